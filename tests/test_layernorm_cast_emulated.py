"""The CUDA kernel of ``layernorm_cast_fp8`` (``csrc/cuda/layernorm_cast.cu``) run on the CPU
through a host emulation of CUDA (``tools/cuda_emu.py``): each of its paths against the reference
(``F.layer_norm``, then ``fp8._cast_math``) under the rules of ``test_fp8_fused_op.py``. This
checks the kernel's indexing, barriers, shuffles and statistics without a GPU; its gpu test
checks it on the GPU. Needs g++ (C++20) and the CUDA toolkit's headers."""
from __future__ import annotations

import pytest
import torch

from dept_mega.parallel.fp8 import E4M3, E5M2, _cast_math
from tests.ops_utils import emulation
from tests.fp8_compare import Rule, _check_layouts, _interval
from tests.test_fp8_fused_op import _at, _ln_exact, _ln_input, _native_layer_norm
from tools import cuda_emu

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# (rows, cols, pad, offset of the rows' means, x_at, w_at, x dtype, weight dtype, bias, fp8,
#  rowwise, colwise, the vectorised path?): see test_fp8_fused_op's _LN_GPU_SHAPES
CASES = [
    (90, 776, 6, 0.0, 0, 0, BF16, BF16, True, E4M3, True, True, True),  # unequal chunk counts, pad rows
    (64, 2048, 0, 1000.0, 0, 0, BF16, FP32, False, E5M2, False, True, True),  # a large mean, 1B width
    (48, 264, 0, 0.0, 0, 1, FP16, FP16, True, E4M3, True, True, True),  # weight / bias misaligned
    (37, 70, 5, 0.0, 0, 0, FP16, FP32, True, E5M2, True, True, False),  # odd shape
    (64, 512, 0, 0.0, 3, 0, BF16, BF16, False, E4M3, True, False, False),  # x misaligned
]


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    return cuda_emu.LayerNormCast(emulation(tmp_path_factory, cuda_emu.LAYERNORM))


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}x{c[1]}+{c[2]}" + ("-vec" if c[-1] else "-scalar")
                                            for c in CASES])
@pytest.mark.slow
def test_emulated_cuda_kernel_gives_the_reference_bytes(kernel, case):
    """q / q_t within the fp32 rounding interval of the reference, at most one FP8 step off and
    rarely (a large mean: the interval only), pad rows zero, the amax maxed into its slot, mean /
    rstd native_layer_norm's up to a rounding; the launch takes the path the case is for."""
    rows, cols, pad, offset, x_at, w_at, dt, w_dt, with_bias, fp8, rowwise, colwise, vec = case
    g = torch.Generator().manual_seed(5)
    x = _at(_ln_input(rows, cols, dt, g, offset), x_at)
    w = _at((1 + 0.5 * torch.randn(cols, generator=g)).to(w_dt), w_at)
    b = _at((0.3 * torch.randn(cols, generator=g)).to(w_dt), w_at) if with_bias else None
    eps = 1e-5
    scale = torch.tensor([0.0, 2.5])
    amax = torch.tensor([0.0, 0.0, 0.5])
    q, q_t, mean, rstd, took_vec = kernel(x, w, b, eps, fp8, pad, rowwise, colwise, scale, 1, amax, 2)
    assert took_vec == vec
    y, rmean, rrstd = _native_layer_norm(x, w, b, eps)
    rq, _, _, ramax = _cast_math(y, scale[1], fp8, pad, True, False)
    exact, err = _ln_exact(x, w, b, eps)
    what = f"emulated {case}"
    _check_layouts(q, q_t, rq, rowwise, colwise, _interval(exact, err, dt, scale[1], fp8), rows,
                   Rule(fraction=1.0 if offset else 1e-3), 1, what)
    assert amax.tolist() == [0.0, 0.0, max(0.5, ramax.item())], what
    for got, ref in ((mean, rmean), (rstd, rrstd)):
        torch.testing.assert_close(got, ref.float(), rtol=2 ** -7, atol=1e-6, msg=what)
