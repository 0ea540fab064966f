"""Why GLOB loses at equal compute: where a group's update of the global table goes, and what
averaging does to it (docs/study/glob.md).

One process replays GLOB with FedAvg for G source groups (D = T = P = 1): every group starts a
round from the same weights θ_{t-1}, trains its own source for ``local_steps`` inner steps with
the trainer dept_mega uses (AdamW, schedule, clipping), and then every parameter — body and
table — becomes θ_{t-1} − mean_k Δ_k (Δ_k = θ_{t-1} − θ_k). Source k is trained by group k in
every round, so each group keeps its own inner AdamW state, as DiLoCo does.

Measured per round, for the token table (which is also the tied softmax):

* ``outside_share``: of the squared norm of group k's table update, the part on rows outside
  V_k (the ids that never occur in source k's training data), averaged over groups;
* ``drift_share``: of the squared norm of the averaged table update, the part that comes from
  groups whose source does not contain the row (null in ``body_only``, which averages no table);
* ``penalty``: validation BPB of source k under the averaged weights minus under group k's
  own weights just before averaging (what one averaging costs), averaged over sources;
* ``bpb``: average validation BPB after the round;
* ``coherence`` (table, body): ‖Σ_k Δ_k‖² / (G·Σ_k ‖Δ_k‖²), 1 when the groups' updates agree,
  1/G when they are orthogonal.

Δ_k is measured from group k's own start of the round: the same weights for every group,
except the table in ``body_only`` from round 2 on.

Modes (``--modes``, comma-separated):

* ``all``: plain GLOB;
* ``present``: ``dept.embedding_rows: present`` (inner steps leave the rows outside V_k
  untouched, dept_mega.dept.row_mask), table averaged over all G groups as usual;
* ``holders``: as ``present``, but each row's pseudo-gradient is averaged over the groups whose
  source holds the row only (TRIM's rule, on a dense table with the full softmax);
* ``body_only``: plain inner steps, the body averaged, every group keeps its own table (SPEC
  with a shared start): what averaging the body alone costs.

    python tools/glob_rows.py --config examples/tiny/glob.yaml --sources en,fr,ru,code \\
        --rounds 4 --local-steps 50 --group-batch 16 --out runs/glob_rows.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dept_mega.config import load_config  # noqa: E402
from dept_mega.data.sources import SourceBatches, ValidationBatches, source_datasets, vocab_set  # noqa: E402
from dept_mega.dept.row_mask import PresentRowsOnly  # noqa: E402
from dept_mega.parallel.groups import build_groups  # noqa: E402
from dept_mega.train import vocab_size_of  # noqa: E402
from dept_mega.trainer import MicroBatch, Trainer  # noqa: E402


MODES = ("all", "present", "holders", "body_only")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="a GLOB config (its model, optimizer, data)")
    ap.add_argument("--sources", default=None, help="comma-separated source names (default: all)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--local-steps", type=int, default=50)
    ap.add_argument("--group-batch", type=int, default=16, help="sequences per group per inner step")
    ap.add_argument("--eval-iters", type=int, default=4,
                    help="validation batches of train.micro_batch_size sequences per source (one process: "
                         "the samples docs/study/glob_rows*.json were measured on)")
    ap.add_argument("--modes", default="all,present", help="dept.embedding_rows values to compare")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override (train.steps and dept.local_steps follow --rounds and --local-steps)")
    ap.add_argument("--out", required=True, help="JSON file for the per-round measurements")
    return ap.parse_args(argv)


def _table(trainer) -> torch.nn.Parameter:
    emb = trainer.embeddings()[0]
    if emb.output_layer is not None:
        raise SystemExit("glob_rows.py: needs model.tie_embeddings: true (the table is the softmax)")
    return emb.word_embeddings.weight


def _bpb(trainer, batches) -> float:
    loss, nbytes = 0.0, 0.0
    for b in batches:
        s, _ = trainer.eval_batches([MicroBatch(t, rows=r) for t, r in zip(b.micro_batches, b.rows)])
        loss += s
        nbytes += float(b.bytes.sum())
    return loss / math.log(2) / nbytes


def _coherence(deltas: list[torch.Tensor]) -> float:
    """‖Σ_k Δ_k‖² / (G·Σ_k ‖Δ_k‖²): 1 when the groups' updates agree, 1/G when they are
    orthogonal (the average then keeps 1/√G of a group's step length)."""
    total = sum(deltas)
    return float(total.pow(2).sum()) / max(len(deltas) * sum(float(d.pow(2).sum()) for d in deltas), 1e-30)


def _snapshot(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.parameters()]


def _load(trainer, values) -> None:
    with torch.no_grad():
        for p, v in zip(trainer.parameters(), values):
            p.copy_(v)


def run_mode(cfg, names: list[str], mode: str, args) -> dict[str, Any]:
    vocab = vocab_size_of(cfg)
    pg = build_groups(1, 1, 1)
    train_sets = source_datasets(cfg, "train")
    valid_sets = source_datasets(cfg, "valid")
    index = {s.name: i for i, s in enumerate(cfg.data.sources)}
    groups = []
    mbs = cfg.train.micro_batch_size
    for name in names:
        torch.manual_seed(cfg.train.seed)
        tr = Trainer(cfg, pg, torch.device("cpu"), vocab_size=vocab)
        i = index[name]
        ids = torch.as_tensor(vocab_set(cfg.data.sources[i].prefix, cfg.data.cache_dir), dtype=torch.int64)
        groups.append({"name": name, "trainer": tr, "ids": ids,
                       "data": SourceBatches(train_sets[i], args.group_batch, cfg.train.micro_batch_size),
                       "valid": list(ValidationBatches(valid_sets[i], mbs, mbs, args.eval_iters))})
    first = groups[0]["trainer"]
    for g in groups[1:]:  # identical start (the seed makes them equal; make sure)
        _load(g["trainer"], _snapshot(first))
    rows = _table(first).shape[0]
    in_vocab = []
    for g in groups:
        m = torch.zeros(rows, dtype=torch.bool)
        m[g["ids"]] = True
        in_vocab.append(m)
    records = []
    G = len(groups)
    ti = [p is _table(first) for p in first.parameters()].index(True)
    for r in range(args.rounds):
        t0 = time.time()
        deltas, local_bpb, outside_share = [], [], []
        theta_prev = None  # group 0's start: the body every group starts from (and the table, but in body_only)
        for g, mask in zip(groups, in_vocab):
            tr = g["trainer"]
            # the group's own round start: the body is the same for every group, but in
            # body_only each group's table is its own from round 2 on
            start = _snapshot(tr)
            if theta_prev is None:
                theta_prev = start
            hook = PresentRowsOnly(tr, g["ids"]) if mode in ("present", "holders") else None
            for _ in range(args.local_steps):
                tr.train_step(g["data"].next_step())
            if hook is not None:
                hook.remove()
            deltas.append([a - b for a, b in zip(start, _snapshot(tr))])
            d = deltas[-1][ti]
            sq_in, sq_out = float(d[mask].pow(2).sum()), float(d[~mask].pow(2).sum())
            outside_share.append(sq_out / max(sq_in + sq_out, 1e-30))
            local_bpb.append(_bpb(tr, g["valid"]))
        mean = [sum(ds[j] for ds in deltas) / G for j in range(len(theta_prev))]
        drift_share = None  # body_only averages no table: there is no averaged table update
        if mode != "body_only":
            drift = torch.zeros_like(mean[ti])
            for ds, mask in zip(deltas, in_vocab):
                drift[~mask] += ds[ti][~mask] / G
            drift_share = float(drift.pow(2).sum()) / max(float(mean[ti].pow(2).sum()), 1e-30)
        body = [j for j in range(len(theta_prev)) if j != ti]
        coherence = {"table": _coherence([ds[ti] for ds in deltas]),
                     "body": _coherence([torch.cat([ds[j].flatten() for j in body]) for ds in deltas])}
        if mode == "holders":  # each row: the mean over the groups whose source holds it (TRIM's rule)
            count = torch.stack(in_vocab).sum(0).clamp(min=1).to(mean[ti].dtype)
            mean[ti] = mean[ti] * (G / count).unsqueeze(1)
        averaged = [a - m for a, m in zip(theta_prev, mean)]
        after = []
        for g, ds in zip(groups, deltas):
            mine = list(averaged)
            if mode == "body_only":  # the table stays the group's own (SPEC with a shared start)
                mine[ti] = g["trainer"].parameters()[ti].detach().clone()
            _load(g["trainer"], mine)
            after.append(_bpb(g["trainer"], g["valid"]))
        rec = {"mode": mode, "round": r + 1, "step": (r + 1) * args.local_steps,
               "outside_share": sum(outside_share) / G, "drift_share": drift_share,
               "penalty": sum(a - b for a, b in zip(after, local_bpb)) / G, "coherence": coherence,
               "bpb_local": sum(local_bpb) / G, "bpb": sum(after) / G,
               "bpb_by_source": {g["name"]: a for g, a in zip(groups, after)},
               "seconds": round(time.time() - t0, 1)}
        print(json.dumps(rec), flush=True)
        records.append(rec)
    vocab_sizes = {g["name"]: int(g["ids"].numel()) for g in groups}
    return {"records": records, "vocab_sizes": vocab_sizes, "rows": rows}


def main(argv=None) -> int:
    args = parse_args(argv)
    out: dict[str, Any] = {"command": "python tools/glob_rows.py " + " ".join(sys.argv[1:] if argv is None else argv),
                           "modes": {}}
    for mode in args.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"glob_rows.py: --modes: unknown mode {mode!r} ({' | '.join(MODES)})")
        rows = "present" if mode in ("present", "holders") else "all"
        # the LR schedule spans the replayed steps, as in a run of rounds × local_steps steps
        fixed = [f"train.steps={args.rounds * args.local_steps}", f"dept.local_steps={args.local_steps}",
                 f"dept.embedding_rows={rows}"]
        cfg = load_config(args.config, list(args.set) + fixed)
        names = args.sources.split(",") if args.sources else [s.name for s in cfg.data.sources]
        unknown = sorted(set(names) - {s.name for s in cfg.data.sources})
        if unknown:
            raise SystemExit(f"glob_rows.py: --sources {','.join(unknown)} not in {args.config}'s data.sources")
        print(f"== mode {mode}: {len(names)} groups, {args.rounds} rounds of {args.local_steps} steps", flush=True)
        out["modes"][mode] = run_mode(cfg, names, mode, args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")
    print(markdown(out))
    return 0


def markdown(out: dict[str, Any]) -> str:
    """One row per mode: shares and penalty per round, the BPB after the last round."""
    lines = ["| mode | outside V_k share of a group's table update | drift share of the averaged update "
             "| averaging penalty (BPB) per round | coherence table / body (last round) "
             "| BPB before / after the last average |",
             "|---|---|---|---|---|---|"]
    for mode, res in out["modes"].items():
        recs = res["records"]
        fmt = lambda key: " ".join("n/a" if r[key] is None else f"{r[key]:.2f}" for r in recs)  # noqa: E731
        coh = recs[-1].get("coherence") or {}
        lines.append(f"| {mode} | {fmt('outside_share')} | {fmt('drift_share')} | {fmt('penalty')} "
                     f"| {coh.get('table', float('nan')):.2f} / {coh.get('body', float('nan')):.2f} "
                     f"| {recs[-1]['bpb_local']:.4f} / {recs[-1]['bpb']:.4f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    from dept_mega.process_exit import exit_after
    exit_after(main)
