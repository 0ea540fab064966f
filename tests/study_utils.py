"""Shared fakes of the study tool's tests: a grid file over the tiny configs, finished runs' metrics,
a stand-in process, tools/study.py's main loaded in-process."""
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Optional

import yaml

from dept_mega.config import save_config
from dept_mega.study.grid import run_config
from dept_mega.study.runner import MARKER, run_dir_of

ROOT = Path(__file__).resolve().parents[1]


def study_grid(tmp_path, **over):
    doc = {"groups": 3, "group_batch": 4,
           "configs": {v: str(ROOT / "examples" / "tiny" / f"{v}.yaml")
                       for v in ("std", "glob", "trim", "spec", "spec_opt")},
           "set": {"train.steps": 100, "train.micro_batch_size": 4},
           "runs": [{"variant": "std", "name": "std_t{dept.temperature}",
                     "set": {"dept.sampling": "temperature"}, "grid": {"dept.temperature": [0.0, 1.0]}},
                    {"variant": ["glob", "spec_opt"],
                     "grid": {"dept.outer_optimizer": [{"name": "fedavg", "lr": 1.0},
                                                       {"name": "nesterov", "lr": 0.7, "momentum": 0.9}]},
                     "set": {"dept.local_steps": 50}}]}
    doc.update(over)
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def fake_metrics(run_dir: str, variant: str, steps: int, bpb: float, groups: int, local_steps: int = 50,
                  nbytes: Optional[dict] = None, outer_every: int = 50, seed: int = 1234) -> None:
    os.makedirs(run_dir, exist_ok=True)
    cfg = {"dept": {"variant": variant, "local_steps": local_steps, "outer_comm_dtype": "fp32"},
           "train": {"seed": seed}}
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        yaml.safe_dump(cfg, f)
    recs = []
    for s in range(10, steps + 1, 10):
        recs.append({"kind": "train", "step": s, "round": 0, "time": 0, "loss": 5.0 - s / 100, "tokens": 64})
    for s in (50, 100):
        recs.append({"kind": "eval", "step": s, "round": 0, "time": 0,
                     "by_source": {k: {"loss": 1.0, "ppl": 2.7, "bpb": bpb + 0.1 * i + (100 - s) / 100,
                                       "tokens": 10, "bytes": (nbytes or {}).get(k, 30)}
                                   for i, k in enumerate(("en", "fr"))}})
    if variant != "std":
        recs += [{"kind": "outer", "step": s, "round": s // outer_every - 1, "time": 0,
                  "bytes": {"outer_body": 1000 * groups, "outer_embedding": 0, "source_move": 0, "dp": 0},
                  "seconds": 0.1} for s in range(outer_every, steps + 1, outer_every)]
    # a run resumed from a checkpoint writes some steps again (the stale record comes first):
    # the last record of each (kind, step) counts
    recs.insert(0, {"kind": "train", "step": 10, "round": 0, "time": 0, "loss": 99.0, "tokens": 64})
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs))
    with open(os.path.join(run_dir, "params.json"), "w") as f:
        json.dump({"ranks": [{"body": 1000, "embeddings": 500}]}, f)


class FakeProc:
    def __init__(self, rc, done):
        self.rc, self.done = rc, done

    def poll(self):
        return self.rc if self.done.is_set() else None


def study_main(monkeypatch):
    """tools/study.py's ``main``, loaded in this process (the path it adds to sys.path is taken
    back after the test)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location("_study_tool", ROOT / "tools" / "study.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def finish_runs(out: str, study, runs=None) -> None:
    """Fake finished runs of ``study`` in ``out``: metrics, the config the trainer writes, the marker."""
    from dept_mega.study.runner import full_command
    for r in runs or study.runs:
        d = run_dir_of(out, r)
        fake_metrics(d, r.variant, 100, 1.0, 3)
        save_config(run_config(".", r, d), os.path.join(d, "config.yaml"))
        Path(d, MARKER).write_text(json.dumps({"command": full_command(out, r, "python"), "nproc": r.nproc}))

