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
    """``train --check | head``, ``train --print-config | head``, ``dept_costs | head``: no
    BrokenPipeError traceback, exit status 141 (128 + SIGPIPE), as a standard tool.

    ``train --check`` runs as a real process (the interpreter's own flush at its exit included);
    the other two run their ``main`` through ``exit_after`` in this process with ``sys.stdout`` a
    pipe whose reader is gone (what their ``__main__`` does, test_the_entry_points_use_it), and the
    stream is closed after it as the interpreter would: without a fresh interpreter's ~2 s each."""
    import contextlib
    import io
    from unittest import mock

    import pytest

    from dept_mega import train as train_cli
    from dept_mega.process_exit import EXIT_BROKEN_PIPE, exit_after
    from tests.test_train_cli import _setup
    from tools import dept_costs
    cfg = _setup(tmp_path)
    args = ["-m", "dept_mega.train", "--config", cfg, "--check", "--world-size", "2"]
    done = _piped_into_closed_reader([sys.executable, *args])
    assert done.returncode == EXIT_BROKEN_PIPE and done.stderr == "", (args, done.returncode, done.stderr)
    for main, argv in ((train_cli.main, ["--config", cfg, "--print-config"]),
                       (dept_costs.main, ["--config", cfg, "--source-vocab", "120"])):
        read, write = os.pipe()
        os.close(read)
        stdout = os.fdopen(write, "w")  # block-buffered, as a process's stdout into a pipe
        err = io.StringIO()
        with mock.patch.dict(os.environ, {"DEPT_MEGA_DEVICE": "cpu"}), mock.patch.object(sys, "stdout", stdout), \
                contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
            exit_after(lambda: main(argv))
        stdout.close()  # the interpreter's flush at exit: must not fail again
        assert exited.value.code == EXIT_BROKEN_PIPE and err.getvalue() == "", (argv, exited.value.code, err.getvalue())


def test_a_broken_pipe_that_is_not_stdout_is_a_real_error(tmp_path):
    """A BrokenPipeError from another pipe (a worker or peer that died) while standard output is
    fine is raised as it is (a traceback, a failed status), not taken for ``| head``'s quiet
    exit: 141 and no word would hide why a run stopped."""
    from unittest import mock

    import pytest

    from dept_mega.process_exit import exit_after

    def main():
        read, write = os.pipe()
        os.close(read)
        try:
            os.write(write, b"to a worker that died")
        finally:
            os.close(write)
        return 0

    with open(tmp_path / "out.txt", "w") as stdout, mock.patch.object(sys, "stdout", stdout), \
            pytest.raises(BrokenPipeError):
        exit_after(main)


LEAVE = textwrap.dedent("""
    import atexit, os, sys, threading, time
    from dept_mega.process_exit import exit_after

    class Teardown:  # held by a module global: freed only by the interpreter's teardown
        def __del__(self):
            os.write(1, b"teardown\\n")

    KEPT = Teardown()

    def main():
        def late_writer():  # a non-daemon thread still working when main returns
            time.sleep(0.3)
            with open(sys.argv[1], "w") as f:
                f.write("written")
        threading.Thread(target=late_writer).start()
        atexit.register(print, "atexit ran")
        sys.stdout.write("buffered, not flushed\\n")  # stdout is a pipe: block-buffered
        import ctypes
        ctypes.CDLL(None).printf(b"C stdio, buffered\\n")  # as a C library (NCCL) prints
        return 5

    exit_after(main)
""")


def test_the_process_leaves_without_the_interpreter_teardown(tmp_path):
    """exit_after ends the process as the interpreter would — non-daemon threads joined, atexit
    handlers run, buffered output flushed, the status kept — but skips the teardown that frees
    every module (about 0.5 s per process with torch imported); C's stdio buffers are flushed too.
    DEPT_MEGA_FULL_EXIT=1: the full exit."""
    for full in (False, True):
        out = tmp_path / f"thread_{full}.txt"
        env = dict(os.environ, PYTHONPATH=ROOT, DEPT_MEGA_FULL_EXIT="1" if full else "0")
        env.pop("PYTHONUNBUFFERED", None)  # block-buffered stdout: what the final flush must write
        done = subprocess.run([sys.executable, "-c", LEAVE, str(out)], cwd=ROOT, capture_output=True, text=True,
                              timeout=60, env=env)
        assert done.returncode == 5, done.stderr
        assert out.read_text() == "written"
        lines = done.stdout.splitlines()
        assert lines[0] == "buffered, not flushed" and "atexit ran" in lines, done.stdout
        assert ("teardown" in lines) == full, done.stdout
        assert "C stdio, buffered" in lines, done.stdout
