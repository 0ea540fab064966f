"""predict_outer_round_bytes equals what the outer-sync building blocks of dept_mega/dept
(FlatSync, exchange_rows) count on a real model's parameters, summed over 4 gloo ranks.

The whole round (driver + trainer) is checked against the same prediction by the DEPT tests;
this one pins the counting rules per layout: T 2 (replicated parameters), D 2 (split and
re-gather), P 2 (the tied table's last-stage copy), fp32 and bf16 on the wire, and TRIM's
reads of V_k's rows from φ's row shards (T·D > 1).
"""
from __future__ import annotations

import pytest
import torch

from dept_mega.config import config_from_dict
from dept_mega.dept.costs import padded_vocab, predict_outer_round_bytes
from dept_mega.dept.outer import FlatSync, OuterOptimizer, chunk_bounds
from dept_mega.dept.trim import TrimTable, exchange_rows
from dept_mega.model.gpt import build_model
from dept_mega.parallel.comm import total_over_ranks
from dept_mega.parallel.groups import build_groups

from .mp_utils import run_distributed

TRIM_V = (37, 70)  # |V_k| of the two groups' sources
GLOBAL_V = 100


def _cfg(variant, tensor, data, pipeline, dtype, **model):
    return config_from_dict({
        "model": {"num_layers": 2, "hidden_size": 16, "num_attention_heads": 4, "seq_length": 8,
                  "position_embedding": "learned", "bias": True, **model},
        "parallel": {"tensor": tensor, "data": data, "pipeline": pipeline},
        "dept": {"variant": variant, "local_steps": 1, "outer_comm_dtype": dtype},
        "precision": "fp32", "backend": "local",
        "train": {"steps": 1, "micro_batch_size": 1, "global_batch_size": data}})


def _delta(pg, before):
    after = pg.comm.snapshot()
    return {k: after[k] - before[k] for k in after}


def _measure(rank, world_size, layouts):
    torch.set_num_threads(1)
    out = []
    for tensor, data, pipeline, dtype, tied in layouts:
        cfg = _cfg("glob", tensor, data, pipeline, dtype, tie_embeddings=tied)
        pg = build_groups(tensor, data, pipeline)
        g = pg.coords.group
        stages = build_model(cfg, pg, GLOBAL_V, seed=3)
        body = [p for st in stages for n, p in st.named_parameters() if n.startswith("body.")]
        emb = list({id(p): p for st in stages for n, p in st.named_parameters()
                    if n.startswith("embeddings.")}.values())
        syncs = {"body": FlatSync(body, pg, OuterOptimizer("fedavg"), "outer_body", dtype),
                 "emb": FlatSync(emb, pg, OuterOptimizer("fedavg"), "outer_embedding", dtype)}
        with torch.no_grad():
            for p in body + emb:
                p.add_(0.01 * (g + 1))
        measured = {}
        for name, sync in syncs.items():
            before = pg.comm.snapshot()
            sync.sync()
            measured[name] = total_over_ranks(_delta(pg, before))
        # TRIM: each rank holding a table sends the real rows of its TP slice of the compact table
        before = pg.comm.snapshot()
        n_real = TRIM_V[g]
        vp = padded_vocab(n_real)
        rows = vp // tensor
        for st in stages:
            emb_mod = st.embeddings
            if emb_mod is None:
                continue
            kinds = [m for m in (emb_mod.word_embeddings, emb_mod.output_layer) if m is not None]
            for _ in kinds:
                # φ row-sharded over the stage's tp × dp ranks: read V_k's rows at the round's
                # start (fill) and end (Δ), as TrimStrategy does
                phi = TrimTable(torch.randn(2 * n_real + 2, 16), pg=pg, group=pg.tp_dp,
                                index=pg.dp_rank * pg.tp_size + pg.tp_rank, parts=pg.tp_size * pg.dp_size)
                v_k = torch.arange(n_real, dtype=torch.int64) * 2 + g
                phi.gather(v_k)
                phi.gather(v_k)
                a, b = min(pg.tp_rank * rows, n_real), min((pg.tp_rank + 1) * rows, n_real)
                ids = torch.arange(a, b, dtype=torch.int64) * 2 + g
                exchange_rows(pg, ids, torch.randn(b - a, 16), comm_dtype=dtype)
        measured["trim"] = total_over_ranks(_delta(pg, before))
        out.append(measured)
    return out


LAYOUTS = [  # (tensor, data, pipeline, dtype, tied): G = 4 / (T·D·P) = 2 in each
    (2, 1, 1, "fp32", True),
    (1, 2, 1, "bf16", True),
    (1, 1, 2, "fp32", True),
    (1, 1, 2, "bf16", False),
    (1, 2, 1, "int8", False),  # quantised: packed chunks (payload + scales), TRIM's rows too
    (2, 1, 1, "int4", True),
]


@pytest.mark.slow
def test_predicted_bytes_equal_counted():
    res = run_distributed(_measure, world_size=4, args=(LAYOUTS,), timeout=300)
    measured = res[0]  # every rank returns the same job totals
    for i, (tensor, data, pipeline, dtype, tied) in enumerate(LAYOUTS):
        label = f"T{tensor} D{data} P{pipeline} {dtype} tied={tied}"
        got = measured[i]
        spec = predict_outer_round_bytes(_cfg("spec", tensor, data, pipeline, dtype, tie_embeddings=tied), 2)
        glob = predict_outer_round_bytes(_cfg("glob", tensor, data, pipeline, dtype, tie_embeddings=tied), 2,
                                         global_vocab=GLOBAL_V)
        trim_cfg = _cfg("trim", tensor, data, pipeline, dtype, tie_embeddings=tied, position_embedding="alibi")
        trim = predict_outer_round_bytes(trim_cfg, 2, trim_vocabs=list(TRIM_V))
        # body: outer_body and the dp re-gather
        assert got["body"]["outer_body"] == spec["outer_body"], label
        assert got["body"]["dp"] == spec["dp"], label
        # GLOB embeddings (tables + learned positions) on top of the body
        assert got["emb"]["outer_embedding"] == glob["outer_embedding"], label
        assert got["emb"]["dp"] == glob["dp"] - spec["dp"], label
        # TRIM rows: with ALiBi there are no positions, so all of it is the rows
        assert got["trim"]["outer_embedding"] == trim["outer_embedding"], label
        assert got["trim"]["dp"] == trim["dp"] - spec["dp"], label
        assert got["trim"]["tp"] == trim["tp"], label
        for part in ("body", "emb", "trim"):
            assert got[part]["source_move"] == 0 and got[part]["pp"] == 0, label
    # the rows really are smaller than a dense table would be
    assert measured[0]["trim"]["outer_embedding"] < measured[0]["emb"]["outer_embedding"]


def test_chunks_add_up():
    """The prediction assumes D chunks that add up to the shard exactly (outer.chunk_bounds)."""
    for n in (0, 1, 7, 100):
        for parts in (1, 2, 3, 8):
            bounds = [chunk_bounds(n, parts, i) for i in range(parts)]
            assert sum(b - a for a, b in bounds) == n
