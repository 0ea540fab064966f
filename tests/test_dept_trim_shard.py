"""TRIM's φ row-sharded over a stage's tp × dp ranks (dept/trim.py TrimTable): the same losses
and the same table, bit for bit, as the whole table on every rank; no rank holds all rows;
the state of a shard reloads (from a shard or from a whole table)."""
import pytest
import torch

from dept_mega.dept.trim import TrimTable
from dept_mega.dept.trim_strategy import TrimStrategy
from tests.dept_utils import run_dept, source_infos, tiny_config
from tests.mp_utils import run_distributed


def _worker(rank, world, parallel):
    over = {"dept": {"variant": "trim", "local_steps": 2,
                     "outer_optimizer": {"name": "adam", "lr": 0.05, "betas": [0.8, 0.99]}},
            "train": {"steps": 4}, "parallel": parallel, "model": {"tie_embeddings": False}}
    out = {}
    for shard in (True, False):
        TrimStrategy.shard_table = shard
        try:
            res = run_dept(tiny_config(over), source_infos(2, trim=True), 2)
        finally:
            TrimStrategy.shard_table = True
        st = res["hooks"].strategy
        out[shard] = {"losses": res["losses"], "phi": st.full_table("phi"), "head": st.full_table("phi_head"),
                      "rows": st.phi.weight.shape[0]}
        if shard:
            sd = st.phi.state_dict()
            fresh = TrimTable(torch.zeros_like(out[shard]["phi"]), optimizer=type(st.phi.optimizer)("adam"),
                              pg=st.phi.pg, group=st.phi.group, index=st.phi.index, parts=st.phi.parts)
            fresh.load_state_dict(sd)
            out["reload_shard"] = torch.equal(fresh.weight, st.phi.weight) and all(
                torch.equal(fresh.optimizer.state[k], v) for k, v in st.phi.optimizer.state.items())
            whole = TrimTable(torch.zeros_like(out[shard]["phi"]), optimizer=type(st.phi.optimizer)("fedavg"),
                              pg=st.phi.pg, group=st.phi.group, index=st.phi.index, parts=st.phi.parts)
            whole.load_state_dict({"weight": out[shard]["phi"], "optimizer": {"name": "fedavg", "state": {}}})
            out["reload_whole"] = torch.equal(whole.weight, st.phi.weight)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("parallel", [{"data": 2}, {"tensor": 2}])
def test_sharded_table_is_bit_identical(parallel):
    res = run_distributed(_worker, 2, args=(parallel,))
    for r in res:
        assert r[True]["losses"] == r[False]["losses"]
        assert torch.equal(r[True]["phi"], r[False]["phi"]) and torch.equal(r[True]["head"], r[False]["head"])
        assert r[True]["rows"] < r[False]["rows"] == r[True]["phi"].shape[0]  # a shard, not the table
        assert r["reload_shard"] and r["reload_whole"]
    assert torch.equal(res[0][True]["phi"], res[1][True]["phi"])
