"""Launching our Triton kernels (the FP8 casts) with less host time than ``kernel[grid](...)``.

Why: the eager FP8 step on a fast GPU waits for the host (docs/performance.md, "FP8: what the
host costs per linear layer"), and every cast is a Triton launch. ``JITFunction.run`` (Triton
3.6) spends most of its host time before the launch itself: it binds the arguments and
computes their specialisation (alignment and divisibility of every argument), turns that into
a string key for its kernel cache, checks the kernel's global values, builds the launch
metadata for its launch hooks and calls the (empty) hook chains around the launch; and
Triton's ``cdiv`` (a ``constexpr_function``) costs about 2 µs per call from host code. On the
CPU, with Triton's launch path real up to a stand-in launcher (``benchmarks/triton_launch_bench.py``),
a delayed-scaling cast takes about 16 µs through ``kernel[grid]`` and 11 µs launched here.

:func:`launch` keeps, per kernel, the compiled kernel Triton chose for each *key*: the launch's
constexprs (names and values) and ``num_warps``, the current device, the compile options
Triton's ``run`` reads per call (:func:`compile_modes`) and, for every runtime argument, the facts
Triton specialises on (a tensor's dtype and 16-byte alignment; an int's equality to 1,
divisibility by 16 and whether it fits 32 / 64 bits; the type of anything else). The first
launch with a key goes through Triton's own ``kernel[grid](...)`` (compiling if needed); later
ones call the compiled kernel's launcher directly, with the arguments Triton itself passes
(every parameter in order, constexprs included) and no launch metadata or hooks. The key holds
at least everything Triton's specialisation depends on, so a cached kernel is always the one
Triton would pick (``tests/test_triton_launch.py`` checks this against Triton's own binder).

Triton's own launch is used instead, for every call, when the kernel is not a compiled
``JITFunction`` (Triton's interpreter, a test double), when a launch or pre-run hook is
attached (a profiler such as proton expects to see each launch) or on a Triton version this
module was not checked against (:data:`VERIFIED_TRITON`).
"""
from __future__ import annotations

import sys
from typing import Any, Optional

import torch

try:
    from triton import knobs as _knobs
    from triton.runtime import driver as _driver
    from triton.runtime.jit import JITFunction as _JITFunction
except ImportError:  # Triton is optional (the CPU environment need not have it)
    _knobs = _driver = _JITFunction = None


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints on the host (``triton.cdiv`` is a constexpr function: slower)."""
    return -(-a // b)


def _arg_key(v: Any) -> Any:
    """What Triton's specialisation of one runtime argument can depend on (a superset)."""
    if type(v) is int:
        return (v == 1, v % 16 == 0, -2147483648 <= v < 2147483648, -9223372036854775808 <= v < 9223372036854775808)
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.data_ptr() % 16 == 0)
    if v is None or v is True or v is False:
        return v
    return type(v)


def specialization_key(device: int, num_warps: int, args: tuple, consts: dict, modes: tuple = ()) -> tuple:
    """The cache key of one launch (see the module docstring); ``modes``: the compile options
    ``JITFunction.run`` reads per call (:func:`compile_modes`)."""
    return (device, num_warps, modes, tuple(consts), *consts.values(), *map(_arg_key, args))


def compile_modes(kernel: Any) -> tuple:
    """The options Triton's ``run`` adds to every call's compile options (debug, instrumentation):
    a change of either after a key's first launch compiles another kernel, as Triton would."""
    if _knobs is None:
        return (getattr(kernel, "debug", None),)
    return (bool(getattr(kernel, "debug", False) or _knobs.runtime.debug), _knobs.compilation.instrumentation_mode)


def _hooks_idle() -> bool:
    """No launch hook attached (Triton 3.6's hooks are chains, empty by default; older ones None)
    and no compile-pipeline inspection hook (its hash is part of Triton's specialisation)."""
    hooks = (_knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook)
    return (all(h is None or getattr(h, "calls", None) == [] for h in hooks)
            and getattr(_knobs.runtime, "add_stages_inspection_hook", None) is None)


