"""Gradient-accumulation fusion (``optim.grad_accum_fusion``, dept_mega/parallel/wgrad.py).

* fused on vs off: the same losses, gradient norms and evaluation losses (fp32, within 1e-6
  relative; on this CPU they are identical) with several micro-batches in one process (tied and
  untied head), full recomputation, DEPT SPEC (stored sources' buffers released) and TRIM, and on two
  processes with DP 2 + overlap + the distributed optimizer, TP 2 + sequence parallelism
  (column-parallel head) and PP 2 × VP 2 (the last stage's tied head copy); every fused weight
  accumulated once per micro-batch through the fused GEMM and ``param.grad`` stays None;
* the bookkeeping: a fused weight receiving more accumulations than expected raises the
  gradient buffer's error; outside a training step the layer gives plain autograd gradients.
* compiled code (train.compile) runs the fused layer outside its graph; the backends line names the accumulation.
"""
from __future__ import annotations

import pytest
import torch

import dept_mega.parallel.wgrad as wgrad
from dept_mega.grad_buffer import GradBuffer, GradSync
from dept_mega.model.embeddings import SourceEmbeddings
from dept_mega.parallel.groups import build_groups
from dept_mega.parallel.layers import FUSED_TORCH_GEMM, ColumnParallelLinear, _GemmMixin
from dept_mega.trainer import Trainer
from tests.mp_utils import run_distributed
from tests.trainer_utils import assert_close, dp_micro_batches, global_batch, tiny_config

STEPS = 3


def fused_weights(trainer: Trainer) -> list[torch.nn.Parameter]:
    out = []
    for st in trainer.stages:
        for m in st.modules():
            if isinstance(m, _GemmMixin) and m.gemm.fuse_wgrad:
                out.append(m.weight)
            elif isinstance(m, SourceEmbeddings) and m.fuse_tied_head:
                out.append(m.word_embeddings.weight)
    return out


class CountFused:
    """Counts the fused weight-gradient accumulations (wraps ``wgrad.add_wgrad``)."""

    def __init__(self) -> None:
        self.calls = 0
        self._orig = wgrad.add_wgrad

    def __enter__(self) -> "CountFused":
        def counted(*args):
            self.calls += 1
            return self._orig(*args)
        wgrad.add_wgrad = counted
        return self

    def __exit__(self, *exc) -> None:
        wgrad.add_wgrad = self._orig


def train_record(over: dict, overrides: tuple[str, ...]) -> dict:
    cfg = tiny_config(over, overrides)
    p = cfg.parallel
    pg = build_groups(p.tensor, p.data, p.pipeline)
    trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=cfg.model.vocab_size)
    fused = fused_weights(trainer)
    losses, norms, calls = [], [], []
    for step in range(STEPS):
        mbs = dp_micro_batches(cfg, global_batch(cfg, step), pg.dp_rank, pg.dp_size)
        with CountFused() as count:
            res = trainer.train_step(mbs)
        losses.append(res.loss)
        norms.append(res.grad_norm)
        calls.append(count.calls / max(1, len(fused) * len(mbs)))  # accumulations per fused weight and micro-batch
        assert all(w.grad is None for w in fused)
    loss_sum, tokens = trainer.eval_batches(dp_micro_batches(cfg, global_batch(cfg, 10_000), pg.dp_rank, pg.dp_size))
    return {"loss": losses, "grad_norm": norms, "eval": [loss_sum / tokens], "calls": calls, "fused": len(fused)}


def dept_record(variant: str, fuse: bool) -> dict:
    from tests.dept_utils import run_dept, source_infos
    from tests.dept_utils import tiny_config as dept_config
    cfg = dept_config({"dept": {"variant": variant, "local_steps": 2}, "optim": {"grad_accum_fusion": fuse}})
    with CountFused() as count:
        out = run_dept(cfg, source_infos(2, trim=variant == "trim"), 2)
    return {"loss": out["losses"], "calls": count.calls}


