"""Every kind of error the compiled dept_mega ops raise from C++ reaches Python as its exception.

Why a test of its own: on the GPU machine's build of the extension (built there with its
/opt/gcc g++ and nvcc), a C++ exception thrown by some of our checks ended the process with a
segmentation fault instead: the CUDA ops' argument checks on the first H100 run, and the CPU
kernels' invalid-id errors of ``remap_ids`` on an H200 (docs/performance.md, "The second H200
call"), while an argument-type error thrown by the same CPU operator was caught. The cases
below are the throw sites, each run in one child process in turn, so that a crash names the
case it happened in and the cases before it; on a machine where all of them pass, a crash-free
build is shown. Runs wherever the extension is built (CUDA cases where it has CUDA kernels and a
GPU is present); ``pytest tests/test_ops_cpp_errors.py`` on the GPU machine answers which
throws crash there."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from dept_mega import ops

# (name, device, statement, the exception type, a part of its message); the statement calls the
# C++ operator itself (torch.ops.dept_mega), past the Python-side checks that guard the CUDA ops
CASES = [
    ("torch_control", "cpu", "torch.empty(3, 4).view(5, 7)", "RuntimeError", "shape '[5, 7]'"),
    ("remap_dtype", "cpu", "O.remap_ids(torch.tensor([1.0]), torch.arange(10))",
     "TypeError", "ids must be int32 or int64"),
    ("remap_ranked_size", "cpu", "O.remap_ranked(torch.tensor([1]), torch.zeros(1, dtype=torch.int64), -5, -1)",
     "ValueError", "got -5"),
    ("remap_out_of_range", "cpu", "O.remap_ids(torch.tensor([1, 5, 99]), torch.arange(10))",
     "IndexError", "global id 99 at flat position 2"),
    ("remap_missing", "cpu", "O.remap_ids(torch.tensor([1, 5]), torch.tensor([0, -1, 2, 3, 4, 5]))",
     "ValueError", "global id 1 (first at flat position 0)"),
    ("remap_ranked_missing", "cpu",
     "O.remap_ranked(torch.tensor([2, 3]), ops.VocabRanks.from_ids(torch.arange(0, 100, 2), 100).words, 100, -1)",
     "ValueError", "global id 3 (first at flat position 1)"),
    ("gather_out_of_range", "cpu", "O.gather_rows(torch.zeros(4, 2), torch.tensor([0, 7]), None)",
     "IndexError", "ids[1] = 7"),
    ("cuda_remap_dtype", "cuda", "O.remap_ids(torch.tensor([1.0], device='cuda'), torch.arange(10, device='cuda'))",
     "TypeError", "ids must be int32 or int64"),
    ("cuda_gather_dims", "cuda", "O.gather_rows(torch.zeros(4, device='cuda'), torch.tensor([0], device='cuda'), None)",
     "ValueError", "table must be 2-D"),
]

CHILD = textwrap.dedent("""
    import sys, torch
    from dept_mega import ops
    ops.backend(torch.device("cpu"))  # loads the extension
    O = torch.ops.dept_mega
    for name, stmt in CASES:
        print("start", name, flush=True)
        try:
            eval(stmt)
            print("none", name, flush=True)
        except Exception as exc:
            print("raised", name, type(exc).__name__, str(exc).splitlines()[0], flush=True)
""")


def _cases() -> list[tuple]:
    st = ops.extension_status()
    if not st.loaded:
        pytest.skip(f"dept_mega.ops extension not built ({st.reason})")
    cuda = st.cuda and torch.cuda.is_available()
    return [c for c in CASES if c[1] == "cpu" or cuda]


def test_every_cpp_error_reaches_python_as_its_exception():
    cases = _cases()
    code = "CASES = " + repr([(name, stmt) for name, _, stmt, _, _ in cases]) + "\n" + CHILD
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    lines = [line.split(" ", 2) for line in p.stdout.splitlines() if line.startswith(("start", "none", "raised"))]
    started = [rest for kind, *rest in lines if kind == "start"]
    assert p.returncode == 0, (f"the child died (status {p.returncode}) in case {started[-1] if started else '?'}; "
                               f"cases before it: {[r[0] for r in started[:-1]]}\n{p.stderr[-3000:]}")
    outcome = {}
    for kind, name, *rest in lines:
        if kind != "start":
            outcome[name] = (kind, rest[0] if rest else "")
    for name, _, _, exc_type, part in cases:
        kind, text = outcome.get(name, ("missing", ""))
        assert kind == "raised", (name, kind)
        assert text.startswith(exc_type + " ") and part in text, (name, text)
