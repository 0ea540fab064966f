"""Single-process model tests: the math against a naive reference, padded vocabulary, the
pipeline split and its init, embedding swapping, positions, backends and their errors, and
the dropout RNG streams."""
from __future__ import annotations

import math

import pytest
import torch

from dept_mega.config import config_from_dict
from dept_mega.model import (BackendError, SourceEmbeddings, TransformerBody, build_model,
                             build_source_embeddings, chunk_layout, describe_backends, padded_vocab_size,
                             resolve_backends)
from dept_mega.model.positions import RotaryEmbedding, alibi_slopes, local_alibi_slopes
from dept_mega.parallel.groups import Coords, ParallelGroups, build_groups
from dept_mega.parallel.random import RNGTracker, dropout, init_full_then_shard, stable_seed
from tests.model_utils import full_tensors, reference_losses, rel_err, tiny_config

VOCAB = 200


def _batch(cfg, vocab=VOCAB, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab, (2, cfg.model.seq_length), generator=g),
            torch.randint(0, vocab, (2, cfg.model.seq_length), generator=g))


OPTIONS = {
    "default": dict(),
    "rmsnorm-swiglu-rope-gqa-untied": dict(normalization="rmsnorm", activation="swiglu", position_embedding="rope",
                                           num_query_groups=2, tie_embeddings=False),
    "learned-bias": dict(position_embedding="learned", bias=True),
    "alibi-6-heads-mqa": dict(hidden_size=48, num_attention_heads=6, num_query_groups=1),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_model_matches_naive_reference(name):
    # a large init std so activations leave the near-linear range (gelu variants differ there)
    cfg = tiny_config(init_method_std=0.3, **OPTIONS[name])
    (stage,) = build_model(cfg, build_groups(), VOCAB, 3, "cpu")
    tokens, labels = _batch(cfg)
    losses = stage(tokens, labels)
    ref = reference_losses(cfg, full_tensors(stage, build_groups()), tokens, labels, VOCAB)
    assert losses.dtype == torch.float32 and losses.shape == (2, cfg.model.seq_length)
    assert rel_err(losses, ref) < 1e-5


def test_padded_vocabulary_takes_no_probability_mass():
    cfg = tiny_config(tie_embeddings=False)
    (stage,) = build_model(cfg, build_groups(), VOCAB, 3, "cpu")
    emb = stage.embeddings
    assert (emb.vocab_size, emb.padded_vocab_size) == (200, 256)
    assert stage.vocab_size == 200
    tokens, labels = _batch(cfg)
    logits = stage(tokens)
    assert logits.shape == (2, cfg.model.seq_length, 256)
    assert torch.isneginf(logits[..., 200:]).all() and torch.isfinite(logits[..., :200]).all()
    # the loss is the softmax over the true vocabulary only
    ref = torch.nn.functional.cross_entropy(logits[..., :200].reshape(-1, 200), labels.reshape(-1),
                                            reduction="none").view(labels.shape)
    assert rel_err(stage(tokens, labels), ref) < 1e-6
    stage(tokens, labels).mean().backward()
    assert not emb.output_layer.weight.grad[200:].any()  # padded rows get no gradient
    assert emb.output_layer.weight.grad[:200].abs().sum() > 0


def test_padded_vocab_size_rules():
    assert padded_vocab_size(1, 1) == 128 and padded_vocab_size(128, 4) == 128 and padded_vocab_size(129, 2) == 256
    with pytest.raises(ValueError, match="not divisible by parallel.tensor=3"):
        padded_vocab_size(200, 3)
    with pytest.raises(ValueError, match="positive"):
        padded_vocab_size(0, 1)


# ----------------------------------------------------------------------------- pipeline split


def _fake_pg(pp_rank, pp_size):
    """Coordinates of a pipeline stage without process groups (construction needs no comm)."""
    return ParallelGroups(tp_size=1, dp_size=1, pp_size=pp_size, num_groups=1, rank=pp_rank,
                          coords=Coords(tp=0, dp=0, pp=pp_rank, group=0))


def test_chunk_layout_is_megatron_interleaved():
    assert chunk_layout(8, 2, 2, 0) == [[0, 1], [4, 5]]
    assert chunk_layout(8, 2, 2, 1) == [[2, 3], [6, 7]]
    assert chunk_layout(4, 1, 1, 0) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="not divisible"):
        chunk_layout(6, 2, 2, 0)


