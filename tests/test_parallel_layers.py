"""Tensor-parallel building blocks under TP=2 (gloo) against dense single-process references:
the autograd mappings, column/row-parallel linear, vocabulary-parallel embedding and cross
entropy (forward and gradients), byte counting, and the TP-independent initialisation."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dept_mega.parallel import mappings as M
from dept_mega.parallel.cross_entropy import vocab_parallel_cross_entropy
from dept_mega.parallel.groups import build_groups
from dept_mega.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from dept_mega.parallel.random import init_full_then_shard, shard_rows
from tests.model_utils import full_tensors, rel_err, unshard
from tests.mp_utils import run_distributed

TOL = 1e-6


def _data(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float()


# ----------------------------------------------------------------------------- mappings


def _mappings_worker(rank, world):
    pg = build_groups(tensor=world)
    x = _data(4, 3, 6)  # identical on every rank
    w = _data(4, 3, 6, seed=1)  # weights the output; identical on every rank
    res = {}

    def run(fn, inp, weight):
        inp = inp.clone().requires_grad_(True)
        pg.comm.reset()
        y = fn(inp)
        (y * weight).sum().backward()
        return y.detach(), inp.grad.detach(), pg.comm.snapshot()["tp"]

    xr = x * (rank + 1)  # a rank-dependent input for the reducing functions
    res["copy"] = run(lambda t: M.copy_to_tp_region(t, pg), x, w * (rank + 1))
    res["reduce"] = run(lambda t: M.reduce_from_tp_region(t, pg), xr, w)
    res["scatter"] = run(lambda t: M.scatter_to_tp_region(t, pg), x, w.chunk(world, -1)[rank])
    res["gather"] = run(lambda t: M.gather_from_tp_region(t, pg), x.chunk(world, -1)[rank], w)
    res["sp_scatter"] = run(lambda t: M.scatter_to_sequence_parallel_region(t, pg), x, w.chunk(world, 0)[rank])
    res["sp_gather"] = run(lambda t: M.gather_from_sequence_parallel_region(t, pg), x.chunk(world, 0)[rank],
                           w * (rank + 1))
    res["sp_gather_nored"] = run(lambda t: M.gather_from_sequence_parallel_region(t, pg, False),
                                 x.chunk(world, 0)[rank], w)
    res["sp_reduce_scatter"] = run(lambda t: M.reduce_scatter_to_sequence_parallel_region(t, pg), xr,
                                   w.chunk(world, 0)[rank])
    return res


@pytest.fixture(scope="module")
def mapping_results():
    return run_distributed(_mappings_worker, 2, timeout=120)


def test_mappings_forward_backward_and_bytes(mapping_results):
    x, w = _data(4, 3, 6), _data(4, 3, 6, seed=1)
    T, n = 2, 4 * 3 * 6 * 4  # bytes of a full fp32 tensor
    for rank, res in enumerate(mapping_results):
        y, g, b = res["copy"]
        assert torch.equal(y, x) and torch.allclose(g, w * 3) and b == n  # bwd all-reduce (1+2)
        y, g, b = res["reduce"]
        assert torch.allclose(y, x * 3) and torch.equal(g, w) and b == n
        y, g, b = res["scatter"]
        # each rank weights its own chunk, so the all-gathered grad is the whole w
        assert torch.equal(y, x.chunk(T, -1)[rank]) and torch.equal(g, w) and b == n // T
        y, g, b = res["gather"]
        assert torch.equal(y, x) and torch.equal(g, w.chunk(T, -1)[rank]) and b == n // T
        y, g, b = res["sp_scatter"]
        assert torch.equal(y, x.chunk(T, 0)[rank]) and torch.equal(g, w) and b == n // T
        y, g, b = res["sp_gather"]  # backward reduce-scatters (1+2)·w
        assert torch.equal(y, x) and torch.allclose(g, (w * 3).chunk(T, 0)[rank]) and b == n // T + n
        y, g, b = res["sp_gather_nored"]
        assert torch.equal(y, x) and torch.equal(g, w.chunk(T, 0)[rank]) and b == n // T
        y, g, b = res["sp_reduce_scatter"]
        assert torch.allclose(y, (x * 3).chunk(T, 0)[rank]) and torch.equal(g, w) and b == n + n // T


def test_mappings_are_identity_on_one_rank():
    pg = build_groups()
    x = _data(4, 2, 6)
    for fn in (M.copy_to_tp_region, M.reduce_from_tp_region, M.scatter_to_tp_region, M.gather_from_tp_region,
               M.scatter_to_sequence_parallel_region, M.gather_from_sequence_parallel_region,
               M.reduce_scatter_to_sequence_parallel_region):
        assert fn(x, pg) is x
    assert pg.comm.snapshot()["tp"] == 0


# ----------------------------------------------------------------------------- layers


def _swiglu(h):
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


LAYER_CASES = [(False, True), (True, True), (True, False)]  # (sequence_parallel, bias)


def _layers_worker(rank, world):
    pg = build_groups(tensor=world)
    return {case: _layers_case(rank, world, pg, *case) for case in LAYER_CASES}


def _layers_case(rank, world, pg, sp, bias):
    torch.manual_seed(0)
    s, b, h, out = 8, 2, 12, 16
    x = _data(s, b, h, seed=3)
    gy = _data(s, b, out, seed=4)
    res = {}
    # column (stride 2: the SwiGLU [gate; up] layout) -> swiglu -> row, the MLP pattern
    col = ColumnParallelLinear(h, 2 * out, pg, name="c", seed=5, init_std=0.3, bias=bias, sequence_parallel=sp,
                               stride=2)
    row = RowParallelLinear(out, out, pg, name="r", seed=5, init_std=0.3, bias=bias, sequence_parallel=sp)
    xin = (x.chunk(world, 0)[rank] if sp else x).clone().requires_grad_(True)
    y = row(_swiglu(col(xin)))
    target = gy.chunk(world, 0)[rank] if sp else gy
    (y * target).sum().backward()
    mod = torch.nn.ModuleDict({"col": col, "row": row})
    if sp and bias:  # the trainer's job under sequence parallelism
        torch.distributed.all_reduce(row.bias.grad, group=pg.tp)
    res["mlp"] = (y.detach(), xin.grad.detach(), full_tensors(mod, pg), full_tensors(mod, pg, grads=True))
    # column with gather_output, row with a full (non-parallel) input
    if not sp:
        col2 = ColumnParallelLinear(h, out, pg, name="c2", seed=5, init_std=0.3, bias=bias, gather_output=True)
        row2 = RowParallelLinear(out, h, pg, name="r2", seed=5, init_std=0.3, bias=bias, input_is_parallel=False)
        xin2 = x.clone().requires_grad_(True)
        y2 = row2(col2(xin2))
        (y2 * x).sum().backward()
        mod2 = torch.nn.ModuleDict({"col": col2, "row": row2})
        res["gathered"] = (y2.detach(), xin2.grad.detach(), full_tensors(mod2, pg, grads=True))
    return res


@pytest.fixture(scope="module")
def layer_results():
    return run_distributed(_layers_worker, 2, timeout=120)


@pytest.mark.parametrize("sp,bias", LAYER_CASES)
def test_column_row_parallel_match_dense(layer_results, sp, bias):
    results = [r[(sp, bias)] for r in layer_results]
    s, b, h, out = 8, 2, 12, 16
    x, gy = _data(s, b, h, seed=3), _data(s, b, out, seed=4)
    wc = init_full_then_shard("c.weight", (2 * out, h), 5, std=0.3)
    wr = init_full_then_shard("r.weight", (out, out), 5, std=0.3)
    bc = torch.zeros(2 * out, requires_grad=True) if bias else None
    br = torch.zeros(out, requires_grad=True) if bias else None
    wc.requires_grad_(True)
    wr.requires_grad_(True)
    xr = x.clone().requires_grad_(True)
    y = F.linear(_swiglu(F.linear(xr, wc, bc)), wr, br)
    (y * gy).sum().backward()
    for rank, res in enumerate(results):
        y_tp, gx, params, grads = res["mlp"]
        ref_y = y.detach().chunk(2, 0)[rank] if sp else y.detach()
        ref_gx = xr.grad.chunk(2, 0)[rank] if sp else xr.grad
        assert rel_err(y_tp, ref_y) < TOL and rel_err(gx, ref_gx) < TOL
        assert torch.equal(params["col.weight"], wc.detach()) and torch.equal(params["row.weight"], wr.detach())
        assert rel_err(grads["col.weight"], wc.grad) < TOL and rel_err(grads["row.weight"], wr.grad) < TOL
        if bias:
            assert rel_err(grads["col.bias"], bc.grad) < TOL and rel_err(grads["row.bias"], br.grad) < TOL
    if not sp:
        wc2 = init_full_then_shard("c2.weight", (out, h), 5, std=0.3).requires_grad_(True)
        wr2 = init_full_then_shard("r2.weight", (h, out), 5, std=0.3).requires_grad_(True)
        xr2 = x.clone().requires_grad_(True)
        y2 = F.linear(F.linear(xr2, wc2), wr2)
        (y2 * x).sum().backward()
        for res in results:
            y_tp, gx, grads = res["gathered"]
            assert rel_err(y_tp, y2.detach()) < TOL and rel_err(gx, xr2.grad) < TOL
            assert rel_err(grads["col.weight"], wc2.grad) < TOL and rel_err(grads["row.weight"], wr2.grad) < TOL


# ----------------------------------------------------------------------------- vocab-parallel


VOCAB_CASES = [100, 50]  # padded to 128; with 50 the second TP=2 shard is all padding


def _vocab_worker(rank, world):
    pg = build_groups(tensor=world)
    return {vocab: _vocab_case(rank, world, pg, vocab, 128) for vocab in VOCAB_CASES}


def _vocab_case(rank, world, pg, vocab, padded):
    ids = torch.randint(0, vocab, (5, 3), generator=torch.Generator().manual_seed(9))
    emb = VocabParallelEmbedding(padded, 8, pg, name="e", seed=1, init_std=1.0)
    out = emb(ids)
    (out * _data(5, 3, 8, seed=2)).sum().backward()
    emb_grad = full_tensors(emb, pg, grads=True)["weight"]
    # cross entropy on this rank's columns; padded columns are -inf
    logits = _data(5, 3, padded, seed=4) * 4
    logits[..., vocab:] = float("-inf")
    shard = logits.chunk(world, -1)[rank].clone().requires_grad_(True)
    pg.comm.reset()
    loss = vocab_parallel_cross_entropy(shard, ids, pg)
    bytes_fwd = pg.comm.snapshot()["tp"]
    (loss * _data(5, 3, seed=5)).sum().backward()
    # the model's way: padded columns hold whatever the head computed (here large values that
    # would dominate the sum), ``vocab_size`` masks them, the backward overwrites the logits
    raw = logits.masked_fill(logits.isinf(), 30.0).chunk(world, -1)[rank].clone().requires_grad_(True)
    pg.comm.reset()
    loss_v = vocab_parallel_cross_entropy(raw * 1.0, ids, pg, vocab_size=vocab, consume_logits=True)
    bytes_v = pg.comm.snapshot()["tp"]
    (loss_v * _data(5, 3, seed=5)).sum().backward()
    return (out.detach(), emb_grad, loss.detach(), shard.grad.detach(), bytes_fwd,
            loss_v.detach(), raw.grad.detach(), bytes_v)


@pytest.fixture(scope="module")
def vocab_results():
    return {1: [_vocab_worker(0, 1)], 2: run_distributed(_vocab_worker, 2, timeout=120)}


@pytest.mark.parametrize("vocab", VOCAB_CASES)
@pytest.mark.parametrize("world", [1, 2])
def test_vocab_parallel_embedding_and_cross_entropy(vocab_results, world, vocab):
    padded = 128
    results = [r[vocab] for r in vocab_results[world]]
    ids = torch.randint(0, vocab, (5, 3), generator=torch.Generator().manual_seed(9))
    table = init_full_then_shard("e.weight", (padded, 8), 1, std=1.0).requires_grad_(True)
    ref = F.embedding(ids, table)
    (ref * _data(5, 3, 8, seed=2)).sum().backward()
    logits = (_data(5, 3, padded, seed=4) * 4)[..., :vocab].clone().requires_grad_(True)
    ref_loss = F.cross_entropy(logits.view(-1, vocab), ids.view(-1), reduction="none").view(5, 3)
    (ref_loss * _data(5, 3, seed=5)).sum().backward()
    ref_grad = torch.cat([logits.grad, torch.zeros(5, 3, padded - vocab)], -1)
    for rank, (out, emb_grad, loss, gshard, bytes_fwd, loss_v, gshard_v, bytes_v) in enumerate(results):
        assert rel_err(out, ref.detach()) < TOL and rel_err(emb_grad, table.grad) < TOL
        for lo, g, nbytes in ((loss, gshard, bytes_fwd), (loss_v, gshard_v, bytes_v)):
            assert lo.dtype == torch.float32
            assert rel_err(lo, ref_loss.detach()) < TOL
            assert torch.isfinite(g).all()
            assert rel_err(g, ref_grad.chunk(world, -1)[rank]) < TOL
            # three reductions of per-token scalars (max; target + sum-exp stacked), never the logits
            assert nbytes == (0 if world == 1 else 15 * 4 * 3)


# ----------------------------------------------------------------------------- init


def test_shard_rows_roundtrip_with_stride():
    full = torch.arange(48.0).view(12, 4)
    for world in (1, 2, 3):
        for stride in (1, 2):
            if 12 % (world * stride):
                continue
            shards = [shard_rows(full, 0, r, world, stride) for r in range(world)]
            assert torch.equal(unshard(shards, 0, stride), full)
    gate, up = full.chunk(2, 0)
    assert torch.equal(shard_rows(full, 0, 1, 2, 2), torch.cat([gate[3:], up[3:]]))


def _init_worker(rank, world):
    from dept_mega.model import build_model
    from tests.model_utils import tiny_config
    pg = build_groups(tensor=world)
    cfg = tiny_config(parallel={"tensor": world}, activation="swiglu", tie_embeddings=False,
                      bias=True, position_embedding="learned")
    (stage,) = build_model(cfg, pg, 200, 11, "cpu")
    full = full_tensors(stage, pg)  # collective: every rank takes part
    return full if rank == 0 else None


@pytest.mark.slow
def test_init_full_weights_identical_for_tp_1_2_4():
    ref = None
    for world in (1, 2, 4):
        full = run_distributed(_init_worker, world, timeout=180)[0]
        if ref is None:
            ref = full
            continue
        assert set(full) == set(ref)
        for k in ref:
            assert torch.equal(full[k], ref[k]), f"{k} differs between TP=1 and TP={world}"
