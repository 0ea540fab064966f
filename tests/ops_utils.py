"""Helpers for the dept_mega.ops tests: random inputs and float64 references."""
from __future__ import annotations

import shutil
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

import dept_mega.ops as ops
from dept_mega.ops import fallback

if TYPE_CHECKING:  # tools.cuda_emu is imported by the emulated tests only
    from tools.cuda_emu import KernelSource

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]),
]
ROW_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ID_DTYPES = [torch.int32, torch.int64]

# Implementations under test: the public API (the compiled kernels when the extension
# handles the device, else the fallback) and the fallback itself.
IMPLS = {
    "api": (ops.gather_rows, ops.scatter_add_rows, ops.scatter_mean_rows, ops.remap_ids),
    "fallback": (fallback.gather_rows, fallback.scatter_add_rows, fallback.scatter_mean_rows,
                 fallback.remap_ids),
}


def lazy_check(device) -> None:
    """check_errors for a CUDA device, whose kernels report invalid ids at the next check; none
    for CPU, where the ops raise at the call: a CPU call that returned had no error (a check
    here would raise an error that the call left in the thread's record instead)."""
    if torch.device(device).type == "cuda":
        ops.check_errors(device)


def ext_handles(device: str) -> bool:
    """Whether the compiled extension (not the PyTorch fallback) runs the ops on ``device``."""
    return ops.backend(device) != "torch"


def require_extension() -> None:
    """Skip the calling test unless the extension's CPU kernels are loaded."""
    if ops.backend("cpu") != "cpp":
        pytest.skip(f"extension not loaded: {ops.extension_status().reason}")


def emulation(tmp_path_factory, kernel: KernelSource) -> Path:
    """``kernel`` built for tools/cuda_emu.py's host emulation of CUDA (in a folder of the session);
    the calling test skipped without g++ or the CUDA toolkit's headers, which the build needs."""
    from tools import cuda_emu

    if shutil.which("g++") is None or cuda_emu.cuda_include() is None:
        pytest.skip("needs g++ and the CUDA toolkit's headers")
    return cuda_emu.build(tmp_path_factory.mktemp("emu"), kernel)


def seed_of(*key) -> int:
    """A seed from test parameters that is the same in every process (unlike hash())."""
    return zlib.crc32(repr(key).encode())


def gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def rand_rows(shape, dtype, device, g) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype).to(device)


def rand_ids(n, num_rows, dtype, device, g, dup_pool=None) -> torch.Tensor:
    """Unsorted ids in [0, num_rows); drawn from a small pool when dup_pool is given, so ids
    repeat."""
    hi = num_rows if dup_pool is None else min(num_rows, dup_pool)
    if hi == 0:
        return torch.empty(0, dtype=dtype, device=device)
    pool = torch.randperm(num_rows, generator=g)[:hi]
    pick = torch.randint(0, hi, (n,), generator=g)
    return pool[pick].to(dtype).to(device)


def ref_scatter_add(out, ids, rows) -> torch.Tensor:
    return out.double().index_add(0, ids.long().cpu().to(out.device), rows.double())


def ref_scatter_mean(table, ids, rows, accumulate, alpha=1.0) -> torch.Tensor:
    idx = ids.long()
    sums = torch.zeros(table.shape, dtype=torch.float64, device=table.device).index_add(
        0, idx, rows.double())
    counts = torch.zeros(table.shape[0], dtype=torch.float64, device=table.device).index_add(
        0, idx, torch.ones(idx.numel(), dtype=torch.float64, device=table.device))
    mean = alpha * sums / counts.clamp(min=1).unsqueeze(1)
    base = table.double()
    new = base + mean if accumulate else mean
    return torch.where((counts > 0).unsqueeze(1), new, base)


def tol(dtype):
    """(rtol, atol) for one final rounding to dtype of an fp32 sum of a few N(0,1) terms."""
    return {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 2e-2),
            torch.float16: (2e-3, 2e-3)}[dtype]


def ref_chunked_add(start: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor,
                    chunk: int = 64) -> torch.Tensor:
    """fp32 ``start[ids[i]] += rows[i]`` in the scatters' documented order, one element add
    at a time in plain Python loops: per destination, its rows in ascending i cut into chunks
    of ``chunk``; chunk 0 added to the start value, each later chunk summed from zero and its
    sum added. Independent of the code under test (slow: small inputs only)."""
    acc = start.float().cpu().clone()
    ids_l, src = ids.long().cpu().tolist(), rows.float().cpu()
    by_dest: dict[int, list[int]] = {}
    for i, d in enumerate(ids_l):
        by_dest.setdefault(d, []).append(i)
    for d, rows_i in by_dest.items():
        for c in range(0, len(rows_i), chunk):
            part = acc[d] if c == 0 else torch.zeros_like(acc[d])
            for i in rows_i[c:c + chunk]:
                part = part + src[i]
            acc[d] = part if c == 0 else acc[d] + part
    return acc
