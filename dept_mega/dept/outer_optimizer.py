"""Outer optimizers (paper Algorithm 1, DiLoCo), stepped by :class:`~dept_mega.dept.outer.FlatSync`.

Pseudo-gradient convention: Δ = θ_{t-1} − θ_local, averaged over the G groups, then the outer
optimizer treats the mean Δ as a gradient:

- ``fedavg``:   θ_t = θ_{t-1} − lr·Δ̄                       (lr 1: plain parameter averaging)
- ``nesterov``: b = μ·b + Δ̄;  θ_t = θ_{t-1} − lr·(Δ̄ + μ·b)   (PyTorch SGD, nesterov=True)
- ``adam``:     m = β1·m + (1−β1)·Δ̄;  v = β2·v + (1−β2)·Δ̄²;
                θ_t = θ_{t-1} − lr·(m/(1−β1^t)) / (sqrt(v/(1−β2^t)) + eps)

All state and the update are fp32.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

STATE_NAMES = {"fedavg": (), "nesterov": ("momentum",), "adam": ("exp_avg", "exp_avg_sq")}
# elements per slice of the element-wise outer step (a multiple of every SIMD width, so that
# slicing does not change a value): bounds the step's temporaries to a few MB
STEP_SLICE = 1 << 20


class OuterOptimizer:
    """One outer optimizer over one flat fp32 buffer (in place)."""

    def __init__(self, name: str, lr: float = 1.0, momentum: float = 0.0,
                 betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        if name not in STATE_NAMES:
            raise ValueError(f"dept.outer_optimizer.name: unknown outer optimizer {name!r} "
                             "(fedavg | nesterov | adam)")
        self.name, self.lr, self.momentum = name, float(lr), float(momentum)
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.steps = 0
        # with parts (FlatSync.use_parts): the steps each part of the buffer has taken; Adam's
        # bias correction of a part uses its own count, ``steps`` is the least of them
        self.part_steps: list[int] = []
        self.state: dict[str, torch.Tensor] = {}

    @classmethod
    def from_config(cls, oc) -> "OuterOptimizer":
        return cls(oc.name, oc.lr, oc.momentum, oc.betas, oc.eps)

    @property
    def state_names(self) -> tuple[str, ...]:
        return STATE_NAMES[self.name]

    def ensure_state(self, like: torch.Tensor) -> None:
        """Allocate the state now (zeros; what the first step would start from), so that a
        checkpoint can load into it in place. It lives where ``like`` lives."""
        for n in self.state_names:
            if n not in self.state:
                self.state[n] = torch.zeros_like(like, dtype=torch.float32)

    @torch.no_grad()
    def step(self, theta: torch.Tensor, delta: torch.Tensor, at: int = 0, part: Optional[int] = None) -> None:
        """θ ← update(θ, Δ̄); both fp32 and of the same shape. ``part`` (see
        :meth:`FlatSync.use_parts`): θ is part ``part`` of the buffer, starting at element
        ``at`` of the state, and only that part's step count advances."""
        _check_fp32(theta, delta)
        if part is None:
            self.ensure_state(theta)
            self.steps += 1
            t = self.steps
        else:
            self.part_steps[part] += 1
            t = self.part_steps[part]
            self.steps = min(self.part_steps)
        self._step_slices(theta, delta, at, t, copy_state=False)

    @torch.no_grad()
    def peek(self, theta: torch.Tensor, delta: torch.Tensor, at: int = 0, part: Optional[int] = None) -> torch.Tensor:
        """What :meth:`step` would make of θ with Δ̄ = ``delta``, as a new tensor; neither θ nor
        the optimizer state nor the step counts change (the eager overlap rule's estimate)."""
        _check_fp32(theta, delta)
        if part is None:
            self.ensure_state(theta)
        out = theta.clone()
        self._step_slices(out, delta, at, (self.steps if part is None else self.part_steps[part]) + 1,
                          copy_state=True)
        return out

    def _step_slices(self, theta: torch.Tensor, delta: torch.Tensor, at: int, t: int, copy_state: bool) -> None:
        """The element-wise update of θ in place, slice by slice (temporaries stay small), with
        the state from element ``at`` on (``copy_state``: on copies, the state unchanged)."""
        n = theta.numel()
        for a in range(0, max(n, 1), STEP_SLICE):
            b = min(a + STEP_SLICE, n)
            state = {k: v[at + a:at + b] for k, v in self.state.items()}
            if copy_state:
                state = {k: v.clone() for k, v in state.items()}
            self._step_slice(theta[a:b], delta[a:b], state, t)

    def _step_slice(self, theta: torch.Tensor, delta: torch.Tensor, state: dict[str, torch.Tensor], t: int) -> None:
        if self.name == "fedavg":
            theta.add_(delta, alpha=-self.lr)
        elif self.name == "nesterov":
            buf = state["momentum"]  # zeros before the first step: b = Δ̄ then
            buf.mul_(self.momentum).add_(delta)
            theta.add_(delta + self.momentum * buf, alpha=-self.lr)
        else:
            b1, b2 = self.betas
            m = state["exp_avg"]
            v = state["exp_avg_sq"]
            m.mul_(b1).add_(delta, alpha=1 - b1)
            v.mul_(b2).addcmul_(delta, delta, value=1 - b2)
            m_hat = m / (1 - b1 ** t)
            v_hat = v / (1 - b2 ** t)
            theta.add_(m_hat / (v_hat.sqrt() + self.eps), alpha=-self.lr)

    def state_dict(self) -> dict:
        sd = {"steps": self.steps, "state": {k: v.clone() for k, v in self.state.items()}}
        if self.part_steps:
            sd["part_steps"] = list(self.part_steps)
        return sd

    def load_state_dict(self, sd: dict) -> None:
        self.steps = int(sd["steps"])
        self.load_part_steps(sd.get("part_steps"))
        loaded = {}
        for k, v in sd["state"].items():
            old = self.state.get(k)
            loaded[k] = v.to(old.device if old is not None else v.device, torch.float32).clone()
        self.state = loaded


    def load_part_steps(self, counts: Optional[Sequence[int]]) -> None:
        """The per-part step counts of a checkpoint (None: it was saved without parts, every
        part has taken ``steps`` steps)."""
        if not self.part_steps:
            if counts:
                raise ValueError(f"outer state: the checkpoint's sync went in {len(counts)} parts, this run's "
                                 "in one (another dept.outer_fragments)")
            return
        counts = [self.steps] * len(self.part_steps) if counts is None else [int(c) for c in counts]
        if len(counts) != len(self.part_steps):
            raise ValueError(f"outer state: the checkpoint's sync went in {len(counts)} parts, this run's in "
                             f"{len(self.part_steps)} (another dept.outer_fragments)")
        self.part_steps = counts


def _check_fp32(theta: torch.Tensor, delta: torch.Tensor) -> None:
    if theta.dtype != torch.float32 or delta.dtype != torch.float32:
        raise TypeError("outer optimizer works on fp32 buffers")
