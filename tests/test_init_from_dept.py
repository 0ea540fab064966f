"""train.init_from under the DEPT variants: the body (and GLOB's table) at a round boundary,
SPEC-OPT's tables by source name, the outer state fresh with θ_{t-1} at the loaded weights;
a source the checkpoint lacks is refused unless train.init_from_new_sources: fresh."""
from __future__ import annotations

import os

import pytest
import torch
import yaml

from dept_mega.config import ConfigError, load_config
from tests.mp_utils import run_distributed


def _source_run(tmp, variant: str, steps: int = 4) -> tuple[str, str]:
    """A DEPT run of one process (one group; local_steps 2): (its config, its run dir)."""
    from tests.test_train_cli import _setup, _train_here
    cfg = _setup(tmp, variant=variant)
    if variant == "spec_opt":  # each source names its tokenizer (the tiny one)
        d = yaml.safe_load(open(cfg))
        for s in d["data"]["sources"]:
            s["tokenizer"] = d["data"]["tokenizer"]
        with open(cfg, "w") as f:
            yaml.safe_dump(d, f)
    run = str(tmp / "run")
    r = _train_here("--config", cfg, f"train.steps={steps}", "train.eval_interval=0", "train.eval_iters=0",
                    "train.save_interval=0", f"train.run_dir={run}")
    assert r.returncode == 0, r.stderr
    return cfg, run


@pytest.fixture(scope="module")
def glob_source(tmp_path_factory):
    return _source_run(tmp_path_factory.mktemp("glob"), "glob")


@pytest.fixture(scope="module")
def spec_opt_source(tmp_path_factory):
    return _source_run(tmp_path_factory.mktemp("specopt"), "spec_opt")


def _narrow(full: torch.Tensor, e) -> torch.Tensor:
    for dim, (off, n) in enumerate(zip(e.offset, e.tensor.shape)):
        full = full.narrow(dim, off, n)
    return full


def _loaded(cfg_path: str, src: str, overrides: list[str], run_dir: str) -> dict:
    """A fresh session of the config (this process's layout) after init_from: the loaded boxes
    against the checkpoint's, the outer state, and (SPEC-OPT) each source's first tables."""
    from dept_mega.checkpoint_format import entries_of, param_key, read_full
    from dept_mega.dept.hook_state import _emb_params
    from dept_mega.dept.store import SourceState
    from dept_mega.init_from import init_from
    from dept_mega.init_from_dept import held_sources, weight_entries
    from dept_mega.init_from_trim import saved_variant
    from dept_mega.train import build_session
    cfg = load_config(cfg_path, [f"train.init_from={src}", f"train.run_dir={run_dir}", *overrides])
    session = build_session(cfg, metrics=False)
    tr, hooks = session.trainer, session.loop.hooks
    path = init_from(tr, cfg, session.device, hooks)
    per_source = cfg.dept.variant == "spec_opt"
    entries = weight_entries(tr, path, cfg.dept.variant, saved_variant(path))
    full = read_full(path, sorted({e.key for e in entries}))
    out = {"groups": tr.pg.num_groups, "step": tr.step, "n": len(entries),
           "embeddings": sum("/embeddings." in e.key for e in entries),
           "equal": all(torch.equal(e.tensor, _narrow(full[e.key], e)) for e in entries)}
    syncs = getattr(hooks, "checkpoint_syncs", dict)().values()
    out["reference"] = all(torch.equal(s.theta_prev, s._read_chunk().to(s.theta_prev.device)) for s in syncs)
    out["outer_state_zero"] = all(not torch.is_tensor(v) or not v.any() for s in syncs
                                  for v in s.optimizer.state.values())
    out["inner_state"] = sum(len(opt.inner.state) for opt in tr.optimizers)
    if per_source:
        held, tables = held_sources(path), {}
        for s in hooks.sources:
            embs = hooks.strategy.initial(s.name)  # what the first installation / evaluation starts from
            pairs = [(e, p) for n, p in _emb_params(SourceState(embs))
                     for e in entries_of(held[s.name](param_key(n, None)) if s.name in held else "-", p.data, p,
                                         tr.pg.tp_rank, tr.pg.tp_size)]
            if s.name in held:
                want = read_full(path, sorted({e.key for e, _ in pairs}))
                tables[s.name] = all(torch.equal(e.tensor, _narrow(want[e.key], e)) for e, _ in pairs)
            else:  # fresh: the seeded table of a new run
                tables[s.name] = all(torch.equal(a, b) for a, b in zip(
                    [p for _, p in _emb_params(SourceState(embs))],
                    [p for _, p in _emb_params(SourceState(hooks.strategy.build(s.name)))]))
        out["tables"] = tables
        out["held"] = sorted(held)
    return out