def _compare(on: dict, off: dict, what: str) -> None:
    for key in ("loss", "grad_norm", "eval"):
        if key in off:
            assert_close(on[key], off[key], 1e-6, f"{what} {key}")


SINGLE = {
    "mb4_tied": ({}, ()),
    "mb4_untied_bias_recompute_full": ({"model": {"tie_embeddings": False, "bias": True, "recompute": "full"}}, ()),
}


@pytest.mark.parametrize("name", list(SINGLE) + ["dept_spec", "dept_trim"])
def test_fused_matches_unfused_one_process(name):
    if name.startswith("dept_"):
        variant = name[len("dept_"):]
        on, off = dept_record(variant, True), dept_record(variant, False)
        assert on["calls"] > 0 and off["calls"] == 0
        _compare(on, off, name)
        return
    over, extra = SINGLE[name]
    on = train_record(over, extra + ("optim.grad_accum_fusion=true",))
    off = train_record(over, extra + ("optim.grad_accum_fusion=false",))
    # every block GEMM (4 per block) and, untied, the head: once per micro-batch each
    assert on["fused"] == 4 * 4 + (name != "mb4_tied") and on["calls"] == [1.0] * STEPS
    assert off["fused"] == 0 and off["calls"] == [0.0] * STEPS
    _compare(on, off, name)


LAYOUTS = {
    "dp2_overlap_distributed": ({}, ("parallel.data=2", "optim.distributed=true", "optim.grad_bucket_size=3000")),
    "tp2_sp_untied": ({"model": {"tie_embeddings": False}},
                      ("parallel.tensor=2", "parallel.sequence_parallel=true")),
    "pp2_vp2_tied": ({}, ("parallel.pipeline=2", "parallel.virtual_pipeline=2")),
}


def layouts_worker(rank: int, world_size: int, steps: int) -> dict:
    torch.manual_seed(0)
    return {(name, fuse): train_record(over, extra + (f"optim.grad_accum_fusion={str(fuse).lower()}",))
            for name, (over, extra) in LAYOUTS.items() for fuse in (True, False)}


@pytest.mark.timeout(120)
def test_fused_matches_unfused_dp_tp_sp_pp():
    results = run_distributed(layouts_worker, 2, args=(STEPS,), timeout=110)
    for rank, got in enumerate(results):
        for name in LAYOUTS:
            on, off = got[(name, True)], got[(name, False)]
            assert on["fused"] > 0 and on["calls"] == [1.0] * STEPS, (name, rank, on)
            assert off["calls"] == [0.0] * STEPS
            _compare(on, off, f"{name} rank {rank}")
    # PP 2 × VP 2: the last stage holds the tied head copy (fused: no input embedding on that chunk)
    assert results[1][("pp2_vp2_tied", True)]["fused"] == results[0][("pp2_vp2_tied", True)]["fused"] + 1


def test_bookkeeping_extra_accumulation_raises_and_plain_autograd_outside_a_step():
    pg = build_groups()
    lin = ColumnParallelLinear(8, 6, pg, name="l", seed=0, init_std=0.5, gemm=FUSED_TORCH_GEMM)
    ref = ColumnParallelLinear(8, 6, pg, name="l", seed=0, init_std=0.5)
    buf = GradBuffer([lin.weight], torch.float32, torch.device("cpu"), bucket_size=1000)
    buf.adopt()
    sync = GradSync(pg, overlap=True)
    xs = [torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    sync.begin([buf], {id(lin.weight): 2})
    for x in xs[:2]:
        lin(x).square().sum().backward()
        ref(x).square().sum().backward()
    assert lin.weight.grad is None and buf.counts[id(lin.weight)] == 2
    assert buf.buckets[0].launched  # final after the expected two: (overlap) launched
    torch.testing.assert_close(lin.weight.main_grad, ref.weight.grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="arrived after its bucket's data-parallel reduction started"):
        lin(xs[2]).sum().backward()
    sync.finish()
    # outside a step (no active buffer): the layer returns its weight gradient to autograd
    lin(xs[0]).square().sum().backward()
    ref.weight.grad = None
    ref(xs[0]).square().sum().backward()
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-6)


