"""train.init_from across the variants with one global vocabulary: TRIM from TRIM / STD / GLOB,
STD / GLOB from TRIM, SPEC from STD / GLOB / TRIM. A property of every pair: after the load,
every table the new run holds (φ, φ_head, the compact tables filled from φ, the shared table,
each SPEC source's table, the learned positions) equals the checkpoint's, row for row over
the |V| real rows, in any layout; the body as saved; the outer state fresh at the loaded
weights. And the first losses equal those of a run that loaded the same weights another way."""
from __future__ import annotations

import os

import pytest
import torch
import yaml

from dept_mega.config import ConfigError, load_config
from tests.mp_utils import run_distributed
from tests.trainer_utils import read_jsonl

COMMON = ["train.eval_interval=0", "train.eval_iters=0", "train.save_interval=0", "train.log_interval=1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 2-step STD run (untied head, learned positions: every table TRIM keeps) and a TRIM
    run of one round started from it with learning rate 0 (its φ is the STD table's rows), and
    a STD run with a tied head and RoPE: (config, STD run dir, TRIM run dir, tied STD run dir)."""
    from tests.test_train_cli import _setup, _train_here
    tmp = tmp_path_factory.mktemp("trimsrc")
    cfg = _setup(tmp, variant="std")
    d = yaml.safe_load(open(cfg))
    d["model"].update(tie_embeddings=False, position_embedding="learned")
    with open(cfg, "w") as f:
        yaml.safe_dump(d, f)
    std, trim, tied = str(tmp / "std"), str(tmp / "trim"), str(tmp / "tied")
    r = _train_here("--config", cfg, *COMMON, "train.steps=2", f"train.run_dir={std}")
    assert r.returncode == 0, r.stderr
    r = _train_here("--config", cfg, *COMMON, "train.steps=2", "model.tie_embeddings=true",
                    "model.position_embedding=rope", f"train.run_dir={tied}")
    assert r.returncode == 0, r.stderr
    r = _train_here("--config", cfg, *COMMON, "train.steps=2", "dept.variant=trim", "optim.lr=0", "optim.min_lr=0",
                    f"train.run_dir={trim}", f"train.init_from={std}")
    assert r.returncode == 0, r.stderr
    return cfg, std, trim, tied


def _tables(path: str, V: int) -> dict[str, torch.Tensor]:
    """The checkpoint's global tables by TRIM's names (its φ / φ_head / positions, or the shared
    table's first V rows)."""
    from dept_mega.checkpoint_format import param_key, read_full, saved_keys, trim_key
    from dept_mega.init_from_trim import TABLES, saved_variant
    keys = {t: (trim_key(t) if saved_variant(path) == "trim" else param_key(n, None)) for t, n in TABLES.items()}
    keys = {t: k for t, k in keys.items() if k in saved_keys(path)}
    full = read_full(path, list(keys.values()))
    return {t: full[k] if t == "positions" else full[k][:V] for t, k in keys.items()}


def _rows_equal(local: torch.Tensor, want: torch.Tensor, first: int) -> bool:
    """``local`` (rows ``first``.. of a table, padded rows past ``want`` ignored) equals ``want``'s rows."""
    n = max(0, min(local.shape[0], want.shape[0] - first))
    return torch.equal(local[:n].float(), want[first:first + n].float().to(local.device))


def _embedding_checks(embs, src: dict, tp_rank: int, ids=None) -> list[bool]:
    """Each table of one embedding list against the source's (``ids``: TRIM's V_k, the compact rows)."""
    out = []
    for e in embs:
        if e is None:
            continue
        for owner, table in ((e.word_embeddings, "phi"), (e.output_layer, "phi_head")):
            if owner is not None:
                w = owner.weight.detach()
                first = tp_rank * w.shape[0]
                want = src[table] if ids is None else src[table][ids]
                out.append(_rows_equal(w, want, first))
        if e.position_embeddings is not None:
            out.append(torch.equal(e.position_embeddings.weight.detach(), src["positions"]))
    return out


def _check(cfg_path: str, src: str, new: str, overrides: list[str], run_dir: str) -> dict:
    """A fresh session (this process's layout) of variant ``new`` after init_from from ``src``."""
    from dept_mega.checkpoint_format import read_full
    from dept_mega.init_from import init_from
    from dept_mega.init_from_dept import weight_entries
    from dept_mega.init_from_trim import saved_variant
    from dept_mega.run_inputs import vocab_size_of
    from dept_mega.train import build_session
    cfg = load_config(cfg_path, [f"dept.variant={new}", f"train.init_from={src}", f"train.run_dir={run_dir}",
                                 *overrides])
    session = build_session(cfg, metrics=False)
    tr, hooks = session.trainer, session.loop.hooks
    path = init_from(tr, cfg, session.device, hooks)
    pg = tr.pg
    src_tables = _tables(path, vocab_size_of(cfg))
    body = [e for e in weight_entries(tr, path, new, saved_variant(path)) if "/embeddings." not in e.key]
    full = read_full(path, sorted({e.key for e in body}))
    out = {"tables": sorted(src_tables), "body": bool(body) and all(
        torch.equal(e.tensor, full[e.key][tuple(slice(o, o + n) for o, n in zip(e.offset, e.tensor.shape))])
        for e in body)}
    checks = []
    if new == "trim":
        st = hooks.strategy
        for table, t in (("phi", st.phi), ("phi_head", st.phi_head)):
            if t is not None:
                checks.append(_rows_equal(t.weight, src_tables[table], t.row_start))
        if st.positions is not None:
            checks.append(torch.equal(st.positions.detach(), src_tables["positions"]))
        for s in hooks.sources:  # the compact tables a source's installation fills from φ
            embs = st.initial(s.name)
            st.install(s.name, embs)
            checks += _embedding_checks(embs, src_tables, pg.tp_rank, s.vocab_ids)
    elif new == "spec":
        for s in hooks.sources:
            checks += _embedding_checks(hooks.strategy.initial(s.name), src_tables, pg.tp_rank)
    else:
        checks += _embedding_checks(tr.embeddings(), src_tables, pg.tp_rank)
    out["checks"] = checks
    syncs = list(getattr(hooks, "checkpoint_syncs", dict)().values())
    out["reference"] = all(torch.equal(s.theta_prev, s._read_chunk().to(s.theta_prev.device)) for s in syncs)
    out["outer_state_zero"] = all(not torch.is_tensor(v) or not v.any() for s in syncs
                                  for v in s.optimizer.state.values())
    out["inner_state"] = sum(len(opt.inner.state) for opt in tr.optimizers)
    return out


def _worker(rank, world, cfg_path, src, new, overrides, run_dir):
    return _check(cfg_path, src, new, overrides, f"{run_dir}/{rank}")


# (this launch's variant, the checkpoint's run, this launch's layout, processes); "tied": a
# tied head (φ on the first and the last stage) and no position table
CASES = [("trim", "std", [], 1), ("trim", "std", ["parallel.tensor=2"], 2), ("trim", "trim", ["parallel.data=2"], 2),
         ("std", "trim", ["parallel.tensor=2"], 2), ("glob", "trim", [], 1), ("spec", "std", [], 1),
         ("spec", "trim", ["parallel.tensor=2"], 2), ("trim", "std", ["parallel.pipeline=2"], 2),
         ("trim", "tied", ["parallel.pipeline=2"], 2)]


@pytest.mark.parametrize("new,src,overrides,world", CASES, ids=[f"{c[0]}_from_{c[1]}_{c[3]}" + "_".join(c[2])
                                                              for c in CASES])
def test_every_table_starts_from_the_checkpoint(runs, tmp_path, new, src, overrides, world):
    cfg_path, std, trim, tied = runs
    source = {"std": std, "trim": trim, "tied": tied}[src]
    if src == "tied":
        overrides = overrides + ["model.tie_embeddings=true", "model.position_embedding=rope"]
    if world == 1:
        ranks = [_check(cfg_path, source, new, overrides, str(tmp_path))]
    else:
        ranks = run_distributed(_worker, world, args=(cfg_path, source, new, overrides, str(tmp_path)))
    for r in ranks:
        assert r["tables"] == (["phi"] if src == "tied" else ["phi", "phi_head", "positions"]), r
        assert r["checks"] and all(r["checks"]), r["checks"]
        assert r["body"] and r["reference"] and r["outer_state_zero"] and r["inner_state"] == 0, r


def _first_loss(run: str) -> float:
    return [x for x in read_jsonl(os.path.join(run, "metrics.jsonl")) if x["kind"] == "train"][0]["loss"]


def test_first_losses_match_a_run_that_loaded_the_same_weights(runs, tmp_path):
    """The TRIM run started from STD (learning rate 0: its checkpoint holds the STD weights,
    as φ) starts TRIM and STD runs exactly as the STD checkpoint does: a TRIM run from it has
    the first loss of the TRIM run from STD, a STD run from it that of a STD run from STD."""
    from tests.test_train_cli import _train_here
    cfg_path, std, trim, _ = runs
    losses = {}
    for name, variant, src in (("trim_trim", "trim", trim), ("std_trim", "std", trim), ("std_std", "std", std)):
        run = str(tmp_path / name)
        r = _train_here("--config", cfg_path, *COMMON, "train.steps=2", f"dept.variant={variant}",
                        f"train.run_dir={run}", f"train.init_from={src}")
        assert r.returncode == 0, r.stderr
        losses[name] = _first_loss(run)
    assert losses["trim_trim"] == _first_loss(trim)
    assert losses["std_trim"] == losses["std_std"]


def test_still_refused(runs):
    """A SPEC-OPT run from anything but SPEC-OPT (its sources' own tokenizers), and STD / GLOB /
    TRIM from a checkpoint with a table per source: one error naming dept.variant and why."""
    from dept_mega.init_from import check_source, source_checkpoint
    cfg_path, std, trim, _ = runs
    with pytest.raises(ConfigError, match="config key 'dept.variant': the checkpoint has 'trim', this launch has "
                                          "'spec_opt'; a spec_opt run starts from a spec_opt checkpoint"):
        check_source(load_config(cfg_path, ["dept.variant=spec_opt"]), source_checkpoint(trim))
    from dept_mega.manifest import DEPENDS_FILE
    import json
    import shutil
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:  # the STD checkpoint, as if a SPEC run had written it
        path = os.path.join(tmp, "step_2")
        shutil.copytree(source_checkpoint(std), path)
        dep = json.load(open(os.path.join(path, DEPENDS_FILE)))
        dep["config"]["dept.variant"] = "spec"
        json.dump(dep, open(os.path.join(path, DEPENDS_FILE), "w"))
        with pytest.raises(ConfigError, match="the checkpoint has 'spec', this launch has 'trim'; a trim run "
                                              "starts from a trim / std / glob checkpoint \\(it holds a table per "
                                              "source"):
            check_source(load_config(cfg_path, ["dept.variant=trim"]), path)
