"""What a federated group job (dept/federation.py) says in its log, and torchft's noise kept out.

torchft logs five INFO lines per round from its Rust core (each quorum printed whole), and on
a CPU build of torch a warning per reconfiguration that the NCCL flight recorder cannot be
reset; the progress lines of a long run drown in them. So a group job sets ``RUST_LOG=warn``
unless the user set ``RUST_LOG`` (``RUST_LOG=info`` brings torchft's lines back) and says
itself, in one line each, what a user waits for: the quorum at a fresh start (the other
groups), a quorum that takes long (a group gone: the lighthouse drops it after its
``--heartbeat-timeout-s``), a change of the groups taking part, a failed exchange.

torchft's Python loggers (``torchft.manager``, ``torchft.process_group``, ...) have no handler:
Python's last-resort handler printed their warnings and errors raw, e.g. ``[dept_group_0/0 -
step 1099511627781] got exception waiting for work ... remote worker crashing ... GLHF!``, a
gloo text that says "crashing" also of a peer that only stalled. They go through
:class:`TorchftLines` instead: one line each on the rank's standard error, marked ``torchft``,
the step named as what it is (:data:`RUNNING`), and the known failures of a collective, of a
quorum's configuration and of a healing (events the job reports and handles itself) said in
words before torchft's own text; every other warning and error whole, with its traceback.
"""
from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from typing import Optional

#: seconds between the "still waiting" lines of a quorum that takes long (the first after this too)
WAIT_EVERY_S = 30.0

#: torchft's step of a job past its first round start is at least this; below it, a job at its
#: first quorum asks with the round it resumes at (0 for a new run). torchft heals every member of
#: a quorum whose step is not the highest from one that is, so a job at its first quorum heals
#: from a running job (as a relaunched job always did), and at a fresh start of every job the
#: lagging ones heal from a job of the newest round (Federation.round_start). Above it, each
#: committed exchange adds one (and each round a job trains alone): torchft's log lines and the
#: lighthouse's page show 2^40 + that count, an order of the jobs' progress, not a training step
RUNNING = 1 << 40

#: torchft's messages for events of this mode that the job handles and reports itself, in words
KNOWN = {"got exception waiting for work": "a cross-group collective failed (a group died, stalled longer than "
                                           "federation.timeout_s, or the network failed; the exchange is redone)",
         "got exception in future": "a cross-group collective failed (the exchange is redone)",
         "got exception in all reduce": "a cross-group all-reduce could not start (the exchange is redone)",
         "got exception in pg configure": "the quorum's process group could not be configured (a group in "
                                          "it is gone; the quorum is asked again)",
         "got exception in recovery": "healing from a live peer failed (the quorum is asked again)"}


def torchft_line(message: str) -> str:
    """A torchft log message as this job's line: its prefix ``[REPLICA/RANK - step N]`` as
    ``[group G, rank R, torchft step 2^40+K]``, and a :data:`KNOWN` message in words first,
    followed by torchft's own text (not shortened: a real error must stay visible)."""
    m = re.match(r"\[(?P<replica>[^\]/]*)/(?P<rank>\d+) - step (?P<step>\d+)\] ?(?P<rest>.*)", message, re.S)
    if m is None:
        return message
    g = re.match(r"dept_group_(\d+)", m["replica"])
    who = f"group {g.group(1)}" if g else m["replica"]
    step = int(m["step"])
    step_s = f"2^40+{step - RUNNING}" if step >= RUNNING else str(step)
    rest = m["rest"]
    for known, words in KNOWN.items():
        if rest.startswith(known):
            rest = f"{words}: {rest[len(known):].lstrip(' :')}"
            break
    return f"[{who}, rank {m['rank']}, torchft step {step_s}] {rest}"