@pytest.mark.parametrize("tied", [True, False])
def test_pipeline_chunks_hold_the_same_weights_as_one_stage(tied):
    base = dict(num_layers=8, tie_embeddings=tied, position_embedding="learned")
    (whole,) = build_model(tiny_config(**base), build_groups(), VOCAB, 5, "cpu")
    ref = dict(whole.named_parameters())
    cfg = tiny_config(parallel={"pipeline": 2, "virtual_pipeline": 2}, **base)
    seen = set()
    for p in range(2):
        stages = build_model(cfg, _fake_pg(p, 2), VOCAB, 5, "cpu")
        assert len(stages) == 2
        for c, st in enumerate(stages):
            assert st.is_first == (p == 0 and c == 0) and st.is_last == (p == 1 and c == 1)
            assert st.body.layer_ids == [2 * (c * 2 + p), 2 * (c * 2 + p) + 1]
            assert (st.body.final_norm is not None) == st.is_last
            for n, t in st.named_parameters():
                assert torch.equal(t, ref[n]), n
                seen.add(n)
            shared = st.shared_embedding_params()
            if tied and (st.is_first or st.is_last):
                assert shared == [st.embeddings.word_embeddings.weight]
            else:
                assert shared == []
    assert seen == set(ref)
    assert whole.shared_embedding_params() == []  # one stage: the tied weight is one parameter


def test_middle_chunk_passes_hidden_states():
    cfg = tiny_config(num_layers=3, parallel={"pipeline": 3})
    stages = [build_model(cfg, _fake_pg(p, 3), VOCAB, 5, "cpu")[0] for p in range(3)]
    (whole,) = build_model(tiny_config(num_layers=3), build_groups(), VOCAB, 5, "cpu")
    tokens, labels = _batch(cfg)
    assert stages[1].embeddings is None
    h = stages[0](tokens)
    assert h.shape == (cfg.model.seq_length, 2, cfg.model.hidden_size)
    losses = stages[2](stages[1](h), labels)
    # stage 2's tied head is a copy of stage 0's word embedding: same numbers as one stage
    assert rel_err(losses, whole(tokens, labels)) < 1e-6


# ----------------------------------------------------------------------------- embeddings swap


def test_swap_source_embeddings_keeps_the_body():
    cfg = tiny_config()
    (stage,) = build_model(cfg, build_groups(), VOCAB, 5, "cpu")
    body_before = {n: p.clone() for n, p in stage.body.named_parameters()}
    (other,) = build_source_embeddings(cfg, build_groups(), 300, seed=99)
    assert other.vocab_size == 300 and other.padded_vocab_size == 384
    old = stage.set_embeddings(other)
    assert old.vocab_size == VOCAB and stage.vocab_size == 300
    assert other.rng is stage.rng  # dropout streams follow the stage
    tokens, labels = _batch(cfg, vocab=300)
    stage(tokens, labels).mean().backward()
    assert all(torch.equal(body_before[n], p) for n, p in stage.body.named_parameters())
    names = [n for n, _ in stage.named_parameters()]
    assert all(n.startswith(("body.", "embeddings.")) for n in names)
    # a source's embeddings are reproducible from its seed and differ between seeds
    (again,) = build_source_embeddings(cfg, build_groups(), 300, seed=99)
    (third,) = build_source_embeddings(cfg, build_groups(), 300, seed=98)
    assert torch.equal(again.word_embeddings.weight, other.word_embeddings.weight.detach())
    assert not torch.equal(third.word_embeddings.weight, again.word_embeddings.weight)
    with pytest.raises(ValueError, match="need embeddings"):
        stage.set_embeddings(None)
    with pytest.raises(ValueError, match="has_input"):
        stage.set_embeddings(SourceEmbeddings(cfg.model, build_groups(), 100, 1, False, True))


def test_body_layers_are_keyed_by_global_id():
    cfg = tiny_config(num_layers=6)
    body = TransformerBody(cfg.model, build_groups(), [4, 5], final_norm=True, seed=3)
    assert [n.split(".")[1] for n, _ in body.named_parameters() if n.startswith("layers.")][0] == "4"
    (whole,) = build_model(cfg, build_groups(), VOCAB, 3, "cpu")
    ref = dict(whole.body.named_parameters())
    assert all(torch.equal(p, ref[n]) for n, p in body.named_parameters())
    x = torch.randn(cfg.model.seq_length, 2, cfg.model.hidden_size)
    assert body(x).shape == x.shape
    with pytest.raises(ValueError, match="outside model.num_layers"):
        TransformerBody(cfg.model, build_groups(), [6], final_norm=False, seed=3)


