"""The memory model's activations (``activation_bytes``, dept/memory.py) against what one
micro-batch's forward saves for backward on CPU, exactly: the unique storages that
``saved_tensors_hooks`` sees, less the parameters and the position caches (the ALiBi bias, the
RoPE tables: held once per model, not per micro-batch). With ``device="cpu"`` the model counts
the CPU kernels' tensors where they differ from CUDA's (the LayerNorm statistics in the
activation dtype; SDPA's output shared with the projection's input, as flex_attention's on
CUDA; the ``bias`` backend's log-sum-exp rather than its scores).

Cases: recompute none / selective / full for part of the layers, the ``bias`` (ALiBi) and
``sdpa`` (RoPE, learned positions) backends, SwiGLU, hidden dropout, fp32, an untied head with
biases; TP 2 with and without sequence parallelism on 2 gloo ranks (there the QKV, fc1 and head
inputs are kept as their sequence shards, parallel/sp_linear.py). Not here: RMSNorm (eager on
CPU it is a composite that keeps fp32 copies of its input, not CUDA's fused kernel), GQA and
attention dropout (the CPU's fallbacks differ from CUDA's kernels).
"""
from __future__ import annotations

import pytest
import torch

from dept_mega.dept.memory import activation_bytes
from tests.dept_utils import merge
from tests.memory_utils import saved_storages, trained_one_step

BASE = {"precision": "bf16", "backend": "local",
        "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "num_query_groups": 2,
                  "ffn_hidden_size": 64, "seq_length": 16, "normalization": "layernorm"},
        "train": {"micro_batch_size": 2, "global_batch_size": 2}}


def _position_caches(stage) -> set[int]:
    out = set()
    for mod in stage.modules():
        pos = getattr(mod, "positions", None)
        if pos is None:
            continue
        cached = list(pos._bias.values()) + (list(pos.rope._cache.values()) if pos.rope is not None else [])
        for v in cached:
            for t in (v if isinstance(v, tuple) else (v,)):
                out.add(t.untyped_storage().data_ptr())
    return out


def measure(over: dict, pg=None) -> tuple[int, object]:
    """(bytes one micro-batch's forward saves for backward, the config), after one training step."""
    tr, cfg, tokens = trained_one_step(BASE, over, pg)
    stage = tr.stages[0]
    with saved_storages() as saved:
        loss = stage(tokens[:, :-1], tokens[:, 1:]).float().sum()
    loss.backward()
    held = {p.untyped_storage().data_ptr() for p in tr.parameters()} | _position_caches(stage)
    return sum(n for p, n in saved.items() if p not in held), cfg


CASES = {
    "none alibi bias": {},
    "selective": {"model": {"recompute": "selective"}},
    "full 1 of 2": {"model": {"recompute": "full", "recompute_layers": 1}},
    "sdpa rope": {"model": {"attention_backend": "sdpa", "position_embedding": "rope"}},
    "sdpa learned swiglu": {"model": {"attention_backend": "sdpa", "position_embedding": "learned",
                                      "activation": "swiglu"}},
    "hidden dropout": {"model": {"hidden_dropout": 0.1}},
    "fp32": {"precision": "fp32"},
    "untied bias": {"model": {"tie_embeddings": False, "bias": True}},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_activation_bytes_equal_the_saved_tensors(case):
    got, cfg = measure(CASES[case])
    assert got == activation_bytes(cfg, cfg.model.vocab_size, 0, device="cpu")


def test_attention_output_counted_once_where_it_is_the_projection_input():
    """On CUDA, flex (ALiBi's backend) shares the core's output with the projection's input; the
    SDPA kernels' output is laid out [b, s, H, d] and the projection's input is a copy."""
    from dept_mega.config import config_from_dict

    cfg = config_from_dict(merge(BASE, {}))
    s, b, q, a = 16, 2, 32, 2
    flex = activation_bytes(config_from_dict(merge(BASE, {"model": {"attention_backend": "flex"}})), 96, 0)
    sdpa = activation_bytes(config_from_dict(merge(BASE, {"model": {"attention_backend": "sdpa",
                                                                     "position_embedding": "learned"}})), 96, 0)
    learned_flex = activation_bytes(config_from_dict(merge(BASE, {"model": {"attention_backend": "flex",
                                                                             "position_embedding": "learned"}})), 96, 0)
    assert sdpa - learned_flex == 2 * s * b * q * a  # two layers, one copy each
    assert activation_bytes(cfg, 96, 0) == flex  # auto with ALiBi is flex


def _tp_worker(rank, world, cases):
    from dept_mega.parallel.groups import build_groups

    torch.set_num_threads(1)
    pg = build_groups(2, 1, 1)
    out = []
    for over in cases:
        got, cfg = measure(over, pg)
        out.append((got, activation_bytes(cfg, cfg.model.vocab_size, 0, device="cpu")))
    return out


@pytest.mark.timeout(120)
def test_activation_bytes_tensor_parallel():
    from tests.mp_utils import run_distributed

    cases = [{"parallel": {"tensor": 2, "sequence_parallel": sp}, "model": {"tie_embeddings": tied}}
             for sp, tied in ((False, True), (True, True), (True, False))]
    for res in run_distributed(_tp_worker, 2, (cases,), timeout=100):
        for case, (got, want) in zip(cases, res):
            assert got == want, (case, got, want)
