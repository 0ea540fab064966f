#!/usr/bin/env python3
"""Device time of the ALiBi attention core of the 1B model, forward + backward, by kernel.

    python benchmarks/attention_bench.py [--device cuda|cpu] [--batch 4] [--heads 16] [--seq 2048] \
        [--head-dim 128] [--iters 10] [--json OUT]

Attention is about a fifth of the 1B model's step on an H200 (docs/performance.md): the same
milliseconds in bf16 and in FP8, so a faster kernel raises bf16's MFU and FP8's speed-up over
bf16 both. This measures, on the model's layout (``q, k, v [s, b, H, d]`` views of one QKV
output, the output ``[s, b, H, d]``) and the model's math (causal, ALiBi slopes of
``positions.alibi_slopes``), one forward and its backward of:

* ``flex`` — what the model runs (``attention.FlexState``: compiled flex_attention, ALiBi as a
  ``score_mod``, the causal block mask);
* ``flex <options>`` — the same with flex_attention ``kernel_options`` (``FLEX_OPTIONS``): tiles
  of the forward and backward kernels, and ``ROWS_GUARANTEED_SAFE`` (every causal row has its
  diagonal, so the kernel may skip its fully-masked-row guard). An option this torch does not
  know is reported as the row's error;
* ``bias <backend>`` — ``F.scaled_dot_product_attention`` with the materialised ALiBi + causal
  bias ``[1, H, s, s]`` (the model's ``bias`` kind), the SDPA backend forced
  (``efficient``, ``cudnn``): could a fused SDPA kernel taking the bias beat flex?
* ``causal <backend>`` (no ALiBi: NOT the model's function) — SDPA's ``flash`` / ``cudnn``
  kernels with ``is_causal``: what the same shape costs without a position bias, a ceiling.

Each row: device ms per forward + backward (``ops_bench.timed_queued``: calls queued behind a
GPU sleep, so it is the device's time, not the host's), TFLOP/s counting the causal half of
``4·b·H·s²·d`` forward and 2.5× that backward, and the largest error of the output and of each
input gradient against an fp32 reference (the bias path in fp32), relative to the reference's
largest magnitude. A row that fails (a backend that refuses the inputs) records its error.
On the CPU (a smoke test) the shapes shrink and only the ``bias``/``causal`` rows with the math
backend run: flex_attention has no backward there.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ops_bench import timed_queued  # noqa: E402

from dept_mega.model.attention import FlexState  # noqa: E402
from dept_mega.model.positions import alibi_slopes, causal_alibi_bias  # noqa: E402

# flex_attention kernel_options to try (torch's names; the forward's tile is BLOCK_M x BLOCK_N,
# the backward's BLOCK_M1/N1 (dK, dV) and BLOCK_M2/N2 (dQ))
FLEX_OPTIONS: tuple[dict, ...] = (
    {"ROWS_GUARANTEED_SAFE": True},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
    {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 64, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M1": 32, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 32, "num_warps": 4, "num_stages": 3},
)


def _options_name(opts: dict) -> str:
    return "flex " + ",".join(f"{k}={v}" for k, v in opts.items())


def make_inputs(b: int, H: int, s: int, d: int, device: torch.device, dtype: torch.dtype,
                seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k, v ``[s, b, H, d]``: views of one ``[s, b, 3, H, d]`` leaf, as the model's QKV
    output is split (so their strides are the model's)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    qkv = torch.randn(s, b, 3, H, d, generator=g).to(device=device, dtype=dtype).requires_grad_()
    return qkv, qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]


def _sdpa(bias: Optional[torch.Tensor], backend: Optional[str]) -> Callable:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
              "flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}[backend]

    def attend(q, k, v):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, H, s, d] views
        with sdpa_kernel([chosen]):
            out = (F.scaled_dot_product_attention(q, k, v, attn_mask=bias) if bias is not None
                   else F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return out.permute(2, 0, 1, 3)

    return attend


def _flex(slopes: torch.Tensor, options: Optional[dict]) -> Callable:
    """The model's FlexState, or the same score_mod and block mask through flex_attention
    compiled with ``kernel_options``."""
    state = FlexState(slopes, compile=True)
    if options is None:
        return lambda q, k, v: state(q, k, v, enable_gqa=False)
    from torch.nn.attention.flex_attention import flex_attention

    def attend(q, k, v, score_mod, block_mask):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        out = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, kernel_options=options)
        return out.permute(2, 0, 1, 3)

    kernel = torch.compile(attend, dynamic=False)

    def run(q, k, v):
        return kernel(q, k, v, *state.prepared(q.shape[0], q.device))

    return run


def candidates(device: torch.device, slopes: torch.Tensor, s: int, dtype: torch.dtype) -> list[tuple[str, Callable]]:
    bias = causal_alibi_bias(slopes, s, dtype, device)
    if device.type != "cuda":
        return [("bias math", _sdpa(bias, "math")), ("causal math (no ALiBi)", _sdpa(None, "math"))]
    # the model's kernel and the uncompiled SDPA rows first; each flex option compiles its own
    # kernels (tens of seconds on a GPU's host), so they come last: a run cut off keeps the rest
    out: list[tuple[str, Callable]] = [("flex (the model's)", _flex(slopes, None))]
    out += [("bias efficient", _sdpa(bias, "efficient")), ("bias cudnn", _sdpa(bias, "cudnn")),
            ("causal flash (no ALiBi)", _sdpa(None, "flash")), ("causal cudnn (no ALiBi)", _sdpa(None, "cudnn"))]
    out += [(_options_name(o), _flex(slopes, o)) for o in FLEX_OPTIONS]
    return out


def _errors(out: torch.Tensor, grad: torch.Tensor, ref: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """Largest |difference| over the reference's largest |value|: the output, and dq/dk/dv."""
    o_ref, g_ref = ref
    err = {"out": float((out.float() - o_ref).abs().max() / o_ref.abs().max())}
    for i, name in enumerate(("dq", "dk", "dv")):
        a, r = grad[:, :, i].float(), g_ref[:, :, i]
        err[name] = float((a - r).abs().max() / r.abs().max())
    return err


