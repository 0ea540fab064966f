"""The vocabulary-parallel cross entropy (dept_mega/parallel/cross_entropy.py) on one rank:
values and gradients against ``F.cross_entropy`` for fp32 and bf16 logits, padded columns
(``-inf`` or masked by ``vocab_size``), labels outside the shard, the in-place backward
(``consume_logits``), huge logits, and the compiled math (inductor on CPU) against the eager
math. TP 2 against TP 1 and the collectives' bytes: tests/test_parallel_layers.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dept_mega.parallel import cross_entropy as ce
from dept_mega.parallel.cross_entropy import vocab_parallel_cross_entropy
from dept_mega.parallel.groups import build_groups
from tests.model_utils import rel_err

V, PADDED = 40, 48  # 8 padded columns


def _case(dtype=torch.float32, seed=11):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(6, 4, PADDED, generator=g) * 3).to(dtype)
    labels = torch.randint(0, V, (6, 4), generator=g)
    weights = torch.randn(6, 4, generator=g)
    return logits, labels, weights


def _reference(logits, labels, weights):
    """fp32 ``F.cross_entropy`` over the unpadded columns; the padded columns' gradient is 0."""
    x = logits[..., :V].float().detach().requires_grad_(True)
    loss = F.cross_entropy(x.reshape(-1, V), labels.reshape(-1), reduction="none").view(labels.shape)
    (loss * weights).sum().backward()
    return loss.detach(), torch.cat([x.grad, torch.zeros(*labels.shape, PADDED - V)], -1)


def _run(logits, labels, weights, **kw):
    leaf = logits.clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(leaf * 1 if kw.get("consume_logits") else leaf, labels, build_groups(), **kw)
    (loss * weights).sum().backward()
    return loss.detach(), leaf.grad


@pytest.mark.parametrize("how", ["-inf", "vocab_size"])
def test_fp32_matches_torch(how):
    """fp32 logits: losses and gradients equal torch's within 1e-6, padded columns either
    ``-inf`` or (the model's way) holding large values that ``vocab_size`` masks."""
    logits, labels, weights = _case()
    ref_loss, ref_grad = _reference(logits, labels, weights)
    if how == "-inf":
        logits[..., V:] = float("-inf")
        loss, grad = _run(logits, labels, weights)
    else:
        logits[..., V:] = 50.0  # would dominate the sum if not masked
        loss, grad = _run(logits, labels, weights, vocab_size=V, consume_logits=True)
    assert loss.dtype == torch.float32 and loss.shape == labels.shape
    assert rel_err(loss, ref_loss) < 1e-6
    assert rel_err(grad, ref_grad) < 1e-6
    assert torch.equal(grad[..., V:], torch.zeros_like(grad[..., V:]))


def test_bf16_logits_match_the_fp32_reference():
    """bf16 logits: fp32 arithmetic on their values (the loss equals the fp32 reference on the
    same values within 1e-6), the gradient in bf16 within bf16 rounding of the fp32 one."""
    logits, labels, weights = _case(torch.bfloat16)
    ref_loss, ref_grad = _reference(logits, labels, weights)
    logits[..., V:] = 50.0
    loss, grad = _run(logits, labels, weights, vocab_size=V, consume_logits=True)
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    assert rel_err(loss, ref_loss) < 1e-6
    torch.testing.assert_close(grad.float(), ref_grad, rtol=2 ** -8, atol=1e-6)


