"""tools/preprocess_data.py stopped part way (SIGTERM, as a batch system ends a job): the
earlier run's files are gone before anything is written, and this run's partial files are
removed; the tokenizer record is written before the data it describes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from dept_mega.data.indexed import IndexedDatasetBuilder, tokenizer_record_path
from dept_mega.data.preprocess import preprocess
from tests.data_utils import ROOT, TOOLS, synthetic_texts, train_tiny_tokenizer, write_jsonl

# Runs the tool with batches of 10 lines and blocks in the tokenizing of the first batch that starts
# at input line L or later (0-based; in the main process, a partition's process or a pool worker: forked,
# they share the patch), after saying so on stderr: the test then knows the run is part way,
# without timing.
DRIVER = textwrap.dedent("""
    import sys, time
    sys.path[:0] = [{root!r}, {tools!r}]
    import dept_mega.data.preprocess as pp
    real = pp._encode_batch
    def blocking(batch, first=0):
        if first >= int(sys.argv[1]):
            print("BLOCKED", file=sys.stderr, flush=True)
            time.sleep(60)
        return real(batch, first)
    pp._encode_batch, pp.BATCH_LINES = blocking, 10
    import preprocess_data
    sys.exit(preprocess_data.main(sys.argv[2:]))
""")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tok"))
    return train_tiny_tokenizer(d, vocab=200), train_tiny_tokenizer(d, vocab=150)


@pytest.mark.parametrize("workers,partitions,block", [(1, 1, 20), (1, 2, 70), (2, 1, 20), (2, 2, 70)])
def test_sigterm_part_way_leaves_nothing(tmp_path, tokenizers, workers, partitions, block):
    old_tok, new_tok = tokenizers
    src = write_jsonl(str(tmp_path / "a.jsonl"), synthetic_texts(100, seed=3))
    out = str(tmp_path / "out")
    preprocess([src], ["text"], old_tok, out, log=None)  # an earlier run, with another tokenizer
    data = out + "_text_document"
    old = sorted(os.listdir(tmp_path))
    assert data + ".idx" in [str(tmp_path / f) for f in old] and os.path.isfile(tokenizer_record_path(data))
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(root=ROOT, tools=TOOLS))
    p = subprocess.Popen([sys.executable, str(driver), str(block), "--input", src, "--tokenizer-model", new_tok,
                          "--output-prefix", out, "--workers", str(workers), "--partitions", str(partitions),
                          "--log-interval", "0"], stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        log = []
        for line in p.stderr:
            log.append(line)
            if line.startswith("BLOCKED"):
                break
        assert log and log[-1].startswith("BLOCKED"), "".join(log)
        assert log[0].startswith("[preprocess] removed 5 files of an earlier run into this --output-prefix")
        if workers == 1:  # batches were written before the block (a worker may block before any is)
            assert any("% (" in line for line in log), "".join(log)
        # part way: none of the earlier run's data or record is left (a SIGKILL now leaves no
        # complete-looking data), only this run's temporary files
        now = set(os.listdir(tmp_path)) - {"driver.py", "a.jsonl"}
        assert now and all(f.endswith(".tmp") for f in now), now
        assert ("out.partitions.tmp" in now) == (partitions > 1), now
        p.send_signal(signal.SIGTERM)
        rest = p.stderr.read()
        assert p.wait(timeout=30) == 143, rest
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert rest.strip().endswith("terminated (SIGTERM); partial files removed, no output written"), rest
    assert "Traceback" not in rest
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl", "driver.py"]


def test_record_is_written_before_the_data(tmp_path, tokenizers, monkeypatch):
    """Data that looks complete (its .idx in place) always has its tokenizer record: the
    record is written first, and a run stopped in between leaves the record without data."""
    src = write_jsonl(str(tmp_path / "a.jsonl"), synthetic_texts(30, seed=3))
    out = str(tmp_path / "out")
    real = IndexedDatasetBuilder.finalize
    finalized = []

    def finalize(self):
        if ".partitions.tmp" not in self.prefix:
            assert os.path.isfile(tokenizer_record_path(self.prefix)), "finalized before its record"
        finalized.append(self.prefix)
        real(self)

    monkeypatch.setattr(IndexedDatasetBuilder, "finalize", finalize)
    for partitions in (1, 2):
        preprocess([src], ["text"], tokenizers[0], out, log=None, partitions=partitions)
    assert finalized.count(out + "_text_document") == 2

    def failing(self):  # stopped in the finalize: no output of the run is left
        raise KeyboardInterrupt

    monkeypatch.setattr(IndexedDatasetBuilder, "finalize", failing)
    with pytest.raises(KeyboardInterrupt):
        preprocess([src], ["text"], tokenizers[0], out, log=None)
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl"]


# Blocks the removal of the partitions directory (the last step of a stopped --partitions run's
# cleanup, in the main process) after saying so, until the file GO exists.
CLEANUP_HOOK = """
    import os
    real_remove_dir = pp.remove_partitions_dir
    def remove_dir(prefix):
        print("CLEANUP", file=sys.stderr, flush=True)
        while not os.path.exists({go!r}):
            time.sleep(0.01)
        return real_remove_dir(prefix)
    pp.remove_partitions_dir = remove_dir
