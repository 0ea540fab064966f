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

Fused casts (the JSON's ``fused`` rows, :func:`run_fused`): is a cast fused into its producer
faster than the producer and then the cast, per path? The LayerNorm of the linears' input
``[tokens, hidden]`` (bf16 x and weight, no bias, as the 1B model) cast to e4m3, unfused
(``F.layer_norm`` then each path's cast) against fused (``layernorm_cast_fp8``: Triton with its
default tile and the candidates of ``LN_TILES``, the C++ operator); GELU of fc2's input
``[tokens, ffn]``, unfused (``F.gelu`` then the cast) against ``cast_fp8(gelu=True)`` (Triton, the
C++ operator, and the torch casts: inductor fuses the GELU into its cast on CUDA); the GELU
backward of fc2 and the cast of its result, fc1's output gradient ``[tokens, ffn]`` to e5m2
(``dgelu``; the C++ operator only), unfused (``aten.gelu_backward`` then the C++ cast) against
``dgelu_cast_fp8``. Delayed scaling, amax recorded, both layouts. The bytes a minimal pass moves
are counted as for a cast: read the bf16 input (2 B per element), write both FP8 layouts (1 + 1
B); LayerNorm's weight and statistics are left out (under 0.1 %), and the unfused pass's bf16
intermediate (written and read back, 4 B more per element) is what fusing saves. ``dgelu`` reads
two bf16 tensors (the gradient and GELU's input) and writes dH (bf16: autograd hands it on) besides
the FP8 copies, 8 B per element at least; its copy row clones 8 B per element, so its ``% of
copy`` is a bandwidth share as the others' are; fusing saves reading dH back (2 B). ``speedup`` is the unfused row's µs of
the same path over the fused row's. A fused row's bytes are compared with the unfused rows'
(the reference): ``differ_bytes`` counts those that differ (an element whose rounded bf16
intermediate came out one step apart; ``max_steps``: the largest distance in FP8 steps), which
the spec allows rarely (``FUSED_MAX_FRACTION``); reported, not failed on.
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

import torch.nn.functional as F  # noqa: E402

from dept_mega.parallel import fp8_casts, fp8_kernels, fp8_norm_kernels  # noqa: E402
from dept_mega.parallel.fp8 import _cast  # noqa: E402
from dept_mega.parallel.fp8_recipe import E4M3, E5M2  # noqa: E402

# (rows, columns, warps) of a Triton program; the first is the default of fp8_kernels.cast_fp8
TRITON_TILES = ((64, 64, 4), (64, 128, 4), (64, 128, 8), (128, 64, 8), (128, 128, 8), (32, 128, 4))
CALLS = 20
# (rows, columns, warps) of a program of the fused LayerNorm cast; the first is layernorm_cast_fp8's default
LN_TILES = (fp8_norm_kernels._TILE,) + tuple(t for t in ((32, 128, 4), (16, 128, 4), (64, 128, 8), (32, 256, 8),
                                                       (16, 256, 4)) if t != fp8_norm_kernels._TILE)
LN_EPS = 1e-5
# the share of a fused row's bytes that may differ from the unfused (a rounded intermediate one
# bf16 step apart: the CPU measured at most 6.1e-5 for LayerNorm, 8.9e-4 for GELU to e4m3;
# tests/test_fp8_fused_op.py), each by at most one FP8 step
FUSED_MAX_FRACTION = 1e-3


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


def _ordinal(q: torch.Tensor) -> torch.Tensor:
    """FP8 bytes as signed steps from zero (±0 both 0): adjacent FP8 values differ by 1."""
    b = q.view(torch.uint8).to(torch.int32)
    return torch.where(b >= 0x80, -(b - 0x80), b)


def compare_bytes(got: tuple, ref: tuple) -> dict:
    """How ``got``'s FP8 tensors (q, q_t) differ from ``ref``'s: the count and share of differing
    bytes and the largest distance in FP8 steps (0 where none differ)."""
    differ, total, steps = 0, 0, 0
    for g, r in zip(got, ref):
        a, b = _ordinal(g), _ordinal(r)
        mask = g.view(torch.uint8) != r.view(torch.uint8)
        differ += int(mask.sum())
        total += mask.numel()
        if mask.any():
            steps = max(steps, int((a - b).abs()[mask].max()))
    return {"differ_bytes": differ, "differ_fraction": differ / total, "max_steps": steps}


def fused_kernels(device: torch.device, weight: torch.Tensor) -> dict[str, list[tuple[str, str, str, object]]]:
    """Per op (``layernorm``, ``gelu``, ``dgelu``): (variant, path, name, f(*inputs, dtype, scale,
    amax) -> (q, q_t)) of every unfused and fused pass that runs on ``device``, the unfused first;
    each casts in both layouts with ``scale[0]`` and maxes its amax into ``amax[0]``. The inputs:
    ``x`` (LayerNorm, GELU), ``grad, h`` (dgelu)."""
    casts = []  # (path, name, cast(t, dtype, scale, amax, gelu) -> (q, q_t))
    if device.type == "cuda" and fp8_kernels.AVAILABLE:
        casts.append(("triton", "triton cast_fp8", lambda t, d, s, a, gelu=False: fp8_kernels.cast_fp8(
            t, d, 0, True, True, scale=s, scale_index=0, amax_out=a, amax_index=0, gelu=gelu)[:2]))
    cuda = fp8_casts.op_unavailable(device) is None
    if cuda:
        casts.append(("cuda", "cuda cast_fp8", lambda t, d, s, a, gelu=False: fp8_casts.cast_fp8(
            t, d, 0, True, True, s, 0, a, 0, gelu=gelu)[:2]))

    def torch_cast(t, d, s, a, gelu=False):
        q, q_t, _, amax = _cast(t, s[0], d, 0, True, True, gelu)
        torch.maximum(a[0], amax, out=a[0])
        return q, q_t
    casts.append(("torch", "torch cast (compiled on CUDA)" if device.type == "cuda" else "torch cast", torch_cast))

    hidden = weight.shape[0]
    ln = [("unfused", path, f"unfused: F.layer_norm + {name}",
           lambda x, d, s, a, c=c: c(F.layer_norm(x, (hidden,), weight, None, LN_EPS), d, s, a))
          for path, name, c in casts]
    gelu = [("unfused", path, f"unfused: F.gelu + {name}", lambda h, d, s, a, c=c: c(F.gelu(h), d, s, a))
            for path, name, c in casts]
    if device.type == "cuda" and fp8_kernels.AVAILABLE:
        for tile in LN_TILES:
            ln.append(("fused", "triton", f"fused: triton layernorm_cast_fp8 {tile[0]}x{tile[1]} w{tile[2]}"
                       + (" (default)" if tile == LN_TILES[0] else ""),
                       lambda x, d, s, a, tile=tile: fp8_kernels.layernorm_cast_fp8(
                           x, weight, None, LN_EPS, d, 0, True, True, scale=s, scale_index=0, amax_out=a,
                           amax_index=0, tile=tile)[:2]))
    if cuda:
        ln.append(("fused", "cuda", "fused: cuda layernorm_cast_fp8",
                   lambda x, d, s, a: fp8_casts.layernorm_cast_fp8(x, weight, None, LN_EPS, d, 0, True, True, s, 0,
                                                                   a, 0)[:2]))
    for path, name, c in casts:
        gelu.append(("fused", path, f"fused: {name}(gelu=True)", lambda h, d, s, a, c=c: c(h, d, s, a, gelu=True)))
    dgelu = []  # f(grad, h, dtype, scale, amax): the C++ operator where it runs
    if cuda:
        dgelu = [("unfused", "cuda", "unfused: aten.gelu_backward + cuda cast_fp8",
                  lambda g, h, d, s, a: fp8_casts.cast_fp8(torch.ops.aten.gelu_backward(g, h), d, 0, True, True, s, 0,
                                                           a, 0)[:2]),
                 ("fused", "cuda", "fused: cuda dgelu_cast_fp8",
                  lambda g, h, d, s, a: fp8_casts.dgelu_cast_fp8(g, h, d, 0, True, True, s, 0, a, 0)[1:])]
    return {"layernorm": ln, "gelu": gelu, "dgelu": dgelu}


def run_fused(device: torch.device, tokens: int, hidden: int, ffn: int, iters: int) -> list[dict]:
    """The fused-cast rows (see the module docstring): per op a copy row, then each unfused and
    fused pass, the fused rows with their speed-up over the same path's unfused row and their
    bytes against the unfused (the first unfused row's; the unfused rows among themselves are
    compared as the plain casts are: ``same_bytes``)."""
    g = torch.Generator(device=device).manual_seed(1)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g, device=device)).to(torch.bfloat16)
    rows = []
    passes = fused_kernels(device, weight)
    for op, label, m, n in (("layernorm", "layernorm [tokens, hidden]", tokens, hidden),
                            ("gelu", "gelu [tokens, ffn]", tokens, ffn), ("dgelu", "dgelu [tokens, ffn]", tokens, ffn)):
        if not passes[op]:  # dgelu without the C++ operator
            continue
        inputs = tuple(torch.randn(m, n, generator=g, device=device).to(torch.bfloat16)
                       for _ in range(2 if op == "dgelu" else 1))
        fp8 = E5M2 if op == "dgelu" else E4M3  # dgelu: a gradient
        scale = torch.full((4,), 8.0, device=device)
        amax = torch.zeros(4, device=device)
        # the minimal pass: read 2 bytes, write 1 + 1 (dgelu: read 2 + 2, write dH 2 and 1 + 1)
        moved = (8 if op == "dgelu" else 4) * inputs[0].numel()
        base = {"shape": label, "op": op, "rows": m, "cols": n, "fp8": str(fp8)[6:]}
        copied = inputs[0] if len(inputs) == 1 else torch.cat(inputs)  # a copy of the same bytes
        copy, row = _copy_row({**base, "variant": "copy", "path": None}, copied, moved, device, iters)
        copied = None
        rows.append(row)
        ref, unfused_us = [], {}
        for variant, path, name, f in passes[op]:
            def check(out, variant=variant) -> dict:
                if variant == "unfused":  # the first is the reference; the others: the same bytes
                    if not ref:
                        ref.extend(out)
                        return {"same_bytes": None}
                    return {"same_bytes": all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                                              for a, b in zip(out, ref))}
                if not ref:
                    raise RuntimeError("no unfused row to compare with")
                return compare_bytes(out, tuple(ref))
            tagged = {**base, "variant": variant, "path": path}
            row = _pass_row(tagged, tagged, name, lambda f=f: f(*inputs, fp8, scale, amax), check, moved, copy,
                            device, iters)
            if "error" not in row:
                if variant == "unfused":
                    unfused_us[path] = row["us"]
                else:
                    row["speedup"] = unfused_us[path] / row["us"] if path in unfused_us else None
            rows.append(row)

        def note(r: dict) -> str:
            out = f"  {r['speedup']:.2f}x unfused" if r.get("speedup") is not None else ""
            if r.get("differ_bytes"):
                out += f"  {r['differ_bytes']} bytes differ ({r['differ_fraction']:.1e}, {r['max_steps']} steps)"
            return out + ("  BYTES DIFFER" if r.get("same_bytes") is False else "")
        _print_rows(rows, label, 26, 58, note)
        inputs = ref = None  # freed before the next op
    return rows


