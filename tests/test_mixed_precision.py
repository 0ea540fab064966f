"""Megatron-style mixed precision on gloo (world 2): bf16 weights and activations on every
pipeline layout, fp32 masters, DEPT's outer sync on the masters, and resuming from
checkpoints (distributed optimizer, half-precision masters, fused AdamW on CPU)."""
from __future__ import annotations

import io
import os

import pytest
import torch

from tests.mp_utils import run_distributed
from tests.trainer_utils import layouts_worker, tiny_config, train_losses


def _layouts_and_bytes(rank, world):
    from tests.optim_utils import train_record
    runs = [({"precision": "bf16"}, ("parallel.pipeline=2",)),
            ({"precision": "bf16"}, ("parallel.pipeline=2", "parallel.virtual_pipeline=2")),
            ({"precision": "bf16"}, ("parallel.tensor=2", "parallel.sequence_parallel=true"))]
    out = layouts_worker(rank, world, runs, 3)
    tp = {prec: train_record({"precision": prec}, ("parallel.tensor=2", "parallel.sequence_parallel=true"), 1)
          for prec in ("fp32", "bf16")}
    return {"layouts": out, "tp_bytes": {k: v["bytes"]["tp"] for k, v in tp.items()}}


@pytest.mark.timeout(200)
def test_bf16_same_numerics_on_every_pipeline_layout():
    """The first stage no longer runs an fp32 residual stream while later stages run bf16: a
    PP 2 (and interleaved) run computes PP 1's first loss bit for bit (the same bf16 ops on the
    same bf16 tensors), and later losses within bf16 noise (the tied embedding's two gradient
    halves are summed in fp32 across stages, in bf16 inside one stage). Tensor-parallel
    collectives move half the bytes of fp32 (the cross entropy's fp32 statistics and the fp32
    sequence-parallel gradient sums aside)."""
    ref = train_losses(tiny_config({"precision": "bf16"}), 3)
    res = run_distributed(_layouts_and_bytes, 2, timeout=180)
    for r in res:
        pp2, pp2_vp2, tp2 = r["layouts"]
        for got in (pp2, pp2_vp2):
            assert got["loss"][0] == ref["loss"][0]
            for a, b in zip(got["loss"], ref["loss"]):
                assert a == pytest.approx(b, rel=1e-4)
        for a, b in zip(tp2["loss"], ref["loss"]):
            assert a == pytest.approx(b, rel=1e-3)
        ratio = r["tp_bytes"]["bf16"] / r["tp_bytes"]["fp32"]
        assert 0.5 <= ratio < 0.52, r["tp_bytes"]


def _dept_bf16_worker(rank, world, variant):
    from tests.dept_utils import run_dept, source_infos
    from tests.dept_utils import tiny_config as dept_config
    cfg = dept_config({"precision": "bf16", "dept": {"variant": variant, "local_steps": 2}, "train": {"steps": 2}})
    seen = {}

    def flat(tr, params):
        return torch.cat([m.detach().reshape(-1).clone() for m in tr.main_params(params)])

    def after_round(r, hooks, tr):  # before the outer sync
        seen["body"] = flat(tr, tr.body_parameters())
        seen["emb"] = flat(tr, tr.embedding_parameters())

    def on_install(r, hooks, tr):
        if variant != "trim":
            return
        emb = tr.embeddings()[0]
        ids = hooks.sources[hooks.index[hooks.installed]].vocab_ids
        w = emb.word_embeddings.weight
        seen["trim_fill"] = (torch.equal(tr.main_params([w])[0][:ids.numel()], hooks.phi.gather(ids))
                             and torch.equal(w.data, w.main_param.to(torch.bfloat16)))

    out = run_dept(cfg, source_infos(2, trim=variant == "trim"), 1, after_round=after_round, on_install=on_install)
    tr = out["trainer"]
    body = tr.body_parameters()
    return {"pre": seen, "body": flat(tr, body), "emb": flat(tr, tr.embedding_parameters()),
            "weights_are_masters": all(torch.equal(p.data, p.main_param.to(p.dtype)) for p in tr.parameters()),
            "half": all(p.dtype == torch.bfloat16 for p in tr.parameters()), "losses": out["losses"]}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("variant", ["glob", "spec", "trim"])
