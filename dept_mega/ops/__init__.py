"""Custom ops for TRIM / SPEC: row gather, deterministic row scatter, scatter-mean, id remap.

API (every op validates its arguments and raises the same errors on every backend):

- ``gather_rows(table, ids, out_dtype=None) -> rows``: ``rows[i] = table[ids[i]]``.
  ``table`` [V, d] float32 / bfloat16 / float16; ``ids`` [n] int32 / int64; ``rows`` [n, d]
  of ``out_dtype`` (default: the table's; cast rounds to nearest even like ``.to``).
  Differentiable in ``table``: the backward is ``scatter_add_rows`` into zeros of the table's
  shape and dtype (deterministic).
- ``scatter_add_rows(out, ids, rows) -> out``: in place, ``out[ids[i]] += rows[i]``;
  duplicate ids accumulate. ``out`` [V, d] contiguous; ``rows`` [n, d], any of the three
  float dtypes (may differ from ``out``'s; rows that overlap ``out`` are read as they were
  before the call). Each destination row is summed in fp32 in a fixed order and rounded
  once: its contributions in ascending position, cut into chunks of 64;
  chunk 0 added to the old value one by one, each later chunk summed from zero and its sum
  added, in chunk order (so long runs of one id reduce in parallel on CUDA; a row with at
  most 64 contributions is a plain ascending sum). The result is bit-identical from run to
  run, whatever the thread count, and equal across backends.
- ``scatter_mean_rows(table, ids, rows, accumulate=False, alpha=1.0) -> table``: the fused
  TRIM round-end update. ``ids``/``rows`` are the concatenated contributions of several
  sources (ids in the table's row space, e.g. global ids for the global table; a row id may
  appear once per contributing source). In one pass per destination row r touched by
  c_r > 0 contributions, with m_r = sum / c_r: ``table[r] = alpha * m_r`` (accumulate=False:
  e.g. the mean of the sources' updated rows) or ``table[r] += alpha * m_r``
  (accumulate=True: e.g. ``alpha=-1`` applies the mean pseudo-gradient
  ``table[r] -= mean(delta)``, or ``alpha=-lr``). Sum, division, scaling and addition are each
  rounded in fp32 (rows may be bf16 / fp16 / fp32); rows touched by nobody keep their values.
  Deterministic as ``scatter_add_rows``.
- ``remap_ids(ids, lookup) -> local_ids``: ``local_ids = lookup[ids]`` for ids of any shape
  (a [b, s] token batch), returned with the ids' dtype and shape. ``lookup`` [V_global]
  int32 / int64 maps a global id to its local row, < 0 for "not in this source's
  vocabulary": such an id raises ``ValueError`` naming the first offending global id (in
  row-major order) and its position. ``lookup`` may instead be a :class:`VocabRanks` (the
  ranks of a sorted vocabulary set, 32x smaller than its lookup: ``dept_mega.ops.ranks``),
  which gives the result and errors of its equivalent lookup (-1 for a non-member); its CUDA
  kernel keeps the ranks in shared memory, so the remap streams like a copy. The values are
  converted to the ids' dtype unchecked: with int32 ids, an int64 lookup value >= 2^31 wraps
  (as ``.to(torch.int32)`` does, on every backend; checking would cost a pass over the lookup
  per call). Keep such lookups int32-safe or pass int64 ids; a ``VocabRanks`` (and its
  ``to_lookup()``) always is, its vocabulary being < 2^31.
- ``backend(device=None) -> "cuda" | "cpp" | "torch"``: what runs the ops for tensors on
  ``device`` (default: cuda if available, else cpu). ``extension_status()`` says why.

Errors: ``IndexError`` for an id outside [0, V) (message names the position and the id),
``ValueError`` for a negative lookup entry, bad shapes or mixed devices, ``TypeError`` for
unsupported dtypes. In-place ops check every id before writing: on error the table is
unchanged. Empty inputs work (no-op / empty result).

When errors are raised: shapes, dtypes and devices at once everywhere (checked in Python
before a compiled op is called); invalid ids at once on CPU (and by the fallback), but by the
compiled CUDA kernels only at the next ``check_errors(device)``, so that no call waits for the
GPU. No compiled kernel throws for an invalid id: it writes the first one into an error record
{code, position, id, bound, lookup value} (csrc/constants.h), per device on the GPU, per calling
thread on CPU, and `recorded_error` decodes a record into the very error the fallback raises.
The CPU wrappers read their thread's record right after the call (a few memory reads) and raise;
``check_errors`` reads the GPU's (one small copy). The trainer checks at every log interval and
at the end of training. With calls on several CUDA streams, the record keeps the first error
written, and a check (a copy on the current stream) sees the errors of the calls its stream has
waited for. A failed scatter leaves the table unchanged; a failed gather / remap returns a zero
row / 0 at each invalid id and the right value everywhere else, so that an output read before
the deferred error is raised (CUDA, a compiled graph) never holds an id out of range (e.g. for
``F.embedding``, whose CUDA kernel would assert and lose the recorded error).

Why records and not C++ exceptions: on the GPU machine (torch 2.11, the extension built there by
the image's /opt/gcc g++) a C++ exception thrown by our operators crashed the process with a
segmentation fault where its message formatted a number (that compiler linked a private copy of
libstdc++, whose streams have no locale; setup.py now links the runtime's libstdc++ and checks;
tests/test_ops_cpp_errors.py runs every remaining throw site). No call should depend on a C++
exception for a data error all the same: the record costs nothing on the GPU.
The operators' own C++ argument checks stay as the last line: ``torch.ops.dept_mega.*`` called
directly, past these wrappers, may still throw from C++, and its invalid ids on CPU raise
nothing until ``check_errors("cpu")`` on that thread (or the thread's next wrapped CPU call).
Under ``torch.compile`` the CPU wrappers do not read the record inside the graph (it would break
the graph): a compiled CPU call's invalid id raises at the next ``check_errors("cpu")``, as on CUDA.

Backends: the compiled extension ``dept_mega.ops._C`` (csrc/: C++ CPU kernels, CUDA kernels
when built with a CUDA torch) registered as ``torch.ops.dept_mega.*`` with fake kernels, so
the ops trace under torch.compile; otherwise the pure PyTorch fallback
(``dept_mega.ops.fallback``), which gives bit-identical results on CPU. Set
``DEPT_MEGA_OPS=torch`` to force the fallback.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Optional, Union

import torch

from dept_mega.ops import fallback
from dept_mega.ops.loader import ExtensionStatus, status
from dept_mega.ops.ranks import VocabRanks

__all__ = ["gather_rows", "scatter_add_rows", "scatter_mean_rows", "remap_ids", "backend", "describe",
           "check_errors", "extension_status", "ExtensionStatus", "VocabRanks"]


def extension_status() -> ExtensionStatus:
    """Whether the compiled kernels are in use, and why not."""
    return status()


def _route(*tensors: torch.Tensor) -> bool:
    """True: call the compiled op. Mixed devices go to the fallback, which raises the same
    ValueError as the compiled checks (the dispatcher would otherwise pick a device first).

    The callers then check the arguments in Python (the same messages as the C++ checks), on
    every device: no C++ throw is reached through this API (see the module docstring)."""
    device = tensors[0].device
    for t in tensors[1:]:  # a loop, not any(<generator>): this runs on every call
        if t.device != device:
            return False
    return _use_extension(device)


def _use_extension(device: torch.device) -> bool:
    st = status()
    if not st.loaded:
        return False
    kind = device.type  # one attribute read (it builds a str)
    return kind == "cpu" or kind == "meta" or (kind == "cuda" and st.cuda)


def describe(device: Union[str, torch.device]) -> str:
    """The run log's word on the custom ops (TRIM's row gather/scatter, the id remap) for
    tensors on ``device``. On a GPU with an extension built without CUDA kernels (typically on a
    cluster's login node without nvcc) it says so and how to fix it: the run is correct but
    takes the slower PyTorch fallback, which nothing else would show."""
    dev = torch.device(device)
    st = status()
    if _use_extension(dev):
        return "custom ops=" + ("CUDA kernels" if dev.type == "cuda" else "C++ kernels")
    if dev.type == "cuda" and st.loaded:
        return ("custom ops=PyTorch fallback on the GPU: the dept_mega.ops extension was built without "
                "CUDA kernels (no nvcc of torch's CUDA major version at build time, e.g. on a login node; "
                "the reason is in build/dept_mega_ops_build.log). Rebuild where nvcc is "
                "(pip install --no-build-isolation -e .); python -m dept_mega.ops --require cuda (and, for "
                "FP8, --require fp8) checks")
    return f"custom ops=PyTorch fallback ({st.reason})"


def backend(device: Union[str, torch.device, None] = None) -> str:
    """"cuda", "cpp" or "torch": the implementation used for tensors on ``device``."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if not _use_extension(dev):
        return "torch"
    return "cuda" if dev.type == "cuda" else "cpp"


def gather_rows(table: torch.Tensor, ids: torch.Tensor,
                out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """rows[i] = table[ids[i]] (see the module docstring)."""
    if _route(table, ids):
        fallback.check_gather_args(table, ids, out_dtype)
        return _compiled(table, torch.ops.dept_mega.gather_rows, table, ids, out_dtype)
    return fallback.gather_rows(table, ids, out_dtype)


def scatter_add_rows(out: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """In place out[ids[i]] += rows[i], deterministic; returns ``out``."""
    if _route(out, ids, rows):
        fallback.check_scatter_args("scatter_add_rows", out, ids, rows)
        _in_place(out, torch.ops.dept_mega.scatter_add_rows_, out, ids, rows)
        return out
    return fallback.scatter_add_rows(out, ids, rows)


def scatter_mean_rows(table: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor,
                      accumulate: bool = False, alpha: float = 1.0) -> torch.Tensor:
    """In place, per touched row r: table[r] = alpha * mean_r (or += with accumulate=True);
    returns ``table``."""
    if _route(table, ids, rows):
        fallback.check_scatter_args("scatter_mean_rows", table, ids, rows)
        _in_place(table, torch.ops.dept_mega.scatter_mean_rows_, table, ids, rows, accumulate, float(alpha))
        return table
    return fallback.scatter_mean_rows(table, ids, rows, accumulate, alpha)


def remap_ids(ids: torch.Tensor, lookup: Union[torch.Tensor, VocabRanks]) -> torch.Tensor:
    """local_ids = lookup[ids] for any shape of ids; lookup < 0 raises ValueError. ``lookup``
    may be a VocabRanks (the same result and errors as its equivalent lookup). The result has
    the ids' dtype: int32 ids with an int64 lookup value >= 2^31 wrap, unchecked (see the
    module docstring)."""
    if isinstance(lookup, VocabRanks):
        return _remap_ranked(ids, lookup)
    # the argument checks are three tests (the trainer remaps every micro-batch);
    # check_remap_args, which builds the message, runs only when one fails
    if _route(ids, lookup):
        if not _remap_args_ok(ids, lookup):
            fallback.check_remap_args(ids, lookup)
        return _compiled(ids, torch.ops.dept_mega.remap_ids, ids, lookup)
    return fallback.remap_ids(ids, lookup)


def _remap_ranked(ids: torch.Tensor, ranks: VocabRanks, stage: int = -1) -> torch.Tensor:
    """remap_ids through ranks; ``stage`` picks the CUDA kernel's words in shared (1) or global
    (0) memory, -1 lets it choose (tests force both). VocabRanks has checked its words, so only
    the ids' dtype (and the stage) is left to check here before the C++ op."""
    words, size = ranks.words, ranks.size
    if _route(ids, words):
        if ids.dtype not in fallback.ID_DTYPES or stage not in (-1, 0, 1):
            fallback.check_remap_ranked_args(ids, words, size, stage)
        return _compiled(ids, torch.ops.dept_mega.remap_ranked, ids, words, size, stage)
    return fallback.remap_ranked(ids, words, size, stage)


def _remap_args_ok(ids: torch.Tensor, lookup: torch.Tensor) -> bool:
    """False exactly when check_remap_args raises for two tensors on one device."""
    return (lookup.dim() == 1 and ids.dtype in fallback.ID_DTYPES
            and lookup.dtype in fallback.ID_DTYPES)


# The CPU kernels' error records, one per thread (csrc/cpu/ops_cpu.cpp, thread_record): each
# thread's view of its own record's memory, made at the thread's first compiled CPU call.
_THREAD = threading.local()


def _thread_record() -> ctypes.Array:
    """This thread's CPU error record: int64[5] over the extension's thread-local memory (reads
    cost tens of ns, where reading a tensor element costs a few µs)."""
    record = getattr(_THREAD, "record", None)
    if record is None:
        view = torch.ops.dept_mega.error_record(torch.empty(0))
        record = (ctypes.c_int64 * view.numel()).from_address(view.data_ptr())
        _THREAD.record = record
    return record


def _compiled(t: torch.Tensor, op, *args):
    """``op(*args)``, a compiled operator on ``t``'s device. On CPU the thread's error record is
    read before the call (an earlier direct or compiled call's error is raised first, so that an
    in-place operator never writes before it) and after it (this call's invalid id); on CUDA the
    record waits for :func:`check_errors`."""
    if t.is_cuda:
        return op(*args)
    _raise_recorded()
    out = op(*args)
    _raise_recorded()
    return out


def _in_place(t: torch.Tensor, op, *args) -> None:
    """``op(*args)``, a compiled operator that updates ``t`` in place, with what autograd expects
    of an in-place op (as the fallback's index_copy_ does): a leaf that requires grad is refused
    in grad mode (the fallback's error; in a compiled graph too), and ``t``'s version counter is
    bumped, so that a backward that saved ``t`` detects the change (the C++ operators have no
    ADInplaceOrView kernel), except while Dynamo traces: the compiled graph's own write-back
    into ``t`` bumps it. The compiled scatters are not differentiable (the fallback's are, through
    index_copy_): call them on tensors that need no gradient, as every caller does (no_grad)."""
    if t.requires_grad and t.is_leaf and torch.is_grad_enabled():
        raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")
    _compiled(t, op, *args)
    if not torch.compiler.is_compiling():
        torch.autograd.graph.increment_version(t)


def _raise_recorded() -> None:
    """After a compiled CPU call: raises (and clears) the error the kernel recorded in this
    thread's record. Skipped while Dynamo traces (the call is then in a graph; the record is
    read at the next check_errors("cpu"))."""
    if torch.compiler.is_compiling():
        return
    record = _thread_record()
    if record[0] != 0:
        host = list(record)
        ctypes.memset(record, 0, ctypes.sizeof(record))
        raise recorded_error(host)


def check_errors(device: Union[str, torch.device, None] = None) -> None:
    """Raises the first invalid-id error that the compiled ops met on ``device`` since the last
    check (and clears it): on CUDA the device's record (one device-to-host copy: call it where
    the host waits for the GPU anyway, the log interval); on CPU this thread's record, which
    holds an error only after ``torch.ops.dept_mega.*`` was called directly or from a compiled
    graph (the wrappers raise at the call). Returns at once for a device without compiled ops."""
    dev = torch.device("cuda" if device is None else device)
    kind = backend(dev)
    if kind == "cpp":
        _raise_recorded()
        return
    if kind != "cuda":
        return
    record = torch.ops.dept_mega.error_record(torch.empty(0, device=dev))
    host = record.tolist()
    if host[0] != 0:
        record.zero_()
        raise recorded_error(host)


def recorded_error(record: list[int]) -> Exception:
    """The exception an error record {code, position, id, bound, lookup value}
    (csrc/constants.h) of a CUDA or CPU kernel stands for: exactly what the fallback raises. The
    one decoder of both backends' records, with the fallback's messages: no kernel throws for an
    invalid id (see the module docstring)."""
    code, pos, gid, bound, value = record
    ops = {1: "gather_rows", 2: "scatter_add_rows", 3: "scatter_mean_rows"}
    if code in ops:
        return fallback.id_out_of_range(ops[code], pos, gid, bound)
    if code == 4:
        return fallback.remap_out_of_range(pos, gid, bound)
    if code == 5:
        return fallback.remap_missing(pos, gid, value)
    return RuntimeError(f"dept_mega: unknown error record code {code} in {record}")
