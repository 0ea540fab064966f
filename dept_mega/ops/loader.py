"""Loading of the compiled extension `dept_mega.ops._C` (csrc/), once per process.

The extension is optional: when it is not built, fails to load (e.g. built against another
torch) or is switched off with DEPT_MEGA_OPS=torch, the ops use the PyTorch fallback and the
reason is kept in `ExtensionStatus.reason` and logged once per job: by global rank 0 (torchrun's
``RANK``; a process outside torchrun is rank 0), as the run log's ``backends:`` line, which says
it again (the other ranks log it at debug level).
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
import os

import torch

logger = logging.getLogger(__name__)

ENV_SWITCH = "DEPT_MEGA_OPS"  # "auto" (default): use the extension if it loads; "torch": never


@dataclasses.dataclass(frozen=True)
class ExtensionStatus:
    loaded: bool  # the CPU kernels are registered under torch.ops.dept_mega
    cuda: bool  # the CUDA kernels are registered too
    reason: str  # why not loaded / what was loaded


def _has_kernel(op: str, key: str) -> bool:
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(op, key))
    except RuntimeError:  # no such operator (an extension built from an older source)
        return False


# The one status of this process, computed on first use. A plain list rather than
# functools.lru_cache so that torch.compile traces `status()` as a constant lookup.
_STATUS: list = []


def _missing_args(op: str, args) -> list:
    """The names in ``args`` that the registered schema of ``op`` does not have."""
    namespace, name = op.split("::")
    schema = getattr(getattr(torch.ops, namespace), name).default._schema
    have = {a.name for a in schema.arguments}
    return [a for a in args if a not in have]


def kernel_missing(op: str, device: "torch.device | str", cuda_needs: str = "its CUDA kernels",
                   args=()) -> "str | None":
    """Why operator ``op`` (``dept_mega::name``) has no kernel for ``device``'s type, None when it
    has one (loads the extension). ``cuda_needs``: what a CUDA build must have had. ``args``:
    argument names this source passes that an older build of the operator lacks (its schema
    without them: refused, as a build from an older csrc/)."""
    device_type = torch.device(device).type
    st = status()
    if not st.loaded:
        return f"the dept_mega.ops extension is not loaded ({st.reason})"
    if args and _has_kernel(op, "CPU") and (old := _missing_args(op, args)):
        return (f"the dept_mega.ops extension is older than this source: {op} has no argument "
                f"{', '.join(old)} (rebuild it: pip install --no-build-isolation -e .)")
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    if key is not None and _has_kernel(op, key):
        return None
    built = cuda_needs if device_type == "cuda" else "this version of csrc/"
    return (f"the dept_mega.ops extension has no {device_type} kernel of {op} (rebuild it with {built}: "
            f"pip install --no-build-isolation -e .)")


def status() -> ExtensionStatus:
    """Loads the extension on first call; the same answer afterwards."""
    if not _STATUS:
        _STATUS.append(_compute_status())
    return _STATUS[0]


def _compute_status() -> ExtensionStatus:
    mode = os.environ.get(ENV_SWITCH, "auto").strip().lower()
    if mode not in ("auto", "torch"):
        raise ValueError(f"{ENV_SWITCH}={mode!r}: expected 'auto' or 'torch'")
    if mode == "torch":
        st = ExtensionStatus(False, False, f"{ENV_SWITCH}=torch forces the PyTorch fallback")
    else:
        st = _load()
    if not st.loaded:
        level = logging.WARNING if announces() else logging.DEBUG
        logger.log(level, "dept_mega.ops: using the PyTorch fallback: %s", st.reason)
    return st


def announces() -> bool:
    """Whether this process says the fallback: global rank 0 of a torchrun job (``RANK``), or a
    process outside torchrun (a tool, a single process), not every rank of a job."""
    return os.environ.get("RANK", "0").strip() in ("", "0")


def _load() -> ExtensionStatus:
    try:
        importlib.import_module("dept_mega.ops._C")
    except ModuleNotFoundError as e:
        if e.name != "dept_mega.ops._C":
            return ExtensionStatus(False, False, f"the extension failed to load: {e}")
        return ExtensionStatus(
            False, False,
            "the extension dept_mega.ops._C is not built (install with `pip install "
            "--no-build-isolation -e .` and a C++ compiler; see build/dept_mega_ops_build.log)")
    except (ImportError, OSError) as e:
        return ExtensionStatus(False, False, f"the extension failed to load: {e}")
    from dept_mega.ops import registration

    # the routed operators, and the CPU error record that the wrappers read after each CPU call
    # (csrc/cpu/ops_cpu.cpp; an older build threw its errors instead)
    needed = [*registration.FAKES, "dept_mega::error_record"]
    missing = [op.split("::")[1] for op in needed if not _has_kernel(op, "CPU")]
    if len(missing) == len(needed):
        return ExtensionStatus(False, False, "the extension loaded but registered no CPU kernels")
    if missing:  # an extension built from an older source
        return ExtensionStatus(False, False, "the extension dept_mega.ops._C is older than this source "
                               f"(no {', '.join(missing)} operator{'s' if len(missing) > 1 else ''}): "
                               "rebuild it (`python setup.py build_ext --inplace`)")
    registration.register()
    cuda = _has_kernel("dept_mega::gather_rows", "CUDA")
    return ExtensionStatus(True, cuda, "loaded dept_mega.ops._C (CPU" + (" + CUDA" if cuda else "")
                           + " kernels)")
