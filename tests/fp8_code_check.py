"""``fp8_triton._fp8_code`` against torch's FP8 bytes: every byte of both formats (decoded to
fp32, a value on the FP8 grid) must code back to itself; NaN to 0x7F with its sign. Run by
``test_fp8_fused_kernels`` under Triton's interpreter and on a CUDA GPU."""
from __future__ import annotations

import torch

from dept_mega.parallel.fp8_triton import _FORMATS, AVAILABLE, tl, triton

if AVAILABLE:
    from dept_mega.parallel.fp8_triton import _fp8_code

    @triton.jit
    def _code_kernel(y_ptr, out_ptr, n, MBITS: tl.constexpr, EMIN: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        y = tl.load(y_ptr + i, mask=i < n, other=0.0)
        tl.store(out_ptr + i, _fp8_code(y, MBITS, EMIN), mask=i < n)


def fp8_code_roundtrip(device: str) -> dict:
    failures = []
    codes = torch.arange(256, dtype=torch.int32)
    for dtype, (_, mbits, emin) in _FORMATS.items():
        every = codes.to(torch.uint8).view(dtype).float()
        keep = ~torch.isinf(every)  # e5m2's ±inf bytes are never on the saturated grid
        y, want = every[keep], codes[keep]
        want = torch.where(torch.isnan(y), 0x7F | (want & 0x80), want)
        out = torch.full((len(y),), -1, dtype=torch.int32, device=device)
        _code_kernel[(1,)](y.to(device), out, len(y), MBITS=mbits, EMIN=emin, BLOCK=256)
        bad = (out.cpu() != want).nonzero()[:, 0]
        if len(bad):
            i = int(bad[0])
            failures.append(f"{dtype}: {len(bad)} codes wrong, e.g. {y[i].item()} -> {int(out[i])} != {int(want[i])}")
    return {"failures": failures}
