"""A group job that has finished the run, told apart from one that is gone (dept/federation.py).

A group job that trained its last step stops heartbeating, as a killed one does, so a job that
waits for a quorum (a requeued job that resumes behind the others) cannot tell from torchft
whether the groups it waits for will come back: it would give up after
``federation.quorum_give_up_s``, exit for a requeue and, requeued, wait and give up again for
ever. So a group job that finishes the run leaves a record at the lighthouse, the one place
every group job reaches: one heartbeat under the id :func:`record_id` (``dept_finished_group_G_
step_S_KEY``), which torchft's lighthouse lists on its ``/status`` page for as long as it runs
(marked old after its ``--heartbeat-timeout-s``; a heartbeat is all its interface stores). KEY
is a hash of the keys every group job agrees on (``federation_config.AGREE_KEYS``), so records
of another run's config on the same lighthouse do not count. torchft's lighthouse never forgets
a heartbeat, so the records of an earlier run of the same config on a long-lived lighthouse are
there too; a record counts only when it was written during this run: after the run's start
(``RUN/run_start.json``, written at its first launch: a partner that finished while this job was
preempted or requeued counts; the lighthouse gives ages, so a record's time is this job's now
minus its age, no clock shared with the lighthouse) by more than :data:`START_MARGIN_S`, and
after every heartbeat of its group's launches (``dept_group_G:UUID``, live or old: a group of a
new run that heartbeats, or heartbeated and was preempted, has not finished this run). A waiting
job reads them (:func:`finished_groups`) and stops, not for a requeue, once too few groups are
left for a quorum ever to form (:func:`cannot_form`).

A lighthouse that restarted has no records: a job then waits and gives up as before."""
from __future__ import annotations

import hashlib
import json
import re
import time
from datetime import timedelta
from typing import Optional

from .federation_config import AGREE_KEYS

PREFIX = "dept_finished_group_"
_RECORD = re.compile(re.escape(PREFIX) + r"(\d+)_step_(\d+)_([0-9a-f]+)$")
# torchft's page: <li class="heartbeat [old]"> ID: seen 1.23s ago </li> (Rust's Duration: s, ms, µs, ns)
_HEARTBEAT = re.compile(r'<li class="heartbeat\s*(old)?\s*">\s*(\S+): seen ([0-9.]+)(s|ms|µs|us|ns) ago')
_UNIT = {"s": 1.0, "ms": 1e-3, "µs": 1e-6, "us": 1e-6, "ns": 1e-9}
#: seconds a record must be newer than the run's start to count: the clocks of the nodes a run's
#: launches ran on may differ (a record of an earlier run is older than this run's start by far)
START_MARGIN_S = 60.0
#: seconds a group's heartbeat (old) must be newer than its record to void it: torchft's last
#: heartbeats of a finishing job may cross its record (a live one voids it while it is live)
BEAT_MARGIN_S = 5.0


def run_key(hashes: list[int]) -> str:
    """12 hex digits of the agreed keys' hashes (``Federation.hashes``; those of the
    ``federation_config.MEET_KEYS`` after them left out): the same in every group job of a run,
    and across a restart of every job that changed only a meet key."""
    return hashlib.sha256(json.dumps(list(hashes[:len(AGREE_KEYS)])).encode()).hexdigest()[:12]


def record_id(group: int, step: int, key: str) -> str:
    return f"{PREFIX}{group}_step_{step}_{key}"


def announce(where: str, group: int, step: int, key: str, timeout_s: float = 5.0) -> Optional[str]:
    """Leave group ``group``'s record (finished at ``step``) at the lighthouse ``where``
    (host:port). Returns None, or why it could not (the lighthouse gone: the run is finished
    anyway; a waiting job then gives up as without the record)."""
    try:
        from torchft.coordination import LighthouseClient
        client = LighthouseClient(addr=f"http://{where}", connect_timeout=timedelta(seconds=timeout_s))
        client.heartbeat(record_id(group, step, key), timeout=timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001 - a courtesy to the other jobs: never fails this one
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return None


def heartbeats(page: str) -> dict[str, tuple[float, bool]]:
    """The lighthouse page's heartbeats: id -> (seconds since seen, old)."""
    return {m.group(2): (float(m.group(3)) * _UNIT[m.group(4)], m.group(1) is not None)
            for m in _HEARTBEAT.finditer(page)}


def finished_groups(page: str, key: str, replica_prefix: str = "dept_group_",
                    started_ago: Optional[float] = None) -> dict[int, int]:
    """Group -> the step it finished at, from the records of run ``key`` on the lighthouse's page
    written during this run: newer than its start ``started_ago`` seconds ago (None: unknown, a
    run without ``RUN/run_start.json``) by :data:`START_MARGIN_S`, and newer than every heartbeat
    of its group's launches (torchft's replica ids ``dept_group_G:UUID``, one per launch; an old
    one by :data:`BEAT_MARGIN_S`)."""
    beats = heartbeats(page)
    done: dict[int, int] = {}
    for rid, (ago, _) in beats.items():
        m = _RECORD.match(rid)
        if m is None or m.group(3) != key:
            continue
        if started_ago is not None and ago > started_ago - START_MARGIN_S:
            continue  # written before this run started (an earlier run's)
        g = int(m.group(1))
        launches = [(a, old) for other, (a, old) in beats.items() if other.startswith(f"{replica_prefix}{g}:")]
        if any(a < ago and (not old or a < ago - BEAT_MARGIN_S) for a, old in launches):
            continue  # the group heartbeated after it: a launch of a later run
        done[g] = max(done.get(g, 0), int(m.group(2)))
    return done


def cannot_form(finished: dict[int, int], group: int, groups: int, least: int) -> bool:
    """True when the groups that have not finished (this one included) are fewer than a quorum's
    ``least``: none will ever form."""
    others = {g for g in finished if g != group and 0 <= g < groups}
    return groups - len(others) < least


def finished_line(finished: dict[int, int], group: int, least: int, where: str) -> str:
    """Why a waiting job stops: the groups that finished, and what the user can do."""
    others = sorted(g for g in finished if g != group)
    steps = sorted({finished[g] for g in others})
    at = f"step {steps[0]}" if len(steps) == 1 else "steps " + ", ".join(map(str, steps))
    return (f"group(s) {', '.join(map(str, others))} finished the run (at {at}: their records at the lighthouse "
            f"{where}), so no quorum of {least} group(s) can form again; not for a requeue: the rounds this group "
            f"has not trained stay untrained (to train them alone, relaunch it with federation.min_groups=1 and a "
            f"lighthouse whose --min-groups is 1; if those records are of an earlier run of this config on this "
            f"lighthouse, restart the lighthouse and relaunch)")


def partners_finished(fed, final: bool) -> Optional[str]:
    """Why federation ``fed``'s quorum wait cannot end (the line of :func:`finished_line`): the
    lighthouse's records show that too many other groups finished the run; else None. Before
    the wait is given up (``final``) only past round 0: a job at the run's start that finds
    records of its config's run is more likely a new run on a lighthouse that served one. The
    records count from this run only (:func:`finished_groups`, the start in ``fed.run_dir``)."""
    from ..run_configs import run_start
    from .federation_log import status_page
    if not final and fed.round == 0:
        return None
    page = status_page(fed.where, 2.0)
    if page is None:
        return None
    started = run_start(fed.run_dir)
    done = finished_groups(page, run_key(fed.hashes), started_ago=None if started is None else time.time() - started)
    if not done or not cannot_form(done, fed.group, fed.groups, fed.least):
        return None
    return finished_line(done, fed.group, fed.least, fed.where)
