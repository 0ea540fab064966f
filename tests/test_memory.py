"""The memory model (dept_mega/dept/memory.py) against the tensors a real run holds.

After one round of a tiny model on 2 gloo ranks, the bytes of the parameters, gradient
buffers, optimizer state and masters, outer-sync state and TRIM's φ (counted from the objects,
each storage once: ``memory.held_bytes``) equal ``predict_memory`` exactly, for DP 2, TP 2 with
sequence parallelism and PP 2; fp32 and bf16 weights; the distributed optimizer on and off
(small buckets, so that several buckets and their padding count), with the outer state on the
distributed optimizer's master shards under bf16; every variant; the body in fragments with
error feedback and the eager start's estimate.
"""
from __future__ import annotations

import pytest
import torch

from dept_mega.dept.memory import (CE_TOKEN_BYTES, MEMORY_KEYS, activation_bytes, ce_transient_bytes, held_bytes,
                                   predict_memory)
from tests.dept_utils import SyntheticSource, allowed_ids, run_dept, source_infos, tiny_config
from tests.mp_utils import run_distributed

LAYOUTS = ({"data": 2}, {"tensor": 2, "sequence_parallel": True}, {"pipeline": 2})
# (precision, optim.distributed, outer optimizer, tie_embeddings)
SETTINGS = (("fp32", False, "adam", True), ("bf16", False, "nesterov", False), ("fp32", True, "fedavg", False))
ODD_WIDTH = {"hidden_size": 15, "num_attention_heads": 3, "num_query_groups": 3, "ffn_hidden_size": 30}
COUNTED = ("weights", "grads", "optimizer", "outer", "trim_table")


def _over(variant, parallel, precision, distributed, outer, tied):
    return {"dept": {"variant": variant, "local_steps": 1, "outer_optimizer": {"name": outer}},
            "train": {"steps": 1}, "parallel": parallel, "precision": precision,
            "model": {"position_embedding": "learned", "tie_embeddings": tied},
            "optim": {"distributed": distributed, "grad_bucket_size": 700}}


def _runs():
    runs = []
    for parallel in LAYOUTS:
        for variant in ("std", "glob", "trim", "spec", "spec_opt"):
            for precision, distributed, outer, tied in SETTINGS:
                runs.append(_over(variant, parallel, precision, distributed, outer, tied))
            # the outer state on the distributed optimizer's master shards; under DP an odd
            # width, so that buckets are padded and the shards are not near-equal chunks
            over = _over(variant, parallel, "bf16", True, "fedavg" if variant == "std" else "adam",
                         variant != "glob")
            if parallel.get("data", 1) > 1:
                over["model"].update(ODD_WIDTH)
            runs.append(over)
        # the body in 2 fragments (one FlatSync each), error feedback's residual; GLOB's
        # tables too; on master shards and on 1/D chunks
        for distributed in (False, True):
            over = _over("glob", parallel, "bf16", distributed, "nesterov", False)
            over["dept"].update(outer_fragments=2, outer_comm_dtype="int8", outer_error_feedback=True, local_steps=2)
            if distributed:  # with the eager start's estimate E
                over["dept"].update(outer_overlap=True, outer_delay=1, outer_overlap_rule="eager")
            over["train"]["steps"] = 2
            runs.append(over)
    return runs


def _worker(rank, world, runs):
    from dept_mega.parallel.groups import build_groups
    from dept_mega.trainer import Trainer

    out = []
    pgs = {}
    for over in runs:
        cfg = tiny_config(over)
        p = cfg.parallel
        key = (p.tensor, p.data, p.pipeline)
        if key not in pgs:
            pgs[key] = build_groups(*key)
        pg = pgs[key]
        variant = cfg.dept.variant
        infos = source_infos(1, trim=variant == "trim", vocabs=(60,) if variant == "spec_opt" else None)
        if variant == "std":
            torch.manual_seed(cfg.train.seed)
            trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=infos[0].vocab_size)
            it = SyntheticSource(cfg, 1, allowed_ids(infos[0]), pg.dp_rank, pg.dp_size)
            trainer.train_step(it.next_step())
            held = held_bytes(trainer)
        else:
            res = run_dept(cfg, infos, 1, pg=pg)
            held = held_bytes(res["trainer"], res["hooks"])
        trim = [int(infos[0].vocab_ids.numel())] if variant == "trim" else []
        pred = predict_memory(cfg, 96, source_vocabs=[60], trim_vocabs=trim, stage=pg.pp_rank)
        largest = predict_memory(cfg, 96, source_vocabs=[60], trim_vocabs=trim)
        out.append({"held": held, "pred": pred, "largest": largest, "pp": pg.pp_rank})
    return out


