"""Which native FP8 casts are fused into the producer of the tensor they cast (``fp8_fused_casts``),
and the run log's account of it.

The producers: a LayerNorm before QKV and fc1 and the GELU before fc2 write those linears' inputs
(``parallel/fp8_prologue.py``); fc2's GELU backward writes fc1's output gradient (``dgelu``,
``parallel/fp8_dgelu.py``). Two rules decide, per cast:

* what can fuse (:func:`_unfused_casts`): RMSNorm and SwiGLU have no fused cast, and a collective
  between the norm and the GEMM (more than one tensor rank) leaves QKV and fc1 unfused. The layers
  apply the same rule (``layers._GemmMixin._fuses``). ``dgelu`` needs fc1 and fc2 in FP8 and fc2's
  GELU fused (its backward is where the fused cast runs), delayed scaling (the cast needs its scale
  before the GELU backward runs) and a cast path with the fused kernel (the C++ casts; the ``torch``
  casts run the same math apart), not the Triton casts.
* ``fp8_fused_casts: null`` (auto) fuses of those only where the fused kernel of the run's casts
  was measured faster than the producer then the cast (:data:`AUTO`); ``true`` fuses them all,
  ``false`` none.
"""
from __future__ import annotations

from typing import Optional

from ..config import ModelConfig

PRODUCERS = {"qkv": "layernorm", "fc1": "layernorm", "fc2": "gelu"}  # the GEMMs whose input a producer writes
DGELU = "dgelu"  # fc1's output gradient, which fc2's GELU backward writes (listed after the GEMMs)

# fp8_fused_casts: null (auto): per cast path (fp8_casts, resolved) and producer, None where auto
# fuses (the fused kernel is faster than the producer then the cast), else why it does not. H200,
# benchmarks/fp8_cast_bench.py at the 1B model's shapes (docs/performance.md, "Measurement
# record"): the C++ GELU cast 1.43x its unfused pair, the C++ LayerNorm cast 1.46x (its rewrite;
# 0.95x before), the C++ dGELU cast 1.15x; the Triton LayerNorm cast 1.40x (at its tile 32 x 256,
# 8 warps), the Triton GELU cast 0.64x. The 1B model's step with every C++ cast fused: 1.053x the
# one with the GELU alone fused (77,367 against 73,491 tokens/s, same call).
_TORCH = "auto: the torch casts have no fused kernel"
_NO_TRITON_DGELU = "the Triton casts have no fused dGELU cast"
AUTO: dict[str, dict[str, Optional[str]]] = {
    "cuda": {"layernorm": None, "gelu": None, DGELU: None},
    "triton": {"layernorm": None,
               "gelu": "auto: the Triton GELU cast is slower than the GELU then the cast (0.64x, H200)",
               DGELU: _NO_TRITON_DGELU},
    "torch": {"layernorm": _TORCH, "gelu": _TORCH, DGELU: _TORCH},
}
# the LayerNorm's fused kernel needs a delayed scale: under current scaling the fused path
# normalises, then casts (the unfused work), so auto leaves it
_CURRENT = "auto: under current scaling the LayerNorm has no fused kernel (normalised, then cast)"
_COMPILE = "auto: train.compile traces the norms, GELUs and casts into the compiled blocks"
# off a GPU auto keeps every cast apart, as auto's casts and GEMMs there are the reference's:
# a fused cast may round the producer's bf16 output one step apart (rarely), so fusing is a
# choice of speed made on the GPU only
_NOT_GPU = "auto: not on a GPU (auto fuses for the fused kernels' GPU speed)"


def _unfused_casts(m: ModelConfig, tp: int) -> dict[str, Optional[str]]:
    """What can fuse: for each GEMM with a fusable producer (QKV and fc1 after the norm, fc2 after
    the activation) None when it can, else why not: the producer has no fused cast (RMSNorm,
    SwiGLU), or a collective sits between the norm and the GEMM (more than one tensor rank: the
    input's all-gather or copy)."""
    norm = (f"{m.normalization} has no fused cast" if m.normalization != "layernorm" else
            f"parallel.tensor {tp}: a collective sits between the norm and the GEMM" if tp > 1 else None)
    act = f"{m.activation} has no fused cast" if m.activation != "gelu" else None
    return {"qkv": norm, "fc1": norm, "fc2": act}


def _auto_reasons(casts: str, scaling: str, compile: bool, gpu: bool) -> dict[str, Optional[str]]:
    """auto's choice per producer (:data:`AUTO`) for the run's casts, scaling, compile and device."""
    if not gpu:
        return {"layernorm": _NOT_GPU, "gelu": _NOT_GPU, DGELU: _NOT_GPU}
    if compile:
        return {"layernorm": _COMPILE, "gelu": _COMPILE, DGELU: _COMPILE}
    reasons = dict(AUTO[casts])
    if scaling == "current" and reasons["layernorm"] is None:
        reasons["layernorm"] = _CURRENT
    return reasons


