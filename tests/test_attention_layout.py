"""The memory traffic of a transformer block's layout changes: how many copy kernels its forward
and backward would launch on CUDA, counted on CPU at the dispatcher, and the layout of the
compiled flex_attention region's output.

What was found on an H200 (1B model, torch 2.11, bf16, flex_attention): four strided
``elementwise_kernel`` copies of an ``[s, b, h]``-sized tensor per layer and micro-batch, 3.1%
of the step. Three were the backward of the QKV split (``torch.cat`` of dq, dk, dv): CUDA's cat
runs one batched kernel only for tensors of at most four dimensions
(``aten/src/ATen/native/cuda/Shape.cu``: ``CAT_ARRAY_MAX_INPUT_DIMS``) and otherwise one
``narrow(...).copy_`` per piece, and the split was of a 5-d view. The fourth was AOT autograd's
copy of the gradient of the compiled flex region's ``[b, H, s, d]`` output to contiguous memory
(torch 2.11: ``torch._functorch.config.guess_tangent_strides_as_outputs = False``); the region
now returns a contiguous ``[s, b, H, d]`` tensor (``model/attention.py``).
"""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dept_mega.model.attention import CoreAttention, FlexState
from dept_mega.model.backends import AttentionPlan, resolve_backends
from dept_mega.model.gpt import TransformerBody
from dept_mega.model.layers import PositionState
from dept_mega.parallel.groups import build_groups
from tests.model_utils import rel_err, tiny_config

CUDA_CAT_MAX_DIMS = 4  # CAT_ARRAY_MAX_INPUT_DIMS in aten/src/ATen/native/cuda/Shape.cu
S, B, HEAD_DIM = 32, 2, 16


class CopyKernels(TorchDispatchMode):
    """Counts the copy kernels that the aten ops run under it would launch on CUDA, for
    outputs of at least ``min_numel`` elements: one per ``copy_`` / ``clone`` / ``_to_copy``
    (into new memory); for ``cat``, one batched kernel when the output has at most four
    dimensions, else one copy per input (cat_out_cuda's fallback)."""

    def __init__(self, min_numel: int) -> None:
        super().__init__()
        self.min_numel = min_numel
        self.copies: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in ("copy_", "clone", "_to_copy", "cat"):
            return out
        result = out if isinstance(out, torch.Tensor) else None
        if result is None or result.numel() < self.min_numel:
            return out
        node = torch._C._current_autograd_node()
        where = f"backward of {node.name()}" if node is not None else "forward"
        if name == "cat":
            pieces = [t for t in args[0] if t.numel() > 0]
            n = 1 if result.dim() <= CUDA_CAT_MAX_DIMS else len(pieces)
            self.copies += [f"cat of {len(pieces)} into {tuple(result.shape)} ({where})"] * n
        elif name == "copy_" or result.untyped_storage().data_ptr() not in {
                t.untyped_storage().data_ptr() for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)}:
            self.copies.append(f"{name} {tuple(result.shape)} ({where})")
        return out


def _block(kind: str, position: str, heads: int, groups: int, dtype=torch.bfloat16, device="cpu",
           seq: int = S) -> TransformerBody:
    """One transformer block of the 1B model's kind (LayerNorm without bias, GELU, no linear
    biases), ``heads`` heads of ``HEAD_DIM``, with attention ``kind``."""
    cfg = tiny_config(num_layers=1, hidden_size=heads * HEAD_DIM, num_attention_heads=heads,
                      num_query_groups=groups, position_embedding=position, seq_length=seq,
                      norm_bias=False, attention_backend="bias").model
    backends = dataclasses.replace(resolve_backends(cfg, device), attention=AttentionPlan(kind))
    return TransformerBody(cfg, build_groups(), [0], final_norm=False, seed=1, backends=backends, dtype=dtype,
                           device=device)


