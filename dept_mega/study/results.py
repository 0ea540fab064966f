"""What a finished run says: its last evaluation, its curves, its bytes and parameters.

Reads ``RUN/config.yaml``, ``RUN/metrics.jsonl`` (records of kind ``train``, ``eval`` and
``outer``), ``RUN/params.json`` and the study's marker. When a run was resumed, a step can
appear twice in ``metrics.jsonl``; the last record of each (kind, step) wins, so nothing is
counted twice.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

CROSS_GROUP = ("outer_body", "outer_embedding", "source_move")


class RunReadError(RuntimeError):
    pass


@dataclass
class RunResult:
    run_dir: str
    variant: str
    config: dict[str, Any]
    by_source: dict[str, dict[str, float]]  # last evaluation
    eval_step: int
    eval_curve: list[tuple[int, float]]  # (step, mean validation BPB)
    train_curve: list[tuple[int, float]]  # (step, training loss)
    tokens_per_step: int
    rounds: int
    bytes_per_round: dict[str, float]  # mean over rounds, per category
    params_per_rank: dict[str, int]  # the largest rank's body / embeddings
    seconds: Optional[float] = None
    command: Optional[list[str]] = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def mean_bpb(self) -> float:
        return _mean([v["bpb"] for v in self.by_source.values()])

    @property
    def mean_ppl(self) -> float:
        return _mean([v["ppl"] for v in self.by_source.values()])

    @property
    def train_tokens(self) -> int:
        return self.eval_step * self.tokens_per_step


def _mean(values: list[Optional[float]]) -> float:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if len(vals) != len(values) or not vals:
        return float("nan")
    return sum(vals) / len(vals)


def read_records(path: str) -> list[dict[str, Any]]:
    """Records of a metrics file, the last one of each (kind, step), in step order per kind."""
    if not os.path.exists(path):
        raise RunReadError(f"{path} does not exist")
    last: dict[tuple[str, int], dict[str, Any]] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RunReadError(f"{path}:{lineno}: not JSON ({exc})") from None
            if "kind" not in rec or "step" not in rec:
                raise RunReadError(f"{path}:{lineno}: a record needs 'kind' and 'step'")
            last[(rec["kind"], int(rec["step"]))] = rec
    return [last[k] for k in sorted(last, key=lambda k: (k[0], k[1]))]


def read_run(run_dir: str) -> RunResult:
    cfg_path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(cfg_path):
        raise RunReadError(f"{cfg_path} does not exist: is {run_dir!r} a run directory?")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = yaml.safe_load(f)
    recs = read_records(os.path.join(run_dir, "metrics.jsonl"))
    evals = [r for r in recs if r["kind"] == "eval"]
    trains = [r for r in recs if r["kind"] == "train"]
    outers = [r for r in recs if r["kind"] == "outer"]
    if not evals:
        raise RunReadError(f"{os.path.join(run_dir, 'metrics.jsonl')}: no eval record")
    last = evals[-1]
    eval_curve = [(int(r["step"]), _mean([v.get("bpb") for v in r["by_source"].values()])) for r in evals]
    train_curve = [(int(r["step"]), float(r["loss"])) for r in trains if r.get("loss") is not None]
    tokens = int(trains[-1]["tokens"]) if trains else 0
    per_round: dict[str, float] = {}
    for r in outers:
        for cat, n in r["bytes"].items():
            per_round[cat] = per_round.get(cat, 0.0) + float(n) / len(outers)
    params: dict[str, int] = {}
    params_path = os.path.join(run_dir, "params.json")
    if os.path.exists(params_path):
        with open(params_path, encoding="utf-8") as f:
            ranks = json.load(f).get("ranks", [])
        for key in ("body", "embeddings"):
            if ranks:
                params[key] = max(int(rk[key]) for rk in ranks)
    seconds = command = None
    marker = os.path.join(run_dir, "study_run.json")
    if os.path.exists(marker):
        with open(marker, encoding="utf-8") as f:
            m = json.load(f)
        seconds, command = m.get("seconds"), m.get("command")
    return RunResult(run_dir, cfg["dept"]["variant"], cfg, last["by_source"], int(last["step"]), eval_curve,
                     train_curve, tokens, len(outers), per_round, params, seconds, command)


def dept_round_steps(results: dict[str, RunResult]) -> tuple[int, str]:
    """The inner steps of one round that STD's data-parallel equivalent is counted over, and why:
    the DEPT runs' ``dept.local_steps`` when they all share one; otherwise one inner step. (An STD
    run's own ``dept.local_steps`` means nothing: STD has no rounds.)"""
    steps = sorted({int(r.config["dept"]["local_steps"]) for r in results.values() if r.variant != "std"})
    if len(steps) == 1:
        return steps[0], f"a round of the DEPT runs' {steps[0]} inner steps (dept.local_steps)"
    if not steps:
        return 1, "one inner step (no DEPT run in the study to compare with)"
    return 1, ("one inner step (the DEPT runs' rounds differ in length: dept.local_steps "
               + ", ".join(map(str, steps)) + ")")


def std_equivalent_bytes_per_round(result: RunResult, groups: int, round_steps: int) -> float:
    """What STD would send in ``round_steps`` inner steps if its global batch were split over
    ``groups`` data-parallel workers (the comparison the paper's Table 1 makes): every worker
    all-reduces the whole model's fp32 gradients every step (counted as comm.py counts: each rank
    its input)."""
    model_params = result.params_per_rank.get("body", 0) + result.params_per_rank.get("embeddings", 0)
    return float(groups * model_params * 4 * round_steps)
