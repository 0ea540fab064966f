"""The per-step FP8 scaling state (``Fp8State``) and the Triton cast kernels (``fp8_kernels.py``).

The kernels run on CPU tensors only in Triton's interpreter, which must be switched on before
Triton is imported: those checks run in a subprocess with ``TRITON_INTERPRET=1`` (skipped when
Triton is not installed, as in the default test environment) and in-process on a CUDA GPU
(``gpu`` marker). Each check function returns its findings so both runs assert the same."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from itertools import product

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dept_mega.parallel import fp8 as fp8_module
from dept_mega.parallel import fp8_kernels as K
from dept_mega.parallel.fp8 import E4M3, E5M2, GRAD, INPUT, WEIGHT, Fp8Recipe, Fp8State, _cast_math, fp8_linear

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed: the cast kernels are checked "
                                                         "in its interpreter (pip install triton)")


def _interpreter_problem():
    """Why Triton's interpreter cannot run the kernels here, or None. Triton 3.6's interpreter
    turns a 1-element array into a loop bound with ``int()``, which numpy 2.4 refuses (the
    reduction's grid-stride loop fails with "only 0-dimensional arrays can be converted")."""
    if not HAS_TRITON:
        return None
    import importlib.metadata

    import numpy
    triton_v = tuple(int(x) for x in importlib.metadata.version("triton").split(".")[:2])
    numpy_v = tuple(int(x) for x in numpy.__version__.split(".")[:2])
    if numpy_v >= (2, 4) and triton_v <= (3, 6):
        return (f"Triton {importlib.metadata.version('triton')}'s interpreter cannot run loops under numpy "
                f"{numpy.__version__} (int() of a 1-element array); numpy < 2.4 runs it")
    return None


_INTERPRETER_PROBLEM = _interpreter_problem()
needs_interpreter = pytest.mark.skipif(_INTERPRETER_PROBLEM is not None, reason=str(_INTERPRETER_PROBLEM))
needs_cuda_triton = pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()
                                            and torch.cuda.get_device_capability() >= (8, 9)),
                                       reason="needs Triton and a CUDA GPU with FP8 (compute capability 8.9+)")


