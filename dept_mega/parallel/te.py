"""Transformer Engine GEMMs for our column/row-parallel layers (``backend: transformer_engine``,
or ``auto`` when ``transformer_engine`` imports and the device is CUDA).

Written against Transformer Engine 2.20.0.dev0 (NVIDIA/TransformerEngine commit d0067d0,
August 2026), checked against the 1.13 and 2.x release signatures it uses:

* ``transformer_engine.pytorch.Linear(in_features, out_features, bias=..., init_method=...,
  params_dtype=..., device=..., parallel_mode=None)`` — ``parallel_mode=None`` means TE does
  no communication: our layers keep doing the tensor/sequence-parallel collectives through
  ``pg.comm`` (bytes counted) and call TE only for the local GEMM. ``Linear.forward`` reads its
  weight as ``getattr(self, "weight")`` (``_get_weight_tensors`` in every release since 1.x),
  so the TE module is given *our* parameter (same name, init, TP attributes, optimizer).
* ``transformer_engine.pytorch.autocast(enabled, recipe=..., amax_reduction_group=...)``
  (2.10 and later) or ``fp8_autocast(enabled, fp8_recipe=..., fp8_group=...)`` (1.x – 2.x,
  deprecated in 2.10): FP8 for the TE modules called inside; on its exit TE all-reduces the
  amaxes over ``amax_reduction_group`` (our ``pg.tp_dp``: the tensor × data-parallel ranks
  of one pipeline stage of one source group, never across source groups). That reduction is
  TE's own ``torch.distributed`` call (a few bytes per GEMM) and is not in ``pg.comm``'s count.
* recipes from ``transformer_engine.common.recipe``: ``DelayedScaling(fp8_format=Format.HYBRID
  | Format.E4M3, amax_history_len=N, amax_compute_algo="max")`` for ``fp8_recipe: delayed`` and
  ``Float8CurrentScaling(fp8_format=...)`` (2.2 and later) for ``fp8_recipe: current``.

Nothing here can run without Transformer Engine and a CUDA GPU; none of our machines has TE,
so this path is untested here (tests skip unless TE imports). TE wants the token count and
the per-rank feature sizes to be multiples of 16 under FP8.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
from typing import Any, Iterator, Optional

import torch


def te_installed() -> bool:
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        return False


def te_importable() -> tuple[bool, str]:
    """(True, version) when ``transformer_engine.pytorch`` imports; (False, reason) otherwise."""
    if not te_installed():
        return False, "transformer_engine is not installed"
    try:
        te = importlib.import_module("transformer_engine")
        importlib.import_module("transformer_engine.pytorch")
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable"
        return False, f"transformer_engine does not import ({type(exc).__name__}: {exc})"
    return True, str(getattr(te, "__version__", "unknown version"))


def _te():
    return importlib.import_module("transformer_engine.pytorch")


def make_recipe(fmt: str, scaling: str, amax_history: int) -> Any:
    """TE's recipe object for ``fp8: hybrid | e4m3`` and ``fp8_recipe: delayed | current``."""
    recipe = importlib.import_module("transformer_engine.common.recipe")
    fp8_format = recipe.Format.HYBRID if fmt == "hybrid" else recipe.Format.E4M3
    if scaling == "delayed":
        return recipe.DelayedScaling(fp8_format=fp8_format, amax_history_len=amax_history, amax_compute_algo="max")
    if not hasattr(recipe, "Float8CurrentScaling"):
        raise RuntimeError("fp8_recipe: current needs Transformer Engine 2.2 or later (Float8CurrentScaling)")
    return recipe.Float8CurrentScaling(fp8_format=fp8_format)


def fp8_autocast(enabled: bool, recipe: Any = None, group: Optional[Any] = None):
    """TE's FP8 autocast context (``autocast`` where it exists, else ``fp8_autocast``)."""
    te = _te()
    if hasattr(te, "autocast"):
        return te.autocast(enabled=enabled, recipe=recipe, amax_reduction_group=group)
    return te.fp8_autocast(enabled=enabled, fp8_recipe=recipe, fp8_group=group)


class TEContext:
    """What a model body needs to run its TE GEMMs: the recipe (None: bf16 TE GEMMs) and the
    amax reduction group. ``block(fp8)`` is the context for one transformer block."""

    def __init__(self, recipe: Any = None, group: Optional[Any] = None) -> None:
        self.recipe = recipe
        self.group = group

    def __deepcopy__(self, memo) -> "TEContext":
        return self  # holds a process group (cannot be copied)

    @contextlib.contextmanager
    def body(self) -> Iterator[None]:
        """Around a whole chunk's forward: one FP8 region, so TE reduces amaxes once per
        micro-batch (on exit), not once per block."""
        if self.recipe is None:
            yield
            return
        with fp8_autocast(True, self.recipe, self.group):
            yield

    def block(self, fp8: bool):
        """Inside :meth:`body`: bf16 blocks (``fp8_first_last_layers_bf16``) nest a disabled region."""
        if self.recipe is None or fp8:
            return contextlib.nullcontext()
        return fp8_autocast(False)


class TELinearHolder:
    """A ``transformer_engine.pytorch.Linear`` (no bias, no TE communication) that multiplies
    by the owning layer's own weight parameter. Kept outside the module tree so parameter
    names and state dicts are ours; rebuilt when the weight object changes (a deep copy)."""

    __slots__ = ("module",)

    def __init__(self) -> None:
        self.module = None

    def __deepcopy__(self, memo) -> "TELinearHolder":
        return TELinearHolder()

    def __call__(self, weight: torch.nn.Parameter, x: torch.Tensor) -> torch.Tensor:
        mod = self.module
        if mod is None or mod.weight is not weight:
            out_features, in_features = weight.shape
            mod = _te().Linear(in_features, out_features, bias=False, init_method=lambda w: None,
                               params_dtype=weight.dtype, device=weight.device, parallel_mode=None)
            mod.weight = weight  # TE reads getattr(self, "weight"): our parameter
            self.module = mod
        return mod(x)
