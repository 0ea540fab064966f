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


def _rank0_check(rank: int, world: int, exc: Exception) -> tuple:
    from dept_mega.parallel.agree import is_agreed
    from dept_mega.train import checked_on_rank0

    def check():
        raise exc

    try:
        checked_on_rank0(check, rank, None)
        return ("ok",)
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        return (type(e).__name__, str(e), is_agreed(e))


def test_rank0s_data_check_does_not_leave_the_others_waiting():
    """train.checked_on_rank0 (the data checks, rank 0 only): an input error is every rank's,
    marked; an OSError reading a data file on rank 0 makes the others raise too, not wait."""
    from dept_mega.data.indexed import IndexedFormatError
    out = run_distributed(_rank0_check, 2, args=(IndexedFormatError("a.idx: truncated"),), timeout=60)
    assert [o[1:] for o in out] == [("a.idx: truncated", True)] * 2, out
    out = run_distributed(_rank0_check, 2, args=(PermissionError("cannot read a.bin"),), timeout=60)
    assert out[0] == ("PermissionError", "cannot read a.bin", False), out
    assert out[1][0] == "RuntimeError" and "rank 0 failed" in out[1][1] and "cannot read a.bin" in out[1][1], out


def _take(rank: int, world: int, run_dir: str, exc) -> tuple:
    from dept_mega.parallel.agree import is_agreed
    from dept_mega.rundir import take_run_dir

    def check():
        if exc is not None:
            raise exc

    try:
        lock = take_run_dir(run_dir, rank, None, check=check)
        held = lock.held
        lock.release()
        return ("ok", held)
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        return (type(e).__name__, str(e), is_agreed(e))


def test_the_run_directory_start_does_not_leave_the_others_waiting(tmp_path):
    """rundir.take_run_dir: rank 0's refusal is every rank's, marked; an exception of another
    kind in rank 0's check makes the others raise too instead of waiting; without one every
    rank holds the lock."""
    run = str(tmp_path / "run")
    out = run_distributed(_take, 2, args=(run, ConfigError("config key 'x': bad")), timeout=60)
    assert out == [("ConfigError", "config key 'x': bad", True)] * 2, out
    out = run_distributed(_take, 2, args=(run, OSError("stale file handle")), timeout=60)
    assert out[0] == ("OSError", "stale file handle", False), out
    assert out[1][0] == "RuntimeError" and "rank 0 failed" in out[1][1], out
    assert run_distributed(_take, 2, args=(run, None), timeout=60) == [("ok", True)] * 2


def _lighthouse_check(rank: int, world: int) -> tuple:
    """Rank 1 alone cannot reach the lighthouse (its /status timed out there); rank 0 can."""
    from dept_mega.dept import federation_config
    from dept_mega.parallel.agree import is_agreed

    def check_reachable(host, port, timeout_s, groups):
        if rank == 1:
            raise ConfigError(f"config key 'federation.lighthouse': cannot reach {host}:{port} (timed out)")
        return 2

    federation_config.check_reachable = check_reachable  # this forked rank's own module
    try:
        return ("ok", federation_config.lighthouse_reachable("lh", 29510, 5.0, 2, None))
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        return (type(e).__name__, str(e), is_agreed(e))


def test_a_lighthouse_one_rank_cannot_reach_stops_every_rank():
    """The group job's lighthouse check is agreed: rank 0, which reached it, does not go on to
    the quorum (and wait there for rank 1) but stops with rank 1's line."""
    out = run_distributed(_lighthouse_check, 2, timeout=60)
    line = "config key 'federation.lighthouse': cannot reach lh:29510 (timed out)"
    assert out == [("ConfigError", line, True)] * 2, out
