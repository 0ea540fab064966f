"""Loading the round driver's checkpoint state (``DeptHooks.state_dict``) saved under another
layout: another data-parallel size or distributed-optimizer layout (the replicas' states
joined, ``dp_joined_state``), another tensor / pipeline layout (``resharded_state``,
``repartitioned_state``, ``rank_resharded_state``), and the capability predicates
(``hook_state_*``) ``dept_mega.checkpoint.check_layout`` asks before choosing a load.

:class:`HookStateLoads` is a base class of :class:`~dept_mega.dept.driver.DeptHooks` and uses
its attributes (``cfg``, ``pg``, ``trainer``, ``strategy``, ``per_source``, ``body_per_source``)
and methods (``load_state_dict``, ``_fresh_state``); it holds no state of its own. It is kept
apart from the driver, which drives rounds.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch

from .chunk_buffers import CHUNK_BUFFERS, missing_chunk_buffer, refuse_chunk_buffers
from .store import SourceState


class _AtStage(Mapping):
    """``sds[(tp, dp)]`` of one pipeline stage seen as ``[(tp, dp, pp)]`` (the keys of
    ``VariantStrategy.joined_state``); values read on access."""

    def __init__(self, sds: Mapping, pp: int) -> None:
        self._sds, self._pp = sds, pp

    def __getitem__(self, key):
        t, d, p = key
        if p != self._pp:
            raise KeyError(key)
        return self._sds[(t, d)]

    def __iter__(self):
        return ((t, d, self._pp) for t, d in self._sds)

    def __len__(self) -> int:
        return len(self._sds)


class HookStateLoads:
    """The driver's loads of hook state saved under another layout (see the module docstring)."""

    def state_replicated_over_dp(self) -> bool:
        """True when :meth:`state_dict` is the same on the D data-parallel replicas of a group
        (per-source embeddings and their AdamW state are replicated; the distributed
        optimizer's shards and TRIM's row state are not): the checkpoint then stores it once
        per (tp, pp, group) and it loads under another ``parallel.data``."""
        # (with the distributed optimizer the optimizer states kept per source are its per-rank
        # shards; the error-feedback residuals and the eager start's estimates, a chunk per rank,
        # are not in this state: dept_mega.checkpoint_state saves them per parameter and group)
        sharded_sources = self.cfg.optim.distributed and (self.strategy.source_embeddings or self.body_per_source)
        return self.strategy.name != "trim" and not sharded_sources

    def hook_state_dp_joinable(self) -> bool:
        """True when per-rank hook state saved under another ``parallel.data`` (same tensor and
        pipeline layout) can be joined by :meth:`load_state_dict_dp_joined`: TRIM, whose φ is
        row-sharded over the stage's tensor × data-parallel ranks, every variant's
        error-feedback residuals and the eager start's estimates in checkpoints that kept them
        in the hook files (``dept.outer_error_feedback``, ``dept.outer_overlap_rule: eager``: a
        chunk of each FlatSync per replica; later ones save them per parameter) and the
        distributed optimizer's shards in the per-source optimizer states
        (:meth:`hook_state_redistributable`)."""
        return True

    def hook_state_redistributable(self) -> bool:
        """True when the per-source optimizer states of :meth:`state_dict` (a source's embedding
        optimizer; the body's with ``dept.body_optimizer_state: source``) load under another
        distributed-optimizer layout — another data-parallel or bucket size, the distributed
        optimizer switched on or off — through :meth:`load_state_dict_dp_joined` (and
        :meth:`dp_joined_state` for :meth:`load_regrouped`): the old data-parallel ranks' pieces
        are joined and this rank's cut (``optim_reshard.redistribute_state_dict``); TRIM's φ
        rows are joined beside them (``VariantStrategy.joined_state``)."""
        return True

    def load_state_dict_dp_joined(self, sds: dict) -> None:
        """:meth:`load_state_dict` from ``sds[(tp, dp)]``, the hook states saved by every rank of
        this rank's (pipeline stage, group) under another data-parallel size (or, saved once
        per (tp, pp, group), data-parallel rank 0's only): TRIM's row-sharded φ and chunked
        outer state joined (``VariantStrategy.joined_state``) and cut here, and the rest as
        :meth:`dp_joined_state` says."""
        self.load_state_dict(self.dp_joined_state(sds))

    def dp_joined_state(self, sds: dict, strategy_state: bool = True) -> dict:
        """This rank's :meth:`state_dict` from ``sds[(tp, dp)]``, the hook states saved by the
        data-parallel ranks at this rank's tensor position (and pipeline stage) of one group
        under another data-parallel size or distributed-optimizer layout: the replicated part
        from data rank 0's (TRIM's φ joined from every (tp, dp) file of the stage), the
        error-feedback residuals and eager estimates (CHUNK_BUFFERS) joined from the old
        replicas' chunks (near-equal, in data-parallel order) and cut into this rank's chunk,
        every per-source optimizer state joined from the old replicas' pieces and cut for this
        rank's optimizers (:meth:`hook_state_redistributable`). ``strategy_state=False``: the
        strategy's own state (TRIM's φ, ``STATE_KEYS``) is left out, and ``sds`` needs only
        this rank's tensor position (:meth:`load_regrouped` takes it from old group 0 alone)."""
        tp = self.pg.tp_rank
        mine = sds[(tp, 0)]
        old = sorted(d for t, d in sds if t == tp)
        if not strategy_state:
            sd = {k: v for k, v in mine.items() if k not in self.strategy.STATE_KEYS}
        else:  # the strategy's own state whole (TRIM: φ's row shards, the positions' chunked outer state)
            sd = dict(mine)
            sd.update(self.strategy.joined_state(_AtStage(sds, self.pg.pp_rank)))
        if self.per_source:
            replicas = [sds[(tp, d)] for d in old]
            self._same_sources(replicas)
            sd["store"] = {n: self._redistributed(n, [x["store"][n] for x in replicas]) for n in mine["store"]}
            if mine.get("installed_state") is not None:
                sd["installed_state"] = self._redistributed(mine["installed"], [x["installed_state"] for x in replicas])
        syncs = self.outer_syncs()
        for entry, attr in CHUNK_BUFFERS.items():
            joined = {}
            for k in mine.get(entry) or {}:
                if k not in syncs or getattr(syncs[k], attr) is None:
                    raise missing_chunk_buffer(entry, attr, k)
                full = torch.cat([sds[(tp, d)][entry][k].reshape(-1) for d in old])
                if full.numel() != syncs[k].numel:
                    raise ValueError(f"outer {attr} {k!r}: the old replicas' chunks hold {full.numel()} values, "
                                     f"the shard {syncs[k].numel}")
                joined[k] = syncs[k].cut_chunk(full)
            if joined:
                sd[entry] = joined
        return sd

    def _redistributed(self, name: str, payloads: list[dict]) -> dict:
        """Source ``name``'s state payload (:func:`~dept_mega.dept.store.state_payload`) for this
        rank from ``payloads``, the old data-parallel replicas' (in data-parallel order): the
        weights as data rank 0 saved them, the embedding optimizer's and the body optimizer's
        state joined and cut for this rank's (``optim_reshard.redistribute_state_dict``)."""
        from ..optim_reshard import redistribute_state_dict
        first = payloads[0]
        sharded = any(isinstance(p.get(k), dict) and "shard" in p[k] for p in payloads
                      for k in ("optimizer", "body_optimizer"))
        if not sharded and not self.cfg.optim.distributed:
            return first  # the plain optimizer on both sides: the replicas' states are the same
        out = {k: v for k, v in first.items() if k != "param_names"}  # the names are the old pieces'
        if first.get("optimizer") is not None:
            opt = self._fresh_state(name).optimizer
            out["optimizer"] = redistribute_state_dict([p["optimizer"] for p in payloads], opt,
                                                       f"source {name!r}: embedding optimizer")
        if first.get("body_optimizer") is not None:
            out["body_optimizer"] = redistribute_state_dict([p["body_optimizer"] for p in payloads],
                                                            self.trainer.body_optimizer,
                                                            f"source {name!r}: body optimizer")
        return out

    def hook_state_reshardable(self) -> bool:
        """True when :meth:`state_dict` is the same at every (tp, pp) position, so that a
        checkpoint loads under another tensor / pipeline size (``dept_mega.reshard``): no
        per-source state (GLOB with the body's optimizer state per group; the outer state is
        under ``dept/...`` keys) and replicated over data parallelism."""
        return not self.per_source and self.strategy.name != "trim" and self.state_replicated_over_dp()

    def hook_state_tensor_reshardable(self) -> bool:
        """True when the per-source hook state saved once per (tp, pp, group) (``hooks_dp0``:
        the plain optimizer) loads under another tensor-parallel size
        (:meth:`load_state_dict_resharded`, same pipeline layout) and, from a checkpoint that
        saved the parameter names of its optimizer states (``layout.json``:
        ``hooks_param_names``), under another pipeline / virtual-pipeline size or into the
        distributed optimizer (:meth:`load_state_dict_repartitioned`, which cuts this rank's
        pieces): SPEC / SPEC-OPT, whose per-source embeddings and AdamW states are found by
        name whatever stage held them, and GLOB with ``dept.body_optimizer_state: source`` (the
        body's AdamW moments per source, no per-source embeddings). Error-feedback residuals
        and eager estimates are not in this state: saved per parameter and group
        (``outer_group_keys``), they reshard like θ_{t-1}; ``check_layout`` refuses older
        checkpoints that kept them in the hook files."""
        return self.strategy.name in ("spec", "spec_opt") or (self.strategy.name == "glob" and self.body_per_source)

    def hook_state_param_names(self) -> bool:
        """True when :meth:`state_dict` saves, with every per-source optimizer state, the
        global parameter names of its entries (``param_names``; ``layout.json``:
        ``hooks_param_names``)."""
        return self.per_source

    def _global_names(self) -> dict[int, str]:
        """Parameter id → its name in the model chunk (global: ``body.layers.{i}`` carries the
        global layer index), the first chunk's where a parameter is in two."""
        out: dict[int, str] = {}
        for st in self.trainer.stages:
            for n, p in st.named_parameters():
                out.setdefault(id(p), n)
        return out

    def _with_param_names(self, payload: dict, state: SourceState) -> dict:
        """``payload`` with the global names of its optimizer states' entries: per optimizer
        ``{"state": [name of state index i], "params": [name of main_params[j]]}``."""
        def named(opt, names: Optional[dict[int, str]]) -> dict:
            names = opt.names if names is None else names
            return {"state": [n for n, _ in opt.indexed_params(names)],
                    "params": [names[id(opt.params[i])] for i, _, _ in opt.pieces_signature()]}

        out = {}
        if payload.get("optimizer") is not None and state.optimizer is not None:
            out["optimizer"] = named(state.optimizer, None)  # "embeddings.{name}" (Trainer.make_embedding_optimizer)
        if payload.get("body_optimizer") is not None:
            out["body_optimizer"] = named(self.trainer.body_optimizer, self._global_names())
        return dict(payload, param_names=out)

    def _reshard_to(self, parts: list, param, what: str = "") -> torch.Tensor:
        """The saved tensor shards ``parts`` (old tensor ranks 0..T'-1) of a per-source tensor
        joined along ``param``'s partition dimension and cut into this rank's shard
        (``dept_mega.reshard``); scalars, non-tensors and tensors without a parameter as saved."""
        from ..checkpoint_format import cut_shard, join_shards
        if not torch.is_tensor(parts[0]) or parts[0].dim() == 0 or param is None:
            return parts[0]
        dim = getattr(param, "partition_dim", None)
        stride = int(getattr(param, "partition_stride", 1) or 1)
        if parts[0].dim() == 1 and param.dim() > 1:  # flattened (joined distributed-optimizer pieces)
            shape = list(param.shape)
            if dim is not None:
                shape[dim] = -1  # the old shard's extent along the partition dimension
            parts = [x.reshape(shape) for x in parts]
        out = cut_shard(join_shards(list(parts), dim, stride), dim, stride, self.pg.tp_size, self.pg.tp_rank)
        if tuple(out.shape) != tuple(param.shape):
            raise ValueError(f"{what + ': ' if what else ''}resharded to {tuple(out.shape)}, this launch holds "
                             f"{tuple(param.shape)}")
        return out.clone()

    def load_state_dict_repartitioned(self, sds: dict) -> None:
        """:meth:`load_state_dict` of :meth:`repartitioned_state`."""
        self.load_state_dict(self.repartitioned_state(sds))

    def repartitioned_state(self, sds: dict) -> dict:
        """This rank's :meth:`state_dict` from ``sds[(tp, pp)]``, the state dicts saved at every
        (tensor rank, pipeline rank) of this rank's group under another tensor, pipeline and / or
        virtual-pipeline layout (each with the ``param_names`` of :meth:`state_dict`). Per
        source: every embedding tensor this rank's chunks hold is taken from the first old
        (stage, chunk) that held one of that name (a tied head's copy on the last stage
        receives the updates of the first stage's table), its AdamW state and the body's
        (``dept.body_optimizer_state: source``) by the parameter names saved with them; each
        joined over the old tensor ranks along its parameter's partition dimension and cut
        into this rank's shard (``dept_mega.reshard``). ``sds`` may hold only this rank's
        stage (the same pipeline layout). The optimizer states come out for this rank's
        optimizers: the distributed optimizer's pieces are cut from the resharded whole
        (``optim_reshard.redistribute_state_dict``)."""
        for x in sds.values():
            refuse_chunk_buffers(x)
        from ..optim_reshard import groups_like, redistribute_state_dict
        from ..optimizer import state_order
        T = 1 + max(t for t, _ in sds)
        stages = sorted({p for _, p in sds})
        if sorted(sds) != [(t, p) for t in range(T) for p in stages]:
            raise ValueError(f"expected the hook state of every tensor rank of {T} at stages {stages}, "
                             f"got {sorted(sds)}")
        s0 = stages[0]
        first = sds[(0, s0)]

        def holders(parts: dict, kind: str, field: str) -> dict[str, tuple[int, dict]]:
            """name -> (old pipeline rank that held it first, {tensor rank: index there})."""
            out: dict[str, tuple[int, dict]] = {}
            for p in stages:
                for t in range(T):
                    names = (parts[(t, p)].get("param_names") or {}).get(kind)
                    if names is None:
                        raise ValueError(f"the saved {kind} state at tensor rank {t}, pipeline rank {p} has no "
                                         f"parameter names")
                    for i, n in enumerate(names[field]):
                        if n not in out or out[n][0] == p:
                            out.setdefault(n, (p, {}))[1].setdefault(t, i)
            return out

        def optimizer_sd(parts: dict, kind: str, opt, names: Optional[dict[int, str]], source: str) -> Optional[dict]:
            saved = {k: v.get(kind) for k, v in parts.items()}
            if all(v is None for v in saved.values()):
                return None
            if any(v is None for v in saved.values()):
                raise ValueError(f"source {source!r}: its {kind} state was saved at some stages only")
            by_state, by_param = holders(parts, kind, "state"), holders(parts, kind, "params")
            names_of = opt.names if names is None else names
            # the plain optimizer's order of this rank's parameters (the distributed one: cut below)
            plain = [(names_of[id(opt.params[i])], opt.params[i])
                     for i, _, _ in state_order([(i, 0, 0) for i in range(len(opt.params))], opt.params)]
            state = {}
            for j, (n, param) in enumerate(plain):
                if n not in by_state:
                    raise ValueError(f"source {source!r}: no saved stage holds the {kind} state of {n}")
                p, index = by_state[n]
                entries = [saved[(t, p)]["state"].get(index[t]) for t in range(T)]
                if entries[0] is None:
                    continue  # saved without state (never stepped)
                state[j] = {k: self._reshard_to([e[k] for e in entries], param, f"source {source!r}: {kind} {k} of {n}")
                            for k in entries[0]}
            # the hyperparameters (lr, betas, ...) of the saved group with the same weight decay
            groups = groups_like([g for p in stages for g in saved[(0, p)]["param_groups"]], opt)
            out = {k: v for k, v in saved[(0, s0)].items() if k not in ("state", "param_groups", "main_params")}
            out.update(state=state, param_groups=groups)
            if "main_params" in saved[(0, s0)]:
                mains = []
                for param in opt.params:
                    n = names_of[id(param)]
                    if n not in by_param:
                        raise ValueError(f"source {source!r}: no saved stage holds the {kind} master of {n}")
                    p, index = by_param[n]
                    mains.append(self._reshard_to([saved[(t, p)]["main_params"][index[t]] for t in range(T)], param,
                                         f"source {source!r}: {kind} master of {n}"))
                out["main_params"] = mains
            if getattr(opt, "distributed", False):
                out = redistribute_state_dict([out], opt, f"source {source!r}: {kind}")
            return out

        def payload(name: str, parts: dict) -> dict:
            fresh = self._fresh_state(name)
            embs = []
            for c, e in enumerate(fresh.embeddings):
                if e is None:
                    embs.append(None)
                    continue
                held = e.state_dict(keep_vars=True)
                sd = {}
                for k, v in held.items():
                    at = [(p, c0) for p in stages for c0, x in enumerate(parts[(0, p)]["embeddings"])
                          if x is not None and k in x]
                    if not at:
                        raise ValueError(f"source {name!r}: no saved stage holds its embeddings' {k}")
                    p, c0 = at[0]
                    sd[k] = self._reshard_to([parts[(t, p)]["embeddings"][c0][k] for t in range(T)], v,
                                    f"source {name!r}: embeddings' {k}")
                embs.append(sd)
            return {"embeddings": embs,
                    "optimizer": optimizer_sd(parts, "optimizer", fresh.optimizer, None, name)
                    if fresh.optimizer is not None else None,
                    "body_optimizer": optimizer_sd(parts, "body_optimizer", self.trainer.body_optimizer,
                                                   self._global_names(), name),
                    "extra": dict(parts[(0, s0)].get("extra", {}))}

        names = sorted(first["store"])
        for k, x in sds.items():
            if sorted(x["store"]) != names or x.get("installed") != first.get("installed"):
                raise ValueError(f"the hook state at (tensor, pipeline) rank {k} holds other sources "
                                 f"({sorted(x['store'])}, installed {x.get('installed')!r}) than at (0, {s0}) "
                                 f"({names}, installed {first.get('installed')!r})")
        sd = dict(first)
        sd["store"] = {n: payload(n, {k: x["store"][n] for k, x in sds.items()}) for n in names}
        if first.get("installed_state") is not None:
            sd["installed_state"] = payload(first["installed"], {k: x["installed_state"] for k, x in sds.items()})
        return sd

    def load_state_dict_resharded(self, sds: list[dict]) -> None:
        """:meth:`load_state_dict` of :meth:`resharded_state`."""
        self.load_state_dict(self.resharded_state(sds))

    def resharded_state(self, sds: list[dict]) -> dict:
        """This rank's :meth:`state_dict` from the state dicts saved by tensor ranks 0..T'-1 of this
        rank's (pipeline rank, group) under another tensor size T': every per-source tensor
        (embedding weights, their AdamW moments, the body's AdamW moments when kept per source)
        is joined along its parameter's partition dimension and cut into this rank's shard
        (``dept_mega.reshard``)."""

        for x in sds:
            refuse_chunk_buffers(x)

        def optimizer_sd(parts: list[Optional[dict]], opt) -> Optional[dict]:
            if parts[0] is None:
                return None
            mains = {id(opt._main_of(p)): p for p in opt.params}
            order = [mains[id(m)] for g in opt.inner.param_groups for m in g["params"]]
            out = dict(parts[0], state={})
            for i, st in parts[0]["state"].items():
                out["state"][i] = {k: self._reshard_to([sd["state"][i][k] for sd in parts], order[int(i)]) for k in st}
            if "main_params" in parts[0]:
                out["main_params"] = [self._reshard_to([sd["main_params"][j] for sd in parts], p)
                                      for j, p in enumerate(opt.params)]
            return out

        def payload(name: str, parts: list[dict]) -> dict:
            fresh = self._fresh_state(name)
            embs = []
            for c, e in enumerate(fresh.embeddings):
                if parts[0]["embeddings"][c] is None or e is None:
                    embs.append(None)
                    continue
                held = e.state_dict(keep_vars=True)
                embs.append({k: self._reshard_to([p["embeddings"][c][k] for p in parts], held[k])
                             for k in parts[0]["embeddings"][c]})
            return {"embeddings": embs,
                    "optimizer": optimizer_sd([p["optimizer"] for p in parts], fresh.optimizer)
                    if fresh.optimizer is not None else None,
                    "body_optimizer": optimizer_sd([p.get("body_optimizer") for p in parts], self.trainer.body_optimizer),
                    "extra": dict(parts[0].get("extra", {}))}

        sd = dict(sds[0])
        sd["store"] = {n: payload(n, [x["store"][n] for x in sds]) for n in sds[0]["store"]}
        if sds[0].get("installed_state") is not None:
            sd["installed_state"] = payload(sds[0]["installed"], [x["installed_state"] for x in sds])
        return sd

    def hook_state_rank_reshardable(self) -> bool:
        """True when the hook state saved per rank (not once per (tp, pp, group)) loads under
        another tensor, pipeline or virtual-pipeline size, the data-parallel size changing with
        them or not (:meth:`load_state_dict_rank_resharded`): TRIM, whose φ is row-sharded
        over a stage's tp × dp ranks and whose per-source state is replicated over data
        parallelism, and SPEC / SPEC-OPT saved with the distributed optimizer (each source's
        embeddings replicated, its AdamW states and the body's with
        ``dept.body_optimizer_state: source`` in per-rank pieces), the distributed optimizer
        on either side (the per-source pieces joined over the old data-parallel ranks by
        parameter name and cut for this rank's optimizers); GLOB with
        ``dept.body_optimizer_state: source`` and the distributed optimizer (the body's
        per-source pieces) the same. Error-feedback residuals and eager estimates: as
        :meth:`hook_state_tensor_reshardable` says."""
        return self.strategy.name in ("trim", "spec", "spec_opt") or (self.strategy.name == "glob"
                                                                      and self.body_per_source)

    def load_state_dict_rank_resharded(self, sds, staged: bool) -> None:
        """:meth:`load_state_dict` of :meth:`rank_resharded_state`."""
        self.load_state_dict(self.rank_resharded_state(sds, staged))

    def rank_resharded_state(self, sds, staged: bool, strategy_state: bool = True) -> dict:
        """:meth:`load_state_dict` (TRIM; SPEC / SPEC-OPT saved with the distributed optimizer)
        from ``sds[(tp, dp, pp)]``, the state dicts saved by the old ranks of this rank's group
        under another tensor / pipeline / virtual-pipeline (and maybe data-parallel) layout:
        every old rank of every stage when ``staged`` (another pipeline or virtual-pipeline
        size), else of this rank's stage (a mapping that may read its files lazily). The
        per-source state (SPEC's embeddings or TRIM's compact tables, their AdamW state, the
        body's with ``dept.body_optimizer_state: source``) comes from the old data rank 0 files
        and is joined and cut by :meth:`repartitioned_state` by parameter name when
        ``staged``, else :meth:`resharded_state`. With the distributed optimizer on either
        side the per-source optimizer states are joined by parameter name from the pieces of
        every old data rank (:meth:`_plain_payloads`; all files of the stages read), resharded
        by name (:meth:`repartitioned_state`) and cut into this rank's pieces. The strategy's
        own state (``STATE_KEYS``; TRIM: φ, φ_head, their per-row outer state and the learned
        positions' outer state) is joined whole (``joined_state``; SPEC / SPEC-OPT: none) and
        :meth:`load_state_dict` cuts this rank's rows and chunk."""
        T = 1 + max(t for t, _, _ in sds)
        D = 1 + max(d for _, d, _ in sds)
        stages = sorted({p for _, _, p in sds})
        refuse_chunk_buffers(sds[(0, 0, stages[0])])  # every old rank's file holds its chunk, if any
        if self.cfg.optim.distributed or self._has_pieces(sds[(0, 0, stages[0])]):
            sd = self.repartitioned_state({(t, p): self._plain_payloads([sds[(t, d, p)] for d in range(D)])
                                            for t in range(T) for p in stages})
        elif staged:
            sd = self.repartitioned_state({(t, p): sds[(t, 0, p)] for t in range(T) for p in stages})
        else:
            if stages != [self.pg.pp_rank]:
                raise ValueError(f"expected the hook state of pipeline rank {self.pg.pp_rank}, got stages {stages}")
            sd = self.resharded_state([sds[(t, 0, self.pg.pp_rank)] for t in range(T)])
        own = self.strategy.STATE_KEYS
        sd = {k: v for k, v in sd.items() if k not in own}
        if strategy_state:  # (load_regrouped takes it from old group 0's only)
            sd.update(self.strategy.joined_state(sds))
        return sd

    @staticmethod
    def _payloads_of(sd: dict) -> list[dict]:
        """The per-source payloads of a hook state dict (the store's and the installed one's)."""
        return list(sd["store"].values()) + ([sd["installed_state"]] if sd.get("installed_state") else [])

    @staticmethod
    def _has_pieces(sd: dict) -> bool:
        """True when a hook state dict's per-source optimizer states are the distributed
        optimizer's pieces (``"shard"``)."""
        return any(isinstance(p.get(k), dict) and "shard" in p[k] for p in HookStateLoads._payloads_of(sd)
                   for k in ("optimizer", "body_optimizer"))

    @staticmethod
    def _same_sources(replicas: list[dict]) -> None:
        """The data-parallel replicas' hook states (data rank 0's first) hold the same sources."""
        first = replicas[0]
        for x in replicas:
            if sorted(x["store"]) != sorted(first["store"]) or x.get("installed") != first.get("installed"):
                raise ValueError(f"the data-parallel replicas' hook states hold other sources "
                                 f"({sorted(x['store'])}, installed {x.get('installed')!r}) than data rank 0's "
                                 f"({sorted(first['store'])}, installed {first.get('installed')!r})")

    def _plain_payloads(self, replicas: list[dict]) -> dict:
        """The hook state dict of the old data rank 0 of one (tensor, pipeline) position with
        every per-source optimizer state that the distributed optimizer saved in pieces joined
        from ``replicas`` (every old data rank's state dict there, in data-parallel order)
        into the plain optimizer's form, named by parameter
        (``optim_reshard.join_named_pieces``), for :meth:`repartitioned_state`."""
        from ..optim_reshard import join_named_pieces
        first = replicas[0]
        self._same_sources(replicas)

        def plain(name: str, payloads: list[dict]) -> dict:
            out = dict(payloads[0])
            for kind in ("optimizer", "body_optimizer"):
                if isinstance(out.get(kind), dict) and "shard" in out[kind]:
                    out[kind], names = join_named_pieces([p[kind] for p in payloads],
                                                         [p["param_names"][kind] for p in payloads],
                                                         f"source {name!r}: {kind}")
                    out["param_names"] = dict(out["param_names"], **{kind: names})
            return out

        sd = dict(first)
        sd["store"] = {n: plain(n, [x["store"][n] for x in replicas]) for n in first["store"]}
        if first.get("installed_state") is not None:
            sd["installed_state"] = plain(first["installed"], [x["installed_state"] for x in replicas])
        return sd
