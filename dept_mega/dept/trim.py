"""TRIM: the global embedding table φ outside the groups' models, and its sparse row updates.

φ (fp32, [|V|, d]) is held on CPU (``dept.trim_table_device: cpu``) by the ranks that hold a
part of the token embedding or of the untied head, its rows sharded over the stage's tensor ×
data-parallel ranks (:class:`TrimTable`). At a round's start a group copies the
rows V_k of its source into its compact embedding (``gather``); at the round's end each rank
computes the pseudo-gradient of the compact rows it owns, Δ_r = φ_r − local_r, and only
those rows and their global ids cross groups (:func:`exchange_rows`). Every rank then applies
the same update (:meth:`TrimTable.apply`): each row held by at least one group takes the mean
Δ over the groups that hold it as its pseudo-gradient, and the configured outer optimizer
(``dept.outer_optimizer``, as for the body) moves the row; rows held by no group stay as
they were, and so does their optimizer state.

The outer optimizer's state lives here, next to φ, per row (:class:`RowOuterOptimizer`):
``momentum`` (nesterov) or ``exp_avg``/``exp_avg_sq`` (adam) of φ's shape, and for adam a
step count per row (a row's bias correction counts the rounds in which some group held it).
Updates touch the held rows only (sparse). ``fedavg`` keeps no state: φ_r ← φ_r − lr·mean Δ_r
in one fused op (lr 1 = the plain row mean).

:func:`row_mean_update_dense` is the dense |V|×d reference used by the tests only.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from ..ops import VocabRanks, gather_rows, remap_ids, scatter_mean_rows
from ..parallel.comm import CrossJob, group_size
from .outer import COMM_DTYPES, chunk_bounds

OUTER_OPTIMIZERS = ("fedavg", "nesterov", "adam")


class RowOuterOptimizer:
    """The outer optimizer over the rows of one table, with state per row (sparse updates).

    Same rules as :class:`dept_mega.dept.outer.OuterOptimizer`, applied to each held row r
    with its mean pseudo-gradient Δ̄_r:
    ``fedavg``: φ_r ← φ_r − lr·Δ̄_r; ``nesterov``: b_r ← μ·b_r + Δ̄_r, φ_r ← φ_r − lr·(Δ̄_r + μ·b_r);
    ``adam``: t_r ← t_r + 1, m_r, v_r as Adam, φ_r ← φ_r − lr·m̂_r/(sqrt(v̂_r) + eps) with the
    bias corrections of t_r. All fp32 (step counts int64)."""

    def __init__(self, name: str = "fedavg", lr: float = 1.0, momentum: float = 0.0,
                 betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        if name not in OUTER_OPTIMIZERS:
            raise ValueError(f"dept.outer_optimizer.name: unknown outer optimizer {name!r} "
                             f"({' | '.join(OUTER_OPTIMIZERS)})")
        self.name, self.lr, self.momentum = name, float(lr), float(momentum)
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.state: dict[str, torch.Tensor] = {}

    @classmethod
    def from_config(cls, oc) -> "RowOuterOptimizer":
        return cls(oc.name, oc.lr, oc.momentum, oc.betas, oc.eps)

    def ensure_state(self, table: torch.Tensor) -> None:
        """Allocate the per-row state (zeros: what the first update of a row starts from)."""
        shapes = {"fedavg": {}, "nesterov": {"momentum": torch.float32},
                  "adam": {"exp_avg": torch.float32, "exp_avg_sq": torch.float32, "steps": torch.int64}}[self.name]
        for n, dtype in shapes.items():
            if n not in self.state:
                shape = table.shape[:1] if n == "steps" else table.shape
                self.state[n] = torch.zeros(shape, dtype=dtype, device=table.device)

    @torch.no_grad()
    def apply(self, table: torch.Tensor, ids: torch.Tensor, deltas: torch.Tensor) -> None:
        """Update ``table`` in place from the contributions (ids may repeat, once per group)."""
        if ids.numel() == 0:
            return
        ids = ids.to(table.device, torch.int64)
        deltas = deltas.to(table.device, torch.float32)
        if self.name == "fedavg":
            # fused: table[r] += (−lr)·mean Δ_r (lr 1: exactly the plain row mean)
            scatter_mean_rows(table, ids, deltas, accumulate=True, alpha=-self.lr)
            return
        self.ensure_state(table)
        rows, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        mean = torch.zeros(rows.numel(), table.shape[1], dtype=torch.float32, device=table.device)
        scatter_mean_rows(mean, inverse, deltas)
        theta = table.index_select(0, rows)
        if self.name == "nesterov":
            buf = self.state["momentum"].index_select(0, rows)
            buf.mul_(self.momentum).add_(mean)
            theta.add_(mean + self.momentum * buf, alpha=-self.lr)
            self.state["momentum"].index_copy_(0, rows, buf)
        else:
            b1, b2 = self.betas
            steps = self.state["steps"].index_select(0, rows) + 1
            m = self.state["exp_avg"].index_select(0, rows)
            v = self.state["exp_avg_sq"].index_select(0, rows)
            m.mul_(b1).add_(mean, alpha=1 - b1)
            v.mul_(b2).addcmul_(mean, mean, value=1 - b2)
            t = steps.to(torch.float64).unsqueeze(1)
            bc1 = (1 - torch.pow(b1, t)).to(torch.float32)
            bc2 = (1 - torch.pow(b2, t)).to(torch.float32)
            theta.add_((m / bc1) / ((v / bc2).sqrt() + self.eps), alpha=-self.lr)
            self.state["steps"].index_copy_(0, rows, steps)
            self.state["exp_avg"].index_copy_(0, rows, m)
            self.state["exp_avg_sq"].index_copy_(0, rows, v)
        table.index_copy_(0, rows, theta)

    def state_dict(self) -> dict:
        return {"name": self.name, "state": {k: v.clone() for k, v in self.state.items()}}

    def load_state_dict(self, sd: dict, table: torch.Tensor) -> None:
        if sd.get("name") != self.name:
            raise ValueError(f"dept.outer_optimizer.name: the checkpoint's TRIM row state is for "
                             f"{sd.get('name')!r}, this run uses {self.name!r}")
        self.state = {}
        self.ensure_state(table)
        for k, v in self.state.items():
            if k not in sd["state"] or tuple(sd["state"][k].shape) != tuple(v.shape):
                raise ValueError(f"TRIM row state {k!r}: expected shape {tuple(v.shape)} in the checkpoint")
            v.copy_(sd["state"][k])


class TrimTable:
    """φ: the global fp32 table (token embedding, or the untied head) and the outer optimizer
    state of its rows, row-sharded over ``parts`` ranks (issue 10's lean DEPT state).

    Rank ``index`` of ``group`` (TrimStrategy: the stage's tensor × data-parallel ranks,
    ``pg.tp_dp``) holds rows ``chunk_bounds(|V|, parts, index)`` of φ (``weight``, with
    ``row_start``/``row_end``) and their per-row optimizer state; no rank holds the whole
    table when ``parts`` > 1. The calls below are collective over ``group`` when ``parts`` > 1
    (every rank of the group calls them with the same ``ids``):

    * :meth:`gather` — the rows ``ids`` of φ on every rank: each rank fills the rows it owns
      into a zero buffer and the buffers are summed over the group as int32 bit patterns
      (exact: one non-zero pattern per row, -0.0 and NaN included; ``pg.comm`` category ``dp``,
      |ids|·d·4 bytes per rank);
    * :meth:`full_table` — the whole φ (all-gather of the shards, category ``dp``).

    :meth:`apply` is local: every rank receives all groups' (ids, Δ) (``exchange_rows``) and
    updates the rows it owns, in the same order as an unsharded table would (bit-identical).
    ``parts`` = 1 (the default) is the unsharded table of one rank."""

    def __init__(self, weight: torch.Tensor, device: str | torch.device = "cpu",
                 optimizer: Optional[RowOuterOptimizer] = None, pg=None, group=None,
                 index: int = 0, parts: int = 1) -> None:
        self.rows_total = int(weight.shape[0])
        self.pg, self.group = pg, group
        self.index, self.parts = int(index), int(parts)
        if self.parts > 1 and (pg is None or group_size(group) != self.parts):
            raise ValueError(f"TRIM table sharded {self.parts} ways needs a group of {self.parts} ranks")
        self.row_start, self.row_end = chunk_bounds(self.rows_total, self.parts, self.index)
        self.weight = weight.detach()[self.row_start:self.row_end].to(device=device, dtype=torch.float32).clone()
        self.optimizer = optimizer if optimizer is not None else RowOuterOptimizer()
        self.optimizer.ensure_state(self.weight)

    @property
    def vocab_size(self) -> int:
        return self.rows_total

    @property
    def sharded(self) -> bool:
        return self.parts > 1

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of φ (collective when sharded, see the class doc)."""
        ids = ids.to(self.weight.device, torch.int64)
        if not self.sharded:
            return gather_rows(self.weight, ids)
        mine = (ids >= self.row_start) & (ids < self.row_end)
        out = torch.zeros(ids.numel(), self.weight.shape[1], dtype=torch.float32, device=self.weight.device)
        out[mine] = gather_rows(self.weight, ids[mine] - self.row_start)
        bits = out.view(torch.int32)
        self.pg.comm.all_reduce(bits, self.group, category="dp")
        return bits.view(torch.float32)

    def full_table(self) -> torch.Tensor:
        """The whole φ [|V|, d] on every rank of the group (collective when sharded)."""
        if not self.sharded:
            return self.weight.clone()
        bounds = [chunk_bounds(self.rows_total, self.parts, i) for i in range(self.parts)]
        largest = max(e - s for s, e in bounds)
        d = self.weight.shape[1]
        mine = torch.zeros(largest, d, dtype=torch.float32, device=self.weight.device)
        mine[:self.weight.shape[0]] = self.weight
        parts = [torch.empty(largest, d, dtype=torch.float32, device=self.weight.device) for _ in bounds]
        self.pg.comm.all_gather_list(parts, mine, self.group, category="dp")
        return torch.cat([t[:e - s] for t, (s, e) in zip(parts, bounds)])

    @torch.no_grad()
    def apply(self, ids: torch.Tensor, deltas: torch.Tensor) -> None:
        """One round's update from every group's (global ids, Δ rows): the rows this rank owns."""
        if self.sharded:
            ids = ids.to(torch.int64)
            mine = (ids >= self.row_start) & (ids < self.row_end)
            ids, deltas = ids[mine] - self.row_start, deltas[mine.to(deltas.device)]
        self.optimizer.apply(self.weight, ids, deltas)

    def state_dict(self) -> dict:
        """This rank's rows: ``weight`` [row_end − row_start, d], ``optimizer`` (per-row state of
        those rows) and ``rows`` = [row_start, row_end, |V|]."""
        return {"weight": self.weight.clone(), "optimizer": self.optimizer.state_dict(),
                "rows": [self.row_start, self.row_end, self.rows_total]}

    def _mine(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """``t`` as this rank's rows: taken as is when it has them, sliced from a whole table."""
        n = self.row_end - self.row_start
        if t.shape[0] == n:
            return t
        if t.shape[0] == self.rows_total:
            return t[self.row_start:self.row_end]
        raise ValueError(f"TRIM table: checkpoint {what} has {t.shape[0]} rows, expected {n} (this rank's "
                         f"rows {self.row_start}-{self.row_end}) or the whole table's {self.rows_total}")

    def load_state_dict(self, sd: dict) -> None:
        """Loads a state of this rank's rows or of the whole table (an unsharded run's)."""
        rows = sd.get("rows")
        if rows is not None and sd["weight"].shape[0] != self.rows_total \
                and list(rows) != [self.row_start, self.row_end, self.rows_total]:
            raise ValueError(f"TRIM table: checkpoint holds rows {rows[0]}-{rows[1]} of {rows[2]}, this rank "
                             f"owns {self.row_start}-{self.row_end} of {self.rows_total} (same layout needed)")
        weight = self._mine(sd["weight"], "weight")
        if tuple(weight.shape[1:]) != tuple(self.weight.shape[1:]):
            raise ValueError(f"TRIM table: checkpoint shape {tuple(sd['weight'].shape)}, "
                             f"expected rows of {tuple(self.weight.shape[1:])}")
        self.weight.copy_(weight)
        opt = dict(sd["optimizer"])
        opt["state"] = {k: self._mine(v, f"row state {k!r}") for k, v in opt.get("state", {}).items()}
        self.optimizer.load_state_dict(opt, self.weight)


@torch.no_grad()
def row_mean_update(table: torch.Tensor, ids: torch.Tensor, deltas: torch.Tensor) -> None:
    """table[r] -= mean of the rows of ``deltas`` whose id is r (ids may repeat across groups).

    Sparse: work and memory are O(len(ids)·d), never O(|V|·d): the fused
    ``dept_mega.ops.scatter_mean_rows`` (accumulate, alpha −1; its PyTorch fallback gives the
    same values). The ``fedavg``, lr 1 case of :class:`RowOuterOptimizer`."""
    if ids.numel() == 0:
        return
    scatter_mean_rows(table, ids.to(table.device, torch.int64), deltas.to(table.device, torch.float32),
                      accumulate=True, alpha=-1.0)


@torch.no_grad()
def row_mean_update_dense(table: torch.Tensor, contributions: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Dense reference of :func:`row_mean_update` (tests): |V|×d sums and |V| counts."""
    sums = torch.zeros_like(table, dtype=torch.float32)
    counts = torch.zeros(table.shape[0], dtype=torch.float32, device=table.device)
    for ids, delta in contributions:
        sums.index_add_(0, ids, delta.to(torch.float32))
        counts.index_add_(0, ids, torch.ones(ids.numel(), dtype=torch.float32, device=table.device))
    held = counts > 0
    table[held] = table[held] - sums[held] / counts[held][:, None]


def _all_gather_var(pg, group, ids: torch.Tensor, rows: torch.Tensor, category: str,
                    comm_dtype, quant_block: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather variable-length (ids [n], rows [n, d]) over ``group``: concatenated in group-rank order.

    gloo and NCCL all-gather equal sizes only, so every rank pads its part to the largest
    count of the group (one int64 count per rank is gathered first); the padding is real
    traffic and is counted. Ids and rows travel in one buffer per rank when the wire dtype is
    fp32 (ids as two int32 halves would be lossy in bf16, so bf16 sends ids separately)."""
    n = group_size(group)
    if n == 1:
        return ids, rows
    d = rows.shape[1]
    dev = rows.device
    count = torch.tensor([ids.numel()], dtype=torch.int64, device=dev)
    all_counts = torch.zeros(n, dtype=torch.int64, device=dev)
    pg.comm.all_gather_into(all_counts, count, group, category=category)
    sizes = [int(c) for c in all_counts.tolist()]
    m = max(sizes)
    id_buf = torch.zeros(m, dtype=torch.int64, device=dev)
    id_buf[:ids.numel()] = ids.to(dev, torch.int64)
    id_out = torch.empty(n * m, dtype=torch.int64, device=dev)
    pg.comm.all_gather_into(id_out, id_buf, group, category=category)
    if isinstance(comm_dtype, str):  # fp8 | int8 | int4: block-quantised (quant.py), fp32 decode
        from .quant import decode, encode
        flat = torch.zeros(m * d, dtype=torch.float32, device=dev)
        flat[:rows.numel()] = rows.reshape(-1).to(torch.float32)
        packed = encode(flat, comm_dtype, quant_block)
        packed_out = torch.empty(n * packed.numel(), dtype=torch.uint8, device=dev)
        pg.comm.all_gather_into(packed_out, packed, group, category=category)
        size = packed.numel()
        row_out = torch.stack([decode(packed_out[i * size:(i + 1) * size], m * d, comm_dtype, quant_block)
                               for i in range(n)])
    else:
        row_buf = torch.zeros(m * d, dtype=comm_dtype, device=dev)
        row_buf[:rows.numel()] = rows.reshape(-1).to(comm_dtype)
        row_out = torch.empty(n * m * d, dtype=comm_dtype, device=dev)
        pg.comm.all_gather_into(row_out, row_buf, group, category=category)
    id_out = id_out.view(n, m)
    row_out = row_out.view(n, m, d)
    out_ids = torch.cat([id_out[i, :sizes[i]] for i in range(n)])
    out_rows = torch.cat([row_out[i, :sizes[i]] for i in range(n)]).to(torch.float32)
    return out_ids, out_rows


def exchange_rows(pg, ids: torch.Tensor, deltas: torch.Tensor, *, comm_dtype: str = "fp32",
                  tp_split: bool = True, quant_block: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Every group's (global ids, Δ rows), on every rank, in a deterministic order.

    ``ids``/``deltas``: the rows this rank's TP slice of the compact table owns (``tp_split``)
    or the whole compact table (``tp_split=False``, e.g. a replicated table). The D replicas
    of a group split the rows: replica d sends its 1/D chunk across groups over ``pg.outer``
    (category ``outer_embedding``: only trimmed rows and their ids cross groups); the result
    is then re-gathered inside the group over ``pg.dp`` (``dp``) and, for TP slices, ``pg.tp``
    (``tp``) so that every rank can update its copy of φ.
    """
    from .quant import QUANT_FORMATS
    if comm_dtype not in COMM_DTYPES and comm_dtype not in QUANT_FORMATS:
        raise ValueError(f"dept.outer_comm_dtype: {comm_dtype!r} is not fp32 | bf16 | fp8 | int8 | int4")
    dtype = COMM_DTYPES.get(comm_dtype, comm_dtype)
    s, e = chunk_bounds(ids.numel(), pg.dp_size, pg.dp_rank)
    my_ids, my_rows = ids[s:e], deltas[s:e].to(torch.float32)

    def across() -> tuple[torch.Tensor, torch.Tensor]:
        return _all_gather_var(pg, pg.outer, my_ids, my_rows, "outer_embedding", dtype, quant_block)

    # federated groups: the counts, ids and rows are one exchange, redone whole if a group fails
    g_ids, g_rows = pg.outer.atomic(across, pg.comm) if isinstance(pg.outer, CrossJob) else across()
    # inside the group: fp32 (already rounded to the wire dtype where that applies)
    g_ids, g_rows = _all_gather_var(pg, pg.dp, g_ids, g_rows, "dp", torch.float32)
    if tp_split:
        g_ids, g_rows = _all_gather_var(pg, pg.tp, g_ids, g_rows, "tp", torch.float32)
    return g_ids, g_rows


def remap_ranks(vocab_ids: torch.Tensor, vocab_size: int) -> VocabRanks:
    """Global→local id map of V_k: the rank of v in ``vocab_ids`` (sorted, unique), "not in V_k"
    elsewhere, as ``VocabRanks`` (ceil(V / 32) words; the remap of the equivalent lookup table,
    without its random reads: ``dept_mega.ops.ranks``)."""
    return VocabRanks.from_ids(vocab_ids, vocab_size)


def remap_tokens(tokens: torch.Tensor, ranks: Union[VocabRanks, torch.Tensor],
                 source: Optional[str] = None) -> torch.Tensor:
    """Map global token ids to compact ids (``dept_mega.ops.remap_ids``; ``ranks`` from
    ``remap_ranks``, or a lookup table); every error the remap raises names the source: an id
    outside V_k (ValueError: its V_k does not match its data), an id outside the global
    vocabulary (IndexError), a bad argument (the remap's own ValueError / TypeError). On CUDA an
    invalid id is reported later, by ``dept_mega.ops.check_errors`` (without the source)."""
    try:
        return remap_ids(tokens, ranks)
    except IndexError as exc:
        raise IndexError(f"TRIM: source {source!r}: a token id is outside the global vocabulary ({exc})") from exc
    except ValueError as exc:
        what = "a token id is not in its vocabulary set V_k" if "not in this source's vocabulary" in str(exc) else "remap"
        raise ValueError(f"TRIM: source {source!r}: {what} ({exc})") from exc
    except TypeError as exc:
        raise TypeError(f"TRIM: source {source!r}: remap ({exc})") from exc
