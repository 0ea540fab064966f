"""tools/study.py: grid expansion at equal compute, resumable scheduling, the report."""
import importlib.util
import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional

import pytest
import yaml

from dept_mega.config import save_config
from dept_mega.study.grid import WHOLE_PART, GridError, describe, load_study, run_config
from dept_mega.study.markdown import render_markdown
from dept_mega.study.report import summary
from dept_mega.study.results import read_records, read_run
from dept_mega.study.runner import (MARKER, StaleRunError, find_stale, is_finished, run_all, run_dir_of,
                                    run_plasticity)

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
                save_config(run_config(".", spec, run_dir), os.path.join(run_dir, "config.yaml"))
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


def test_cost_is_per_inner_step_and_per_run(tmp_path):
    """GLOB at dept.local_steps 5 and 10 sends the same bytes per round, so the round hides the
    ablation: the report counts bytes per inner step and per run (measured from the outer
    records), half as many at 10 local steps; STD's data-parallel equivalent is per inner step
    too, headed so, and bytes.png plots per inner step."""
    results = {}
    for name, variant, L in [("std", "std", 100), ("glob5", "glob", 5), ("glob10", "glob", 10)]:
        d = str(tmp_path / name)
        _fake_metrics(d, variant, 100, 1.0, 3, local_steps=L, outer_every=L)
        results[name] = read_run(d)
    study = load_study(_grid(tmp_path, runs=[{"variant": "std", "name": "std"}] + [
        {"variant": "glob", "name": f"glob{L}", "set": {"dept.local_steps": L}} for L in (5, 10)]))
    data = summary(study, results, "cmd")
    by = {r["name"]: r for r in data["runs"]}
    # 3000 bytes of outer_body per round in both: 20 rounds vs 10 rounds of 100 steps
    assert by["glob5"]["bytes_per_round"]["outer_body"] == by["glob10"]["bytes_per_round"]["outer_body"] == 3000
    assert by["glob5"]["bytes_per_step"]["outer_body"] == 600 and by["glob10"]["bytes_per_step"]["outer_body"] == 300
    assert by["glob5"]["cross_group_bytes_total"] == 60000 and by["glob10"]["cross_group_bytes_total"] == 30000
    assert by["std"]["std_equivalent_bytes_per_step"] == 3 * 1500 * 4
    assert by["std"]["std_equivalent_bytes_total"] == 3 * 1500 * 4 * 100
    md = render_markdown(data)
    assert "| glob5 | 1,000 | 500 | fp32 | 5 × 20 | 600 B | 0 B | 0 B | 60.0 kB | – | – | – |" in md
    assert "| glob10 | 1,000 | 500 | fp32 | 10 × 10 | 300 B | 0 B | 0 B | 30.0 kB | – | – | – |" in md
    assert "| std | 1,000 | 500 | – | – | – | – | – | – | 18.0 kB | 1.80 MB | – |" in md
    assert "STD data-parallel equivalent/inner step" in md and "/round" not in md
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    from dept_mega.study import figures
    heights = {}
    real_bar = plt.Axes.bar

    def bar(self, x, height, *args, label=None, **kw):
        heights[label] = list(height)
        return real_bar(self, x, height, *args, label=label, **kw)
    plt.Axes.bar = bar
    try:
        figures.plot(data, str(tmp_path))
    finally:
        plt.Axes.bar = real_bar
    assert heights["outer_body"][1:] == [600, 300]  # glob5, glob10: per inner step
    assert heights["std (data-parallel equivalent)"][0] == 18000


