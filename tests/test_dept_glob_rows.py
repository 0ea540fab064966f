"""GLOB with ``dept.embedding_rows: present``: a group's inner steps update only the table rows
of its round's source vocabulary V_k; the outer average is the usual one."""
import pytest
import torch

from tests.dept_utils import SyntheticSource, allowed_ids, emb_state, run_dept, solo_groups, source_infos, tiny_config
from tests.mp_utils import run_distributed


def _table(trainer):
    return trainer.embeddings()[0].word_embeddings.weight


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_rows_outside_the_source_stay_exactly_and_the_norm_ignores_them(precision):
    from dept_mega.dept.row_mask import PresentRowsOnly
    from dept_mega.trainer import Trainer
    cfg = tiny_config({"dept": {"variant": "glob"}, "precision": precision, "optim": {"weight_decay": 0.1}})
    info = source_infos(1, trim=True)[0]
    torch.manual_seed(cfg.train.seed)
    tr = Trainer(cfg, solo_groups(), torch.device("cpu"), vocab_size=info.vocab_size)
    before = tr.main_params([_table(tr)])[0].clone()
    mask = PresentRowsOnly(tr, info.vocab_ids)
    it = SyntheticSource(cfg, 1, allowed_ids(info))
    norms = []
    grads = {}

    class Spy:  # what the masked gradient looks like right before the norm
        def after_reduce(self, trainer):
            grads["table"] = trainer.reduced_grad(_table(trainer)).clone()

        def after_step(self, trainer):
            pass

    tr.step_hooks.append(Spy())
    for _ in range(3):
        norms.append(tr.train_step(it.next_step()).grad_norm)
    after = tr.main_params([_table(tr)])[0]
    held = torch.zeros(before.shape[0], dtype=torch.bool)
    held[info.vocab_ids] = True
    assert torch.equal(after[~held], before[~held])  # weight decay and momentum undone, bit for bit
    assert not torch.equal(after[held], before[held])
    assert mask.frozen_rows == int((~held).sum())
    assert float(grads["table"][~held].abs().max()) == 0.0 and float(grads["table"][held].abs().max()) > 0
    if precision == "bf16":  # the model's weights follow their masters
        assert torch.equal(_table(tr).data[~held], before[~held].to(torch.bfloat16))
    mask.remove()
    assert mask not in tr.step_hooks


def _worker(rank, world, over, rounds):
    cfg = tiny_config(over)
    out = run_dept(cfg, source_infos(2, trim=True), rounds, data_seed={"s0": 1, "s1": 2})
    return {"losses": out["losses"], "emb": emb_state(out["trainer"]),
            "table": _table(out["trainer"]).detach().clone()}


@pytest.mark.timeout(200)
def test_glob_present_rows_equals_the_average_of_masked_local_runs():
    """Two groups, fedavg: after each round the table is the mean of two single-group runs
    that each update only their source's rows (computed here without DEPT)."""
    from dept_mega.dept.row_mask import PresentRowsOnly
    from dept_mega.trainer import Trainer
    over = {"dept": {"variant": "glob", "local_steps": 2, "embedding_rows": "present"}, "train": {"steps": 4}}
    res = run_distributed(_worker, 2, args=(over, 2))
    plain = run_distributed(_worker, 2, args=({**over, "dept": {"variant": "glob", "local_steps": 2}}, 2))
    cfg = tiny_config(over)
    infos = source_infos(2, trim=True)
    torch.manual_seed(cfg.train.seed)
    trainers = [Trainer(cfg, solo_groups(), torch.device("cpu"), vocab_size=infos[0].vocab_size) for _ in range(2)]
    iters = [SyntheticSource(cfg, k + 1, allowed_ids(infos[k])) for k in range(2)]
    start = _table(trainers[0]).detach().clone()
    for _ in range(2):
        masks = [PresentRowsOnly(tr, infos[k].vocab_ids) for k, tr in enumerate(trainers)]
        for tr, it in zip(trainers, iters):
            for _ in range(cfg.dept.local_steps):
                tr.train_step(it.next_step())
        for m in masks:
            m.remove()
        with torch.no_grad():
            for ps in zip(*(tr.parameters() for tr in trainers)):
                mean = sum(p.detach() for p in ps) / 2
                for p in ps:
                    p.copy_(mean)
    for r in res:
        for k, v in emb_state(trainers[0]).items():
            torch.testing.assert_close(r["emb"][k], v, rtol=1e-5, atol=1e-6)
    # rows in neither source's vocabulary never move; plain GLOB moves them
    neither = torch.ones(start.shape[0], dtype=torch.bool)
    for info in infos:
        neither[info.vocab_ids] = False
    neither[infos[0].vocab_size:] = False  # the padded rows
    assert torch.equal(res[0]["table"][neither], start[neither])
    assert not torch.equal(plain[0]["table"][neither], start[neither])
    assert res[0]["losses"] != plain[0]["losses"]


