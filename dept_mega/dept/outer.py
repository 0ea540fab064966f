"""Outer optimizers and the synchronisation of a flat parameter buffer across groups.

Pseudo-gradient convention (paper Algorithm 1, DiLoCo): Δ = θ_{t-1} − θ_local, averaged over
the G groups, then the outer optimizer treats the mean Δ as a gradient:

- ``fedavg``:   θ_t = θ_{t-1} − lr·Δ̄                       (lr 1: plain parameter averaging)
- ``nesterov``: b = μ·b + Δ̄;  θ_t = θ_{t-1} − lr·(Δ̄ + μ·b)   (PyTorch SGD, nesterov=True)
- ``adam``:     m = β1·m + (1−β1)·Δ̄;  v = β2·v + (1−β2)·Δ̄²;
                θ_t = θ_{t-1} − lr·(m/(1−β1^t)) / (sqrt(v/(1−β2^t)) + eps)

All state and the update are fp32. :class:`FlatSync` keeps θ_{t-1} as an fp32 copy of the
parameters it owns (this rank's TP/PP shard), and at a round's end:

1. Δ = θ_{t-1} − θ_local (fp32), of which this rank takes its 1/D chunk: the D data-parallel
   replicas of a group hold identical parameters, so each handles one chunk;
2. all-reduce of the chunk over ``pg.outer`` (in ``dept.outer_comm_dtype``), divided by G;
3. the outer optimizer updates the chunk of θ (state exists for the chunk only);
4. all-gather of the updated chunks over ``pg.dp`` (fp32, category ``dp``) and copy into
   the parameters.

With half-precision weights the fp32 values to read and write are the optimizer's master
copies: a FlatSync built with ``main_params`` / ``refresh`` (``Trainer.main_params`` and
``Trainer.refresh_model_params``) reads θ_local from and writes θ_t into those, then refreshes
the model's weights; without them it works on the parameters themselves (fp32 weights).
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

import torch

from ..parallel.comm import group_size

COMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class OuterOptimizer:
    """One outer optimizer over one flat fp32 buffer (in place)."""

    def __init__(self, name: str, lr: float = 1.0, momentum: float = 0.0,
                 betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        if name not in ("fedavg", "nesterov", "adam"):
            raise ValueError(f"dept.outer_optimizer.name: unknown outer optimizer {name!r} "
                             "(fedavg | nesterov | adam)")
        self.name, self.lr, self.momentum = name, float(lr), float(momentum)
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.steps = 0
        self.state: dict[str, torch.Tensor] = {}

    @classmethod
    def from_config(cls, oc) -> "OuterOptimizer":
        return cls(oc.name, oc.lr, oc.momentum, oc.betas, oc.eps)

    def ensure_state(self, like: torch.Tensor) -> None:
        """Allocate the state now (zeros; what the first step would start from), so that a
        checkpoint can load into it in place."""
        names = {"fedavg": (), "nesterov": ("momentum",), "adam": ("exp_avg", "exp_avg_sq")}[self.name]
        for n in names:
            if n not in self.state:
                self.state[n] = torch.zeros_like(like, dtype=torch.float32)

    @torch.no_grad()
    def step(self, theta: torch.Tensor, delta: torch.Tensor) -> None:
        """θ ← update(θ, Δ̄); both fp32 and of the same shape."""
        if theta.dtype != torch.float32 or delta.dtype != torch.float32:
            raise TypeError("outer optimizer works on fp32 buffers")
        self.ensure_state(theta)
        self.steps += 1
        if self.name == "fedavg":
            theta.add_(delta, alpha=-self.lr)
        elif self.name == "nesterov":
            buf = self.state["momentum"]  # zeros before the first step: b = Δ̄ then
            buf.mul_(self.momentum).add_(delta)
            theta.add_(delta + self.momentum * buf, alpha=-self.lr)
        else:
            b1, b2 = self.betas
            m = self.state["exp_avg"]
            v = self.state["exp_avg_sq"]
            m.mul_(b1).add_(delta, alpha=1 - b1)
            v.mul_(b2).addcmul_(delta, delta, value=1 - b2)
            m_hat = m / (1 - b1 ** self.steps)
            v_hat = v / (1 - b2 ** self.steps)
            theta.add_(m_hat / (v_hat.sqrt() + self.eps), alpha=-self.lr)

    def state_dict(self) -> dict:
        return {"steps": self.steps, "state": {k: v.clone() for k, v in self.state.items()}}

    def load_state_dict(self, sd: dict) -> None:
        self.steps = int(sd["steps"])
        self.state = {k: v.clone() for k, v in sd["state"].items()}


def flatten_fp32(params: Sequence[torch.Tensor]) -> torch.Tensor:
    if not params:
        return torch.zeros(0, dtype=torch.float32)
    return torch.cat([p.detach().reshape(-1).to(torch.float32) for p in params])


def chunk_bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of chunk ``index`` when n elements are split into ``parts`` near-equal chunks."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


class FlatSync:
    """Outer synchronisation of a list of parameters held by this rank (see module doc)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], pg, optimizer: OuterOptimizer,
                 category: str = "outer_body", comm_dtype: str = "fp32",
                 main_params: Optional[Callable[[Sequence[torch.nn.Parameter]], list[torch.Tensor]]] = None,
                 refresh: Optional[Callable[[Sequence[torch.nn.Parameter]], None]] = None) -> None:
        self.params = list(params)
        self._main_params = main_params
        self._refresh = refresh
        self.pg = pg
        self.category = category
        if comm_dtype not in COMM_DTYPES:
            raise ValueError(f"dept.outer_comm_dtype: {comm_dtype!r} is not fp32 | bf16")
        self.comm_dtype = COMM_DTYPES[comm_dtype]
        self.optimizer = optimizer
        self.numel = sum(p.numel() for p in self.params)
        D = pg.dp_size
        self.bounds = [chunk_bounds(self.numel, D, d) for d in range(D)]
        self.start, self.end = self.bounds[pg.dp_rank]
        self.theta_prev = flatten_fp32(self.values())  # θ_{t-1}, full (fp32)
        self.optimizer.ensure_state(self.theta_prev[self.start:self.end])

    def values(self) -> list[torch.Tensor]:
        """The fp32 tensors holding the parameters' values (the masters of half weights)."""
        return self._main_params(self.params) if self._main_params is not None else self.params

    @torch.no_grad()
    def sync(self) -> None:
        if self.numel == 0:
            # e.g. GLOB embeddings on a middle pipeline stage: every member of this rank's outer
            # and dp groups has the same (empty) share, so nobody communicates. (A collective on
            # the empty CPU buffer would fail under NCCL, which takes CUDA tensors only.)
            return
        pg = self.pg
        G = group_size(pg.outer)
        s, e = self.start, self.end
        values = self.values()
        local = flatten_fp32(values)
        delta = self.theta_prev[s:e] - local[s:e]
        if G > 1:
            wire = delta.to(self.comm_dtype) if self.comm_dtype != torch.float32 else delta
            pg.comm.all_reduce(wire, pg.outer, category=self.category)
            delta = wire.to(torch.float32).div_(G)
        theta = self.theta_prev[s:e].clone()
        self.optimizer.step(theta, delta)
        full = self.theta_prev  # overwritten with θ_t
        if group_size(pg.dp) > 1:
            shards = [torch.empty(b - a, dtype=torch.float32, device=theta.device) for a, b in self.bounds]
            pg.comm.all_gather_list(shards, theta, pg.dp, category="dp")
            full = torch.cat(shards)
        else:
            full = theta
        self.theta_prev = full.clone()
        offset = 0
        for v in values:
            n = v.numel()
            v.data.copy_(full[offset:offset + n].view_as(v).to(v.dtype))
            offset += n
        if self._refresh is not None:
            self._refresh(self.params)

    def param_state(self) -> dict:
        """Checkpoint view, independent of how the state is held: {"steps": n, "reference": [θ_{t-1}
        of each parameter in ``self.params`` order, fp32, shaped like it], and one such list per
        outer-optimizer state ("momentum" | "exp_avg", "exp_avg_sq")}, full over ``pg.dp`` (the
        optimizer chunks are gathered: a collective over ``pg.dp``, category ``dp``)."""
        def split(flat):
            out, off = [], 0
            for p in self.params:
                out.append(flat[off:off + p.numel()].view(p.shape).clone())
                off += p.numel()
            return out
        out = {"steps": self.optimizer.steps, "reference": split(self.theta_prev)}
        for name, chunk in sorted(self.optimizer.state.items()):
            full = chunk
            if group_size(self.pg.dp) > 1 and self.numel:
                shards = [torch.empty(b - a, dtype=torch.float32, device=chunk.device) for a, b in self.bounds]
                self.pg.comm.all_gather_list(shards, chunk.contiguous(), self.pg.dp, category="dp")
                full = torch.cat(shards)
            out[name] = split(full)
        return out

    def load_param_state(self, state: dict) -> None:
        """Inverse of :meth:`param_state` (full over ``pg.dp``); keeps this rank's chunk of the
        optimizer state."""
        self.theta_prev = flatten_fp32(state["reference"]).to(self.theta_prev.device)
        if self.theta_prev.numel() != self.numel:
            raise ValueError(f"outer state holds {self.theta_prev.numel()} values, expected {self.numel}")
        self.optimizer.steps = int(state["steps"])
        self.optimizer.state = {n: flatten_fp32(v)[self.start:self.end].to(self.theta_prev.device).clone()
                                for n, v in state.items() if n not in ("steps", "reference")}

    def state_dict(self) -> dict:
        return {"theta_prev": self.theta_prev.clone(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        if sd["theta_prev"].numel() != self.numel:
            raise ValueError(f"outer state holds {sd['theta_prev'].numel()} values, expected {self.numel}")
        self.theta_prev = sd["theta_prev"].clone().to(torch.float32)
        self.optimizer.load_state_dict(sd["optimizer"])
