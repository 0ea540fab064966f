"""``fp8_gemm_tuning``: the cuBLASLt FP8 GEMMs time cuBLASLt's candidate algorithms on each
problem's first call and keep the fastest (``csrc/cuda/fp8_gemm_lt.cpp``, ``pick_fastest``).

On the CPU: the operator's ``tune`` argument is checked as the other arguments are (the Python
checks and the operator, the same message) and ignored by the CPU kernel (same bytes, nothing
logged); the config's bounds and conflicts; the backends pass the setting to the FP8 state only
with the cuBLASLt GEMM on a GPU and say in the run log where it does not apply; every GEMM of an
FP8 linear (forward, input gradient, the weight gradient accumulated into ``main_grad``) gets it;
the run log's summary of a tuning. The ``gpu`` test checks on the GPU that tuning never writes
into the output (an accumulating GEMM adds the product once), logs every candidate and keeps a
candidate no slower than the heuristic's first; and that a problem first seen untuned (tune 0, or
inside a CUDA graph capture) is still tuned on its first call with tune > 1 (UNVERIFIED until run
on a GPU)."""
from __future__ import annotations

import pytest
import torch

from dept_mega.config import ConfigError
from dept_mega.model import resolve_backends
from dept_mega.model.backends import BackendError
from dept_mega.parallel import fp8_gemm
from dept_mega.parallel.fp8 import E4M3, E5M2, Fp8Recipe, Fp8State, fp8_linear
from tests.test_fp8_auto import cuda_here  # noqa: F401 - the fixture
from tests.test_fp8_gemm import _bound, _operands, _ref_fp32
from tests.trainer_utils import gpu_test_device, tiny_config

_WHY = fp8_gemm.op_unavailable("cpu")
needs_op = pytest.mark.skipif(_WHY is not None, reason=f"dept_mega::fp8_gemm unavailable: {_WHY}")
FP8 = {"precision": "bf16", "fp8": "hybrid"}


@needs_op
@pytest.mark.parametrize("tune", [-1, 65])
def test_tune_out_of_range_is_named_by_both_checks(tune):
    g = torch.Generator().manual_seed(3)
    a, b, sa, sb = _operands(32, 64, 48, E4M3, E4M3, g)
    msg = f"fp8_gemm: tune must be between 0 and 64 \\(the algorithms to time\\), got {tune}"
    with pytest.raises(ValueError, match=msg):
        fp8_gemm.check_args(a, b, sa, sb, None, False, tune)
    with pytest.raises(ValueError, match=msg):  # the operator's C++ check, the same message
        fp8_gemm.op()(a, b, sa, sb, False, None, False, tune)


@needs_op
def test_the_cpu_kernel_ignores_tune():
    g = torch.Generator().manual_seed(4)
    a, b, sa, sb = _operands(48, 64, 32, E5M2, E4M3, g)
    fp8_gemm.tuning_log(clear=True)
    plain = fp8_gemm.fp8_gemm(a, b, sa, sb)
    tuned = fp8_gemm.fp8_gemm(a, b, sa, sb, tune=8)
    assert torch.equal(plain.view(torch.int16), tuned.view(torch.int16))
    out = torch.ones(48, 32)
    fp8_gemm.fp8_gemm(a, b, sa, sb, out=out, tune=8)
    assert torch.equal(out, 1 + _ref_fp32(a, b, sa, sb))
    assert fp8_gemm.tuning_log() == []


@pytest.mark.parametrize("over,err", [
    ({"fp8_gemm_tuning": 65}, "'fp8_gemm_tuning': at most 64 algorithms are timed, got 65"),
    ({"fp8_gemm_tuning": -1}, "'fp8_gemm_tuning': must be >= 0, got -1"),
    ({**FP8, "fp8_gemm": "torch", "fp8_gemm_tuning": 8}, "'fp8_gemm_tuning': 8 times the algorithms of the cublaslt"),
    ({**FP8, "backend": "transformer_engine", "fp8_gemm_tuning": 8},
     "'fp8_gemm_tuning': 8 applies to the native FP8 linears"),
])
def test_config_refuses(over, err):
    with pytest.raises(ConfigError, match=err):
        tiny_config(over)