"""


@pytest.mark.parametrize("first,status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_second_signal_does_not_cut_the_cleanup_short(tmp_path, tokenizers, first, status):
    """SIGTERM or Ctrl-C, then both again while the partial files are being removed: the later
    ones are ignored, the removal finishes, and the exit status is the first signal's."""
    src = write_jsonl(str(tmp_path / "a.jsonl"), synthetic_texts(100, seed=3))
    go = tmp_path / "go"
    driver = tmp_path / "driver.py"
    hook = textwrap.dedent(CLEANUP_HOOK.format(go=str(go))).lstrip()
    driver.write_text(DRIVER.format(root=ROOT, tools=TOOLS).replace("import preprocess_data\n",
                                                                    hook + "import preprocess_data\n"))
    p = subprocess.Popen([sys.executable, str(driver), "70", "--input", src, "--tokenizer-model", tokenizers[0],
                          "--output-prefix", str(tmp_path / "out"), "--partitions", "2"],
                         stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        log = []
        for wanted, signals in (("BLOCKED", [first]), ("CLEANUP", [signal.SIGTERM, signal.SIGINT])):
            for line in p.stderr:
                log.append(line)
                if line.startswith(wanted):
                    break
            assert log and log[-1].startswith(wanted), "".join(log)
            for sig in signals:
                p.send_signal(sig)
        assert os.path.isdir(tmp_path / "out.partitions.tmp")  # not removed yet: the hook waits
        go.write_text("")
        rest = p.stderr.read()
        assert p.wait(timeout=30) == status, rest
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert "Traceback" not in rest, rest
    assert rest.strip().endswith("partial files removed, no output written"), rest
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl", "driver.py", "go"]


# Widens, without changing what happens, the windows in which a stopped run's pool could hang
# (dept_mega/data/stop_signals.py): the pool replaces a worker that died 0.2 s after it died
# (after the main process's stop), a worker takes 0.8 s to start (before the pool's worker loop
# runs the initializer), and terminate() comes 0.4 s after the stop (after the replacements).
SLOW_POOL = """
    import multiprocessing.pool as mpp
    real_maintain, real_worker, real_terminate = mpp.Pool._maintain_pool, mpp.worker, mpp.Pool.terminate
    def maintain(*args):
        if any(p.exitcode is not None for p in args[3]):
            time.sleep(0.2)
        return real_maintain(*args)
    def worker(*args, **kwargs):
        time.sleep(0.8)
        return real_worker(*args, **kwargs)
    def terminate(self):
        time.sleep(0.4)
        return real_terminate(self)
    mpp.Pool._maintain_pool, mpp.worker, mpp.Pool.terminate = staticmethod(maintain), worker, terminate
"""


def _group_members(pgid: int) -> list[str]:
    """The processes (pid and command) in process group ``pgid``, from /proc."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:  # ended meanwhile
            continue
        if int(stat[stat.rindex(")") + 2:].split()[2]) == pgid:
            found.append(stat[:stat.rindex(")") + 1])
    return found


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process group from /proc")
@pytest.mark.parametrize("partitions", [1, 2])
@pytest.mark.parametrize("sig,status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_to_the_process_group_stops_every_process(tmp_path, tokenizers, sig, status, partitions):
    """Ctrl-C in a terminal (SIGINT to the whole process group) or SIGTERM to every process, with
    --workers 4: the workers' pool must not replace a worker that died of it by one that ignores
    the pool's SIGTERM (it would wait for it for ever). The tool exits with the signal's status
    within seconds, no output and no process of the group left; twice each."""
    src = write_jsonl(str(tmp_path / "a.jsonl"), synthetic_texts(100, seed=3))
    driver = tmp_path / "driver.py"
    hook = textwrap.dedent(SLOW_POOL).lstrip()
    driver.write_text(DRIVER.format(root=ROOT, tools=TOOLS).replace("import preprocess_data\n",
                                                                    hook + "import preprocess_data\n"))
    for attempt in range(2):
        # every batch from line 20 on blocks: every worker is busy (an idle one, killed by SIGTERM just
        # as it takes the task queue's lock, would hang terminate(): a limit of multiprocessing's pool)
        p = subprocess.Popen([sys.executable, str(driver), "20", "--input", src,
                              "--tokenizer-model", tokenizers[0], "--output-prefix", str(tmp_path / "out"),
                              "--workers", "4", "--partitions", str(partitions), "--log-interval", "0"],
                             stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
        try:
            log = []
            for line in p.stderr:
                log.append(line)
                if line.startswith("BLOCKED"):
                    break
            assert log and log[-1].startswith("BLOCKED"), "".join(log)
            os.killpg(p.pid, sig)
            try:
                rest = p.communicate(timeout=15)[1]
            except subprocess.TimeoutExpired:
                raise AssertionError(f"attempt {attempt}: still running 15 s after {sig.name} to the group: "
                                     f"{_group_members(p.pid)}") from None
            assert p.returncode == status, rest
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        assert "Traceback" not in rest, rest
        assert rest.strip().endswith("partial files removed, no output written"), rest
        assert _group_members(p.pid) == [], f"attempt {attempt}: left running"
        assert sorted(os.listdir(tmp_path)) == ["a.jsonl", "driver.py"]
