#!/usr/bin/env python3
"""Host (CPU-side Python and dispatch) cost of one FP8 linear call, forward + backward.

    OMP_NUM_THREADS=1 python benchmarks/fp8_host_overhead.py [--device cpu|cuda] [--shape 16,16] [--depth 8] \
        [--calls 50] [--trials 9] [--modes bf16,bf16_layer,fp8_torch,...] [--profile MODE] [--json OUT]

On a fast GPU the FP8 linear layers are bound by what the host spends per call: the GPU kernels
of a 1B model's linear are over before Python has launched the next ones (docs/performance.md).
This script measures that host time on the CPU with operands so small (``--shape tokens,hidden``,
default 16 × 16, the smallest legal FP8 GEMM) that the kernels' own time is small, so the time
per call is mostly the Python and the dispatcher around them.

Every mode times forward and backward passes through a chain of ``--depth`` linear layers
``hidden → hidden`` (bf16 weights, the input a leaf that needs its gradient; one
``backward()`` per pass, as one per micro-batch in training) and reports the time per layer
call. Each pass runs inside an open training step as the trainer runs it: a gradient buffer
active for the weights (``main_grad`` fp32) and, for FP8, the model's ``Fp8State`` step open
with delayed scaling (``--scaling current``: current scaling, where a Triton cast is two
launches). A warm-up step comes first, so the step timed has history and scales, and each
step's first pass, which casts the weights, is not timed: every timed call finds its weight's
FP8 copies cached and casts its input and its output gradient. Trials alternate the modes
(rotating which goes first) to share the machine's noise; the result is the median over
trials of µs per call, in CPU time of the process (with one thread that is the host's work;
time the process was preempted on a shared machine does not count).

``--device cuda`` runs the same chains on the GPU (weights, operands and gradient buffer there;
the FP8 state with ``kernels="triton"``) and times them by the wall clock, with
``torch.cuda.synchronize()`` before the first and after the last timed pass: the operands are
so small that the GPU finishes each kernel before the host has issued the next, so the wall
time is the host's time, now including what exists only on a GPU (Triton's launcher, the CUDA
driver's launches, cuBLASLt's descriptor and heuristic setup in ``_scaled_mm``). Modes:

* ``bf16``: plain ``F.linear`` with autograd's own weight-gradient accumulation (``w.grad``).
* ``bf16_layer``: our bf16 linear path (``optim.grad_accum_fusion``, the default): the
  ``FusedWgradLinear`` autograd function, its backward adding ``dYᵀ·X`` into ``main_grad``
  through ``GradBuffer.arrive``.
* ``fp8_torch``: ``fp8_linear`` with the ``torch`` casts (``_cast_math`` eagerly): the whole FP8
  path including the reference casts' several eager tensor ops per cast. Gradient to
  ``main_grad`` as the trainer does for FP8 weights. On CUDA the casts run eagerly here too
  (the trainer compiles them there: Dynamo's guards and inductor's kernels instead, not
  measured), a dozen kernel launches per cast.
* ``fp8``: the real path on CUDA, the Triton casts and ``torch._scaled_mm`` as training runs
  them. Skipped on the CPU, which has no Triton launcher (Triton's interpreter would time the
  interpreter); the output says so.
* ``fp8_op``: as ``fp8`` with each cast through the custom operator
  ``torch.ops.dept_mega.fp8_cast`` (``fp8_cast_op.py``, what the compiled graphs call) instead
  of ``cast_fp8`` directly, the operator's fresh amax maxed into the layer's slot afterwards as
  the traced linear does. On CUDA ``fp8_op − fp8`` is the operator's cost per call: the
  dispatcher and ``custom_op``'s Python around the same kernel, plus the operator's own small
  kernels (the amax's zero fill; under delayed scaling the scale's reciprocal) and the maximum.
  On the CPU the operator runs the reference math, so there ``fp8_op − fp8_torch`` is that
  cost without the extra kernels.
* ``fp8_cuda``: the FP8 path with the C++ cast operator (``Fp8State(kernels="cuda")``,
  ``fp8_casts: cuda``: ``torch.ops.dept_mega.cast_fp8``, ``parallel/fp8_casts.py``) in place of
  the Triton cast: on CUDA its CUDA kernel, launched through the dispatcher; on the CPU its CPU
  kernel (which computes the bytes: at 16 × 16 little). Skipped where the ``dept_mega.ops``
  extension lacks the operator's kernel for the device (the output says why).
* ``fp8_lt``: the ``fp8`` path (on the CPU the ``fp8_torch`` one) with its three GEMMs through the C++
  operator ``dept_mega::fp8_gemm`` (``Fp8State(gemm="cublaslt")``, ``fp8_gemm: cublaslt``,
  ``parallel/fp8_gemm.py``) in place of ``torch._scaled_mm``: on CUDA cuBLASLt with its algorithm
  cached per shape, the weight gradient accumulated into ``main_grad`` by the GEMM (no bf16 dW,
  no add); on the CPU the operator's CPU kernel. Skipped where the extension lacks the
  operator's kernel for the device (the output says why).
* ``fp8_stub``: the ``triton`` cast path of ``Fp8State.cast`` with ``fp8_kernels.cast_fp8``
  replaced by a stub that only allocates its outputs (no arithmetic, the FP8 bytes are
  garbage): the Python of the FP8 linear around the cast call (state lookups, weight cache,
  ``_scaled_mm`` checks and GEMMs, autograd function, gradient accumulation).
* ``fp8_launch_stub``: as ``fp8_stub`` but the real ``cast_fp8`` runs, with only its Triton
  kernel objects replaced by no-op launchers (and Triton's ``cdiv`` and availability flags
  provided when Triton is not installed): adds ``cast_fp8``'s own Python (checks,
  allocations, grid). What neither stub measures is Triton's launcher itself (argument
  binding, specialisation key, cache lookup, the driver call), which exists only on a GPU.
* ``fp8_python``: as ``fp8_stub`` and ``torch._scaled_mm`` replaced by a stub that allocates
  its bf16 output: our Python, autograd and the allocations alone (PyTorch's CPU ``_scaled_mm``
  converts both operands to fp32 first, ~20 µs per call even at 16 × 16, which is not what the
  cuBLASLt call costs the host on a GPU).

The differences between modes are printed as a derived table (and are ``derived`` in the
JSON), µs per linear call (two casts, the weight's cached, and three GEMMs):

* ``triton_launcher`` = ``fp8 − fp8_launch_stub``: Triton's launcher (argument binding,
  specialisation key, kernel cache lookup, the driver's launch). CUDA only.
* ``cast_fp8_python`` = ``fp8_launch_stub − fp8_stub``: ``cast_fp8``'s own Python.
* ``scaled_mm_host`` = ``fp8_stub − fp8_python``: ``torch._scaled_mm`` (on CUDA its host path:
  dispatch, cuBLASLt's descriptors and heuristic; on the CPU PyTorch's CPU kernel, which
  computes, ~20 µs per call even at 16 × 16: not a host figure).
* ``cast_op`` = ``fp8_op − fp8`` (CUDA) or ``fp8_op − fp8_torch`` (CPU): see ``fp8_op``.
* ``cuda_cast`` = ``fp8_cuda − fp8`` (CUDA: what the C++ operator saves (negative) or costs
  against the Triton casts, two casts per call) or ``fp8_cuda − fp8_torch`` (CPU: the
  operator's CPU kernel against the eager torch casts).
* ``lt_gemm`` = ``fp8_lt − fp8`` (CUDA: what the cuBLASLt operator saves (negative) or costs
  against ``torch._scaled_mm`` and the weight gradient's add, three GEMMs per call) or
  ``fp8_lt − fp8_torch`` (CPU: the operator's CPU kernel and its fp32 accumulation).

``--profile MODE`` runs one more step of ``MODE`` under cProfile and prints where its time goes.
On the CPU the kernels' time is not zero at these sizes (the CPU ``_scaled_mm`` and, in
``fp8_torch``, the eager casts compute), so the differences between modes, not the absolute
numbers, are the host cost of the FP8 path; GPU kernel launches (the CUDA driver) are part
of the figures only with ``--device cuda``.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
import types

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dept_mega.grad_buffer import GradBuffer, GradSync  # noqa: E402
from dept_mega.parallel import fp8 as fp8_module  # noqa: E402
from dept_mega.parallel import fp8_cast_op  # noqa: E402,F401  (registers torch.ops.dept_mega.fp8_cast)
from dept_mega.parallel import fp8_casts  # noqa: E402
from dept_mega.parallel import fp8_gemm  # noqa: E402
from dept_mega.parallel import fp8_kernels as K  # noqa: E402
from dept_mega.parallel import wgrad  # noqa: E402
from dept_mega.parallel.fp8 import Fp8Recipe, Fp8State, fp8_linear  # noqa: E402
from dept_mega.parallel.groups import build_groups  # noqa: E402

MODES = ("bf16", "bf16_layer", "fp8_torch", "fp8", "fp8_op", "fp8_cuda", "fp8_lt", "fp8_stub", "fp8_launch_stub",
         "fp8_python")
_BIG = 1 << 40  # expected accumulations per step: the buffer's buckets never become final
# the derived table: name -> (minuend, subtrahend on CUDA, subtrahend on the CPU, what it is)
DERIVED = {
    "triton_launcher": ("fp8", "fp8_launch_stub", "fp8_launch_stub",
                        "Triton's launcher: binding, specialisation key, cache lookup, driver launch"),
    "cast_fp8_python": ("fp8_launch_stub", "fp8_stub", "fp8_stub", "cast_fp8's own Python: checks, allocations, grid"),
    "scaled_mm_host": ("fp8_stub", "fp8_python", "fp8_python",
                       "torch._scaled_mm: dispatch and cuBLASLt setup (CPU: PyTorch's CPU kernel, computing)"),
    "cast_op": ("fp8_op", "fp8", "fp8_torch",
                "the custom operator dept_mega::fp8_cast around each cast (see fp8_op)"),
    "cuda_cast": ("fp8_cuda", "fp8", "fp8_torch",
                  "the C++ operator dept_mega::cast_fp8 in place of the Triton casts (CPU: of the torch casts)"),
    "lt_gemm": ("fp8_lt", "fp8", "fp8_torch",
                "the cuBLASLt operator dept_mega::fp8_gemm in place of torch._scaled_mm + the dW add"),
}


def derived(us: dict, device: str) -> dict:
    """The :data:`DERIVED` differences of the medians ``us`` (µs per call) on ``device``: per
    name ``{"us": value or None, "of": "a - b", "what": ...}``; None where a mode did not run."""
    out = {}
    for name, (a, b_cuda, b_cpu, what) in DERIVED.items():
        b = b_cuda if device == "cuda" else b_cpu
        value = us[a] - us[b] if a in us and b in us else None
        out[name] = {"us": value, "of": f"{a} - {b}", "what": what}
    return out


def skip_reason(mode: str, device: str):
    """Why ``mode`` cannot run on ``device`` (None: it can)."""
    operator = {"fp8_cuda": ("cast", fp8_casts), "fp8_lt": ("GEMM", fp8_gemm)}.get(mode)
    if operator is not None:
        why = operator[1].op_unavailable(device)
        return None if why is None else f"the C++ {operator[0]} operator cannot run: {why}"
    if mode != "fp8":
        return None
    if device != "cuda":
        return ("needs a GPU: the real Triton casts have no launcher on the CPU (Triton's interpreter would time "
                "the interpreter)" + ("" if K.AVAILABLE else "; Triton is not installed here"))
    if not K.AVAILABLE:
        return "Triton is not installed: the Triton casts cannot run"
    return None


def _stub_scaled_mm(a, b, scale_a=None, scale_b=None, out_dtype=None, **kwargs):
    """``torch._scaled_mm``'s output, allocated and left unwritten (the ``fp8_python`` mode)."""
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def _stub_cast_fp8(t, dtype, pad=0, rowwise=True, colwise=False, scale=None, scale_index=0,
                   amax_out=None, amax_index=0):
    """``cast_fp8``'s outputs, allocated and left unwritten (the ``fp8_stub`` mode)."""
    rows, cols = t.shape
    q = t.new_empty((rows + pad, cols), dtype=dtype) if rowwise else None
    q_t = t.new_empty((cols, rows + pad), dtype=dtype) if colwise else None
    return q, q_t, (t.new_empty((), dtype=torch.float32) if scale is None else None)


