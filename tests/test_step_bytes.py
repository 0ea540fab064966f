"""A round record's dp / tp / pp bytes equal local_steps × the predicted inner step of every
group (dept/step_bytes.py) plus the predicted outer synchronisation's share (dept/costs.py),
exactly, on real DEPT rounds (Trainer + DeptHooks) over 4 gloo ranks, for a grid of layouts:
data-parallel (plain; distributed optimizer with small padded buckets), tensor-parallel with and
without sequence parallelism (and full recomputation; native FP8 with bf16 first and last blocks), pipeline (tied and untied, interleaved),
mixed, bf16; GLOB, SPEC and TRIM (TRIM: each group's own |V_k| table)."""
from __future__ import annotations

import pytest
import torch

from dept_mega.dept.costs import predict_outer_sync
from dept_mega.dept.step_bytes import predict_inner_round_bytes, predict_inner_step_bytes
from tests.dept_utils import VOCAB, run_dept, source_infos, tiny_config
from tests.mp_utils import run_distributed

WORLD = 4

# (label, config overrides); G = 4 / (T·D·P)
CASES = [
    ("D2 glob learned untied", {"parallel": {"data": 2}, "dept": {"variant": "glob"},
                                "model": {"position_embedding": "learned", "tie_embeddings": False}}),
    ("D2 distributed buckets spec", {"parallel": {"data": 2}, "dept": {"variant": "spec"},
                                     "optim": {"distributed": True, "grad_bucket_size": 301}}),
    ("D2 trim", {"parallel": {"data": 2}, "dept": {"variant": "trim"}}),
    ("T2 glob", {"parallel": {"tensor": 2}, "dept": {"variant": "glob"}}),
    ("T2 SP spec learned bias", {"parallel": {"tensor": 2, "sequence_parallel": True}, "dept": {"variant": "spec"},
                                 "model": {"position_embedding": "learned", "bias": True}}),
    ("T2 SP recompute untied", {"parallel": {"tensor": 2, "sequence_parallel": True}, "dept": {"variant": "glob"},
                                "model": {"recompute": "full", "recompute_layers": 1, "tie_embeddings": False,
                                          "normalization": "rmsnorm"}}),
    ("T2 recompute dropout", {"parallel": {"tensor": 2}, "dept": {"variant": "spec"},
                              "model": {"recompute": "full", "hidden_dropout": 0.1}}),
    ("P2 glob tied", {"parallel": {"pipeline": 2}, "dept": {"variant": "glob"}}),
    ("P2 V2 spec untied", {"parallel": {"pipeline": 2, "virtual_pipeline": 2}, "dept": {"variant": "spec"},
                           "model": {"num_layers": 4, "tie_embeddings": False}}),
    ("T2 SP D2 distributed bf16 grads spec", {"parallel": {"tensor": 2, "data": 2, "sequence_parallel": True},
                                        "dept": {"variant": "spec"}, "precision": "bf16",
                                        "optim": {"distributed": True, "grad_bucket_size": 301,
                                                  "grad_dtype": "bf16"},
                                        "model": {"position_embedding": "learned", "bias": True,
                                                  "activation": "swiglu"}}),
    ("T2 SP P2 tied distributed", {"parallel": {"tensor": 2, "pipeline": 2, "sequence_parallel": True},
                                   "dept": {"variant": "glob"}, "optim": {"distributed": True}}),
    ("D2 P2 tied", {"parallel": {"data": 2, "pipeline": 2}, "dept": {"variant": "glob"}}),
    # native FP8 (on CPU): the FP8 block's QKV and fc1 keep their FP8 copy of the gathered input
    # and do not all-gather it again in backward; the bf16 first and last blocks do
    ("T2 SP fp8 first/last bf16", {"parallel": {"tensor": 2, "sequence_parallel": True}, "dept": {"variant": "glob"},
                                   "precision": "bf16", "fp8": "hybrid", "backend": "local",
                                   "fp8_first_last_layers_bf16": True,
                                   "model": {"num_layers": 3, "hidden_size": 32, "ffn_hidden_size": 64}}),
]


def _config(over: dict):
    base = {"dept": {"local_steps": 2}, "train": {"steps": 2}}
    merged = {k: {**base.get(k, {}), **over.get(k, {})} if isinstance(over.get(k, {}), dict) else over[k]
              for k in set(base) | set(over)}
    return tiny_config(merged)


def _groups(cfg) -> int:
    p = cfg.parallel
    return WORLD // (p.tensor * p.data * p.pipeline)


