"""Deterministic initialisation and the dropout RNG streams of tensor parallelism.

Initialisation (``init_full_then_shard``): a parameter is drawn on its FULL shape from a CPU
generator seeded by (seed, the parameter's stable name), then sliced to this rank's shard.
The full weights are therefore identical whatever the tensor or pipeline layout, so layouts
can be compared and checkpoints resharded. The stable name uses global layer ids, never a
stage-local index.

Dropout (``RNGTracker``), Megatron's "model-parallel RNG" idea with explicit generators
instead of a global state:

* ``default`` — the same seed on every tensor rank of a stage: used where activations are
  replicated across tensor ranks (hidden dropout without sequence parallelism), so every
  rank drops the same elements and the replicas stay equal.
* ``tensor_parallel`` — a seed that differs per tensor rank: used inside tensor-split regions
  (attention dropout over this rank's heads; hidden dropout on sequence shards under
  sequence parallelism), so the shards get independent masks.

Both streams are offset by pipeline stage so different stages' layers draw different masks.
A checkpoint restores them exactly under the same layout; under another tensor / pipeline
layout they are re-seeded from the run seed and the checkpoint's step (``RNGTracker.reseed``).

Activation recomputation (``model/recompute.py``) replays a region's forward during backward:
``get_states()`` / ``set_states()`` capture and restore both generators so the replay draws
exactly the masks of the original forward (``torch.utils.checkpoint``'s ``preserve_rng_state``
only covers the global CPU/CUDA generators, not ours). Kernels whose dropout uses the
device's global generator (SDPA, flash-attn) are seeded from our stream by
``fork_device_rng``, so restoring our stream replays them too.
"""
from __future__ import annotations

import contextlib
import hashlib
from typing import Iterator, Optional, Sequence

import torch

# Offsets as in Megatron (pipeline stages and the tensor-parallel stream get distinct seeds).
_PP_OFFSET = 100
_TP_OFFSET = 2718


