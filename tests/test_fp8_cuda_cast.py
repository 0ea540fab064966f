"""The C++ FP8 cast operator ``dept_mega::cast_fp8`` (``parallel/fp8_casts.py``; kernels in
``csrc/cpu/ops_cpu.cpp``, ``csrc/cuda/fp8_cast.cu``, per-element math ``csrc/fp8_cast.h``) and the
``cuda`` casts of ``Fp8State`` / ``fp8_casts: cuda``.

On the CPU its kernel is compared with the reference math ``fp8._cast_math`` bit for bit (both
formats, both scalings, every layout, pad rows, bf16 and fp16 inputs, every bf16 and fp16 bit
pattern, NaN, ±inf, ±0, FP8 subnormals, saturation), and a training run with the ``cuda`` casts
gives the ``torch`` casts' losses exactly. The CUDA kernels run here through the host emulation of
CUDA (``tools/cuda_emu.py``): with the host's arithmetic their bytes, 1/scale and amax equal the CPU
kernel's bit for bit in each of their paths. The ``gpu`` test compares the CUDA kernel with the
Triton kernel and the reference on the device."""
from __future__ import annotations

from itertools import product

import pytest
import torch

from dept_mega.parallel import fp8_casts
from dept_mega.parallel.fp8 import E4M3, E5M2, _cast_math
from tests.ops_utils import emulation
from tests.trainer_utils import gpu_test_device, tiny_config, train_losses
from tools import cuda_emu

_WHY = fp8_casts.op_unavailable("cpu")
needs_op = pytest.mark.skipif(_WHY is not None, reason=f"dept_mega::cast_fp8 unavailable: {_WHY}")
LAYOUTS = [(True, False), (False, True), (True, True)]


def _values(kind: str, rows: int, cols: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """A [rows, cols] input: ``wide`` (normal values over 13 decades, so that a scale sends some to
    FP8 subnormals, some to saturation and some between, with ±0 and ±tiny values),
    ``specials`` (the same with ±inf and NaNs of both signs), ``bits`` (every bit pattern of
    the 16-bit dtype, rows × cols = 65536)."""
    if kind == "bits":
        return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype).reshape(rows, cols)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-9, 4, cols)
    x[0, :4] = torch.tensor([0.0, -0.0, 1e-30, -1e-30])
    x = x.to(dtype)
    if kind == "specials":
        nan = torch.tensor([0x7FC0 if dtype == torch.bfloat16 else 0x7E00], dtype=torch.int32)
        neg_nan = (nan | 0x8000).to(torch.int16).view(dtype)
        x.view(-1)[1::7] = float("inf")
        x.view(-1)[2::11] = float("-inf")
        x.view(-1)[3::13] = nan.to(torch.int16).view(dtype)
        x.view(-1)[5::17] = neg_nan
    return x


def _bytes(q: torch.Tensor) -> torch.Tensor:
    """The FP8 bytes, every NaN byte as 0x7F: the sign of a NaN is not part of the contract.
    PyTorch's own CPU conversion of an fp16 NaN keeps its sign in the vectorised body of a copy
    and drops it in the scalar tail (torch 2.13: -NaN at position 4544 of 4550 becomes
    0x7FFFFFFF), so the reference's NaN bytes depend on where they sit; bf16 NaNs keep theirs
    and the CPU kernel matches those exactly."""
    return q.view(torch.uint8).masked_fill(torch.isnan(q.float()), 0x7F)


def _same_bytes(got, ref, strict: bool = False) -> bool:
    """Same dtype, shape, strides and bytes; ``strict``: NaN bytes with their signs."""
    if got is None or ref is None:
        return got is None and ref is None
    as_bytes = (lambda q: q.view(torch.uint8)) if strict else _bytes
    return (got.dtype == ref.dtype and got.shape == ref.shape and got.stride() == ref.stride()
            and torch.equal(as_bytes(got), as_bytes(ref)))


def _same_float(a, b) -> bool:
    """Equal, NaN equal to NaN (a NaN's payload is not part of the contract)."""
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def _cases(in_dtype: torch.dtype, shapes) -> list:
    """(name, tensor, pad, scale or None) of every value kind, shape and scale. ``shapes``:
    (rows, cols, pad, offset): a nonzero offset makes the tensor a view that many elements into
    its storage (a data pointer not 16-byte aligned: the kernel's scalar loads)."""
    g = torch.Generator().manual_seed(0)
    bits = _values("bits", 256, 256, in_dtype, g)
    out = [(f"bits {in_dtype}", bits, 0, s) for s in (None, 1.0, 0.37, 2.0 ** 12)]
    for (rows, cols, pad, offset), kind in product(shapes, ("wide", "specials")):
        x = _values(kind, rows, cols, in_dtype, g)
        if offset:
            x = torch.cat([x.new_zeros(offset), x.reshape(-1)])[offset:].view(rows, cols)
        for s in (None, 3.7, 1e-3, float("nan")):
            out.append((f"{kind} {rows}x{cols}+{pad} offset {offset}", x, pad, s))
    return out