def test_output_projections_get_scaled_init():
    cfg = tiny_config(num_layers=8, hidden_size=64, ffn_hidden_size=256)
    (stage,) = build_model(cfg, build_groups(), VOCAB, 3, "cpu")
    p = dict(stage.named_parameters())
    std = cfg.model.init_method_std
    scaled = std / math.sqrt(2 * 8)
    assert abs(p["body.layers.0.attention.qkv.weight"].std().item() - std) < 0.1 * std
    assert abs(p["body.layers.0.attention.proj.weight"].std().item() - scaled) < 0.1 * scaled
    assert abs(p["body.layers.0.mlp.fc2.weight"].std().item() - scaled) < 0.1 * scaled
    assert torch.equal(p["body.layers.0.input_norm.weight"], torch.ones(64))
    assert p["body.layers.0.input_norm.weight"].tensor_parallel is False
    # different names draw different numbers; the same name the same ones
    assert not torch.equal(p["body.layers.0.attention.qkv.weight"], p["body.layers.1.attention.qkv.weight"])
    a = init_full_then_shard("x", (4, 4), 1, std=1.0)
    assert torch.equal(a, init_full_then_shard("x", (4, 4), 1, std=1.0))
    assert stable_seed(1, "x") != stable_seed(2, "x")


# ----------------------------------------------------------------------------- positions


def test_alibi_slopes():
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    torch.testing.assert_close(alibi_slopes(4), torch.tensor([2.0 ** -(2 * (i + 1)) for i in range(4)]))
    six = alibi_slopes(6)  # 4 slopes of n=4, then every other slope of n=8
    torch.testing.assert_close(six, torch.cat([alibi_slopes(4), alibi_slopes(8)[0::2][:2]]))
    torch.testing.assert_close(torch.cat([local_alibi_slopes(8, r, 4) for r in range(4)]), alibi_slopes(8))


def test_rope_scores_depend_on_relative_position_only():
    rope = RotaryEmbedding(8)
    q = torch.randn(1, 1, 1, 8).expand(6, 1, 1, 8)
    k = torch.randn(1, 1, 1, 8).expand(6, 1, 1, 8)
    rq, rk = rope.apply(q)[:, 0, 0], rope.apply(k)[:, 0, 0]
    scores = rq @ rk.t()
    torch.testing.assert_close(scores[3, 1], scores[5, 3])
    torch.testing.assert_close(scores[2, 2], scores[0, 0])
    torch.testing.assert_close(rope.apply(q)[0], q[0])  # position 0 is not rotated
    with pytest.raises(ValueError, match="even"):
        RotaryEmbedding(7)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])])
@pytest.mark.slow
def test_compiled_rope_equals_the_eager_math_with_gradients(device):
    """RoPE runs compiled on CUDA (positions._ROPE); on the CPU the same function
    compiled by inductor gives the eager math's outputs and input gradients (bf16 inputs:
    within one bf16 rounding of the eager result, fp32 math inside)."""
    from dept_mega.model import positions
    rope = RotaryEmbedding(16)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, 2, 3, 16, generator=g).to(device, torch.bfloat16).requires_grad_()
    gy = torch.randn(12, 2, 3, 16, generator=g).to(device, torch.bfloat16)
    cos, sin = rope.tables(12, x.device)
    outs = []
    for fn in (positions.rope_math, positions._ROPE.compiled):
        y = fn(x, cos, sin)
        (gx,) = torch.autograd.grad(y, x, gy)
        outs.append((y.float(), gx.float()))
    (y0, g0), (y1, g1) = outs
    torch.testing.assert_close(y1, y0, rtol=8e-3, atol=1e-2)
    torch.testing.assert_close(g1, g0, rtol=8e-3, atol=1e-2)
    want = x.detach().float()
    half = 8
    rotated = torch.cat([-want[..., half:], want[..., :half]], dim=-1)
    torch.testing.assert_close(y1, (want * cos + rotated * sin).bfloat16().float(), rtol=8e-3, atol=1e-2)


# ----------------------------------------------------------------------------- backends