def test_report_tables_gain_and_figures(tmp_path):
    pytest.importorskip("matplotlib")
    from dept_mega.study.figures import plot
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
    assert std["std_equivalent_bytes_per_step"] == 3 * 1500 * 4
    md = render_markdown(data)
    assert "| glob_outer_optimizer=fedavg | 1 | 0.9000 | 1.0000 | 0.9500 | +9.5 % |" in md
    assert "| std_t0 | 1 | 1.0000 | 1.1000 | 1.0500 | (best STD) |" in md
    # outer_body summed over ranks (3 × 1000 per round), per inner step (50 per round): 60 B
    assert "| 50 × 2 | 60 B | 0 B | 0 B | 6.00 kB |" in md and "| 18.0 kB | 1.80 MB |" in md
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
    """SPEC-OPT's own tokenizer reading the same number of sequences covers other bytes: its gain
    is left out (–), the note names exactly the runs that read other bytes (not STD and GLOB,
    which read the reference's text) and asks for eval_whole; runs that read every part whole
    keep their gain, marked †; equal bytes give no note."""
    study = load_study(_grid(tmp_path, runs=[{"variant": "std", "name": "std"}, {"variant": "glob", "name": "glob"},
                                             {"variant": "spec_opt", "name": "spec_opt"}]))
    results = {}
    for r in study.runs:
        d = str(tmp_path / r.name)
        _fake_metrics(d, r.variant, 100, 1.0 if r.variant == "std" else 0.9, 3,
                      nbytes={"fr": 3781} if r.variant == "spec_opt" else {"fr": 3571})
        save_config(run_config(".", r, d), os.path.join(d, "config.yaml"))  # eval_samples 48, seq_length 64
        results[r.name] = read_run(d)
        r_fr = results[r.name].by_source["fr"]
        r_fr["tokens"] = 48 * 64  # read as many sequences as asked for: maybe a cut part
    data = summary(study, results, "cmd")
    assert [(d["source"], d["min_bytes"], d["max_bytes"]) for d in data["eval_text_differs"]] == [("fr", 3571, 3781)]
    assert data["eval_text_differs"][0]["by_bytes"] == {3571: ["std", "glob"], 3781: ["spec_opt"]}
    rows = {r["label"]: r for r in data["rows"]}
    assert rows["glob"]["eval_text"] == "same" and rows["glob"]["gain_vs_best_std_pct"] == pytest.approx(0.1 / 1.05 * 100)
    assert rows["spec_opt"]["eval_text"] == "other" and rows["spec_opt"]["gain_vs_best_std_pct"] is None
    assert next(r for r in data["runs"] if r["name"] == "spec_opt")["gain_vs_best_std_pct"] is None
    md = render_markdown(data)
    assert "| spec_opt | 1 | 0.9000 | 1.0000 | 0.9500 | – |" in md
    if importlib.util.find_spec("matplotlib"):  # bpb.png marks the row too
        import matplotlib.pyplot as plt
        from dept_mega.study import figures
        labels, real_bar = [], plt.Axes.bar

        def bar(self, *args, label=None, hatch=None, **kw):
            labels.append((label, hatch))
            return real_bar(self, *args, label=label, hatch=hatch, **kw)
        plt.Axes.bar = bar
        try:
            figures.plot(data, str(tmp_path))
        finally:
            plt.Axes.bar = real_bar
        assert ("spec_opt (n=1; other text)", "xx") in labels and ("glob (n=1)", None) in labels
    assert "| glob | 1 | 0.9000 | 1.0000 | 0.9500 | +9.5 % |" in md
    assert "fr: std, glob 3,571 bytes; spec_opt 3,781 bytes" in md
    assert " spec_opt read other text than the reference (std)" in md and "std, glob read other" not in md
    assert "set `eval_whole: true` in the grid" in md
    # every run read the part whole (fewer sequences than asked for): only the parts' edges differ
    for r in results.values():
        r.by_source["fr"]["tokens"] = 10
    data = summary(study, results, "cmd")
    assert {r["label"]: r["eval_text"] for r in data["rows"]} == {"std": None, "glob": "same", "spec_opt": "edges"}
    md = render_markdown(data)
    assert "| spec_opt | 1 | 0.9000 | 1.0000 | 0.9500 | +9.5 % † |" in md
    assert "† spec_opt: every run concerned read these parts whole" in md and "left out" not in md
    assert "here at most 210 bytes, 5.55 % of fr's text" in md
    # the same text everywhere: no note
    for r in results.values():
        r.by_source["fr"]["bytes"] = 3571
    data = summary(study, results, "cmd")
    assert data["eval_text_differs"] == [] and data["eval_text_note"] is None
    assert "Not the same validation text" not in render_markdown(data)