def _inputs(hidden: int, dtype=torch.bfloat16, device="cpu", seq: int = S) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(seq, B, hidden, generator=torch.Generator().manual_seed(0)).to(device, dtype).requires_grad_()
    w = torch.randn(seq, B, hidden, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    return x, w


def _count_copies(body: TransformerBody, hidden: int) -> list[str]:
    x, w = _inputs(hidden)
    (body(x) * w).sum().backward()  # first call: the bias path caches its bias
    counter = CopyKernels(min_numel=S * B * HEAD_DIM)
    with counter:
        (body(x) * w).sum().backward()
    return counter.copies


# (kind, position, heads, groups) -> the copy kernels a block's forward + backward launches:
# MHA: one, the batched cat assembling the QKV gradient from dq, dk, dv (separate buffers of the
# attention kernel's backward). GQA adds the query heads' copy out of the grouped QKV layout (the
# heads of a group are not one stride apart) and, on the bias path, K and V repeated per head.
EXPECTED = {("bias", "alibi", 4, 4): 1, ("sdpa", "learned", 4, 4): 1,
            ("bias", "alibi", 4, 2): 4, ("sdpa", "learned", 4, 2): 2}


@pytest.mark.parametrize("kind,position,heads,groups", list(EXPECTED))
def test_block_copy_kernels(kind, position, heads, groups):
    copies = _count_copies(_block(kind, position, heads, groups), heads * HEAD_DIM)
    assert len(copies) == EXPECTED[kind, position, heads, groups], copies


def _split_views(heads: int, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the block makes them: pieces of the grouped QKV output ``[s, b, ...]``."""
    qpg = heads // groups
    qkv = torch.randn(S, B, groups, (qpg + 2) * HEAD_DIM, generator=torch.Generator().manual_seed(2))
    q, k, v = torch.split(qkv, [qpg * HEAD_DIM, HEAD_DIM, HEAD_DIM], dim=3)
    return q.reshape(S, B, heads, HEAD_DIM), k, v


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2)])
def test_compiled_flex_region_returns_contiguous_sbhd(heads, groups):
    """The function FlexState compiles returns a contiguous ``[s, b, H, d]`` tensor for the
    block's q/k/v views (Dynamo's traced output, i.e. the compiled region's boundary), so the
    gradient arriving there is contiguous and AOT autograd copies nothing before the kernel's
    backward; the eager kernel (CoreAttention) gives the same layout."""
    cfg = tiny_config(num_attention_heads=heads, num_query_groups=groups, hidden_size=heads * HEAD_DIM,
                      seq_length=S).model
    positions = PositionState(cfg, 0, 1, flex=True, compile_flex=False)
    state = positions.flex
    q, k, v = _split_views(heads, groups)
    traced = []

    def capture(gm, example_inputs):
        (outs,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
        traced.extend(o.meta["example_value"] for o in tree_flatten(outs)[0])
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(state._plain, backend=capture, dynamic=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        out = fn(q, k, v, state._score_mods["cpu"], state._masks[(S, "cpu")], heads != groups)
        eager = CoreAttention("flex", positions, q_per_group=heads // groups, dropout_p=0.0, rng=None)(q, k, v)
    assert len(traced) == 1 and tuple(traced[0].shape) == (S, B, heads, HEAD_DIM)
    assert traced[0].is_contiguous(), traced[0].stride()
    assert out.is_contiguous() and eager.is_contiguous()
    assert torch.equal(out, eager)


def test_flex_state_takes_the_sbhd_layout():
    """FlexState is called with ``[s, b, H, d]`` tensors: its mask is the one for ``s``."""
    cfg = tiny_config(num_attention_heads=4, num_query_groups=4, hidden_size=4 * HEAD_DIM, seq_length=S).model
    state = FlexState(PositionState(cfg, 0, 1).slopes, compile=False)
    q, k, v = _split_views(4, 4)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        out = state(q, k, v, enable_gqa=False)
    assert out.shape == q.shape and list(state._masks) == [(S, "cpu")]


def test_no_gradient_copy_at_the_compiled_flex_region(monkeypatch):
    """The copy that AOT autograd made of the gradient arriving at the compiled flex region,
    reproduced on CPU: torch 2.11 (the GPU machine's) expects a compiled region's output
    gradients in contiguous memory format (``guess_tangent_strides_as_outputs = False``) and
    copies one that is not (``coerce_to_expected_memory_format``). Run with that setting,
    ``aot_eager`` (the same AOT autograd wrappers as inductor) and flex_attention's CPU refusal
    of a backward lifted (its reference backward runs on any device): no copy; and the block's
    gradients are the bias path's."""
    import torch._dynamo  # noqa: F401 - loads AOT autograd's runtime wrappers
    import torch._functorch._aot_autograd.runtime_wrappers as wrappers
    import torch.nn.attention.flex_attention as flex_module
    for module, name in ((flex_module, "_validate_device"), (wrappers, "coerce_to_expected_memory_format")):
        if not hasattr(module, name):
            pytest.skip(f"this torch has no {module.__name__}.{name} (the test reproduces torch 2.11's path)")
    monkeypatch.setattr(flex_module, "_validate_device", lambda *args: None)
    real, calls, copies = wrappers.coerce_to_expected_memory_format, [], []

    def counting(x, memory_format):
        y = real(x, memory_format)
        calls.append(tuple(x.shape))
        if y is not x:
            copies.append((tuple(x.shape), x.stride()))
        return y

    monkeypatch.setattr(wrappers, "coerce_to_expected_memory_format", counting)
    grads = {}
    torch._dynamo.reset()
    try:
        for kind in ("bias", "flex"):
            body = _block(kind, "alibi", 4, 4, dtype=torch.float32)
            if kind == "flex":
                state = body.positions.flex
                state._kernel = torch.compile(state._plain, backend="aot_eager", dynamic=False)
            x, w = _inputs(4 * HEAD_DIM, dtype=torch.float32)
            with torch._functorch.config.patch(guess_tangent_strides_as_outputs=False), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                (body(x) * w).sum().backward()
            grads[kind] = [x.grad] + [p.grad for p in body.parameters()]
    finally:
        torch._dynamo.reset()
    assert calls, "the compiled region's backward did not run"
    assert copies == []
    for got, want in zip(grads["flex"], grads["bias"]):
        assert rel_err(got, want) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_block_launches_no_direct_copy_on_cuda():
    """On a GPU: one block's forward + backward (compiled flex_attention, ALiBi, bf16, one query
    head per group, as the 1B model) launches no ``direct_copy_kernel`` (the H200 profile's
    strided ``elementwise_kernel`` copies, four per layer and micro-batch before) and one batched
    cat (the QKV gradient)."""
    seq = 128  # flex_attention's main kernel, not the decoding one
    body = _block("flex", "alibi", 4, 4, device="cuda", seq=seq)
    x, w = _inputs(4 * HEAD_DIM, device="cuda", seq=seq)
    (body(x) * w).sum().backward()  # compiles
    body.zero_grad(set_to_none=True)
    x.grad = None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        (body(x) * w).sum().backward()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert [n for n in names if "copy_kernel" in n.lower()] == []
    assert sum("CatArrayBatchedCopy" in n for n in names) == 1, names
