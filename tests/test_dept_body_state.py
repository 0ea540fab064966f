"""``dept.body_optimizer_state``: ``group`` (default) keeps the body's inner AdamW state with the
group; ``source`` keeps it per source, and a source that moves to another group finds its own
moments there (sent as ``source_move``)."""
import pytest
import torch

from tests.dept_utils import run_dept, source_infos, tiny_config
from tests.mp_utils import run_distributed

ROUNDS = 6


def _body_moments(trainer):
    sd = trainer.body_optimizer.state_dict()["state"]
    return {f"{i}.{k}": v.clone() for i, st in sd.items() for k, v in st.items()}


def _worker(rank, world, runs):
    out = []
    for variant, mode, seed in runs:
        cfg = tiny_config({"dept": {"variant": variant, "local_steps": 1, "body_optimizer_state": mode},
                           "train": {"steps": ROUNDS, "seed": seed}})
        events = []
        res = run_dept(cfg, source_infos(3, trim=variant == "trim"), ROUNDS,
                       on_install=lambda r, h, tr: events.append((r, 0, _body_moments(tr))),
                       after_round=lambda r, h, tr: events.append((r, 1, _body_moments(tr))))
        plans = [res["hooks"].scheduler.plan(r) for r in range(ROUNDS)]
        out.append({"events": events, "sources": [p.sources for p in plans], "moves": [p.moves for p in plans],
                    "bytes": [o["bytes"]["source_move"] for o in res["outer"]],
                    "body": sum(p.numel() for p in res["trainer"].body_parameters())})
    return out


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_body_moments_travel_with_their_source():
    from dept_mega.dept.rounds import RoundScheduler
    seed = next(sd for sd in range(100)
                if sum(len(RoundScheduler(3, 2, seed=sd).plan(r).moves) for r in range(ROUNDS)) >= 2)
    runs = [("spec", "source", seed), ("glob", "source", seed), ("glob", "group", seed)]
    res = run_distributed(_worker, 2, args=(runs,), timeout=250)
    for i, (variant, mode, _) in enumerate(runs):
        sources, moves = res[0][i]["sources"], res[0][i]["moves"]
        # source -> moments after its most recent round; group -> moments after its last round
        by_source, by_group, checked_moved = {}, {}, 0
        moved = {(r, m.source) for r, ms in enumerate(moves) for m in ms}
        for r in range(ROUNDS):
            for g in range(2):
                ev = {kind: m for rr, kind, m in res[g][i]["events"] if rr == r}
                k = sources[r][g]
                if mode == "source":
                    if k in by_source:
                        assert _equal(ev[0], by_source[k]), (variant, r, g, k)
                        checked_moved += (r, k) in moved
                    else:
                        assert ev[0] == {}, (variant, r, g, "a never-trained source starts with empty moments")
                elif r > 0:
                    assert _equal(ev[0], by_group[g]), (r, g)  # the group's own, whatever the source
                by_source[k], by_group[g] = ev[1], ev[1]
        move_bytes = [sum(res[g][i]["bytes"][r] for g in range(2)) for r in range(ROUNDS)]
        body = res[0][i]["body"]
        for r in range(ROUNDS):
            if mode == "source":
                assert checked_moved >= 1, (variant, "no moved source was checked")
                # each move carries at least the two fp32 moments of the body
                assert move_bytes[r] >= len(moves[r]) * 2 * body * 4, (variant, r, move_bytes[r])
            else:
                assert move_bytes[r] == 0  # GLOB with the body state per group: nothing moves


def _body_masters(trainer):
    return {i: trainer.main_params([p])[0].detach().clone() for i, p in enumerate(trainer.body_parameters())}


