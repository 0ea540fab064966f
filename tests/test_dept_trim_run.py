"""TRIM in a run: φ after a round equals the dense per-row mean of the groups' compact rows;
only trimmed rows cross groups; measured outer bytes of every variant match dept_costs."""
import pytest
import torch

from dept_mega.dept.costs import predict_outer_round_bytes
from dept_mega.dept.trim import row_mean_update_dense
from tests.dept_utils import VOCAB, run_dept, source_infos, tiny_config
from tests.mp_utils import run_distributed


def _trim_worker(rank, world, over):
    cfg = tiny_config(over)
    infos = source_infos(2, trim=True)
    seen = {}

    def on_install(r, hooks, trainer):
        seen["phi0"] = hooks.phi.weight.clone()
        emb = trainer.embeddings()[0]
        ids = infos[int(hooks.installed[1:])].vocab_ids
        # the compact table starts as φ's rows V_k
        seen["filled"] = torch.equal(emb.word_embeddings.weight[:ids.numel()], hooks.phi.weight[ids])
        seen["vocab"] = emb.vocab_size

    def after_round(r, hooks, trainer):
        emb = trainer.embeddings()[0]
        ids = infos[int(hooks.installed[1:])].vocab_ids
        seen["local"] = (ids, emb.word_embeddings.weight[:ids.numel()].detach().clone())

    out = run_dept(cfg, infos, 1, on_install=on_install, after_round=after_round)
    return {"phi0": seen["phi0"], "phi": out["hooks"].phi.weight.clone(), "local": seen["local"],
            "filled": seen["filled"], "vocab": seen["vocab"], "bytes": out["outer"][0]["bytes"],
            "losses": out["losses"]}


@pytest.mark.timeout(200)
def test_trim_round_matches_dense_reference():
    over = {"dept": {"variant": "trim", "local_steps": 2}, "train": {"steps": 2}}
    res = run_distributed(_trim_worker, 2, args=(over,))
    infos = source_infos(2, trim=True)
    phi0 = res[0]["phi0"]
    contributions = []
    for r in res:
        assert r["filled"] and r["vocab"] in (infos[0].vocab_ids.numel(), infos[1].vocab_ids.numel())
        ids, local = r["local"]
        contributions.append((ids, phi0[ids] - local))
    dense = phi0.clone()
    row_mean_update_dense(dense, contributions)
    for r in res:
        torch.testing.assert_close(r["phi"], dense, rtol=0, atol=1e-7)
    held = torch.zeros(VOCAB, dtype=torch.bool)
    for ids, _ in contributions:
        held[ids] = True
    assert (~held).any() and torch.equal(res[0]["phi"][~held], phi0[~held])
    assert not torch.equal(res[0]["phi"][held], phi0[held])
    # only trimmed rows crossed: far less than one dense fp32 table per group
    h = tiny_config(over).model.hidden_size
    assert res[0]["bytes"]["outer_embedding"] < 2 * VOCAB * h * 4


def _bytes_worker(rank, world, runs):
    out = []
    for over, n in runs:
        cfg = tiny_config(over)
        infos = source_infos(n, trim=cfg.dept.variant == "trim",
                             vocabs=(60, 200, 130)[:n] if cfg.dept.variant == "spec_opt" else None)
        res = run_dept(cfg, infos, 2)
        sizes = {s.name: (s.vocab_ids.numel() if s.vocab_ids is not None else s.vocab_size) for s in infos}
        out.append({"bytes": [o["bytes"] for o in res["outer"]],
                    "trim_vocabs": [[sizes[a[g]] for g in sorted(a)] for a in res["assignments"]]})
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,parallel", [(2, {}), (4, {"data": 2})])
def test_measured_outer_bytes_match_dept_costs(world, parallel):
    runs = []
    # every (positions, tying) combination at D = 1; two of them at D = 2 (the dp re-gather)
    combos = [("alibi", True), ("alibi", False), ("learned", True), ("learned", False)]
    if parallel:
        combos = [("alibi", True), ("learned", False)]
    for variant in ("glob", "trim", "spec", "spec_opt"):
        for position, tie in combos:
            over = {"dept": {"variant": variant, "local_steps": 1}, "train": {"steps": 2},
                    "model": {"position_embedding": position, "tie_embeddings": tie}, "parallel": parallel}
            runs.append((over, 3))
    res = run_distributed(_bytes_worker, world, args=(runs,))
    G = 2
    for (over, _), got in zip(runs, res[0]):
        cfg = tiny_config(over)
        for r in range(2):
            pred = predict_outer_round_bytes(cfg, G, global_vocab=VOCAB, trim_vocabs=got["trim_vocabs"][r])
            for cat in ("outer_body", "outer_embedding"):
                assert got["bytes"][r][cat] == pred[cat], (over, r, cat, got["bytes"][r], pred)
        if cfg.dept.variant in ("spec", "spec_opt"):
            assert got["bytes"][0]["outer_embedding"] == 0


@pytest.mark.parametrize("outer", [{"name": "nesterov", "lr": 0.7, "momentum": 0.9},
                                   {"name": "adam", "lr": 0.02, "betas": [0.8, 0.99], "eps": 1.0e-6}])
def test_trim_rows_take_the_configured_outer_optimizer(outer):
    """A TRIM run (one process: G = 1, K = 2 sources alternating, 4 rounds): φ after every round
    equals a dense plain-tensor reference that applies the configured outer optimizer to
    each held row's pseudo-gradient, with state per row (rows of the other source's V_k keep
    theirs while it is not trained)."""
    from tests.dept_utils import solo_groups
    from tests.test_dept_trim import _dense_outer_reference
    over = {"dept": {"variant": "trim", "local_steps": 1, "outer_optimizer": outer}, "train": {"steps": 4}}
    infos = source_infos(2, trim=True)
    phi0, rounds = {}, []

    def on_install(r, hooks, trainer):
        phi0.setdefault("phi", hooks.phi.weight.clone())
        rounds.append(hooks.phi.weight.clone())

    def after_round(r, hooks, trainer):
        ids = infos[int(hooks.installed[1:])].vocab_ids
        local = trainer.embeddings()[0].word_embeddings.weight[:ids.numel()].detach().clone()
        rounds[-1] = [(ids, rounds[-1][ids] - local)]  # this round's (ids, Δ) of the one group

    out = run_dept(tiny_config(over), infos, 4, pg=solo_groups(), on_install=on_install, after_round=after_round)
    kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in outer.items() if k != "name"}
    ref, _ = _dense_outer_reference(phi0["phi"], rounds, outer["name"], **kw)
    torch.testing.assert_close(out["hooks"].phi.weight, ref, rtol=1e-5, atol=1e-6)
    # and it is not the plain row mean
    plain, _ = _dense_outer_reference(phi0["phi"], rounds, "fedavg", lr=1.0)
    assert not torch.allclose(out["hooks"].phi.weight, plain, rtol=1e-4, atol=1e-5)
