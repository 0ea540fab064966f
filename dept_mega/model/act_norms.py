"""Per-layer RMS of the transformer blocks' outputs (``train.log_activation_norms``).

The paper's stability finding is that at equal learning rates STD's activation norms grow and
diverge while DEPT's stay stable; the RMS of each block's output (the residual stream) over a
step's tokens shows it. On the steps that log, the trainer hands every chunk's
:class:`~dept_mega.model.gpt.TransformerBody` an :class:`ActivationSums` whose ``sums`` is a
slice of the step's statistics tensor; each block's output adds its sum of squares and its
element count there, on the device. The trainer's one all-reduce of the statistics over the
source group then sums the layers of every pipeline stage, the sequence shards of every
tensor rank (with sequence parallelism; without it the tensor ranks hold the same output and
add it T times to both sums, which the ratio cancels) and the micro-batches of every
data-parallel rank, and the step's one read of the device fetches them with the loss.
RMS = sqrt(sum of squares / elements) over the full hidden size (``metrics.activation_fields``).

Nothing is measured inside the compiled blocks (``train.compile``) or again in a recomputed
block's backward (``model.recompute``): the body adds a block's output after the block
returns. On other steps, and with the option off, the body holds None and adds nothing.
"""
from __future__ import annotations

import torch


class ActivationSums:
    """``sums``: a float64 tensor of ``2 × num_layers`` values on the device: the sum of squares
    of layer i's output at ``i``, its element count at ``num_layers + i`` (global layer ids)."""

    def __init__(self, sums: torch.Tensor, num_layers: int) -> None:
        if sums.shape != (2 * num_layers,) or sums.dtype != torch.float64:
            raise ValueError(f"ActivationSums: need float64 [{2 * num_layers}], got {sums.dtype} {tuple(sums.shape)}")
        self.sums = sums
        self.num_layers = num_layers

    @torch.no_grad()
    def add(self, layer_id: int, hidden: torch.Tensor) -> None:
        h = hidden.detach()
        # the norm's reduction in fp32 (bf16 activations too), without a squared copy
        self.sums[layer_id] += torch.linalg.vector_norm(h, dtype=torch.float32).double().square()
        self.sums[self.num_layers + layer_id] += h.numel()

