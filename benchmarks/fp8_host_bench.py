#!/usr/bin/env python3
"""Host cost of one eager linear layer call, forward and backward apart: µs, dispatcher ops, Python calls.

    OMP_NUM_THREADS=1 python benchmarks/fp8_host_bench.py [--device cpu|cuda] [--shape 16,64] [--depth 8]
        [--repeats 200] [--combos bf16,cuda+cublaslt,...] [--kernels stub|real] [--scaling delayed|current]
        [--ops] [--json OUT]

On a fast GPU the eager FP8 step is bound by the host (docs/performance.md, "FP8: what the host
costs per linear layer"): the kernels of a 1B model's linear are over before Python has issued
the next ones, so every µs of Python per call counts. This script measures that host time.

What it runs: a chain of ``--depth`` parallel linear layers (``ColumnParallelLinear`` and
``RowParallelLinear`` in turn, ``hidden → hidden``, bf16 weights, tensor-parallel size 1) as
the model builds them, inside an open training step as the trainer opens it (a ``GradBuffer``
with fp32 ``main_grad`` active; for FP8 the model's ``Fp8State`` step open under ``--scaling``,
delayed by default, after a first step that gave every operand a history). Combinations:

* ``bf16``: ``LinearGemm(fuse_wgrad=True)`` (``optim.grad_accum_fusion``, the default): the weight
  gradient added into ``main_grad`` by the backward. ``bf16_unfused``: ``LinearGemm()`` (the fusion
  off): ``F.linear``, autograd's ``param.grad`` and the buffer's hook. The bf16 references.
* ``CASTS+GEMM`` for CASTS in ``torch`` | ``cuda`` | ``triton`` | ``tritonpy`` and GEMM in ``torch``
  | ``cublaslt``: the eager FP8 linear with ``Fp8State(kernels=CASTS, gemm=GEMM)`` (``fp8_casts``,
  ``fp8_gemm``). ``cuda+cublaslt`` is the path a GPU run with ``fp8_casts: cuda`` + ``fp8_gemm:
  cublaslt`` takes: the Python of ``fp8.py`` does not branch on the device there (the two C++
  operators are called through the same overloads; only their kernels differ), so on the CPU the
  same Python and the same dispatcher calls run. ``triton+torch`` is the default on CUDA
  (Triton casts, ``torch._scaled_mm``); ``triton`` casts run with ``--device cuda`` only (on the
  CPU only Triton's interpreter could, which would time the interpreter). ``torch`` casts run
  eagerly here but compiled on CUDA, and ``torch`` GEMMs toggle oneDNN around ``_scaled_mm`` on
  the CPU only: those combinations are not the GPU's host path (shown for comparison; on CUDA
  left out by default: inductor would compile the casts first).
* ``tritonpy``: the ``triton`` cast path with only the Triton kernels' launches made no-ops
  (``fp8_kernels._cast_kernel`` and ``_amax_parts_kernel``; Triton's availability
  provided where it is not installed): ``cast_fp8``'s own Python runs (checks, allocations, grid),
  no kernel, so its bytes are garbage. It runs on either device; against ``triton`` it leaves
  exactly the launch out (``parallel/triton_launch.py``'s direct launch: the cache key and lookup,
  the compiled kernel's launcher, the driver's launch).
* ``tritonrun``: the ``triton`` casts launched through Triton's own ``kernel[grid](...)``
  (``JITFunction.run``: argument binding, specialisation, string cache key, launch metadata and
  hooks) instead of the direct launch; CUDA only. Against ``triton`` it gives what the direct
  launch saves.
* ``CASTS+GEMM+fused`` and ``CASTS+GEMM+unfused``: the chain with the producers of the layers'
  inputs as the model hands them over (each layer's ``prologue``): a LayerNorm (the model's
  ``Norm``) before each column layer (QKV, fc1), the GELU before each row layer (fc2), the
  norms' parameters in the gradient buffer. ``fused``: ``fp8_fused_casts`` on (the producer in
  the input's cast: ``fp8_prologue.py``, one operator or launch, then its backward op);
  ``unfused``: ``F.layer_norm`` / ``F.gelu`` called by the layer, then the plain FP8 linear.
  Their difference is what fusion saves the host per linear call, the producer's own call
  included. Under ``--kernels stub`` the fused LayerNorm cast is stubbed as well; the
  unfused producers and both variants' backward ops (``native_layer_norm_backward``,
  ``gelu_backward``) are ATen's CPU kernels, which compute (at 16 × 64 a small part of their
  cost, against a GPU host's launch, which they lack).

``--device cuda`` runs the same chains on the GPU (real kernels) and times each forward and
backward by the wall clock between two synchronisations: at these sizes the kernels end about as
soon as the host has issued them, so that is the host's time with the CUDA launches included.

``--kernels stub`` (the default on the CPU) replaces the CPU kernels of ``dept_mega::cast_fp8``
and ``dept_mega::fp8_gemm`` in this process by C++ kernels that only allocate their outputs
(and of ``dept_mega::layernorm_cast_fp8``; compiled once with
``torch.utils.cpp_extension.load_inline``, ~45 s the first time, cached after): the CPU kernels compute (the GEMM converts its operands to fp32: ~50 µs per call even at
16 × 64), which a GPU does not do on the host, so with them the figures would mostly be
arithmetic. With the stubs a call costs what it costs a CUDA host minus the driver's launches:
our Python, autograd, the dispatcher and the allocations. The numbers are garbage then (nothing
is checked against them). ``--kernels real`` keeps the computing kernels (no compile: what the
device check's dry run uses); on CUDA the real kernels always run.

Figures, per layer call (chain totals / depth), forward and backward apart:

* ``us``: the minimum over ``--repeats`` passes of the process's CPU time (``time.process_time``:
  time the process was preempted on a shared machine does not count), after warm-up passes.
  A pass is one forward of the chain, then one ``backward()`` (one per micro-batch, as in
  training: autograd's own start is shared by the chain). Each pass of a step after the
  step's first (which casts the weights) is timed, so the weights' FP8 copies come from the
  cache as on every micro-batch but the first of a training step.
* ``ops``: operators that reached the dispatcher from Python (a ``TorchDispatchMode``; a C++
  kernel's own inner calls are not counted), by name, counted in one untimed pass.
* ``py_calls``: Python function calls (``sys.setprofile``'s ``call`` events) and calls of C
  functions from Python (``c_call``) in that pass.
* ``syncs``: ops that read a tensor's value on the host (``aten::_local_scalar_dense``:
  ``.item()``, ``bool(t)``, ``.tolist()``; ``aten::is_nonzero``; ``aten::equal``) or copy to the
  CPU; must be 0 on the hot path.

Derived, µs per linear call (forward + backward: two casts, the weight's cached, three GEMMs),
differences of the combinations' sums (``derived`` in the JSON; the first pair of rows that both
ran, the cublaslt rows first, so the GPU path's own figures; n/a where none did):

* ``triton_launcher`` = ``triton+G − tritonpy+G``: the Triton kernels' launches alone (the direct
  launch; CUDA only: the rows differ in the launches and nothing else).
* ``direct_launch_saves`` = ``tritonrun+G − triton+G``: what launching the compiled kernels
  directly saves over Triton's ``kernel[grid](...)`` (CUDA only).
* ``cast_fp8_python`` = ``tritonpy+G − cuda+G``: ``cast_fp8``'s Python over the C++ operator's whole
  host path (binding, dispatcher, allocation; on CUDA its launch too). Not the absolute Python of
  ``cast_fp8`` (that would need a row with the cast replaced by nothing), but what choosing the
  operator saves of it.
* ``triton_casts`` = ``triton+G − cuda+G`` (= the two above): what the Triton casts cost the host
  over the C++ cast operator (``fp8_casts: triton`` against ``cuda``). CUDA only.
* ``scaled_mm_host`` = ``C+torch − C+cublaslt``: ``torch._scaled_mm``'s host path (dispatch,
  cuBLASLt's descriptors and heuristic) and the weight gradient's separate add, over the cuBLASLt
  operator's (``fp8_gemm: torch`` against ``cublaslt``), again not absolute. On the CPU PyTorch's
  CPU ``_scaled_mm`` computes (~20 µs per GEMM even here): not a host figure.
* ``gpu_path_over_bf16`` = ``cuda+cublaslt − bf16``: what the FP8 path costs the host per call over
  the bf16 layer's.
* ``fusion_saves`` = ``cuda+cublaslt+unfused − cuda+cublaslt+fused``: what fusing the producer
  into the C++ cast saves the host per linear call (negative: what it costs), its producer's
  call included. ``fusion_saves_triton``: the same for the Triton casts (``triton``, on the CPU
  ``tritonpy``).

On the CPU these are a proxy for the host time of a GPU run, without the CUDA driver's launch
cost (a few µs per kernel), on a CPU other jobs may share; compare figures of one run (the
combinations alternate per repeat to share the machine's noise).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from dept_mega.grad_buffer import GradBuffer, GradSync  # noqa: E402
from dept_mega.ops import loader  # noqa: E402
from dept_mega.model.layers import Norm  # noqa: E402
from dept_mega.parallel import fp8_casts, fp8_gemm, fp8_kernels, fp8_norm_kernels, triton_launch  # noqa: E402
from dept_mega.parallel.fp8 import Fp8Recipe, Fp8State  # noqa: E402
from dept_mega.parallel.fp8_prologue import GELU  # noqa: E402
from dept_mega.parallel.groups import build_groups  # noqa: E402
from dept_mega.parallel.layers import ColumnParallelLinear, LinearGemm, RowParallelLinear  # noqa: E402

CASTS = ("torch", "cuda", "triton", "tritonpy", "tritonrun")
PLAIN = ("bf16", "bf16_unfused") + tuple(f"{c}+{g}" for c in CASTS for g in ("torch", "cublaslt"))
# CASTS+GEMM+fused / +unfused: the chain with its producers (LayerNorm before the column layers,
# GELU before the row layers), fused into the casts (fp8_fused_casts) or called before the linear
PROLOGUE = ("fused", "unfused")
COMBOS = PLAIN + tuple(f"{c}+{v}" for c in PLAIN if "+" in c for v in PROLOGUE)
# on CUDA the torch casts are compiled by inductor at their first call (minutes for the bench): left out
_FUSED_ROWS = ("cuda+cublaslt+fused", "cuda+cublaslt+unfused", "tritonpy+cublaslt+fused",
               "tritonpy+cublaslt+unfused")
DEFAULT = {"cpu": ("bf16", "bf16_unfused", "torch+torch", "torch+cublaslt", "cuda+torch", "cuda+cublaslt",
                   "tritonpy+cublaslt") + _FUSED_ROWS,
           "cuda": ("bf16", "bf16_unfused", "triton+torch", "triton+cublaslt", "tritonpy+cublaslt",
                    "tritonrun+cublaslt", "cuda+torch",
                    "cuda+cublaslt", "triton+cublaslt+fused", "triton+cublaslt+unfused") + _FUSED_ROWS[:2]}
GPU_PATH = "cuda+cublaslt"  # the combination whose Python is the GPU run's (see the docstring)
# the derived table (see the docstring): name -> (candidate (minuend, subtrahend) pairs, the first
# that both ran is used; what it is; a caveat on the CPU or None)
DERIVED = {
    "triton_launcher": ((("triton+cublaslt", "tritonpy+cublaslt"), ("triton+torch", "tritonpy+torch")),
                        "the Triton kernels' launches (direct: cache key and lookup, driver launch)", None),
    "direct_launch_saves": ((("tritonrun+cublaslt", "triton+cublaslt"), ("tritonrun+torch", "triton+torch")),
                            "the direct launch's saving over Triton's kernel[grid](...)", None),
    "cast_fp8_python": ((("tritonpy+cublaslt", "cuda+cublaslt"), ("tritonpy+torch", "cuda+torch")),
                        "cast_fp8's Python (checks, allocations, grid) over the C++ cast operator's host path", None),
    "triton_casts": ((("triton+cublaslt", "cuda+cublaslt"), ("triton+torch", "cuda+torch")),
                     "the Triton casts over the C++ cast operator (fp8_casts: triton against cuda)", None),
    "scaled_mm_host": ((("cuda+torch", "cuda+cublaslt"), ("triton+torch", "triton+cublaslt"),
                        ("tritonpy+torch", "tritonpy+cublaslt"), ("torch+torch", "torch+cublaslt")),
                       "torch._scaled_mm's host path and the dW add over the cuBLASLt operator's (fp8_gemm: torch "
                       "against cublaslt)", "on the CPU PyTorch's CPU _scaled_mm computes: not a host figure"),
    "gpu_path_over_bf16": ((("cuda+cublaslt", "bf16"),), "the GPU path's FP8 linear over the bf16 layer", None),
    "fusion_saves": ((("cuda+cublaslt+unfused", "cuda+cublaslt+fused"), ("cuda+torch+unfused", "cuda+torch+fused")),
                     "what fusing the producer (LayerNorm, GELU) into the C++ cast saves the host (negative: costs), "
                     "the producer's own call included", None),
    "fusion_saves_triton": ((("triton+cublaslt+unfused", "triton+cublaslt+fused"),
                             ("tritonpy+cublaslt+unfused", "tritonpy+cublaslt+fused"),
                             ("triton+torch+unfused", "triton+torch+fused"),
                             ("tritonpy+torch+unfused", "tritonpy+torch+fused")),
                            "the same with the Triton casts (tritonpy: without Triton's launcher)", None),
}
_BIG = 1 << 40  # expected accumulations per step: the buffer's buckets never become final
_SYNC_OPS = ("aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal", "aten::item")

_STUB_SRC = r"""
#include <torch/library.h>
#include <ATen/ATen.h>
namespace {
// dept_mega::cast_fp8 / fp8_gemm with their outputs allocated and left unwritten (the bench's
// --kernels stub): the host work of a CUDA kernel's launcher minus the launch itself.
std::tuple<at::Tensor, at::Tensor, at::Tensor> cast_stub(
    const at::Tensor& t, at::ScalarType dtype, int64_t pad, bool rowwise, bool colwise,
    const std::optional<at::Tensor>& scale, int64_t, const std::optional<at::Tensor>&, int64_t, bool) {
  const int64_t rows = t.size(0) + pad, cols = t.size(1);
  at::Tensor q, qt, inv;
  if (rowwise) q = at::empty({rows, cols}, t.options().dtype(dtype));
  if (colwise) qt = at::empty({cols, rows}, t.options().dtype(dtype));
  if (!scale.has_value()) inv = at::empty({}, t.options().dtype(at::kFloat));
  return {q, qt, inv};
}
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layernorm_cast_stub(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>&, double, at::ScalarType dtype,
    int64_t pad, bool rowwise, bool colwise, const std::optional<at::Tensor>&, int64_t,
    const std::optional<at::Tensor>&, int64_t) {
  const int64_t rows = x.size(0), cols = x.size(1);
  at::Tensor q, qt;
  if (rowwise) q = at::empty({rows + pad, cols}, x.options().dtype(dtype));
  if (colwise) qt = at::empty({cols, rows + pad}, x.options().dtype(dtype));
  // mean and rstd as the CPU kernel returns them (the dtype native_layer_norm_backward takes there)
  return {q, qt, at::empty({rows, 1}, x.options().dtype(weight.scalar_type())),
          at::empty({rows, 1}, x.options().dtype(weight.scalar_type()))};
}
at::Tensor gemm_stub(const at::Tensor& a, const at::Tensor& b, const at::Tensor&, const at::Tensor&, bool,
                     const std::optional<at::Tensor>& out, bool) {
  if (out.has_value()) return at::Tensor();
  return at::empty({a.size(0), b.size(1)}, a.options().dtype(at::kBFloat16));
}
}  // namespace
TORCH_LIBRARY_IMPL(dept_mega, CPU, m) {
  m.impl("cast_fp8", &cast_stub);
  m.impl("layernorm_cast_fp8", &layernorm_cast_stub);
  m.impl("fp8_gemm", &gemm_stub);
}
"""


def install_stub_kernels() -> None:
    """Replace the CPU kernels of the two FP8 operators in this process (see ``--kernels``)."""
    from torch.utils.cpp_extension import load_inline

    why = loader.kernel_missing("dept_mega::cast_fp8", "cpu")  # loads the extension (its kernels first)
    if why is not None:
        raise SystemExit(f"--kernels stub: {why}")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": what is wanted here
        # the stubs' signatures follow the operators' schemas: a name of their own per schema, so a
        # checkout of another version (its build cached under the old name) does not rebuild this one
        load_inline("dept_mega_fp8_host_stubs_v2", cpp_sources=[_STUB_SRC], is_python_module=False)


def derived(us: dict, device: str) -> dict:
    """The :data:`DERIVED` differences of ``us`` (µs per call, forward + backward, by combination):
    per name ``{"us": value or None, "of": "a - b", "what": ...}``; None where no pair ran."""
    out = {}
    for name, (pairs, what, cpu_note) in DERIVED.items():
        pair = next(((a, b) for a, b in pairs if a in us and b in us), None)
        out[name] = {"us": None if pair is None else us[pair[0]] - us[pair[1]],
                     "of": " - ".join(pair or pairs[0]),
                     "what": what + (f" ({cpu_note})" if cpu_note and device == "cpu" else "")}
    return out


class _NoLaunch:
    """A Triton kernel object whose launches do nothing (the ``tritonpy`` casts)."""

    def __getitem__(self, grid):
        return _no_launch


def _no_launch(*args, **kwargs) -> None:
    return None


# one stand-in for every stubbed kernel: triton_launch keeps an entry per kernel object it sees
_NO_LAUNCH = _NoLaunch()


@contextlib.contextmanager
def launches_stubbed():
    """``fp8_kernels`` (and ``fp8_norm_kernels``, the fused LayerNorm cast) with their Triton
    launches no-ops for the duration (see ``tritonpy`` in the module docstring), restored
    afterwards: ``cast_fp8``'s and ``layernorm_cast_fp8``'s own Python runs, no kernel."""
    saved = []
    for K, kernels in ((fp8_kernels, ("_cast_kernel", "_amax_parts_kernel")),
                       (fp8_norm_kernels, ("_layernorm_cast_kernel",))):
        names = kernels + ("AVAILABLE", "interpreted")
        saved.append((K, names, {n: getattr(K, n) for n in names if hasattr(K, n)}))
        for n in kernels:
            setattr(K, n, _NO_LAUNCH)
        K.AVAILABLE, K.interpreted = True, lambda: True  # interpreted: its check of CPU tensors passes
    try:
        yield
    finally:
        for K, names, values in saved:
            for n in names:
                if n in values:
                    setattr(K, n, values[n])
                elif hasattr(K, n):
                    delattr(K, n)


@contextlib.contextmanager
def launched_by_triton():
    """The Triton casts launched through Triton's ``kernel[grid](...)`` for the duration (the
    ``tritonrun`` casts), the direct launch restored afterwards."""
    saved = [(K, K.launch) for K in (fp8_kernels, fp8_norm_kernels)]
    for K, _ in saved:
        K.launch = triton_launch.triton_launch
    try:
        yield
    finally:
        for K, fn in saved:
            K.launch = fn


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.name()] += 1
        out = func(*args, **(kwargs or {}))
        if func.name() in ("aten::_to_copy", "aten::copy_") and args and isinstance(args[0], torch.Tensor):
            dev = (kwargs or {}).get("device")
            if dev is not None and torch.device(dev).type == "cpu" and args[0].device.type != "cpu":
                self.ops["<copy to cpu>"] += 1
        return out


class _PyCalls:
    def __init__(self) -> None:
        self.calls = self.c_calls = 0

    def __call__(self, frame, event, arg):
        if event == "call":
            self.calls += 1
        elif event == "c_call":
            self.c_calls += 1

    def __enter__(self):
        sys.setprofile(self)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)


class Chain:
    """``depth`` column/row-parallel layers of one combination, their gradient buffer and FP8 state."""

    def __init__(self, combo: str, tokens: int, hidden: int, depth: int, device: str = "cpu",
                 scaling: str = "delayed") -> None:
        torch.manual_seed(0)
        self.device = torch.device(device)
        pg = build_groups()
        self.state, self.stub_launches = None, combo.startswith("tritonpy+")
        self.triton_run = combo.startswith("tritonrun+")
        prologue = combo.split("+")[2] if combo.count("+") == 2 else None
        if combo in ("bf16", "bf16_unfused"):
            gemm = LinearGemm(fuse_wgrad=combo == "bf16")
        else:
            casts, mm = combo.split("+")[:2]
            # tritonpy: a state any device can build, then Fp8State.cast's Triton path by hand
            self.state = Fp8State(Fp8Recipe("hybrid", scaling, amax_history=16), device,
                                  kernels="torch" if self.stub_launches else casts.replace("tritonrun", "triton"),
                                  gemm=mm)
            if self.stub_launches:
                self.state.kernels = "triton"
            gemm = LinearGemm("fp8", self.state, fused_casts=prologue == "fused")
        kinds = (ColumnParallelLinear, RowParallelLinear)
        self.layers = [kinds[i % 2](hidden, hidden, pg, name=f"l{i}", seed=i, init_std=hidden ** -0.5, gemm=gemm,
                                    device=device, dtype=torch.bfloat16) for i in range(depth)]
        # +fused / +unfused: each layer's producer as the model hands it over (its prologue): a
        # LayerNorm (the model's Norm, bf16 weight and bias) before a column layer (QKV, fc1), the
        # GELU before a row layer (fc2)
        self.prologues = [None] * depth if prologue is None else [
            GELU if i % 2 else Norm("layernorm", hidden, 1e-5, name=f"n{i}", seed=i, device=device,
                                    dtype=torch.bfloat16) for i in range(depth)]
        norms = [p for p in self.prologues if isinstance(p, Norm)]
        # the norms' parameters get their gradients as in training (from the buffer, as the weights')
        self.ws = [m.weight for m in self.layers] + [t for n in norms for t in (n.weight, n.bias)]
        self.buffer = GradBuffer(self.ws, torch.float32, self.device, bucket_size=1 << 30)
        self.buffer.adopt()
        self.sync = GradSync(pg, overlap=False)
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(tokens, hidden, generator=g).bfloat16().to(device).requires_grad_()
        self.dy = torch.randn(tokens, hidden, generator=g).bfloat16().to(device)
        self.depth = depth
        self.step(lambda: None)  # the first (current-scaled) step: every operand has a history after it

    def forward(self) -> torch.Tensor:
        y = self.x
        for m, p in zip(self.layers, self.prologues):
            y = m(y) if p is None else m(y, prologue=p)
        return y

    def backward(self, y: torch.Tensor) -> None:
        """One micro-batch's backward. ``inputs``: the parameters only, so that the chain's input,
        a leaf here where the model's is not, gets no gradient of its own (autograd would
        detach or add one per pass); the first layer computes its input's gradient all the same."""
        torch.autograd.backward(y, self.dy, inputs=self.ws)

    def step(self, body) -> None:
        """One training step: its first pass (the weights' casts), then ``body()``."""
        with (launches_stubbed() if self.stub_launches else
              launched_by_triton() if self.triton_run else contextlib.nullcontext()):
            self._step(body)

    def _step(self, body) -> None:
        self.sync.begin([self.buffer], {id(w): _BIG for w in self.ws})
        if self.state is not None:
            self.state.begin_step()
        try:
            self.backward(self.forward())
            body()
        finally:
            if self.state is not None:
                self.state.end_step()
            self.sync.finish()

    def timed(self, passes: int) -> tuple[list[float], list[float]]:
        """Seconds of ``passes`` forwards and of their backwards, one step: CPU time of the process
        on the CPU; on CUDA wall time, the device synchronised before and after each (its kernels
        on tiny operands end about as soon as the host has issued them)."""
        fwd, bwd = [], []
        cuda = self.device.type == "cuda"
        clock = time.perf_counter if cuda else time.process_time
        sync = torch.cuda.synchronize if cuda else (lambda: None)

        def body():
            for _ in range(passes):
                sync()
                t0 = clock()
                y = self.forward()
                sync()
                t1 = clock()
                self.backward(y)
                sync()
                t2 = clock()
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
        self.step(body)
        return fwd, bwd

    def counted(self) -> dict:
        """Dispatcher ops, Python calls and host syncs of one pass (forward, backward)."""
        ops, py = {}, {}

        def body():  # ops twice (the first pass under the mode also counts what it sets up once), then
            # the Python calls without the mode (its __torch_dispatch__ is a Python call per op)
            for counter in (_Count, _Count, _PyCalls):
                for phase in ("fwd", "bwd"):
                    with counter() as c:
                        if phase == "fwd":
                            y = self.forward()
                        else:
                            self.backward(y)
                    if counter is _Count:
                        ops[phase] = c.ops
                    else:
                        py[phase] = c
        self.step(body)
        res = {}
        for phase in ("fwd", "bwd"):
            n = ops[phase]
            res[phase] = {"ops": sum(n.values()) / self.depth,
                          "by_op": {k: v / self.depth for k, v in sorted(n.items())},
                          "py_calls": py[phase].calls / self.depth, "c_calls": py[phase].c_calls / self.depth,
                          "syncs": sum(v for k, v in n.items() if k in _SYNC_OPS or k == "<copy to cpu>")}
        return res


