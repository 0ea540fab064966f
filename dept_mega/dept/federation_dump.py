"""A test hook of federated source groups (dept/federation.py): with the environment variable
``DEPT_FEDERATION_DUMP`` set to a directory, every rank of a group job writes there what a
test needs to recompute the outer synchronisation from outside the jobs.

- ``g{group}_rank{rank}_round{r}.pt`` at the end of round r: ``groups`` (whose pseudo-gradients
  were averaged), ``sent`` (what this rank put on the cross-group exchanges, in order:
  ``(category, tensor)``), ``means`` (the mean pseudo-gradient each outer optimizer step
  received, in order: ``(sync name, tensor)``), ``theta`` (every outer sync's θ_t after the
  round) and ``body`` (this rank's body parameters, flattened, after the round);
- ``g{group}_rank{rank}_heal{r}.pt`` when the group healed into round r, once its source's
  state is installed: ``source``, ``embeddings`` (its embeddings' tensors by name) and
  ``optimizer`` (their inner optimizer's state dict);
- both with ``phi``: TRIM's whole φ (None for other variants);
- with ``DEPT_FEDERATION_HOLD=R:WHERE:PATH`` (WHERE ``start``: before round R's quorum;
  ``exchange``: before round R's first cross-group exchange; ``launch``: in round R's first
  overlapped exchange, between its count of contributing groups and its launch, so that the
  other groups have it in flight) the job writes
  ``g{group}_rank{rank}_held{R}`` there and waits until the file PATH exists: a test stops
  a group at a known point (to kill it there, to make it slow, to keep it waiting until
  another job's quorum request is at the lighthouse) instead of racing its progress.

Nothing is written without the variable; the training path is the same either way.
"""
from __future__ import annotations

import copy
import os
import time
from typing import Any, Optional

import torch

ENV = "DEPT_FEDERATION_DUMP"
HOLD_ENV = "DEPT_FEDERATION_HOLD"


def from_env(group: int, rank: int) -> Optional["FederationDump"]:
    root = os.environ.get(ENV)
    return FederationDump(root, group, rank) if root else None


class FederationDump:
    def __init__(self, root: str, group: int, rank: int) -> None:
        os.makedirs(root, exist_ok=True)
        self.prefix = os.path.join(root, f"g{group}_rank{rank}")
        self._sent: list[tuple[str, torch.Tensor]] = []
        self._means: list[tuple[str, torch.Tensor]] = []
        self._hold: Optional[tuple[int, str, str]] = None
        spec = os.environ.get(HOLD_ENV)
        if spec:
            r, where, path = spec.split(":", 2)
            if where not in ("start", "exchange", "launch"):
                raise ValueError(f"{HOLD_ENV}={spec!r}: WHERE is start, exchange or launch")
            self._hold = (int(r), where, path)

    def hold(self, round_index: int, where: str) -> None:
        """Wait here until the hold's file exists, if this is the hold's point (module doc)."""
        if self._hold is None or self._hold[:2] != (round_index, where):
            return
        path = self._hold[2]
        self._hold = None
        open(f"{self.prefix}_held{round_index}", "w").close()
        while not os.path.exists(path):
            time.sleep(0.05)

    def sent(self, category: str, t: torch.Tensor) -> None:
        self._sent.append((category, t.detach().to("cpu", copy=True)))

    def watch(self, syncs: dict) -> None:
        """Record the mean pseudo-gradient every outer optimizer step of ``syncs`` receives."""
        for name, sync in syncs.items():
            opt = sync.optimizer
            step = opt.step

            def recorded(theta, delta, *args, _name=name, _step=step, **kw):
                self._means.append((_name, delta.detach().to("cpu", copy=True)))
                return _step(theta, delta, *args, **kw)

            opt.step = recorded

    def round_end(self, round_index: int, groups: list[int], syncs: dict, trainer, strategy=None) -> None:
        body = [p.detach().reshape(-1).to("cpu", torch.float32) for p in trainer.body_parameters()]
        out: dict[str, Any] = {"round": round_index, "groups": list(groups), "sent": self._sent,
                               "means": self._means,
                               "theta": {k: s.theta_prev.detach().to("cpu", copy=True) for k, s in syncs.items()},
                               "body": torch.cat(body) if body else torch.zeros(0), "phi": _phi(strategy)}
        torch.save(out, f"{self.prefix}_round{round_index}.pt")
        self._sent, self._means = [], []

    def dropped(self) -> None:
        """The round was completed without this group: what it sent is not part of any round."""
        self._sent, self._means = [], []

    def healed(self, round_index: int, source: str, trainer, strategy=None) -> None:
        embs = {f"{i}.{n}": p.detach().to("cpu", copy=True) for i, e in enumerate(trainer.embeddings())
                if e is not None for n, p in e.named_parameters()}
        opt = trainer.embedding_optimizer
        torch.save({"round": round_index, "source": source, "embeddings": embs,
                    "optimizer": copy.deepcopy(opt.state_dict()) if opt is not None else None,
                    "phi": _phi(strategy)},
                   f"{self.prefix}_heal{round_index}.pt")


def _phi(strategy) -> Optional[torch.Tensor]:
    """TRIM's whole φ (a collective over the stage's ranks when sharded); None for other variants."""
    full = getattr(strategy, "full_table", None)
    return full("phi").to("cpu", copy=True) if full is not None and strategy.phi is not None else None