def _copy_row(base: dict, x: torch.Tensor, moved: int, device: torch.device, iters: int) -> tuple[dict, dict]:
    """A device copy of ``x`` timed: (its timing, its row): what every pass is measured against."""
    copy = timed_queued(lambda: x.clone(), device, iters, CALLS)
    return copy, {**base, "kernel": "copy (bf16 clone)", "us": copy["s"] * 1e6, "gbps": moved / copy["s"] / 1e9,
                  "host_us": copy["host_s"] * 1e6}


def _pass_row(base: dict, error_base: dict, name: str, f, check, moved: int, copy: dict, device: torch.device,
              iters: int) -> dict:
    """One pass ``f()`` timed against ``copy``: its row, with ``check(f())``'s fields (its bytes
    against the reference's), or an error row (``error_base``, the name and the error: one pass
    failing leaves the others' rows)."""
    try:
        extra = check(f())
        r = timed_queued(f, device, iters, CALLS)
    except Exception as exc:
        return {**error_base, "kernel": name, "error": f"{type(exc).__name__}: {exc}"[:300]}
    return {**base, "kernel": name, "us": r["s"] * 1e6, "gbps": moved / r["s"] / 1e9,
            "pct_of_copy": 100 * copy["s"] / r["s"], "host_us": r["host_s"] * 1e6, "queued": r["queued"], **extra}


