"""Trainer units: LR schedule, non-finite steps, determinism, embedding swaps, precision,
gradient-norm counting, metrics records."""
from __future__ import annotations

import math

import pytest
import torch

from dept_mega.config import config_from_dict
from dept_mega.metrics import MetricsWriter, check_record, make_record
from dept_mega.model import gpt
from dept_mega.optim import counted_once, lr_at
from dept_mega.parallel.groups import build_groups
from dept_mega.precision import LossScaler
from dept_mega.trainer import MicroBatch, NonFiniteLossError, Trainer
from tests.trainer_utils import (TINY, dp_micro_batches, global_batch, merge, read_jsonl, tiny_config,
                                 train_losses)


def _trainer(cfg):
    return Trainer(cfg, build_groups(), torch.device("cpu"), vocab_size=cfg.model.vocab_size)


def test_lr_schedule():
    o = config_from_dict({"optim": {"lr": 1.0, "min_lr": 0.1, "warmup_steps": 4}}).optim
    total = 14
    assert [lr_at(s, o, total) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, o, total) == pytest.approx(1.0)
    assert lr_at(9, o, total) == pytest.approx(0.55)  # half-way down the cosine
    assert lr_at(14, o, total) == pytest.approx(0.1)
    assert lr_at(100, o, total) == pytest.approx(0.1)
    decay = [lr_at(s, o, total) for s in range(4, 15)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))
    o0 = config_from_dict({"optim": {"lr": 1.0, "min_lr": 0.1, "warmup_steps": 0}}).optim
    assert lr_at(0, o0, 10) == pytest.approx(1.0)


def test_trainer_applies_schedule():
    cfg = tiny_config({"train": {"steps": 5}, "optim": {"warmup_steps": 2}})
    tr = _trainer(cfg)
    lrs = [tr.train_step(dp_micro_batches(cfg, global_batch(cfg, s), 0, 1)).lr for s in range(3)]
    assert lrs == [lr_at(s, cfg.optim, 5) for s in range(3)]
    assert tr.body_optimizer.param_groups[0]["lr"] == lrs[-1]


def test_same_seed_same_losses_and_different_seed_differs():
    cfg = tiny_config()
    a, b = train_losses(cfg, 3), train_losses(cfg, 3)
    assert a == b
    c = train_losses(tiny_config(overrides=("train.seed=8",)), 3)
    assert c["loss"] != a["loss"]


def test_nonfinite_steps_are_skipped_counted_and_stop_the_run():
    cfg = tiny_config({"optim": {"max_consecutive_nonfinite": 3}, "train": {"steps": 10}})
    tr = _trainer(cfg)
    batch = lambda s: dp_micro_batches(cfg, global_batch(cfg, s), 0, 1)  # noqa: E731
    assert not tr.train_step(batch(0)).skipped
    emb = tr.stages[0].embeddings.word_embeddings.weight
    saved = emb.detach().clone()
    body_before = [p.detach().clone() for p in tr.body_parameters()]
    with torch.no_grad():
        emb.fill_(float("nan"))
    res = tr.train_step(batch(1))
    assert res.skipped and math.isnan(res.loss)
    assert (tr.nonfinite_total, tr.nonfinite_in_a_row) == (1, 1)
    # the body did not move on the skipped step
    assert all(torch.equal(a, b) for a, b in zip(body_before, tr.body_parameters()))
    with torch.no_grad():
        emb.copy_(saved)
    res = tr.train_step(batch(2))
    assert not res.skipped and math.isfinite(res.loss)
    assert (tr.nonfinite_total, tr.nonfinite_in_a_row) == (1, 0)
    with torch.no_grad():
        emb.fill_(float("inf"))
    tr.train_step(batch(3))
    tr.train_step(batch(4))
    with pytest.raises(NonFiniteLossError, match="3 steps in a row"):
        tr.train_step(batch(5))
    assert tr.nonfinite_total == 4


def test_loss_is_mean_over_global_batch_tokens():
    cfg = tiny_config()
    tr = _trainer(cfg)
    mbs = dp_micro_batches(cfg, global_batch(cfg, 0), 0, 1)
    with torch.no_grad():
        per = torch.cat([tr.stages[0](mb.tokens[:, :-1], mb.tokens[:, 1:]) for mb in mbs])
    res = tr.train_step(mbs)
    assert res.tokens == cfg.train.global_batch_size * cfg.model.seq_length
    assert res.loss == pytest.approx(per.double().mean().item(), rel=1e-6)
    # sequences of one token have no target: an error naming their shapes, not a division by zero
    with pytest.raises(ValueError, match=r"no target tokens \(token shapes \[\(2, 1\)"):
        tr.train_step([MicroBatch(mb.tokens[:, :1]) for mb in mbs])


