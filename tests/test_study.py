"""tools/study.py: grid expansion at equal compute, resumable scheduling, the report."""
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional

import pytest
import yaml

from dept_mega.config import save_config
from dept_mega.study.grid import GridError, describe, load_study, run_config
from dept_mega.study.report import render_markdown, summary
from dept_mega.study.results import read_records, read_run
from dept_mega.study.runner import MARKER, is_finished, run_all, run_dir_of, run_plasticity

ROOT = Path(__file__).resolve().parents[1]


def _grid(tmp_path, **over):
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


def test_grid_expands_at_equal_compute(tmp_path):
    study = load_study(_grid(tmp_path))
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
    own = load_study(_grid(tmp_path, set={"train.steps": 100, "train.micro_batch_size": 4, "train.eval_samples": 5}))
    assert all(run_config(".", r, "x").train.eval_samples == 5 for r in own.runs)


@pytest.mark.parametrize("over, match", [
    ({"set": {"train.global_batch_size": 8}}, "set by the study tool"),
    ({"bogus": 1}, r"unknown key\(s\) \['bogus'\]"),
    ({"groups": 0}, "'groups' must be a positive integer"),
    ({"runs": [{"variant": "std", "grid": {"train.steps": [100, 200]}}]}, "equal compute needs the same"),
    ({"runs": [{"variant": "std"}, {"variant": "std"}]}, "share the name"),
    ({"runs": [{"variant": "glob", "set": {"dept.local_steps": 30}}]}, "dept.local_steps': train.steps=100 is not a multiple of 30"),
    ({"runs": [{"variant": "std", "set": {"model.nope": 1}}]}, "unknown config key 'model.nope'"),
    ({"plasticity": {"steps": 3}}, "plasticity'.source_config: the held-out source"),
    ({"plasticity": {"source_config": "x.yaml", "steps": 0}}, "plasticity'.steps: a positive integer"),
    ({"plasticity": {"source_config": "x.yaml", "steps": 2, "body_lr": 0.1}}, "body_lr: a number, with body"),
    ({"plasticity": {"source_config": "x.yaml", "steps": 2, "runs": ["nope"]}}, r"unknown run\(s\) \['nope'\]"),
])
def test_grid_errors_name_the_problem(tmp_path, over, match):
    with pytest.raises(GridError, match=match):
        load_study(_grid(tmp_path, **over))


def _fake_metrics(run_dir: str, variant: str, steps: int, bpb: float, groups: int, local_steps: int = 50,
                  nbytes: Optional[dict] = None) -> None:
    os.makedirs(run_dir, exist_ok=True)
    cfg = {"dept": {"variant": variant, "local_steps": local_steps}}
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
        recs += [{"kind": "outer", "step": s, "round": s // 50 - 1, "time": 0,
                  "bytes": {"outer_body": 1000 * groups, "outer_embedding": 0, "source_move": 0, "dp": 0},
                  "seconds": 0.1} for s in (50, 100)]
    # a run resumed from a checkpoint writes some steps again (the stale record comes first):
    # the last record of each (kind, step) counts
    recs.insert(0, {"kind": "train", "step": 10, "round": 0, "time": 0, "loss": 99.0, "tokens": 64})
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs))
    with open(os.path.join(run_dir, "params.json"), "w") as f:
        json.dump({"ranks": [{"body": 1000, "embeddings": 500}]}, f)


class _FakeProc:
    def __init__(self, rc, done):
        self.rc, self.done = rc, done

    def poll(self):
        return self.rc if self.done.is_set() else None


def test_runner_budget_resume_and_failures(tmp_path):
    study = load_study(_grid(tmp_path))
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
                _fake_metrics(run_dir, spec.variant, 100, 1.0 if spec.variant == "std" else 0.9, 3)
                rc = 0
            with lock:
                running[0] -= spec.nproc
            proc.rc = rc
            done.set()

        proc = _FakeProc(None, done)
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


