"""``outside_compiled_graphs``: ``torch.compiler.disable`` without importing ``torch._dynamo``
when a module is imported.

``torch.compiler.disable`` used as a decorator imports ``torch._dynamo`` at once: about a
second of CPU in every process that imports the module (the trainer's modules: fp8_linear,
the fused-wgrad linear, the cross entropy, recompute, attention with dropout), whether or not
it ever compiles or trains. ``torch._disable_dynamo`` (what ``torch.optim`` uses for the same
reason) imports it at the function's first call instead, and is otherwise the decorator: under
``torch.compile`` the call is a graph break and the function runs eagerly, outside the graph
(Dynamo skips the wrapper's module, ``torch._compile``; the same graphs, breaks and frames as
with ``torch.compiler.disable``: tests/test_compile.py; Dynamo's log names the break "Attempted
to call function marked as skipped"). A torch without it gets the decorator. Eagerly a call
costs ~0.1 µs more than through the decorator (one more Python frame; ~0.55 µs in all here).

Why not a wrapper of our own that calls the function directly unless
``torch.compiler.is_compiling()``: Dynamo traces such a wrapper (it is user code), so every
call from a compiled block is one more compiled frame with a graph break inside (measured on
torch 2.13, a block of 4 such calls under ``backend="eager"``: 9 frames and 6 graph breaks
instead of 4 and 4, 82 µs a call of the block instead of 52).

A process that trains imports ``torch._dynamo`` anyway, when it builds its optimizer
(``torch.optim.Optimizer.add_param_group`` is ``torch._disable_dynamo``'d): the second is saved
only where nothing is trained (tools, a run that stops at a config error, an import).
"""
from __future__ import annotations

from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)

_LAZY = getattr(torch, "_disable_dynamo", None)


def outside_compiled_graphs(fn: F) -> F:
    """``fn`` run eagerly, outside any compiled graph (a graph break), as with
    ``torch.compiler.disable``; ``torch._dynamo`` is imported at its first call."""
    if _LAZY is None:
        return torch.compiler.disable(fn)
    return _LAZY(fn)  # type: ignore[return-value]