def skip_reason(combo: str, device: str):
    """Why ``combo`` cannot run on ``device`` (None: it can)."""
    if combo.startswith("bf16"):
        return None
    casts, gemm = combo.split("+")[:2]
    if casts in ("triton", "tritonrun") and (device != "cuda" or not fp8_kernels.AVAILABLE):
        return "Triton's casts need CUDA and Triton (on the CPU only its interpreter, which would time the interpreter)"
    if casts == "cuda" and (why := fp8_casts.op_unavailable(device)):
        return f"the C++ cast operator cannot run: {why}"
    if gemm == "cublaslt" and (why := fp8_gemm.op_unavailable(device)):
        return f"the C++ GEMM operator cannot run: {why}"
    return None


def main(argv: list[str] | None = None) -> None:
    """The command line (``argv``: its arguments, default ``sys.argv[1:]``; the tests run it in process)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--shape", default="16,64", help="tokens,hidden (multiples of 16)")
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=200, help="timed passes per combination (minimum taken)")
    ap.add_argument("--per-step", type=int, default=4, help="passes per training step (micro-batches)")
    ap.add_argument("--combos", default=None, help=f"of {', '.join(COMBOS)} (default: {', '.join(DEFAULT['cpu'])}; "
                    f"on CUDA {', '.join(DEFAULT['cuda'])})")
    ap.add_argument("--kernels", default=None, choices=("stub", "real"), help="default: stub on the CPU, real on CUDA")
    ap.add_argument("--scaling", default="delayed", choices=("delayed", "current"),
                    help="the FP8 recipe's scaling (current: a Triton cast is two launches)")
    ap.add_argument("--ops", action="store_true", help="print the dispatcher ops by name")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    tokens, hidden = (int(n) for n in args.shape.split(","))
    combos = [c for c in (args.combos or ",".join(DEFAULT[args.device])).split(",") if c]
    if set(combos) - set(COMBOS):
        raise SystemExit(f"--combos: one of {', '.join(COMBOS)}, got {sorted(set(combos) - set(COMBOS))}")
    kernels = args.kernels or ("stub" if args.device == "cpu" else "real")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available to this process")
    if kernels == "stub" and args.device != "cpu":
        raise SystemExit("--kernels stub replaces the operators' CPU kernels: on CUDA the real kernels run")
    skipped = {c: why for c in combos if (why := skip_reason(c, args.device))}
    combos = [c for c in combos if c not in skipped]
    if kernels == "stub":
        install_stub_kernels()
    chains = {c: Chain(c, tokens, hidden, args.depth, args.device, args.scaling) for c in combos}
    counts = {c: chains[c].counted() for c in combos}
    for c in combos:  # warm-up
        chains[c].timed(args.per_step)
    times = {c: ([], []) for c in combos}
    rounds = -(-args.repeats // args.per_step)
    for r in range(rounds):
        for c in combos[r % len(combos):] + combos[:r % len(combos)]:
            f, b = chains[c].timed(args.per_step)
            times[c][0].extend(f)
            times[c][1].extend(b)
    cuda = args.device == "cuda"
    name = torch.cuda.get_device_name() if cuda else "cpu"
    timing = "wall time between synchronisations" if cuda else "process CPU time"
    res = {"device": args.device, "device_name": name, "shape": [tokens, hidden], "depth": args.depth,
           "kernels": kernels, "scaling": args.scaling, "passes": rounds * args.per_step, "torch": torch.__version__,
           "timing": f"{timing}, min over passes, per layer call", "skipped": skipped, "combos": {}}
    print(f"host µs per layer call on {name}, min of {rounds * args.per_step} passes ({timing}), tokens,hidden = "
          f"{args.shape}, chain of {args.depth}, kernels {kernels}, {args.scaling} scaling, torch {torch.__version__}")
    print(f"  {'combo':25s} {'fwd us':>7s} {'bwd us':>7s} {'sum':>7s} | {'fwd ops':>7s} {'bwd ops':>7s} | "
          f"{'py fwd':>6s} {'py bwd':>6s} | syncs")
    for c in combos:
        f, b = (min(v) / args.depth * 1e6 for v in times[c])
        k = counts[c]
        res["combos"][c] = {"fwd_us": f, "bwd_us": b, **{f"{ph}_{key}": k[ph][key] for ph in ("fwd", "bwd")
                                                         for key in ("ops", "py_calls", "c_calls", "syncs", "by_op")}}
        print(f"  {c:25s} {f:7.1f} {b:7.1f} {f + b:7.1f} | {k['fwd']['ops']:7.2f} {k['bwd']['ops']:7.2f} | "
              f"{k['fwd']['py_calls']:6.1f} {k['bwd']['py_calls']:6.1f} | {k['fwd']['syncs'] + k['bwd']['syncs']}"
              f"{'   <- fp8_casts: cuda + fp8_gemm: cublaslt' if c == GPU_PATH else ''}")
        if args.ops:
            for ph in ("fwd", "bwd"):
                print(f"      {ph}: " + ", ".join(f"{n.split('::')[-1]} {v:g}" for n, v in k[ph]["by_op"].items()))
    for c, why in skipped.items():
        print(f"  {c:25s} skipped: {why}")
    res["derived"] = derived({c: v["fwd_us"] + v["bwd_us"] for c, v in res["combos"].items()}, args.device)
    print("derived, µs per call (forward + backward):")
    for n, d in res["derived"].items():
        value = "     n/a" if d["us"] is None else f"{d['us']:8.1f}"
        print(f"  {n:19s} {value}  = {d['of']}: {d['what']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