@pytest.mark.timeout(300)
def test_held_bytes_equal_the_prediction():
    runs = _runs()
    res = run_distributed(_worker, 2, args=(runs,))
    for i, over in enumerate(runs):
        # each pipeline stage's largest rank against the prediction for that stage
        for pp in sorted({r[i]["pp"] for r in res}):
            ranks = [r[i] for r in res if r[i]["pp"] == pp]
            held = max((r["held"] for r in ranks), key=lambda h: sum(h.values()))
            pred = ranks[0]["pred"]
            for k in COUNTED:
                assert held[k] == pred[k], (over, pp, k, held, pred)
        # without a stage: the stage with the largest total (activations and the CE transient count)
        largest = res[0][i]["largest"]
        assert largest["total"] == max(r[i]["pred"]["total"] for r in res)
        assert set(MEMORY_KEYS) <= set(largest)


def test_activation_formula_by_recompute_mode():
    """Selective drops the attention core's saved tensors, full keeps one input per layer, SP
    divides the replicated part by T; the bias backend adds the s² scores."""
    base = {"model": {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 4,
                      "ffn_hidden_size": 256, "seq_length": 32, "vocab_size": 96},
            "train": {"micro_batch_size": 2, "global_batch_size": 4}, "precision": "bf16"}
    from tests.dept_utils import merge
    from dept_mega.config import config_from_dict

    def act(**over):
        return activation_bytes(config_from_dict(merge(base, over)), 96, 0)

    none, sel, full = act(), act(model={"recompute": "selective"}), act(model={"recompute": "full"})
    assert full < sel < none
    s, b, h, L, a = 32, 2, 64, 4, 2
    # full: each layer's input + the token ids + the final norm's input, statistics (fp32 mean and
    # 1/σ of LayerNorm) and output (the head's input) + the logits (saved by the cross entropy, in
    # the activation dtype) + its per-token statistics
    assert config_from_dict(base).model.normalization == "layernorm"
    assert full == (L * s * b * h * a + 8 * s * b + 2 * s * b * h * a + 2 * 4 * s * b + s * b * 128 * a
                    + CE_TOKEN_BYTES * s * b)
    assert act(model={"recompute": "full", "recompute_layers": 2}) == full + 2 * (none - full) // L
    tp = act(parallel={"tensor": 2})
    sp = act(parallel={"tensor": 2, "sequence_parallel": True})
    assert sp < tp < none
    assert act(model={"attention_backend": "bias"}) > none
    # Transformer Engine's column layers keep the gathered QKV and fc1 inputs, not their shards
    # (sp_linear.py is for the torch GEMMs): 2 (sbh - sbh/T) a more per layer; without SP nothing changes
    assert act(backend="transformer_engine", parallel={"tensor": 2, "sequence_parallel": True}) \
        == sp + L * 2 * (s * b * h - s * b * h // 2) * a
    assert act(backend="transformer_engine", parallel={"tensor": 2}) == tp


def _allocated_peak(fn) -> tuple[int, int]:
    """Peak bytes allocated on the CPU while ``fn`` runs, beyond what was allocated before, and
    the bytes still allocated when it returns (the profiler's allocator events, summed in time
    order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak, cur


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_cross_entropy_buffers_are_the_modelled_ones(precision):
    """The cross entropy on the CPU (its eager math), as the model's loss calls it (padded
    columns masked by ``vocab_size``, gradient written into the logits): its forward and its
    backward each allocate one fp32 copy of the unpadded columns at their peak
    (``ce_transient_bytes(eager=True)``; compiled on CUDA there is none) and keep only per-token
    vectors (``CE_TOKEN_BYTES``, in ``activation_bytes`` beside the logits themselves); the
    gradient is the logits' own storage. A second fp32 copy, or a new gradient buffer, would
    exceed the slack of a few bytes per token."""
    from dept_mega.config import config_from_dict
    from dept_mega.dept.memory import CE_TOKEN_BYTES
    from dept_mega.parallel.cross_entropy import vocab_parallel_cross_entropy
    from dept_mega.parallel.groups import build_groups

    cfg = config_from_dict({"model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                                      "ffn_hidden_size": 64, "seq_length": 64, "vocab_size": 1000},
                            "train": {"micro_batch_size": 2, "global_batch_size": 2}, "precision": precision})
    s, b, v, v_pad = 64, 2, 1000, 1024
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    labels = torch.randint(0, v, (s, b))
    base = torch.randn(s, b, v_pad, dtype=dtype, requires_grad=True)
    logits = base * 1  # a non-leaf, as the head's output
    pg = build_groups()
    held = {}

    def forward():
        held["loss"] = vocab_parallel_cross_entropy(logits, labels, pg, vocab_size=v, consume_logits=True)

    def backward():
        (held["grad"],) = torch.autograd.grad(held["loss"].sum(), logits)

    predicted = ce_transient_bytes(cfg, v, 0, eager=True)
    assert predicted == s * b * v * 4 and ce_transient_bytes(cfg, v, 0) == 0
    slack = 64 * s * b  # per-token vectors (labels, masks, statistics, the loss)
    fwd_peak, fwd_kept = _allocated_peak(forward)
    assert 0 <= fwd_peak - predicted <= slack, (fwd_peak, predicted)
    assert CE_TOKEN_BYTES * s * b <= fwd_kept <= slack, fwd_kept  # nothing vocabulary-sized kept
    bwd_peak, _ = _allocated_peak(backward)
    assert 0 <= bwd_peak - predicted <= slack, (bwd_peak, predicted)
    assert held["grad"].data_ptr() == logits.data_ptr()  # the gradient is written into the logits
    assert torch.isfinite(held["grad"]).all() and not held["grad"][..., v:].any()


@pytest.mark.gpu
def test_activation_memory_script_on_gpu(tmp_path):
    """benchmarks/activation_memory.py runs on a CUDA device and measures every recompute mode;
    the prediction is within a factor of two of the measured peak (the comparison itself goes
    into docs/performance.md)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import json
    import subprocess
    import sys

    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {num_layers: 4, hidden_size: 1024, num_attention_heads: 8, num_query_groups: 8, "
                   "ffn_hidden_size: 4096, seq_length: 1024, vocab_size: 32000}\n"
                   "precision: bf16\ntrain: {micro_batch_size: 4, global_batch_size: 8}\n")
    out = tmp_path / "act.json"
    subprocess.run([sys.executable, "benchmarks/activation_memory.py", "--config", str(cfg), "--out", str(out)],
                   check=True)
    res = json.loads(out.read_text())["modes"]
    assert set(res) == {"none", "selective", "full"}
    for r in res.values():
        assert 0.5 < r["predicted_bytes"] / r["measured_peak_bytes"] < 2.0
    assert res["full"]["measured_peak_bytes"] < res["none"]["measured_peak_bytes"]


