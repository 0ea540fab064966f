"""tools/preprocess_data.py --partitions: the line numbers of bad lines are those of the whole
input in every part, counted in one pass at most, and the output is the unpartitioned one."""
from __future__ import annotations

import os
import re
import signal
import time

import pytest

import dept_mega.data.partitions as parts_mod
from dept_mega.data.preprocess import PreprocessError, _encode_batch as real_encode, preprocess
from tests.data_utils import synthetic_texts, train_tiny_tokenizer, write_jsonl

BAD = {"invalid_json": b"not json\n", "missing_key": b'{"body": "x"}\n', "non_string": b'{"text": 7}\n',
       "empty_text": b'{"text": ""}\n'}


@pytest.fixture(scope="module")
def tok_model(tmp_path_factory):
    return train_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")), vocab=200)


def _inputs(tmp_path) -> tuple[list[str], dict[str, list[str]]]:
    """Two files with bad lines of every kind spread over them (so over every part); the
    expected places of each kind."""
    want: dict[str, list[str]] = {k: [] for k in BAD}
    paths = []
    for name, n, seed in (("a.jsonl", 230, 1), ("b.jsonl", 170, 2)):
        path = write_jsonl(str(tmp_path / name), synthetic_texts(n, seed=seed))
        with open(path, "rb") as f:
            lines = f.readlines()
        kinds = list(BAD)
        for i in range(7, len(lines), 23):  # every 23rd line, the kinds in turn
            kind = kinds[(i // 23) % len(kinds)]
            lines[i] = BAD[kind]
            want[kind].append(f"{path}:{i + 1}")
        with open(path, "wb") as f:
            f.write(b"".join(lines))
        paths.append(path)
    return paths, want


@pytest.mark.parametrize("partitions,workers", [(1, 1), (3, 1), (4, 2), (5, 3)])
def test_bad_line_numbers_are_the_inputs_in_every_part(tmp_path, tok_model, monkeypatch, partitions, workers):
    paths, want = _inputs(tmp_path)
    counted = []
    real = parts_mod.count_newlines
    monkeypatch.setattr(parts_mod, "count_newlines", lambda path, start, end: counted.append((path, start, end))
                        or real(path, start, end))
    monkeypatch.setattr("dept_mega.data.jsonl.MAX_EXAMPLES", 100)  # every place, not the first 5
    st = preprocess(paths, ["text"], tok_model, str(tmp_path / "o"), partitions=partitions, workers=workers,
                    log=None, round_trip_every=3)
    assert st.report.counts == {k: len(v) for k, v in want.items()}
    assert {k: [e.split(" ('")[0] for e in v] for k, v in st.report.examples.items()} == want
    assert st.lines == 400
    # the line numbers at the cuts: no byte is counted twice (not from byte 0 for each part)
    for path in paths:
        spans = sorted((a, b) for p, a, b in counted if p == path)
        assert all(b0 <= a1 for (_, b0), (a1, _) in zip(spans, spans[1:])), spans
    out = {ext: open(str(tmp_path / "o_text_document") + ext, "rb").read() for ext in (".bin", ".idx", ".bytes.npy")}
    ref = preprocess(paths, ["text"], tok_model, str(tmp_path / "r"), log=None, round_trip_every=3)
    assert st.round_trip[0] == ref.round_trip[0]  # the same lines checked (every 3rd of the whole input)
    assert out == {ext: open(str(tmp_path / "r_text_document") + ext, "rb").read()
                   for ext in (".bin", ".idx", ".bytes.npy")}


_MARKS: list = []  # [directory, the real _encode_batch] of the test below (forked processes inherit it)


def _rendezvous(batch, first=0):
    """_encode_batch, but a process's first batch waits until two processes have started one."""
    marks, real = _MARKS
    mark = marks / f"started_{os.getpid()}"
    if not mark.exists():
        mark.touch()
        deadline = time.time() + 20
        while len(list(marks.glob("started_*"))) < 2:
            if time.time() > deadline:
                raise RuntimeError("no other process started tokenizing meanwhile")
            time.sleep(0.01)
    return real(batch, first)


def test_partitions_run_side_by_side(tmp_path, tok_model, monkeypatch):
    """With --workers 2 --partitions 2 the two parts tokenize at the same time, each in its own
    process (with one worker each: no pool): each part's first batch waits until the other part
    has started (parts one after the other would wait in vain)."""
    import dept_mega.data.preprocess as pp
    paths, _ = _inputs(tmp_path)
    (tmp_path / "marks").mkdir()
    monkeypatch.setattr(pp, "_encode_batch", _rendezvous)
    _MARKS[:] = [tmp_path / "marks", real_encode]
    try:
        st = preprocess(paths, ["text"], tok_model, str(tmp_path / "o"), partitions=2, workers=2, log=None)
    finally:
        _MARKS.clear()
    assert st.lines == 400 and len(list((tmp_path / "marks").glob("started_*"))) == 2
    assert not list(tmp_path.glob("o*.tmp"))  # the partitions directory, removed after the merge


def test_strict_stops_every_partition(tmp_path, tok_model):
    paths, want = _inputs(tmp_path)
    with pytest.raises(PreprocessError, match="bad input and --strict given: nothing written") as e:
        preprocess(paths, ["text"], tok_model, str(tmp_path / "o"), partitions=3, workers=3, strict=True, log=None)
    assert "invalid_json" in str(e.value) or "missing_key" in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "b.jsonl"]


def _child_exits(q, index):
    if index == 1:
        os._exit(3)  # dies without "done" (as a process killed by the OOM killer would)
    q.put(("done", index))


def _child_sleeps(q, index):
    if index == 0:
        q.put(("error", index))
    else:
        time.sleep(60)
    q.put(("done", index))


def test_run_in_processes_reports_a_dead_child_and_stops_the_others():
    from dept_mega.data.partitions import run_in_processes
    seen = []
    with pytest.raises(RuntimeError, match=r"partition 1 ended \(exit code 3\) before finishing"):
        run_in_processes([(0,), (1,), (2,)], _child_exits, 3, seen.append, poll=0.05)

    def on_message(msg):
        if msg[0] == "error":
            raise ValueError("stop")

    t0 = time.time()
    with pytest.raises(ValueError, match="stop"):
        run_in_processes([(0,), (1,)], _child_sleeps, 2, on_message, poll=0.05)
    assert time.time() - t0 < 20  # the sleeping child was terminated, not waited for


def _child_deaf(q, index):
    if index == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        q.put(("deaf", index))
        time.sleep(60)
    else:
        q.put(("error", index))
        time.sleep(60)  # ends through the stop only (an end of its own would be an error of its own)


def test_run_in_processes_kills_a_child_that_outlives_its_stop_wait_and_says_so():
    """A child still there ``stop_wait`` seconds after SIGTERM (stuck, or deaf to it) is killed,
    and the log names it: the tool's stop is bounded, not a 30 s wait per child."""
    from dept_mega.data.partitions import run_in_processes
    seen, logged = set(), []

    def on_message(msg):
        seen.add(msg[0])
        if seen == {"deaf", "error"}:
            raise ValueError("stop")

    t0 = time.time()
    with pytest.raises(ValueError, match="stop"):
        run_in_processes([(0,), (1,)], _child_deaf, 2, on_message, poll=0.05, log=logged.append, stop_wait=1.0)
    assert time.time() - t0 < 10
    assert len(logged) == 1 and re.fullmatch(r"\[preprocess\] the process of partition 1 \(pid \d+\) had not ended "
                                             r"1 s after SIGTERM: killed", logged[0]), logged


_BOOTSTRAP_SIGNAL = """
import multiprocessing.util, os, signal, sys
sys.path.insert(0, {root!r})
from dept_mega.data.partitions import run_in_processes
from dept_mega.data.stop_signals import stop_on_signals
real = multiprocessing.util._close_stdin
def signalled():  # in the child, in multiprocessing's start-up code, before the target runs
    os.kill(os.getpid(), signal.SIGTERM)
    real()
multiprocessing.util._close_stdin = signalled
def target(q, index):
    q.put(("done", index))
with stop_on_signals():
    try:
        run_in_processes([(0,)], target, 1, lambda m: None, poll=0.05)
    except RuntimeError as exc:
        print("error:", exc)
"""


def test_a_signal_in_a_childs_start_up_ends_it_quietly(tmp_path):
    """SIGTERM to the whole process group can reach a partition's process while multiprocessing's
    start-up code runs, before its own handling began: the child is forked with the signals
    blocked, so it ends with status 1 once its handling is in place (no traceback from
    multiprocessing's bootstrap, as a fresh-clone suite once saw)."""
    import subprocess
    import sys

    from tests.data_utils import ROOT
    driver = tmp_path / "driver.py"
    driver.write_text(_BOOTSTRAP_SIGNAL.format(root=ROOT))
    res = subprocess.run([sys.executable, str(driver)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    assert "error: the process of partition 0 ended (exit code 1) before finishing" in res.stdout, res.stdout


def _child_dies_mid_message(q, index):
    import threading
    q.put(("first", index))
    threading.Timer(0.3, os._exit, args=(1,)).start()  # (as SIGKILL would, or os._exit on a signal)
    q.put(("big", b"x" * (1 << 20)))  # more than a pipe holds: stuck part way while the parent is busy


def _run_mid_message(out):
    from dept_mega.data.partitions import run_in_processes

    def on_message(msg):
        if msg[0] == "first":
            time.sleep(1.0)  # busy: the child's next message fills the pipe, then the child ends
        out.put(("message", msg[0]))

    try:
        run_in_processes([(0,)], _child_dies_mid_message, 1, on_message, poll=0.05)
    except RuntimeError as exc:
        out.put(("error", str(exc)))


def test_a_child_that_ends_part_way_through_a_message_is_an_error_not_a_hang():
    """A child killed while it sends a message leaves half of it behind: the parent reads what
    came whole, then reports the child's end (a shared queue's reader would wait for the rest
    for ever)."""
    from tests.data_utils import in_a_fork
    got = in_a_fork(_run_mid_message, 20, "waiting for the rest of a message from a child that ended")
    assert got == [("message", "first"),
                   ("error", "the process of partition 0 ended (exit code 1) before finishing")], got


def _child_leaves_a_process_holding_its_pipe(q, index):
    pid = os.fork()
    if pid == 0:  # (as a tokenizer worker that outlives its partition's process, where nothing kills it)
        time.sleep(30)
        os._exit(0)
    q.put(("grandchild", pid))
    os._exit(3)


def test_a_dead_child_is_reported_while_a_process_it_started_holds_its_pipe():
    from dept_mega.data.partitions import run_in_processes
    seen = []
    t0 = time.time()
    try:
        with pytest.raises(RuntimeError, match=r"partition 0 ended \(exit code 3\) before finishing"):
            run_in_processes([(0,)], _child_leaves_a_process_holding_its_pipe, 1, seen.append, poll=0.05)
        assert time.time() - t0 < 10
    finally:
        for _, pid in seen:
            os.kill(pid, signal.SIGKILL)
    assert [m[0] for m in seen] == ["grandchild"]
