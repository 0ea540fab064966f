"""dept_mega.adapt: a trained body with fresh embeddings for a new source (plasticity)."""
import json
import os
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "examples" / "data" / "build"


def _tiny_run_config(tmp_path, variant: str) -> str:
    """A tiny run on two sample sources (en, fr) with the global tokenizer."""
    cfg = yaml.safe_load((ROOT / "examples" / "tiny" / f"{variant}.yaml").read_text())
    cfg["data"]["sources"] = cfg["data"]["sources"][:2]
    cfg["model"].update({"hidden_size": 32, "ffn_hidden_size": 64, "seq_length": 32})
    cfg["train"].update({"steps": 4, "micro_batch_size": 2, "global_batch_size": 4, "eval_iters": 2,
                         "eval_interval": 0, "save_interval": 2, "log_interval": 1,
                         "run_dir": str(tmp_path / "run")})
    cfg["dept"]["local_steps"] = 2
    path = tmp_path / f"{variant}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _held_out(tmp_path, **train) -> str:
    """The held-out source: Japanese with its own tokenizer (a vocabulary the run never had)."""
    new = {"data": {"sources": [{"name": "ja", "prefix": str(BUILD / "ja_own_text_document"),
                                 "tokenizer": str(BUILD / "tok" / "ja.model")}]},
           "optim": {"lr": 3.0e-3, "warmup_steps": 1},
           "train": {"eval_iters": 2, "global_batch_size": 4, "micro_batch_size": 2, **train}}
    path = tmp_path / "new.yaml"
    path.write_text(yaml.safe_dump(new))
    return str(path)


def _bodies(run_dir: str, step: int, source=None) -> dict[str, torch.Tensor]:
    from dept_mega.export.checkpoint_reader import read_full_weights
    return {k: v for k, v in read_full_weights(run_dir, step, source).items() if k.startswith("body.")}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from tests.trainer_utils import ensure_sample_corpus
    ensure_sample_corpus()
    tmp = tmp_path_factory.mktemp("adapt")
    cfg = _tiny_run_config(tmp, "glob")
    # dept_mega.train's main on 2 ranks forked with torchrun's environment (tests/mp_utils.py):
    # the run is what is adapted here; a torchrun launch would add its and the ranks' start-up
    from tests.federation_utils import run_single_job
    run_single_job(cfg, str(tmp / "run"), 2)
    return tmp


@pytest.mark.slow
def test_frozen_body_fresh_embeddings_and_random_reference(trained, tmp_path, capsys):
    from dept_mega.adapt import main
    run_dir = str(trained / "run")
    out = tmp_path / "out"
    assert main(["--run-dir", run_dir, "--source-config", _held_out(tmp_path), "--steps", "3",
                 "--out", str(out)]) == 0
    report = json.loads((out / "adapt.json").read_text())
    assert report["step"] == 4 and report["body"] == "frozen" and report["sources"] == ["ja"]
    for arm in ("trained", "random"):
        assert set(report[arm]) == {"ja"} and report[arm]["ja"]["bpb"] > 0
        metrics = [json.loads(line) for line in (out / arm / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in metrics if r["kind"] == "train"] == [1, 2, 3]
    assert report["gain_pct"] == pytest.approx((report["random_bpb"] - report["bpb"]) / report["random_bpb"] * 100)
    # the frozen body is the run's, bit for bit; the embeddings are the new tokenizer's
    adapted = _bodies(str(out / "trained"), 3)
    original = _bodies(run_dir, 4, "en")
    assert adapted.keys() == original.keys() and all(torch.equal(adapted[k], original[k]) for k in adapted)
    from dept_mega.data.tokenizer import load_tokenizer
    from dept_mega.export.checkpoint_reader import read_full_weights
    table = read_full_weights(str(out / "trained"), 3)["embeddings.word_embeddings.weight"]
    assert table.shape[0] >= load_tokenizer(str(BUILD / "tok" / "ja.model")).vocab_size
    said = capsys.readouterr().out
    assert "frozen" in said
    # the launch lines say what is trained, not the std config the arms run under
    assert f"dept_mega adapt: new source ja on the body of {run_dir} (glob) | world 1" in said, said
    assert "dept_mega adapt: new source ja on a randomly initialised body (the reference) | world 1" in said
    assert "dept_mega: std" not in said


@pytest.mark.slow
def test_trainable_body_with_its_own_lr(trained, tmp_path):
    from dept_mega.adapt import main
    run_dir = str(trained / "run")
    out = tmp_path / "out"
    assert main(["--run-dir", run_dir, "--source-config", _held_out(tmp_path), "--steps", "2", "--out", str(out),
                 "--body", "trainable", "--body-lr", "1e-4", "--no-random-baseline"]) == 0
    report = json.loads((out / "adapt.json").read_text())
    assert report["random"] is None and report["body_lr"] == 1e-4
    moved = _bodies(str(out / "trained"), 2)
    original = _bodies(run_dir, 4, "en")
    assert any(not torch.equal(moved[k], original[k]) for k in moved)
    # a small body LR moves the body little: every tensor stays close to the trained one
    assert all((moved[k] - original[k]).abs().max() < 5e-3 for k in moved)


def test_errors_name_the_problem(tmp_path, capsys):
    from dept_mega.adapt import main
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"dept": {"variant": "glob"}}))
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"model": {"hidden_size": 8}, "data": {"sources": [{"name": "x"}]}}))
    args = ["--run-dir", str(run), "--steps", "2", "--out", str(tmp_path / "o")]
    assert main([*args, "--source-config", str(bad)]) == 2
    assert "config key 'model'" in capsys.readouterr().err
    bad.write_text(yaml.safe_dump({"train": {"steps": 9}, "data": {"sources": [{"name": "x"}]}}))
    assert main([*args, "--source-config", str(bad)]) == 2
    assert "config key 'train.steps'" in capsys.readouterr().err
    assert main([*args, "--source-config", str(bad), "--body-lr", "0.1"]) == 2
    assert "--body-lr needs --body trainable" in capsys.readouterr().err
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "x").write_text("")
    bad.write_text(yaml.safe_dump({"data": {"sources": [{"name": "x"}]}}))
    assert main([*args, "--source-config", str(bad)]) == 2
    assert "is not empty" in capsys.readouterr().err