class TorchftLines(logging.Handler):
    """torchft's Python log records at WARNING and above (the level Python's last-resort
    handler printed), each as ``torchft LEVEL: `` + :func:`torchft_line`, on standard error
    (every rank, as before: an error on any rank is seen)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            head, sep, tail = text.partition("\n")
            sys.stderr.write(f"torchft {record.levelname.lower()}: {torchft_line(head)}{sep}{tail}\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging's own rule: a handler never raises
            self.handleError(record)


def quiet_torchft() -> None:
    """Before torchft's Manager starts: its Rust INFO lines off unless ``RUST_LOG`` is set, two
    messages that say nothing about this run dropped (the flight recorder on CPU builds;
    torch's warning about the read-only buffer torchft's healing transport hands it), a
    failed collective's traceback (torchft's own frames; the error stays, one line), and its
    Python loggers' records through :class:`TorchftLines`."""
    os.environ.setdefault("RUST_LOG", "warn")
    logger = logging.getLogger("torchft.manager")
    if not any(isinstance(f, _DropFlightRecorder) for f in logger.filters):
        logger.addFilter(_DropFlightRecorder())
    root = logging.getLogger("torchft")  # every torchft.* logger's records: one line each, marked
    if not any(isinstance(h, TorchftLines) for h in root.handlers):
        root.addHandler(TorchftLines())
        root.propagate = False  # (else the root logger's handlers, or the last-resort one, print them again)
    warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


def quiet_checkpoint_server(transport) -> None:
    """torchft's healing transport (``HTTPTransport``) serves a healing peer over
    ``http.server``, which writes an access line (``::ffff:HOST - - [DATE] "GET
    /checkpoint/N/full HTTP/1.1" 200 -``) to standard error, i.e. into the serving job's log,
    for every request. Its request handler is a class of that transport alone: its access line
    is dropped there (errors, ``log_error``, stay). The job says itself who healed (the
    ``joined`` line)."""
    server = getattr(transport, "_server", None)
    if server is None:  # another transport (or torchft changed): nothing to quiet
        return
    server.RequestHandlerClass.log_request = lambda handler, code="-", size="-": None


class _DropFlightRecorder(logging.Filter):
    """Drops the flight recorder warning; keeps the line of a failed collective, of a quorum
    whose process group cannot be configured and of a failed healing (a group gone: events of
    this mode, which the job reports itself) without its local traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if any(what in message for what in ("got exception waiting for work", "got exception in pg configure",
                                            "got exception in recovery")):
            record.exc_info, record.exc_text = None, None
        return "flight recorder" not in message


def first_line(error: object) -> str:
    """An exception (torchft's errors carry the remote traceback) as its first non-empty line."""
    text = str(error).strip()
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), type(error).__name__)


def membership_line(round_index: int, groups: list, before: list, healed: bool = False) -> str:
    """``federation: round 14: groups [0, 1] (left: 2)``: a change of the groups taking part."""
    joined = sorted(set(groups) - set(before))
    left = sorted(set(before) - set(groups))
    what = []
    if joined and before:
        what.append("joined: " + ", ".join(map(str, joined)))
    if left:
        what.append("left: " + ", ".join(map(str, left)))
    if healed:
        what.append("this job healed from a live peer")
    return f"federation: round {round_index}: groups {sorted(groups)}" + (f" ({'; '.join(what)})" if what else "")


def status_page(where: str, timeout: float) -> Optional[str]:
    """torchft's lighthouse page ``/status`` (:func:`_status_page`)."""
    return _status_page(where, timeout)


def _status_page(where: str, timeout: float) -> Optional[str]:
    """torchft's lighthouse page ``/status``; None when it cannot be read. Asked directly, never
    through the environment's ``http_proxy`` (set on many clusters for the internet): the group
    jobs' torchft client reaches the lighthouse directly, and a proxy cannot reach a
    node-internal address."""
    import urllib.request
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with direct.open(f"http://{where}/status", timeout=timeout) as r:
            return r.read().decode("utf-8", "replace")
    except Exception:  # noqa: BLE001 - a status line is a courtesy: the wait goes on without it
        return None


def _next_quorum(page: str) -> Optional[str]:
    import re
    m = re.search(r"Next quorum status: *([^\n<]*)", page)
    return m.group(1).strip() or None if m else None


def lighthouse_status(where: str, timeout: float = 2.0) -> Optional[str]:
    """The lighthouse's own account of the next quorum (torchft's ``/status`` page), e.g. ``New
    quorum not ready, only have 1 participants, need min_replicas 2 [1/1 participants
    healthy][1 heartbeating]``; None when it cannot be read."""
    page = _status_page(where, timeout)
    return _next_quorum(page) if page is not None else None