def _interpreted(check: str, module: str = "tests.test_fp8_kernels"):
    """``check('cpu')`` of ``module`` (a test module whose check functions return JSON-able
    findings) in a subprocess running Triton's interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    code = f"import json, {module} as t; print('RESULT' + json.dumps(t.{check}('cpu')))"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("RESULT")][-1][len("RESULT"):])


# ----------------------------------------------------------------------------- kernel against reference


def _same_bytes(got, ref) -> bool:
    if (got is None) != (ref is None):
        return False
    return got is None or (got.shape == ref.shape and got.stride() == ref.stride() and got.dtype == ref.dtype
                           and torch.equal(got.view(torch.uint8), ref.view(torch.uint8)))


def kernel_vs_reference(device: str) -> dict:
    """``cast_fp8`` against ``_cast_math`` on the same tensors: the FP8 bytes of both layouts,
    ``1/scale`` (current scaling) and the amax written into its slot. Rows not a multiple of the
    tile, zero-padding rows to a multiple of 16, both formats, every layout, current and delayed
    scaling; values from e4m3/e5m2 subnormals to saturation, ±0 and tiny values of both signs;
    a tensor of more blocks than partial maxima (the reduction's grid-stride loop); an all-zero
    tensor; ±inf and NaN."""
    g = torch.Generator().manual_seed(0)
    failures, cases = [], 0
    for (rows, cols, pad), dtype in product([(40, 64, 8), (130, 96, 14), (1, 16, 15)], (E4M3, E5M2)):
        x = torch.randn(rows, cols, generator=g) * torch.logspace(-9, 4, cols)
        x[0, :4] = torch.tensor([0.0, -0.0, 1e-30, -1e-30])
        x = x.bfloat16().to(device)
        for (rowwise, colwise), delayed in product([(True, False), (False, True), (True, True)], (False, True)):
            scale = torch.tensor([0.0, 3.7, 0.0], device=device) if delayed else None
            amax = torch.zeros(3, device=device)
            q, q_t, inv = K.cast_fp8(x, dtype, pad, rowwise, colwise, scale=scale, scale_index=1,
                                     amax_out=amax, amax_index=2)
            rq, rq_t, rinv, ramax = _cast_math(x, scale[1] if delayed else None, dtype, pad, rowwise, colwise)
            case = f"{rows}x{cols}+{pad} {dtype} rowwise={rowwise} colwise={colwise} delayed={delayed}"
            cases += 1
            if not (_same_bytes(q, rq) and _same_bytes(q_t, rq_t)):
                failures.append(f"{case}: FP8 bytes differ")
            if not delayed and not torch.equal(inv, rinv):
                failures.append(f"{case}: 1/scale {inv.item()} != {rinv.item()}")
            if delayed and inv is not None:
                failures.append(f"{case}: a delayed cast returned 1/scale")
            if not (amax[2] == ramax and amax[0] == 0 and amax[1] == 0):
                failures.append(f"{case}: amax {amax.tolist()} != {ramax.item()}")
    block, parts = K._AMAX_BLOCK, K._PARTS
    K._AMAX_BLOCK, K._PARTS = 16, 4  # 160 blocks over 4 programs
    try:
        x = torch.randn(40, 64, generator=g).bfloat16().to(device)
        x[37, 5] = -9.5  # the amax, in a late block of the last program
        q, _, inv = K.cast_fp8(x, E4M3, 8)
        rq, _, rinv, _ = _cast_math(x, None, E4M3, 8, True, False)
        cases += 1
        if not (_same_bytes(q, rq) and torch.equal(inv, rinv)):
            failures.append("grid-stride amax: the cast differs")
    finally:
        K._AMAX_BLOCK, K._PARTS = block, parts
    x = torch.zeros(24, 32, dtype=torch.bfloat16, device=device)  # all zero: the scale of amax 1e-12
    q, q_t, inv = K.cast_fp8(x, E5M2, 8, colwise=True)
    rq, rq_t, rinv, _ = _cast_math(x, None, E5M2, 8, True, True)
    cases += 1
    if not (_same_bytes(q, rq) and _same_bytes(q_t, rq_t) and torch.equal(inv, rinv)):
        failures.append("all-zero tensor: the cast differs")
    x = torch.randn(48, 32, generator=g).bfloat16().to(device)
    x[3, 4], x[7, 1], x[9, 9] = float("inf"), float("-inf"), float("nan")
    amax = torch.zeros(1, device=device)
    q, _, _ = K.cast_fp8(x, E4M3, scale=torch.tensor([2.0], device=device), amax_out=amax)
    rq, _, _, ramax = _cast_math(x, torch.tensor(2.0, device=device), E4M3, 0, True, False)
    finite = ~torch.isnan(rq.float())
    cases += 1
    if not (torch.isnan(amax[0]) and torch.isnan(ramax)):
        failures.append("NaN input: the amax is not NaN")
    if not torch.equal(q.view(torch.uint8)[finite], rq.view(torch.uint8)[finite]):
        failures.append("inf input: not saturated as the reference")
    if device != "cpu" and not torch.isnan(q.float()[~finite]).all():  # the interpreter has no e4m3 NaN
        failures.append("NaN input: no NaN in the FP8 copy")
    return {"cases": cases, "failures": failures}


# ----------------------------------------------------------------------------- the state, both kernels


@contextlib.contextmanager
def _eager_reference():
    """The ``torch`` casts eagerly on every device (on CUDA they are compiled by default, and
    inductor's arithmetic is not the reference's)."""
    real = fp8_module._cast
    fp8_module._cast = lambda t, scale, dtype, pad=0, rowwise=True, colwise=False, gelu=False: _cast_math(
        t, scale, dtype, pad, rowwise, colwise, gelu)
    try:
        yield
    finally:
        fp8_module._cast = real


def _run_steps(state: Fp8State, device: str, steps: int = 3, micro_batches: int = 2):
    """``steps`` training steps of one FP8 linear layer, ``micro_batches`` forwards and
    backwards each, inputs of changing range: outputs, gradients, history and scales."""
    layer = state.new_layer()
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(96, 64, generator=g) * 0.02).bfloat16().to(device).requires_grad_()
    outs = []
    for step in range(steps):
        state.begin_step()
        for mb in range(micro_batches):
            x = (torch.randn(40, 64, generator=g) * (1 + step + mb)).bfloat16().to(device).requires_grad_()
            gy = torch.randn(40, 96, generator=g).bfloat16().to(device)
            y = fp8_linear(x, w, layer)
            outs += [y.detach(), *torch.autograd.grad(y, (x, w), gy)]
        state.end_step()
    return outs, state.history.clone(), state.scale.clone()


def state_kernels_agree(device: str) -> dict:
    """Three delayed-scaling steps through an ``Fp8State`` with the Triton kernels and one with
    the reference casts: the same outputs, gradients, amax history and scales, bit for bit."""
    recipe = Fp8Recipe("hybrid", "delayed", amax_history=2)
    with _eager_reference():
        got = _run_steps(Fp8State(recipe, device, kernels="triton"), device)
        ref = _run_steps(Fp8State(recipe, device, kernels="torch"), device)
    failures = [f"output {i} differs" for i, (a, b) in enumerate(zip(got[0], ref[0])) if not torch.equal(a, b)]
    failures += [f"{k} differs" for k, a, b in (("history", got[1], ref[1]), ("scale", got[2], ref[2]))
                 if not torch.equal(a, b)]
    return {"tensors": len(got[0]), "failures": failures, "history_rows_used": int((got[1] > 0).any(1).sum())}


# ----------------------------------------------------------------------------- launches per cast

_NO_KERNEL = {"empty.memory_format", "new_empty.default", "t.default", "view.default", "_unsafe_view.default",
              "slice.Tensor", "alias.default", "detach.default", "transpose.int", "select.int", "as_strided.default",
              "expand.default", "_reshape_alias.default", "reshape.default", "unsqueeze.default", "squeeze.dim"}


class _OpLog(TorchDispatchMode):
    """The ATen ops that launch work (views and allocations left out), outside our kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__) + "." + func._overloadname
        if not self.paused and name not in _NO_KERNEL:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