def test_dept_outer_sync_averages_the_fp32_masters(variant):
    """precision bf16, 2 groups, FedAvg (lr 1): after a round the body's fp32 masters are the
    average of the groups' fp32 masters (not of their bf16 weights) and the bf16 weights are
    the rounded masters; GLOB's embeddings too; TRIM fills its compact rows into the masters."""
    res = run_distributed(_dept_bf16_worker, 2, args=(variant,), timeout=180)
    mean_body = (res[0]["pre"]["body"] + res[1]["pre"]["body"]) / 2
    assert not torch.equal(res[0]["pre"]["body"], res[1]["pre"]["body"])  # the groups trained differently
    for r in res:
        assert r["half"] and r["weights_are_masters"]
        torch.testing.assert_close(r["body"], mean_body, rtol=1e-6, atol=1e-7)
        if variant == "glob":
            torch.testing.assert_close(r["emb"], (res[0]["pre"]["emb"] + res[1]["pre"]["emb"]) / 2,
                                       rtol=1e-6, atol=1e-7)
        if variant == "trim":
            assert r["pre"]["trim_fill"]
    # the average of the bf16 weights is farther away than the test's tolerance
    bf16_mean = (res[0]["pre"]["body"].bfloat16().float() + res[1]["pre"]["body"].bfloat16().float()) / 2
    assert not torch.allclose(bf16_mean, mean_body, rtol=1e-6, atol=1e-7)


def _sharded_masters_worker(rank, world, variant):
    from tests.dept_utils import run_dept, source_infos
    from tests.dept_utils import tiny_config as dept_config
    # an odd width: buckets are padded, so the shards are not D near-equal chunks
    cfg = dept_config({"precision": "bf16", "parallel": {"data": 2},
                       "model": {"hidden_size": 15, "num_attention_heads": 3, "num_query_groups": 3,
                                 "ffn_hidden_size": 30},
                       "optim": {"distributed": True, "grad_bucket_size": 500},
                       "dept": {"variant": variant, "local_steps": 2}, "train": {"steps": 2}})
    seen = {}

    def own(hooks):  # this rank's chunk of every FlatSync: the fp32 masters it owns
        return {n: s.shards.read(torch.device("cpu")).clone() for n, s in hooks.outer_syncs().items()}

    def before(r, h, tr):
        seen["pre"], seen["counters"] = own(h), h.pg.comm.snapshot()

    def after(r, h, tr):
        from dept_mega.parallel.comm import total_over_ranks
        seen["post"] = own(h)
        now = h.pg.comm.snapshot()
        seen["sync_bytes"] = total_over_ranks({k: now[k] - seen["counters"][k] for k in now})

    infos = source_infos(2, trim=variant == "trim")
    out = run_dept(cfg, infos, 1, after_round=before, after_sync=after)
    tr, pg, hooks = out["trainer"], out["pg"], out["hooks"]
    consistent = True
    for sync in hooks.outer_syncs().values():
        for (a, b), m in zip(sync.ranges, sync.shards.mains):  # the weights are the rounded masters
            flat = torch.cat([p.data.reshape(-1) for p in sync.params])
            consistent &= torch.equal(flat[a:b], m.to(torch.bfloat16))
    from dept_mega.dept.costs import predict_outer_sync
    from tests.dept_utils import VOCAB
    return {"pre": seen["pre"], "post": seen["post"], "group": pg.group_index, "dp": pg.dp_rank,
            "sync_bytes": seen["sync_bytes"],
            "trim_vocabs": [int(infos[k].vocab_ids.numel()) for k in hooks.scheduler.plan(0).sources]
            if variant == "trim" else None,
            "predicted": predict_outer_sync(cfg, 2, global_vocab=VOCAB, trim_vocabs=[
                int(infos[k].vocab_ids.numel()) for k in hooks.scheduler.plan(0).sources] if variant == "trim" else None
            )["round"],
            "chunks": {n: s.chunk_numel for n, s in hooks.outer_syncs().items()},
            "numel": {n: s.numel for n, s in hooks.outer_syncs().items()}, "consistent": consistent,
            "weights": torch.cat([p.detach().reshape(-1).float() for p in tr.parameters()])}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("variant", ["glob", "trim"])