def _print_rows(rows: list[dict], label: str, width: int, kernel_width: int, note) -> None:
    """The rows of ``label`` as the bench prints them (``note(row)``: the line's tail)."""
    for r in rows:
        if r["shape"] != label:
            continue
        if "error" in r:
            print(f"  {label:<{width}} {r['kernel']:<{kernel_width}} FAILED {r['error']}", flush=True)
            continue
        pct = f"{r['pct_of_copy']:5.0f}% of copy" if "pct_of_copy" in r else " " * 13
        print(f"  {label:<{width}} {r['kernel']:<{kernel_width}} {r['us']:9.1f} us {r['gbps']:8.0f} GB/s {pct}  host "
              f"{r['host_us']:6.1f} us{note(r)}", flush=True)


def run(device: torch.device, tokens: int, hidden: int, ffn: int, iters: int) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    for label, m, n, dtype in shapes(tokens, hidden, ffn):
        t = torch.randn(m, n, generator=g, device=device).to(torch.bfloat16)
        scale = torch.full((4,), 8.0, device=device)
        amax = torch.zeros(4, device=device)
        moved = 4 * t.numel()  # read 2 bytes, write 1 + 1
        base = {"shape": label, "rows": m, "cols": n, "fp8": str(dtype)[6:]}
        copy, row = _copy_row(base, t, moved, device, iters)
        rows.append(row)
        ref = []

        def same_as_ref(out) -> dict:  # every kernel gives the reference's bytes (the first kernel's)
            q, q_t, _ = out
            if not ref:
                ref.extend((q, q_t))
                return {"same_bytes": None}
            return {"same_bytes": bool(torch.equal(q.view(torch.uint8), ref[0].view(torch.uint8))
                                       and torch.equal(q_t.view(torch.uint8), ref[1].view(torch.uint8)))}
        for name, cast in kernels(device):
            rows.append(_pass_row(base, {"shape": label}, name, lambda cast=cast: cast(t, dtype, scale, amax),
                                  same_as_ref, moved, copy, device, iters))
        _print_rows(rows, label, 24, 28, lambda r: "" if r.get("same_bytes") in (None, True) else "  BYTES DIFFER")
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
    print("Fused casts: the producer (LayerNorm, GELU, GELU backward) and the cast in one kernel, against the "
          "producer then the cast", flush=True)
    fused = run_fused(device, tokens, hidden, ffn, args.iters)
    differ = [r for r in rows + fused if r.get("same_bytes") is False]
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(device), "torch": torch.__version__, "rows": rows,
                                               "fused": fused, "fused_max_fraction": FUSED_MAX_FRACTION},
                                              indent=1))
    if differ:
        sys.exit(f"kernels that gave other bytes than the first: {sorted({r['kernel'] for r in differ})}")


if __name__ == "__main__":
    main()