def _reasons(m: ModelConfig, tp: int, fp8_gemms: tuple[str, ...], setting: Optional[bool], casts: str,
             scaling: str, compile: bool, gpu: bool) -> dict[str, Optional[str]]:
    """For each FP8 GEMM with a producer (and ``dgelu`` where fc1 and fc2 are FP8): None when it
    fuses under ``setting`` (``fp8_fused_casts``), else why not."""
    rule = _unfused_casts(m, tp)
    auto = _auto_reasons(casts, scaling, compile, gpu) if setting is None else {}
    out = {g: rule[g] or auto.get(p) for g, p in PRODUCERS.items() if g in fp8_gemms}
    if "fc1" in fp8_gemms and "fc2" in fp8_gemms:
        out[DGELU] = (rule["fc2"] or auto.get(DGELU) or (_NO_TRITON_DGELU if casts == "triton" else None)
                      or ("current scaling: the dGELU's fused cast needs a delayed scale" if scaling == "current"
                          else None)
                      or ("fc2 does not fuse its GELU" if out["fc2"] is not None else None))
    return out


def fused_cast_gemms(m: ModelConfig, tp: int, fp8_gemms: tuple[str, ...], setting: Optional[bool] = True,
                     casts: str = "torch", scaling: str = "delayed", compile: bool = False,
                     gpu: bool = True) -> tuple[str, ...]:
    """Which FP8 GEMMs fuse the producer of their input into its cast under ``fp8_fused_casts:
    setting`` with the run's resolved ``casts`` (``fp8_casts``), ``scaling``, ``compile`` and
    whether the device is a GPU (the last four matter to auto, ``setting`` None, only), in the
    order qkv, fc1, fc2, then ``dgelu`` where fc1's output-gradient cast is fused into fc2's GELU
    backward."""
    if setting is False:
        return ()
    return tuple(g for g, why in _reasons(m, tp, fp8_gemms, setting, casts, scaling, compile, gpu).items()
                 if why is None)


def unfused_cast_reasons(m: ModelConfig, tp: int, fp8_gemms: tuple[str, ...], setting: Optional[bool] = True,
                         casts: str = "torch", scaling: str = "delayed", compile: bool = False,
                         gpu: bool = True) -> tuple[str, ...]:
    """Why the FP8 GEMMs that :func:`fused_cast_gemms` leaves out do not fuse, for the run log:
    ``"<gemms> (<why>)"``, GEMMs with the same reason together (``setting`` False: none)."""
    if setting is False:
        return ()
    by_reason: dict[str, list[str]] = {}
    for g, why in _reasons(m, tp, fp8_gemms, setting, casts, scaling, compile, gpu).items():
        if why is not None:
            by_reason.setdefault(why, []).append(g)
    return tuple(f"{', '.join(gemms)} ({why})" for why, gemms in by_reason.items())


def describe(mode: str, fused: tuple[str, ...], unfused: tuple[str, ...], casts: str, scaling: str,
             apex: bool) -> str:
    """The run log's account of ``fp8_fused_casts`` (``mode``: ``on`` for true, ``auto`` for null):
    which linears fuse which producer and how that runs with the run's casts and recipe (one
    kernel; with the ``torch`` casts, or the LayerNorm under current scaling, the producer then
    the cast: the same math), and which FP8 linears do not fuse, and why."""
    if casts not in ("triton", "cuda"):
        ln = gelu = dgelu = "run apart: the torch casts have no fused kernel"
    else:
        gelu = "one kernel"
        ln = ("one kernel once the input has a delayed scale (from the second training step)"
              if scaling == "delayed" else "normalised, then cast: current scaling")
        dgelu = "one kernel in fc2's backward once the gradient has a delayed scale (from the second training step)"
    what = {"qkv": f"qkv (layernorm, {ln})", "fc1": f"fc1 (layernorm, {ln})", "fc2": f"fc2 (gelu, {gelu})",
            DGELU: f"dgelu (fc1's output gradient, {dgelu})"}
    parts = [what[g] for g in fused] or ["none" if unfused else "none: no FP8 linear reads a LayerNorm or GELU output"]
    if unfused:
        parts.append("not fused: " + "; ".join(unfused))
    out = f"fused casts (fp8_fused_casts{': null = auto' if mode == 'auto' else ''}) [{', '.join(parts)}]"
    if apex and {"qkv", "fc1"} & set(fused):
        out += " (those LayerNorms are computed by the fused path, not apex)"
    return out