def test_a_missing_file_of_the_source_config_is_named_by_its_key_there(tmp_path, capsys, monkeypatch):
    """Checked before the source's tokenizer becomes the adaptation's data.tokenizer: the error
    names data.sources[i].tokenizer in NEW.yaml, not the merged config's data.tokenizer."""
    from dept_mega.adapt import main
    from tests.data_utils import write_docs
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text((ROOT / "examples" / "tiny" / "glob.yaml").read_text())
    prefix = write_docs(str(tmp_path / "ja_text_document"), [[3, 4, 5]] * 4)
    new = tmp_path / "new.yaml"
    args = ["--run-dir", str(run), "--steps", "2", "--out", str(tmp_path / "o"), "--source-config", str(new)]
    gone = str(tmp_path / "gone.model")
    new.write_text(yaml.safe_dump({"data": {"sources": [{"name": "ja", "prefix": prefix, "tokenizer": gone}]}}))
    assert main(args) == 2
    assert capsys.readouterr().err == (f"error: config key 'data.sources[0].tokenizer' in {new}: file {gone!r} "
                                       f"does not exist\n")
    monkeypatch.chdir(tmp_path)  # a relative path: read from here, and said so
    new.write_text(yaml.safe_dump({"data": {"sources": [{"name": "ja", "prefix": "ja_text_document"},
                                                        {"name": "ko", "prefix": "ko_text_document"}]}}))
    assert main(args) == 2
    assert capsys.readouterr().err == (f"error: config key 'data.sources[1].prefix' in {new}: file "
                                       f"'ko_text_document.bin' does not exist (relative to the current directory "
                                       f"{os.getcwd()})\n")