class _NoLaunch:
    """A Triton kernel object whose launches do nothing (the ``fp8_launch_stub`` mode)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _op_cast_fp8(t, dtype, pad=0, rowwise=True, colwise=False, scale=None, scale_index=0, amax_out=None,
                 amax_index=0):
    """``cast_fp8`` through the custom operator (the ``fp8_op`` mode): its fresh amax maxed into
    ``amax_out``'s slot, as the traced linear does with it."""
    q, q_t, inv, amax = torch.ops.dept_mega.fp8_cast(t, scale, scale_index, dtype, pad, rowwise, colwise)
    if amax_out is not None:
        torch.maximum(amax_out[amax_index], amax, out=amax_out[amax_index])
    return (q if rowwise else None), (q_t if colwise else None), (inv if scale is None else None)


class _KernelsVia:
    """What ``fp8.py`` sees as ``fp8_kernels`` in the ``fp8_op`` mode: the module with its
    ``cast_fp8`` replaced (the operator's own CUDA implementation still calls the real one)."""

    def __init__(self, cast_fp8) -> None:
        self.cast_fp8 = cast_fp8

    def __getattr__(self, name):
        return getattr(K, name)


def _eager_cast(t, scale, dtype, pad=0, rowwise=True, colwise=False):
    """``fp8._cast`` run eagerly on every device (the ``fp8_torch`` mode on CUDA)."""
    return fp8_module._cast_math(t, scale, dtype, pad, rowwise, colwise)