def test_config_refuses_present_rows_outside_glob():
    from dept_mega.config import ConfigError
    with pytest.raises(ConfigError, match="'dept.embedding_rows': present applies to glob"):
        tiny_config({"dept": {"variant": "spec", "embedding_rows": "present"}})
    with pytest.raises(ConfigError, match="'dept.embedding_rows': present needs optim.distributed false"):
        tiny_config({"dept": {"variant": "glob", "embedding_rows": "present"}, "optim": {"distributed": True}})


def test_glob_rows_tool_measures_updates_outside_the_source_vocabulary(tmp_path):
    """tools/glob_rows.py (docs/study/glob.md) on the sample corpus, 2 groups × 3 steps: plain
    GLOB moves rows outside V_k, ``present`` moves none, and the averaged table then holds no
    update from a group whose source lacks the row."""
    import json
    import os

    from tests.trainer_utils import ROOT, ensure_sample_corpus
    from tools.glob_rows import main
    ensure_sample_corpus()
    out = tmp_path / "rows.json"
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        main(["--config", "examples/tiny/glob.yaml", "--sources", "ru,code", "--rounds", "1",
              "--local-steps", "3", "--group-batch", "8", "--eval-iters", "1", "--out", str(out),
              "--set", "optim.warmup_steps=1"])
    finally:
        os.chdir(cwd)
    res = json.loads(out.read_text())["modes"]
    plain, present = res["all"]["records"][0], res["present"]["records"][0]
    assert 0.0 < plain["outside_share"] < 1.0 and 0.0 < plain["drift_share"] < 1.0
    assert present["outside_share"] == 0.0 and present["drift_share"] == 0.0
    assert set(plain["bpb_by_source"]) == {"ru", "code"}


def test_glob_rows_body_only_measures_each_group_from_its_own_table(tmp_path, monkeypatch):
    """``body_only``: each group keeps its own table, so from round 2 on the groups start from
    different tables; a group's table update (coherence.table, outside share) is measured from
    its own start, not group 0's, and no averaged table means no drift share."""
    import json
    import os

    from dept_mega.trainer import Trainer
    from tests.trainer_utils import ROOT, ensure_sample_corpus
    from tools.glob_rows import _coherence, main, markdown
    ensure_sample_corpus()
    seen = {}  # trainer → [(table before, table after)] per train_step (one step per round)
    real_step = Trainer.train_step

    def step(self, *a, **kw):
        before = _table(self).detach().clone()
        out = real_step(self, *a, **kw)
        seen.setdefault(id(self), []).append((before, _table(self).detach().clone()))
        return out
    monkeypatch.setattr(Trainer, "train_step", step)
    out = tmp_path / "rows.json"
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        main(["--config", "examples/tiny/glob.yaml", "--sources", "ru,code", "--rounds", "2",
              "--local-steps", "1", "--group-batch", "8", "--eval-iters", "1", "--modes", "body_only",
              "--out", str(out), "--set", "optim.warmup_steps=1"])
    finally:
        os.chdir(cwd)
    res = json.loads(out.read_text())
    recs = res["modes"]["body_only"]["records"]
    g0, g1 = seen.values()
    assert not torch.equal(g0[1][0], g1[1][0])  # round 2: the groups' own tables differ
    for r, rec in enumerate(recs):
        own = [g[r][0] - g[r][1] for g in (g0, g1)]
        assert rec["coherence"]["table"] == pytest.approx(_coherence(own), rel=1e-5)
        assert rec["drift_share"] is None
    assert "| body_only | " in markdown(res) and " n/a n/a |" in markdown(res)