def test_dept_outer_sync_on_the_distributed_optimizers_master_shards(variant):
    """optim.distributed with bf16 weights (2 groups × D 2, GLOB, FedAvg lr 1): each rank's chunk
    of the outer sync is the fp32 masters it owns; after the sync they are the mean of the two
    groups' masters of the same pieces, the bf16 weights are those masters rounded, and every
    replica of every group holds the same weights; the bytes are dept_mega.dept.costs'."""
    res = run_distributed(_sharded_masters_worker, 4, args=(variant,), timeout=180)
    by = {(r["group"], r["dp"]): r for r in res}
    assert set(by) == {(g, d) for g in range(2) for d in range(2)}
    for name in res[0]["pre"]:
        # the chunks are the optimizer's shards: together they cover the FlatSync's values once
        assert by[0, 0]["chunks"][name] + by[0, 1]["chunks"][name] == res[0]["numel"][name]
        for d in range(2):
            a, b = by[0, d], by[1, d]
            assert not torch.equal(a["pre"][name], b["pre"][name])  # the groups trained differently
            mean = (a["pre"][name] + b["pre"][name]) / 2
            for r in (a, b):
                torch.testing.assert_close(r["post"][name], mean, rtol=1e-6, atol=1e-7)
    for r in res:
        assert r["consistent"]
        if variant == "glob":  # (TRIM's compact tables are the group's source's)
            assert torch.equal(r["weights"], res[0]["weights"])
    # the sync's bytes (Δ of the owned masters across groups, the bf16 pieces over dp) are the
    # prediction of dept_mega.dept.costs from the bucket layout
    got, pred = res[0]["sync_bytes"], res[0]["predicted"]
    if variant == "trim":  # (measured from the round's end: the round start's read of φ's rows is not in it)
        from dept_mega.dept.costs import trim_shard_gather_bytes
        pred = dict(pred, dp=pred["dp"] - trim_shard_gather_bytes(res[0]["trim_vocabs"], 15, 1, 2) // 2)
    for k in ("outer_body", "outer_embedding", "dp"):
        assert got[k] == pred[k], (k, got, pred)


# ----------------------------------------------------------------------------- resume

RESUME_RUNS = {
    "dist_bf16_fused": ("optim.distributed=true", "precision=bf16", "optim.fused=true", "optim.grad_bucket_size=3000"),
    "bf16_fused": ("precision=bf16", "optim.fused=true"),
    "dist_fp32": ("optim.distributed=true", "optim.grad_bucket_size=3000"),
    "fp32_fused": ("optim.fused=true",),
}


def _loop(cfg, pg, run_dir, rank):
    from dept_mega.checkpoint import Checkpointer
    from dept_mega.loop import StdHooks, TrainLoop
    from dept_mega.metrics import MetricsWriter
    from dept_mega.trainer import Trainer
    from tests.dept_utils import SyntheticSource
    trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=cfg.model.vocab_size)
    allowed = torch.arange(cfg.model.vocab_size)

    def make_iterator(name):
        return SyntheticSource(cfg, 3, allowed, pg.dp_rank, pg.dp_size)

    writer = MetricsWriter(run_dir, enabled=rank == 0, stream=io.StringIO())
    ck = Checkpointer(run_dir)
    return TrainLoop(cfg, pg, trainer, StdHooks(), writer, make_iterator, checkpointer=ck), ck


def _state(trainer):
    out = [p.detach().clone() for p in trainer.parameters()]
    for o in trainer.optimizers:
        for m, st in o.state.items():
            out += [m.detach().clone()] + [v.clone() for v in st.values()]
    return out


