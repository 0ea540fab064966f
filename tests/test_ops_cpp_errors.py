"""Every kind of error the compiled dept_mega ops still raise from C++ reaches Python as its exception.

Why a test of its own: on the GPU machine's build of the extension (built there with its
/opt/gcc g++, which links libstdc++ statically), a C++ error whose message formats a number ended
the process with a segmentation fault instead: the extension's private copy of libstdc++'s streams
has no locale (an H200, 2026-11-28: cuda-gdb stopped in ``std::ostream::_M_insert<long>`` inside
our library; messages of strings only were raised). setup.py now links the runtime's libstdc++
explicitly and checks the built library (tests/test_setup_build.py reproduces the copy on the
CPU). Since the first crashes no kernel throws for an invalid id (it writes an error record that
dept_mega.ops decodes), and the public API checks every argument in Python first; what still
throws from C++ is an operator's argument check when ``torch.ops.dept_mega`` is called directly.
The cases below are those throw sites, and the invalid-id calls that must now return without
throwing, run in a child process, again from the next case after a crash, so that one run names
every case that crashes. Runs wherever the extension is built (CUDA cases where it has CUDA
kernels and a GPU is present)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from dept_mega import ops

# (name, device, statement, the exception type or None: returns without raising, a part of its
# message); the statement calls the C++ operator itself (torch.ops.dept_mega), past the
# Python-side checks of dept_mega.ops
CASES = [
    ("torch_control", "cpu", "torch.empty(3, 4).view(5, 7)", "RuntimeError", "shape '[5, 7]'"),
    ("remap_dtype", "cpu", "O.remap_ids(torch.tensor([1.0]), torch.arange(10))",
     "TypeError", "ids must be int32 or int64"),
    ("remap_lookup_dims", "cpu", "O.remap_ids(torch.tensor([1]), torch.zeros(2, 2, dtype=torch.int64))",
     "ValueError", "lookup must be 1-D"),
    ("remap_ranked_size", "cpu", "O.remap_ranked(torch.tensor([1]), torch.zeros(1, dtype=torch.int64), -5, -1)",
     "ValueError", "got -5"),
    ("gather_dims", "cpu", "O.gather_rows(torch.zeros(4), torch.tensor([0]), None)",
     "ValueError", "table must be 2-D"),
    ("gather_out_dtype", "cpu", "O.gather_rows(torch.zeros(4, 2), torch.tensor([0]), torch.float64)",
     "TypeError", "out_dtype must be float32"),
    ("scatter_noncontiguous", "cpu", "O.scatter_add_rows_(torch.zeros(3, 4).t(), torch.tensor([0]), torch.ones(1, 3))",
     "ValueError", "must be contiguous"),
    # invalid ids: recorded, not thrown
    ("remap_out_of_range", "cpu", "O.remap_ids(torch.tensor([1, 5, 99]), torch.arange(10))", None, ""),
    ("remap_missing", "cpu", "O.remap_ids(torch.tensor([1, 5]), torch.tensor([0, -1, 2, 3, 4, 5]))", None, ""),
    ("remap_ranked_missing", "cpu",
     "O.remap_ranked(torch.tensor([2, 3]), ops.VocabRanks.from_ids(torch.arange(0, 100, 2), 100).words, 100, -1)",
     None, ""),
    ("gather_out_of_range", "cpu", "O.gather_rows(torch.zeros(4, 2), torch.tensor([0, 7]), None)", None, ""),
    ("scatter_out_of_range", "cpu", "O.scatter_mean_rows_(torch.zeros(4, 2), torch.tensor([7]), torch.ones(1, 2))",
     None, ""),
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


def _run_children(cases: list[tuple]) -> tuple[list[list[str]], dict[str, str]]:
    """Runs the cases in a child process; when the child dies, again from the case after the one
    it died in, so that one run names every case that crashes (a GPU session has no time for one
    run per crash). Returns the child's lines and {case: how the child died (its stderr's end)}."""
    lines, crashed, todo = [], {}, [(name, stmt) for name, _, stmt, _, _ in cases]
    while todo:
        p = subprocess.run([sys.executable, "-c", "CASES = " + repr(todo) + "\n" + CHILD], capture_output=True,
                           text=True, timeout=240)
        got = [line.split(" ", 2) for line in p.stdout.splitlines() if line.startswith(("start", "none", "raised"))]
        lines += got
        if p.returncode == 0:
            break
        started = [rest[0] for kind, *rest in got if kind == "start"]
        where = started[-1] if started else todo[0][0]
        crashed[where] = f"status {p.returncode}: {p.stderr[-1500:]}"
        todo = todo[[name for name, _ in todo].index(where) + 1:]
    return lines, crashed


def test_every_cpp_error_reaches_python_as_its_exception():
    cases = _cases()
    lines, crashed = _run_children(cases)
    assert not crashed, (f"the child died in {len(crashed)} of {len(cases)} cases: {sorted(crashed)} "
                         f"(the first: {next(iter(crashed.values()))})")
    outcome = {}
    for kind, name, *rest in lines:
        if kind != "start":
            outcome[name] = (kind, rest[0] if rest else "")
    for name, _, _, exc_type, part in cases:
        kind, text = outcome.get(name, ("missing", ""))
        if exc_type is None:
            assert kind == "none", (name, kind, text)
            continue
        assert kind == "raised", (name, kind)
        assert text.startswith(exc_type + " ") and part in text, (name, text)
