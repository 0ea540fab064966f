"""What a run writes (docs/metrics.md): ``RUN/metrics.jsonl``, a human-readable log line,
TensorBoard events when ``tensorboard`` is installed.

Only global rank 0 writes (``enabled``); other ranks get a writer whose calls do nothing.
Every record has ``kind``, ``step`` (inner steps done), ``round`` and ``time`` (unix
seconds), then the kind's fields; one JSON object per line, flushed per line.

Throughput (like Megatron's log line): :class:`ThroughputMeter` gives every
``train`` record ``tokens_per_s`` (all groups, over the logging window), ``tflops_per_device``
(FLOPs per token × tokens/s ÷ world size; null on CPU), ``mfu``
(over the device's dense bf16 peak, :func:`peak_bf16_flops`; null on CPU and on GPUs whose
peak we do not know) and, on CUDA, ``mem_allocated_gb`` / ``mem_peak_gb`` (the maximum over
all ranks of ``torch.cuda.memory_allocated`` / ``max_memory_allocated``, 1 GB = 1e9 bytes).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence, TextIO

from .log_lines import write_line

KINDS = ("train", "eval", "outer", "bench", "membership")
REQUIRED = {
    "train": ("loss", "lr", "grad_norm", "tokens", "sources", "loss_by_source", "tokens_per_s",
              "tflops_per_device", "mfu", "consumed_samples", "consumed_tokens"),
    "eval": ("by_source",),
    "outer": ("bytes", "seconds"),
    "membership": ("groups", "joined", "left"),  # federated source groups (dept/federation.py)
    "bench": ("tokens_per_s", "tokens_per_s_per_device", "tflops_per_device", "mfu", "peak_tflops", "mfu_basis",
              "step_ms", "peak_mem_gb"),
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
    """Raise ValueError when ``rec`` lacks a field docs/metrics.md lists (used by tests)."""
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
                 tensorboard: Optional[bool] = True, wandb: Optional[str] = None,
                 config: Optional[dict[str, Any]] = None) -> None:
        """``wandb``: a Weights & Biases project (``train.wandb``) that also receives the scalars
        TensorBoard gets; ``config`` is the run's resolved config, stored with the W&B run.
        ``tensorboard`` (``train.tensorboard``): True, None (only if the package is installed,
        nothing said otherwise) or False. A missing optional package that was asked for is one
        warning line on stderr, and the run goes on."""
        self.enabled = enabled and run_dir is not None
        self.run_dir = run_dir
        self.stream = stream if stream is not None else sys.stdout
        self._file: Optional[TextIO] = None
        self._tb = None
        self._tb_class = None
        self._wandb = None
        self._wandb_continued = False  # the W&B run existed before this launch (RUN/wandb_id.txt)
        # lines for the run's log after resume_at (what W&B keeps of an interrupted launch)
        self.resume_notes: list[str] = []
        if not self.enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self._file = open(os.path.join(run_dir, "metrics.jsonl"), "a", encoding="utf-8")
        if tensorboard is not False:
            try:
                from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
                self._tb_class = SummaryWriter
                self._tb = SummaryWriter(os.path.join(run_dir, "tb"))
            except Exception as exc:  # noqa: BLE001 - tensorboard is optional
                absent = isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "tensorboard"
                if tensorboard or not absent:  # asked for, or broken rather than absent
                    print(f"warning: no TensorBoard events in {os.path.join(run_dir, 'tb')}: "
                          f"{_why(exc, 'tensorboard')}", file=sys.stderr, flush=True)
        if wandb:
            self._wandb_continued = os.path.exists(os.path.join(run_dir, WANDB_ID_FILE))
            self._wandb = _start_wandb(wandb, run_dir, config)

    def resume_at(self, step: int) -> int:
        """Make ``metrics.jsonl`` continue from inner step ``step`` (the checkpoint a run resumed
        from; 0 for a run that starts over): keep the records with ``step <= step``, drop the
        later ones (the steps between that checkpoint and a crash, which the resumed run writes
        again) and any unreadable line (a record cut by the crash). The file is rewritten
        atomically; readers never see a step twice. Returns the number of lines dropped.

        The other writers: TensorBoard's events after ``step`` are hidden (a new event file with
        ``purge_step`` = step + 1; TensorBoard shows the resumed run's values there). W&B cannot
        rewrite steps it has: when this launch continues an earlier launch's W&B run, a line
        in :attr:`resume_notes` says which steps keep the interrupted launch's values."""
        if not self.enabled:
            return 0
        path = os.path.join(self.run_dir, "metrics.jsonl")
        kept: list[bytes] = []
        dropped = 0
        replayed: list[int] = []  # the steps of the dropped records
        with open(path, "rb") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    at = int(rec["step"])
                    keep = at <= step
                    if not keep:
                        replayed.append(at)
                except (ValueError, KeyError, TypeError):
                    keep = False
                if keep:
                    kept.append(line if line.endswith(b"\n") else line + b"\n")
                else:
                    dropped += 1
        if dropped:
            self._file.close()
            tmp = path + ".tmp"
            with open(tmp, "wb") as f:
                f.writelines(kept)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            self._file = open(path, "a", encoding="utf-8")
            if self._tb is not None:
                self._tb.close()
                self._tb = self._tb_class(os.path.join(self.run_dir, "tb"), purge_step=step + 1)
        if replayed and self._wandb is not None and self._wandb_continued:
            first, last = min(replayed), max(replayed)
            self.resume_notes.append(
                f"warning: W&B: this launch continues from step {step}, and the W&B run already has steps "
                f"{first}-{last} from the interrupted launch; W&B cannot rewrite logged steps and ignores this "
                f"launch's values for them, so its curves keep the abandoned values up to step {last} "
                f"(metrics.jsonl and TensorBoard hold the resumed run's; docs/metrics.md)")
        return dropped

    @property
    def has_tensorboard(self) -> bool:
        return self._tb is not None

    def write(self, kind: str, step: int, round_index: int, **fields: Any) -> Optional[dict[str, Any]]:
        if not self.enabled:
            return None
        rec = make_record(kind, step, round_index, **fields)
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        scalars = scalars_of(rec) if self._tb is not None or self._wandb is not None else {}
        if self._tb is not None:
            for tag, value in scalars.items():
                self._tb.add_scalar(tag, value, rec["step"])
            self._tb.flush()
        if self._wandb is not None and scalars:
            self._wandb.log(scalars, step=rec["step"])
        return rec

    def log(self, line: str) -> None:
        if self.enabled:
            write_line(line, self.stream)  # one write: other jobs' ranks may share the terminal

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def scalars_of(rec: dict[str, Any]) -> dict[str, float]:
    """The scalars of a record that TensorBoard and W&B show, by tag."""
    out: dict[str, float] = {}
    if rec["kind"] == "train":
        for key in ("loss", "loss_window", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "mfu",
                    "mem_peak_gb", "consumed_samples", "consumed_tokens"):
            if rec.get(key) is not None:
                out[f"train/{key}"] = rec[key]
        for src, loss in rec["loss_by_source"].items():
            if loss is not None:
                out[f"train_loss/{src}"] = loss
        if rec.get("act_rms_max") is not None:
            out["train/act_rms_max"] = rec["act_rms_max"]
        for i, rms in enumerate(rec.get("act_rms") or []):
            if rms is not None:
                out[f"train/act_rms/{i}"] = rms
    elif rec["kind"] == "eval":
        for src, vals in rec["by_source"].items():
            for key in ("loss", "ppl", "bpb"):
                if vals.get(key) is not None:
                    out[f"eval_{key}/{src}"] = vals[key]
    elif rec["kind"] in ("outer", "membership"):
        for key, value in rec.items():
            if key not in ("kind", "step", "round", "time"):
                _flatten(f"{rec['kind']}/{key}", value, out)
        if rec["kind"] == "outer" and isinstance(rec.get("bytes"), dict):
            out["outer/bytes_total"] = sum(v for v in rec["bytes"].values() if _is_number(v))
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _flatten(tag: str, value: Any, out: dict[str, float]) -> None:
    """The naming rule of the ``outer`` and ``membership`` scalars: a number is ``tag``; a
    dict's entries are ``tag/KEY`` (nested dicts: ``tag/KEY/SUBKEY``); a list gives its length
    as ``tag_count``; true / false are 1 / 0; null and strings are left out."""
    if isinstance(value, bool):
        out[tag] = int(value)
    elif _is_number(value):
        out[tag] = value
    elif isinstance(value, dict):
        for key, sub in value.items():
            _flatten(f"{tag}/{key}", sub, out)
    elif isinstance(value, (list, tuple)):
        out[f"{tag}_count"] = len(value)