def _resume_worker(rank, world, root):
    from dept_mega.parallel.groups import build_groups
    pg = build_groups(1, 2, 1)
    out = {}
    for name, extra in RESUME_RUNS.items():
        run_dir = os.path.join(root, name)
        cfg = tiny_config({"train": {"steps": 4, "save_interval": 2, "eval_interval": 0, "log_interval": 100,
                                     "run_dir": run_dir}}, ("parallel.data=2",) + extra)
        loop, _ = _loop(cfg, pg, run_dir, rank)
        loop.run()
        full = _state(loop.trainer)
        loop2, ck = _loop(cfg, pg, run_dir, rank)
        ck.load(loop2, step=2)
        fused = [g["fused"] for o in loop2.trainer.optimizers for g in o.param_groups]
        loop2.run()
        resumed = _state(loop2.trainer)
        out[name] = {"same": len(full) == len(resumed) and all(torch.equal(a, b) for a, b in zip(full, resumed)),
                     "fused": fused}
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_is_bit_exact_with_sharded_or_half_precision_optimizer_state(tmp_path):
    """Save at step 2 of 4, resume in fresh processes' trainers: weights, fp32 masters and
    AdamW moments at step 4 equal the uninterrupted run's bit for bit — the distributed
    optimizer's per-rank shards, half-precision runs' masters, and fused AdamW (optim.fused:
    true, on CPU here) whose ``step`` must live where the fused kernel keeps it. A 1-rank
    launch loads the 2-rank distributed-optimizer checkpoint (its pieces joined and cut,
    dept_mega.optim_reshard; tests/test_reshard_optimizer.py checks the values), with the
    distributed optimizer or without; a layout that claims tensor shards the checkpoint lacks
    is an error naming the checkpoint and the tensor (another tensor size itself loads:
    tests/test_reshard.py)."""
    res = run_distributed(_resume_worker, 2, args=(str(tmp_path),), timeout=280)
    for r in res:
        for name, got in r.items():
            assert got["same"], name
            assert all(got["fused"]) == ("fused" in name), (name, got["fused"])
    from dept_mega.checkpoint import load_weights
    from dept_mega.parallel.groups import build_groups
    from dept_mega.trainer import Trainer
    run_dir = str(tmp_path / "dist_fp32")
    cfg = tiny_config({"train": {"run_dir": run_dir}}, RESUME_RUNS["dist_fp32"])
    trainer = Trainer(cfg, build_groups(), torch.device("cpu"), vocab_size=cfg.model.vocab_size)
    load_weights(trainer, run_dir, 2)  # D 2 -> 1, distributed
    moments = [v.clone() for st in trainer.body_optimizer.state.values() for k, v in st.items() if k == "exp_avg"]
    cfg_plain = tiny_config({"train": {"run_dir": run_dir}}, ("optim.grad_bucket_size=3000",))
    trainer = Trainer(cfg_plain, build_groups(), torch.device("cpu"), vocab_size=cfg.model.vocab_size)
    load_weights(trainer, run_dir, 2)  # D 2 -> 1, the plain optimizer
    plain = torch.cat([trainer.body_optimizer.state[p]["exp_avg"].reshape(-1) for p in trainer.body_optimizer.params])
    assert plain.abs().sum() > 0 and torch.equal(plain.sort().values, torch.cat(moments).sort().values)
    layout = tmp_path / "dist_fp32" / "checkpoints" / "step_2" / "layout.json"
    import json
    layout.write_text(json.dumps(dict(json.loads(layout.read_text()), tensor=2)))
    import shutil
    for f in layout.parent.glob("rng_tp0_pp0.pt"):
        shutil.copy(f, layout.parent / "rng_tp1_pp0.pt")
    from dept_mega.manifest import seal
    seal(str(layout.parent), 2)  # a sealed checkpoint whose layout.json claims 2 tensor shards
    # format 2 keys every box by its global tensor and offset: what layout.json claims does not
    # decide what is read (a missing box is an error naming the key: tests/test_checkpoint_format.py)
    load_weights(trainer, run_dir, 2)
    again = torch.cat([trainer.body_optimizer.state[p]["exp_avg"].reshape(-1) for p in trainer.body_optimizer.params])
    assert torch.equal(again, plain)
