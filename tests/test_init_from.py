"""train.init_from: a fresh run takes another run's model weights (any layout) and nothing else;
a run with a checkpoint of its own resumes from it; another model is refused by key."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from dept_mega.config import ConfigError, load_config
from tests.mp_utils import run_distributed
from tests.trainer_utils import read_jsonl


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A 2-step STD run of one process (checkpoint at step 2): (its config, its run dir)."""
    from tests.test_train_cli import _setup, _train_here
    tmp = tmp_path_factory.mktemp("src")
    cfg = _setup(tmp, variant="std")
    run = str(tmp / "run")
    r = _train_here("--config", cfg, "train.steps=2", "train.eval_interval=0", "train.eval_iters=0",
                    "train.save_interval=0", f"train.run_dir={run}")
    assert r.returncode == 0, r.stderr
    return cfg, run


def _loaded_vs_saved(cfg_path: str, src_run: str, overrides: list[str]) -> dict:
    """Build a fresh trainer for the config with ``overrides`` in this process's layout, apply
    train.init_from, and compare every parameter box with the checkpoint's full tensor."""
    from dept_mega.checkpoint_format import read_full
    from dept_mega.checkpoint_state import model_entries
    from dept_mega.init_from import init_from
    from dept_mega.parallel.groups import build_groups
    from dept_mega.run_inputs import vocab_size_of
    from dept_mega.trainer import Trainer
    cfg = load_config(cfg_path, [f"train.init_from={src_run}", *overrides])
    p = cfg.parallel
    pg = build_groups(p.tensor, p.data, p.pipeline)
    torch.manual_seed(123)
    trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=vocab_size_of(cfg))
    before = [e.tensor.clone() for e in model_entries(trainer, optimizer=False)]
    path = init_from(trainer, cfg, torch.device("cpu"))
    entries = model_entries(trainer, optimizer=False)
    full = read_full(path, sorted({e.key for e in entries}))
    equal, changed = [], 0
    for e, b in zip(entries, before):
        want = full[e.key]
        for dim, (off, n) in enumerate(zip(e.offset, e.tensor.shape)):
            want = want.narrow(dim, off, n)
        equal.append(torch.equal(e.tensor, want))
        changed += int(not torch.equal(b, e.tensor))
    masters_agree = all(torch.equal(getattr(p, "main_param", p).float(), p.float()) for p in trainer.body_parameters())
    opt_state = sum(len(opt.inner.state) for opt in trainer.optimizers)
    return {"path": path, "equal": equal, "changed": changed, "n": len(entries), "step": trainer.step,
            "consumed": trainer.consumed_samples, "optimizer_state": opt_state, "masters": masters_agree,
            "boxes": [(e.key, e.offset) for e in entries]}


def _worker(rank, world, cfg_path, src_run, overrides):
    return _loaded_vs_saved(cfg_path, src_run, overrides)


def test_weights_load_in_another_layout_and_nothing_else(source):
    cfg_path, src_run = source
    one = _loaded_vs_saved(cfg_path, src_run, [])
    assert one["path"] == os.path.join(src_run, "checkpoints", "step_2")
    assert all(one["equal"]) and one["changed"] == one["n"] > 0
    assert (one["step"], one["consumed"], one["optimizer_state"], one["masters"]) == (0, 0, 0, True)
    for overrides in (["parallel.tensor=2"], ["parallel.data=2", "optim.distributed=true"]):
        ranks = run_distributed(_worker, 2, args=(cfg_path, os.path.join(src_run, "checkpoints", "step_2"),
                                                  overrides))
        for r in ranks:
            assert all(r["equal"]), (overrides, r["equal"])
            assert (r["step"], r["consumed"], r["optimizer_state"], r["masters"]) == (0, 0, 0, True)
        if overrides == ["parallel.tensor=2"]:  # the two ranks read different halves
            assert ranks[0]["boxes"] != ranks[1]["boxes"]


