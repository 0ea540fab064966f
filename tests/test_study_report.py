"""The study report: per-inner-step costs, tables with seeds' mean ± sd, gains against the best STD,
names, figures, mid-round evaluations."""
import importlib.util
import json
import math
import os

import pytest

from dept_mega.config import save_config
from dept_mega.study.grid import WHOLE_PART, GridError, describe, load_study, run_config
from dept_mega.study.markdown import render_markdown
from dept_mega.study.report import summary
from dept_mega.study.results import read_records, read_run
from dept_mega.study.runner import run_dir_of
from tests.study_utils import ROOT, fake_metrics, study_grid


def test_cost_is_per_inner_step_and_per_run(tmp_path):
    """GLOB at dept.local_steps 5 and 10 sends the same bytes per round, so the round hides the
    ablation: the report counts bytes per inner step and per run (measured from the outer
    records), half as many at 10 local steps; STD's data-parallel equivalent is per inner step
    too, headed so, and bytes.png plots per inner step."""
    results = {}
    for name, variant, L in [("std", "std", 100), ("glob5", "glob", 5), ("glob10", "glob", 10)]:
        d = str(tmp_path / name)
        fake_metrics(d, variant, 100, 1.0, 3, local_steps=L, outer_every=L)
        results[name] = read_run(d)
    study = load_study(study_grid(tmp_path, runs=[{"variant": "std", "name": "std"}] + [
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


@pytest.mark.parametrize("tied", [True, False])
def test_std_equivalent_counts_the_whole_model_not_one_tp_pp_shard(tmp_path, tied):
    """An STD run with tensor 2 × pipeline 2 (and a second data-parallel replica): params.json
    holds each rank's shard; the data-parallel equivalent all-reduces the whole model, the
    count one T = P = 1 rank holds (norms and positions every tensor rank holds counted once,
    a tied table's last-stage copy not at all)."""
    from dept_mega.config import load_config
    from dept_mega.dept.costs import body_split, model_params, padded_vocab, position_params
    from dept_mega.study.results import std_equivalent_bytes_per_step
    cfg = load_config(str(ROOT / "examples" / "tiny" / "std.yaml"),
                      ["parallel.tensor=2", "parallel.pipeline=2", "parallel.data=2",
                       "model.position_embedding=learned", f"model.tie_embeddings={str(tied).lower()}"])
    m, T, vocab = cfg.model, 2, 100
    d = str(tmp_path / "std")
    fake_metrics(d, "std", 100, 1.0, 3)
    save_config(cfg, os.path.join(d, "config.yaml"))
    split, table = body_split(m), padded_vocab(vocab) * m.hidden_size
    ranks = []
    for dp in (0, 1):
        for pp in (0, 1):
            for tp in (0, 1):  # each stage holds half the body: its share of the split rows + all its norms
                emb = table // T + position_params(m) if pp == 0 else table // T
                ranks.append({"rank": len(ranks), "group": 0, "dp": dp, "pp": pp, "tp": tp,
                              "body": split.sharded // (2 * T) + split.replicated // 2, "embeddings": emb})
    assert sum(rk["body"] for rk in ranks if rk["dp"] == 0) == split.sharded + T * split.replicated
    with open(os.path.join(d, "params.json"), "w") as f:
        json.dump({"ranks": ranks}, f)
    r = read_run(d)
    assert r.model_params == model_params(m, vocab, padded=True)
    assert std_equivalent_bytes_per_step(r, 3) == 3 * model_params(m, vocab, padded=True) * 4


def test_report_tables_gain_and_figures(tmp_path):
    pytest.importorskip("matplotlib")
    from dept_mega.study.figures import plot
    study = load_study(study_grid(tmp_path))
    out = tmp_path / "out"
    results = {}
    for i, r in enumerate(study.runs):
        d = run_dir_of(str(out), r)
        bpb = {"std": 1.0 + 0.5 * i}.get(r.variant, 0.9)
        # STD keeps examples/tiny/std.yaml's dept.local_steps (100), which means nothing for it
        fake_metrics(d, r.variant, 100, bpb, 3, local_steps=100 if r.variant == "std" else 50)
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
        return load_study(study_grid(tmp_path, runs=[{"variant": "std", "name": f"std{i}", "set": s}
                                                for i, s in enumerate(sets)]))
    ablation = grid([{"model.num_layers": 2}, {"model.num_layers": 1}])
    assert ablation.model_differs_in == ["model.num_layers"]
    assert ablation.body_flops["std0"] == 2 * ablation.body_flops["std1"] > 0
    assert "warning: equal tokens and steps; NOT equal compute: runs differ in model.num_layers" in describe(ablation)
    results = {}
    for r in ablation.runs:
        fake_metrics(str(tmp_path / r.name), "std", 100, 1.0, 3)
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
    study = load_study(study_grid(tmp_path, runs=[{"variant": "std", "name": "std"}, {"variant": "glob", "name": "glob"},
                                             {"variant": "spec_opt", "name": "spec_opt"}]))
    results = {}
    for r in study.runs:
        d = str(tmp_path / r.name)
        fake_metrics(d, r.variant, 100, 1.0 if r.variant == "std" else 0.9, 3,
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


def test_a_source_the_reference_did_not_evaluate_is_named_with_the_means(tmp_path):
    """A GLOB run that also evaluates ja (its grid entry kept the base config's sources), which
    STD did not: its gain is left out, the note says why (ja, not evaluated by std), and that
    the mean column averages each row's own sources."""
    study = load_study(study_grid(tmp_path, runs=[{"variant": "std", "name": "std"},
                                                  {"variant": "glob", "name": "glob"}]))
    results = {}
    for r in study.runs:
        d = str(tmp_path / r.name)
        fake_metrics(d, r.variant, 100, 1.0, 3)  # en 1.0, fr 1.1
        results[r.name] = read_run(d)
    results["glob"].by_source["ja"] = {"loss": 1, "ppl": 2, "bpb": 0.4, "tokens": 10, "bytes": 30}
    data = summary(study, results, "cmd")
    assert [(d["source"], d["missing"]) for d in data["eval_text_differs"]] == [("ja", ["std"])]
    glob = next(r for r in data["rows"] if r["label"] == "glob")
    assert glob["gain_vs_best_std_pct"] is None and glob["eval_sources_missing"] == ["ja"]
    md = render_markdown(data)
    assert "| glob | 1 | 1.0000 | 1.1000 | 0.4000 | 0.8333 | – |" in md
    assert "ja: glob 30 bytes; not evaluated by std." in md
    assert ("glob did not evaluate the same sources as the reference (std) (evaluated by only one of the two — "
            "glob: ja), so their gain is left out (–)") in md
    assert "The mean column averages each row's own sources: std: en, fr; glob: en, fr, ja." in md


def test_eval_whole_reads_every_part_whole(tmp_path):
    """``eval_whole: true`` sets train.eval_samples above any part's size for every run (the
    evaluation reads min(eval_samples, the part's samples)); a grid that also sets it is refused."""
    study = load_study(study_grid(tmp_path, eval_whole=True))
    assert study.eval_whole and "every run reads every validation part whole (eval_whole: true)" in describe(study)
    assert all(run_config(".", r, "x").train.eval_samples == WHOLE_PART for r in study.runs)
    assert all(sum(o.startswith("train.eval_samples=") for o in r.overrides) == 1 for r in study.runs)
    with pytest.raises(GridError, match="'eval_whole: true' sets train.eval_samples itself"):
        load_study(study_grid(tmp_path, eval_whole=True,
                         set={"train.steps": 100, "train.micro_batch_size": 4, "train.eval_samples": 5}))
    with pytest.raises(GridError, match="'eval_whole' must be true or false"):
        load_study(study_grid(tmp_path, eval_whole="yes"))
    from dept_mega.data.sources import ValidationBatches

    class _Part:
        samples_per_epoch = 37
    vb = ValidationBatches(_Part(), 4, 4, 0, samples=WHOLE_PART)
    assert vb.num_samples == 37 and len(vb) == 10


def test_read_records_rejects_a_broken_line(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"kind": "train", "step": 1}\n{not json\n')
    with pytest.raises(Exception, match=r"m.jsonl:2: not JSON"):
        read_records(str(p))


def test_seeds_make_one_row_with_mean_sd_and_n(tmp_path):
    """Runs that differ only in train.seed are one row: mean ± sd, n; the gain is against the
    best STD row's mean, not the luckiest single STD run."""
    study = load_study(study_grid(tmp_path, runs=[
        {"variant": "std", "name": "std_s{train.seed}", "grid": {"train.seed": [1, 2]}},
        {"variant": "std", "name": "std_t1", "set": {"dept.sampling": "temperature", "dept.temperature": 1.0}},
        {"variant": "glob", "grid": {"train.seed": [1, 2, 3]}}]))
    assert [r.seed_label for r in study.runs] == ["std_s*", "std_s*", None, "glob", "glob", "glob"]
    bpb = {"std_s1": 0.90, "std_s2": 1.30, "std_t1": 1.00, "glob_seed=1": 0.95, "glob_seed=2": 1.05,
           "glob_seed=3": 1.00}
    results = {}
    for r in study.runs:
        d = str(tmp_path / r.name)
        fake_metrics(d, r.variant, 100, bpb[r.name], 3, seed=r.settings.get("train.seed", 1234))
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
    study = load_study(study_grid(tmp_path, runs=[
        {"variant": "glob", "name": "g_{dept.outer_optimizer}", "grid": {"dept.outer_optimizer": sweep}},
        {"variant": "glob", "grid": {"dept.outer_optimizer": sweep}, "set": {"train.seed": 2}},  # (not one run twice)
        {"variant": "glob", "name": "lr{dept.outer_optimizer.lr}_m{dept.outer_optimizer.momentum}",
         "grid": {"dept.outer_optimizer": sweep}, "set": {"train.seed": 3}},
        {"variant": "glob", "grid": {"dept.outer_optimizer": [{"name": "fedavg", "lr": 1.0},
                                                               {"name": "nesterov", "lr": 0.7}]}}]))
    assert [r.name for r in study.runs] == [
        "g_nesterov-lr0.7", "g_nesterov-lr0.5", "glob_outer_optimizer=nesterov-lr0.7",
        "glob_outer_optimizer=nesterov-lr0.5", "lr0.7_m0.9", "lr0.5_m0.9",
        "glob_outer_optimizer=fedavg", "glob_outer_optimizer=nesterov"]  # names alone differ: names alone
    with pytest.raises(GridError, match=r"\{dept.outer_optimizer.beta\} is neither a grid key of this run nor an entry"):
        load_study(study_grid(tmp_path, runs=[{"variant": "glob", "name": "g{dept.outer_optimizer.beta}",
                                          "grid": {"dept.outer_optimizer": sweep}}]))


def test_mid_round_checkpoints_are_warned_in_the_listing_only(tmp_path):
    """save_interval 50 with dept.local_steps 100: the grid's listing warns (the trainer's own
    warning, schedule_warnings); the results, which such checkpoints do not change, do not."""
    study = load_study(study_grid(tmp_path, runs=[{"variant": "std", "name": "std"},
                                                  {"variant": "glob", "grid": {"dept.local_steps": [50, 100]}}],
                                  set={"train.steps": 100, "train.micro_batch_size": 4, "train.eval_interval": 100,
                                       "train.save_interval": 50}))
    assert study.warnings == {} and list(study.checkpoint_warnings) == ["glob_local_steps=100"]
    assert "warning: run glob_local_steps=100: config key 'train.save_interval': 50 is not a multiple of " \
           "dept.local_steps=100" in describe(study)
    results = {}
    for r in study.runs:
        fake_metrics(str(tmp_path / r.name), r.variant, 100, 1.0, 3)
        results[r.name] = read_run(str(tmp_path / r.name))
    assert summary(study, results, "cmd")["schedule_warnings"] == {}


def test_mid_round_evaluations_are_warned_and_marked(tmp_path):
    """eval_interval 50 with dept.local_steps 100: the grid's listing warns (the trainer's own
    warning, schedule_warnings), results.md names the runs and steps, and curves.png draws those
    points apart (unjoined ×), not on the run's line."""
    study = load_study(study_grid(tmp_path, runs=[{"variant": "std", "name": "std"},
                                             {"variant": "glob", "grid": {"dept.local_steps": [50, 100]}}],
                             set={"train.steps": 100, "train.micro_batch_size": 4, "train.eval_interval": 50}))
    assert list(study.warnings) == ["glob_local_steps=100"]
    assert "train.eval_interval': 50 is not a multiple of dept.local_steps=100" in study.warnings["glob_local_steps=100"]
    assert "warning: run glob_local_steps=100: config key 'train.eval_interval'" in describe(study)
    results = {}
    for r in study.runs:
        d = str(tmp_path / r.name)
        fake_metrics(d, r.variant, 100, 1.0, 3, local_steps=100 if r.name.endswith("100") or r.variant == "std" else 50)
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