#: a quorum wait longer than this says, whatever the lighthouse shows, what to do if it restarted
LONG_WAIT_S = 600.0


def forgot_requests(page: str, was_in_quorum: bool) -> bool:
    """The lighthouse's page shows that it holds no quorum request of a job that is waiting for
    one: it has none at all (``only have 0 participants``), or it never formed a quorum
    (``Current quorum_id: 0``) while this job has been in quorums (``was_in_quorum``). Either
    is a lighthouse that restarted during the wait: it forgets the requests it held, and
    torchft's clients do not send them again."""
    import re
    status = _next_quorum(page) or ""
    if re.search(r"only have 0 participants", status):
        return True
    m = re.search(r"Current quorum_id: *(\d+)", page)
    return was_in_quorum and m is not None and int(m.group(1)) == 0


def least_groups(job_min: int, lighthouse_min: Optional[int]) -> tuple[int, str]:
    """How many groups a round of this job needs: the larger of its ``federation.min_groups`` and
    the lighthouse's ``--min-groups`` (None: its status page did not show it), and which one that
    is, for the job's lines. The lighthouse forms no quorum below its own; a quorum below the
    job's is asked again (federation_wait.at_least)."""
    if lighthouse_min is None:
        return job_min, f"federation.min_groups {job_min}; the lighthouse's --min-groups not shown"
    if lighthouse_min > job_min:
        return lighthouse_min, f"the lighthouse's --min-groups {lighthouse_min} > federation.min_groups {job_min}"
    if job_min > lighthouse_min:
        return job_min, f"federation.min_groups {job_min} > the lighthouse's --min-groups {lighthouse_min}"
    return job_min, f"federation.min_groups {job_min} = the lighthouse's --min-groups"


def quorum_wait_line(round_index: int, seconds: float, min_groups: int, where: str, was_in_quorum: bool = False,
                     give_up_s: Optional[float] = None) -> str:
    """The "still waiting for a quorum" line, with what the lighthouse sees and, when it has
    forgotten this job's request (:func:`forgot_requests`) or the wait is long
    (:data:`LONG_WAIT_S`), what to do; and when the job gives up (``give_up_s``)."""
    restart = "restart the group jobs (they resume from their checkpoints and ask the lighthouse anew)"
    page = _status_page(where, 2.0)
    status = _next_quorum(page) if page is not None else None
    if page is None:  # (torchft does not send a lost quorum request again to a restarted lighthouse)
        says = (f"the lighthouse {where} does not answer (if it died: restart it, then the group jobs; they resume "
                "from their checkpoints)")
    elif forgot_requests(page, was_in_quorum):
        says = (f"the lighthouse {where} says: {status}; it holds no quorum request of this job: it restarted and "
                f"forgot the quorum, and this job's request is not sent again: {restart}")
    else:
        says = f"the lighthouse {where} says: {status}"
        if seconds >= LONG_WAIT_S:
            says += f" (if the lighthouse restarted during this wait, it forgot this job's request: {restart})"
    end = (f"; this job gives up after federation.quorum_give_up_s = {give_up_s:g} s (a checkpoint at a round start, "
           "exit status 75)" if give_up_s is not None else "")
    return (f"federation: round {round_index}: waiting {seconds:.0f} s for a quorum of at least {min_groups} "
            f"group(s); {says} (a group that is gone counts until its heartbeats stop for the lighthouse's "
            "--heartbeat-timeout-s; groups that finished the run leave a record there, and this job stops, not for a "
            "requeue, once too few groups are left for a quorum)"
            f"{end}")


def healed_line(group: int, round_index: int, was: int, step: int, members: list) -> str:
    """The line of a job that healed from a live peer: its loop moves from step ``was`` to
    ``step``, the start of the peers' round. Backwards (this job's checkpoint was of a newer
    round than the running groups': it came after them, and a running job is always the
    source) the steps it loses are named, so that a job relaunched late is not taken for one
    that caught up."""
    line = f"federation: group {group} healed from a live peer at round {round_index} (step {was} -> {step}"
    if step < was:
        line += (f": behind this job's own checkpoint, whose last {was - step} steps are dropped; the running "
                 "groups were started before it (docs/launching.md §12, 'Stopping and resuming')")
    return line + f"); groups {members}"
