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
