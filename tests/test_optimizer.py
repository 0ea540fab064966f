"""Single-process units of the gradient buffer, the inner optimizer and mixed precision."""
from __future__ import annotations

import pytest
import torch

from dept_mega.config import ConfigError
from dept_mega.grad_buffer import GradBuffer, GradSync
from dept_mega.optimizer import empty_adamw_state
from dept_mega.parallel.groups import build_groups
from dept_mega.trainer import Trainer
from tests.trainer_utils import dp_micro_batches, global_batch, tiny_config


def _trainer(cfg):
    return Trainer(cfg, build_groups(), torch.device("cpu"), vocab_size=cfg.model.vocab_size)


def test_bucket_is_final_only_after_its_last_accumulation():
    """A bucket is launched when every parameter got its expected accumulations (one per
    micro-batch), never earlier; an unexpected extra gradient is an error, not a lost update."""
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(4))
    buf = GradBuffer([a, b], torch.float32, torch.device("cpu"), bucket_size=4)
    assert [len(k.params) for k in buf.buckets] == [1, 1]  # reverse order: b's bucket first
    buf.adopt()
    sync = GradSync(build_groups(), overlap=True)
    sync.begin([buf], {id(a): 2, id(b): 2})
    (a.sum() * 2 + b.sum()).backward()
    assert a.grad is None and not any(k.launched for k in buf.buckets)
    (a.sum() + b.sum() * 3).backward()
    assert all(k.launched for k in buf.buckets) and sync.launched_during_backward == 2
    assert torch.equal(a.main_grad, torch.full((3,), 3.0)) and torch.equal(b.main_grad, torch.full((4,), 4.0))
    with pytest.raises(RuntimeError, match="after its bucket's data-parallel reduction started"):
        a.sum().backward()
    sync.finish()
    # in-order launching: the second bucket waits for the first
    sync.begin([buf], {id(a): 1, id(b): 1})
    a.sum().backward()
    assert not any(k.launched for k in buf.buckets)
    b.sum().backward()
    assert all(k.launched for k in buf.buckets)
    sync.finish()
    # outside a step autograd's plain .grad is left alone
    a.sum().backward()
    assert torch.equal(a.grad, torch.ones(3))


def test_distributed_buckets_are_padded_and_isolate_shared_params():
    ps = [torch.nn.Parameter(torch.ones(n)) for n in (5, 7, 3)]
    buf = GradBuffer(ps, torch.float32, torch.device("cpu"), bucket_size=100, shards=4, isolate=frozenset({id(ps[1])}))
    assert [[q.numel() for q in k.params] for k in buf.buckets] == [[3], [7], [5]]
    assert all(k.numel % 4 == 0 for k in buf.buckets) and buf.numel == 4 + 8 + 8


