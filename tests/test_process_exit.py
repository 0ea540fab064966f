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
    for path in ("dept_mega/train.py", "dept_mega/evaluate.py", "dept_mega/adapt.py", "tools/benchmark.py",
                 "tools/dept_costs.py", "tools/summarize_runs.py", "tools/study.py", "tools/glob_rows.py",
                 "dept_mega/ops/__main__.py"):
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            text = f.read()
        assert "exit_after(main)" in text and "sys.exit(main())" not in text, path


def _piped_into_closed_reader(args: list[str]) -> subprocess.CompletedProcess:
    """Run ``args`` with its stdout a pipe whose read end is closed at once (``| head -0``:
    the reader went away before the first line), deterministically: every write fails."""
    read, write = os.pipe()
    os.close(read)
    env = dict(os.environ, PYTHONPATH=ROOT, DEPT_MEGA_DEVICE="cpu")
    try:
        done = subprocess.run(args, stdout=write, stderr=subprocess.PIPE, text=True, timeout=120, cwd=ROOT, env=env)
    finally:
        os.close(write)
    return done


def test_a_closed_stdout_ends_the_clis_quietly(tmp_path):
    """``train --print-config | head``, ``train --check | head``, ``dept_costs | head``: no
    BrokenPipeError traceback, exit status 141 (128 + SIGPIPE), as a standard tool."""
    from dept_mega.process_exit import EXIT_BROKEN_PIPE
    from tests.test_train_cli import _setup
    cfg = _setup(tmp_path)
    for args in (["-m", "dept_mega.train", "--config", cfg, "--print-config"],
                 ["-m", "dept_mega.train", "--config", cfg, "--check", "--world-size", "2"],
                 [os.path.join(ROOT, "tools", "dept_costs.py"), "--config", cfg, "--source-vocab", "120"]):
        done = _piped_into_closed_reader([sys.executable, *args])
        assert done.returncode == EXIT_BROKEN_PIPE and done.stderr == "", (args, done.returncode, done.stderr)