def test_tuning_off_or_one_is_accepted_everywhere():
    for n in (0, 1):
        tiny_config({**FP8, "fp8_gemm": "torch", "fp8_gemm_tuning": n})


def test_backends_apply_it_to_cublaslt_on_a_gpu_only(cuda_here):  # noqa: F811 - the fixture
    cfg = tiny_config({**FP8, "fp8_gemm_tuning": 8})
    b = resolve_backends(cfg, "cuda")
    assert (b.fp8_gemm, b.fp8_gemm_tuning) == ("cublaslt", 8)
    assert "cuBLASLt operator dept_mega::fp8_gemm, weight gradients accumulated into main_grad by the GEMM tuned " \
           "over 8 candidates" in b.describe()
    assert resolve_backends(tiny_config(FP8), "cuda").fp8_gemm_tuning == 0
    # auto takes torch._scaled_mm (no GEMM operator): said, not applied
    cuda_here.set(gemm_op=False)
    b = resolve_backends(cfg, "cuda")
    assert (b.fp8_gemm, b.fp8_gemm_tuning) == ("torch", 0)
    assert "fp8_gemm_tuning 8 not applied: the FP8 GEMMs are torch._scaled_mm" in b.describe()
    cpu = resolve_backends(cfg, "cpu")
    assert cpu.fp8_gemm_tuning == 0 and "fp8_gemm_tuning 8 not applied: the FP8 GEMMs are torch._scaled_mm" \
        in cpu.describe()


@needs_op
def test_backends_on_the_cpu_kernel_say_it_has_one_algorithm():
    b = resolve_backends(tiny_config({**FP8, "fp8_gemm": "cublaslt", "fp8_gemm_tuning": 8}), "cpu")
    assert b.fp8_gemm_tuning == 0
    assert "fp8_gemm_tuning 8 not applied: the operator's cpu kernel has one algorithm" in b.describe()


def test_auto_choosing_transformer_engine_refuses_it(cuda_here, monkeypatch):  # noqa: F811 - the fixture
    from dept_mega.model import backends as backends_module
    monkeypatch.setattr(backends_module, "_resolve_linear", lambda cfg, device: ("transformer_engine", []))
    with pytest.raises(BackendError, match="'fp8_gemm_tuning': 8 applies to the native FP8 linears"):
        resolve_backends(tiny_config({**FP8, "fp8_gemm_tuning": 8}), "cuda")


@needs_op
def test_every_gemm_of_the_fp8_linear_gets_tune(monkeypatch):
    """Forward, input gradient and the weight gradient accumulated into main_grad (a training
    step with a gradient buffer), each calls the operator with tune; without tuning none passes it."""
    from dept_mega.grad_buffer import GradBuffer, GradSync
    from dept_mega.parallel.groups import build_groups
    real = fp8_gemm.op()
    calls = []

    def spy(*args, **kwargs):
        calls.append((args[5] is not None if len(args) > 5 else "out" in kwargs, kwargs.get("tune")))
        return real(*args, **kwargs)

    monkeypatch.setattr(fp8_gemm, "op", lambda: spy)
    for tuning in (8, 0):
        calls.clear()
        state = Fp8State(Fp8Recipe("hybrid", "current"), "cpu", kernels="torch", gemm="cublaslt", gemm_tuning=tuning)
        layer = state.new_layer()
        w = torch.nn.Parameter(torch.randn(96, 64).bfloat16())
        buf = GradBuffer([w], torch.float32, torch.device("cpu"), bucket_size=1 << 20)
        buf.adopt()
        sync = GradSync(build_groups(), overlap=False)
        sync.begin([buf], {id(w): 1})
        state.begin_step()
        x = torch.randn(32, 64).bfloat16().requires_grad_()
        fp8_linear(x, w, layer).backward(torch.randn(32, 96).bfloat16())
        state.end_step()
        sync.finish()
        want = tuning if tuning > 1 else None
        assert sorted(calls, key=str) == sorted([(False, want), (False, want), (True, want)], key=str), calls