@contextlib.contextmanager
def _patched(mode: str, device: str = "cpu"):
    """The cast path of ``mode`` in place for the duration (restored afterwards)."""
    saved = {name: getattr(K, name) for name in ("cast_fp8", "_cast_kernel", "_amax_parts_kernel", "AVAILABLE",
                                                   "triton", "interpreted") if hasattr(K, name)}
    scaled_mm, kernels, cast = torch._scaled_mm, fp8_module.fp8_kernels, fp8_module._cast
    if mode in ("fp8_stub", "fp8_python"):
        K.cast_fp8 = _stub_cast_fp8
    if mode == "fp8_python":
        torch._scaled_mm = _stub_scaled_mm
    elif mode == "fp8_launch_stub":
        K._cast_kernel = K._amax_parts_kernel = _NoLaunch()
        K.AVAILABLE, K.interpreted = True, lambda: True
        if K.triton is None:
            K.triton = types.SimpleNamespace(cdiv=lambda a, b: -(-a // b))
    elif mode == "fp8_op":
        fp8_module.fp8_kernels = _KernelsVia(_op_cast_fp8)
    elif mode == "fp8_torch" and device == "cuda":
        fp8_module._cast = _eager_cast
    try:
        yield
    finally:
        torch._scaled_mm = scaled_mm
        fp8_module.fp8_kernels, fp8_module._cast = kernels, cast
        for name, value in saved.items():
            setattr(K, name, value)
        for name in ("_cast_kernel", "_amax_parts_kernel"):
            if name not in saved and hasattr(K, name):
                delattr(K, name)


class Case:
    """One mode's chain of ``depth`` linear layers, operands, gradient buffer and step (see the
    module docstring)."""

    def __init__(self, mode: str, tokens: int, hidden: int, depth: int, scaling: str = "delayed",
                 device: str = "cpu") -> None:
        g = torch.Generator().manual_seed(0)
        self.mode, self.device = mode, device
        self.ws = [torch.nn.Parameter((torch.randn(hidden, hidden, generator=g) * hidden ** -0.5).bfloat16().to(device))
                   for _ in range(depth)]
        self.x = torch.randn(tokens, hidden, generator=g).bfloat16().to(device).requires_grad_()
        self.dy = torch.randn(tokens, hidden, generator=g).bfloat16().to(device)
        self.buffer = None
        if mode != "bf16":
            self.buffer = GradBuffer(self.ws, torch.float32, torch.device(device), bucket_size=1 << 30)
            self.buffer.adopt()
            self.sync = GradSync(build_groups(), overlap=False)
        self.state, self.layers = None, [None] * depth
        if mode.startswith("fp8"):
            # CUDA: the Triton casts where Triton is installed (the real path; stubbed in the
            # stub modes); the CPU has no launcher: the state's kernel path is set by hand below
            kernels = "triton" if device == "cuda" and K.AVAILABLE and mode != "fp8_torch" else "torch"
            if mode == "fp8_cuda":
                kernels = "cuda"  # the C++ operator on either device
            gemm = "cublaslt" if mode == "fp8_lt" else "torch"
            self.state = Fp8State(Fp8Recipe("hybrid", scaling, amax_history=16), device, kernels=kernels, gemm=gemm)
            self.layers = [self.state.new_layer() for _ in range(depth)]
            if mode not in ("fp8_torch", "fp8_cuda", "fp8_lt"):
                self.state.kernels = "triton"  # the kernel path of Fp8State.cast (stubbed in the stub modes)
            self.step(2)  # the first (current-scaled) step: history and scales from here on

    def call(self) -> None:
        """Forward and backward through the chain."""
        y = self.x
        for w, layer in zip(self.ws, self.layers):
            if self.mode == "bf16":
                y = F.linear(y, w)
            elif self.mode == "bf16_layer":
                y = wgrad.linear(y, w, None, fuse_wgrad=True)
            else:
                y = fp8_linear(y, w, layer)
        y.backward(self.dy)

    def step(self, calls: int) -> float:
        """One training step of ``calls`` forward + backward passes through the chain (the
        micro-batches); seconds of all but the first (FP8: which casts the weights): CPU time of
        the process on the CPU, wall time between two synchronisations on CUDA."""
        cuda = self.device == "cuda"
        clock = time.perf_counter if cuda else time.process_time
        with _patched(self.mode, self.device):
            if self.buffer is not None:
                self.sync.begin([self.buffer], {id(w): _BIG for w in self.ws})
            if self.state is not None:
                self.state.begin_step()
            self.call()
            if cuda:
                torch.cuda.synchronize()
            t0 = clock()
            for _ in range(calls):
                self.call()
            if cuda:
                torch.cuda.synchronize()
            dt = clock() - t0
            if self.state is not None:
                self.state.end_step()
            if self.buffer is not None:
                self.sync.finish()
            self.x.grad = None
            for w in self.ws:
                w.grad = None
        return dt


def profile(case: Case, calls: int, top: int = 25) -> str:
    prof = cProfile.Profile()
    prof.enable()
    case.step(calls)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="where the chains run (cuda: wall time between synchronisations)")
    ap.add_argument("--shape", default="16,16", help="tokens,hidden (multiples of 16)")
    ap.add_argument("--depth", type=int, default=8, help="linear layers in the chain")
    ap.add_argument("--calls", type=int, default=50, help="timed forward + backward passes per trial")
    ap.add_argument("--trials", type=int, default=9)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--scaling", default="delayed", choices=("delayed", "current"), help="the FP8 recipe's scaling")
    ap.add_argument("--profile", default=None, help="a mode to run once more under cProfile")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shape = tuple(int(n) for n in args.shape.split(","))
    requested = [m for m in args.modes.split(",") if m]
    unknown = set(requested) - set(MODES) | ({args.profile} - set(MODES) - {None})
    if len(shape) != 2 or unknown:
        raise SystemExit(f"--shape takes tokens,hidden; modes are {', '.join(MODES)} (got {sorted(unknown)})")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available to this process")
    skipped = {m: why for m in requested if (why := skip_reason(m, args.device))}
    if args.profile in skipped:
        raise SystemExit(f"--profile {args.profile}: {skipped[args.profile]}")
    modes = [m for m in requested if m not in skipped]
    cases = {m: Case(m, *shape, args.depth, args.scaling, args.device) for m in modes}
    for case in cases.values():  # warm-up: allocator, dispatcher caches (and on CUDA Triton's kernel cache)
        case.step(args.calls // 4 + 1)
    us: dict[str, list[float]] = {m: [] for m in modes}
    for trial in range(args.trials):
        order = modes[trial % len(modes):] + modes[:trial % len(modes)]
        for m in order:
            us[m].append(cases[m].step(args.calls) / (args.calls * args.depth) * 1e6)
    median = {m: statistics.median(v) for m, v in us.items()}
    res = {"device": args.device, "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "timing": "wall clock between synchronisations" if args.device == "cuda" else "process CPU time",
           "shape": shape, "depth": args.depth, "scaling": args.scaling, "calls": args.calls, "trials": args.trials,
           "threads": args.threads, "torch": torch.__version__, "us_per_call": median,
           "us_min": {m: min(v) for m, v in us.items()}, "skipped": skipped, "derived": derived(median, args.device)}
    print(f"host µs per linear call (forward + backward) on {res['device_name']} ({res['timing']}), tokens,hidden = "
          f"{args.shape}, a chain of {args.depth}, {args.calls} passes × {args.trials} trials, torch "
          f"{torch.__version__}, {args.threads} thread(s), {args.scaling} scaling")
    base = median.get("bf16")
    for m in requested:
        if m in skipped:
            print(f"  {m:16s} skipped: {skipped[m]}")
            continue
        rel = f"  ({median[m] / base:.2f}× bf16)" if base else ""
        print(f"  {m:16s} median {median[m]:8.1f}  min {res['us_min'][m]:8.1f}{rel}")
    print("derived, µs per call:")
    for name, d in res["derived"].items():
        value = "n/a (a mode did not run)" if d["us"] is None else f"{d['us']:8.1f}"
        print(f"  {name:16s} {value}  = {d['of']}: {d['what']}")
    if args.profile:
        print(profile(cases.get(args.profile) or Case(args.profile, *shape, args.depth, args.scaling, args.device),
                      args.calls))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