def test_loss_by_source_from_sequence_ids():
    cfg = tiny_config({"data": {"sources": []}})
    tr = Trainer(cfg, build_groups(), torch.device("cpu"), vocab_size=cfg.model.vocab_size, num_sources=3)
    tokens = global_batch(cfg, 0)
    ids = torch.tensor([0, 2, 2, 0, 0, 2, 2, 2])
    mbs = [MicroBatch(tokens[i:i + 2], ids[i:i + 2]) for i in range(0, 8, 2)]
    with torch.no_grad():
        per = torch.cat([tr.stages[0](mb.tokens[:, :-1], mb.tokens[:, 1:]) for mb in mbs]).double()
    res = tr.train_step(mbs)
    s = cfg.model.seq_length
    assert res.tokens_by_source == {0: 3 * s, 2: 5 * s}
    assert res.loss_sum_by_source[0] == pytest.approx(per[ids == 0].sum().item(), rel=1e-6)
    assert res.loss_sum_by_source[2] == pytest.approx(per[ids == 2].sum().item(), rel=1e-6)


def test_set_embeddings_swaps_weights_and_optimizer_state():
    cfg = tiny_config({"train": {"steps": 10}})
    pg = build_groups()
    tr = _trainer(cfg)
    batch = lambda s: dp_micro_batches(cfg, global_batch(cfg, s), 0, 1)  # noqa: E731
    tr.train_step(batch(0))
    emb_a, opt_a = tr.embeddings(), tr.embedding_optimizer
    a_weight = emb_a[0].word_embeddings.weight.detach().clone()
    emb_b = gpt.build_source_embeddings(cfg, pg, 60, seed=99)
    old = tr.set_embeddings(emb_b)
    assert old == (emb_a, opt_a)
    assert tr.stages[0].embeddings is emb_b[0]
    res = tr.train_step([MicroBatch(mb.tokens % 60) for mb in batch(1)])  # a 60-token vocabulary
    assert math.isfinite(res.loss)
    assert torch.equal(emb_a[0].word_embeddings.weight, a_weight)  # A untouched while away
    assert len(tr.embedding_optimizer.state) > 0 and tr.embedding_optimizer is not opt_a
    tr.set_embeddings(emb_a, opt_a)
    step_a = next(iter(opt_a.state.values()))["step"].item()
    tr.train_step(batch(2))
    assert next(iter(opt_a.state.values()))["step"].item() == step_a + 1  # state carried on
    assert not torch.equal(emb_a[0].word_embeddings.weight, a_weight)


@pytest.mark.parametrize("precision,grad_dtype", [("bf16", "fp32"), ("fp16", "fp32"), ("bf16", "bf16")])
def test_half_precision_weights_with_fp32_masters(precision, grad_dtype):
    """bf16/fp16: the model's weights are half precision, the optimizer's fp32 masters start
    from the exact fp32 init, gradients accumulate in the ``optim.grad_dtype`` buffer, and the
    weights are the rounded masters after every step."""
    cfg32 = tiny_config()
    cfg = tiny_config({"precision": precision, "optim": {"grad_dtype": grad_dtype}})
    ref = train_losses(cfg32, 2)
    init32 = [p.detach().clone() for p in _trainer(cfg32).parameters()]
    tr = _trainer(cfg)
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    assert all(p.dtype == half for p in tr.parameters())
    assert all(torch.equal(p.main_param, q) for p, q in zip(tr.parameters(), init32))
    losses = [tr.train_step(dp_micro_batches(cfg, global_batch(cfg, s), 0, 1)).loss for s in range(2)]
    for p in tr.parameters():
        assert p.main_param.dtype == torch.float32 and torch.equal(p.data, p.main_param.to(half))
        assert p.main_grad.dtype == (torch.bfloat16 if grad_dtype == "bf16" else torch.float32)
    assert all(m.dtype == torch.float32 for o in tr.optimizers for g in o.param_groups for m in g["params"])
    for a, b in zip(losses, ref["loss"]):
        assert a == pytest.approx(b, rel=2e-2)
    if precision == "fp16":
        assert tr.precision.scaler is not None and tr.nonfinite_total == 0


