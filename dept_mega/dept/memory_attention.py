"""The attention kernel the memory model (dept/memory.py, dept/memory_fp8.py) counts, resolved
once with the trainer's own choice (model/backends.py :func:`choose_attention`), and what its
saved tensors are.

Every attention-dependent term of the activations is keyed on :func:`attention_kind`: the
core's saved statistics or scores (``bias`` on CUDA: the s² scores) and whether the core's
output is the projection's input (:func:`attention_output_shared`). ``auto`` therefore counts
what a run would use on that device: flash-attn where it is installed and can run, for ALiBi
flex_attention where it can train (CUDA, head dimension ≥ 16, no attention dropout, ...) and
the materialised bias otherwise, for RoPE / learned positions SDPA.

The CUDA rules for PyTorch's SDPA (the ``sdpa`` and ``bias`` backends) were measured on an H200
(torch 2.11, 2026-11-28, tests/test_memory_activations.py's ``gpu`` test): its CUDA kernels
write their output in the query's memory layout, so the reshape to the projection's input is a
view; with the ``bias`` backend's additive mask they keep no scores (and no dropout mask:
Philox); each keeps a log-sum-exp of ``[b, H, s]`` fp32, padded to a multiple of 32 queries
in fp32 (the memory-efficient kernel), and a 16-byte RNG state. flash-attn's rule (its output a copy) is
not measured (not installable on our machines).
"""
from __future__ import annotations

from typing import Optional

from ..config import Config


def attention_kind(cfg: Config, device: str = "cuda", flash_installed: Optional[bool] = None) -> str:
    """``flash`` | ``flex`` | ``sdpa`` | ``bias``: what the trainer runs for ``cfg`` on a
    ``device`` (``cuda`` | ``cpu``) with flash-attn installed or not (None: whether it imports
    here, or ``model.attention_backend: flash``, which a run needs installed). A path that
    cannot run is the trainer's ``BackendError``."""
    from ..model.attention import flash_attn_available
    from ..model.backends import choose_attention

    m = cfg.model
    if flash_installed is None:
        flash_installed = flash_attn_available() or m.attention_backend == "flash"
    return choose_attention(m.attention_backend, device_type=device, precision=cfg.precision,
                            position=m.position_embedding, head_dim=m.head_dim,
                            q_per_group=m.num_attention_heads // m.query_groups, seq_length=m.seq_length,
                            dropout=m.attention_dropout > 0, flash_installed=flash_installed).kind


def attention_output_shared(kind: str, device: str = "cuda") -> bool:
    """Whether the projection's input is a view of the attention core's output of kernel
    ``kind`` (one tensor, kept by the core's backward and by the projection's): ``flex`` writes
    its output densely as ``[s, b, H, d]`` (model/attention.py); PyTorch's SDPA kernels (the
    ``sdpa`` and ``bias`` backends), on the CPU and on CUDA, write it in the query's layout, the
    same ``[s, b, H, d]`` memory (both measured by tests/test_memory_activations.py). flash-attn
    is counted as writing ``[b, s, H, d]``, so that the reshape copies (b > 1; not measured)."""
    if device == "cpu":
        return True  # every CPU path (flex and flash do not run there)
    return kind in ("flex", "sdpa", "bias")


def scores_saved(kind: str, device: str, attention_dropout: float) -> bool:
    """Whether the core keeps the s² scores (and, with dropout, their mask) rather than the
    fused kernels' log-sum-exp: the ``bias`` backend on the CPU with attention dropout (the
    math kernel; without dropout the CPU kernel takes the bias without materialising the
    scores). On CUDA the ``bias`` backend's mask runs the memory-efficient kernel (measured)."""
    return kind == "bias" and device == "cpu" and attention_dropout > 0


def statistics_bytes(kind: str, device: str, precision: str, batch_heads: int, s: int) -> int:
    """What the core keeps besides its inputs and output when it keeps no scores, for
    ``batch_heads`` = b × heads on the rank: the log-sum-exp (fp32, one per query), for CUDA's
    SDPA kernels padded to a multiple of 32 queries in fp32 (the memory-efficient kernel) and
    with their 16-byte RNG state (seed, offset), as measured (module docstring)."""
    if device != "cuda" or kind not in ("sdpa", "bias"):
        return 4 * batch_heads * s
    return 4 * batch_heads * (-(-s // 32) * 32 if precision == "fp32" else s) + 16
