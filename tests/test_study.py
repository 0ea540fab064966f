"""tools/study.py: grid expansion at equal compute, resumable scheduling, refusing changed runs
(the report's tables: test_study_report.py)."""
import functools
import io
import json
import os
import subprocess
import threading
from pathlib import Path

import pytest
import yaml

from dept_mega.config import save_config
from dept_mega.study.grid import GridError, load_study, run_config
from dept_mega.study.runner import MARKER, StaleRunError, find_stale, is_finished, run_all, run_dir_of, run_plasticity
from tests.study_utils import (ROOT, FakeProc, fake_metrics, finish_runs, forked_popen, forked_torchrun, study_grid,
                               study_main)
from tests.trainer_utils import run_script


def test_grid_expands_at_equal_compute(tmp_path):
    study = load_study(study_grid(tmp_path))
    names = [r.name for r in study.runs]
    assert names == ["std_t0", "std_t1", "glob_outer_optimizer=fedavg", "glob_outer_optimizer=nesterov",
                     "spec_opt_outer_optimizer=fedavg", "spec_opt_outer_optimizer=nesterov"]
    by = {r.name: r for r in study.runs}
    # STD: one group with groups × group_batch sequences; DEPT: `groups` processes of group_batch
    assert "train.global_batch_size=12" in by["std_t0"].overrides and by["std_t0"].nproc == 1
    assert "train.global_batch_size=4" in by["glob_outer_optimizer=fedavg"].overrides
    assert by["glob_outer_optimizer=nesterov"].nproc == 3
    assert "dept.outer_optimizer={lr: 0.7, momentum: 0.9, name: nesterov}" in by[
        "spec_opt_outer_optimizer=nesterov"].overrides
    assert by["std_t1"].overrides.index("dept.temperature=1.0") < by["std_t1"].overrides.index(
        "train.global_batch_size=12")
    # every run evaluates the same validation sequences: eval_iters (12 in the tiny configs) x group_batch
    assert all("train.eval_samples=48" in r.overrides for r in study.runs), [r.overrides for r in study.runs]
    assert [run_config(".", r, "x").train.eval_sequences() for r in study.runs] == [48] * len(study.runs)
    # a grid that sets eval_samples keeps its own
    own = load_study(study_grid(tmp_path, set={"train.steps": 100, "train.micro_batch_size": 4, "train.eval_samples": 5}))
    assert all(run_config(".", r, "x").train.eval_samples == 5 for r in own.runs)


@pytest.mark.parametrize("over, match", [
    ({"set": {"train.global_batch_size": 8}}, "set by the study tool"),
    ({"bogus": 1}, r"unknown key\(s\) \['bogus'\]"),
    ({"groups": 0}, "'groups' must be a positive integer"),
    ({"runs": [{"variant": "std", "grid": {"train.steps": [100, 200]}}]}, "equal compute needs the same"),
    ({"runs": [{"variant": "std"}, {"variant": "std"}]}, "share the name"),
    # one run under two names would be reported as two seeds of one row
    ({"runs": [{"variant": "std", "name": "a"}, {"variant": "glob"}, {"variant": "std", "name": "b"}]},
     r"runs 'a' \(runs\[0\]\) and 'b' \(runs\[2\]\) resolve to the same config, train.seed 1234 included"),
    ({"runs": [{"variant": "glob", "set": {"dept.local_steps": 30}}]}, "dept.local_steps': train.steps=100 is not a multiple of 30"),
    ({"runs": [{"variant": "std", "set": {"model.nope": 1}}]}, "unknown config key 'model.nope'"),
    ({"plasticity": {"steps": 3}}, "plasticity'.source_config: the held-out source"),
    ({"plasticity": {"source_config": "x.yaml", "steps": 0}}, "plasticity'.steps: a positive integer"),
    ({"plasticity": {"source_config": "x.yaml", "steps": 2, "body_lr": 0.1}}, "body_lr: a number, with body"),
    ({"plasticity": {"source_config": "examples/study/heldout_ja.yaml", "steps": 2, "runs": ["nope"]}},
     r"unknown run\(s\) \['nope'\]"),
])
def test_grid_errors_name_the_problem(tmp_path, over, match):
    with pytest.raises(GridError, match=match):
        load_study(study_grid(tmp_path, **over))