class DirectLauncher:
    """The direct launches of one kernel. ``kernel``: a ``JITFunction`` (or an object with its
    interface: ``params`` with ``name`` / ``is_constexpr``, ``run(*args, grid=, warmup=,
    **kwargs)`` returning the compiled kernel); ``driver``: with ``get_current_device()`` and
    ``get_current_stream(device)`` (Triton's active driver by default)."""

    def __init__(self, kernel: Any, driver: Any = None) -> None:
        self.kernel = kernel
        self.driver = driver
        names = [p.name for p in kernel.params]
        flags = [bool(p.is_constexpr) for p in kernel.params]
        self.runtime_count = flags.index(True) if True in flags else len(flags)
        if any(not f for f in flags[self.runtime_count:]):
            raise ValueError(f"triton_launch: {names}: the constexpr parameters must come after the runtime ones")
        self.const_names = tuple(names[self.runtime_count:])
        self.compiled: dict[tuple, Any] = {}
        self.direct_launches = 0  # launches that skipped Triton's run (for tests and benchmarks)

    def __call__(self, grid: tuple, args: tuple, consts: dict, num_warps: int) -> None:
        drv = self.driver or _driver.active
        device = drv.get_current_device()
        key = specialization_key(device, num_warps, args, consts, compile_modes(self.kernel))
        k = self.compiled.get(key)
        if k is None:
            if len(args) != self.runtime_count or tuple(consts) != self.const_names:
                raise ValueError(f"triton_launch: {self.kernel}: takes {self.runtime_count} runtime arguments and "
                                 f"the constexprs {self.const_names} in that order; got {len(args)} and {tuple(consts)}")
            self.compiled[key] = self.kernel.run(*args, grid=grid, warmup=False, num_warps=num_warps, **consts)
            return
        n = len(grid)
        k.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, drv.get_current_stream(device),
              k.function, k.packed_metadata, None, None, None, *args, *consts.values())
        self.direct_launches += 1


_LAUNCHERS: dict[int, tuple[Any, Optional[DirectLauncher]]] = {}


# Triton versions whose run / launcher convention this module was checked against (the
# launcher's arguments, the specialisation; tests/test_triton_launch.py): others launch through
# Triton's own path
VERIFIED_TRITON = ((3, 6),)


def direct_launch_supported(kernel: Any) -> bool:
    """Whether :func:`launch` can launch ``kernel`` directly: a compiled Triton ``JITFunction``
    (not the interpreter's) of a Triton in :data:`VERIFIED_TRITON`."""
    if _JITFunction is None or not isinstance(kernel, _JITFunction):
        return False
    import re

    import triton
    m = re.match(r"(\d+)\.(\d+)", triton.__version__)
    return m is not None and (int(m.group(1)), int(m.group(2))) in VERIFIED_TRITON


def describe(kernel: Any) -> str:
    """How :func:`launch` launches ``kernel``, for the run log."""
    if direct_launch_supported(kernel):
        return "launched directly"
    version = getattr(sys.modules.get("triton"), "__version__", "?")
    verified = ", ".join(".".join(map(str, v)) for v in VERIFIED_TRITON)
    return f"launched by Triton {version} itself (the direct launch is checked for Triton {verified})"


def launcher_of(kernel: Any) -> Optional[DirectLauncher]:
    """``kernel``'s :class:`DirectLauncher`, made on first use; None where unsupported."""
    entry = _LAUNCHERS.get(id(kernel))
    if entry is None or entry[0] is not kernel:
        entry = _LAUNCHERS[id(kernel)] = (kernel, DirectLauncher(kernel) if direct_launch_supported(kernel) else None)
    return entry[1]


def triton_launch(kernel: Any, grid: tuple, args: tuple, consts: dict, num_warps: int) -> None:
    """Triton's own launch, ``kernel[grid](*args, **consts, num_warps=num_warps)`` (what
    :func:`launch` falls back to; ``benchmarks/fp8_host_bench.py``'s ``tritonrun`` casts)."""
    kernel[grid](*args, **consts, num_warps=num_warps)


def launch(kernel: Any, grid: tuple, args: tuple, consts: dict, num_warps: int) -> None:
    """``kernel[grid](*args, **consts, num_warps=num_warps)``, directly where possible (see the
    module docstring). ``args``: every runtime parameter in order; ``consts``: every constexpr
    parameter, in the kernel's order."""
    direct = launcher_of(kernel)
    if direct is None or kernel.pre_run_hooks or not _hooks_idle():
        triton_launch(kernel, grid, args, consts, num_warps)
        return
    direct(grid, args, consts, num_warps)


__all__ = ["ceil_div", "specialization_key", "DirectLauncher", "direct_launch_supported", "describe", "launcher_of",
           "launch", "triton_launch"]