def test_labels_outside_the_shard_and_in_padding(monkeypatch):
    """As the second of two tensor ranks sees it (its collectives made identities): the shard
    holds global ids [48, 96), of which ``vocab_size`` 88 leaves 40 real columns. A label
    outside the shard adds no target (its share of the loss is ``log Σ exp(z − max)``) and no onehot; a label in a padded column gives an
    infinite loss (as a ``-inf`` logit would)."""
    from types import SimpleNamespace

    monkeypatch.setattr(ce, "tp_world", lambda pg: 2)
    pg = SimpleNamespace(tp_rank=1, tp=None, comm=SimpleNamespace(all_reduce=lambda *a, **k: None))
    logits, labels, weights = _case()
    labels = labels + PADDED  # on this shard
    labels[0] = 7  # rank 0's columns: outside
    labels[1, 0] = PADDED + V + 2  # a padded column of this shard
    x = (logits.clone() * 1).requires_grad_(True)
    loss = vocab_parallel_cross_entropy(x, labels, pg, vocab_size=PADDED + V)
    (loss[2:] * weights[2:]).sum().backward()
    lse = torch.logsumexp(logits[..., :V], -1)
    target = torch.gather(logits, -1, (labels - PADDED).clamp(0, PADDED - 1).unsqueeze(-1)).squeeze(-1)
    # no target term: the rank's share is log Σ exp(z − max), the all-reduce adds the target's
    torch.testing.assert_close(loss[0], lse[0] - logits[0, :, :V].amax(-1), rtol=1e-6, atol=0)
    assert torch.isinf(loss[1, 0]) and loss[1, 0] > 0
    torch.testing.assert_close(loss[2:], (lse - target)[2:], rtol=1e-6, atol=0)
    ref_loss, ref_grad = _reference(logits[2:], labels[2:] - PADDED, weights[2:])
    torch.testing.assert_close(x.grad[2:], ref_grad, rtol=1e-6, atol=1e-7)
    assert torch.equal(x.grad[:2], torch.zeros_like(x.grad[:2]))


def test_consume_logits_writes_the_gradient_in_place():
    """With ``consume_logits`` the gradient reaching the logits is the logits' own storage
    (no new vocabulary-sized buffer); a second backward is refused, not wrong; a leaf is
    refused. Without it the caller's logits are untouched."""
    logits, labels, weights = _case(torch.bfloat16)
    pg = build_groups()
    leaf = logits.clone().requires_grad_(True)
    x = leaf * 1
    loss = vocab_parallel_cross_entropy(x, labels, pg, consume_logits=True)
    seen: list[int] = []
    x.register_hook(lambda g: seen.append(g.data_ptr()))
    (loss * weights).sum().backward(retain_graph=True)
    assert seen == [x.data_ptr()]
    with pytest.raises(RuntimeError, match="second backward"):
        (loss * weights).sum().backward()
    with pytest.raises(ValueError, match="leaf"):
        vocab_parallel_cross_entropy(leaf, labels, pg, consume_logits=True)
    kept = logits.clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(kept, labels, pg)
    (loss * weights).sum().backward()
    assert torch.equal(kept.detach(), logits) and kept.grad.data_ptr() != kept.data_ptr()


def test_huge_logits_are_stable():
    pg = build_groups()
    logits = torch.tensor([[1e4, 0.0, -1e4], [5e3, 5e3, 0.0]], requires_grad=True)
    loss = vocab_parallel_cross_entropy(logits, torch.tensor([0, 2]), pg)
    assert torch.isfinite(loss).all()
    torch.testing.assert_close(loss, torch.tensor([0.0, 5e3 + torch.log(torch.tensor(2.0)).item()]))
    loss.sum().backward()
    assert torch.isfinite(logits.grad).all()
    torch.testing.assert_close(logits.grad, torch.tensor([[0.0, 0.0, 0.0], [0.5, 0.5, -1.0]]))


def test_compiled_math_equals_eager(monkeypatch):
    """The functions CUDA runs compiled, compiled by inductor on CPU (one tiny bf16 case, the
    model's call: padded columns masked by ``vocab_size``, the gradient written into the
    logits): the same losses and gradients as the eager math."""
    logits, labels, weights = _case(torch.bfloat16, seed=5)
    logits[..., V:] = 50.0
    eager = _run(logits, labels, weights, vocab_size=V, consume_logits=True)
    monkeypatch.setattr(ce, "_math", lambda name, device: ce._MATH[name].compiled)
    compiled = _run(logits, labels, weights, vocab_size=V, consume_logits=True)
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-6, atol=1e-6)  # fp32 sums in another order
    torch.testing.assert_close(compiled[1], eager[1], rtol=2 ** -8, atol=1e-7)  # at most one bf16 rounding
    assert torch.equal(compiled[1][..., V:], torch.zeros_like(compiled[1][..., V:]))
