"""What native FP8 (``fp8`` with ``backend: local``, parallel/fp8.py) changes in the memory
model (dept/memory.py), per rank.

Which GEMMs run FP8: the four block GEMMs (QKV, projection, fc1, fc2) of the FP8 layers (all
blocks, or all but the first and last with ``fp8_first_last_layers_bf16``) whose per-rank
weight sizes are multiples of 16 (``fp8_gemm_shape_ok``); the output layer stays bf16.

* **weight copies** (:func:`fp8_weight_copy_bytes`): ``Fp8WeightCache`` casts each FP8 GEMM's
  weight shard once per training step, in both layouts (``q`` [out, in] for the forward, ``q_t``
  [in, out] for the input gradient): 2 bytes per weight element, held from the step's first
  forward to the close of the step (after its last backward, before the optimizer), so at the
  step's activation peak. With current scaling each copy also holds its own 4-byte
  dequantisation factor (delayed scaling: a view of the state's).
* **activations** (:func:`fp8_activation_delta`, per micro-batch): each FP8 GEMM saves the
  1-byte transposed copy of its input (``pad16(s·b)`` rows: the token count padded to a
  multiple of 16; with sequence parallelism the all-gathered rows) instead of the bf16 input.
  What goes is what the bf16 formula counts for that input (with sequence parallelism the
  norms' outputs sharded: the bf16 QKV and fc1 layers keep the shard and all-gather it again in
  backward, parallel/sp_linear.py; the FP8 ones keep only their 1-byte copy of the gathered input).
  The bf16 input is freed unless another op keeps it: the inputs of QKV and fc1 (the norms'
  outputs) and of fc2 (the activation's output) are kept by nobody else, so their bf16 terms
  go; the projection's input is the attention core's output, reshaped: unless the core is
  recomputed (``selective``) the core's backward keeps it when the reshape is a view (``flex``: the core writes
  ``[s, b, H, d]`` densely; ``memory_attention.attention_output_shared`` of the kernel the
  trainer picks, ``attention_kind``), so only the FP8 copy is added;
  otherwise (or with ``selective``) the projection was its only keeper. ``full``: a
  recomputed block saves only its input, as without FP8. With current scaling each FP8 GEMM
  also saves its input's 4-byte dequantisation factor per micro-batch (delayed: a view). When
  the token count needs padding, a GEMM's output is a view of its padded result: the QKV and
  fc1 outputs (kept by the attention and the activation) hold ``pad16(s·b)`` rows.
* **scaling state** (:func:`fp8_scaling_bytes`, delayed scaling only, allocated by the first
  training step): the amax history ``[N + 1, 3 L]`` fp32 (N = ``fp8_amax_history``, L FP8
  GEMMs of the rank), the step's scales and constants (``3 L`` fp32 each), the reciprocal
  scales one per 16 bytes, and per GEMM two 3-element fp32 amax vectors.

Transformer Engine's FP8 (``backend: transformer_engine``) is not modelled.
"""
from __future__ import annotations

from typing import Optional

from ..config import Config
from .memory_attention import attention_kind, attention_output_shared

from ..parallel.fp8_gemm import ALIGN as FP8_ALIGN  # the padded token rows
from ..parallel.fp8_gemm import PTR_ALIGN as SCALE_STRIDE_BYTES  # one reciprocal scale per 16 bytes (fp8.py)


def native_fp8(cfg: Config) -> bool:
    """Whether the memory model counts FP8 for ``cfg``: ``fp8`` set and the native backend
    (``local``; ``auto`` where Transformer Engine is not used)."""
    return cfg.fp8 is not None and cfg.backend in ("local", "auto")


def fp8_layer_ids(cfg: Config) -> tuple[int, ...]:
    """Global ids of the blocks whose GEMMs run FP8 (model/backends.py's choice)."""
    from ..model.backends import fp8_block_layers

    return fp8_block_layers(cfg.model.num_layers, cfg.fp8_first_last_layers_bf16)


def gemm_shapes(cfg: Config) -> dict[str, tuple[int, int]]:
    """Per-rank (in, out) of each block GEMM that runs FP8 (the ones model/backends.py picks,
    ``native_fp8_gemms``: both sizes multiples of 16)."""
    from ..model.backends import _gemm_shapes, native_fp8_gemms

    shapes = _gemm_shapes(cfg.model, cfg.parallel.tensor)
    return {g: shapes[g] for g in native_fp8_gemms(cfg.model, cfg.parallel.tensor)}