def _worker(rank, world, cfg_path, src, overrides, run_dir):
    return _loaded(cfg_path, src, overrides, f"{run_dir}/{rank}")


def test_glob_body_and_table_in_two_groups(glob_source, tmp_path):
    """A one-group GLOB checkpoint into two groups (2 processes): every group starts from the
    checkpoint's body and global table; outer θ_{t-1} = those weights, outer and inner state fresh."""
    cfg_path, src_run = glob_source
    ranks = run_distributed(_worker, 2, args=(cfg_path, src_run, [], str(tmp_path)))
    for r in ranks:
        assert r["groups"] == 2 and r["step"] == 0 and r["embeddings"] > 0 and r["n"] > r["embeddings"]
        assert r["equal"] and r["reference"] and r["outer_state_zero"] and r["inner_state"] == 0, r


def test_std_and_glob_checkpoints_start_each_other(glob_source, tmp_path):
    from dept_mega.init_from import check_source, source_checkpoint
    cfg_path, src_run = glob_source
    path = source_checkpoint(src_run)
    check_source(load_config(cfg_path, ["dept.variant=std"]), path)  # the same tensors: accepted
    r = _loaded(cfg_path, src_run, ["dept.variant=std"], str(tmp_path / "std"))
    assert r["equal"] and r["embeddings"] > 0
    with pytest.raises(ConfigError, match="config key 'dept.variant': the checkpoint has 'glob', this launch has "
                                          "'spec_opt'"):
        check_source(load_config(cfg_path, ["dept.variant=spec_opt"]), path)


def _with_source_c(cfg_path: str, tmp_path) -> str:
    """The config with a third source, c (a's data), that the checkpoint's run never had."""
    cfg = yaml.safe_load(open(cfg_path))
    cfg["data"]["sources"].append({**cfg["data"]["sources"][0], "name": "c"})
    path = tmp_path / "three.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_spec_opt_tables_by_source_and_a_new_source(spec_opt_source, tmp_path):
    cfg_path, src_run = spec_opt_source
    ranks = run_distributed(_worker, 2, args=(cfg_path, src_run, [], str(tmp_path / "two")))
    for r in ranks:
        assert r["groups"] == 2 and r["step"] == 0 and r["embeddings"] == 0 and r["equal"], r
        assert r["reference"] and r["outer_state_zero"] and r["inner_state"] == 0, r
        assert r["held"] and set(r["tables"]) == {"a", "b"}
        assert all(r["tables"][n] for n in r["held"]), r["tables"]
    three = _with_source_c(cfg_path, tmp_path)
    with pytest.raises(ConfigError, match="config key 'data.sources\\[2\\]' differs from checkpoint .*: source 'c': "
                                          "the checkpoint holds no embeddings of it \\(its run had no "
                                          "such source\\); train.init_from_new_sources: fresh"):
        _loaded(three, src_run, [], str(tmp_path / "err"))
    r = _loaded(three, src_run, ["train.init_from_new_sources=fresh"], str(tmp_path / "fresh"))
    assert r["tables"]["c"] and all(r["tables"][n] for n in r["held"]) and "c" not in r["held"]
    with pytest.raises(ConfigError, match="train.init_from_new_sources"):
        load_config(cfg_path, ["train.init_from_new_sources=maybe"])