def test_loss_scaler_backoff_and_growth():
    s = LossScaler(scale=1024.0, growth_interval=2)
    s.update(True)
    assert s.scale == 512.0
    s.update(False)
    s.update(False)
    assert s.scale == 1024.0


def test_grad_norm_counts_replicated_and_duplicate_params_once():
    class PG:
        tp_rank = 1
    p_shard, p_rep, p_dup = (torch.nn.Parameter(torch.ones(2)) for _ in range(3))
    p_shard.tensor_parallel = True
    p_rep.tensor_parallel = False
    p_dup.tensor_parallel = True
    dup = frozenset({id(p_dup)})
    assert counted_once(p_shard, PG, dup)
    assert not counted_once(p_rep, PG, dup)  # replicated: counted on tensor rank 0 only
    assert not counted_once(p_dup, PG, dup)
    PG.tp_rank = 0
    assert counted_once(p_rep, PG, dup)


def test_metrics_records(tmp_path):
    w = MetricsWriter(str(tmp_path), enabled=True, tensorboard=False)
    w.write("train", 3, 0, loss=float("nan"), lr=1e-3, grad_norm=1.0, tokens=10, sources={"0": "blend"},
            loss_by_source={"en": 2.0}, tokens_per_s=5.0, tflops_per_device=None, mfu=None, consumed_samples=12,
            consumed_tokens=48)
    w.write("eval", 3, 0, by_source={"en": {"loss": 1.0, "ppl": math.e, "bpb": 0.5, "tokens": 4, "bytes": 12}})
    w.write("outer", 4, 1, bytes={"dp": 3}, seconds=0.1)
    w.write("bench", 5, 0, tokens_per_s=1.0, tokens_per_s_per_device=1.0, tflops_per_device=None, mfu=None,
            peak_tflops=None, mfu_basis="dense bf16 peak", step_ms=2.0, peak_mem_gb=0.1)
    w.close()
    recs = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [r["kind"] for r in recs] == ["train", "eval", "outer", "bench"]
    for r in recs:
        check_record(r)
        assert isinstance(r["time"], float) and r["time"] > 1.6e9
    assert recs[0]["loss"] is None  # NaN is not JSON: written as null
    with pytest.raises(ValueError, match="misses"):
        make_record("train", 1, 0, loss=1.0)
    with pytest.raises(ValueError, match="tokens_per_s"):  # throughput fields are part of the contract
        make_record("train", 1, 0, loss=1.0, lr=1.0, grad_norm=1.0, tokens=1, sources={}, loss_by_source={})
    with pytest.raises(ValueError, match="unknown"):
        make_record("nope", 1, 0)
    MetricsWriter(str(tmp_path / "other"), enabled=False).write("outer", 1, 0, bytes={}, seconds=0.0)
    assert not (tmp_path / "other").exists()


def test_flops_per_token_formula():
    from dept_mega.metrics import train_flops_per_token
    m = tiny_config({"model": {"num_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "num_query_groups": 1,
                               "ffn_hidden_size": 16, "seq_length": 4, "activation": "swiglu"}}).model
    q, kv = 8, 4  # heads·head_dim, groups·head_dim
    per_layer = 6 * 8 * (q + 2 * kv + q) + 6 * 8 * 16 * 3 + 6 * q * 4
    assert train_flops_per_token(m, 10) == 2 * per_layer + 6 * 8 * 10


