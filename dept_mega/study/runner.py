"""Running a study's runs: one ``torchrun ... -m dept_mega.train`` per run, sequentially or
several at once within a budget of processes, resumable.

A run is *finished* when ``OUT/runs/NAME/study_run.json`` exists (written here after the run
exited 0) and its ``metrics.jsonl`` holds an evaluation at the last step. A run directory
without that marker (a run that was stopped) is started again with the same command: the
trainer resumes from the run's own checkpoint. Each run's output goes to
``OUT/logs/NAME.log``.

A run directory is only reused for the run the grid asks for now: :func:`find_stale` compares
its ``config.yaml`` (and the process count of its marker) with the config the grid resolves to,
and an adaptation's ``adapt.json`` and ``trained/config.yaml`` with the grid's ``plasticity:``.
A difference is refused (:class:`StaleRunError`, naming the run and the keys) unless the caller
asks to make those runs again (``rerun_changed``): their directories are then moved to
``OUT/replaced/NAME.K/`` and the runs made from scratch.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, TextIO

import yaml

from ..config import ConfigError
from ..config_diff import differences
from .grid import RunSpec, Study, run_config

MARKER = "study_run.json"


def run_dir_of(out: str, run: RunSpec) -> str:
    return os.path.join(out, "runs", run.name)


def full_command(out: str, run: RunSpec, python: str = sys.executable) -> list[str]:
    return run.command(python) + [f"train.run_dir={run_dir_of(out, run)}"]


def last_eval_step(metrics_path: str) -> Optional[int]:
    """The step of the last ``eval`` record of a metrics file (None: none or no file)."""
    if not os.path.exists(metrics_path):
        return None
    step = None
    with open(metrics_path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a crash; the trainer's resume rewrites the file
            if rec.get("kind") == "eval":
                step = int(rec["step"])
    return step


def is_finished(out: str, run: RunSpec, steps: int) -> bool:
    d = run_dir_of(out, run)
    return os.path.exists(os.path.join(d, MARKER)) and last_eval_step(os.path.join(d, "metrics.jsonl")) == steps


class StaleRunError(RuntimeError):
    """Runs (or adaptations) in the output directory made from another config than the grid
    asks for now."""


@dataclass
class Stale:
    """A run or adaptation whose directory holds other settings than the grid asks for."""
    name: str
    kind: str  # "run" | "adaptation"
    path: str
    diffs: list[tuple[str, Any, Any]]  # (key, what the directory has, what the grid asks)

    def line(self) -> str:
        shown = "; ".join(f"{k}: it has {a!r}, the grid asks {b!r}" for k, a, b in self.diffs[:8])
        more = f"; and {len(self.diffs) - 8} more" if len(self.diffs) > 8 else ""
        return f"{self.kind} {self.name} ({self.path}): {shown}{more}"


def _config_diffs(stored: Any, wanted: dict) -> list[tuple[str, Any, Any]]:
    """Differences between a saved config and the one asked for now, the run directory aside."""
    stored = json.loads(json.dumps(stored, default=str))
    wanted = json.loads(json.dumps(wanted, default=str))
    for cfg in (stored, wanted):
        if isinstance(cfg, dict) and isinstance(cfg.get("train"), dict):
            cfg["train"].pop("run_dir", None)
    return [(k.lstrip("."), a, b) for k, a, b in differences(stored, wanted)]


def stale_run(out: str, run: RunSpec, cwd: str) -> Optional[Stale]:
    """The differences between ``run``'s directory (a finished or stopped run: its
    ``config.yaml``; its marker's process count) and what the grid asks for now; None when the
    directory holds no config yet or the same one."""
    d = run_dir_of(out, run)
    cfg_path = os.path.join(d, "config.yaml")
    if not os.path.exists(cfg_path):
        return None
    with open(cfg_path, encoding="utf-8") as f:
        stored = yaml.safe_load(f)
    try:
        wanted = run_config(cwd, run, d).to_dict()
    except ConfigError as exc:
        return Stale(run.name, "run", d, [("(config)", "a config", f"one that does not load: {exc}")])
    diffs = _config_diffs(stored, wanted)
    marker = os.path.join(d, MARKER)
    if os.path.exists(marker):
        with open(marker, encoding="utf-8") as f:
            nproc = json.load(f).get("nproc")
        if nproc is not None and nproc != run.nproc:
            diffs.append(("processes (--nproc-per-node)", nproc, run.nproc))
    return Stale(run.name, "run", d, diffs) if diffs else None


def stale_adaptation(out: str, run: RunSpec, study: Study, cwd: str) -> Optional[Stale]:
    """The differences between ``run``'s finished adaptation (``adapt.json``: held-out config,
    steps, body options, the run's step it adapted; ``trained/config.yaml``: the adaptation's
    config, which follows the held-out config file and the run's config) and what the grid's
    ``plasticity:`` asks for now; None when there is none or it matches."""
    p = study.plasticity
    d = plasticity_dir(out, run)
    path = os.path.join(d, "adapt.json")
    if p is None or not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        rep = json.load(f)
    diffs = [(k, rep.get(k), v) for k, v in (("source_config", p.source_config), ("steps", p.steps),
                                              ("body", p.body), ("body_lr", p.body_lr)) if rep.get(k) != v]
    last = last_eval_step(os.path.join(run_dir_of(out, run), "metrics.jsonl"))
    if rep.get("step") is not None and last is not None and rep["step"] != last:
        diffs.append(("the run's step adapted", rep["step"], last))
    trained = os.path.join(d, "trained", "config.yaml")
    run_cfg_path = os.path.join(run_dir_of(out, run), "config.yaml")
    if os.path.exists(trained) and os.path.exists(run_cfg_path):
        from ..adapt import adapt_config
        from ..run_paths import run_config_tree
        try:
            run_cfg, _ = run_config_tree(run_dir_of(out, run))  # its paths as dept_mega.adapt reads them
            src = p.source_config if os.path.isabs(p.source_config) else os.path.join(cwd, p.source_config)
            with open(src, encoding="utf-8") as f:
                new = yaml.safe_load(f) or {}
            wanted = adapt_config(run_cfg, new, p.source_config, p.steps, "", 1).to_dict()
        except (OSError, ConfigError, yaml.YAMLError) as exc:
            diffs.append(("(adaptation config)", "a config", f"one that does not load: {exc}"))
        else:
            with open(trained, encoding="utf-8") as f:
                diffs += _config_diffs(yaml.safe_load(f), wanted)
    return Stale(run.name, "adaptation", d, diffs) if diffs else None


def find_stale(study: Study, out: str, cwd: Optional[str] = None, runs: bool = True,
               adaptations: bool = True) -> list[Stale]:
    """Every run and adaptation in ``out`` made from other settings than ``study`` asks for
    (an adaptation of a run that is itself stale is not listed twice: it goes with its run)."""
    cwd = cwd or os.getcwd()
    found, changed = [], set()
    for r in study.runs:
        s = stale_run(out, r, cwd)
        if s is not None:
            changed.add(r.name)
            if runs:
                found.append(s)
    if adaptations and study.plasticity is not None:
        chosen = [r for r in study.runs if r.name not in changed
                  and (study.plasticity.runs is None or r.name in study.plasticity.runs)]
        found += [s for s in (stale_adaptation(out, r, study, cwd) for r in chosen) if s is not None]
    return found


def stale_message(stale: list[Stale], out: str) -> str:
    return (f"{len(stale)} run(s) / adaptation(s) in {out} were made with other settings than the grid now asks "
            "for; their results would be reported under this grid:\n  " + "\n  ".join(s.line() for s in stale)
            + f"\nRestore the grid, choose another --out, or pass --rerun-changed to move them to "
            f"{os.path.join(out, 'replaced')}/ and make them again.")


def replace_stale(stale: list[Stale], out: str, log: TextIO = sys.stdout) -> None:
    """Move each stale run's directory (with its adaptation) or stale adaptation's directory to
    ``OUT/replaced/NAME.K/`` (K: the first free number), so that it is made again."""
    for s in stale:
        k = 1
        while os.path.exists(os.path.join(out, "replaced", f"{s.name}.{k}")):
            k += 1
        dest = os.path.join(out, "replaced", f"{s.name}.{k}")
        os.makedirs(dest)
        moved = [s.path]
        if s.kind == "run" and os.path.isdir(os.path.join(out, "plasticity", s.name)):
            moved.append(os.path.join(out, "plasticity", s.name))
        for src in moved:
            shutil.move(src, os.path.join(dest, os.path.basename(os.path.dirname(src))))
        print(f"[study] {s.kind} {s.name}: settings changed; moved {', '.join(moved)} to {dest} to make it again",
              file=log, flush=True)


@dataclass
class Outcome:
    run: RunSpec
    returncode: int
    seconds: float
    skipped: bool = False


def run_all(study: Study, out: str, steps: int, *, parallel: int = 0, cwd: Optional[str] = None,
            log: TextIO = sys.stdout, python: str = sys.executable, rerun_changed: bool = False,
            launch: Optional[Callable[[list[str], str, dict, TextIO], subprocess.Popen]] = None) -> list[Outcome]:
    """Run every unfinished run of ``study``. ``parallel``: budget of processes running at once
    (0 or 1: one run at a time; a run larger than the budget runs alone). A run directory made
    with other settings than the grid asks for raises :class:`StaleRunError`, or with
    ``rerun_changed`` is moved aside and made again. ``launch(cmd, cwd, env, log_file)`` starts
    one run (default: ``subprocess.Popen``; tests pass a fake)."""
    cwd = cwd or os.getcwd()
    stale = find_stale(study, out, cwd, adaptations=False)
    if stale and not rerun_changed:
        raise StaleRunError(stale_message(stale, out))
    replace_stale(stale, out, log)
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    os.makedirs(os.path.join(out, "runs"), exist_ok=True)
    todo: list[RunSpec] = []
    outcomes: list[Outcome] = []
    for r in study.runs:
        if is_finished(out, r, steps):
            print(f"[study] {r.name}: finished earlier, skipped", file=log, flush=True)
            outcomes.append(Outcome(r, 0, 0.0, skipped=True))
        else:
            todo.append(r)
    budget = max(1, parallel)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    launch = launch or _popen
    running: list[tuple[RunSpec, subprocess.Popen, float, TextIO]] = []
    total, done = len(todo), 0
    t_start = time.time()
    while todo or running:
        while todo and (not running or sum(r.nproc for r, *_ in running) + todo[0].nproc <= budget):
            run = todo.pop(0)
            cmd = full_command(out, run, python)
            log_path = os.path.join(out, "logs", f"{run.name}.log")
            fh = open(log_path, "a", encoding="utf-8")
            fh.write(f"$ {' '.join(cmd)}\n")
            fh.flush()
            proc = launch(cmd, cwd, env, fh)
            running.append((run, proc, time.time(), fh))
            print(f"[study] {run.name}: started ({run.nproc} process(es)); log {log_path}", file=log, flush=True)
        time.sleep(0.2)
        for item in list(running):
            run, proc, t0, fh = item
            rc = proc.poll()
            if rc is None:
                continue
            running.remove(item)
            fh.close()
            seconds = time.time() - t0
            done += 1
            if rc == 0 and last_eval_step(os.path.join(run_dir_of(out, run), "metrics.jsonl")) == steps:
                with open(os.path.join(run_dir_of(out, run), MARKER), "w", encoding="utf-8") as f:
                    json.dump({"command": full_command(out, run, "python"), "seconds": seconds,
                               "nproc": run.nproc}, f, indent=1)
                status = "finished"
            else:
                status = f"FAILED (exit {rc}; see {os.path.join(out, 'logs', run.name + '.log')})"
                rc = rc or 1
            elapsed = time.time() - t_start
            eta = elapsed / done * (total - done)
            print(f"[study] {run.name}: {status} in {seconds:.0f} s ({done}/{total}; elapsed {elapsed:.0f} s, "
                  f"about {eta:.0f} s left)", file=log, flush=True)
            outcomes.append(Outcome(run, rc, seconds))
    order = {r.name: i for i, r in enumerate(study.runs)}
    return sorted(outcomes, key=lambda o: order[o.run.name])


def _popen(cmd: list[str], cwd: str, env: dict, fh: TextIO) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT)


def plasticity_dir(out: str, run: RunSpec) -> str:
    return os.path.join(out, "plasticity", run.name)


def plasticity_command(out: str, run: RunSpec, study: Study, reference: bool,
                       python: str = sys.executable) -> list[str]:
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", "dept_mega.adapt",
           "--run-dir", run_dir_of(out, run), *study.plasticity.args(), "--out", plasticity_dir(out, run)]
    return cmd if reference else cmd + ["--no-random-baseline"]


def reference_key(out: str, run: RunSpec, study: Study, cwd: str) -> str:
    """What the random-body reference of ``run``'s adaptation depends on: the adaptation's own
    config (``dept_mega.adapt``'s merge of the held-out source config over the run's
    ``config.yaml``, one process as the study launches it: model, seed, batch sizes, optimizer,
    data, evaluation) and the body options, everything but the output directory. Runs with the
    same key get the same random body trained the same way, so they share one reference. A
    config the adaptation would refuse gets a key of its own (its adaptation fails and says why)."""
    from ..adapt import adapt_config
    from ..run_paths import run_config_tree
    p = study.plasticity
    try:
        run_cfg, _ = run_config_tree(run_dir_of(out, run))  # its paths as dept_mega.adapt reads them
        src = p.source_config if os.path.isabs(p.source_config) else os.path.join(cwd, p.source_config)
        with open(src, encoding="utf-8") as f:
            new = yaml.safe_load(f) or {}
        cfg = adapt_config(run_cfg, new, p.source_config, p.steps, "", 1).to_dict()
    except Exception as exc:  # noqa: BLE001 - only a grouping key: the run's own adapt reports the problem
        return f"(no shared reference: {run.name}: {exc})"
    cfg["train"]["run_dir"] = None
    return json.dumps([cfg, p.body, p.body_lr], sort_keys=True, default=str)


def run_plasticity(study: Study, out: str, steps: int, *, cwd: Optional[str] = None, log: TextIO = sys.stdout,
                   python: str = sys.executable, execute: bool = True, rerun_changed: bool = False,
                   launch: Optional[Callable[[list[str], str, dict, TextIO], int]] = None) -> dict[str, dict]:
    """Adapt the body of every finished (selected) run to the held-out source, one after the
    other. The random-body reference is made once per distinct adaptation
    (:func:`reference_key`: e.g. runs of different models each get their own), by the first run
    of each. Returns {run name: summary} for the runs whose adaptation finished (``adapt.json``
    present: a second call skips them; ``execute=False`` only reads those). ``launch(cmd, cwd,
    env, log_file)`` runs one adaptation and returns its exit status (tests pass a fake). A
    finished adaptation made with other settings than the grid's raises :class:`StaleRunError`
    (or with ``rerun_changed`` is moved aside and made again; not with ``execute=False``)."""
    p = study.plasticity
    if p is None:
        return {}
    cwd = cwd or os.getcwd()
    stale = find_stale(study, out, cwd, runs=False)
    if stale and not (rerun_changed and execute):
        raise StaleRunError(stale_message(stale, out))
    replace_stale(stale, out, log)
    chosen = [r for r in study.runs if (p.runs is None or r.name in p.runs) and is_finished(out, r, steps)]
    keys = {r.name: reference_key(out, r, study, cwd) for r in chosen}
    maker: dict[str, str] = {}  # key -> the run whose adaptation makes its reference
    for r in chosen:
        maker.setdefault(keys[r.name], r.name)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    launch = launch or (lambda cmd, cwd, env, fh: subprocess.run(cmd, cwd=cwd, env=env, stdout=fh,
                                                                 stderr=subprocess.STDOUT).returncode)
    reports: dict[str, dict] = {}
    random_of: dict[str, tuple[float, str]] = {}  # key -> (random-body BPB, the run whose adapt.json has it)
    for run in chosen:
        reference = maker[keys[run.name]] == run.name
        path = os.path.join(plasticity_dir(out, run), "adapt.json")
        if not os.path.exists(path) and execute:
            if os.path.isdir(plasticity_dir(out, run)):  # an interrupted adaptation: start it again
                shutil.rmtree(plasticity_dir(out, run))
            cmd = plasticity_command(out, run, study, reference=reference, python=python)
            log_path = os.path.join(out, "logs", f"{run.name}.adapt.log")
            t0 = time.time()
            with open(log_path, "a", encoding="utf-8") as fh:
                fh.write(f"$ {' '.join(cmd)}\n")
                fh.flush()
                rc = launch(cmd, cwd, env, fh)
            status = "finished" if rc == 0 and os.path.exists(path) else f"FAILED (exit {rc}; see {log_path})"
            print(f"[study] plasticity {run.name}: {status} in {time.time() - t0:.0f} s", file=log, flush=True)
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            rep = json.load(f)
        if rep.get("random_bpb") is not None:
            random_of.setdefault(keys[run.name], (rep["random_bpb"], run.name))
        reports[run.name] = {"source": ",".join(rep["sources"]), "steps": rep["steps"], "body": rep["body"],
                             "bpb": rep["bpb"], "random_bpb": None, "random_reference": None,
                             "command": plasticity_command(out, run, study, reference=reference, python="python")}
    for name, rep in reports.items():
        rep["random_bpb"], rep["random_reference"] = random_of.get(keys[name], (None, None))
    return reports
