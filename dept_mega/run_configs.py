"""The configs a run directory keeps (docs/metrics.md, "The run directory").

* ``RUN/config.yaml``: the resolved config of the run, i.e. of its last launch that trained
  (what ``dept_mega.evaluate``, the export and the summaries read). A launch that trains
  nothing (the run is already complete at ``train.steps``) leaves it as it is, unless the
  directory has none yet.
* ``RUN/launch_dir.json``: the directory the launch that wrote ``RUN/config.yaml`` started in,
  which its relative paths are relative to (:mod:`dept_mega.run_paths`: how the tools read them).
* ``RUN/configs/launch_N.yaml``: the resolved config of every launch that got past the checks
  (N = 1, 2, ... in launch order), with a comment header saying where it started and whether it
  trained: the record of which config each part of a run used (the header also names the
  directory its relative paths are relative to).
* ``RUN/run_start.json``: ``{"time": T}``, when the run's first launch got past the checks
  (``time.time()`` of that job's clock), written once and kept by every later launch (a requeue,
  a relaunch): what a federated group job compares the age of its partners' "finished" records
  with (dept/federation_finished.py).
* ``RUN/checkpoints/step_N/config.yaml``: the resolved config of the launch that wrote that
  checkpoint (written by :mod:`dept_mega.checkpoint`, covered by its manifest), as Megatron-LM
  keeps its arguments in every checkpoint.
"""
from __future__ import annotations

import json
import os
import re
import time
from typing import Optional

import yaml

from .run_paths import CONFIG_FILE, record_launch_dir

LAUNCHES_DIR = "configs"
RUN_START_FILE = "run_start.json"
_LAUNCH = re.compile(r"^launch_(\d+)\.yaml$")


def config_text(cfg) -> str:
    """The resolved config as YAML, keys in the schema's order (``--print-config``'s text)."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def launch_numbers(run_dir: str) -> list[int]:
    """The N of every ``RUN/configs/launch_N.yaml``, ascending."""
    try:
        names = os.listdir(os.path.join(run_dir, LAUNCHES_DIR))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(m.group(1)) for n in names if (m := _LAUNCH.match(n)))


def record_launch(cfg, run_dir: str, start: int, trains: bool, resumed: Optional[int]) -> tuple[str, bool]:
    """Write this launch's ``RUN/configs/launch_N.yaml`` and, when it trains (or the run has no
    ``config.yaml`` yet), ``RUN/config.yaml`` with ``RUN/launch_dir.json`` (the current
    directory); at the run's first launch, ``RUN/run_start.json``. ``start``: the step the
    launch starts at; ``resumed``: the checkpoint step it resumed from (None: a new run).
    Returns (the launch file's path, whether ``config.yaml`` was written). Global rank 0 only
    (the run directory is held by this job: ``dept_mega.rundir``)."""
    text = config_text(cfg)
    folder = os.path.join(run_dir, LAUNCHES_DIR)
    os.makedirs(folder, exist_ok=True)
    n = (launch_numbers(run_dir) or [0])[-1] + 1
    began = "resumed from checkpoint step %d" % resumed if resumed is not None else "a new run"
    did = (f"trains from step {start} to {cfg.train.steps}" if trains
           else f"trains nothing (the run is complete at step {start} of train.steps {cfg.train.steps})")
    header = (f"# launch {n} of this run directory, {time.strftime('%Y-%m-%d %H:%M:%S %z')}: {began}; {did}\n"
              f"# the resolved config of this launch (dept_mega.train --config takes this file as it is); "
              f"its relative paths are relative to the directory it was launched from, {os.getcwd()}\n")
    path = os.path.join(folder, f"launch_{n}.yaml")
    _write_atomic(path, header + text)
    if run_start(run_dir) is None:
        _write_atomic(os.path.join(run_dir, RUN_START_FILE), json.dumps({"time": time.time()}) + "\n")
    main = os.path.join(run_dir, CONFIG_FILE)
    wrote = trains or not os.path.exists(main)
    if wrote:  # the launch directory first: a config.yaml is never paired with an older launch's
        record_launch_dir(run_dir)
        _write_atomic(main, text)
    return path, wrote


def run_start(run_dir: str) -> Optional[float]:
    """When the run began (``RUN/run_start.json``, the job's clock); None for a run without a
    readable one (one started before it was written)."""
    try:
        with open(os.path.join(run_dir, RUN_START_FILE), encoding="utf-8") as f:
            value = json.load(f).get("time")
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) else None