def run(device: torch.device, b: int, H: int, s: int, d: int, iters: int,
        json_path: Optional[str] = None) -> list[dict]:
    """One row per kernel (:func:`candidates`); with ``json_path`` the rows so far are written
    there after each row, so a run stopped at a time limit keeps what it measured."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    slopes = alibi_slopes(H)
    qkv, q, k, v = make_inputs(b, H, s, d, device, dtype)
    dout = torch.randn(s, b, H, d, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    # the fp32 reference: the bias path in fp32 (math backend: no kernel's own rounding)
    qkv32 = qkv.detach().float().requires_grad_()
    o32 = _sdpa(causal_alibi_bias(slopes, s, torch.float32, device), "math")(qkv32[:, :, 0], qkv32[:, :, 1],
                                                                             qkv32[:, :, 2])
    o32.backward(dout.float())
    ref = (o32.detach(), qkv32.grad)
    del o32, qkv32
    flops = 4 * b * H * s * s * d / 2 * 3.5  # causal half; backward 2.5x the forward
    rows = []
    for name, fn in candidates(device, slopes, s, dtype):
        row = {"kind": "attention_bench", "kernel": name, "shape": [s, b, H, d], "dtype": str(dtype)[6:]}
        try:
            qkv.grad = None
            out = fn(q, k, v)
            out.backward(dout)
            row["error"] = _errors(out.detach(), qkv.grad, ref)

            def step(fn=fn):
                qkv.grad = None
                fn(q, k, v).backward(dout)

            t = timed_queued(step, device, iters, calls=3)
            row.update(ms=t["s"] * 1e3, host_ms=t["host_s"] * 1e3, queued=t["queued"],
                       tflops=flops / t["s"] / 1e12)
        except Exception as exc:  # noqa: BLE001 - a kernel that refuses these inputs is a result
            row["failed"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        rows.append(row)
        _print(row)
        if json_path:
            Path(json_path).write_text(json.dumps(rows, indent=1))
    return rows


def _print(row: dict) -> None:
    if "failed" in row:
        print(f"{row['kernel']:<72} failed: {row['failed']}", flush=True)
        return
    e = row["error"]
    print(f"{row['kernel']:<72} {row['ms']:8.3f} ms {row['tflops']:7.1f} TFLOP/s  err out {e['out']:.1e} "
          f"dq {e['dq']:.1e} dk {e['dk']:.1e} dv {e['dv']:.1e}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None, help="write the rows here (one JSON list)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    rows = run(device, args.batch, args.heads, args.seq, args.head_dim, args.iters, args.json)
    return 0 if any("ms" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