def test_eval_whole_reads_every_part_whole(tmp_path):
    """``eval_whole: true`` sets train.eval_samples above any part's size for every run (the
    evaluation reads min(eval_samples, the part's samples)); a grid that also sets it is refused."""
    study = load_study(_grid(tmp_path, eval_whole=True))
    assert study.eval_whole and "every run reads every validation part whole (eval_whole: true)" in describe(study)
    assert all(run_config(".", r, "x").train.eval_samples == WHOLE_PART for r in study.runs)
    assert all(sum(o.startswith("train.eval_samples=") for o in r.overrides) == 1 for r in study.runs)
    with pytest.raises(GridError, match="'eval_whole: true' sets train.eval_samples itself"):
        load_study(_grid(tmp_path, eval_whole=True,
                         set={"train.steps": 100, "train.micro_batch_size": 4, "train.eval_samples": 5}))
    with pytest.raises(GridError, match="'eval_whole' must be true or false"):
        load_study(_grid(tmp_path, eval_whole="yes"))
    from dept_mega.data.sources import ValidationBatches

    class _Part:
        samples_per_epoch = 37
    vb = ValidationBatches(_Part(), 4, 4, 0, samples=WHOLE_PART)
    assert vb.num_samples == 37 and len(vb) == 10


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
def test_study_end_to_end_on_the_sample_corpus(tmp_path, monkeypatch):
    """Two real runs (STD and GLOB with 2 groups) of a few steps on two sample sources: the
    tool runs them, writes the report, and a second call finds them finished. (The first and
    the --report-only call run the tool's main in this process, from the repository root as the
    tool asks; the second call is the script itself, whose lines are checked: ~2 s of a fresh
    interpreter's imports less for each of the others.)"""
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
    args = ["--grid", str(grid), "--out", str(out), "--parallel", "3"]
    cmd = [sys.executable, str(ROOT / "tools" / "study.py"), *args]
    main = _study_main(monkeypatch)
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
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert res.returncode == 0 and res.stdout.count("finished earlier, skipped") == 2
    assert "[study] plasticity" not in res.stdout  # nothing adapted again
    # a report remade from the finished runs names the command that runs the study
    assert main(args + ["--report-only"]) == 0
    made_by = next(line for line in (out / "results.md").read_text().splitlines() if line.startswith("Made by"))
    assert "--report-only" not in made_by and "--parallel 3" in made_by