def test_accumulation_call_by_device_and_dtypes():
    cpu = torch.device("cpu")
    assert wgrad.wgrad_call(cpu, torch.float32, torch.float32) == "addmm_"
    assert wgrad.wgrad_call(cpu, torch.bfloat16, torch.bfloat16) == "addmm_"
    assert wgrad.wgrad_call(cpu, torch.bfloat16, torch.float32) == "addmm_fp32_operands"
    with pytest.raises(ValueError, match="optim.grad_accum_fusion"):
        wgrad.wgrad_call(cpu, torch.float32, torch.bfloat16)
    # the fp32-operand path: fp32 accumulation of the bf16 values
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(32, n, generator=g).bfloat16() for n in (6, 5))
    main = torch.randn(6, 5, generator=g)
    want = main + a.double().t() @ b.double()
    wgrad.add_wgrad(main, a, b)
    torch.testing.assert_close(main.double(), want, rtol=1e-6, atol=1e-6)


def test_inside_a_compiled_region_the_fused_layer_runs_outside_the_graph():
    """train.compile: Dynamo would not re-evaluate the backward's Python bookkeeping once traced
    (parallel/wgrad.py), so a fused linear called from compiled code is a graph break and runs
    eagerly: fused in every step (the second traced step is where tracing it failed), the
    buffer's counts right, no param.grad."""
    import torch._dynamo
    pg = build_groups()
    w = torch.nn.Parameter(torch.randn(6, 8, generator=torch.Generator().manual_seed(1)))
    buf = GradBuffer([w], torch.float32, torch.device("cpu"), bucket_size=1000)
    buf.adopt()
    sync = GradSync(pg, overlap=True)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))

    def loss(x):
        return (wgrad.linear(x, w, None, True) * 1.5).square().sum()

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    want = 2 * 2.25 * (x @ w.detach().t()).t() @ x
    for fn in (loss, torch.compile(loss, backend="aot_eager"), torch.compile(loss, backend="aot_eager")):
        for mbs in (1, 2):
            sync.begin([buf], {id(w): mbs})
            with CountFused() as count:
                for _ in range(mbs):
                    fn(x).backward()
            sync.finish()
            assert count.calls == mbs and buf.counts[id(w)] == mbs and w.grad is None
            torch.testing.assert_close(w.main_grad, mbs * want, rtol=1e-5, atol=1e-5)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) >= 1


def test_backends_line_names_the_accumulation():
    from dept_mega.model.backends import resolve_backends
    line = resolve_backends(tiny_config(overrides=("precision=bf16",))).describe()
    # pipeline 1: the tied head shares the one chunk with the input embedding (not fused there)
    assert "grad_accum_fusion=on [torch GEMMs]: " + wgrad.PATHS["addmm_fp32_operands"] in line, line
    piped = resolve_backends(tiny_config(overrides=("precision=bf16", "parallel.pipeline=2"))).describe()
    assert ("grad_accum_fusion=on [torch GEMMs, tied head on a chunk without the input embedding]: "
            + wgrad.PATHS["addmm_fp32_operands"]) in piped, piped
    off = resolve_backends(tiny_config(overrides=("optim.grad_accum_fusion=false",))).describe()
    assert "grad_accum_fusion=off |" in off, off
    # an explicit fp8_gemm: cublaslt still accumulates its weight gradients in the GEMM: said
    lt = resolve_backends(tiny_config(overrides=("optim.grad_accum_fusion=false", "precision=bf16", "fp8=hybrid",
                                                 "backend=local", "fp8_gemm=cublaslt"))).describe()
    assert ("grad_accum_fusion=off [but the fp8 GEMMs accumulate into main_grad themselves: fp8_gemm cublaslt]"
            in lt), lt
    compiled = resolve_backends(tiny_config(overrides=("train.compile=true", "model.tie_embeddings=false"))).describe()
    assert "grad_accum_fusion=on [torch GEMMs (outside the compiled graphs: a graph break each), output head]: " in compiled