@pytest.mark.parametrize("dept_steps, per, why", [
    ((20, 50), 1, "one inner step (the DEPT runs' rounds differ in length: dept.local_steps 20, 50)"),
    ((), 1, "one inner step (no DEPT run in the study to compare with)"),
    ((20, 20), 20, "a round of the DEPT runs' 20 inner steps"),
])
def test_std_equivalent_counts_the_dept_runs_round(tmp_path, dept_steps, per, why):
    results = {}
    for name, variant, n in [("std", "std", 100)] + [(f"glob{i}", "glob", n) for i, n in enumerate(dept_steps)]:
        d = str(tmp_path / name)
        _fake_metrics(d, variant, 100, 1.0, 3, local_steps=n)
        results[name] = read_run(d)
    study = load_study(_grid(tmp_path, runs=[{"variant": "std", "name": "std"}] + [
        {"variant": "glob", "name": f"glob{i}", "set": {"dept.local_steps": 50}} for i in range(len(dept_steps))]))
    data = summary(study, results, "cmd")
    std = next(r for r in data["runs"] if r["name"] == "std")
    assert std["std_equivalent_bytes_per_round"] == 3 * 1500 * 4 * per
    assert data["std_equivalent_round_steps"] == per and data["std_equivalent_round"].startswith(why)
    assert f"send in {why}" in render_markdown(data)


def test_report_tables_gain_and_figures(tmp_path):
    pytest.importorskip("matplotlib")
    from dept_mega.study.report import plot
    study = load_study(_grid(tmp_path))
    out = tmp_path / "out"
    results = {}
    for i, r in enumerate(study.runs):
        d = run_dir_of(str(out), r)
        bpb = {"std": 1.0 + 0.5 * i}.get(r.variant, 0.9)
        # STD keeps examples/tiny/std.yaml's dept.local_steps (100), which means nothing for it
        _fake_metrics(d, r.variant, 100, bpb, 3, local_steps=100 if r.variant == "std" else 50)
        results[r.name] = read_run(d)
    rr = results["std_t0"]
    assert [s for s, _ in rr.train_curve][:2] == [10, 20] and rr.train_curve[0][1] == pytest.approx(4.9)
    assert rr.eval_curve[-1][1] == pytest.approx(1.05) and rr.train_tokens == 6400
    data = summary(study, results, "python tools/study.py --grid g --out o")
    assert data["best_std"] == "std_t0"
    glob = next(r for r in data["runs"] if r["name"] == "glob_outer_optimizer=fedavg")
    assert glob["gain_vs_best_std_pct"] == pytest.approx((1.05 - 0.95) / 1.05 * 100)
    std = next(r for r in data["runs"] if r["name"] == "std_t0")
    # over a round of the DEPT runs (50 inner steps), not STD's own dept.local_steps
    assert std["std_equivalent_bytes_per_round"] == 3 * 1500 * 4 * 50
    md = render_markdown(data)
    assert "in a round of the DEPT runs' 50 inner steps" in md and "| 900.00 kB |" in md
    assert "| glob_outer_optimizer=fedavg | 0.9000 | 1.0000 | 0.9500 | +9.5 % |" in md
    assert "| std_t0 | 1.0000 | 1.1000 | 1.0500 | (best STD) |" in md
    assert "1.00 kB" not in md and "3.00 kB" in md  # outer_body per round, summed over ranks
    for p in plot(data, str(tmp_path)):
        assert os.path.getsize(p) > 5000


def test_model_ablation_is_not_called_equal_compute(tmp_path):
    """Runs that differ in the body (model.num_layers) make equal tokens but not equal compute:
    describe() and results.md say so; a difference in the vocabulary alone does not."""
    def grid(sets):
        return load_study(_grid(tmp_path, runs=[{"variant": "std", "name": f"std{i}", "set": s}
                                                for i, s in enumerate(sets)]))
    ablation = grid([{"model.num_layers": 2}, {"model.num_layers": 1}])
    assert ablation.model_differs_in == ["model.num_layers"]
    assert ablation.body_flops["std0"] == 2 * ablation.body_flops["std1"] > 0
    assert "warning: equal tokens and steps; NOT equal compute: runs differ in model.num_layers" in describe(ablation)
    results = {}
    for r in ablation.runs:
        _fake_metrics(str(tmp_path / r.name), "std", 100, 1.0, 3)
        results[r.name] = read_run(str(tmp_path / r.name))
    data = summary(ablation, results, "cmd")
    assert data["compute_note"].startswith("equal tokens and steps; NOT equal compute: runs differ in model.num_layers")
    md = render_markdown(data)
    assert "**Equal tokens and steps; NOT equal compute: runs differ in model.num_layers" in md
    assert "Equal compute:" not in md
    # the same body, other vocabulary sizes or kernels: equal compute, no warning
    same = grid([{"model.vocab_size": 100}, {"model.vocab_size": 200, "model.attention_backend": "bias"}])
    assert same.model_differs_in == [] and "warning" not in describe(same)
    assert "Equal compute: every DEPT run" in render_markdown(summary(same, results, "cmd"))
    # the same FLOPs but another model: said too
    eps = grid([{"model.norm_eps": 1e-5}, {"model.norm_eps": 1e-6}])
    assert "NOT the same model: runs differ in model.norm_eps" in describe(eps)