def test_plasticity_source_config_is_checked_at_grid_load(tmp_path):
    """A missing or non-mapping held-out source config is an error when the grid loads, naming
    the grid file, its 'plasticity' entry and the file, not when dept_mega.adapt first reads
    it after every run has trained; a relative path is taken from base_dir."""
    with pytest.raises(GridError, match=r"grid.yaml: 'plasticity'.source_config: '.*/nope.yaml' does not exist"):
        load_study(study_grid(tmp_path, plasticity={"source_config": "nope.yaml", "steps": 2}))
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(GridError, match=r"'plasticity'.source_config: '.*list.yaml' must hold a mapping"):
        load_study(study_grid(tmp_path, plasticity={"source_config": str(tmp_path / "list.yaml"), "steps": 2}))
    (tmp_path / "held.yaml").write_text("train: {log_interval: 10}\n")
    study = load_study(study_grid(tmp_path, plasticity={"source_config": "held.yaml", "steps": 2}),
                       base_dir=str(tmp_path))
    assert study.plasticity.source_config == "held.yaml"


def test_runner_budget_resume_and_failures(tmp_path):
    study = load_study(study_grid(tmp_path))
    out = str(tmp_path / "out")
    running, peak, started = [0], [0], []
    lock = threading.Lock()

    def launch(cmd, cwd, env, fh):
        run_dir = next(c.split("=", 1)[1] for c in cmd if c.startswith("train.run_dir="))
        name = os.path.basename(run_dir)
        spec = next(r for r in study.runs if r.name == name)
        started.append(name)
        done = threading.Event()
        with lock:
            running[0] += spec.nproc
            peak[0] = max(peak[0], running[0])

        def work():
            if "spec_opt" in name and "nesterov" in name:
                rc = 1  # this run fails
            else:
                fake_metrics(run_dir, spec.variant, 100, 1.0 if spec.variant == "std" else 0.9, 3)
                save_config(run_config(".", spec, run_dir), os.path.join(run_dir, "config.yaml"))
                rc = 0
            with lock:
                running[0] -= spec.nproc
            proc.rc = rc
            done.set()

        proc = FakeProc(None, done)
        threading.Timer(0.05, work).start()
        return proc

    log = open(tmp_path / "log.txt", "w")
    outcomes = run_all(study, out, 100, parallel=4, launch=launch, log=log)
    assert peak[0] <= 4  # never more processes than the budget (a 3-process run plus a 1-process one)
    failed = [o.run.name for o in outcomes if o.returncode]
    assert failed == ["spec_opt_outer_optimizer=nesterov"]
    for o in outcomes:
        assert is_finished(out, o.run, 100) == (o.returncode == 0)
    # a second call skips the finished runs and retries only the failed one
    started.clear()
    run_all(study, out, 100, parallel=4, launch=launch, log=log)
    assert started == ["spec_opt_outer_optimizer=nesterov"]
    marker = json.loads(Path(run_dir_of(out, study.runs[0]), MARKER).read_text())
    assert marker["command"][:3] == ["python", "-m", "torch.distributed.run"]


