"""The cross-group communicator of a federated group job (dept/federation.py): what stands in
``pg.outer``'s place (:class:`FederatedOuter`) and the handle of an exchange launched on it
(:class:`FederatedWork`), committed where it is waited on, or found completed without this group
(:class:`LeftOut`); a group job read offline (:class:`Offline`); the
process group that records each quorum's ranks (:func:`recording`); torchft's Manager made to configure it
again at its next quorum (:func:`reconfigure_next`); its healing server stopped (:func:`stop_checkpoint_server`)."""
from __future__ import annotations

import inspect
import threading
import time
from typing import Optional

import torch

from ..parallel.comm import CrossJob


class LeftOut(Exception):
    """A round was completed by the other groups without this one (it reached the exchange
    more than ``timeout_s`` after them): its pseudo-gradient is dropped, the peers' state is
    written, and it goes on at their next round (``DeptHooks`` catches this: at a round's end,
    or at a fragment's or an overlapped sync's exchange inside it)."""


class FederatedOuter(CrossJob):
    """Stands for ``pg.outer`` in a group job: the cross-group communicator of the outer sync
    (``parallel.comm`` dispatches its collectives here). ``size()`` is the number of groups
    taking part in the current exchange."""

    def __init__(self, federation) -> None:
        self.federation = federation

    def size(self) -> int:
        return self.federation.participants

    def all_reduce(self, t: torch.Tensor, comm, category: str) -> torch.Tensor:
        """Sum ``t`` in place over the participating groups; redone with the survivors when a
        group fails during the exchange. Counts ``t``'s bytes once (the committed exchange)."""
        return self.federation.all_reduce_sum(t, comm, category)

    def all_gather_into(self, out: torch.Tensor, shard: torch.Tensor, comm, category: str) -> torch.Tensor:
        """The participating groups' shards, in group order (quantised outer syncs)."""
        return self.federation.all_gather_into(out, shard, comm, category)

    def atomic(self, fn, comm):
        """``fn()``'s collectives on this communicator as one exchange (TRIM's row exchange)."""
        return self.federation.atomic(fn, comm)

    def all_reduce_async(self, t: torch.Tensor, comm, category: str):
        """:meth:`all_reduce` launched: a handle whose ``wait()`` commits it (overlapped sync)."""
        return self.federation.all_reduce_async(t, comm, category)

    def all_gather_async(self, out: torch.Tensor, shard: torch.Tensor, comm, category: str):
        """:meth:`all_gather_into` launched: a handle whose ``wait()`` commits it."""
        return self.federation.all_gather_async(out, shard, comm, category)


class FederatedWork:
    """An overlapped exchange across the groups (torchft's streaming DiLoCo pattern): launched
    on the quorum taken before it, committed where it is waited on (``should_commit``; on a
    failure redone, blocking, with the survivors' quorum). ``groups``: how many groups' values
    the committed exchange holds (the divisor of the mean)."""

    def __init__(self, federation, state: dict, after, run, restore, comm, counts: list) -> None:
        self.federation, self.state, self.after, self.run = federation, state, after, run
        self.restore, self.comm, self.counts = restore, comm, counts
        self.done = False

    @property
    def groups(self) -> int:
        return len(self.state["keep"])

    def is_completed(self) -> bool:
        work = self.state["work"]
        return self.done or work is None or bool(work.is_completed())

    def wait(self) -> bool:
        """Commits the exchange, or does it again on the current quorum: when it was not launched
        (the Manager had failed before) or was launched on an earlier quorum (another exchange's
        redo formed a new one since: the groups may differ, and a commit would take this
        group's own Δ for the mean, or an unwritten buffer, for a sum of every group's)."""
        if self.done:
            return True
        fed, state = self.federation, self.state
        since = time.monotonic()  # (a failure is said with the time this wait took)
        work = state["work"]
        if state.get("sent") and work is not None and state.get("quorum") == fed.quorums:
            try:
                work.wait()
                self.after()
            except Exception as exc:  # noqa: BLE001 - a peer gone mid-exchange: reported, not raised
                fed.manager.report_error(exc)
            fed._exchange(self.run, self.restore, self.comm, self.counts, tried=since)  # (counted if committed)
        else:
            if work is not None:
                try:
                    work.wait()  # (ended: the new quorum's configure aborted the process group it ran on)
                except Exception:  # noqa: BLE001 - its outcome does not count
                    pass
                if state.get("sent") and len(state["keep"]) > 1:  # (some of it may have crossed)
                    fed.count_failed(self.counts)
            self.restore()
            fed._exchange(self.run, self.restore, self.comm, self.counts)
        fed.round_groups = list(state["keep"])
        self.done = True
        return True