def test_benchmark_tool_missing_tokenizer_is_one_error_line(tmp_path, capsys):
    """The synthetic batches need only the vocabulary size: a tokenizer file that is not there
    (tools/prepare_sample.py not run yet) is exit 2 with the key and how to go on, not a traceback."""
    import importlib.util
    import os

    import yaml
    from tests.trainer_utils import ROOT
    cfg_path = tmp_path / "tiny.yaml"
    cfg_path.write_text(yaml.safe_dump(merge(TINY, {"data": {"tokenizer": str(tmp_path / "no.model")}})))
    spec = importlib.util.spec_from_file_location("bench_tool", os.path.join(ROOT, "tools", "benchmark.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "bench.json"
    assert mod.main(["--config", str(cfg_path), "--steps", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "config key 'data.tokenizer'" in err and "no.model" in err and "model.vocab_size=N" in err
    assert "Traceback" not in err and not out.exists()
    # no tokenizer and no vocabulary size: the config's own error, as it is (one key, no advice
    # to build tokenizers that are not configured)
    cfg_path.write_text(yaml.safe_dump(merge(TINY, {"data": {"tokenizer": None}, "model": {"vocab_size": None}})))
    assert mod.main(["--config", str(cfg_path), "--steps", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: config key 'data.tokenizer': no tokenizer") and "build the" not in err, err


def test_benchmark_tool_writes_bench_record(tmp_path, monkeypatch):
    import importlib.util
    import os

    import yaml
    from tests.trainer_utils import ROOT
    cfg_path = tmp_path / "tiny.yaml"
    cfg_path.write_text(yaml.safe_dump(merge(TINY, {"train": {"steps": 10}})))
    spec = importlib.util.spec_from_file_location("bench_tool", os.path.join(ROOT, "tools", "benchmark.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "bench.json"
    assert mod.main(["--config", str(cfg_path), "--steps", "2", "--warmup", "1", "--out", str(out),
                     "parallel.sequence_parallel=false", f"train.run_dir={tmp_path / 'run'}",
                     "train.profile.start=3", "train.profile.stop=4"]) == 0
    import json
    rec = json.loads(out.read_text())
    check_record(rec)
    # every key is accepted and recorded; train.profile traced a step after the timed ones
    assert rec["config"]["train"]["profile"] == {"start": 3, "stop": 4, "ranks": [0]}
    assert rec["device_name"] == "cpu" and rec["torch_version"] == torch.__version__
    assert os.listdir(tmp_path / "run" / "profile") == ["rank0_steps4-4.json"]
    assert rec["kind"] == "bench" and rec["tokens_per_s"] > 0 and rec["step_ms"] > 0
    assert rec["tokens_per_s_per_device"] == rec["tokens_per_s"]  # one device
    assert rec["tflops_per_device"] is None and rec["mfu"] is None  # CPU: tokens/s only (§8)
    assert rec["tokens_per_step"] == 8 * 16 and rec["peak_mem_gb"] > 0
    assert mod.main(["--config", str(cfg_path), "--steps", "1", "--out", str(out), "nope.key=1"]) == 2
    # the speed keys (FP8 native path, recompute, attention backend, overlapped reduction) too
    speed = ["precision=bf16", "fp8=hybrid", "backend=local", "model.recompute=selective",
             "model.attention_backend=bias", "optim.overlap_grad_reduce=true", "fp8_recipe=delayed",
             "fp8_amax_history=4", "fp8_first_last_layers_bf16=true", "optim.grad_dtype=fp32",
             "parallel.sequence_parallel=false", f"train.run_dir={tmp_path / 'run2'}"]
    assert mod.main(["--config", str(cfg_path), "--steps", "1", "--warmup", "1", "--out", str(out)] + speed) == 0
    rec = json.loads(out.read_text())
    assert rec["tokens_per_s"] > 0 and rec["config"]["fp8"] == "hybrid"
    assert rec["config"]["model"]["recompute"] == "selective" and rec["config"]["precision"] == "bf16"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_norm_of_is_the_fp64_sum_of_squared_norms_in_a_fixed_number_of_kernels(seed, monkeypatch):
    """norm_of sums the squares of the per-tensor norms in fp64 on the device (a stack, not one
    kernel per tensor) and returns a tensor: the same bits as squaring and summing each norm in
    fp64, and no read of the device (the trainer fetches it with the step's statistics)."""
    from dept_mega.optim import norm_of

    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(n, generator=g) * 10 ** torch.randint(-3, 4, (1,), generator=g).item()
             for n in torch.randint(1, 5000, (40,), generator=g).tolist()]
    grads.append(torch.randn(3, 7, generator=g).bfloat16())
    expected = torch.stack([n.double() ** 2 for n in torch._foreach_norm([t.float() for t in grads])]).sum().sqrt()
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("norm_of read the device"))
    got = norm_of(grads, None, torch.device("cpu"))
    monkeypatch.undo()
    assert got.dtype == torch.float64 and got.shape == (1,)
    assert got.item() == expected.item()
    assert norm_of([], None, torch.device("cpu")).item() == 0.0