def test_plasticity_reference_per_model(tmp_path):
    """The random-body reference is made once per distinct adaptation: runs of different models
    (model.num_layers 2 and 1) each get their own, runs that differ only in what the adaptation
    replaces (dept.*) share one."""
    heldout = tmp_path / "heldout.yaml"
    heldout.write_text(yaml.safe_dump({"data": {"sources": [{"name": "ja", "prefix": "x/ja", "tokenizer": "x/ja.model"}]},
                                       "train": {"global_batch_size": 4, "micro_batch_size": 4}}))
    study = load_study(study_grid(tmp_path, runs=[{"variant": ["std", "glob"],
                                              "grid": {"model.num_layers": [2, 1]}}],
                             plasticity={"source_config": str(heldout), "steps": 2}))
    out = str(tmp_path / "out")
    os.makedirs(os.path.join(out, "logs"))
    for r in study.runs:
        d = run_dir_of(out, r)
        fake_metrics(d, r.variant, 100, 1.0, 3)
        save_config(run_config(".", r, d), os.path.join(d, "config.yaml"))
        Path(d, MARKER).write_text("{}")
    made = []

    def launch(cmd, cwd, env, fh):  # the adaptation: random BPB from the run's model
        run_dir, dest = cmd[cmd.index("--run-dir") + 1], cmd[cmd.index("--out") + 1]
        layers = yaml.safe_load(Path(run_dir, "config.yaml").read_text())["model"]["num_layers"]
        rep = {"sources": ["ja"], "steps": 2, "body": "frozen", "bpb": 2.0}
        if "--no-random-baseline" not in cmd:
            made.append(os.path.basename(run_dir))
            rep["random_bpb"] = 3.0 + layers
        os.makedirs(dest)
        Path(dest, "adapt.json").write_text(json.dumps(rep))
        return 0

    reps = run_plasticity(study, out, 100, launch=launch, log=open(tmp_path / "log.txt", "w"))
    names = [r.name for r in study.runs]
    assert names == ["std_num_layers=2", "std_num_layers=1", "glob_num_layers=2", "glob_num_layers=1"]
    # STD (batch 12) and GLOB (batch 4) adapt with the held-out config's batch: one reference per model
    assert made == ["std_num_layers=2", "std_num_layers=1"]
    assert {n: reps[n]["random_bpb"] for n in names} == {"std_num_layers=2": 5.0, "std_num_layers=1": 4.0,
                                                         "glob_num_layers=2": 5.0, "glob_num_layers=1": 4.0}
    assert reps["glob_num_layers=1"]["random_reference"] == "std_num_layers=1"
    assert "--no-random-baseline" in reps["glob_num_layers=2"]["command"]
    assert "--no-random-baseline" not in reps["std_num_layers=1"]["command"]
    # without the held-out batch size, each run adapts with its own batch: STD's and GLOB's differ
    heldout.write_text(yaml.safe_dump({"data": {"sources": [{"name": "ja", "prefix": "x/ja", "tokenizer": "x/ja.model"}]}}))
    import shutil
    shutil.rmtree(os.path.join(out, "plasticity"))
    made.clear()
    run_plasticity(study, out, 100, launch=launch, log=open(tmp_path / "log2.txt", "w"))
    assert made == names


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_study_end_to_end_on_the_sample_corpus(tmp_path, monkeypatch):
    """Two real runs (STD and GLOB with 2 groups) of a few steps on two sample sources: the
    tool runs them, writes the report, and a second call finds them finished. (The first and
    the --report-only call run the tool's main in this process, from the repository root as the
    tool asks; the second call is the script itself run as ``__main__``, whose lines are checked.
    The runs' and GLOB's adaptation's commands are read by torchrun's parser and run on ranks
    forked from this process's forkserver (study_utils.forked_torchrun: ~4 s of CPU less for
    torchrun and each rank); STD's adaptation is launched as the study launches it, torchrun
    included: the one test of ``torchrun --standalone -m dept_mega.adapt``.)"""
    from tests.trainer_utils import ensure_sample_corpus
    ensure_sample_corpus()
    configs = {}
    for v in ("std", "glob"):
        cfg = yaml.safe_load((ROOT / "examples" / "tiny" / f"{v}.yaml").read_text())
        cfg["data"]["sources"] = cfg["data"]["sources"][:2]
        cfg["model"].update({"hidden_size": 32, "ffn_hidden_size": 64, "seq_length": 32})
        cfg["train"].update({"micro_batch_size": 2, "eval_iters": 2})
        path = tmp_path / f"{v}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        configs[v] = str(path)
    heldout = tmp_path / "heldout.yaml"
    build = ROOT / "examples" / "data" / "build"
    heldout.write_text(yaml.safe_dump({"data": {"sources": [{"name": "ja", "prefix": str(build / "ja_own_text_document"),
                                                            "tokenizer": str(build / "tok" / "ja.model")}]},
                                       "train": {"global_batch_size": 2, "micro_batch_size": 2, "eval_iters": 1}}))
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({"groups": 2, "group_batch": 2, "configs": configs,
                                    "set": {"train.steps": 4, "train.eval_interval": 2, "train.save_interval": 4,
                                            "train.log_interval": 1, "dept.local_steps": 2},
                                    "runs": [{"variant": ["std", "glob"]}],
                                    "plasticity": {"source_config": str(heldout), "steps": 2}}))
    out = tmp_path / "out"
    # a budget of 3 processes (the report names it below); the forked launch below runs each job
    # to its end as it starts it: the budget's scheduling is test_runner_budget_resume_and_failures's
    args = ["--grid", str(grid), "--out", str(out), "--parallel", "3"]
    main = study_main(monkeypatch)
    adaptations = []

    def adapt(cmd, cwd, env, fh):
        adaptations.append(os.path.basename(cmd[cmd.index("--out") + 1]))
        if len(adaptations) == 1:  # as run_plasticity launches it
            return subprocess.run(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode
        return forked_torchrun(cmd, cwd, env, fh)

    monkeypatch.setitem(main.__globals__, "run_all", functools.partial(run_all, launch=forked_popen))
    monkeypatch.setitem(main.__globals__, "run_plasticity", functools.partial(run_plasticity, launch=adapt))
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert main(args) == 0  # (its output: pytest's capture)
    data = json.loads((out / "results.json").read_text())
    assert [r["name"] for r in data["runs"]] == ["std", "glob"] and all(r["finished"] for r in data["runs"])
    glob = data["runs"][1]
    assert glob["rounds"] == 2 and glob["bytes_per_round"]["outer_body"] > 0
    assert set(glob["by_source"]) == {"en", "fr"} and glob["train_tokens"] == data["runs"][0]["train_tokens"]
    for f in ("results.md", "bpb.png", "curves.png", "bytes.png"):
        assert (out / f).stat().st_size > 0
    # plasticity: each body adapted to the held-out source; the random reference made once (the
    # held-out config sets the batch, so STD's and GLOB's adaptations are the same)
    plast = {r["name"]: r["plasticity"] for r in data["runs"]}
    assert set(plast) == {"std", "glob"} and all(p["source"] == "ja" and p["bpb"] > 0 for p in plast.values())
    assert plast["std"]["random_bpb"] == plast["glob"]["random_bpb"] > 0
    assert "random" in json.loads((out / "plasticity" / "std" / "adapt.json").read_text())
    assert json.loads((out / "plasticity" / "glob" / "adapt.json").read_text())["random"] is None
    assert plast["glob"]["random_reference"] == "std"  # the same adaptation (model, seed, batch): shared
    assert "## Plasticity" in (out / "results.md").read_text()
    assert adaptations == ["std", "glob"]
    # (the runner's lines go to its log, by default the sys.stdout of its import: here one to read)
    said = io.StringIO()
    for fn in (run_all, run_plasticity):
        monkeypatch.setitem(fn.__kwdefaults__, "log", said)
    assert run_script("tools/study.py", *args, monkeypatch=monkeypatch) == 0
    said = said.getvalue()
    assert said.count("finished earlier, skipped") == 2
    assert "[study] plasticity" not in said  # nothing adapted again
    # a report remade from the finished runs names the command that runs the study
    assert main(args + ["--report-only"]) == 0
    made_by = next(line for line in (out / "results.md").read_text().splitlines() if line.startswith("Made by"))
    assert "--report-only" not in made_by and "--parallel 3" in made_by


def test_changed_grid_is_refused_not_silently_reused(tmp_path, monkeypatch, capsys):
    """A run directory made from other settings than the grid now asks for (optim.lr added to
    `set:`) is not reused under the new grid: run_all and tools/study.py refuse, naming the run
    and the key; --rerun-changed moves it to OUT/replaced/ and makes it again."""
    out = str(tmp_path / "out")
    old = load_study(study_grid(tmp_path, runs=[{"variant": "std", "name": "std"}, {"variant": "glob", "name": "glob"}]))
    finish_runs(out, old)
    assert find_stale(old, out) == []
    grid = study_grid(tmp_path, runs=[{"variant": "std", "name": "std"}, {"variant": "glob", "name": "glob"}],
                 set={"train.steps": 100, "train.micro_batch_size": 4, "optim.lr": 1.0e-3})
    new = load_study(grid)
    stale = find_stale(new, out)
    assert [(s.name, s.kind, [d[0] for d in s.diffs]) for s in stale] == [("std", "run", ["optim.lr"]),
                                                                        ("glob", "run", ["optim.lr"])]
    assert stale[0].diffs[0][2] == 1.0e-3
    started = []

    def launch(cmd, cwd, env, fh):
        started.append(os.path.basename(next(c for c in cmd if c.startswith("train.run_dir=")).split("=", 1)[1]))
        return FakeProc(1, threading.Event())  # (never finishes: not waited for below)

    log = open(tmp_path / "log.txt", "w")
    with pytest.raises(StaleRunError, match=r"run std \(.*runs/std\): optim.lr: it has 0.003, the grid asks 0.001"):
        run_all(new, out, 100, launch=launch, log=log)
    assert started == [] and is_finished(out, new.runs[0], 100)
    # the tool says so before anything runs, also for --report-only (exit 2): the script run as
    # ``python tools/study.py ...`` runs it, in this process (a process of its own: ~4 s of CPU more)
    monkeypatch.chdir(ROOT)
    capsys.readouterr()
    rc = run_script("tools/study.py", "--grid", grid, "--out", out, "--report-only", monkeypatch=monkeypatch)
    err = capsys.readouterr().err
    assert rc == 2 and "run glob" in err and "optim.lr" in err, err
    assert "--rerun-changed" in err and not (Path(out) / "results.md").exists()
    # --rerun-changed (rerun_changed=True): moved aside, made again
    os.makedirs(os.path.join(out, "plasticity", "std"))
    done = threading.Event()
    done.set()

    def launch_ok(cmd, cwd, env, fh):
        name = os.path.basename(next(c for c in cmd if c.startswith("train.run_dir=")).split("=", 1)[1])
        started.append(name)
        finish_runs(out, new, [r for r in new.runs if r.name == name])
        return FakeProc(0, done)

    run_all(new, out, 100, launch=launch_ok, log=log, rerun_changed=True)
    assert started == ["std", "glob"] and find_stale(new, out) == []
    assert yaml.safe_load(Path(out, "replaced", "std.1", "runs", "config.yaml").read_text())["optim"]["lr"] == 3e-3
    assert Path(out, "replaced", "std.1", "plasticity").is_dir() and not Path(out, "plasticity", "std").exists()
    # another base config (the same overrides) is a change too; so is the process count
    other = tmp_path / "glob2.yaml"
    cfg = yaml.safe_load((ROOT / "examples" / "tiny" / "glob.yaml").read_text())
    cfg["model"]["num_layers"] = 1
    other.write_text(yaml.safe_dump(cfg))
    doc = yaml.safe_load(Path(grid).read_text())
    doc["configs"]["glob"] = str(other)
    Path(grid).write_text(yaml.safe_dump(doc))
    assert [(s.name, [d[0] for d in s.diffs]) for s in find_stale(load_study(grid), out)] == [
        ("glob", ["model.num_layers"])]
    doc["groups"] = 2
    Path(grid).write_text(yaml.safe_dump(doc))
    diffs = {s.name: [d[0] for d in s.diffs] for s in find_stale(load_study(grid), out)}
    assert "processes (--nproc-per-node)" in diffs["glob"] and "train.global_batch_size" in diffs["std"]


def test_changed_plasticity_is_refused(tmp_path):
    """A finished adaptation made with other plasticity settings (steps) or from another
    held-out config is refused, naming the run and the key; rerun_changed makes it again."""
    heldout = tmp_path / "heldout.yaml"
    heldout.write_text(yaml.safe_dump({"data": {"sources": [{"name": "ja", "prefix": "x/ja", "tokenizer": "x/ja.model"}]},
                                       "train": {"global_batch_size": 4, "micro_batch_size": 4}}))
    study = load_study(study_grid(tmp_path, runs=[{"variant": "std", "name": "std"}],
                             plasticity={"source_config": str(heldout), "steps": 2}))
    out = str(tmp_path / "out")
    os.makedirs(os.path.join(out, "logs"))
    finish_runs(out, study)
    made = []

    def launch(cmd, cwd, env, fh):
        from dept_mega.adapt import adapt_config
        run_dir, dest = cmd[cmd.index("--run-dir") + 1], cmd[cmd.index("--out") + 1]
        steps = int(cmd[cmd.index("--steps") + 1])
        run_cfg = yaml.safe_load(Path(run_dir, "config.yaml").read_text())
        cfg = adapt_config(run_cfg, yaml.safe_load(heldout.read_text()), str(heldout), steps,
                           os.path.join(dest, "trained"), 1)
        os.makedirs(os.path.join(dest, "trained"))
        save_config(cfg, os.path.join(dest, "trained", "config.yaml"))
        Path(dest, "adapt.json").write_text(json.dumps({
            "source_config": str(heldout), "steps": steps, "body": "frozen", "body_lr": None, "step": 100,
            "sources": ["ja"], "bpb": 2.0, "random_bpb": 3.0}))
        made.append(steps)
        return 0

    log = open(tmp_path / "log.txt", "w")
    run_plasticity(study, out, 100, launch=launch, log=log)
    assert made == [2] and find_stale(study, out) == []
    longer = load_study(study_grid(tmp_path, runs=[{"variant": "std", "name": "std"}],
                              plasticity={"source_config": str(heldout), "steps": 3}))
    with pytest.raises(StaleRunError, match=r"adaptation std \(.*plasticity/std\): steps: it has 2, the grid asks 3"):
        run_plasticity(longer, out, 100, launch=launch, log=log)
    # the held-out config file edited (its batch size): the adaptation's config differs
    heldout.write_text(yaml.safe_dump({"data": {"sources": [{"name": "ja", "prefix": "x/ja", "tokenizer": "x/ja.model"}]},
                                       "train": {"global_batch_size": 8, "micro_batch_size": 4}}))
    assert [d[0] for d in find_stale(study, out)[0].diffs] == ["train.global_batch_size"]
    reps = run_plasticity(longer, out, 100, launch=launch, log=log, rerun_changed=True)
    assert made == [2, 3] and reps["std"]["steps"] == 3 and Path(out, "replaced", "std.1", "plasticity").is_dir()



def test_an_adaptation_of_a_run_launched_elsewhere_is_not_stale(tmp_path):
    """The study compares a finished adaptation with the config dept_mega.adapt makes: the run's
    relative paths (here data.tokenizer) resolved against its recorded launch directory, as the
    adaptation read them (dept_mega.run_paths), not as config.yaml writes them."""
    from dept_mega.adapt import adapt_config
    from dept_mega.run_paths import record_launch_dir, run_config_tree
    heldout = tmp_path / "heldout.yaml"  # no tokenizer of its own: the run's data.tokenizer stays
    heldout.write_text(yaml.safe_dump({"data": {"sources": [{"name": "ja", "prefix": "x/ja"}]},
                                       "train": {"global_batch_size": 4, "micro_batch_size": 4}}))
    study = load_study(study_grid(tmp_path, runs=[{"variant": "std", "name": "std"}],
                                  plasticity={"source_config": str(heldout), "steps": 2}))
    out = str(tmp_path / "out")
    os.makedirs(os.path.join(out, "logs"))
    finish_runs(out, study)
    record_launch_dir(run_dir_of(out, study.runs[0]), str(tmp_path / "launch"))

    def launch(cmd, cwd, env, fh):  # what dept_mega.adapt writes
        run_dir, dest = cmd[cmd.index("--run-dir") + 1], cmd[cmd.index("--out") + 1]
        cfg = adapt_config(run_config_tree(run_dir)[0], yaml.safe_load(heldout.read_text()), str(heldout), 2,
                           os.path.join(dest, "trained"), 1)
        os.makedirs(os.path.join(dest, "trained"))
        save_config(cfg, os.path.join(dest, "trained", "config.yaml"))
        Path(dest, "adapt.json").write_text(json.dumps({
            "source_config": str(heldout), "steps": 2, "body": "frozen", "body_lr": None, "step": 100,
            "sources": ["ja"], "bpb": 2.0, "random_bpb": 3.0}))
        return 0

    with open(tmp_path / "log.txt", "w") as log:
        run_plasticity(study, out, 100, launch=launch, log=log)
    trained = yaml.safe_load(Path(out, "plasticity", "std", "trained", "config.yaml").read_text())
    assert trained["data"]["tokenizer"] == str(tmp_path / "launch" / "examples/data/build/tok/global.model")
    assert find_stale(study, out) == []