def _worker(rank, world, cases):
    torch.set_num_threads(1)
    out = []
    for _, over in cases:
        cfg = _config(over)
        G = _groups(cfg)
        infos = source_infos(G, trim=cfg.dept.variant == "trim")
        res = run_dept(cfg, infos, 1)
        sizes = {s.name: (s.vocab_ids.numel() if s.vocab_ids is not None else s.vocab_size) for s in infos}
        vocabs = [sizes[res["assignments"][0][g]] for g in range(G)]
        out.append({"bytes": res["outer"][0]["bytes"], "vocabs": vocabs})
    return out


def expected_record(cfg, vocabs: list[int], global_vocab: int = VOCAB, extras: bool = True) -> dict[str, int]:
    """A round record's dp / tp / pp for ``cfg`` with these per-group table sizes: the inner steps
    plus the outer sync's share (``extras``: of the run's first and last round, as here)."""
    trim = vocabs if cfg.dept.variant == "trim" else None
    outer = predict_outer_sync(cfg, len(vocabs), global_vocab=global_vocab, trim_vocabs=trim)
    inner = predict_inner_round_bytes(cfg, vocabs)
    parts = ("round", "first_extra", "final_extra") if extras else ("round",)
    return {k: inner[k] + sum(outer[part].get(k, 0) for part in parts) for k in ("dp", "tp", "pp")}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_round_record_bytes_equal_prediction():
    measured = run_distributed(_worker, WORLD, args=(CASES,), timeout=280)[0]  # job totals: same on every rank
    for (label, over), got in zip(CASES, measured):
        cfg = _config(over)
        want = expected_record(cfg, got["vocabs"])
        assert {k: got["bytes"][k] for k in want} == want, label
        p = cfg.parallel
        # every layout exercises the categories it has: nothing is predicted as zero that is not
        step = predict_inner_step_bytes(cfg, got["vocabs"][0])
        assert (step["dp"] > 0) == (p.data > 1) and (step["tp"] > 0) == (p.tensor > 1) \
            and (step["pp"] > 0) == (p.pipeline > 1), label


def test_terms_scale_as_documented():
    """Config arithmetic only: doubling the micro-batches doubles tp and the pipeline sends (pp
    less its fixed part per step);
    the distributed optimizer reduce-scatters what the plain one all-reduces and adds the
    weights' all-gather (1/D of the grads' bytes at fp32)."""
    base = _config({"parallel": {"data": 2}})
    dist = _config({"parallel": {"data": 2}, "optim": {"distributed": True}})
    a, b = predict_inner_step_bytes(base, VOCAB), predict_inner_step_bytes(dist, VOCAB)
    assert b["dp"] == a["dp"] + a["dp"] // 2  # one bucket per buffer, no padding at this size
    t1 = predict_inner_step_bytes(_config({"parallel": {"tensor": 2}}), VOCAB)
    t2 = predict_inner_step_bytes(_config({"parallel": {"tensor": 2}, "train": {"global_batch_size": 8}}), VOCAB)
    assert t2["tp"] == 2 * t1["tp"]
    # pp: the sends per micro-batch over a fixed part per step (the tied table's all-reduce)
    p1, p2, p4 = (predict_inner_step_bytes(_config({"parallel": {"pipeline": 2}, "train": {"global_batch_size": 4 * k}}),
                                           VOCAB)["pp"] for k in (1, 2, 4))
    assert p2 - p1 > 0 and p4 - p2 == 2 * (p2 - p1)


def test_dept_costs_tool_reports_inner_steps_and_records():
    """tools/dept_costs.py: each variant's ``inner_step_bytes`` is the module's prediction with the
    variant's vocabulary, and with --groups ``record_bytes`` is what the real-run test above
    checks a round record against (``expected_record``)."""
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("dept_costs_tool", os.path.join(root, "tools", "dept_costs.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    layout = ["parallel.tensor=2", "parallel.data=2", "parallel.pipeline=2", "parallel.sequence_parallel=true",
              "optim.distributed=true", "model.tie_embeddings=true", "model.num_layers=4"]
    args = tool.parse_args(["--config", os.path.join(root, "examples/tiny/glob.yaml"), *layout,
                            "--global-vocab", "2000", "--source-vocab", "1500", "--trim-vocab", "900",
                            "--groups", "3"])
    out = tool.compute(args)
    from dept_mega.config import load_config
    cfg = load_config(args.config, layout)
    for name, vocab, per_group in (("glob", 2000, [2000] * 3), ("trim", 900, [900] * 3),
                                   ("spec_opt", 1500, [1500] * 3)):
        c = out["variants"][name]
        one = tool._variant(cfg, name)
        assert c["inner_step_bytes"] == predict_inner_step_bytes(one, vocab), name
        assert all(c["inner_step_bytes"][k] > 0 for k in ("dp", "tp", "pp")), name
        record = expected_record(one, per_group, global_vocab=2000, extras=False)
        assert c["record_bytes"] == record, name
    text = tool.table(out)
    assert "inner step of one group" in text and "round record's dp / tp / pp" in text