def _study_main(monkeypatch):
    """tools/study.py's ``main``, loaded in this process (the path it adds to sys.path is taken
    back after the test)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location("_study_tool", ROOT / "tools" / "study.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _finish(out: str, study, runs=None) -> None:
    """Fake finished runs of ``study`` in ``out``: metrics, the config the trainer writes, the marker."""
    from dept_mega.study.runner import full_command
    for r in runs or study.runs:
        d = run_dir_of(out, r)
        _fake_metrics(d, r.variant, 100, 1.0, 3)
        save_config(run_config(".", r, d), os.path.join(d, "config.yaml"))
        Path(d, MARKER).write_text(json.dumps({"command": full_command(out, r, "python"), "nproc": r.nproc}))


def test_changed_grid_is_refused_not_silently_reused(tmp_path):
    """A run directory made from other settings than the grid now asks for (optim.lr added to
    `set:`) is not reused under the new grid: run_all and tools/study.py refuse, naming the run
    and the key; --rerun-changed moves it to OUT/replaced/ and makes it again."""
    out = str(tmp_path / "out")
    old = load_study(_grid(tmp_path, runs=[{"variant": "std", "name": "std"}, {"variant": "glob", "name": "glob"}]))
    _finish(out, old)
    assert find_stale(old, out) == []
    grid = _grid(tmp_path, runs=[{"variant": "std", "name": "std"}, {"variant": "glob", "name": "glob"}],
                 set={"train.steps": 100, "train.micro_batch_size": 4, "optim.lr": 1.0e-3})
    new = load_study(grid)
    stale = find_stale(new, out)
    assert [(s.name, s.kind, [d[0] for d in s.diffs]) for s in stale] == [("std", "run", ["optim.lr"]),
                                                                        ("glob", "run", ["optim.lr"])]
    assert stale[0].diffs[0][2] == 1.0e-3
    started = []

    def launch(cmd, cwd, env, fh):
        started.append(os.path.basename(next(c for c in cmd if c.startswith("train.run_dir=")).split("=", 1)[1]))
        return _FakeProc(1, threading.Event())  # (never finishes: not waited for below)

    log = open(tmp_path / "log.txt", "w")
    with pytest.raises(StaleRunError, match=r"run std \(.*runs/std\): optim.lr: it has 0.003, the grid asks 0.001"):
        run_all(new, out, 100, launch=launch, log=log)
    assert started == [] and is_finished(out, new.runs[0], 100)
    # the tool says so before anything runs, also for --report-only (exit 2)
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "study.py"), "--grid", grid, "--out", out,
                          "--report-only"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "run glob" in res.stderr and "optim.lr" in res.stderr, res.stderr
    assert "--rerun-changed" in res.stderr and not (Path(out) / "results.md").exists()
    # --rerun-changed (rerun_changed=True): moved aside, made again
    os.makedirs(os.path.join(out, "plasticity", "std"))
    done = threading.Event()
    done.set()

    def launch_ok(cmd, cwd, env, fh):
        name = os.path.basename(next(c for c in cmd if c.startswith("train.run_dir=")).split("=", 1)[1])
        started.append(name)
        _finish(out, new, [r for r in new.runs if r.name == name])
        return _FakeProc(0, done)

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
    study = load_study(_grid(tmp_path, runs=[{"variant": "std", "name": "std"}],
                             plasticity={"source_config": str(heldout), "steps": 2}))
    out = str(tmp_path / "out")
    os.makedirs(os.path.join(out, "logs"))
    _finish(out, study)
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
    longer = load_study(_grid(tmp_path, runs=[{"variant": "std", "name": "std"}],
                              plasticity={"source_config": str(heldout), "steps": 3}))
    with pytest.raises(StaleRunError, match=r"adaptation std \(.*plasticity/std\): steps: it has 2, the grid asks 3"):
        run_plasticity(longer, out, 100, launch=launch, log=log)
    # the held-out config file edited (its batch size): the adaptation's config differs
    heldout.write_text(yaml.safe_dump({"data": {"sources": [{"name": "ja", "prefix": "x/ja", "tokenizer": "x/ja.model"}]},
                                       "train": {"global_batch_size": 8, "micro_batch_size": 4}}))
    assert [d[0] for d in find_stale(study, out)[0].diffs] == ["train.global_batch_size"]
    reps = run_plasticity(longer, out, 100, launch=launch, log=log, rerun_changed=True)
    assert made == [2, 3] and reps["std"]["steps"] == 3 and Path(out, "replaced", "std.1", "plasticity").is_dir()


def test_seeds_make_one_row_with_mean_sd_and_n(tmp_path):
    """Runs that differ only in train.seed are one row: mean ± sd, n; the gain is against the
    best STD row's mean, not the luckiest single STD run."""
    study = load_study(_grid(tmp_path, runs=[
        {"variant": "std", "name": "std_s{train.seed}", "grid": {"train.seed": [1, 2]}},
        {"variant": "std", "name": "std_t1", "set": {"dept.sampling": "temperature", "dept.temperature": 1.0}},
        {"variant": "glob", "grid": {"train.seed": [1, 2, 3]}}]))
    assert [r.seed_label for r in study.runs] == ["std_s*", "std_s*", None, "glob", "glob", "glob"]
    bpb = {"std_s1": 0.90, "std_s2": 1.30, "std_t1": 1.00, "glob_seed=1": 0.95, "glob_seed=2": 1.05,
           "glob_seed=3": 1.00}
    results = {}
    for r in study.runs:
        d = str(tmp_path / r.name)
        _fake_metrics(d, r.variant, 100, bpb[r.name], 3, seed=r.settings.get("train.seed", 1234))
        results[r.name] = read_run(d)
    data = summary(study, results, "cmd")
    rows = {r["label"]: r for r in data["rows"]}
    assert list(rows) == ["std_s*", "std_t1", "glob"] and [r["n"] for r in rows.values()] == [2, 1, 3]
    # std_s1 alone is the best single STD run (0.95 mean), but its row's mean is 1.15: std_t1 (1.05) is the reference
    assert data["best_std"] == "std_t1"
    assert rows["std_s*"]["mean_bpb"] == pytest.approx(1.15) and rows["std_s*"]["mean_bpb_sd"] == pytest.approx(0.2828, abs=1e-4)
    assert rows["glob"]["mean_bpb"] == pytest.approx(1.05) and rows["glob"]["seeds"] == [1, 2, 3]
    assert rows["glob"]["gain_vs_best_std_pct"] == pytest.approx(0.0, abs=1e-9) and rows["glob"]["gain_se_pct"] is None
    md = render_markdown(data)
    assert "| run | n | en | fr | mean | gain vs std_t1 (n=1) |" in md
    assert "| glob | 3 | 1.0000 ± 0.0500 | 1.1000 ± 0.0500 | 1.0500 ± 0.0500 | +0.0 % |" in md
    assert "| std_s* | 2 | 1.1000 ± 0.2828 |" in md
    assert "- glob: glob_seed=1 (seed 1), glob_seed=2 (seed 2), glob_seed=3 (seed 3)" in md
    assert "| glob_seed=2 | glob | 2 | 1.0500 | 1.1500 | 1.1000 | -4.8 % |" in md  # every run, against the row mean
    # with n >= 2 on both sides, the gain has a standard error
    results["std_t1"].by_source["en"]["bpb"] = 9.0  # std_t1 now worst: the reference is std_s* (n=2)
    data = summary(study, results, "cmd")
    glob = next(r for r in data["rows"] if r["label"] == "glob")
    assert data["best_std"] == "std_s*" and glob["gain_vs_best_std_pct"] == pytest.approx((1.15 - 1.05) / 1.15 * 100)
    assert glob["gain_se_pct"] == pytest.approx(math.sqrt(0.05 ** 2 / 3 + 0.2828427 ** 2 / 2) / 1.15 * 100, rel=1e-5)
    assert "gain vs std_s* (n=2)" in render_markdown(data)