def _compare(impls: dict, device: str, in_dtype: torch.dtype, fp8: torch.dtype, shapes,
             strict: bool = False) -> list[str]:
    """Every case through the reference math and each of ``impls`` (name → a ``cast_fp8``):
    the FP8 bytes of both layouts, 1/scale (current scaling), the amax maxed into its slot
    (the slot holding 0.5 before; the other slots untouched). ``strict``: the signs of NaN
    bytes too. Returns the failures."""
    failures = []
    for name, x, pad, s in _cases(in_dtype, shapes):
        if device != "cpu":  # the same storage offset on the device
            x = torch.cat([x.new_zeros(x.storage_offset()), x.reshape(-1)]).to(device)[x.storage_offset():].view(x.shape)
        for rowwise, colwise in LAYOUTS:
            scale = None if s is None else torch.tensor([0.0, s, 0.0], device=device)
            rq, rq_t, rinv, ramax = _cast_math(x, None if scale is None else scale[1], fp8, pad, rowwise, colwise)
            want_amax = torch.maximum(torch.tensor(0.5, device=device), ramax)
            for impl, cast in impls.items():
                amax = torch.tensor([0.0, 0.0, 0.5], device=device)
                q, q_t, inv = cast(x, fp8, pad, rowwise, colwise, scale, 1, amax, 2)
                case = f"{impl}: {name} {fp8} scale={s} rowwise={rowwise} colwise={colwise}"
                if not (_same_bytes(q, rq if rowwise else None, strict) and _same_bytes(q_t, rq_t, strict)):
                    bad = _bytes(q if rowwise else q_t) != _bytes(rq if rowwise else rq_t)
                    failures.append(f"{case}: FP8 bytes differ ({int(bad.sum())} of {bad.numel()})")
                if (inv is None) != (s is not None) or (inv is not None and not _same_float(inv, rinv)):
                    failures.append(f"{case}: 1/scale {inv} != {rinv}")
                if not (_same_float(amax[2], want_amax) and amax[0] == 0 and amax[1] == 0):
                    failures.append(f"{case}: amax slots {amax.tolist()}, want [0, 0, {want_amax.item()}]")
    return failures


@needs_op
@pytest.mark.parametrize("in_dtype,fp8", list(product((torch.bfloat16, torch.float16), (E4M3, E5M2))),
                         ids=lambda v: str(v).replace("torch.", ""))
def test_cpu_operator_gives_the_reference_bytes(in_dtype, fp8):
    """Shapes: rows not a multiple of the 64-row tile, columns not a multiple of 8 or 64, pad
    rows to a multiple of 16 and more, one row. Scales: current scaling (None), a delayed scale
    that sends the wide values into FP8 subnormals and saturation, a small one, a NaN one;
    a tensor at a storage offset. bf16: NaN bytes with their signs too (see ``_bytes``)."""
    shapes = [(40, 64, 8, 0), (130, 96, 14, 0), (1, 16, 15, 0), (65, 70, 0, 0), (32, 64, 0, 4)]
    failures = _compare({"cpu op": fp8_casts.cast_fp8}, "cpu", in_dtype, fp8, shapes,
                        strict=in_dtype == torch.bfloat16)  # see _bytes
    assert not failures, "\n".join(failures[:20])


@needs_op
@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=lambda v: str(v).replace("torch.", ""))
def test_reference_casts_an_empty_tensor_as_the_operator(fp8):
    """0 rows (with and without pad rows), 0 columns, both: the reference math gives the
    operator's shapes and bytes (an empty output's strides aside), amax 0 and (current scaling)
    its 1/scale (the reference's amax, vector_norm(inf), used to raise on an empty tensor)."""
    def same(got, ref):
        if got is None or ref is None or got.numel() or ref.numel():
            return _same_bytes(got, ref, True)
        return (got.dtype, got.shape) == (ref.dtype, ref.shape)
    for (rows, cols, pad), s, gelu in product(((0, 8, 0), (0, 8, 16), (5, 0, 3), (0, 0, 2)), (None, 3.7),
                                              (False, True)):
        x = torch.empty(rows, cols, dtype=torch.bfloat16)
        for rowwise, colwise in LAYOUTS:
            scale = None if s is None else torch.tensor([0.0, s])
            rq, rq_t, rinv, ramax = _cast_math(x, None if scale is None else scale[1], fp8, pad, rowwise,
                                               colwise, gelu)
            amax = torch.tensor([0.0, 0.0, 0.5])
            q, q_t, inv = fp8_casts.cast_fp8(x, fp8, pad, rowwise, colwise, scale, 1, amax, 2, gelu)
            case = (rows, cols, pad, s, gelu, rowwise, colwise)
            assert same(q, rq if rowwise else None) and same(q_t, rq_t), case
            assert ramax.item() == 0.0 and amax.tolist() == [0.0, 0.0, 0.5], case
            assert s is not None or _same_float(inv, rinv), case


