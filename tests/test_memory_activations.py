"""The memory model's activations (``activation_bytes``, dept/memory.py) against what one
micro-batch's forward saves for backward on CPU, exactly: the unique storages that
``saved_tensors_hooks`` sees, less those a second micro-batch's forward saves too (the
parameters, the position caches: held once per model, not per micro-batch). A ``gpu`` test does
the same on CUDA for the attention kernels whose saved tensors the model counts by rule. With ``device="cpu"`` the model counts
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


def measure(over: dict, pg=None, device: str = "cpu") -> tuple[int, object]:
    """(bytes one micro-batch's forward saves for backward, the config), after one training step.
    Two forwards, both graphs alive: what both save (parameters, the position caches, flex's
    block masks: held once per model) is left out; what only the first saves is its micro-batch's."""
    tr, cfg, tokens = trained_one_step(BASE, over, pg, device)
    stage = tr.stages[0]
    tokens = tokens.to(device)
    losses, saves = [], []
    for _ in range(2):
        with saved_storages() as saved:
            losses.append(stage(tokens[:, :-1], tokens[:, 1:]).float().sum())
        saves.append(saved)
    sum(losses).backward()
    held = set(saves[0]) & set(saves[1])
    return sum(n for p, n in saves[0].items() if p not in held), cfg


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


# (model overrides, device, flash-attn installed) for which the trainer's attention choice is
# checked; ``auto`` resolves to each of flash, flex, bias and sdpa among them
KIND_CASES = {
    "auto alibi cuda": ({}, "cuda", False),
    "auto alibi cuda flash": ({}, "cuda", True),
    "auto alibi dropout cuda": ({"attention_dropout": 0.1}, "cuda", False),
    "auto alibi head_dim 8 cuda": ({"num_attention_heads": 4, "num_query_groups": 4}, "cuda", False),
    "auto alibi cpu": ({}, "cpu", True),
    "auto rope cuda": ({"position_embedding": "rope"}, "cuda", False),
    "sdpa learned cuda": ({"attention_backend": "sdpa", "position_embedding": "learned"}, "cuda", False),
    "sdpa rope cpu": ({"attention_backend": "sdpa", "position_embedding": "rope"}, "cpu", False),
    "bias cuda": ({"attention_backend": "bias"}, "cuda", True),
    "flex cuda": ({"attention_backend": "flex"}, "cuda", False),
}


@pytest.mark.parametrize("case", sorted(KIND_CASES))
def test_activations_count_the_attention_the_trainer_picks(case, monkeypatch):
    """The memory model resolves ``model.attention_backend`` as the trainer does (model/backends.py
    for the device and whether flash-attn is installed), and ``auto`` is counted exactly as the
    kernel it resolves to named explicitly."""
    import dataclasses

    from dept_mega.config import config_from_dict
    from dept_mega.dept.memory_attention import attention_kind
    from dept_mega.model import backends

    over, device, flash = KIND_CASES[case]
    cfg = config_from_dict(merge(BASE, {"model": over}))
    monkeypatch.setattr(backends, "flash_attn_available", lambda: flash)
    want = backends._resolve_attention(cfg.model, cfg.precision, torch.device(device)).kind
    if device == "cpu":  # the whole resolution a CPU trainer makes
        assert backends.resolve_backends(cfg, "cpu").attention.kind == want
    assert attention_kind(cfg, device, flash) == want
    named = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention_backend=want))
    assert activation_bytes(cfg, 96, 0, device=device, flash_installed=flash) == \
        activation_bytes(named, 96, 0, device=device, flash_installed=flash), want


# CUDA attention kernels whose saved tensors the model counts by rule (memory_attention.py)
GPU_CASES = {
    "sdpa bf16 rope": {"model": {"attention_backend": "sdpa", "position_embedding": "rope"}},
    "sdpa bf16 learned": {"model": {"attention_backend": "sdpa", "position_embedding": "learned"}},
    "sdpa fp32 learned": {"precision": "fp32", "model": {"attention_backend": "sdpa",
                                                         "position_embedding": "learned"}},
    "bias alibi": {"model": {"attention_backend": "bias"}},
    "bias alibi attention dropout": {"model": {"attention_backend": "bias", "attention_dropout": 0.1}},
    "flex alibi": {"model": {"attention_backend": "flex"}},
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_activation_bytes_equal_the_saved_tensors_on_cuda(case):
    """On CUDA the bytes one micro-batch's forward saves equal ``activation_bytes(...,
    device="cuda")``. A failure names the attention kernel, both numbers and the per-layer sizes
    of the attention terms counted by rule (the s² scores of ``bias``, the log-sum-exp, the
    output copy when it is not the projection's input), so that the difference shows which rule
    the kernel follows."""
    from dept_mega.dept.memory_attention import (attention_kind, attention_output_shared, scores_saved,
                                                 statistics_bytes)
    from tests.trainer_utils import gpu_test_device

    device = gpu_test_device()  # cpu: a rehearsal with the CPU kernels' rules (DEPT_MEGA_GPU_TESTS_ON_CPU=1)
    if device == "cpu" and ("flex" in case or "dropout" in case):
        pytest.skip("rehearsal: flex_attention has no backward on the CPU, and the CPU's attention dropout "
                    "is not modelled (its math kernel keeps more)")
    got, cfg = measure(GPU_CASES[case], device=device)
    want = activation_bytes(cfg, cfg.model.vocab_size, 0, device=device)
    m = cfg.model
    kind = attention_kind(cfg, device)
    b, s, a = cfg.train.micro_batch_size, m.seq_length, 4 if cfg.precision == "fp32" else 2
    heads, q = m.num_attention_heads, m.num_attention_heads * m.head_dim
    terms = (f"counted: scores {scores_saved(kind, device, m.attention_dropout)}, output shared "
             f"{attention_output_shared(kind, device)}; per layer ({m.num_layers} layers): s² scores "
             f"{b * heads * s * s * a} bytes (+ dropout mask {b * heads * s * s}), log-sum-exp and RNG state "
             f"{statistics_bytes(kind, device, cfg.precision, b * heads, s)}, "
             f"output copy {s * b * q * a}")
    assert got == want, (f"{case}: attention backend {kind} on {device} saved {got} bytes, activation_bytes "
                         f"predicts {want} (measured - predicted = {got - want}); {terms}")


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
