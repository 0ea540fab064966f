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

from ..variant import variant_of

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
    bytes_total: dict[str, float]  # summed over the run's outer records (all rounds, all ranks), per category
    params_per_rank: dict[str, int]  # the largest rank's body / embeddings
    seconds: Optional[float] = None
    command: Optional[list[str]] = None
    extra: dict[str, Any] = field(default_factory=dict)
    model_params: Optional[int] = None  # the whole model of one group (replica_params); None without params.json

    @property
    def mean_bpb(self) -> float:
        return _mean([v["bpb"] for v in self.by_source.values()])

    @property
    def mean_ppl(self) -> float:
        return _mean([v["ppl"] for v in self.by_source.values()])

    @property
    def train_tokens(self) -> int:
        return self.eval_step * self.tokens_per_step

    @property
    def local_steps(self) -> Optional[int]:
        """Inner steps per round (None for STD, which has no rounds)."""
        return int(self.config["dept"]["local_steps"]) if variant_of(self.variant).rounds else None

    def bytes_per_step(self) -> dict[str, float]:
        """Measured bytes per inner step by category: the run's total over its final step (its
        last evaluation's), so runs whose rounds differ in length compare."""
        return {c: n / self.eval_step for c, n in self.bytes_total.items()} if self.eval_step else {}

    def mid_round_eval_steps(self) -> list[int]:
        """The steps of evaluations inside a round (not a multiple of ``dept.local_steps``):
        group 0's unsynchronised model, not comparable with round-end points
        (dept_mega/schedule_warnings.py); not the final evaluation, which follows the last
        round's sync whatever the step. [] for STD."""
        L = self.local_steps
        return [s for s, _ in self.eval_curve if s % L and s != self.eval_step] if L else []


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
    total: dict[str, float] = {}
    for r in outers:
        for cat, n in r["bytes"].items():
            total[cat] = total.get(cat, 0.0) + float(n)
    per_round = {cat: n / len(outers) for cat, n in total.items()}
    params: dict[str, int] = {}
    model_params = None
    params_path = os.path.join(run_dir, "params.json")
    if os.path.exists(params_path):
        with open(params_path, encoding="utf-8") as f:
            ranks = json.load(f).get("ranks", [])
        for key in ("body", "embeddings"):
            if ranks:
                params[key] = max(int(rk[key]) for rk in ranks)
        model_params = replica_params(ranks, cfg) if ranks else None
    seconds = command = None
    marker = os.path.join(run_dir, "study_run.json")
    if os.path.exists(marker):
        with open(marker, encoding="utf-8") as f:
            m = json.load(f)
        seconds, command = m.get("seconds"), m.get("command")
    return RunResult(run_dir, cfg["dept"]["variant"], cfg, last["by_source"], int(last["step"]), eval_curve,
                     train_curve, tokens, len(outers), per_round, total, params, seconds, command,
                     model_params=model_params)


def replica_params(ranks: list[dict[str, Any]], cfg: dict[str, Any]) -> int:
    """The whole model's parameters, as one rank holds them with no tensor or pipeline
    parallelism, from ``params.json``'s per-rank shards (``cfg``: the run's config.yaml).

    Sums the shards of one data-parallel replica of group 0 (its T·P ranks), then counts once
    what those ranks hold more than once: the norms and row-parallel biases and the learned
    positions every tensor rank holds whole, and the tied table's copy on the last pipeline
    stage (the untied head there is counted)."""
    par = cfg.get("parallel") or {}
    T, P = int(par.get("tensor", 1)), int(par.get("pipeline", 1))
    replica = [rk for rk in ranks if rk.get("group", 0) == 0 and rk.get("dp", 0) == 0]
    body = sum(int(rk["body"]) for rk in replica)
    emb = sum(int(rk["embeddings"]) for rk in replica if rk.get("pp", 0) == 0)
    model = cfg.get("model") or {}
    if P > 1 and not model.get("tie_embeddings", True):
        emb += sum(int(rk["embeddings"]) for rk in replica if rk.get("pp", 0) == P - 1)
    if T > 1:
        from ..config import config_from_dict
        from ..dept.costs import body_split, position_params
        m = config_from_dict(cfg).model
        body -= (T - 1) * body_split(m).replicated
        emb -= (T - 1) * position_params(m)
    return body + emb


def std_equivalent_bytes_per_step(result: RunResult, groups: int) -> float:
    """What STD would send per inner step if its global batch were split over ``groups``
    data-parallel workers (the comparison the paper's Table 1 makes): every worker all-reduces
    the whole model's fp32 gradients every step (counted as comm.py counts: each rank its
    input). The whole model, not one rank's tensor or pipeline shard (:func:`replica_params`)."""
    if result.model_params is not None:
        return float(groups * result.model_params * 4)
    model_params = result.params_per_rank.get("body", 0) + result.params_per_rank.get("embeddings", 0)
    return float(groups * model_params * 4)
