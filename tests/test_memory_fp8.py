"""The memory model's native FP8 terms (dept/memory_fp8.py) against what a run holds on CPU:
the activations one micro-batch saves for backward (bf16 against fp8=hybrid, counted by
``saved_tensors_hooks`` over unique storages; the difference of the two runs, so that the
backend's own accounting cancels), the FP8 weight copies the step's cache holds and the
delayed-scaling state."""
from __future__ import annotations

import pytest

from dept_mega.dept.memory import predict_memory
from dept_mega.dept.memory_fp8 import fp8_activation_delta, fp8_scaling_bytes, fp8_weight_copy_bytes
from tests.dept_utils import merge, tiny_config
from tests.memory_utils import saved_storages, trained_one_step

BASE = {"precision": "bf16", "backend": "local",
        "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "num_query_groups": 2,
                  "ffn_hidden_size": 64, "seq_length": 16},
        "train": {"micro_batch_size": 2, "global_batch_size": 2}}


def _fp8_storages(stage) -> tuple[set[int], int, set[int], int]:
    """(ptrs, bytes) of the open step's weight-cache entries, and of the FP8 scaling state
    (delayed scaling: a cache entry's dequantisation factor is a view of the state's)."""
    cache: dict[int, int] = {}
    state: dict[int, int] = {}
    states = {}

    def add(d, t):
        if t is not None:
            d[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    for m in stage.modules():
        layer = getattr(m, "fp8_layer", None)
        if layer is None:
            continue
        states[id(layer.state)] = layer.state
        e = layer.cache._entry
        assert e is not None, "the step's first forward fills every FP8 layer's cache"
        for t in (e.q, e.q_t, e.inv):
            add(cache, t)
        add(state, layer.amax)
        add(state, layer.grad_amax)
    for st in states.values():
        for t in (st.history, st.scale, st.inv, st._fmax):
            add(state, t)
    own = {p: n for p, n in cache.items() if p not in state}
    return set(own), sum(own.values()), set(state), sum(state.values())


def _measure(over: dict, pg=None) -> dict:
    """One training step (the delayed recipe's history), then one micro-batch's forward under
    saved_tensors_hooks inside an open FP8 step: the bytes of the unique storages saved for
    backward that are neither parameters nor FP8 cache/state, the cache's and state's bytes."""
    from dept_mega.parallel.fp8 import fp8_weight_cache
    tr, cfg, tokens = trained_one_step(BASE, over, pg)
    params = {p.untyped_storage().data_ptr() for p in tr.parameters()}
    stage = tr.stages[0]
    views = []
    hooks = [m.register_forward_pre_hook(lambda _m, args: views.append(args[0]._base is not None))
             for name, m in stage.named_modules() if name.endswith("attention.proj")]
    out = {}
    with fp8_weight_cache(tr.stages):
        with saved_storages() as saved:
            loss = stage(tokens[:, :-1], tokens[:, 1:]).float().sum()
        cache, out["cache"], state, out["state"] = (_fp8_storages(stage) if cfg.fp8 else (set(), 0, set(), 0))
        loss.backward()
    for h in hooks:
        h.remove()
    out["act"] = sum(n for p, n in saved.items() if p not in params and p not in cache and p not in state)
    out["proj_input_is_view"] = all(views) and bool(views)
    out["cfg"] = cfg
    return out


CASES = {
    "none": {"model": {"recompute": "none"}},
    "selective": {"model": {"recompute": "selective"}},
    "full_1_of_2": {"model": {"recompute": "full", "recompute_layers": 1}},
    "current_scaling": {"fp8_recipe": "current"},
    "padded_rows": {"model": {"seq_length": 8}, "train": {"micro_batch_size": 1, "global_batch_size": 1}},
    "first_last_bf16_swiglu": {"model": {"num_layers": 3, "activation": "swiglu"},
                               "fp8_first_last_layers_bf16": True},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fp8_memory_terms_match_a_run(case):
    """The saved activations' difference FP8 − bf16 is the model's FP8 delta exactly, and the
    step's FP8 weight copies and scaling state are the model's ``fp8_weight_copies`` and
    ``fp8_scaling``. On CPU the attention (the ``bias`` path) returns its output densely as
    ``[s, b, H, d]``, so the projection's input is a view of it (asserted): the model's
    ``shared`` case, as flex_attention on CUDA."""
    over = CASES[case]
    bf16 = _measure(over)
    fp8 = _measure(merge(over, {"fp8": "hybrid"}))
    cfg = fp8["cfg"]
    assert bf16["proj_input_is_view"] and fp8["proj_input_is_view"]
    delta = fp8_activation_delta(cfg, 0, shared=True)
    assert delta != 0 or cfg.model.recompute == "full"
    assert fp8["act"] - bf16["act"] == delta
    assert fp8["cache"] == fp8_weight_copy_bytes(cfg, 0) > 0
    assert fp8["state"] == fp8_scaling_bytes(cfg, 0)
    assert (fp8["state"] > 0) == (cfg.fp8_recipe == "delayed")
    pred = predict_memory(cfg, cfg.model.vocab_size, [cfg.model.vocab_size])
    assert pred["fp8_weight_copies"] == fp8["cache"] and pred["fp8_scaling"] == fp8["state"]


def _tp_worker(rank, world, cases):
    from dept_mega.parallel.groups import build_groups

    pg = build_groups(2, 1, 1)
    out = []
    for over in cases:
        bf16, fp8 = _measure(over, pg), _measure(merge(over, {"fp8": "hybrid"}), pg)
        cfg = fp8.pop("cfg")
        # sequence parallelism: the bf16 QKV and fc1 layers keep their input's shard (they
        # all-gather it again in backward, parallel/sp_linear.py), which is what the model counts
        out.append({"diff": fp8["act"] - bf16["act"], "delta": fp8_activation_delta(cfg, 0, shared=True),
                    "views": bf16["proj_input_is_view"] and fp8["proj_input_is_view"],
                    "cache": fp8["cache"], "copies": fp8_weight_copy_bytes(cfg, 0),
                    "state": fp8["state"], "scaling": fp8_scaling_bytes(cfg, 0)})
    return out


@pytest.mark.timeout(300)
def test_fp8_memory_terms_match_a_tensor_parallel_run():
    """As above on each rank of TP 2 (gloo), with and without sequence parallelism: per-rank
    weight shards, the all-gathered GEMM inputs' FP8 copies against the sharded bf16 norm outputs."""
    from tests.mp_utils import run_distributed

    cases = [{"parallel": {"tensor": 2, "sequence_parallel": sp}} for sp in (False, True)]
    for res in run_distributed(_tp_worker, 2, (cases,)):
        for r in res:
            assert r["views"]
            assert r["diff"] == r["delta"] != 0, res
            assert r["cache"] == r["copies"] > 0 and r["state"] == r["scaling"] > 0


def test_transformer_engine_fp8_is_not_counted():
    cfg = tiny_config(merge(BASE, {"fp8": "hybrid"}))
    import dataclasses
    te = dataclasses.replace(cfg, backend="transformer_engine")
    for fn in (fp8_activation_delta, fp8_weight_copy_bytes, fp8_scaling_bytes):
        assert fn(te, 0) == 0 and fn(cfg, 0) != 0


def test_preflight_reports_the_fp8_terms(tmp_path):
    """``dept_mega.train --check``'s memory line names the FP8 weight copies and scaling state
    (native FP8) and not without FP8."""
    from dept_mega.preflight import _size, preflight
    from tests.data_utils import write_docs

    docs = [list(range(3, 60))] * 8
    prefix = write_docs(str(tmp_path / "a"), docs, nbytes=[3 * len(d) for d in docs])
    lines = {}
    for fp8 in (None, "hybrid"):
        cfg = tiny_config(merge(BASE, {"fp8": fp8, "dept": {"variant": "std"},
                                       "data": {"sources": [{"name": "a", "prefix": prefix}], "split": "50,50"}}))
        lines[fp8] = next(x for x in preflight(cfg, 1)[0] if x.startswith("memory per rank"))
    want = f"+ FP8 weight copies {_size(fp8_weight_copy_bytes(cfg, 0))} + FP8 scaling {_size(fp8_scaling_bytes(cfg, 0))}"
    assert want in lines["hybrid"] and "FP8" not in lines[None]
