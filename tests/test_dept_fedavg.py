"""FedAvg over G groups: identical data → a single group's run; different data → the explicit
average of the groups' locally trained models (computed here from separate single-group runs)."""
import pytest
import torch

from tests.dept_utils import (SyntheticSource, body_vector, emb_state, run_dept, source_infos, tiny_config,
                              train_plain, solo_groups)
from tests.mp_utils import run_distributed


def _worker(rank, world, over, rounds, data_seed):
    cfg = tiny_config(over)
    out = run_dept(cfg, source_infos(2), rounds, data_seed=data_seed)
    tr = out["trainer"]
    return {"losses": out["losses"], "body": body_vector(tr), "emb": emb_state(tr), "outer": out["outer"]}


@pytest.mark.timeout(200)
def test_fedavg_identical_data_equals_single_group():
    over = {"dept": {"variant": "glob", "local_steps": 2}, "train": {"steps": 6}}
    res = run_distributed(_worker, 2, args=(over, 3, {"s0": 1, "s1": 1}))
    cfg = tiny_config(over)
    ref = train_plain(cfg, source_infos(2)[0], 6, seed=1)
    for r in res:
        torch.testing.assert_close(r["body"], body_vector(ref), rtol=1e-5, atol=1e-6)
        for k, v in emb_state(ref).items():
            torch.testing.assert_close(r["emb"][k], v, rtol=1e-5, atol=1e-6)
    assert res[0]["losses"] == res[1]["losses"]
    assert res[0]["outer"][0]["bytes"]["outer_body"] > 0 and res[0]["outer"][0]["bytes"]["outer_embedding"] > 0


@pytest.mark.timeout(200)
def test_fedavg_different_data_equals_explicit_average():
    over = {"dept": {"variant": "glob", "local_steps": 2}, "train": {"steps": 4}}
    res = run_distributed(_worker, 2, args=(over, 2, {"s0": 1, "s1": 2}))
    cfg = tiny_config(over)
    infos = source_infos(2)
    # two single-group runs, each on its own source, averaged explicitly after every round
    torch.manual_seed(cfg.train.seed)
    from dept_mega.trainer import Trainer
    trainers = [Trainer(cfg, solo_groups(), torch.device("cpu"), vocab_size=infos[0].vocab_size) for _ in range(2)]
    iters = [SyntheticSource(cfg, k + 1, torch.arange(infos[k].vocab_size)) for k in range(2)]
    for _ in range(2):
        for tr, it in zip(trainers, iters):
            for _ in range(cfg.dept.local_steps):
                tr.train_step(it.next_step())
        with torch.no_grad():
            for ps in zip(*(tr.parameters() for tr in trainers)):
                mean = sum(p.detach() for p in ps) / 2
                for p in ps:
                    p.copy_(mean)
    for r in res:
        torch.testing.assert_close(r["body"], body_vector(trainers[0]), rtol=1e-5, atol=1e-6)
        for k, v in emb_state(trainers[0]).items():
            torch.testing.assert_close(r["emb"][k], v, rtol=1e-5, atol=1e-6)
    # the groups really trained on different data: their losses differ
    assert res[0]["losses"] != res[1]["losses"]