class _CountingKernel:
    def __init__(self, kernel, log: _OpLog, counts: list) -> None:
        self.kernel, self.log, self.counts = kernel, log, counts

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.counts.append(1)
            self.log.paused = True  # the interpreter's own tensor copies are not launches
            try:
                return launch(*args, **kwargs)
            finally:
                self.log.paused = False
        return run


def launches_per_cast(device: str) -> dict:
    """What the host launches per FP8 linear call with the Triton casts: per step (the first
    current-scaled, the others delayed) and micro-batch, the kernels of the casts in the forward
    (input, plus the weight in the first micro-batch) and the backward (output gradient), and
    every other ATen op that is not a view or an allocation."""
    state = Fp8State(Fp8Recipe("hybrid", "delayed", amax_history=4), device, kernels="triton")
    layer = state.new_layer()
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(96, 64, generator=g) * 0.02).bfloat16().to(device).requires_grad_()
    log, counts = _OpLog(), []
    real = K._cast_kernel, K._amax_parts_kernel
    K._cast_kernel, K._amax_parts_kernel = (_CountingKernel(k, log, counts) for k in real)
    out = []
    try:
        for _ in range(2):
            state.begin_step()
            for _ in range(2):
                x = torch.randn(40, 64, generator=g).bfloat16().to(device).requires_grad_()
                gy = torch.randn(40, 96, generator=g).bfloat16().to(device)
                for phase in ("forward", "backward"):
                    counts.clear()
                    log.ops.clear()
                    with log:
                        if phase == "forward":
                            y = fp8_linear(x, w, layer)
                        else:
                            torch.autograd.grad(y, (x, w), gy)
                    out.append([phase, len(counts), list(log.ops)])
            state.end_step()
    finally:
        K._cast_kernel, K._amax_parts_kernel = real
    return {"calls": out}


EXPECTED_LAUNCHES = [  # (phase, cast kernels) per micro-batch: 2 steps × 2 micro-batches
    ("forward", 4), ("backward", 2), ("forward", 2), ("backward", 2),  # first step: amax + cast per cast
    ("forward", 2), ("backward", 1), ("forward", 1), ("backward", 1),  # then one kernel per cast
]


def _check_launches(res: dict) -> None:
    got = [(phase, n) for phase, n, _ in res["calls"]]
    assert got == EXPECTED_LAUNCHES, got
    for phase, _, ops in res["calls"]:  # besides the casts only the GEMMs launch work
        assert ops == ["_scaled_mm.default"] * (1 if phase == "forward" else 2), (phase, ops)