@pytest.mark.slow
def test_a_step_inside_a_round_needs_a_group(trained, tmp_path):
    """Inside a round the groups hold different bodies: a mid-round step needs --group."""
    import shutil
    from dept_mega.checkpoint import load_body
    from dept_mega.config import ConfigError, load_config
    from dept_mega.manifest import seal
    from dept_mega.model import build_model
    from dept_mega.parallel.groups import build_groups
    run = tmp_path / "run"
    shutil.copytree(trained / "run", run)
    cfg = load_config(str(run / "config.yaml"), ["dept.variant=std"])
    pg = build_groups()
    stages = build_model(cfg, pg, 8000, 1)
    step = run / "checkpoints" / "step_4"
    dep = json.loads((step / "depends.json").read_text())
    dep["config"]["dept.local_steps"] = 3  # as if the run's rounds were 3 steps long: step 4 is mid-round
    (step / "depends.json").write_text(json.dumps(dep))
    seal(str(step), 4)
    with pytest.raises(ConfigError, match="inside a round.*--group"):
        load_body(stages, cfg, pg, str(run), 4)
    assert load_body(stages, cfg, pg, str(run), 4, group=1) == 1
    with pytest.raises(ConfigError, match="no group 2"):
        load_body(stages, cfg, pg, str(run), 4, group=2)
    # a model of another shape: every differing body key, with both values
    other = load_config(str(run / "config.yaml"), ["dept.variant=std", "model.num_layers=3", "model.activation=swiglu"])
    with pytest.raises(ConfigError) as info:
        load_body(build_model(other, pg, 8000, 1), other, pg, str(run), 4, group=1)
    head, *rows = str(info.value).split("\n")
    assert head.startswith("2 config keys differ from the body in checkpoint "), head
    assert any("'model.num_layers': the checkpoint has 2, this launch has 3" in r for r in rows), rows
    assert any("'model.activation'" in r and "'swiglu'" in r for r in rows), rows


def test_dept_only_keys_of_the_run_do_not_reach_the_adaptation(tmp_path):
    """The adaptation is one source group without rounds: keys that only DEPT variants take
    (some refuse std) are dropped, whatever the run used — and a federated group job's
    federation keys (the adaptation joins no lighthouse)."""
    from dept_mega.adapt import adapt_config
    from dept_mega.dept.federation_config import resolve
    run = yaml.safe_load((ROOT / "examples" / "tiny" / "glob.yaml").read_text())
    run["dept"].update({"embedding_rows": "present", "body_optimizer_state": "source"})
    run["federation"] = {"lighthouse": "lh-host:29510", "group": 1, "groups": 3, "min_groups": 2}
    new = {"data": {"sources": [{"name": "ja", "prefix": str(BUILD / "ja_global_text_document")}]}}
    cfg = adapt_config(run, new, "new.yaml", steps=3, run_dir=str(tmp_path / "a"), world=1)
    assert cfg.dept.variant == "std" and cfg.dept.embedding_rows == "all"
    assert cfg.dept.body_optimizer_state == "group"
    assert cfg.federation.lighthouse is None and resolve(cfg) is None


def test_the_adaptations_eval_iters_wins_over_the_runs_eval_samples(tmp_path):
    """A study run's config sets train.eval_samples; an adaptation config asking for eval_iters
    evaluates that many global batches (the run's eval_samples dropped), and may set its own."""
    from dept_mega.adapt import adapt_config
    run = yaml.safe_load((ROOT / "examples" / "tiny" / "spec.yaml").read_text())
    run["train"]["eval_samples"] = 48
    src = {"sources": [{"name": "ja", "prefix": str(BUILD / "ja_global_text_document")}]}
    kept = adapt_config(run, {"data": src}, "new.yaml", steps=3, run_dir=str(tmp_path / "a"), world=1)
    assert kept.train.eval_sequences() == 48
    iters = adapt_config(run, {"data": src, "train": {"eval_iters": 2, "global_batch_size": 8}}, "new.yaml", steps=3,
                         run_dir=str(tmp_path / "b"), world=1)
    assert iters.train.eval_samples is None and iters.train.eval_sequences() == 16
    own = adapt_config(run, {"data": src, "train": {"eval_iters": 2, "eval_samples": 5}}, "new.yaml", steps=3,
                       run_dir=str(tmp_path / "c"), world=1)
    assert own.train.eval_sequences() == 5


def test_the_adaptation_may_run_on_another_device_than_the_run(tmp_path):
    """A cluster run's config says train.device: cuda; its adaptation may say cpu (or auto), e.g.
    on a machine without a GPU: train.device is one of the keys NEW.yaml may set."""
    from dept_mega.adapt import adapt_config
    run = yaml.safe_load((ROOT / "examples" / "tiny" / "spec.yaml").read_text())
    run["train"]["device"] = "cuda"
    src = {"sources": [{"name": "ja", "prefix": str(BUILD / "ja_global_text_document")}]}
    assert adapt_config(run, {"data": src}, "new.yaml", steps=3, run_dir=str(tmp_path / "a"),
                        world=1).train.device == "cuda"
    cfg = adapt_config(run, {"data": src, "train": {"device": "cpu"}}, "new.yaml", steps=3,
                       run_dir=str(tmp_path / "b"), world=1)
    assert cfg.train.device == "cpu"