class Offline:
    """A group job's place among the group jobs (``group`` of ``groups``) without joining them:
    for reading its own checkpoint after the run (``dept_mega.evaluate``), when the lighthouse
    and the other jobs may be gone. Evaluation needs only this job's own sources, whose state
    its checkpoint holds; nothing crosses jobs, so any exchange is refused by name."""

    participants = 1

    def __init__(self, group: int, groups: int) -> None:
        self.group, self.groups = group, groups

    def __getattr__(self, name: str):
        raise RuntimeError(f"federation: {name} needs the other group jobs; this group job's checkpoint is read "
                           "offline (dept_mega.evaluate), without the lighthouse")


def recording(cls):
    """``cls`` (a torchft process group) that records the ``global_ranks`` argument torchft's
    Manager passes to :meth:`configure` at every reconfiguration: the ranks of the quorum's
    replica groups (group index × job size + rank in the job), in the process group's rank
    order — which group each rank of an exchange is. ``global_ranks`` is a documented
    argument of torchft's ``ProcessGroup.configure``; torchft itself keeps it only in a
    private attribute. Fails at once if torchft's signature no longer has it (tested)."""
    if "global_ranks" not in inspect.signature(cls.configure).parameters:
        raise RuntimeError(f"federation: torchft's {cls.__name__}.configure has no global_ranks argument "
                           "(torchft changed; dept_mega/dept/federation.py, recording())")

    class Recording(cls):
        quorum_ranks: Optional[list] = None

        def configure(self, *args, **kwargs) -> None:
            bound = inspect.signature(cls.configure).bind(self, *args, **kwargs)
            ranks = bound.arguments.get("global_ranks")
            self.quorum_ranks = list(ranks) if ranks is not None else None
            super().configure(*args, **kwargs)

    Recording.__name__ = Recording.__qualname__ = f"Recording{cls.__name__}"
    return Recording


def reconfigure_next(manager) -> None:
    """The next quorum of torchft's ``manager`` configures its process group again, even with
    the same quorum id. torchft takes a quorum's id as configured before it configures, and
    skips configuring at a later quorum of the same id: after a failed configure (a peer not
    reached), a quorum of the same groups asked again would use a process group that was never
    made (torchft: "process group not initialized"). The lighthouse gives a new id only when the
    groups differ, so a failure between live groups (a network problem) met that."""
    if not hasattr(manager, "_quorum_id"):
        raise RuntimeError("federation: torchft's Manager has no _quorum_id (torchft changed: "
                           "dept_mega/dept/federation_outer.py, reconfigure_next())")
    manager._quorum_id = -1


def stop_checkpoint_server(transport) -> None:
    """Ends the serving thread of torchft's healing transport (``HTTPTransport``) without
    waiting for it. torchft's ``shutdown(wait=False)``, which ``Manager.shutdown(wait=False)``
    calls, sets its server's stop flag under a name Python mangles to another one, so the
    server went on serving (and polling) after the job's federation shut down. The flag set
    here is the one ``socketserver`` reads: the thread ends within its poll interval, and its
    listening socket is closed then (a peer that connects later is refused at once)."""
    server = getattr(transport, "_server", None)
    if server is None:  # (another transport: nothing to stop)
        return
    server._BaseServer__shutdown_request = True
    thread = getattr(transport, "_thread", None)

    def close() -> None:  # its listening socket, once the serving thread no longer polls it
        if thread is not None:
            thread.join()
        server.server_close()
    threading.Thread(target=close, name="federation-healing-close", daemon=True).start()
