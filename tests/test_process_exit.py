"""dept_mega.process_exit: what a launched process left in reference cycles (where the gloo
process groups sit) is freed before the interpreter shuts down, and the status is kept."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

SCRIPT = textwrap.dedent("""
    import atexit, weakref
    from dept_mega.process_exit import exit_after

    class Held:  # stands for the trainer <-> loop <-> hooks cycle holding the process groups
        pass

    def main():
        a, b = Held(), Held()
        a.other, b.other = b, a
        f = weakref.finalize(a, print, "freed", flush=True)
        f.atexit = False
        atexit.register(print, "interpreter shutdown", flush=True)
        return 3

    {call}
""")


def _run(call: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT.format(call=call)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))


def test_cycles_are_freed_before_shutdown_and_the_status_kept():
    done = _run("exit_after(main)")
    assert done.returncode == 3, done.stderr
    assert done.stdout.split() == ["freed", "interpreter", "shutdown"], done.stdout


def test_without_it_the_cycle_outlives_main():
    """The control: a plain ``sys.exit(main())`` leaves the cycle to the shutdown."""
    done = _run("import sys; sys.exit(main())")
    assert done.returncode == 3, done.stderr
    assert done.stdout.split()[:2] == ["interpreter", "shutdown"], done.stdout


def test_the_entry_points_use_it():
    for path in ("dept_mega/train.py", "dept_mega/evaluate.py", "dept_mega/adapt.py", "tools/benchmark.py"):
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            text = f.read()
        assert "exit_after(main)" in text and "sys.exit(main())" not in text, path