def test_spec_opt_run_installs_the_tables(spec_opt_source, tmp_path):
    """Through dept_mega.train (one round of 2 steps, learning rate 0 so that nothing moves;
    dept.untrained_sources: warn, as the sources that round does not train are the point):
    the sources the new run installed and saved hold the checkpoint's tables, and its log says
    where the weights came from."""
    from dept_mega.checkpoint_format import read_full, saved_keys
    from dept_mega.init_from_dept import held_sources
    from tests.test_train_cli import _train_here
    cfg_path, src_run = spec_opt_source
    run = str(tmp_path / "init")
    r = _train_here("--config", cfg_path, "train.eval_interval=0", "train.eval_iters=0", "train.save_interval=0",
                    "train.steps=2", "optim.lr=0", "optim.min_lr=0", f"train.run_dir={run}",
                    f"train.init_from={src_run}", "dept.untrained_sources=warn")
    assert r.returncode == 0, r.stderr
    old = os.path.join(src_run, "checkpoints", "step_4")
    assert f"model weights from {old} (train.init_from)" in r.stdout
    new = os.path.join(run, "checkpoints", "step_2")
    mine, theirs = held_sources(new), held_sources(old)
    assert mine
    for name, key_of in mine.items():
        keys = [k for k in saved_keys(new) if k.startswith(key_of("model/embeddings."))]
        assert keys, name
        a = read_full(new, keys)
        same = {k: theirs[name]("model/" + k.split("model/", 1)[1]) for k in keys}  # its key in the source run
        b = read_full(old, list(same.values()))
        assert all(torch.equal(a[k], b[same[k]]) for k in keys), name
    # the run records the checkpoint it started from; a resume reads that one again, not what
    # train.init_from names now (here a run directory that no longer exists: as if moved)
    import json
    rec = json.load(open(os.path.join(run, "init_from.json")))
    assert rec == {"init_from": src_run, "checkpoint": os.path.abspath(old)}, rec
    # the recorded checkpoint is verified again at a resume: a copy with a damaged data file refused
    import shutil
    copy = tmp_path / "copy" / "checkpoints" / "step_4"
    shutil.copytree(old, copy)
    data = sorted(copy.glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with open(os.path.join(run, "init_from.json"), "w") as f:
        json.dump({"init_from": src_run, "checkpoint": str(copy)}, f)
    args = ("--config", cfg_path, "train.eval_interval=0", "train.eval_iters=0", "train.save_interval=0",
            "train.steps=4", "optim.lr=0", "optim.min_lr=0", f"train.run_dir={run}", "dept.untrained_sources=warn")
    r = _train_here(*args, f"train.init_from={src_run}")
    assert r.returncode != 0 and f"config key 'train.init_from': checkpoint {copy} is not usable" in r.stderr, r.stderr
    assert data.name in r.stderr, r.stderr
    with open(os.path.join(run, "init_from.json"), "w") as f:
        json.dump(rec, f)
    r = _train_here("--config", cfg_path, "train.eval_interval=0", "train.eval_iters=0", "train.save_interval=0",
                    "train.steps=4", "optim.lr=0", "optim.min_lr=0", f"train.run_dir={run}",
                    f"train.init_from={tmp_path / 'moved'}", "dept.untrained_sources=warn")
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stdout


def test_the_pre_flight_refuses_what_the_launch_refuses(spec_opt_source, tmp_path):
    """``--check`` with ``train.init_from`` (a user audit found it silent: a missing path, a
    checkpoint of another variant or tokenizer passed it and stopped the launch on its nodes):
    the pre-flight raises the launch's error for each (the path, the model keys, each source's
    table), and says where the weights will come from, or that a checkpoint of the run's own
    takes precedence."""
    from dept_mega.preflight import preflight, run_check
    cfg_path, src_run = spec_opt_source
    run = f"train.run_dir={tmp_path / 'new'}"

    def check(path, *more, cfg=cfg_path):
        return preflight(load_config(cfg, [run, f"train.init_from={path}", *more]), 1)[0]

    lines = check(src_run)
    assert f"init_from: the model weights of {os.path.join(src_run, 'checkpoints', 'step_4')} (the same model " \
           "keys; its files are checked at launch)" in lines, lines
    with pytest.raises(ConfigError, match="config key 'train.init_from': .*nothing' is not a directory"):
        check(tmp_path / "nothing")
    with pytest.raises(ConfigError, match="config key 'model.hidden_size' differs from checkpoint .*: the checkpoint "
                                          "has 32, this launch has 64; train.init_from needs a checkpoint"):
        check(src_run, "model.hidden_size=64")
    with pytest.raises(ConfigError, match="config key 'data.sources\\[2\\]' differs from checkpoint .*: source 'c': "
                                          "the checkpoint holds no embeddings of it"):
        check(src_run, "dept.untrained_sources=warn", cfg=_with_source_c(cfg_path, tmp_path))
    assert any(ln.startswith("init_from: not used: ") for ln in preflight(load_config(
        cfg_path, [f"train.run_dir={src_run}", f"train.init_from={src_run}"]), 1)[0])
    assert run_check(load_config(cfg_path, [run, f"train.init_from={tmp_path / 'nothing'}"]), 1) == 2
