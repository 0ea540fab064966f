"""The inner optimizer: AdamW over fp32 main parameters, fed by a contiguous gradient buffer.

:class:`InnerOptimizer` is one object per parameter set (the trainer has one for the body and
one for the installed embeddings, so DEPT can swap a source's embeddings with their state):

* its parameters' gradients go to a :class:`~dept_mega.grad_buffer.GradBuffer`
  (``param.main_grad``), reduced over ``pg.dp`` bucket by bucket (:class:`GradSync`);
* the AdamW it wraps (``.inner``; ``.state`` / ``.param_groups`` are AdamW's) updates fp32
  *main* parameters: the parameters themselves under ``precision: fp32`` (bit-identical to a
  plain AdamW over the model), fp32 copies ``param.main_param`` under bf16/fp16 (Megatron's
  ``Float16OptimizerWithFloat16Params``), copied back into the half-precision weights after
  every step;
* ``state_dict()`` is AdamW's plus, with half-precision weights, ``"main_params"``: the fp32
  masters travel with the state (a SPEC source that moves keeps full precision).

:mod:`dept_mega.distributed_optimizer` shards the main parameters and the moments over the
data-parallel ranks (``optim.distributed``).

``param.main_param`` is the authoritative value of a half-precision parameter: code that
writes weights outside the optimizer (DEPT's outer sync, TRIM's row fill) writes the main
parameter and then calls :func:`refresh_model_params`; loading a module's state dict
refreshes the main parameters from the loaded weights (:func:`keep_masters_on_load`).
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

import torch

from .config import OptimConfig
from .grad_buffer import GradBuffer
from .parallel.groups import ParallelGroups
from .precision import Precision


def unique_params(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def use_fused(optim: OptimConfig, device: torch.device) -> bool:
    """``optim.fused``: null → the fused kernel on CUDA, foreach elsewhere; true/false force it."""
    return optim.fused if optim.fused is not None else torch.device(device).type == "cuda"


def adamw_kwargs(optim: OptimConfig, device: torch.device) -> dict:
    kwargs = {"lr": optim.lr, "betas": tuple(optim.betas), "eps": optim.eps}
    if use_fused(optim, device):
        kwargs["fused"] = True
    else:
        kwargs["foreach"] = True
    return kwargs


def new_adamw(groups: list[dict], optim: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    groups = [g for g in groups if g["params"]]
    if not groups:
        # an empty optimizer keeps the swap logic uniform (e.g. a chunk without embeddings)
        groups = [{"params": [], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, **adamw_kwargs(optim, device))


def empty_adamw_state(opt: torch.optim.Optimizer, group: dict, p: torch.Tensor) -> dict:
    """The state AdamW creates on its first step, as zeros (so a checkpoint can load into it
    in place). ``step`` lives where AdamW keeps it: on the parameter's device for the fused
    and capturable kernels, a CPU scalar otherwise."""
    if group.get("fused") or group.get("capturable"):
        step = torch.zeros((), dtype=torch.float32, device=p.device)
    else:
        dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        step = torch.tensor(0.0, dtype=dtype)
    state = {"step": step, "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
             "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
    if group.get("amsgrad"):
        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def state_order(pieces: Sequence[tuple[int, int, int]],
                params: Sequence[torch.nn.Parameter]) -> list[tuple[int, int, int]]:
    """The ``pieces`` (``(parameter index, start, end)``, :meth:`InnerOptimizer.pieces_signature`)
    in the order of the indices of AdamW's state dict: those of matrices, then the others (the
    weight-decay groups of :meth:`InnerOptimizer._groups`, each in the order given)."""
    return ([pc for pc in pieces if params[pc[0]].dim() >= 2] +
            [pc for pc in pieces if params[pc[0]].dim() < 2])


# ----------------------------------------------------------------------------- main params


def main_param(p: torch.nn.Parameter) -> torch.Tensor:
    """The fp32 tensor that holds ``p``'s authoritative value (write it, then
    :func:`refresh_model_params`)."""
    m = getattr(p, "main_param", None)
    if m is not None:
        return m
    if p.dtype == torch.float32:
        return p.data
    raise RuntimeError(f"parameter of shape {tuple(p.shape)} is {p.dtype} and has no full fp32 master copy on "
                       f"this rank (optim.distributed shards the masters of half-precision weights)")


@torch.no_grad()
def refresh_model_params(params: Iterable[torch.nn.Parameter]) -> None:
    """Copy the fp32 main parameters into the (half-precision) model weights: one multi-tensor
    copy (``torch._foreach_copy_``; a launch per parameter was ~150 launches a step on the 1B
    model)."""
    dst, src = [], []
    for p in params:
        m = getattr(p, "main_param", None)
        if m is not None:
            dst.append(p.data)
            src.append(m)
    if dst:
        torch._foreach_copy_(dst, src)


@torch.no_grad()
def copy_model_to_main(params: Iterable[torch.nn.Parameter]) -> None:
    """The reverse: take the model weights as the main parameters (after loading weights only)."""
    for p in params:
        m = getattr(p, "main_param", None)
        if m is not None:
            m.copy_(p.data)


def _after_load(module: torch.nn.Module, incompatible_keys) -> None:
    copy_model_to_main(module.parameters())


def keep_masters_on_load(module: torch.nn.Module) -> None:
    """After ``module.load_state_dict`` the main parameters follow the loaded weights (an
    optimizer state loaded afterwards may then restore the exact fp32 masters)."""
    if not getattr(module, "_masters_follow_loads", False):
        module.register_load_state_dict_post_hook(_after_load)
        module._masters_follow_loads = True


@torch.no_grad()
def to_model_dtype(params: Iterable[torch.nn.Parameter], dtype: torch.dtype, keep_master: bool) -> None:
    """Store ``params`` in ``dtype``; with ``keep_master`` an fp32 parameter's current tensor
    becomes its ``main_param`` (no copy, no rounding of the master)."""
    for p in params:
        if p.dtype == dtype:
            if keep_master and dtype != torch.float32 and getattr(p, "main_param", None) is None:
                p.main_param = p.data.float()  # a weight that was already half: the best master there is
            continue
        if keep_master and p.dtype == torch.float32 and dtype != torch.float32:
            p.main_param = p.data
        p.data = p.data.to(dtype)


# ----------------------------------------------------------------------------- the optimizer


class InnerOptimizer:
    """AdamW over fp32 main parameters with a gradient buffer (see module doc)."""

    distributed = False

    def __init__(self, params: Iterable[torch.nn.Parameter], optim: OptimConfig, pg: ParallelGroups,
                 device: torch.device, precision: Precision, shared: Iterable[torch.nn.Parameter] = (),
                 names: Optional[dict[int, str]] = None) -> None:
        self.cfg = optim
        self.pg = pg
        self.device = torch.device(device)
        self.precision = precision
        self.half = precision.half
        self.params = [p for p in unique_params(params) if p.requires_grad]
        self.names = names or {}
        shards = pg.dp_size if self.distributed else 1
        isolate = frozenset(id(p) for p in shared) if self.distributed else frozenset()
        self.buffer = GradBuffer(self.params, precision.grad_dtype, self.device, optim.grad_bucket_size,
                                 shards=shards, isolate=isolate, names=self.names)
        self.buffer.optimizer = self
        self._setup_main_params()
        self.buffer.adopt()
        self.inner = new_adamw(self._groups(), optim, self.device)

    # -- layout (overridden by the distributed optimizer) ----------------------------------
    def _setup_main_params(self) -> None:
        to_model_dtype(self.params, self.precision.param_dtype, keep_master=self.half)

    def _groups(self) -> list[dict]:
        """Weight decay on matrices only (not on biases, norm weights); same order as the params."""
        decay = [self._main_of(p) for p in self.params if p.dim() >= 2]
        no_decay = [self._main_of(p) for p in self.params if p.dim() < 2]
        return [{"params": decay, "weight_decay": self.cfg.weight_decay},
                {"params": no_decay, "weight_decay": 0.0}]

    def _main_of(self, p: torch.nn.Parameter) -> torch.Tensor:
        return p if not self.half else p.main_param

    # -- what the trainer uses ---------------------------------------------------------------
    @property
    def state(self):
        return self.inner.state

    @property
    def param_groups(self):
        return self.inner.param_groups

    def adopt(self) -> None:
        """Take (back) the gradients of this optimizer's parameters."""
        self.buffer.adopt()

    def release_grads(self) -> None:
        self.buffer.release()

    def received(self, p: torch.nn.Parameter) -> bool:
        """Whether ``p`` got a gradient this step."""
        return self.buffer.counts.get(id(p), 0) > 0

    def grad_view(self, p: torch.nn.Parameter) -> Optional[torch.Tensor]:
        """The reduced gradient of ``p`` this rank holds (all of it here)."""
        return p.main_grad

    def reduced_grads(self) -> list[torch.Tensor]:
        return [self.grad_view(p) for p in self.params if self.received(p)]

    @torch.no_grad()
    def scale_grads(self, factor: float) -> None:
        grads = [g for g in self.reduced_grads() if g is not None and g.numel()]
        if grads:
            torch._foreach_mul_(grads, factor)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on the main parameters from the reduced (and clipped) gradients, then the
        half-precision weights from the main parameters."""
        mains = []
        for p in self.params:
            if not self.received(p):
                continue  # no gradient this step: AdamW leaves it alone, as it would without a buffer
            m = self._main_of(p)
            g = p.main_grad
            m.grad = g if g.dtype == m.dtype else g.to(m.dtype)
            mains.append(m)
        self.inner.step()
        for m in mains:
            m.grad = None
        if self.half:
            refresh_model_params(self.params)

    # -- weights written outside the optimizer --------------------------------------------------
    def refresh_model_params(self) -> None:
        refresh_model_params(self.params)

    def copy_model_to_main(self) -> None:
        copy_model_to_main(self.params)

    # -- state -------------------------------------------------------------------------------
    def ensure_state(self) -> None:
        """Create AdamW's state (zeros) for every main parameter that has none yet."""
        for group in self.inner.param_groups:
            for m in group["params"]:
                if not self.inner.state.get(m):
                    self.inner.state[m] = empty_adamw_state(self.inner, group, m)

    def indexed_params(self, names: Optional[dict[int, str]] = None) -> list[tuple[str, torch.nn.Parameter]]:
        """``(name, parameter)`` in the order of the indices of AdamW's state dict (``state``
        keys, ``param_groups`` ``params``): the parameter groups' main parameters in turn.
        ``names``: parameter id → name (default: the names this optimizer was built with). A
        checkpoint saves these names beside a state dict so that it can be joined by name
        under another pipeline layout, where a stage holds other parameters in another order
        (a format-1 checkpoint, ``dept_mega.checkpoint_v1``)."""
        names = self.names if names is None else names
        model_of = self._model_of_main()
        out = []
        for group in self.inner.param_groups:
            for m in group["params"]:
                p = model_of.get(id(m))
                if p is None or id(p) not in names:
                    raise ValueError(f"indexed_params: a main parameter of shape {tuple(m.shape)} has no named "
                                     f"model parameter")
                out.append((names[id(p)], p))
        return out

    def _model_of_main(self) -> dict[int, torch.nn.Parameter]:
        """id of each main parameter (AdamW's parameters) -> the model parameter it belongs to."""
        return {id(self._main_of(p)): p for p in self.params}

    def pieces_signature(self) -> list[tuple[int, int, int]]:
        """``(parameter index, start, end)`` of what this optimizer holds of its parameters
        (``[start, end)`` of the flattened parameter), in the order of ``main_params`` in
        :meth:`state_dict`: every parameter whole here; the distributed optimizer's pieces."""
        return [(i, 0, p.numel()) for i, p in enumerate(self.params)]

    def checkpoint_items(self) -> list[tuple[str, torch.nn.Parameter, torch.Tensor, Optional[tuple[int, int]]]]:
        """(state name, parameter, tensor, flat range) of the state a checkpoint saves: AdamW's
        moments and step, ``main_param`` for half-precision weights; the range is None (shaped
        like the parameter's shard; ``dept_mega.checkpoint_format``)."""
        out = []
        for p in self.params:
            for k, v in (self.inner.state.get(self._main_of(p)) or {}).items():
                if torch.is_tensor(v):
                    out.append((k, p, v, None))
            if self.half:
                out.append(("main_param", p, p.main_param, None))
        return out

    def checkpoint_tensors(self, key_of: Callable[[torch.nn.Parameter], Optional[str]]) -> dict[str, torch.Tensor]:
        """Format 1 (``dept_mega.checkpoint_v1``): ``{moment}/{param key}`` → tensor."""
        return {f"{k}/{key_of(p)}": v for k, p, v, _ in self.checkpoint_items() if key_of(p) is not None}

    def after_checkpoint_load(self, with_optimizer: bool) -> None:
        """Make weights and main parameters agree after DCP loaded into them."""
        if with_optimizer:
            self.refresh_model_params()
        else:
            self.copy_model_to_main()

    def state_dict(self) -> dict:
        sd = self.inner.state_dict()
        if self.half:
            sd["main_params"] = [p.main_param for p in self.params]
        return sd

    def masters_state_dict(self) -> Optional[dict]:
        """:meth:`state_dict` with AdamW's state emptied: the fp32 main parameters only (None
        under fp32 weights, where the weights are the masters). Loading it resets the moments
        and restores the exact masters — what a source carries when
        ``dept.reset_inner_optimizer`` drops its optimizer state but not its precision."""
        if not self.half:
            return None
        sd = self.state_dict()
        sd["state"] = {}
        return sd

    def moments_state_dict(self) -> dict:
        """:meth:`state_dict` without the main parameters: AdamW's moments and steps only (what
        ``dept.body_optimizer_state: source`` keeps per source — the weights stay the group's)."""
        sd = self.state_dict()
        sd.pop("main_params", None)
        return sd

    @torch.no_grad()
    def load_state_dict(self, sd: dict, with_masters: bool = True) -> None:
        """``with_masters=False``: load AdamW's state only and leave the weights and their
        fp32 masters as they are (main parameters in ``sd`` are ignored)."""
        sd = dict(sd)
        mains = sd.pop("main_params", None)
        if sd.pop("shard", None) is not None:
            raise ValueError("optim.distributed: this optimizer state holds one data-parallel rank's shard "
                             "(a distributed-optimizer run); it does not load into the plain optimizer")
        if mains is not None and len(mains) != len(self.params):
            raise ValueError(f"optimizer state holds {len(mains)} main parameters, this optimizer has "
                             f"{len(self.params)}")
        self.inner.load_state_dict(sd)
        if not with_masters:
            return
        if mains is None:
            self.copy_model_to_main()  # state of an fp32 run: the weights are all there is
            return
        for p, m in zip(self.params, mains):
            main_param(p).copy_(m)  # the exact fp32 masters (into the fp32 weights of an fp32 run)
        self.refresh_model_params()