def _rows(cfg: Config) -> int:
    s, b = cfg.model.seq_length, cfg.train.micro_batch_size
    return -(-s * b // FP8_ALIGN) * FP8_ALIGN


def _rank_fp8_layers(cfg: Config, pp_rank: int) -> list[list[int]]:
    """Per chunk of stage ``pp_rank``: its FP8 layers' ids."""
    from ..model.gpt import chunk_layout

    p = cfg.parallel
    fp8 = set(fp8_layer_ids(cfg))
    return [[i for i in ids if i in fp8] for ids in chunk_layout(cfg.model.num_layers, p.pipeline,
                                                                 p.virtual_pipeline, pp_rank)]


def fp8_weight_copy_bytes(cfg: Config, pp_rank: int) -> int:
    """The FP8 weight copies a rank of stage ``pp_rank`` holds during a training step."""
    if not native_fp8(cfg):
        return 0
    n = sum(len(c) for c in _rank_fp8_layers(cfg, pp_rank))
    shapes = gemm_shapes(cfg)
    inv = 4 if cfg.fp8_recipe == "current" else 0
    return n * sum(2 * i * o + inv for i, o in shapes.values())


def fp8_gemms_on_rank(cfg: Config, pp_rank: int) -> int:
    return sum(len(c) for c in _rank_fp8_layers(cfg, pp_rank)) * len(gemm_shapes(cfg))


def fp8_scaling_bytes(cfg: Config, pp_rank: int) -> int:
    """The delayed-scaling state of a rank of stage ``pp_rank`` (0 under current scaling)."""
    if not native_fp8(cfg) or cfg.fp8_recipe != "delayed":
        return 0
    g = fp8_gemms_on_rank(cfg, pp_rank)
    if g == 0:
        return 0
    cols = 3 * g
    return 4 * cols * (cfg.fp8_amax_history + 1) + 4 * cols * 2 + SCALE_STRIDE_BYTES * cols + 24 * g


def layer_delta(cfg: Config, shared: Optional[bool] = None) -> int:
    """The change (bytes, may be negative) FP8 makes to one non-recomputed FP8 block's saved
    activations of one micro-batch (see the module doc)."""
    m, p = cfg.model, cfg.parallel
    T = p.tensor
    sp = p.sequence_parallel and T > 1
    a = 2  # FP8 needs bf16 activations
    s, b, h = m.seq_length, cfg.train.micro_batch_size, m.hidden_size
    rep = s * b * h // T if sp else s * b * h
    q = m.num_attention_heads * m.head_dim
    if shared is None:  # the attention kernel the trainer picks on CUDA (memory_attention.py)
        shared = attention_output_shared(attention_kind(cfg))
    removed = {"qkv": rep * a, "fc1": rep * a, "fc2": s * b * m.ffn_size // T * a,
               "proj": 0 if (shared and m.recompute != "selective") else s * b * q // T * a}
    inv = 4 if cfg.fp8_recipe == "current" else 0
    R = _rows(cfg)
    shapes = gemm_shapes(cfg)
    # padded rows: the GEMM's output is a view of its R-row result, so the QKV output (kept by
    # the core or its recomputation) and fc1's (kept by the activation) hold R rows, not s·b
    padded = (R - s * b) * a * sum(shapes[g][1] for g in ("qkv", "fc1") if g in shapes)
    return padded + sum(R * i + inv - removed[g] for g, (i, _) in shapes.items())


def fp8_activation_delta(cfg: Config, pp_rank: int, shared: Optional[bool] = None) -> int:
    """The change FP8 makes to one micro-batch's saved activations on a rank of stage
    ``pp_rank``: :func:`layer_delta` per FP8 block that is not recomputed in full."""
    if not native_fp8(cfg):
        return 0
    m = cfg.model
    from ..model.gpt import chunk_layout

    p = cfg.parallel
    per = layer_delta(cfg, shared)
    fp8 = set(fp8_layer_ids(cfg))
    total = 0
    for ids in chunk_layout(m.num_layers, p.pipeline, p.virtual_pipeline, pp_rank):
        k = 0
        if m.recompute == "full":
            k = min(m.recompute_layers if m.recompute_layers is not None else len(ids), len(ids))
        total += per * sum(1 for i in ids[k:] if i in fp8)  # the first k blocks of a chunk are recomputed
    return total