def test_names_tell_an_outer_lr_sweep_apart(tmp_path):
    """Outer optimizers that share a name: the short form adds the entries that differ, and a
    template may name an entry of a grid key's mapping ({dept.outer_optimizer.lr})."""
    sweep = [{"name": "nesterov", "lr": 0.7, "momentum": 0.9}, {"name": "nesterov", "lr": 0.5, "momentum": 0.9}]
    study = load_study(_grid(tmp_path, runs=[
        {"variant": "glob", "name": "g_{dept.outer_optimizer}", "grid": {"dept.outer_optimizer": sweep}},
        {"variant": "glob", "grid": {"dept.outer_optimizer": sweep}},
        {"variant": "glob", "name": "lr{dept.outer_optimizer.lr}_m{dept.outer_optimizer.momentum}",
         "grid": {"dept.outer_optimizer": sweep}},
        {"variant": "glob", "grid": {"dept.outer_optimizer": [{"name": "fedavg", "lr": 1.0},
                                                               {"name": "nesterov", "lr": 0.7}]}}]))
    assert [r.name for r in study.runs] == [
        "g_nesterov-lr0.7", "g_nesterov-lr0.5", "glob_outer_optimizer=nesterov-lr0.7",
        "glob_outer_optimizer=nesterov-lr0.5", "lr0.7_m0.9", "lr0.5_m0.9",
        "glob_outer_optimizer=fedavg", "glob_outer_optimizer=nesterov"]  # names alone differ: names alone
    with pytest.raises(GridError, match=r"\{dept.outer_optimizer.beta\} is neither a grid key of this run nor an entry"):
        load_study(_grid(tmp_path, runs=[{"variant": "glob", "name": "g{dept.outer_optimizer.beta}",
                                          "grid": {"dept.outer_optimizer": sweep}}]))


