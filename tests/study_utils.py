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


def _module_rank(rank: int, world: int, module: str, argv: list, cwd: str, log: str) -> int:
    """One rank of ``torchrun ... -m MODULE ARGV``: the module's ``main(ARGV)`` in ``cwd``, its
    output appended to ``log`` (as torchrun's workers write to the run's log)."""
    os.chdir(cwd)
    with open(log, "a", encoding="utf-8") as f:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        status = importlib.import_module(module).main(argv)
        sys.stdout.flush()
        sys.stderr.flush()
    return status


def forked_torchrun(cmd: list[str], cwd: str, env: dict, fh) -> int:
    """Run a command the study launches, ``PYTHON -m torch.distributed.run --standalone
    --nproc-per-node N -m MODULE ARGS``, to its end: its launcher arguments read by torchrun's
    own parser, then ``MODULE``'s ``main(ARGS)`` on N ranks forked from this process's
    forkserver with the environment torchrun gives them (tests/mp_utils.py), in ``cwd``, their
    output appended to the run's log ``fh``. Returns the exit status (0: every rank returned 0).
    Launched as such, the job would cost a fresh import of torch for torchrun and for each rank
    (~4 s of CPU each)."""
    from torch.distributed.run import get_args_parser

    from tests.mp_utils import run_distributed
    assert cmd[1:3] == ["-m", "torch.distributed.run"], cmd
    args = get_args_parser().parse_args(cmd[3:])
    assert args.standalone and args.module, cmd
    nproc = int(args.nproc_per_node)
    fh.flush()
    status = run_distributed(_module_rank, nproc, args=(args.training_script, args.training_script_args, cwd,
                                                        fh.name), timeout=180)
    return 0 if status == [0] * nproc else 1


def forked_popen(cmd: list[str], cwd: str, env: dict, fh) -> "FakeProc":
    """:func:`forked_torchrun` as ``run_all``'s ``launch``: the run is finished when this returns."""
    import threading
    done = threading.Event()
    done.set()
    return FakeProc(forked_torchrun(cmd, cwd, env, fh), done)

