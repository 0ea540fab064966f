"""The direct launches of our Triton kernels (``parallel/triton_launch.py``).

Three levels: the launcher's cache logic with a stand-in kernel (runs everywhere); against
Triton's own code with a stand-in driver and compiler, in a subprocess (needs Triton; its
launch path, not the GPU): the cache key refines Triton's specialisation and a direct launch
passes the compiled kernel's launcher exactly the arguments Triton's ``run`` passes; and on a
CUDA GPU, the casts launched directly give the reference bytes (``gpu`` marker)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from dept_mega.parallel import triton_launch as TL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_TRITON = importlib.util.find_spec("triton") is not None


class _Compiled:
    """A compiled kernel stand-in: records its launcher's calls."""

    def __init__(self, log: list) -> None:
        self.function, self.packed_metadata, self.log = object(), (4, 1), log

    def run(self, *a) -> None:
        self.log.append(("direct", a))


class _Kernel:
    """A ``JITFunction`` stand-in: three runtime parameters, then two constexprs."""

    def __init__(self) -> None:
        self.params = [SimpleNamespace(name=n, is_constexpr=c) for n, c in
                       (("x", False), ("n", False), ("eps", False), ("A", True), ("B", True))]
        self.log: list = []

    def run(self, *args, grid, warmup, num_warps, **consts):
        self.log.append(("triton", args, grid, warmup, num_warps, consts))
        return _Compiled(self.log)


class _Driver:
    def __init__(self) -> None:
        self.device, self.stream = 0, 7

    def get_current_device(self) -> int:
        return self.device

    def get_current_stream(self, device: int) -> int:
        return self.stream + device


