"""A tools/ script run in this process as ``python SCRIPT ARGS...`` would run it
(:func:`tests.trainer_utils.run_script`: no fresh interpreter importing torch again, ~3 s of
CPU each), its exit status and output returned as a subprocess's would be."""
from __future__ import annotations

from types import SimpleNamespace

from tests.trainer_utils import ROOT, run_script


def run_tool(script: str, *args: str, capsys, monkeypatch, cwd: str = ROOT) -> SimpleNamespace:
    """``returncode``, ``stdout``, ``stderr`` of ``python SCRIPT ARGS...`` run in ``cwd``; an
    exit with a message (``sys.exit("...")``) is status 1 with the message on stderr, as Python
    gives it. The working directory, sys.path, sys.argv and environment are the test's again
    afterwards. What the test printed before the call and had not read is discarded."""
    capsys.readouterr()
    with monkeypatch.context() as patch:
        patch.chdir(cwd)
        code = run_script(str(script), *args, monkeypatch=patch)
    out, err = capsys.readouterr()
    if code is None:
        code = 0
    elif not isinstance(code, int):
        err, code = f"{err}{code}\n", 1
    return SimpleNamespace(returncode=code, stdout=out, stderr=err)