def test_backend_description_and_errors():
    line = describe_backends(tiny_config())
    assert "linear=torch" in line and "norm=torch" in line and "\n" not in line
    assert "attention=torch-sdpa+materialised-bias" in line  # ALiBi on CPU under auto
    assert resolve_backends(tiny_config(position_embedding="rope")).attention.kind == "sdpa"
    try:
        import transformer_engine.pytorch  # noqa: F401
        have_te = True
    except ImportError:
        have_te = False
    cfg = config_from_dict({"model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                                      "seq_length": 16}, "backend": "transformer_engine"})
    with pytest.raises(BackendError, match="transformer_engine"):
        build_model(cfg, build_groups(), VOCAB, 1, "cpu")  # not installed here, or not CUDA
    if not have_te:
        with pytest.raises(BackendError, match="not installed"):
            resolve_backends(cfg)
    # fp8 with backend auto and no Transformer Engine: the native FP8 path, said in the log
    cfg = config_from_dict({"model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                                      "seq_length": 16}, "fp8": "hybrid", "precision": "bf16"})
    b = resolve_backends(cfg)
    assert b.linear == "fp8-native" and b.fp8_layers == (0, 1)
    assert "native fp8 (torch._scaled_mm, torch casts) hybrid, delayed scaling" in b.describe()  # CPU: torch casts


# ----------------------------------------------------------------------------- dropout


def test_rng_streams():
    t0, t1 = RNGTracker(5, tp_rank=0), RNGTracker(5, tp_rank=1)
    draw = lambda t, tp: torch.rand(4, generator=t.generator(tp))  # noqa: E731
    assert torch.equal(draw(t0, False), draw(t1, False))  # replicated regions: same masks
    assert not torch.equal(draw(t0, True), draw(t1, True))  # tensor-split regions: different
    other_stage = RNGTracker(5, tp_rank=0, pp_rank=1)
    assert not torch.equal(draw(RNGTracker(5), False), draw(other_stage, False))
    state = t0.state_dict()
    a = draw(t0, True)
    t0.load_state_dict(state)
    assert torch.equal(a, draw(t0, True))
    # forking the device RNG for SDPA dropout leaves the global stream untouched
    torch.manual_seed(0)
    expect = torch.rand(3)
    torch.manual_seed(0)
    with t0.fork_device_rng(tensor_parallel=True):
        torch.rand(10)
    assert torch.equal(torch.rand(3), expect)


def test_dropout_function():
    x = torch.ones(1000)
    t = RNGTracker(1)
    assert dropout(x, 0.5, False, t, False) is x
    y = dropout(x, 0.5, True, t, False)
    assert set(y.unique().tolist()) <= {0.0, 2.0} and 350 < int((y == 0).sum()) < 650
    with pytest.raises(ValueError, match="RNGTracker"):
        dropout(x, 0.5, True, None, False)


def test_model_dropout_is_seeded_and_only_in_training():
    cfg = tiny_config(hidden_dropout=0.2, attention_dropout=0.2)
    tokens, labels = _batch(cfg)

    def losses(seed, train):
        (stage,) = build_model(cfg, build_groups(), VOCAB, seed, "cpu")
        stage.train(train)
        return stage(tokens, labels).detach()

    a, b = losses(1, True), losses(1, True)
    assert torch.equal(a, b)  # same seed, same masks
    assert not torch.equal(a, losses(1, False))
    assert torch.equal(losses(1, False), losses(1, False))
    # attention dropout alone changes the result (the SDPA dropout path is live)
    cfg_attn = tiny_config(attention_dropout=0.5)
    (st,) = build_model(cfg_attn, build_groups(), VOCAB, 1, "cpu")
    train_loss = st(tokens, labels).detach()
    st.eval()
    assert not torch.equal(train_loss, st(tokens, labels).detach())


def test_deepcopy_shares_groups_and_rng_but_copies_weights():
    import copy
    pg = build_groups()
    (stage,) = build_model(tiny_config(), pg, VOCAB, 1, "cpu")
    clone = copy.deepcopy(stage)
    assert clone.embeddings.pg is pg and clone.body.layers["0"].attention.qkv.pg is pg
    assert clone.rng is stage.rng
    w = clone.embeddings.word_embeddings.weight
    assert w is not stage.embeddings.word_embeddings.weight and torch.equal(w, stage.embeddings.word_embeddings.weight)
    # nn.Parameter's deepcopy drops Python attributes; copy_parallel_attributes restores them
    from dept_mega.parallel.layers import copy_parallel_attributes
    assert not hasattr(w, "tensor_parallel")
    copy_parallel_attributes(stage, clone)
    assert w.tensor_parallel is False and w.partition_dim == 0 and w.sequence_parallel is False


def test_activation_shape():
    from dept_mega.model import activation_shape
    cfg = tiny_config(parallel={"tensor": 2, "sequence_parallel": True})
    pg2 = ParallelGroups(tp_size=2, dp_size=1, pp_size=1, num_groups=1, rank=0, coords=Coords(0, 0, 0, 0))
    assert activation_shape(cfg, pg2, 3) == (8, 3, 32)
    assert activation_shape(tiny_config(), build_groups(), 3) == (16, 3, 32)


def test_layernorm_without_bias_is_torch_layernorm_without_bias():
    """model.norm_bias: false — LayerNorm has a weight only (MPT's), and no 'bias' parameter."""
    from dept_mega.model.layers import Norm
    n = Norm("layernorm", 16, 1e-5, name="x", seed=0, bias=False)
    assert n.bias is None and [name for name, _ in n.named_parameters()] == ["weight"]
    with torch.no_grad():
        n.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 16)
    ref = torch.nn.functional.layer_norm(x, (16,), n.weight, None, 1e-5)
    assert torch.equal(n(x), ref)
    assert Norm("layernorm", 16, 1e-5, name="x", seed=0).bias is not None