def _install_worker(rank, world, seed):
    # bf16 weights (fp32 masters), the body synchronised in 2 fragments: at a round's start the
    # groups' bodies differ (fragment 0 trained on since its sync), so a source's body state
    # that carried masters would overwrite the receiving group's weights
    cfg = tiny_config({"precision": "bf16",
                       "dept": {"variant": "glob", "local_steps": 2, "body_optimizer_state": "source",
                                "outer_fragments": 2},
                       "train": {"steps": 2 * ROUNDS, "seed": seed}})
    ends, starts = {}, {}
    res = run_dept(cfg, source_infos(3), ROUNDS,
                   after_sync=lambda r, h, tr: ends.__setitem__(r, _body_masters(tr)),
                   on_install=lambda r, h, tr: starts.__setitem__(r, _body_masters(tr)))
    moves = [res["hooks"].scheduler.plan(r).moves for r in range(ROUNDS)]
    changed = [r for r in range(1, ROUNDS) if not _equal(ends[r - 1], starts[r])]
    return {"changed": changed, "moves": sum(len(m) for m in moves[1:])}


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_installing_a_sources_body_state_leaves_the_body_weights_alone():
    from dept_mega.dept.rounds import RoundScheduler
    seed = next(sd for sd in range(100)
                if sum(len(RoundScheduler(3, 2, seed=sd).plan(r).moves) for r in range(1, ROUNDS)) >= 2)
    res = run_distributed(_install_worker, 2, args=(seed,), timeout=180)
    assert res[0]["moves"] >= 2
    for g in range(2):
        assert res[g]["changed"] == [], f"group {g}: the body's fp32 masters changed at the start of rounds {res[g]['changed']}"


def _embedding_masters(trainer):
    opt = trainer.embedding_optimizer
    return {i: m.detach().clone() for i, m in enumerate(opt.state_dict().get("main_params") or [])}


def _reset_worker(rank, world, dist, seed):
    # bf16 weights, per-source embeddings, the inner optimizer reset every round: the AdamW
    # moments go, the fp32 masters of the source's embeddings must stay (also for a source that
    # moved here); rounding them to the bf16 weights would lose the sub-bf16 part of every update
    cfg = tiny_config({"precision": "bf16", "parallel": {"data": 2 if dist else 1},
                       "optim": {"distributed": dist, "grad_bucket_size": 500},
                       "dept": {"variant": "spec", "local_steps": 2, "reset_inner_optimizer": True},
                       "train": {"steps": 2 * ROUNDS, "seed": seed}})
    ends, starts = {}, {}

    def end(r, h, tr):
        ends[r] = (h.installed, _embedding_masters(tr))

    def start(r, h, tr):
        starts[r] = (h.installed, _embedding_masters(tr), len(tr.embedding_optimizer.state))

    res = run_dept(cfg, source_infos(3), ROUNDS, after_sync=end, on_install=start)
    return {"ends": ends, "starts": starts, "group": res["pg"].group_index, "names": [s.name for s in source_infos(3)],
            "moves": [res["hooks"].scheduler.plan(r).moves for r in range(ROUNDS)]}


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("dist", [False, True])
def test_reset_inner_optimizer_keeps_the_embedding_masters(dist):
    from dept_mega.dept.rounds import RoundScheduler
    seed = next(sd for sd in range(100)
                if sum(len(RoundScheduler(3, 2, seed=sd).plan(r).moves) for r in range(1, ROUNDS)) >= 2)
    res = run_distributed(_reset_worker, 4 if dist else 2, args=(dist, seed), timeout=180)
    last = {}  # source -> its masters when its last round ended (on the rank of the same dp position)
    checked = checked_moved = 0
    moved = {(rnd, res[0]["names"][m.source]) for rnd, ms in enumerate(res[0]["moves"]) for m in ms}
    by_group = {}
    for r in res:
        by_group.setdefault(r["group"], r)  # one rank per group (dp rank 0 comes first)
    for rnd in range(ROUNDS):
        for g, r in sorted(by_group.items()):
            name, masters, moments = r["starts"][rnd]
            assert moments == 0, "the inner optimizer is reset at every round start"
            if name in last:
                assert masters.keys() == last[name].keys()
                assert all(torch.equal(masters[k], last[name][k]) for k in masters), (rnd, g, name)
                checked += 1
                checked_moved += (rnd, name) in moved
        for g, r in sorted(by_group.items()):
            name, masters = r["ends"][rnd]
            last[name] = masters
    assert checked >= 3 and checked_moved >= 1, (checked, checked_moved)
