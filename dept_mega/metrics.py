"""What a run writes (design.md §6): ``RUN/metrics.jsonl``, a human-readable log line,
TensorBoard events when ``tensorboard`` is installed.

Only global rank 0 writes (``enabled``); other ranks get a writer whose calls do nothing.
Every record has ``kind``, ``step`` (inner steps done), ``round`` and ``time`` (unix
seconds), then the kind's fields; one JSON object per line, flushed per line.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Optional, TextIO

KINDS = ("train", "eval", "outer", "bench")
REQUIRED = {
    "train": ("loss", "lr", "grad_norm", "tokens", "sources", "loss_by_source"),
    "eval": ("by_source",),
    "outer": ("bytes", "seconds"),
    "bench": ("tokens_per_s", "tokens_per_s_per_device", "tflops_per_device", "mfu", "step_ms",
              "peak_mem_gb"),
}
EVAL_FIELDS = ("loss", "ppl", "bpb", "tokens", "bytes")


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def make_record(kind: str, step: int, round_index: int, **fields: Any) -> dict[str, Any]:
    if kind not in KINDS:
        raise ValueError(f"unknown metrics record kind {kind!r}")
    missing = [k for k in REQUIRED[kind] if k not in fields]
    if missing:
        raise ValueError(f"metrics record of kind {kind!r} misses {missing}")
    rec = {"kind": kind, "step": int(step), "round": int(round_index), "time": time.time()}
    rec.update(fields)
    return _clean(rec)


def check_record(rec: dict[str, Any]) -> None:
    """Raise ValueError when ``rec`` does not follow design.md §6 (used by tests)."""
    for key in ("kind", "step", "round", "time"):
        if key not in rec:
            raise ValueError(f"record misses {key!r}: {rec}")
    kind = rec["kind"]
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}")
    for key in REQUIRED[kind]:
        if key not in rec:
            raise ValueError(f"{kind} record misses {key!r}: {rec}")
    if kind == "eval":
        for src, vals in rec["by_source"].items():
            for key in EVAL_FIELDS:
                if key not in vals:
                    raise ValueError(f"eval record for source {src!r} misses {key!r}")


class MetricsWriter:
    def __init__(self, run_dir: Optional[str], enabled: bool = True, stream: Optional[TextIO] = None,
                 tensorboard: bool = True) -> None:
        self.enabled = enabled and run_dir is not None
        self.run_dir = run_dir
        self.stream = stream if stream is not None else sys.stdout
        self._file: Optional[TextIO] = None
        self._tb = None
        if not self.enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self._file = open(os.path.join(run_dir, "metrics.jsonl"), "a", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
                self._tb = SummaryWriter(os.path.join(run_dir, "tb"))
            except Exception:  # noqa: BLE001 - tensorboard is optional (design.md §6)
                self._tb = None

    @property
    def has_tensorboard(self) -> bool:
        return self._tb is not None

    def write(self, kind: str, step: int, round_index: int, **fields: Any) -> Optional[dict[str, Any]]:
        if not self.enabled:
            return None
        rec = make_record(kind, step, round_index, **fields)
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        if self._tb is not None:
            self._tensorboard(rec)
        return rec

    def _tensorboard(self, rec: dict[str, Any]) -> None:
        kind, step = rec["kind"], rec["step"]
        if kind == "train":
            for key in ("loss", "lr", "grad_norm"):
                if rec.get(key) is not None:
                    self._tb.add_scalar(f"train/{key}", rec[key], step)
            for src, loss in rec["loss_by_source"].items():
                if loss is not None:
                    self._tb.add_scalar(f"train_loss/{src}", loss, step)
        elif kind == "eval":
            for src, vals in rec["by_source"].items():
                for key in ("loss", "ppl", "bpb"):
                    if vals.get(key) is not None:
                        self._tb.add_scalar(f"eval_{key}/{src}", vals[key], step)
        self._tb.flush()

    def log(self, line: str) -> None:
        if self.enabled:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def format_seconds(s: float) -> str:
    s = max(0, int(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h:d}:{m:02d}:{sec:02d}"


def human_line(step: int, total: int, loss: float, lr: float, tokens_per_s: float, elapsed: float,
               eta: float, skipped: int = 0) -> str:
    """``step 20/100 | loss 5.1234 | lr 3.000e-04 | 12,345 tok/s | elapsed 0:01:02 | eta 0:04:08``"""
    extra = f" | skipped {skipped}" if skipped else ""
    return (f"step {step}/{total} | loss {loss:.4f} | lr {lr:.3e} | {tokens_per_s:,.0f} tok/s | "
            f"elapsed {format_seconds(elapsed)} | eta {format_seconds(eta)}{extra}")


def train_flops_per_token(model, vocab_size: int) -> float:
    """Training FLOPs per token, design.md §8 (Megatron's dense formula): per layer
    6·h·(q + 2·kv + q) for the attention projections, 6·h·ffn·(3 if swiglu else 2) for the MLP,
    6·q·s for causal attention; plus 6·h·V once for the output head."""
    h = model.hidden_size
    q = model.num_attention_heads * model.head_dim
    kv = model.query_groups * model.head_dim
    mlp = 6 * h * model.ffn_size * (3 if model.activation == "swiglu" else 2)
    per_layer = 6 * h * (q + 2 * kv + q) + mlp + 6 * q * model.seq_length
    return float(model.num_layers * per_layer + 6 * h * vocab_size)


def write_json_atomic(path: str, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` through a temporary file and a rename, so a reader
    never sees a half-written file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)
