"""Which device a launch trains on: the config key ``train.device``.

* ``auto``: CUDA where torch can use it, else the CPU (the run log's ``backends:`` line ends
  with the device and, on the CPU, why CUDA was not used). The environment variable
  ``DEPT_MEGA_DEVICE=cpu`` makes ``auto`` mean the CPU (the test suite sets it).
* ``cuda``: refuse to start without a usable CUDA device, naming why: a CPU-only build of
  torch (``torch.version.cuda`` is None; a ``.venv`` made by ``examples/main.sh`` holds one),
  no device visible to the process (``CUDA_VISIBLE_DEVICES``; a Slurm step given no GPUs),
  fewer devices than torchrun's processes on the node, or CUDA failing to initialise (a driver
  older than torch's CUDA build needs: torch only warns about it and ``torch.cuda.is_available()``
  says False). Without this a GPU cluster job whose ranks cannot use CUDA would train on the
  CPU over gloo, slowly and silently.
* ``cpu``: the CPU and gloo even where CUDA is usable (debugging).

The check reads only this process's environment and torch, before any collective, so under
torchrun every rank of a node fails alike (no rank waits for another) and the pre-flight
(``--check``) gives the same error on the node it runs on.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

import torch

from ..config_schema import ConfigError

KEY = "train.device"
FORCE_CPU_ENV = "DEPT_MEGA_DEVICE"  # =cpu: auto means the CPU (tests, benchmarks)


def _visible() -> str:
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "CUDA_VISIBLE_DEVICES unset" if value is None else f"CUDA_VISIBLE_DEVICES={value!r}"


def _torch_build() -> str:
    return f"torch {torch.__version__} in {sys.prefix}"


def _cpu_build() -> bool:
    return torch.version.cuda is None and getattr(torch.version, "hip", None) is None


def cuda_problem(local_world: int = 1) -> Optional[str]:
    """None when this process can use CUDA devices 0 .. ``local_world`` − 1; else why not, in
    one line. Initialises CUDA (it raises the driver's own error text when it cannot)."""
    if _cpu_build():
        return f"{_torch_build()} is a CPU-only build (torch.version.cuda is None)"
    try:
        torch.cuda.init()  # a driver too old, none found, no device visible: torch's error says which
        count = torch.cuda.device_count()
    except Exception as exc:  # noqa: BLE001 - reported as the reason, the launch stops
        text = " ".join(str(exc).split()) or type(exc).__name__
        return f"CUDA cannot be used by {_torch_build()} (CUDA {torch.version.cuda}): {text} ({_visible()})"
    if count < max(local_world, 1):
        return (f"{'no' if count == 0 else f'only {count}'} CUDA device(s) visible to this process ({_visible()}) "
                f"for the {local_world} process(es) torchrun starts on this node (LOCAL_WORLD_SIZE); "
                f"a Slurm step needs --gpus-per-node (or --gres=gpu:N)")
    return None


def local_world_size() -> int:
    """The processes torchrun starts on this node (``LOCAL_WORLD_SIZE``; 1 without torchrun)."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "1")
    try:
        return max(int(value), 1)
    except ValueError:
        raise ConfigError(f"config key '{KEY}': cuda, but LOCAL_WORLD_SIZE={value!r} is not a number of processes "
                          f"(torchrun sets it; the devices this node needs cannot be counted)") from None


def check_local_rank(local_rank: int) -> None:
    """``train.device: auto`` took CUDA: a ConfigError naming the key when this process's device
    (``LOCAL_RANK``) is not visible (CUDA's own error is "invalid device ordinal")."""
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ConfigError(f"config key '{KEY}': auto took CUDA, but this process is LOCAL_RANK={local_rank} and only "
                          f"{count} CUDA device(s) are visible ({_visible()}): start at most {count} process(es) per "
                          f"node (torchrun --nproc-per-node), or set {KEY}=cpu")


def use_cuda(setting: str, local_world: int = 1, preflight: bool = False) -> bool:
    """Whether the launch runs on CUDA under ``train.device: setting``; a ``ConfigError``
    naming the key when ``cuda`` is asked for and cannot be had (``preflight``: the message
    says that the check ran on this machine, which may be a login node without GPUs)."""
    forced_cpu = os.environ.get(FORCE_CPU_ENV, "") == "cpu"
    if setting == "cpu":
        return False
    if setting == "auto":
        return not forced_cpu and torch.cuda.is_available()
    if setting != "cuda":
        raise ConfigError(f"config key '{KEY}': {setting!r} is not one of auto | cuda | cpu")
    if forced_cpu:
        raise ConfigError(f"config key '{KEY}': cuda, but the environment sets {FORCE_CPU_ENV}=cpu (which "
                          f"makes train.device: auto use the CPU); unset it, or set {KEY}=cpu")
    problem = cuda_problem(local_world)
    if problem is None:
        return True
    if _cpu_build():
        base = torch.__version__.split("+")[0]
        problem += (f": install a CUDA build there, e.g. pip install torch=={base} --index-url "
                    f"https://download.pytorch.org/whl/cu130 (a CUDA version your driver supports)")
    where = (f"; the pre-flight checks the machine it runs on: run it on a GPU node (examples/1b/common.sh runs it "
             f"inside the job) or with {KEY}=auto on a login node") if preflight else ""
    raise ConfigError(f"config key '{KEY}': cuda, but {problem}. The job does not fall back to the CPU "
                      f"({KEY}=cpu trains there on purpose){where}")


def cpu_reason(setting: str) -> str:
    """Why a launch under ``train.device: setting`` runs on the CPU (the run log's device note)."""
    if setting == "cpu":
        return f"{KEY}: cpu"
    if os.environ.get(FORCE_CPU_ENV, "") == "cpu":
        return f"{KEY}: auto, {FORCE_CPU_ENV}=cpu"
    problem = cuda_problem()
    return f"{KEY}: auto, " + (problem if problem is not None else "CUDA became usable after the start")


def describe_device(setting: str, device: torch.device) -> str:
    """``device cuda:0``, or on the CPU ``device cpu (why)``: the end of the ``backends:`` line."""
    if device.type != "cpu":
        return f"device {device}"
    return f"device cpu ({cpu_reason(setting)})"


def preflight_line(setting: str) -> str:
    """The pre-flight's ``device:`` line; a ``ConfigError`` as the launch would raise it for
    ``cuda`` without a usable device on this machine."""
    if use_cuda(setting, preflight=True):
        n = torch.cuda.device_count()
        return (f"device: {setting} -> CUDA here ({n} device(s), {torch.cuda.get_device_name(0)}; "
                f"torch {torch.__version__}, CUDA {torch.version.cuda})")
    if setting == "cpu":
        return f"device: cpu ({KEY}), gloo"
    return (f"device: auto -> CPU here ({cpu_reason(setting)}); a launch on a node where CUDA works uses it "
            f"({KEY}: cuda refuses to start without it)")