@needs_triton
@needs_interpreter
def test_triton_kernels_in_the_interpreter_match_the_reference():
    res = _interpreted("kernel_vs_reference")
    assert res["cases"] == 3 * 2 * 6 + 3 and not res["failures"], res["failures"]
    res = _interpreted("state_kernels_agree")
    assert res["tensors"] == 3 * 2 * 3 and res["history_rows_used"] == 3 and not res["failures"], res
    _check_launches(_interpreted("launches_per_cast"))


@pytest.mark.gpu
@needs_cuda_triton
def test_triton_kernels_on_cuda_match_the_reference():
    res = kernel_vs_reference("cuda")
    assert not res["failures"], res["failures"]
    res = state_kernels_agree("cuda")
    assert not res["failures"], res
    _check_launches(launches_per_cast("cuda"))


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the gpu-marked test compiles them for the device")
def test_triton_kernels_compile_for_an_h100():
    """The interpreter does not compile: compile the kernels ahead of time for sm_90 (no GPU
    needed) in the variants a training step uses, and check the PTX converts with the hardware's
    saturating round-to-nearest instruction and updates the amax atomically."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import triton
    target = GPUTarget("cuda", 90, 32)
    amax = triton.compile(ASTSource(fn=K._amax_parts_kernel, constexprs={"BLOCK": K._AMAX_BLOCK},
                                    signature={"x_ptr": "*bf16", "parts_ptr": "*fp32", "n": "i32", "nprog": "i32",
                                               "BLOCK": "constexpr"}), target=target)
    assert ".entry" in amax.asm["ptx"]
    for fmt, dtype, current in [("fp8e4nv", E4M3, False), ("fp8e5", E5M2, True)]:
        fmax, mbits, emin = K._FORMATS[dtype]
        consts = dict(FMAX=fmax, MBITS=mbits, EMIN=emin, MIN_AMAX=K._MIN_AMAX, CURRENT=current, RECORD=True,
                      ROWWISE=True, COLWISE=True, PARTS=K._PARTS, BLOCK_M=K._TILE, BLOCK_N=K._TILE)
        sig = {"x_ptr": "*bf16", "q_ptr": f"*{fmt}", "qt_ptr": f"*{fmt}", "scale_ptr": "*fp32", "inv_ptr": "*fp32",
               "parts_ptr": "*fp32", "amax_ptr": "*fp32", **{k: "i32" for k in (
                   "rows", "cols", "out_rows", "nparts", "scale_index", "amax_index")}, **{k: "constexpr" for k in consts}}
        ptx = triton.compile(ASTSource(fn=K._cast_kernel, signature=sig, constexprs=consts), target=target).asm["ptx"]
        assert f"cvt.rn.satfinite.{'e4m3' if dtype == E4M3 else 'e5m2'}x2.f32" in ptx and "atom.global" in ptx


def test_the_triton_path_is_refused_where_it_cannot_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    recipe = Fp8Recipe("hybrid", "delayed")
    with pytest.raises(ValueError, match="'triton' (need Triton|on cpu need Triton's interpreter)"):
        Fp8State(recipe, "cpu", kernels="triton")
    with pytest.raises(ValueError, match="not one of auto"):
        Fp8State(recipe, "cpu", kernels="bogus")
    assert Fp8State(recipe, "cpu").kernels == "torch"
    # the config key: refused at resolve time, naming the key; torch is always available
    from dept_mega.config import ConfigError
    from dept_mega.model import resolve_backends
    from tests.trainer_utils import tiny_config
    base = {"fp8": "hybrid", "backend": "local", "precision": "bf16"}
    with pytest.raises(ConfigError, match="config key 'fp8_casts': FP8 cast kernels 'triton'"):
        resolve_backends(tiny_config({**base, "fp8_casts": "triton"}), "cpu")
    assert resolve_backends(tiny_config({**base, "fp8_casts": "torch"}), "cpu").fp8_casts == "torch"
    with pytest.raises(ConfigError, match="fp8_casts"):
        tiny_config({**base, "fp8_casts": "bogus"})


# ----------------------------------------------------------------------------- per-step scale semantics


def test_delayed_scale_is_fp8_max_over_the_largest_amax_of_the_previous_n_steps(monkeypatch):
    """History length 2. Step k's inputs (two micro-batches) have the amaxes below; step 0 is
    current-scaled (each micro-batch by its own amax), step k ≥ 1 uses 448 / (the largest amax
    of steps k-2 and k-1) for both micro-batches. The history row of a step holds the larger
    amax of its two micro-batches; evaluations and calls outside a step use current scaling and
    leave the history and scales alone."""
    amaxes = [(4.0, 1.0), (2.0, 0.5), (0.25, 8.0), (1.0, 1.0), (3.0, 2.0), (0.5, 0.5), (1.0, 1.0)]
    inv_used = []
    real_mm = fp8_module._scaled_mm
    monkeypatch.setattr(fp8_module, "_scaled_mm", lambda a, b, sa, sb, *f: inv_used.append((sa, sb)) or real_mm(a, b, sa, sb, *f))
    state = Fp8State(Fp8Recipe("hybrid", "delayed", amax_history=2), "cpu")
    layer = state.new_layer()
    w = torch.eye(16).bfloat16() * 0.5
    pattern = torch.linspace(-1, 1, 16 * 16).reshape(16, 16)
    fmax = torch.tensor(448.0)
    for k, step in enumerate(amaxes):
        state.begin_step()
        for a in step:
            inv_used.clear()
            fp8_linear((pattern * a).bfloat16(), w, layer)
            (x_inv, w_inv), = inv_used
            if k == 0:
                want = (448.0 / torch.tensor(a).clamp(min=1e-12)).reciprocal()
                want_w = (448.0 / torch.tensor(0.5)).reciprocal()
            else:
                past = max(max(s) for s in amaxes[max(0, k - 2):k])
                want = (fmax / torch.tensor(past)).reciprocal()
                want_w = (fmax / torch.tensor(0.5)).reciprocal()
            assert torch.equal(x_inv, want) and torch.equal(w_inv, want_w), (k, a, x_inv, want)
        state.end_step()
        assert state.history[state.pos, INPUT] == max(step) and state.history[state.pos, WEIGHT] == 0.5
        assert state.history[state.pos, GRAD] == 0  # no backward ran
    before = (state.history.clone(), state.scale.clone(), state.pos)
    for train_step_open in (False, None):  # an evaluation step, then no step open
        if train_step_open is not None:
            state.begin_step(train=train_step_open)
        inv_used.clear()
        fp8_linear((pattern * 100).bfloat16(), w, layer)
        assert torch.equal(inv_used[0][0], (448.0 / torch.tensor(100.0)).reciprocal())  # current scaling
        if state.mode is not None:
            state.end_step()
    assert torch.equal(state.history, before[0]) and torch.equal(state.scale, before[1]) and state.pos == before[2]


def test_nonfinite_amaxes_are_left_out_and_a_column_without_amax_keeps_its_scale():
    """A step's non-finite amaxes (inf/NaN values) are left out of later windows, and an operand
    whose window has no positive amax left (an all-zero tensor, or only non-finite entries)
    keeps its scale (Transformer Engine's rule); e5m2 gradient columns scale to 57344."""
    def run(history, steps):
        state = Fp8State(Fp8Recipe("hybrid", "delayed", amax_history=history), "cpu")
        layer = state.new_layer()
        w = torch.eye(16).bfloat16().requires_grad_()
        for x, gy in steps:
            state.begin_step()
            y = fp8_linear(torch.full((16, 16), x).bfloat16().requires_grad_(), w, layer)
            torch.autograd.grad(y, (w,), torch.full((16, 16), gy).bfloat16())
            state.end_step()
        return state
    # window 1: step 1 (input 0, grad inf) leaves step 2 with step 1's scales, from step 0
    state = run(1, [(2.0, 4.0), (0.0, float("inf")), (1.0, 1.0)])
    assert state.history[1].tolist() == [0.0, 1.0, float("inf")]
    assert state.scale.tolist() == [224.0, 448.0, 57344.0 / 4]
    # window 2: step 3's gradient scale comes from step 1 (2), step 2's inf left out
    state = run(2, [(1.0, 4.0), (1.0, 2.0), (1.0, float("inf")), (1.0, 1.0)])
    assert state.scale.tolist() == [448.0, 448.0, 57344.0 / 2]