def test_ceil_div():
    for a in range(0, 70):
        for b in (1, 2, 16, 64):
            assert TL.ceil_div(a, b) == -(-a // b) == (a + b - 1) // b


def _variants(x: torch.Tensor):
    """(name, args, consts, num_warps, device) of launches that each need their own kernel
    after the base launch: every fact Triton specialises on, changed one at a time."""
    base = ((x, 32, 1e-5), {"A": 1, "B": True}, 4, 0)
    yield "base", *base
    yield "unaligned tensor", (x[1:], 32, 1e-5), *base[1:]
    yield "other dtype", (x.half(), 32, 1e-5), *base[1:]
    yield "int 1", (x, 1, 1e-5), *base[1:]
    yield "int not divisible by 16", (x, 33, 1e-5), *base[1:]
    yield "int beyond 32 bits", (x, 2 ** 31 + 32, 1e-5), *base[1:]
    yield "int beyond signed 64 bits", (x, 2 ** 63 + 32, 1e-5), *base[1:]
    yield "constexpr", base[0], {"A": 2, "B": True}, *base[2:]
    yield "num_warps", base[0], base[1], 8, 0
    yield "device", base[0], base[1], 4, 1


def test_direct_launcher_compiles_once_per_key_then_launches_directly():
    kernel, drv = _Kernel(), _Driver()
    launcher = TL.DirectLauncher(kernel, drv)
    x = torch.zeros(64, dtype=torch.bfloat16)
    seen = 0
    for name, args, consts, warps, device in _variants(x):
        drv.device = device
        for repeat in range(3):
            launcher((5, 2), args, consts, warps)
            kind = kernel.log[-1][0]
            assert kind == ("triton" if repeat == 0 else "direct"), (name, repeat, kind)
        seen += 1
        assert len(launcher.compiled) == seen, name  # a key of its own
        first, direct = kernel.log[-3], kernel.log[-1]
        assert first[1:] == (args, (5, 2), False, warps, consts)
        # the launcher's arguments as Triton's run passes them: grid (3-D), stream, function,
        # metadata, no launch metadata or hooks, then every parameter in order
        compiled = launcher.compiled[TL.specialization_key(device, warps, args, consts, TL.compile_modes(kernel))]
        assert direct[1] == (5, 2, 1, 7 + device, compiled.function, compiled.packed_metadata, None, None, None,
                             *args, *consts.values())
    assert launcher.direct_launches == 2 * seen
    # Triton's per-call compile options (debug here) are part of the key: a change compiles anew
    drv.device = 0
    kernel.debug = True
    launcher((5, 2), *next(_variants(x))[1:4])
    assert kernel.log[-1][0] == "triton" and len(launcher.compiled) == seen + 1


def test_direct_launcher_refuses_arguments_it_cannot_order():
    launcher = TL.DirectLauncher(_Kernel(), _Driver())
    x = torch.zeros(64, dtype=torch.bfloat16)
    launcher((1,), (x, 32, 1e-5), {"A": 1, "B": 1}, 4)  # compiled and cached under A, B
    with pytest.raises(ValueError, match=r"constexprs \('A', 'B'\) in that order"):
        launcher((1,), (x, 32, 1e-5), {"B": 1, "A": 1}, 4)  # the same values in another order: not that kernel
    with pytest.raises(ValueError, match="3 runtime arguments"):
        launcher((1,), (x, 32), {"A": 1, "B": True}, 4)
    bad = _Kernel()
    bad.params.insert(0, SimpleNamespace(name="C", is_constexpr=True))
    with pytest.raises(ValueError, match="must come after the runtime ones"):
        TL.DirectLauncher(bad, _Driver())


def test_launch_takes_tritons_own_path_for_other_kernels():
    """A kernel that is not a compiled JITFunction (the interpreter's, a test double) is
    launched as ``kernel[grid](...)`` every time."""
    calls = []

    class Double:
        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((grid, a, kw))

    k = Double()
    assert TL.launcher_of(k) is None and "launched by Triton" in TL.describe(k)
    TL.launch(k, (3,), (1, 2), {"A": 1}, 8)
    TL.launch(k, (3,), (1, 2), {"A": 1}, 8)
    assert calls == [((3,), (1, 2), {"A": 1, "num_warps": 8})] * 2


# ------------------------------------------------------------------ against Triton's own code

def against_triton() -> dict:
    """With a stand-in driver (sm_90) and compiler, through Triton's real ``JITFunction.run``:
    (1) for each of our FP8 kernels and many argument variants, every key of ours maps to one
    key of Triton's kernel cache; (2) the launcher arguments of a direct launch equal those
    Triton's run passes for the same call (launch metadata and hooks aside)."""
    import importlib.util

    import triton.runtime.jit as J

    from dept_mega.parallel import fp8_kernels as K
    from dept_mega.parallel import fp8_norm_kernels as N

    spec = importlib.util.spec_from_file_location("triton_launch_bench", os.path.join(ROOT, "benchmarks",
                                                                                      "triton_launch_bench.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    log: list = []
    with bench.stand_in_triton(log):
        return _against_triton(J, K, N, log)


def _against_triton(J, K, N, log) -> dict:
    bf = torch.zeros(4096, dtype=torch.bfloat16)
    f32 = torch.zeros(64)
    fp8 = torch.zeros(4096, dtype=torch.uint8).view(torch.float8_e4m3fn)
    tensors = [bf, bf[1:], bf[8:], bf.half(), f32, f32[1:]]
    ints = [0, 1, 2, 16, 17, 48, 2 ** 31 - 16, 2 ** 31, 2 ** 31 + 16, 2 ** 63 + 16]
    consts_cast = {"FMAX": 448.0, "MBITS": 3, "EMIN": -6, "MIN_AMAX": 1e-12, "CURRENT": False, "RECORD": True,
                   "ROWWISE": True, "COLWISE": True, "PARTS": 256, "BLOCK_M": 64, "BLOCK_N": 64, "GELU": False}
    consts_ln = {"FMAX": 448.0, "MBITS": 3, "EMIN": -6, "HAS_BIAS": True, "RECORD": True, "ROWWISE": True,
                 "COLWISE": False, "BLOCK_M": 32, "BLOCK_N": 128}
    cases = []
    for t in tensors:
        for i in ints:
            cases.append((K._cast_kernel, (t, fp8, fp8, f32, f32, f32, f32, i, 64, i, 3, i, 0), consts_cast))
            cases.append((K._cast_kernel, (bf, fp8, fp8[1:], f32, f32, f32, f32, 16, i, 16, i, 5, i), consts_cast))
            cases.append((N._layernorm_cast_kernel, (t, t, t, fp8, fp8, f32, f32, f32, f32, i, 2048, i, 1e-5, i, 0),
                          consts_ln))
            cases.append((K._amax_parts_kernel, (t, f32, i, 5), {"BLOCK": 4096, "GELU": True}))
    ours_to_triton: dict = {}
    for kernel, args, consts in cases:
        _, _, _, backend, binder = kernel.device_caches[0]
        _, specialization, options = binder(*args, **consts, num_warps=4)
        theirs = J.compute_cache_key(kernel.device_caches[0][1], specialization, options)
        ours = (kernel.fn.__name__, TL.specialization_key(0, 4, args, consts))
        ours_to_triton.setdefault(ours, set()).add(theirs)
    ambiguous = [str(k) for k, v in ours_to_triton.items() if len(v) > 1]
    # (2) one kernel, Triton's run then a direct launch of the same call
    launcher = TL.DirectLauncher(K._cast_kernel)
    args = (bf, fp8, fp8, f32, f32, f32, f32, 32, 64, 32, 0, 5, 1)
    launcher((1, 2), args, consts_cast, 4)
    launcher((1, 2), args, consts_cast, 4)
    triton_call, direct_call = log[-2], log[-1]
    # a pre-run hook attached: Triton's own path (it runs the hook and passes its hook chains)
    seen_hook: list = []
    for _ in range(2):  # the key compiled and launched directly once
        TL.launch(K._cast_kernel, (1, 2), args, consts_cast, 4)
    assert log[-1][7] is None
    K._cast_kernel.pre_run_hooks.append(lambda *a, **kw: seen_hook.append(1))
    try:
        TL.launch(K._cast_kernel, (1, 2), args, consts_cast, 4)
    finally:
        K._cast_kernel.pre_run_hooks.clear()
    hooked = seen_hook == [1] and log[-1][7] is not None
    same = (len(triton_call) == len(direct_call)
            and all(a is b or a == b for i, (a, b) in enumerate(zip(triton_call, direct_call)) if i not in (6, 7, 8)))
    return {"keys": len(ours_to_triton), "triton_keys": len(set().union(*ours_to_triton.values())),
            "ambiguous": ambiguous, "same_launch_args": same, "direct_launches": launcher.direct_launches,
            "hooks_passed_by_triton": [type(a).__name__ for a in triton_call[7:9]], "direct_hooks": list(direct_call[6:9]),
            "described": TL.describe(K._cast_kernel), "pre_run_hook_took_tritons_path": hooked}


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (its launch path runs with a stand-in driver: no GPU)")
def test_key_refines_tritons_specialisation_and_direct_launch_passes_its_arguments():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    env.pop("TRITON_INTERPRET", None)
    code = "import json, tests.test_triton_launch as t; print('RESULT' + json.dumps(t.against_triton()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    res = json.loads(out.stdout.split("RESULT", 1)[1])
    assert not res["ambiguous"], res["ambiguous"][:5]
    assert res["keys"] >= res["triton_keys"] > 20, res  # the variants do reach many of Triton's kernels
    assert res["same_launch_args"] and res["direct_launches"] == 1, res
    assert res["direct_hooks"] == [None, None, None], res
    assert res["described"] == "launched directly", res
    assert res["pre_run_hook_took_tritons_path"], res


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (its launch path runs with a stand-in driver: no GPU)")
def test_launch_bench_runs_and_leaves_no_stand_in_behind():
    """``benchmarks/triton_launch_bench.py``: figures for each row and path, and afterwards the
    kernels' caches, the direct launchers and Triton's driver are those from before."""
    import importlib.util

    from triton.runtime import driver

    from dept_mega.parallel import fp8_kernels as K
    spec = importlib.util.spec_from_file_location("triton_launch_bench", os.path.join(ROOT, "benchmarks",
                                                                                      "triton_launch_bench.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    caches, launchers, active = K._cast_kernel.device_caches, dict(TL._LAUNCHERS), driver._active
    res = bench.measure(repeats=2, batch=3)
    assert set(res) == {"cast_fp8 delayed", "cast_fp8 current", "layernorm_cast_fp8"}
    assert all(r["direct"] > 0 and r["triton"] > 0 for r in res.values()), res
    assert K._cast_kernel.device_caches is caches and TL._LAUNCHERS == launchers and driver._active is active
    assert K.launch is TL.launch


# ------------------------------------------------------------------ on the GPU

@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
                    reason="needs Triton and a CUDA GPU with FP8 (compute capability 8.9+)")
def test_direct_launches_give_the_reference_bytes_on_cuda():
    from dept_mega.parallel import fp8_kernels as K
    from dept_mega.parallel.fp8 import _cast_math

    launcher = TL.launcher_of(K._cast_kernel)
    assert launcher is not None, "the cast kernel is not launched directly on this Triton"
    before = launcher.direct_launches
    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(4097 * 96, generator=g, device="cuda").bfloat16()
    scale = torch.tensor([0.5, 3.0], device="cuda")
    for offset in (0, 1, 0, 1):  # aligned, then a view 2 bytes off: each key twice
        x = base[offset:offset + 4096 * 96].view(4096, 96)
        for s in (None, scale):
            amax = torch.zeros(2, device="cuda")
            q, q_t, inv = K.cast_fp8(x, torch.float8_e4m3fn, 16, True, True, s, 1, amax, 1)
            rq, rq_t, rinv, ramax = _cast_math(x, None if s is None else s[1], torch.float8_e4m3fn, 16, True, True)
            assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), (offset, s is None)
            assert torch.equal(q_t.view(torch.uint8), rq_t.view(torch.uint8)), (offset, s is None)
            assert torch.equal(amax[1], ramax.float()), (offset, s is None)
    assert launcher.direct_launches > before
