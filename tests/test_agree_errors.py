"""dept_mega.parallel.agree.agree_errors across ranks (gloo, forked ranks): an error of the
agreed kinds is raised on every rank, marked; any other exception on one rank must not leave the
others waiting in the gather."""
from __future__ import annotations

from dept_mega.config import ConfigError
from tests.mp_utils import run_distributed


def _outcome(rank: int, world: int, fail: dict) -> tuple:
    from dept_mega.parallel.agree import agree_errors, is_agreed

    def fn():
        if rank in fail:
            raise fail[rank]
        return rank

    try:
        return ("ok", agree_errors(fn, (ConfigError,)))
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        return (type(exc).__name__, str(exc), is_agreed(exc))


def test_an_agreed_kind_is_raised_on_every_rank_marked():
    out = run_distributed(_outcome, 2, args=({1: ConfigError("config key 'x': bad")},), timeout=60)
    assert out == [("ConfigError", "config key 'x': bad", True)] * 2, out


def test_another_exception_on_one_rank_does_not_leave_the_others_waiting():
    """Rank 1 hits an OSError (not an agreed kind): it raises its own, unmarked; rank 0, whose
    check passed, does not wait in the gather for it (until the process group's timeout) but
    raises an error naming rank 1 and what it hit."""
    out = run_distributed(_outcome, 2, args=({1: PermissionError("cannot read /data/x.bin")},), timeout=60)
    assert out[1] == ("PermissionError", "cannot read /data/x.bin", False), out
    kind, text, agreed = out[0]
    assert kind == "RuntimeError" and not agreed, out
    assert text.startswith("rank 1 failed where every rank checks the same inputs: PermissionError: cannot read "
                           "/data/x.bin"), out


def test_a_rank_with_its_own_other_exception_keeps_it():
    """Rank 0 has an agreed-kind error, rank 1 another exception: rank 1 raises its own (it is
    not lost behind rank 0's), rank 0 its agreed one."""
    out = run_distributed(_outcome, 2, args=({0: ConfigError("config key 'x': bad"), 1: KeyError("k")},),
                          timeout=60)
    assert out == [("ConfigError", "config key 'x': bad", True), ("KeyError", "'k'", False)], out