@needs_op
def test_argument_errors_are_the_operators():
    """The Python checks (run before a CUDA call) raise what the C++ checks raise."""
    x = torch.zeros(4, 16, dtype=torch.bfloat16)
    s = torch.ones(3)
    bad = [
        ((torch.zeros(2, 4, 16, dtype=torch.bfloat16), E4M3, 0, s, 0, None, 0), ValueError, "2-D tensor"),
        ((x.float(), E4M3, 0, s, 0, None, 0), TypeError, "bfloat16 or float16 tensor, got float32"),
        ((x, torch.float16, 0, s, 0, None, 0), TypeError, "float8_e4m3fn or float8_e5m2, got float16"),
        ((x, E4M3, -1, s, 0, None, 0), ValueError, "pad must be >= 0"),
        ((x, E4M3, 0, s.double(), 0, None, 0), TypeError, "scale must be float32"),
        ((x, E4M3, 0, s, 3, None, 0), ValueError, "scale index 3 is out of range for 3 elements"),
        ((x, E4M3, 0, None, 0, torch.ones(4, 2).t(), 0), ValueError, "amax_out must be contiguous"),
        ((x, E4M3, 0, None, 0, s, -1), ValueError, "amax_out index -1 is out of range"),
    ]
    for (t, dtype, pad, scale, si, amax, ai), exc, msg in bad:
        with pytest.raises(exc, match=msg):
            fp8_casts.check_args(t, dtype, pad, scale, si, amax, ai)
        with pytest.raises(exc, match=msg):
            fp8_casts.op()(t, dtype, pad, True, False, scale, si, amax, ai)


@needs_op
@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_fp8_casts_cuda_trains_exactly_as_the_torch_casts(recipe, monkeypatch):
    """``fp8_casts: cuda`` on the CPU runs the operator's CPU kernel for every cast of the
    bf16 activations, weights and gradients (counted): the losses, gradient norms and the
    evaluation equal the ``torch`` casts' bit for bit, and the log line names the operator."""
    from dept_mega.model import resolve_backends
    calls = []
    real = fp8_casts.op

    def counting():
        op = real()
        return lambda *a: calls.append(1) or op(*a)

    monkeypatch.setattr(fp8_casts, "op", counting)
    over = {"precision": "bf16", "fp8": "hybrid", "fp8_recipe": recipe, "optim": {"lr": 1.0e-2}}
    cfg = tiny_config({**over, "fp8_casts": "cuda"})
    assert "C++ cast operator dept_mega::cast_fp8" in resolve_backends(cfg, "cpu").describe()
    got = train_losses(cfg, 3)
    assert len(calls) > 100
    ref = train_losses(tiny_config({**over, "fp8_casts": "torch"}), 3)
    assert got == ref and len(set(got["loss"])) == 3


@pytest.mark.gpu
def test_cuda_operator_matches_the_triton_kernel_and_the_reference():
    """On the GPU: the CUDA kernel, the Triton kernel and the eager reference math give the same
    bytes, 1/scale and amax at training-like shapes (the vectorised path: 16-byte rows, rows a
    multiple of 16 after padding) and odd ones (the scalar path; the CUDA kernel only), for random
    values and the edge cases of the CPU test, every bf16/fp16 bit pattern included. Without a GPU under
    DEPT_MEGA_GPU_TESTS_ON_CPU=1 it rehearses with the CPU kernel against the reference."""
    device = gpu_test_device(fp8=True)
    from dept_mega.parallel import fp8_kernels
    if device == "cuda" and fp8_casts.op_unavailable(device):
        pytest.fail(f"the CUDA kernel of dept_mega::cast_fp8 is not built: {fp8_casts.op_unavailable(device)}")
    training = [(4096, 2048, 0, 0), (8192, 1024, 0, 0)]
    shapes = training + [(2040, 5632, 8, 0), (130, 72, 14, 0), (33, 12, 3, 0), (64, 256, 0, 4)]
    failures = []
    for in_dtype, fp8 in product((torch.bfloat16, torch.float16), (E4M3, E5M2)):
        failures += _compare({"cuda op": fp8_casts.cast_fp8}, device, in_dtype, fp8, shapes)
        # Triton on the training shapes only: each other shape's divisibility and alignment is a
        # specialisation of its own, compiled for every layout and scaling (~120 compiles, a minute
        # or more of the device check); test_fp8_kernels compares Triton with the reference
        if device == "cuda" and fp8_kernels.AVAILABLE:
            failures += _compare({"triton": fp8_kernels.cast_fp8}, device, in_dtype, fp8, training)
    assert not failures, "\n".join(failures[:30])