def test_mid_round_evaluations_are_warned_and_marked(tmp_path):
    """eval_interval 50 with dept.local_steps 100: the grid's listing warns (the trainer's own
    warning, schedule_warnings), results.md names the runs and steps, and curves.png draws those
    points apart (unjoined ×), not on the run's line."""
    study = load_study(_grid(tmp_path, runs=[{"variant": "std", "name": "std"},
                                             {"variant": "glob", "grid": {"dept.local_steps": [50, 100]}}],
                             set={"train.steps": 100, "train.micro_batch_size": 4, "train.eval_interval": 50}))
    assert list(study.warnings) == ["glob_local_steps=100"]
    assert "train.eval_interval': 50 is not a multiple of dept.local_steps=100" in study.warnings["glob_local_steps=100"]
    assert "warning: run glob_local_steps=100: config key 'train.eval_interval'" in describe(study)
    results = {}
    for r in study.runs:
        d = str(tmp_path / r.name)
        _fake_metrics(d, r.variant, 100, 1.0, 3, local_steps=100 if r.name.endswith("100") or r.variant == "std" else 50)
        results[r.name] = read_run(d)
    data = summary(study, results, "cmd")
    by = {r["name"]: r for r in data["runs"]}
    assert by["glob_local_steps=100"]["mid_round_eval_steps"] == [50]
    assert by["glob_local_steps=50"]["mid_round_eval_steps"] == [] and by["std"]["mid_round_eval_steps"] == []
    md = render_markdown(data)
    assert "**Warning, run glob_local_steps=100:** config key 'train.eval_interval'" in md
    assert "drawn as unjoined × marks: glob_local_steps=100 steps 50." in md
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    from dept_mega.study import figures
    lines = []
    real_plot = plt.Axes.plot

    def plot(self, xs, ys, *args, **kw):
        lines.append((kw.get("label"), kw.get("linestyle"), kw.get("marker"), list(xs)))
        return real_plot(self, xs, ys, *args, **kw)
    plt.Axes.plot = plot
    try:
        figures.plot(data, str(tmp_path))
    finally:
        plt.Axes.plot = real_plot
    tps = 64
    assert ("glob_local_steps=100", None, "o", [100 * tps]) in lines  # the line: round ends only
    assert ("inside a round (not synchronised)", "none", "x", [50 * tps]) in lines
    assert ("glob_local_steps=50", None, "o", [50 * tps, 100 * tps]) in lines


def test_the_final_evaluation_is_not_a_mid_round_one():
    """train.steps not a multiple of dept.local_steps: the last evaluation follows the last
    round's sync, so it is a round-end point; the ones inside a round are marked."""
    from dept_mega.study.results import RunResult
    r = RunResult(run_dir="r", variant="glob", config={"dept": {"variant": "glob", "local_steps": 50}},
                  by_source={}, eval_step=210, eval_curve=[(50, 2.0), (75, 1.9), (100, 1.8), (210, 1.5)],
                  train_curve=[], tokens_per_step=1, rounds=5, bytes_per_round={}, bytes_total={},
                  params_per_rank={})
    assert r.local_steps == 50 and r.mid_round_eval_steps() == [75]
