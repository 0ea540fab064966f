"""``outside_compiled_graphs``: ``torch.compiler.disable`` without importing ``torch._dynamo``
when a module is imported.

``torch.compiler.disable`` used as a decorator imports ``torch._dynamo`` at once, about a
second of CPU in every process that imports the module (every rank of every job and test),
whether or not anything is ever compiled. The wrapper here calls the function directly
unless Dynamo is tracing, and only then (``torch._dynamo`` is loaded by then) goes through
``torch._dynamo.disable``, so inside a compiled region the function still runs eagerly,
outside the graph (a graph break), exactly as with the decorator.
"""
from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)


def outside_compiled_graphs(fn: F) -> F:
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        return _disabled(fn)(*args, **kwargs)

    return call  # type: ignore[return-value]


@functools.cache
def _disabled(fn: Callable) -> Callable:
    import torch._dynamo
    return torch._dynamo.disable(fn)