# --- the CUDA kernels, emulated on the CPU ---------------------------------------------------------

BF16, FP16 = torch.bfloat16, torch.float16
# (rows, cols, pad, element offset of x in its buffer, dtype, fp8, rowwise, colwise, delayed scale
#  (None: current scaling), amax slot?, gelu, values (_values), the vectorised path?)
EMULATED = [
    (90, 776, 6, 0, BF16, E4M3, True, True, 2.5, True, False, "wide", True),  # pad rows, a partial column tile
    (90, 776, 6, 0, FP16, E5M2, True, True, 2.0 ** 7, True, True, "wide", True),  # gelu
    (130, 96, 14, 0, BF16, E5M2, False, True, None, True, False, "wide", True),  # current: two partial maxima
    (65, 70, 7, 0, FP16, E4M3, True, True, None, True, True, "wide", False),  # current gelu, cols % 8, pad
    (32, 64, 0, 4, BF16, E4M3, True, False, 3.7, True, False, "specials", False),  # x misaligned, NaN / inf
    (40, 72, 0, 0, FP16, E4M3, True, True, 3.7, True, True, "specials", False),  # gelu of NaN / inf
    (48, 264, 0, 1, FP16, E5M2, True, True, None, False, False, "wide", False),  # current, misaligned, no slot
    (1, 16, 15, 0, BF16, E5M2, False, True, 1e-3, True, True, "wide", True),  # one row, 15 pad rows, gelu
    (64, 128, 0, 0, BF16, E4M3, False, True, 2.5, False, False, "wide", True),  # q_t, its barrier its own
    (64, 128, 0, 0, FP16, E4M3, False, False, None, True, False, "wide", True),  # no copy: 1/scale, amax
    (0, 16, 0, 0, BF16, E4M3, True, True, None, True, False, "empty", True),  # current: 1/scale of nothing
]


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    return cuda_emu.Fp8Cast(emulation(tmp_path_factory, cuda_emu.CAST))


@needs_op
@pytest.mark.parametrize("case", EMULATED, ids=[f"{c[0]}x{c[1]}+{c[2]}" + ("-gelu" if c[10] else "")
                                                + ("-current" if c[8] is None else "") + ("-vec" if c[-1] else "-scalar")
                                                for c in EMULATED])
@pytest.mark.slow
def test_emulated_cuda_kernel_equals_the_cpu_kernel(emulated, case):
    """fp8_cast.cu's kernels through tools/cuda_emu.py (current scaling: the partial maxima, then
    the cast): the cast takes the path the case is for, and the bytes of both layouts (pad rows
    included, NaN bytes with their signs), 1/scale and the amax slots equal the CPU kernel's bit
    for bit (the same host arithmetic; the CPU kernel is checked against the reference above).
    One exception, the emulation's and not the kernel's: GELU's NaNs (of NaN and -inf) rounded to
    fp16 by cuda_fp16.h's host conversion lose their sign, which c10::Half keeps (on the GPU every
    NaN byte is 0x7F), so there the NaN bytes' signs are not compared (``_bytes``)."""
    rows, cols, pad, offset, dt, fp8, rowwise, colwise, s, with_amax, gelu, kind, vec = case
    x = torch.zeros(rows, cols, dtype=dt) if kind == "empty" else _values(kind, rows, cols, dt,
                                                                            torch.Generator().manual_seed(3))
    if gelu and kind == "wide":  # the largest |x| negative: GELU's amax is another element's
        flat = x.view(-1)
        at = flat.abs().argmax()
        flat[at] = -flat[at].abs()
    x = torch.cat([x.new_zeros(offset), x.reshape(-1)])[offset:].view(rows, cols)
    assert x.data_ptr() % 16 == (2 * offset) % 16
    scale = None if s is None else torch.tensor([0.0, s])
    amax = torch.tensor([0.0, 0.0, 0.5]) if with_amax else None
    q, q_t, inv, took_vec = emulated(x, fp8, pad, rowwise, colwise, scale, 1, amax, 2, gelu)
    assert took_vec == vec
    ramax = torch.tensor([0.0, 0.0, 0.5]) if with_amax else None
    rq, rq_t, rinv = fp8_casts.cast_fp8(x, fp8, pad, rowwise, colwise, scale, 1, ramax, 2, gelu)
    strict = not (gelu and dt == FP16)
    assert _same_bytes(q, rq, strict) and _same_bytes(q_t, rq_t, strict)
    assert (inv is None) == (rinv is None) and (inv is None or _same_float(inv, rinv))
    if with_amax:
        assert _same_float(amax, ramax) and (kind == "empty" or not amax[2] <= 0.5)