@pytest.mark.parametrize("fused", [False, True])
def test_prebuilt_adamw_state_is_what_adamw_creates(fused):
    """Checkpoint loading fills pre-built state in place; it must match AdamW's own lazily
    created state (fused AdamW keeps ``step`` on the parameter's device as float32 — a CPU
    step beside CUDA parameters is the 'state_steps' error on GPUs)."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    p = torch.nn.Parameter(torch.randn(4, 3, device=dev))
    kw = {"fused": True} if fused else {"foreach": True}
    opt = torch.optim.AdamW([p], lr=0.1, **kw)
    built = empty_adamw_state(opt, opt.param_groups[0], p)
    p.grad = torch.ones_like(p)
    opt.step()
    real = opt.state[p]
    assert built.keys() == real.keys()
    for k in built:
        assert (built[k].dtype, built[k].device, built[k].shape) == (real[k].dtype, real[k].device, real[k].shape), k


def test_optimizer_config_keys_are_checked():
    with pytest.raises(ConfigError, match="'optim.grad_dtype'"):
        tiny_config(overrides=("optim.grad_dtype=bf16",))  # needs precision bf16
    with pytest.raises(ConfigError, match="'optim.grad_dtype'"):
        tiny_config(overrides=("optim.grad_dtype=fp16", "precision=bf16"))
    # DEPT syncs the distributed optimizer's master shards (dept/master_shards.py)
    for variant in ("glob", "trim", "spec", "spec_opt"):
        tiny_config({"precision": "bf16", "dept": {"variant": variant, "local_steps": 1}, "optim": {"distributed": True}})
    with pytest.raises(ConfigError, match="'optim.grad_bucket_size'"):
        tiny_config(overrides=("optim.grad_bucket_size=0",))
    with pytest.raises(ConfigError, match="'optim.fused'"):
        tiny_config(overrides=("optim.fused=auto",))
    cfg = tiny_config({"precision": "fp32", "dept": {"variant": "spec", "local_steps": 1}, "optim": {"distributed": True}})
    assert cfg.optim.distributed and cfg.optim.overlap_grad_reduce and cfg.optim.fused is None


def test_bf16_residual_stream_and_master_api():
    """bf16: every block's output (the residual stream) is bf16 on the first stage too, the
    loss stays fp32; ``main_params``/``refresh_model_params`` read and write the fp32 masters,
    and loading a module state dict refreshes the masters from the loaded weights."""
    cfg = tiny_config({"precision": "bf16"})
    tr = _trainer(cfg)
    dtypes = []
    hooks = [blk.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
             for st in tr.stages for blk in st.body.layers.values()]
    mbs = dp_micro_batches(cfg, global_batch(cfg, 0), 0, 1)
    with torch.no_grad():
        per_token = tr.stages[0](mbs[0].tokens[:, :-1], mbs[0].tokens[:, 1:])
    assert per_token.dtype == torch.float32 and set(dtypes) == {torch.bfloat16}
    for h in hooks:
        h.remove()
    tr.train_step(mbs)
    body = tr.body_parameters()
    masters = tr.main_params(body)
    assert all(m.dtype == torch.float32 and m is p.main_param for m, p in zip(masters, body))
    with torch.no_grad():
        masters[0].add_(1e-3)
    tr.refresh_model_params(body[:1])
    assert torch.equal(body[0].data, masters[0].to(torch.bfloat16))
    emb = tr.embeddings()[0]
    sd = {k: v.clone() + 1 for k, v in emb.state_dict().items()}
    emb.load_state_dict(sd)
    w = emb.word_embeddings.weight
    assert torch.equal(w.main_param, w.data.float())
    # fp32: the parameters are their own masters (DEPT code path unchanged)
    tr32 = _trainer(tiny_config())
    p = tr32.body_parameters()[0]
    assert tr32.main_params([p])[0].data_ptr() == p.data_ptr()


def test_training_with_foreign_embedding_optimizer_is_an_error():
    cfg = tiny_config()
    tr = _trainer(cfg)
    from dept_mega.model import build_source_embeddings
    other = build_source_embeddings(cfg, build_groups(), cfg.model.vocab_size, seed=3)
    tr.set_embeddings(other, tr.embedding_optimizer)  # an evaluation-style install
    with pytest.raises(RuntimeError, match="not owned by the installed optimizers"):
        tr.train_step(dp_micro_batches(cfg, global_batch(cfg, 0), 0, 1))


def test_moved_source_keeps_its_fp32_masters():
    """SPEC moves a source's embeddings with their optimizer state; with bf16 weights that
    state carries the fp32 masters, so the receiving group continues from the exact masters
    (not from the rounded weights), through the same pack/unpack as the wire."""
    from dept_mega.dept.store import SourceState, encode, load_payload, parse_header, state_payload, unpack
    from dept_mega.model import build_source_embeddings
    cfg = tiny_config({"precision": "bf16"})
    tr = _trainer(cfg)
    tr.train_step(dp_micro_batches(cfg, global_batch(cfg, 0), 0, 1))
    raw, tensors = encode(state_payload(SourceState(tr.embeddings(), tr.embedding_optimizer), with_optimizer=True))
    received = unpack(parse_header(raw, peer=0).tree, [t.clone() for t in tensors])
    embs = build_source_embeddings(cfg, build_groups(), cfg.model.vocab_size, seed=11)
    state = SourceState(embs, tr.make_embedding_optimizer(embs))
    load_payload(state, received)
    w_src, w_dst = tr.embeddings()[0].word_embeddings.weight, embs[0].word_embeddings.weight
    assert w_dst.dtype == torch.bfloat16 and torch.equal(w_dst.data, w_src.data)
    assert torch.equal(w_dst.main_param, w_src.main_param)
    assert not torch.equal(w_dst.main_param, w_dst.data.float())  # the masters hold more than the weights
    st_src = tr.embedding_optimizer.state[w_src.main_param]
    st_dst = state.optimizer.state[w_dst.main_param]
    assert all(torch.equal(st_src[k], st_dst[k]) for k in st_src)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fused_adamw_resumes_on_cuda(tmp_path, precision):
    """The GPU-only bug: fused AdamW keeps ``step`` on the parameter's device, so optimizer
    state pre-built on the CPU for checkpoint loading made the next step fail ("state_steps")."""
    import os

    from dept_mega.checkpoint import Checkpointer, load_weights
    cfg = tiny_config({"precision": precision, "train": {"run_dir": str(tmp_path)}})
    dev = torch.device("cuda")
    tr = Trainer(cfg, build_groups(), dev, vocab_size=cfg.model.vocab_size)
    assert all(g["fused"] for o in tr.optimizers for g in o.param_groups if g["params"])
    for s in range(2):
        tr.train_step(dp_micro_batches(cfg, global_batch(cfg, s), 0, 1))

    class _Loop:  # what Checkpointer.save reads
        trainer, hooks, iterators = tr, None, {}

    Checkpointer(str(tmp_path)).save(_Loop())
    assert os.path.isdir(tmp_path / "checkpoints" / "step_2")
    tr2 = Trainer(cfg, build_groups(), dev, vocab_size=cfg.model.vocab_size)
    load_weights(tr2, str(tmp_path), 2)
    tr2.step = 2
    a = tr.train_step(dp_micro_batches(cfg, global_batch(cfg, 2), 0, 1)).loss
    b = tr2.train_step(dp_micro_batches(cfg, global_batch(cfg, 2), 0, 1)).loss
    assert a == b


@pytest.mark.parametrize("over", [{"precision": "bf16"}, {"optim": {"distributed": True}}])
def test_dropped_trainer_is_freed_without_the_cycle_collector(over):
    """Parameters point to their gradient buffer only weakly: a dropped trainer (and the
    process groups it holds) is freed at once, not by a garbage-collection pass at interpreter
    shutdown — tearing gloo groups down there aborted worker processes."""
    import gc
    import weakref
    cfg = tiny_config(over)
    tr = _trainer(cfg)
    tr.train_step(dp_micro_batches(cfg, global_batch(cfg, 0), 0, 1))
    refs = [weakref.ref(x) for x in (tr, tr.body_optimizer, tr.body_optimizer.buffer)]
    gc.disable()
    try:
        del tr
        assert all(r() is None for r in refs)
    finally:
        gc.enable()