def test_dept_costs_memory_json(tmp_path, capsys):
    """tools/dept_costs.py --memory --json: every variant has exactly the memory keys, in int
    bytes; lean outer state and the distributed optimizer shrink what they should. (The tool's
    ``main`` in this process, which has torch imported: a subprocess would import it again, ~3 s
    of CPU a call; the script's own start is tests/test_costs.py's.)"""
    import json

    from tests.test_costs import _tool
    tool = _tool()
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {num_layers: 2, hidden_size: 64, num_attention_heads: 4, ffn_hidden_size: 256, "
                   "seq_length: 32, vocab_size: 500}\nparallel: {data: 4}\nprecision: fp32\n"
                   "dept: {variant: glob}\ntrain: {micro_batch_size: 2, global_batch_size: 16}\n")

    def run(*extra):
        capsys.readouterr()
        assert tool.main(["--config", str(cfg), "--source-vocab", "300", "--trim-vocab", "200", "--memory", "--json",
                          *extra]) == 0
        return json.loads(capsys.readouterr().out)["variants"]

    full, lean = run("--outer-state", "full"), run("--outer-state", "lean", "--set", "optim.distributed=true")
    for name, v in full.items():
        assert list(v["memory"]) == list(MEMORY_KEYS) and all(isinstance(x, int) for x in v["memory"].values())
        assert lean[name]["memory"]["optimizer"] < v["memory"]["optimizer"]
    assert full["std"]["memory"]["outer"] == 0 and full["glob"]["memory"]["outer"] > full["spec"]["memory"]["outer"]
    assert lean["glob"]["memory"]["outer"] < full["glob"]["memory"]["outer"]
    assert full["trim"]["memory"]["trim_table"] > 0 == full["spec"]["memory"]["trim_table"]