def _why(exc: BaseException, package: str) -> str:
    if isinstance(exc, ImportError):
        return f"the {package} package is not installed (pip install {package})"
    return f"{type(exc).__name__}: {exc}"


def missing_logger_packages(tensorboard: Optional[bool], wandb: Optional[str]) -> list[str]:
    """The warnings a launch will print for ``train.tensorboard: true`` / ``train.wandb`` whose
    package is not installed here (the pre-flight's: training goes on without that logging)."""
    import importlib.util
    out = []
    if tensorboard and importlib.util.find_spec("tensorboard") is None:
        out.append("train.tensorboard: the tensorboard package is not installed (pip install tensorboard); the "
                   "launch writes no TensorBoard events")
    if wandb and importlib.util.find_spec("wandb") is None:
        out.append(_no_wandb(wandb, _why(ModuleNotFoundError(), "wandb")))
    return out


def _no_wandb(project: str, why: str) -> str:
    """The warning (without ``warning: ``) of a ``train.wandb`` run that cannot log to W&B."""
    return f"train.wandb={project!r}: {why}; not logging to Weights & Biases"


WANDB_ID_FILE = "wandb_id.txt"


def _start_wandb(project: str, run_dir: str, config: Optional[dict[str, Any]]):
    """A W&B run for ``RUN`` in ``project``, continued by every relaunch of the run (its id is
    kept in ``RUN/wandb_id.txt``). ``WANDB_MODE=offline`` (read by wandb) writes it under
    ``RUN/wandb/`` without a network; ``wandb sync`` uploads it later. None (and one warning
    line) when the package is missing or the run cannot start."""
    try:
        import wandb
    except ImportError as exc:
        print(f"warning: {_no_wandb(project, _why(exc, 'wandb'))}", file=sys.stderr, flush=True)
        return None
    id_path = os.path.join(run_dir, WANDB_ID_FILE)
    if os.path.exists(id_path):
        with open(id_path, encoding="utf-8") as f:
            run_id = f.read().strip()
    else:
        name = "".join(c if c.isalnum() or c in "_-" else "-" for c in os.path.basename(os.path.abspath(run_dir)))
        run_id = f"{name}-{os.urandom(4).hex()}"
        with open(id_path + ".tmp", "w", encoding="utf-8") as f:
            f.write(run_id + "\n")
        os.replace(id_path + ".tmp", id_path)
    try:
        return wandb.init(project=project, name=os.path.basename(os.path.abspath(run_dir)), id=run_id,
                          resume="allow", dir=run_dir, config=config)
    except Exception as exc:  # noqa: BLE001 - wandb's errors (login, network) must not stop training
        print(f"warning: train.wandb={project!r}: wandb.init failed ({type(exc).__name__}: {exc}); not logging to "
              f"Weights & Biases (WANDB_MODE=offline logs without a network)", file=sys.stderr, flush=True)
        return None


