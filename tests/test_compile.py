"""``train.compile: true``: every transformer block is compiled with ``torch.compile`` (in place,
so parameter names and checkpoints do not change) and training gives the eager losses; a
platform that cannot compile is one clear ``BackendError`` line."""
from __future__ import annotations

import pytest

from dept_mega.model import BackendError, build_model
from dept_mega.model import gpt as gpt_module
from dept_mega.parallel.groups import build_groups
from tests.trainer_utils import assert_close, tiny_config, train_losses


@pytest.mark.slow
@pytest.mark.parametrize("model", [
    {"hidden_dropout": 0.1},  # the whole block compiled
    # attention dropout: the attention module runs eagerly inside the compiled block (its dropout
    # is seeded from our stream); with selective recomputation of the attention core
    {"hidden_dropout": 0.1, "attention_dropout": 0.1, "recompute": "selective"},
], ids=["compiled-block", "attention-dropout-selective"])
def test_compiled_blocks_give_the_eager_losses(model):
    over = {"model": {"num_layers": 2, **model}, "train": {"steps": 3}}
    eager = train_losses(tiny_config(over), 3)
    compiled_cfg = tiny_config({**over, "train": {"steps": 3, "compile": True}})
    (stage,) = build_model(compiled_cfg, build_groups(), 100, 7)
    (plain,) = build_model(tiny_config(over), build_groups(), 100, 7)
    assert [n for n, _ in stage.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert all(hasattr(b, "_compiled_call_impl") and b._compiled_call_impl is not None
               for b in stage.body.layers.values())
    compiled = train_losses(compiled_cfg, 3)
    # inductor may fuse and reorder fp32 arithmetic: equal within 1e-5, not bit for bit
    assert_close(compiled["loss"], eager["loss"], rel=1e-5, what="loss")
    assert_close(compiled["grad_norm"], eager["grad_norm"], rel=1e-4, what="grad norm")
    assert_close(compiled["eval"], eager["eval"], rel=1e-5, what="eval loss")


def test_compile_with_full_recompute_is_refused():
    from dept_mega.config import ConfigError
    with pytest.raises(ConfigError, match="train.compile.*model.recompute: full is not supported"):
        tiny_config({"model": {"recompute": "full"}, "train": {"compile": True}})


def test_a_platform_that_cannot_compile_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(gpt_module, "compile_problem", lambda device: "InvalidCxxCompiler: No working C++ compiler")
    with pytest.raises(BackendError, match=r"config key 'train.compile': torch.compile cannot run on this platform "
                                           r"\(InvalidCxxCompiler: No working C\+\+ compiler\); set train.compile: false"):
        build_model(tiny_config({"train": {"compile": True}}), build_groups(), 100, 7)


def test_compiled_blocks_trace_flex_attention_without_graph_breaks(monkeypatch):
    """Per-block compile with the flex path: the kernel, the ALiBi score_mod and the causal
    block mask exist before a compiled block runs (made with the model, and by the body's
    forward for a new length), so each block is one graph holding flex_attention — no graph
    break, no recompile from one block or step to the next — and the losses are the eager
    bias path's. Forward only (flex_attention has no backward on CPU); Dynamo's capture with a
    recording backend (inductor's CPU flex kernel takes ~30 s to build here)."""
    import dataclasses

    import torch
    import torch._dynamo

    from dept_mega.model.backends import AttentionPlan
    from tests.trainer_utils import dp_micro_batches, global_batch
    cfg = tiny_config({"model": {"num_layers": 2, "num_query_groups": 2}})  # ALiBi, GQA
    (eager,) = build_model(cfg, build_groups(), 100, 7)  # auto on CPU: the materialised bias
    assert eager.body.layers["0"].attention.core.kind == "bias"
    real = gpt_module.resolve_backends
    monkeypatch.setattr(gpt_module, "resolve_backends",
                        lambda c, d="cpu": dataclasses.replace(real(c, d), attention=AttentionPlan("flex")))
    (flex,) = build_model(cfg, build_groups(), 100, 7)
    assert flex.body.layers["0"].attention.core.kind == "flex"
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for block in flex.body.layers.values():
        block.compile(backend=record)
    with torch.no_grad():
        for step in range(2):
            for mb in dp_micro_batches(cfg, global_batch(cfg, step), 0, 1):
                x, y = mb.tokens[:, :-1], mb.tokens[:, 1:]
                assert_close(flex(x, labels=y).flatten().tolist(), eager(x, labels=y).flatten().tolist(),
                             rel=1e-5, what="per-token loss")
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}
    assert len(graphs) == 1  # both blocks, every micro-batch: one graph
    hops = [n for n in graphs[0].graph.nodes if n.target is torch.ops.higher_order.flex_attention]
    assert len(hops) == 1
    with torch.no_grad():  # another length: its mask is made by the body, outside the blocks
        x, y = mb.tokens[:, :8], mb.tokens[:, 1:9]
        assert_close(flex(x, labels=y).flatten().tolist(), eager(x, labels=y).flatten().tolist(),
                     rel=1e-5, what="per-token loss, 8 tokens")
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {} and len(graphs) == 2  # a new shape: one more


def test_outside_compiled_graphs_is_the_disable_decorator_and_loads_no_dynamo_at_import():
    """``compile_guard.outside_compiled_graphs`` (fp8_linear, the fused-wgrad linear, the cross
    entropy, recompute, attention with dropout): called from compiled code the function runs
    eagerly outside the graph with the same graphs, graph breaks and compiled frames as with
    ``torch.compiler.disable`` (a wrapper Dynamo traces would add a frame and a break per call);
    importing the trainer does not import ``torch._dynamo`` (about a second in every process
    that neither trains nor compiles), the first call does."""
    import subprocess
    import sys

    import torch
    import torch._dynamo

    from dept_mega.compile_guard import outside_compiled_graphs
    from tests.trainer_utils import ROOT

    def traced(decorator):
        @decorator
        def inner(x):
            return torch.sin(x) * 3

        def block(x):
            return inner(torch.cos(inner(torch.relu(x)))) + 1

        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        graphs = []

        def record(gm, example_inputs):
            graphs.append(sorted(str(n.target) for n in gm.graph.nodes if n.op == "call_function"))
            return gm.forward

        x = torch.randn(4)
        compiled = torch.compile(block, backend=record)
        for _ in range(2):  # the second call: the cached graphs, nothing traced again
            torch.testing.assert_close(compiled(x), torch.sin(torch.cos(torch.sin(torch.relu(x)) * 3)) * 3 + 1)
        counters = torch._dynamo.utils.counters
        return graphs, sum(counters["graph_break"].values()), dict(counters["frames"])

    ours, disabled = traced(outside_compiled_graphs), traced(torch.compiler.disable)
    assert ours == disabled, (ours, disabled)
    graphs, breaks, _ = ours
    assert breaks == 2 and not any("sin" in op for g in graphs for op in g), ours  # inner: never in a graph
    assert any("cos" in op for g in graphs for op in g), ours
    code = ("import sys, dept_mega.train, dept_mega.model; a = 'torch._dynamo' in sys.modules; "
            "import torch; from dept_mega.model.recompute import recompute; "
            "recompute(torch.sin, torch.ones(2)); print(a, 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False True", out.stdout + out.stderr[-2000:]
