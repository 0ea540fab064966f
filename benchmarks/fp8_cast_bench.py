#!/usr/bin/env python3
"""GPU time of one FP8 cast at the 1B model's shapes, by kernel, against a copy of the same bytes.

    python benchmarks/fp8_cast_bench.py [--device cuda|cpu] [--tokens 8192] [--hidden 2048] [--ffn 8192] \
        [--iters 10] [--json OUT]

A training cast reads a bf16 tensor once and writes its FP8 copy twice (row-major and
transposed: the forward's and the weight gradient's operands), 4 bytes per element: exactly
what a copy of the bf16 tensor moves. So each row's ``% of copy`` is the cast's bandwidth
against the device's copy bandwidth at the same size. Shapes (``tokens`` = micro-batch ×
sequence): the inputs of the linears ``[tokens, hidden]`` and ``[tokens, ffn]`` (e4m3), the
output gradients ``[tokens, 3·hidden]`` and ``[tokens, ffn]`` (e5m2), all with delayed scaling
and the amax recorded, as in a training step after its first.

Kernels: ``triton`` (``fp8_kernels.cast_fp8``, the default tile and the candidates of
``TRITON_TILES``: which tile is fastest on this GPU), ``cuda`` (the C++ operator
``dept_mega::cast_fp8``, where the extension has it), ``torch`` (the reference math, compiled by
inductor on CUDA as the ``torch`` casts run). Calls are queued behind a GPU sleep
(``ops_bench.timed_queued``), so the rows are device time, not the host's dispatch; the host's
µs per call is a column of its own. On the CPU (a smoke test) the shapes shrink by 64 and only
the ``torch`` and ``cuda`` kernels run (Triton needs a GPU).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ops_bench import timed_queued  # noqa: E402

from dept_mega.parallel import fp8_casts, fp8_kernels  # noqa: E402
from dept_mega.parallel.fp8 import _cast  # noqa: E402
from dept_mega.parallel.fp8_recipe import E4M3, E5M2  # noqa: E402

# (rows, columns, warps) of a Triton program; the first is the default of fp8_kernels.cast_fp8
TRITON_TILES = ((64, 64, 4), (64, 128, 4), (64, 128, 8), (128, 64, 8), (128, 128, 8), (32, 128, 4))
CALLS = 20


def shapes(tokens: int, hidden: int, ffn: int) -> list[tuple[str, int, int, torch.dtype]]:
    return [("input [tokens, hidden]", tokens, hidden, E4M3), ("input [tokens, ffn]", tokens, ffn, E4M3),
            ("grad [tokens, 3 hidden]", tokens, 3 * hidden, E5M2), ("grad [tokens, ffn]", tokens, ffn, E5M2)]


def kernels(device: torch.device) -> list[tuple[str, object]]:
    """(name, cast(t, dtype, scale, amax)) of every kernel that runs on ``device``: each casts
    ``t`` in both layouts with ``scale[0]`` and maxes its amax into ``amax[0]``."""
    out = []
    if device.type == "cuda" and fp8_kernels.AVAILABLE:
        for tile in TRITON_TILES:
            out.append((f"triton {tile[0]}x{tile[1]} w{tile[2]}" + (" (default)" if tile == TRITON_TILES[0] else ""),
                        lambda t, d, s, a, tile=tile: fp8_kernels.cast_fp8(t, d, 0, True, True, scale=s, scale_index=0,
                                                                           amax_out=a, amax_index=0, tile=tile)))
    if fp8_casts.op_unavailable(device) is None:
        out.append(("cuda (dept_mega::cast_fp8)",
                    lambda t, d, s, a: fp8_casts.cast_fp8(t, d, 0, True, True, s, 0, a, 0)))

    def torch_cast(t, d, s, a):
        q, q_t, inv, amax = _cast(t, s[0], d, 0, True, True)
        torch.maximum(a[0], amax, out=a[0])
        return q, q_t, inv
    out.append(("torch (compiled on CUDA)" if device.type == "cuda" else "torch", torch_cast))
    return out


def run(device: torch.device, tokens: int, hidden: int, ffn: int, iters: int) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    for label, m, n, dtype in shapes(tokens, hidden, ffn):
        t = torch.randn(m, n, generator=g, device=device).to(torch.bfloat16)
        scale = torch.full((4,), 8.0, device=device)
        amax = torch.zeros(4, device=device)
        moved = 4 * t.numel()  # read 2 bytes, write 1 + 1
        copy = timed_queued(lambda: t.clone(), device, iters, CALLS)
        rows.append({"shape": label, "rows": m, "cols": n, "fp8": str(dtype)[6:], "kernel": "copy (bf16 clone)",
                     "us": copy["s"] * 1e6, "gbps": moved / copy["s"] / 1e9, "host_us": copy["host_s"] * 1e6})
        ref = None
        for name, cast in kernels(device):
            try:
                q, q_t, _ = cast(t, dtype, scale, amax)
                same = None
                if ref is None:
                    ref = (q, q_t)
                else:  # every kernel gives the reference's bytes (the first kernel's)
                    same = bool(torch.equal(q.view(torch.uint8), ref[0].view(torch.uint8))
                                and torch.equal(q_t.view(torch.uint8), ref[1].view(torch.uint8)))
                r = timed_queued(lambda cast=cast: cast(t, dtype, scale, amax), device, iters, CALLS)
            except Exception as exc:  # one kernel failing leaves the others' rows
                rows.append({"shape": label, "kernel": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
                print(f"  {label:<24} {name:<28} FAILED {rows[-1]['error']}", flush=True)
                continue
            rows.append({"shape": label, "rows": m, "cols": n, "fp8": str(dtype)[6:], "kernel": name,
                         "us": r["s"] * 1e6, "gbps": moved / r["s"] / 1e9, "pct_of_copy": 100 * copy["s"] / r["s"],
                         "host_us": r["host_s"] * 1e6, "queued": r["queued"], "same_bytes": same})
        for r in rows:
            if r["shape"] == label and "error" not in r:
                pct = f"{r['pct_of_copy']:5.0f}% of copy" if "pct_of_copy" in r else " " * 13
                print(f"  {label:<24} {r['kernel']:<28} {r['us']:9.1f} us {r['gbps']:8.0f} GB/s {pct}  host "
                      f"{r['host_us']:6.1f} us" + ("" if r.get("same_bytes") in (None, True) else "  BYTES DIFFER"),
                      flush=True)
        t = ref = None  # freed before the next shape
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    device = torch.device(args.device)
    tokens, hidden, ffn = args.tokens, args.hidden, args.ffn
    if device.type == "cpu":
        tokens, hidden, ffn = tokens // 64, hidden // 64, ffn // 64
    print(f"FP8 casts on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch "
          f"{torch.__version__}, tokens {tokens}, hidden {hidden}, ffn {ffn}", flush=True)
    rows = run(device, tokens, hidden, ffn, args.iters)
    differ = [r for r in rows if r.get("same_bytes") is False]
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(device), "torch": torch.__version__, "rows": rows},
                                              indent=1))
    if differ:
        sys.exit(f"kernels that gave other bytes than the first: {sorted({r['kernel'] for r in differ})}")


if __name__ == "__main__":
    main()