def test_describe_tuning_sums_what_was_kept():
    rows = [dict(m=8192, n=2048, k=8192, accumulate=False, how="timed", ms=[0.2, 0.18, None], chosen=1),
            dict(m=2048, n=8192, k=8192, accumulate=True, how="timed", ms=[0.3, 0.31], chosen=0),
            dict(m=64, n=64, k=64, accumulate=False, how="one candidate", ms=[None], chosen=0)]
    line = fp8_gemm.describe_tuning(rows)
    assert line.startswith("fp8_gemm_tuning: 3 problems tuned; kept 0.480 ms against the heuristic's first 0.500 ms: ")
    assert "8192x2048x8192 #1 of 3 0.180 ms (first 0.200)" in line
    assert "2048x8192x8192 acc #0 of 2 0.300 ms (first 0.300)" in line and "64x64x64: one candidate" in line
    assert fp8_gemm.describe_tuning([]) == "fp8_gemm_tuning: no problem tuned"


@pytest.mark.gpu
def test_tuning_times_candidates_without_touching_the_output():
    """On the GPU: a problem tuned over 8 candidates, accumulating into out (beta = 1), adds the
    product once (the candidates ran on a scratch copy); the log names the problem, every
    candidate's time and keeps one no slower than the heuristic's first; a second call of the
    problem is not tuned again and gives the same bytes as the first. Without a GPU
    (DEPT_MEGA_GPU_TESTS_ON_CPU=1) it rehearses on the CPU kernel (tune ignored, nothing logged)."""
    device = gpu_test_device(fp8=True)
    if device == "cuda" and fp8_gemm.op_unavailable(device):
        pytest.fail(f"the CUDA kernel of dept_mega::fp8_gemm is not built: {fp8_gemm.op_unavailable(device)}")
    m, k, n = (4096, 2048, 1536) if device == "cuda" else (64, 128, 96)  # a shape no other test uses
    g = torch.Generator(device=device).manual_seed(9)
    a, b, sa, sb = _operands(m, k, n, E4M3, E5M2, g, device)
    prod = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32) if device == "cuda" \
        else _ref_fp32(a, b, sa, sb)
    fp8_gemm.tuning_log(clear=True)
    out0 = torch.randn(m, n, generator=g, device=device)
    out = out0.clone()
    fp8_gemm.fp8_gemm(a, b, sa, sb, out=out, tune=8)
    tol = _bound(a, b, sa, sb, k) + 2.0 ** -24 * (out0 + prod).abs() * 2
    assert ((out - (out0 + prod)).abs() <= tol).all()
    rows = fp8_gemm.tuning_log(clear=True)
    if device != "cuda":
        assert rows == []
        return
    assert len(rows) == 1, rows
    r = rows[0]
    assert (r["m"], r["n"], r["k"], r["accumulate"], r["out"]) == (m, n, k, True, "float32"), r
    assert r["how"] in ("timed", "one candidate") and 1 <= len(r["ms"]) <= 8
    assert len(r["algo_ids"]) == len(r["tile_ids"]) == len(r["ms"]) and 0 <= r["chosen"] < len(r["ms"])
    if r["how"] == "timed" and r["ms"][0] is not None:
        assert r["ms"][r["chosen"]] <= r["ms"][0]
    first = fp8_gemm.fp8_gemm(a, b, sa, sb, tune=8)
    again = fp8_gemm.fp8_gemm(a, b, sa, sb, tune=8)
    assert torch.equal(first.view(torch.int16), again.view(torch.int16))
    assert len(fp8_gemm.tuning_log()) == 1  # the bf16-output problem, tuned once
    print("fp8_gemm tuning:", fp8_gemm.describe_tuning(rows + fp8_gemm.tuning_log()))