def test_report_notes_validation_text_that_differs(tmp_path):
    """A source whose evaluated bytes differ between runs (SPEC-OPT's own tokenizer reading the
    same number of sequences of a larger part) is named with its byte range in results.md and
    results.json; equal bytes give no note."""
    study = load_study(_grid(tmp_path, runs=[{"variant": "std", "name": "std"}, {"variant": "glob", "name": "glob"},
                                             {"variant": "spec_opt", "name": "spec_opt"}]))
    results = {}
    for r in study.runs:
        d = str(tmp_path / r.name)
        _fake_metrics(d, r.variant, 100, 1.0, 3, nbytes={"fr": 3781} if r.variant == "spec_opt" else {"fr": 3571})
        save_config(run_config(".", r, d), os.path.join(d, "config.yaml"))  # eval_samples 48, seq_length 64
        results[r.name] = read_run(d)
    data = summary(study, results, "cmd")
    assert [(d["source"], d["min_bytes"], d["max_bytes"]) for d in data["eval_text_differs"]] == [("fr", 3571, 3781)]
    # 10 tokens read of 64-token sequences: fewer than the 48 asked for, so every part was read whole
    assert data["eval_text_differs"][0]["cut"] == []
    md = render_markdown(data)
    assert "Not the same validation text: the runs' final evaluations of fr (3,571 to 3,781 bytes)" in md
    assert "Every run read these parts whole" in md and data["eval_text_note"] in md
    # a run that read as many sequences as it asked for may have cut its part: the fix is named
    for r in results.values():
        r.by_source["fr"]["tokens"] = 48 * 64
    data = summary(study, results, "cmd")
    assert data["eval_text_differs"][0]["cut"] == ["std", "glob", "spec_opt"]
    assert "set train.eval_samples (the grid's `set:`) to at least the largest validation part's sample count" in (
        render_markdown(data))
    # the same text everywhere: no note
    for r in results.values():
        r.by_source["fr"]["bytes"] = 3571
    data = summary(study, results, "cmd")
    assert data["eval_text_differs"] == [] and data["eval_text_note"] is None
    assert "Not the same validation text" not in render_markdown(data)


def test_plasticity_reference_per_model(tmp_path):
    """The random-body reference is made once per distinct adaptation: runs of different models
    (model.num_layers 2 and 1) each get their own, runs that differ only in what the adaptation
    replaces (dept.*) share one."""
    heldout = tmp_path / "heldout.yaml"
    heldout.write_text(yaml.safe_dump({"data": {"sources": [{"name": "ja", "prefix": "x/ja", "tokenizer": "x/ja.model"}]},
                                       "train": {"global_batch_size": 4, "micro_batch_size": 4}}))
    study = load_study(_grid(tmp_path, runs=[{"variant": ["std", "glob"],
                                              "grid": {"model.num_layers": [2, 1]}}],
                             plasticity={"source_config": str(heldout), "steps": 2}))
    out = str(tmp_path / "out")
    os.makedirs(os.path.join(out, "logs"))
    for r in study.runs:
        d = run_dir_of(out, r)
        _fake_metrics(d, r.variant, 100, 1.0, 3)
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


def test_read_records_rejects_a_broken_line(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"kind": "train", "step": 1}\n{not json\n')
    with pytest.raises(Exception, match=r"m.jsonl:2: not JSON"):
        read_records(str(p))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_study_end_to_end_on_the_sample_corpus(tmp_path):
    """Two real runs (STD and GLOB with 2 groups) of a few steps on two sample sources: the
    tool runs them, writes the report, and a second call finds them finished."""
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
    # a budget of 3 processes: STD (1) and GLOB (2) run at once (their start-ups and torchrun's
    # waits overlap); the budget's scheduling is test_runner_budget_resume_and_failures's
    cmd = [sys.executable, str(ROOT / "tools" / "study.py"), "--grid", str(grid), "--out", str(out),
           "--parallel", "3"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=500,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
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
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert res.returncode == 0 and res.stdout.count("finished earlier, skipped") == 2
    assert "[study] plasticity" not in res.stdout  # nothing adapted again
    # a report remade from the finished runs names the command that runs the study
    res = subprocess.run(cmd + ["--report-only"], cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert res.returncode == 0, res.stderr[-2000:]
    made_by = next(line for line in (out / "results.md").read_text().splitlines() if line.startswith("Made by"))
    assert "--report-only" not in made_by and "--parallel 3" in made_by
