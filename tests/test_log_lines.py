"""Lines that processes sharing a terminal write (the preprocessing tool and its workers, a
job's ranks, the group jobs of one allocation) reach the stream in one write each.
``print()`` writes the text and its newline apart: another process's line written in between
lands inside the line (seen: a worker's marker inside a preprocessing progress line, and a test
that looked for the marker at a line's start waited out a 60 s block)."""
from __future__ import annotations

import io
import sys

import pytest

from dept_mega.log_lines import write_line
from dept_mega.metrics import MetricsWriter
from dept_mega.process_exit import report_error


class Writes(io.StringIO):
    def __init__(self):
        super().__init__()
        self.calls = []

    def write(self, s):
        self.calls.append(s)
        return super().write(s)


def _stderr_line(stream, monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "stderr", stream)
    write_line("[preprocess]  10.3% (0.0 of 0.0 MB)")


def _metrics_log(stream, monkeypatch, tmp_path):
    writer = MetricsWriter(str(tmp_path), enabled=True, stream=stream, tensorboard=False)
    writer.log("step 3 | loss 4.1")
    writer.close()


def _report_error(stream, monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    report_error("data.sources[0].path: no such file", file=stream)


def _lighthouse(stream, monkeypatch, tmp_path):
    """The lighthouse command's address line (torchft logs from its own threads meanwhile)."""
    import signal
    from types import SimpleNamespace

    from dept_mega import lighthouse

    class Server:
        def address(self):
            return "http://node017:29510"

        def shutdown(self):
            pass
    monkeypatch.setattr(lighthouse, "serve", lambda *a, **k: Server())
    monkeypatch.setattr(sys, "stdout", stream)
    # (it runs until killed: here it returns at once, its signal handlers not installed)
    monkeypatch.setattr(lighthouse, "threading", SimpleNamespace(Event=lambda: SimpleNamespace(wait=lambda: True)))
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    pytest.importorskip("torchft")
    assert lighthouse.main(["--port", "29510", "--min-groups", "1"]) == 0


@pytest.mark.parametrize("writer", [_stderr_line, _metrics_log, _report_error, _lighthouse])
def test_a_line_is_one_write(writer, monkeypatch, tmp_path):
    stream = Writes()
    writer(stream, monkeypatch, tmp_path)
    assert stream.calls, "nothing was written"
    assert all(c.endswith("\n") and c.count("\n") == 1 for c in stream.calls), stream.calls
