"""How the FP8 cast tests compare a kernel's output with the reference's (``test_fp8_fused_op.py``,
``test_fp8_dgelu_op.py``, ``test_layernorm_cast_emulated.py``): values as steps of their format,
the rounding interval of the exact value, and the :class:`Rule` that bounds how many elements may
differ inside it and how far, with a failure's message naming the first differing elements."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dept_mega.parallel.fp8 import _cast_math


def _ordinal(q: torch.Tensor) -> torch.Tensor:
    """FP8 (or bf16 / fp16) values as signed steps from zero (±0 both 0): adjacent values of the
    format differ by 1."""
    if q.element_size() == 1:
        b, sign = q.view(torch.uint8).to(torch.int32), 0x80
    else:
        b, sign = q.view(torch.int16).to(torch.int32) & 0xFFFF, 0x8000
    return torch.where(b >= sign, -(b - sign), b)


def _from_ordinal(o: torch.Tensor, dtype) -> torch.Tensor:
    """The bf16 / fp16 values of :func:`_ordinal`'s steps."""
    b = torch.where(o < 0, (-o) | 0x8000, o)
    return torch.where(b >= 0x8000, b - 0x10000, b).to(torch.int16).view(dtype)


def _step(t: torch.Tensor, k: int) -> torch.Tensor:
    """bf16 / fp16 ``t`` moved ``k`` steps (adjacent values) up."""
    return _from_ordinal(_ordinal(t) + k, t.dtype)


@dataclass(frozen=True)
class Rule:
    """How far a kernel may be from the reference where the intermediate's rounding is ambiguous
    (inside the interval, which every check applies first). ``fraction``: of the elements may
    differ; ``count``: that many may differ whatever the size (a fraction cannot allow one
    element of a 16-element case without allowing thousands of a large one); ``one_step``: each
    differing element exactly one step (adjacent values) from the reference's, and each differing
    FP8 byte the cast of the reference's intermediate (GELU or dGELU in bf16 / fp16) moved one
    step (mostly the adjacent FP8 code; but a step of fp16's subnormals, 2^-24, scaled by 2^14 is
    2^-10, twenty e5m2 codes from zero); ``amax_rtol``: the amax recorded against the
    reference's, relative (0: equal).

    On the CPU (measured fractions, another erf / exp than PyTorch's vectorised ones): a fraction.
    On the GPU PyTorch's kernels have the fused kernels' formulas and CUDA's erff / expf, so equal
    values are expected; what another compilation of the same formula can give is an fp32
    rounding here and there, which moves a rounded value by one step at most (the formulas'
    cancellation magnifies an fp32 ulp a few times, far below a bf16 / fp16 / FP8 step): a few
    elements one step away, and an amax within one rounding of the input dtype."""
    fraction: float = 0.0
    count: int = 0
    one_step: bool = False
    amax_rtol: float = 0.0


# the GPU's rule for the GELU and dGELU casts (see Rule): at most this many elements per compared
# tensor one step from the reference (expected: none)
GPU_DIFFER = 8


def _gpu_rule(in_dtype) -> Rule:
    return Rule(count=GPU_DIFFER, one_step=True, amax_rtol=torch.finfo(in_dtype).eps)


def _differences(mask, got, ref, inputs, n: int = 6) -> str:
    """The first ``n`` elements of ``mask`` ([rows, cols]): index, the inputs there, our value and
    the reference's (and their steps apart), for a failure's message."""
    idx = mask.nonzero()[:n].tolist()
    gs, rs = _ordinal(got), _ordinal(ref)
    parts = []
    for i, j in idx:
        ins = ", ".join(f"{name} {t[i, j].item():.7g}" for name, t in inputs)
        parts.append(f"[{i}, {j}] {ins}: ours {got[i, j].float().item():.7g}, reference "
                     f"{ref[i, j].float().item():.7g} ({int(gs[i, j] - rs[i, j]):+d} steps)")
    more = int(mask.sum()) - len(idx)
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def _check_differing(got, ref, diff, rule: Rule, what: str, inputs, neighbours=None) -> float:
    """``rule``'s count / fraction and step checks on the elements ``diff`` where ``got`` and
    ``ref`` (same shape, [rows, cols]) differ; ``neighbours``: for FP8 bytes, the casts of the
    reference's intermediate one step down and up (the one-step rule's values), else one step of
    ``got``'s format. Returns the fraction that differs."""
    n, k = diff.numel(), int(diff.sum())
    if rule.one_step:
        g = _ordinal(got)
        if neighbours is None:
            far = diff & ((g - _ordinal(ref)).abs() != 1)
        else:
            far = diff & (g != _ordinal(neighbours[0])) & (g != _ordinal(neighbours[1]))
        of = "the reference" if neighbours is None else "the reference's intermediate"
        assert not far.any(), (f"{what}: {int(far.sum())} elements more than one step from {of}: "
                               f"{_differences(far, got, ref, inputs)}")
    allowed = max(rule.count, rule.fraction * n)
    assert k <= allowed, (f"{what}: {k} of {n} elements differ ({k / n:.2e}; at most {allowed:g}): "
                          f"{_differences(diff, got, ref, inputs)}")
    return k / n if n else 0.0