def stable_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (seed, name), identical across processes and Python runs."""
    digest = hashlib.sha256(f"{int(seed)}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def shard_rows(full: torch.Tensor, dim: int, rank: int, world: int, stride: int = 1) -> torch.Tensor:
    """This rank's shard of ``full`` along ``dim``.

    ``stride`` > 1: the dimension is made of ``stride`` equal blocks (e.g. SwiGLU's [gate; up])
    and each rank takes its chunk of *every* block, concatenated in block order.
    """
    if world == 1:
        return full
    size = full.shape[dim]
    if size % (world * stride):
        raise ValueError(f"dimension {dim} of size {size} cannot be split into {world} shards "
                         f"× {stride} blocks")
    blocks = full.chunk(stride, dim=dim)
    return torch.cat([b.chunk(world, dim=dim)[rank] for b in blocks], dim=dim)


def init_full_then_shard(name: str, full_shape: Sequence[int], seed: int, *, std: Optional[float] = None,
                         const: Optional[float] = None, partition_dim: Optional[int] = None,
                         rank: int = 0, world: int = 1, stride: int = 1,
                         dtype: torch.dtype = torch.float32,
                         device: torch.device | str = "cpu") -> torch.Tensor:
    """Initialise ``name`` on its full shape, then keep this rank's shard.

    ``std``: normal(0, std) from a generator seeded by ``stable_seed(seed, name)``;
    ``const``: every element equal to ``const`` (norm weights 1, biases 0).
    """
    if (std is None) == (const is None):
        raise ValueError("give exactly one of std or const")
    if const is not None:
        full = torch.full(tuple(full_shape), float(const), dtype=torch.float32)
    else:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(stable_seed(seed, name))
        full = torch.empty(tuple(full_shape), dtype=torch.float32)
        full.normal_(0.0, std, generator=gen)
    if partition_dim is not None:
        full = shard_rows(full, partition_dim, rank, world, stride)
    return full.to(device=device, dtype=dtype).contiguous()


class RNGTracker:
    """The two dropout streams of one rank (see the module docstring).

    ``seed`` is the run seed; ``pp_rank``/``tp_rank`` this rank's coordinates. Generators live
    on ``device`` so masks are drawn where the activations are.

    ``step``: the training step the streams start at. 0 (a fresh run) gives the seeds above;
    another step (``reseed``: a checkpoint resumed under another tensor / pipeline layout,
    whose saved streams belong to other ranks) replaces the run seed by
    ``stable_seed(seed, "dropout@step{step}")`` before the same offsets, so the resumed run
    does not replay the masks of step 0.
    """

    def __init__(self, seed: int, tp_rank: int = 0, pp_rank: int = 0,
                 device: torch.device | str = "cpu", step: int = 0) -> None:
        self.device = torch.device(device)
        self.seed, self.tp_rank, self.pp_rank = int(seed), int(tp_rank), int(pp_rank)
        self.generators: dict[str, torch.Generator] = {
            key: torch.Generator(device=self.device) for key in ("default", "tensor_parallel")}
        self.reseed(step)

    def reseed(self, step: int) -> None:
        """Seed both streams for training step ``step`` (in place: the modules share this tracker)."""
        base = self.seed if int(step) == 0 else stable_seed(self.seed, f"dropout@step{int(step)}")
        self.seeds = {
            "default": base + _PP_OFFSET * self.pp_rank,
            "tensor_parallel": base + _PP_OFFSET * self.pp_rank + _TP_OFFSET + self.tp_rank,
        }
        for key, s in self.seeds.items():
            self.generators[key].manual_seed(s)

    def __deepcopy__(self, memo) -> "RNGTracker":
        return self  # a copied module keeps drawing from the rank's streams

    @classmethod
    def for_groups(cls, seed: int, pg, device: torch.device | str = "cpu") -> "RNGTracker":
        return cls(seed, tp_rank=pg.tp_rank, pp_rank=pg.pp_rank, device=device)

    def generator(self, tensor_parallel: bool) -> torch.Generator:
        return self.generators["tensor_parallel" if tensor_parallel else "default"]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: g.get_state() for k, g in self.generators.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for k, g in self.generators.items():
            g.set_state(state[k])

    # Names of Megatron's / Transformer Engine's RNG tracker interface, used by recomputation.
    def get_states(self) -> dict[str, torch.Tensor]:
        """Copies of both generators' states (for replaying a recomputed region)."""
        return self.state_dict()

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.load_state_dict(states)

    @contextlib.contextmanager
    def fork_device_rng(self, tensor_parallel: bool) -> Iterator[None]:
        """Run a kernel that draws from the device's global RNG (SDPA / flash-attn dropout)
        with a seed taken from one of our streams; the global state is restored after.

        The seed is a hash of the stream's state (host-side for a CUDA generator: Philox seed
        and offset), which is then advanced by one draw on the device that nobody reads. So
        no host synchronisation (reading a drawn number back would be one per attention
        call), and restoring the stream (recomputation, checkpoints) replays the seed."""
        stream = self.generator(tensor_parallel)
        digest = hashlib.sha256(stream.get_state().numpy().tobytes()).digest()
        seed = int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
        torch.randint(0, 2 ** 62, (1,), generator=stream, device=self.device)
        if self.device.type == "cuda":
            idx = self.device.index if self.device.index is not None else torch.cuda.current_device()
            gen = torch.cuda.default_generators[idx]
        else:
            gen = torch.default_generator
        saved = gen.get_state()
        gen.manual_seed(seed)
        try:
            yield
        finally:
            gen.set_state(saved)


def dropout(x: torch.Tensor, p: float, training: bool, tracker: Optional[RNGTracker],
            tensor_parallel: bool) -> torch.Tensor:
    """Inverted dropout whose mask comes from ``tracker``'s stream (see module docstring)."""
    if not training or p <= 0.0:
        return x
    if tracker is None:
        raise ValueError("dropout > 0 needs an RNGTracker")
    keep = 1.0 - p
    mask = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    mask.bernoulli_(keep, generator=tracker.generator(tensor_parallel))
    return x * mask * (1.0 / keep)