def format_seconds(s: float) -> str:
    s = max(0, int(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h:d}:{m:02d}:{sec:02d}"


def human_line(step: int, total: int, loss: float, lr: float, tokens_per_s: float, elapsed: float,
               eta: float, skipped: int = 0, tflops_per_device: Optional[float] = None,
               mfu: Optional[float] = None, mem_peak_gb: Optional[float] = None,
               grad_norm: Optional[float] = None, consumed: Optional[tuple[int, int, int]] = None,
               loss_window: Optional[float] = None, act_rms_max: Optional[float] = None) -> str:
    """``step 20/100 | loss 5.1234 | window loss 5.2011 | lr 3.000e-04 | grad norm 0.512 |
    consumed 5,120 samples 20,971,520 tokens | 12,345 tok/s | 402.1 TFLOP/s/device | MFU 40.7% |
    mem peak 61.2 GB | elapsed 0:01:02 | eta 0:04:08`` (the window loss, grad norm, consumed,
    TFLOP/s, MFU and memory parts only where given; a non-finite loss or norm prints as nan;
    ``| act rms max 1.23`` after the grad norm with ``train.log_activation_norms``).
    ``loss_window``: the mean loss over the logging window (the loop gives it when the window
    holds more than one step). ``consumed``: (samples, tokens, groups) of one source group, said
    to be per group when there are several."""
    extra = f" | skipped {skipped}" if skipped else ""
    window = "" if loss_window is None else f" | window loss {loss_window:.4f}"
    norm = "" if grad_norm is None else f" | grad norm {grad_norm:.3f}"
    if act_rms_max is not None:
        norm += f" | act rms max {act_rms_max:.3f}"
    if consumed is not None:
        samples, tokens, groups = consumed
        norm += f" | consumed {samples:,} samples {tokens:,} tokens{' per group' if groups > 1 else ''}"
    perf = ""
    if tflops_per_device is not None:
        perf += f" | {tflops_per_device:.1f} TFLOP/s/device"
    if mfu is not None:
        perf += f" | MFU {100 * mfu:.1f}%"
    if mem_peak_gb is not None:
        perf += f" | mem peak {mem_peak_gb:.1f} GB"
    return (f"step {step}/{total} | loss {loss:.4f}{window} | lr {lr:.3e}{norm} | {tokens_per_s:,.0f} tok/s{perf} | "
            f"elapsed {format_seconds(elapsed)} | eta {format_seconds(eta)}{extra}")


def activation_fields(sums: Sequence[float]) -> dict[str, Any]:
    """A train record's ``act_rms`` (per transformer block, model order: the RMS of its output
    over the step's tokens, every group's) and ``act_rms_max`` (the largest; null when a layer
    is not finite) from ``[sums of squares..., element counts...]`` (model/act_norms.py)."""
    n = len(sums) // 2
    rms = [math.sqrt(sums[i] / sums[n + i]) if sums[n + i] > 0 else None for i in range(n)]
    finite = [r for r in rms if r is not None and math.isfinite(r)]
    return {"act_rms": rms, "act_rms_max": max(finite) if len(finite) == len(rms) and finite else None}


def format_bytes(n: float) -> str:
    """``532 B``, ``12.3 kB``, ``45.6 MB``, ``1.23 GB``, ``4.56 TB`` (decimal units: 1 MB = 10⁶ bytes)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            x = n / size
            return f"{x:.2f} {unit}" if abs(x) < 10 else f"{x:.1f} {unit}" if abs(x) < 100 else f"{x:.0f} {unit}"
    return f"{int(n)} B"


def outer_line(rec: dict[str, Any]) -> str:
    """The log line of an ``outer`` record: ``outer sync round 3 (step 40) | sent 1.23 GB
    (dp 1.18 GB, outer_body 45.6 MB) | 0.52 s | exposed 0.10 s`` — the bytes the whole job sent
    in the round (inner steps included) with its non-zero categories, the sync's seconds, then
    where known the seconds training waited for it, the overlapped seconds (when any), the
    federated groups it averaged and the bytes of their exchange tries that failed (when any).
    A field that is null (not finite) prints as nan."""
    nbytes = {k: v for k, v in (rec.get("bytes") or {}).items() if _is_number(v)}
    parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in nbytes.items() if v)
    line = (f"outer sync round {rec['round']} (step {rec['step']}) | sent {format_bytes(sum(nbytes.values()))}"
            + (f" ({parts})" if parts else "") + f" | {_secs(rec.get('seconds'))}")
    if "exposed_seconds" in rec:
        line += f" | exposed {_secs(rec['exposed_seconds'])}"
    if rec.get("overlap_seconds"):
        line += f" | overlapped {_secs(rec['overlap_seconds'])}"
    if isinstance(rec.get("groups"), list):
        line += f" | groups {', '.join(map(str, rec['groups']))}"
    failed = {k: v for k, v in (rec.get("failed_bytes") or {}).items() if _is_number(v) and v}
    if failed:  # (federated groups: exchange tries that failed, not in "sent")
        line += (f" | failed tries {format_bytes(sum(failed.values()))} ("
                 + ", ".join(f"{k} {format_bytes(v)}" for k, v in failed.items()) + ")")
    return line


def _secs(value: Optional[float]) -> str:
    return "nan s" if value is None else f"{value:.2f} s"


def train_flops_per_token(model, vocab_size: int) -> float:
    """Training FLOPs per token (docs/metrics.md): per layer 6·h·(q + 2·kv + q) for the attention
    projections, 6·h·ffn·(3 if swiglu else 2) for the MLP, 6·q·s for causal attention (half the
    s×s scores); plus 6·h·V once for the output head. Megatron-LM's formula since core_v0.12
    (``num_floating_point_operations``), given the same vocabulary; up to core_r0.11 it counted
    12·q·s for attention, as torchtitan does."""
    h = model.hidden_size
    q = model.num_attention_heads * model.head_dim
    kv = model.query_groups * model.head_dim
    mlp = 6 * h * model.ffn_size * (3 if model.activation == "swiglu" else 2)
    per_layer = 6 * h * (q + 2 * kv + q) + mlp + 6 * q * model.seq_length
    return float(model.num_layers * per_layer + 6 * h * vocab_size)


# Dense bf16 peak FLOP/s by device name: the SXM parts ("NVIDIA H100 80GB HBM3", "NVIDIA H200")
# and the GH200's GPU. The PCIe and NVL parts of both have lower peaks (lower clocks and power;
# the H200 NVL's datasheet gives 835 TFLOP/s dense) and are not listed: their MFU is null rather
# than measured against the SXM part's peak.
PEAK_BF16_FLOPS = {"H100 SXM": 989e12, "H200 SXM": 989e12}


# What every MFU here is over: FP8 runs too, so an FP8 run's MFU is not its share of the FP8 peak
# (twice the bf16 one on H100 / H200)
MFU_BASIS = "dense bf16 peak of the device (for FP8 runs too)"


def peak_bf16_flops(device_name: str) -> Optional[float]:
    """Dense bf16 peak of a CUDA device from its name, or None when we do not know it."""
    name = device_name.upper()
    if "PCIE" in name or "NVL" in name:
        return None
    if "H200" in name:
        return PEAK_BF16_FLOPS["H200 SXM"]
    if "H100" in name:
        return PEAK_BF16_FLOPS["H100 SXM"]
    return None


def device_peak_flops(device) -> Optional[float]:
    """:func:`peak_bf16_flops` of a torch device (None on CPU)."""
    import torch
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return peak_bf16_flops(torch.cuda.get_device_name(device))


class ThroughputMeter:
    """Tokens, FLOPs and time of one logging window (see the module docstring).

    Every rank calls :meth:`add_step` after each step with its group's tokens and the
    vocabulary its embeddings use (None where the rank has none); :meth:`window` — on every
    rank at the same step, it reduces over the groups and ranks — returns the record fields and
    starts the next window. Time spent inside :meth:`paused` (evaluation, checkpoints) is not
    counted. FLOPs per token follow §8 with the vocabulary of each group's embeddings (SPEC-OPT
    groups have different ones; TRIM's softmax runs over V_k).
    """

    def __init__(self, model_cfg, pg, device, *, report_flops: Optional[bool] = None,
                 peak_flops: Optional[float] = None, clock: Callable[[], float] = time.perf_counter) -> None:
        import torch
        self.model = model_cfg
        self.pg = pg
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.report_flops = cuda if report_flops is None else report_flops
        self.peak = peak_flops if peak_flops is not None else device_peak_flops(self.device)
        self.clock = clock
        self._per_token: dict[int, float] = {}
        self.start()

    def start(self) -> None:
        self.t0 = self._now()
        self.tokens = 0
        self.flops = 0.0
        self.excluded = 0.0

    def flops_per_token(self, vocab_size: int) -> float:
        if vocab_size not in self._per_token:
            self._per_token[vocab_size] = train_flops_per_token(self.model, vocab_size)
        return self._per_token[vocab_size]

    def add_step(self, tokens: int, vocab_size: Optional[int]) -> None:
        self.tokens += int(tokens)
        if vocab_size:
            self.flops += tokens * self.flops_per_token(vocab_size)

    def _now(self) -> float:
        """The clock once the device has finished the work queued so far (CUDA is asynchronous)."""
        if self.device.type == "cuda":
            import torch
            torch.cuda.synchronize(self.device)
        return self.clock()

    @contextmanager
    def paused(self) -> Iterator[None]:
        t = self._now()
        try:
            yield
        finally:
            self.excluded += self._now() - t

    def window(self) -> dict[str, Any]:
        import torch
        import torch.distributed as dist

        from .parallel.comm import bookkeeping_device
        seconds = max(self._now() - self.t0 - self.excluded, 1e-9)
        pg = self.pg
        tokens, flops = float(self.tokens), self.flops
        distributed = dist.is_available() and dist.is_initialized() and pg.world_size > 1
        if pg.num_groups > 1 and distributed:
            # one slot pair per group, filled by the group's first rank (bookkeeping, not counted)
            v = torch.zeros(2 * pg.num_groups, dtype=torch.float64, device=bookkeeping_device())
            g = pg.group_index
            if pg.rank == pg.rank_of(0, 0, 0, g):
                v[2 * g] = tokens
                v[2 * g + 1] = flops
            dist.all_reduce(v)
            tokens, flops = float(v[0::2].sum()), float(v[1::2].sum())
        out: dict[str, Any] = {"tokens_per_s": tokens / seconds, "tflops_per_device": None, "mfu": None}
        if self.report_flops and flops > 0:
            tflops = flops / seconds / pg.world_size / 1e12
            out["tflops_per_device"] = tflops
            if self.peak:
                out["mfu"] = tflops * 1e12 / self.peak
        if self.device.type == "cuda":
            mem = torch.tensor([torch.cuda.memory_allocated(self.device), torch.cuda.max_memory_allocated(self.device)],
                               dtype=torch.float64, device=self.device)
            if distributed:
                dist.all_reduce(mem, op=dist.ReduceOp.MAX)
            out["mem_allocated_gb"] = float(mem[0]) / 1e9
            out["mem_peak_gb"] = float(mem[1]) / 1e9
        self.start()
        return out


def write_json_atomic(path: str, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` through a temporary file and a rename, so a reader
    never sees a half-written file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)