def _check_amax(got: float, want: float, rule: Rule, what: str) -> None:
    assert abs(got - want) <= rule.amax_rtol * abs(want), f"{what}: amax {got!r}, the reference's {want!r}"


def _interval(exact, bound, dtype, scale, fp8):
    """The FP8 ordinals of ``exact ∓ bound`` (float64) rounded to ``dtype`` and cast with ``scale``:
    what an fp32 computation within ``bound`` of the exact value may give."""
    lo = _ordinal(_cast_math((exact - bound).to(dtype), scale, fp8, 0, True, False)[0])
    hi = _ordinal(_cast_math((exact + bound).to(dtype), scale, fp8, 0, True, False)[0])
    return lo, hi


def _compare(got, ref, interval, rows: int, rule: Rule, max_steps, what: str, inputs=(), neighbours=None) -> float:
    """``got`` vs ``ref`` ([rows + pad, cols] FP8, or their transposes: pass them transposed
    back): pad rows equal; elsewhere equal except where the fp32 rounding of the intermediate is
    ambiguous: there ``got`` lies in ``interval`` (see :func:`_interval`), at most ``max_steps``
    FP8 steps from ``ref`` (None: the interval only), and ``rule`` holds (:class:`Rule`).
    ``inputs``: (name, [rows, cols] tensor) pairs named in a failure's message beside the values;
    ``neighbours``: see :func:`_check_differing` (the shape of ``ref``). Returns the fraction that
    differs."""
    assert got is not None and got.dtype == ref.dtype and got.shape == ref.shape, what
    g, r = _ordinal(got), _ordinal(ref)
    assert torch.equal(g[rows:], r[rows:]), f"{what}: pad rows differ"
    g, r = g[:rows], r[:rows]
    lo, hi = interval
    diff = g != r
    outside = diff & ((g < lo) | (g > hi))
    assert not outside.any(), (f"{what}: {int(outside.sum())} bytes differ outside the fp32 rounding interval: "
                               f"{_differences(outside, got[:rows], ref[:rows], inputs)}")
    if max_steps is not None:
        # where the interval is one step wide (the rounding is ambiguous but the value well
        # conditioned): neighbours, ±(smallest subnormal) included. A wider interval is an
        # ill-conditioned element (a row whose spread is tiny next to its mean): the interval only.
        narrow = (hi - lo) <= 1
        far = narrow & ((g - r).abs() > max_steps) & ~((g.abs() <= 1) & (r.abs() <= 1))
        assert not far.any(), (f"{what}: bytes more than {max_steps} FP8 steps apart: "
                               f"{_differences(far, got[:rows], ref[:rows], inputs)}")
    nb = None if neighbours is None else tuple(t[:rows] for t in neighbours)
    return _check_differing(got[:rows], ref[:rows], diff, rule, what, inputs, nb)


def _check_layouts(q, q_t, rq, rowwise, colwise, interval, rows, rule, max_steps, what, inputs=(),
                   neighbours=None) -> float:
    assert (q is None) == (not rowwise) and (q_t is None) == (not colwise), f"{what}: layouts"
    frac = 0.0
    if rowwise:
        frac = _compare(q, rq, interval, rows, rule, max_steps, what, inputs, neighbours)
    if colwise:
        assert q_t.is_contiguous()
        frac = _compare(q_t.t(), rq, interval, rows, rule, max_steps, what + " q_t", inputs, neighbours)
    return frac


def _move_ambiguous(t, exact, err, moves: int, steps: int, visible=None):
    """bf16 / fp16 ``t`` with its first ``moves`` elements whose rounding is ambiguous (the
    interval of ``exact ∓ err`` holds more than one value) moved ``steps`` steps inside it; only
    where ``visible(t moved, sign)`` (bool, t's shape) when given: the tests' stand-in for a GPU
    kernel that rounds a few values otherwise."""
    o, lo, hi = _ordinal(t), _ordinal((exact - err).to(t.dtype)), _ordinal((exact + err).to(t.dtype))
    move = torch.where(o + steps <= hi, steps, torch.where(o - steps >= lo, -steps, 0))
    if visible is not None:
        for sign in (1, -1):
            move = torch.where((move == sign * steps) & ~visible(_from_ordinal(o + sign * steps, t.dtype), sign), 0, move)
    move = move.flatten()
    picked = move.nonzero().flatten()[:moves]
    o = o.flatten().clone()
    o[picked] += move[picked]
    return _from_ordinal(o, t.dtype).view_as(t)


def _neighbour_bytes(t, scale, fp8, pad):
    """The FP8 bytes of bf16 / fp16 ``t`` moved one step down and one up, cast with ``scale``."""
    return tuple(_cast_math(_step(t, k), scale, fp8, pad, True, False)[0] for k in (-1, 1))