@pytest.mark.gpu
def test_a_problem_first_seen_untuned_is_tuned_later():
    """On the GPU: the algorithm cache keeps apart how a problem's algorithm was chosen. A problem
    first called with tune=0 is timed on its first call with tune=4 (once: a third call is not);
    a problem first called with tune=4 inside a CUDA graph capture (no timing there: the
    heuristic's first, said once) is timed on its first uncaptured call, and the graph replays
    the same product. Without a GPU (DEPT_MEGA_GPU_TESTS_ON_CPU=1): the CPU kernel logs
    nothing whatever tune says, and the capture part is left out (CUDA graphs need CUDA)."""
    device = gpu_test_device(fp8=True)
    if device == "cuda" and fp8_gemm.op_unavailable(device):
        pytest.fail(f"the CUDA kernel of dept_mega::fp8_gemm is not built: {fp8_gemm.op_unavailable(device)}")
    g = torch.Generator(device=device).manual_seed(11)
    # shapes no other test of this file uses (the cache lives as long as the process)
    a, b, sa, sb = _operands(*((1024, 512, 768) if device == "cuda" else (32, 64, 48)), E4M3, E4M3, g, device)
    fp8_gemm.tuning_log(clear=True)
    untuned = fp8_gemm.fp8_gemm(a, b, sa, sb, tune=0)
    assert fp8_gemm.tuning_log() == []
    tuned = fp8_gemm.fp8_gemm(a, b, sa, sb, tune=4)
    fp8_gemm.fp8_gemm(a, b, sa, sb, tune=4)
    rows = fp8_gemm.tuning_log(clear=True)
    if device != "cuda":
        assert rows == [] and torch.equal(untuned.view(torch.int16), tuned.view(torch.int16))
        return
    assert len(rows) == 1 and (rows[0]["m"], rows[0]["n"], rows[0]["k"]) == (1024, 768, 512), rows
    assert rows[0]["how"] in ("timed", "one candidate"), rows
    assert _within_a_bf16_ulp(tuned, untuned, _bound(a, b, sa, sb, 512))  # another algorithm: another order

    a, b, sa, sb = _operands(512, 1024, 256, E4M3, E4M3, g, device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fp8_gemm.fp8_gemm(a, b, sa, sb, tune=4)
    rows = fp8_gemm.tuning_log(clear=True)
    assert len(rows) == 1 and rows[0]["how"].startswith("not timed: the stream is being captured"), rows
    assert (rows[0]["m"], rows[0]["n"], rows[0]["k"], rows[0]["chosen"]) == (512, 256, 1024, 0), rows
    eager = fp8_gemm.fp8_gemm(a, b, sa, sb, tune=4)
    rows = fp8_gemm.tuning_log(clear=True)
    assert len(rows) == 1 and rows[0]["how"] in ("timed", "one candidate"), rows
    graph.replay()
    torch.cuda.synchronize()
    assert _within_a_bf16_ulp(captured, eager, _bound(a, b, sa, sb, 1024))


def _within_a_bf16_ulp(x, y, bound):
    """Two bf16 products of the same operands summed in other orders: the fp32 summation bound plus
    one bf16 rounding of the larger."""
    ulp = torch.finfo(torch.bfloat16).eps * torch.maximum(x.float().abs(), y.float().abs())
    return bool(((x.float() - y.float()).abs() <= bound + ulp).all())


def test_the_run_log_says_what_the_first_step_tuned(monkeypatch):
    from types import SimpleNamespace

    from dept_mega.loop import TrainLoop
    rows = [dict(m=8192, n=2048, k=8192, accumulate=False, how="timed", ms=[0.2, 0.18], chosen=1)]
    cleared = []
    monkeypatch.setattr(fp8_gemm, "tuning_log", lambda clear=False: cleared.append(clear) or rows)
    for fp8, tuning, logged in (("hybrid", 8, True), ("hybrid", 0, False), (None, 8, False)):
        lines = []
        fake = SimpleNamespace(cfg=SimpleNamespace(fp8=fp8, fp8_gemm_tuning=tuning),
                               writer=SimpleNamespace(log=lines.append))
        TrainLoop._log_gemm_tuning(fake)
        assert lines == ([fp8_gemm.describe_tuning(rows)] if logged else []), (fp8, tuning)
    assert cleared == [True]
