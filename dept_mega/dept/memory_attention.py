"""The attention kernel the memory model (dept/memory.py, dept/memory_fp8.py) counts, resolved
once with the trainer's own choice (model/backends.py :func:`choose_attention`), and what its
saved tensors are.

Every attention-dependent term of the activations is keyed on :func:`attention_kind`: the
core's saved statistics or scores (``bias`` on CUDA: the s² scores) and whether the core's
output is the projection's input (:func:`attention_output_shared`). ``auto`` therefore counts
what a run would use on that device: flash-attn where it is installed and can run, for ALiBi
flex_attention where it can train (CUDA, head dimension ≥ 16, no attention dropout, ...) and
the materialised bias otherwise, for RoPE / learned positions SDPA.

The CUDA rules (``bias`` keeps its scores; the output of flash-attn and of CUDA SDPA is not a
view of the projection's input) are not yet measured on a GPU: tests/test_memory_activations.py's
``gpu`` test measures them.
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
    its output densely as ``[s, b, H, d]`` (model/attention.py); so does PyTorch's CPU SDPA
    kernel (the ``sdpa`` and ``bias`` backends on ``device="cpu"``, measured by
    tests/test_memory_activations.py). flash-attn and the CUDA SDPA kernels are counted as
    writing ``[b, s, H, d]``, so that the reshape copies (b > 1)."""
    if device == "cpu":
        return True  # every CPU path (flex and flash do not run there)
    return kind == "flex"


def scores_saved(kind: str, device: str, attention_dropout: float) -> bool:
    """Whether the core keeps the s² scores (and, with dropout, their mask) rather than the
    fused kernels' log-sum-exp: the ``bias`` backend on CUDA (counted as the math kernel) and on
    the CPU with attention dropout (without dropout the CPU kernel takes the bias without
    materialising the scores, measured)."""
    return kind == "bias" and not (device == "cpu" and attention_dropout == 0)