def test_another_model_is_refused_naming_the_keys(source, tmp_path):
    from dept_mega.init_from import check_source, source_checkpoint
    cfg_path, src_run = source
    path = source_checkpoint(src_run)
    cfg = load_config(cfg_path, ["model.hidden_size=64", "model.activation=swiglu"])
    with pytest.raises(ConfigError) as exc:
        check_source(cfg, path)
    msg = str(exc.value)
    assert msg.startswith(f"2 config keys differ from checkpoint {path}; train.init_from needs a checkpoint of the "
                          "same model:\n") and "config key 'model.hidden_size': the checkpoint has 32, this launch " \
        "has 64" in msg and "config key 'model.activation'" in msg, msg
    cfg = load_config(cfg_path, ["data.tokenizer=null", "model.vocab_size=120"])
    with pytest.raises(ConfigError, match=r"config key 'data.tokenizer'.*: the checkpoint was trained with '.*tiny"):
        check_source(cfg, path)
    with pytest.raises(ConfigError, match="config key 'train.init_from': .* holds no checkpoint"):
        source_checkpoint(str(tmp_path))
    with pytest.raises(ConfigError, match="config key 'train.init_from': .* is not a directory"):
        source_checkpoint(str(tmp_path / "nothing"))
    with pytest.raises(ConfigError, match="config key 'train.init_from': .*step_7' is not a directory"):
        source_checkpoint(os.path.join(src_run, "checkpoints", "step_7"))
    damaged = tmp_path / "damaged" / "checkpoints" / "step_2"
    shutil.copytree(path, damaged)
    os.remove(damaged / "depends.json")
    with pytest.raises(ConfigError, match="config key 'train.init_from': checkpoint .*step_2 is not usable"):
        source_checkpoint(str(damaged))
    with pytest.raises(ConfigError, match="config key 'dept.variant': the checkpoint has 'std', this launch has "
                                          "'spec_opt'; a spec_opt run starts from a spec_opt checkpoint"):
        check_source(load_config(cfg_path, ["dept.variant=spec_opt"]), path)


def test_a_fresh_run_starts_from_the_weights_and_a_relaunch_resumes_itself(source, tmp_path):
    """Through dept_mega.train: step 1 onwards with fresh counters; its first loss is the
    source's model's (well below a fresh model's); a relaunch with a longer run resumes from
    the run's own checkpoint and says that init_from was not used."""
    from tests.test_train_cli import _train_here
    cfg_path, src_run = source
    common = ["train.eval_interval=0", "train.eval_iters=0", "train.save_interval=0", "train.log_interval=1"]
    fresh = str(tmp_path / "fresh")
    assert _train_here("--config", cfg_path, *common, "train.steps=1", f"train.run_dir={fresh}").returncode == 0
    run = str(tmp_path / "run")
    r = _train_here("--config", cfg_path, *common, "train.steps=1", f"train.run_dir={run}",
                    f"train.init_from={src_run}")
    assert r.returncode == 0, r.stderr
    assert f"model weights from {src_run}/checkpoints/step_2 (train.init_from)" in r.stdout
    recs = [x for x in read_jsonl(os.path.join(run, "metrics.jsonl")) if x["kind"] == "train"]
    base = [x for x in read_jsonl(os.path.join(fresh, "metrics.jsonl")) if x["kind"] == "train"]
    src = [x for x in read_jsonl(os.path.join(src_run, "metrics.jsonl")) if x["kind"] == "train"]
    assert [x["step"] for x in recs] == [1] and recs[0]["consumed_samples"] == 4
    assert recs[0]["loss"] < base[0]["loss"] and recs[0]["loss"] != src[0]["loss"]
    r = _train_here("--config", cfg_path, *common, "train.steps=2", f"train.run_dir={run}",
                    f"train.init_from={src_run}")
    assert r.returncode == 0, r.stderr
    assert f"resumed from {run}/checkpoints/step_1 (train.init_from={src_run} not used" in r.stdout
    assert "model weights from" not in r.stdout
    # another model: one error line naming the key, exit status 2, before any step
    other = str(tmp_path / "other")
    r = _train_here("--config", cfg_path, *common, "train.steps=1", f"train.run_dir={other}",
                    f"train.init_from={src_run}", "model.ffn_hidden_size=96")
    assert r.returncode == 2 and "config key 'model.ffn_hidden_size' differs from checkpoint " in r.stderr \
        and ": the checkpoint has 64, this launch has 96; train.init_from needs" in r.stderr, r.stderr
    assert not os.path.exists(os.path.join(other, "config.yaml"))  # written only once a launch is accepted
