"""Activation recomputation (``model.recompute``) with exact replay of our dropout streams.

``recompute(fn, *args, replay=[...])`` runs ``fn(*args)`` under ``torch.utils.checkpoint``
(non-reentrant): only the inputs are kept, and backward runs ``fn`` again to rebuild what it
needs. Anything that makes the forward draw or update state must be replayed exactly, or the
recomputed activations (and so the gradients) differ from the original ones:

* our dropout masks come from the explicit generators of ``RNGTracker`` (and SDPA/flash-attn
  dropout is seeded from them): ``torch.utils.checkpoint``'s ``preserve_rng_state`` does not
  know these generators, so their states are captured when the forward starts, set again
  before the recomputation, and the live states (which the rest of the step has advanced
  since) are put back after it;
* native FP8 needs no replay: a training step's scales are fixed when the step opens, and a
  recomputed cast maxes the same amax into the step's history row again (``parallel/fp8.py``).

The global CPU/CUDA generators are still preserved by ``torch.utils.checkpoint`` itself.
Without autograd (evaluation) ``fn`` runs directly.

Modes (``model/gpt.py``, ``model/layers.py``): ``selective`` recomputes the attention core
(QKᵀ, softmax, dropout, ·V — Megatron's selective recompute); ``full`` recomputes whole blocks
from their inputs (the first ``model.recompute_layers`` blocks of each pipeline chunk). A
recomputed block repeats its forward tensor-parallel collectives during backward (counted in
``pg.comm`` as ``tp`` bytes, as they are real traffic).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch
import torch.utils.checkpoint as _checkpoint
from ..compile_guard import outside_compiled_graphs


class Replayable(Protocol):
    def get_states(self) -> Any: ...

    def set_states(self, states: Any) -> None: ...


def _contexts(replay: Sequence[Replayable]):
    saved: list[Any] = []

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        saved[:] = [r.get_states() for r in replay]
        yield

    @contextlib.contextmanager
    def recomputation() -> Iterator[None]:
        live = [r.get_states() for r in replay]
        for r, s in zip(replay, saved):
            r.set_states(s)
        try:
            yield
        finally:
            for r, s in zip(replay, live):
                r.set_states(s)

    return forward(), recomputation()


@outside_compiled_graphs
def recompute(fn: Callable[..., torch.Tensor], *args: torch.Tensor,
              replay: Sequence[Replayable] = ()) -> torch.Tensor:
    """``fn(*args)``, keeping only ``args`` for backward and replaying ``replay``'s states
    when ``fn`` is recomputed. Runs eagerly (a graph break under ``torch.compile``)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    return _checkpoint.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True,
                                  context_fn=lambda: _contexts(replay))
