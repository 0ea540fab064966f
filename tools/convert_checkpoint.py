"""Convert a checkpoint of format 1 (keys by rank position) to format 2 (boxes of global tensors).

    python tools/convert_checkpoint.py --run-dir RUN [--step S] [--config RUN/config.yaml]

Format 1 (releases before format 2) keyed each tensor by where it lay:
``model/g{g}/tp{t}/pp{p}/c{c}/{name}``, the inner optimizers' state under
``optim/{body|emb}/{moment}/`` + that key (the distributed optimizer's pieces with
``/dp{d}of{D}:{start}-{end}``: a flat range of the shard), DEPT's outer state under
``dept/{category}/tp{t}/pp{p}/c{c}/{name}/{kind}`` and the per-group buffers under
``dept/{category}/g{g}/...``. Such a checkpoint loads only with the layout it was written
with. This tool rewrites step S (default: ``latest``) in format 2
(``dept_mega.checkpoint_format``): every tensor a box of its global tensor under global keys;
afterwards any layout change that format 2 allows applies.

Single process, no torchrun: every tensor of the checkpoint is read whole into host memory
(the whole checkpoint must fit there) and written again. The tensor-parallel split of each
parameter (dimension, SwiGLU's stride) comes from the model code, built on the meta device
from the run's config. The other files (layout, data positions, hook state, dropout
streams) are copied unchanged. Integrity: the new step is written as ``step_S.convert.tmp``
with a manifest of checksums, then the old directory is renamed ``step_S.format1`` (kept:
delete it once the run resumed) and the new one renamed to ``step_S``; ``latest`` is not
touched (it names the step, which keeps its number).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import warnings
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dept_mega.checkpoint_format import (Entry, entries_of, optim_key, outer_key, param_key,  # noqa: E402
                                         save_entries, whole)
from dept_mega.manifest import LAYOUT_FILE, CheckpointError, fsync_dir, read_json, read_manifest, seal  # noqa: E402

_POS = r"tp(?P<t>\d+)/pp(?P<p>\d+)/c(?P<c>\d+)/(?P<name>[^/]+)"
_MODEL = re.compile(rf"^model/g(?P<g>\d+)/{_POS}$")
_OPTIM = re.compile(rf"^optim/(?P<opt>body|emb)/(?P<moment>[^/]+)/model/g(?P<g>\d+)/{_POS}"
                    r"(?:/dp\d+of\d+:(?P<start>\d+)-(?P<end>\d+))?$")
_OUTER = re.compile(rf"^dept/(?P<cat>[^/]+)/(?:g(?P<g>\d+)/)?{_POS}/(?P<kind>[^/]+)$")
_COUNTER = re.compile(r"^dept/[^/]+/(?:steps|part_steps)$")
_KNOWN = re.compile(r"^dept/(?P<cat>[^/]+)/g(?P<g>\d+)/tp(?P<t>\d+)/pp(?P<p>\d+)/eager_known$")


def _read_all(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of DCP checkpoint ``path``, whole, in host memory."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    md = FileSystemReader(path).read_metadata().state_dict_metadata
    out = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.items() if hasattr(m, "size")}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(out, checkpoint_id=path, no_dist=True)
    return out


def convert_entries(tensors: dict[str, torch.Tensor], layout: dict, structure: dict, where: str) -> list[Entry]:
    """The format-2 entries of the format-1 ``tensors`` of a checkpoint with ``layout``
    (``structure``: name → ((partition dim, stride), full shape or None), from the model code)."""
    T, D, P, G = (int(layout[k]) for k in ("tensor", "data", "pipeline", "groups"))

    def like(key: str, name: str, shard_shape) -> SimpleNamespace:
        if name not in structure:
            raise CheckpointError(f"{where}: {key!r}: no parameter {name!r} in the run's model (another config?)")
        (dim, stride), full = structure[name]
        sharded = dim is not None and T > 1 and (full is None or tuple(full) != tuple(shard_shape))
        return SimpleNamespace(shape=tuple(shard_shape), partition_dim=dim, partition_stride=stride,
                               tensor_parallel=sharded)

    def group(m) -> int | None:
        return int(m["g"]) if G > 1 else None

    out: list[Entry] = []
    for key, t in tensors.items():
        if m := _MODEL.match(key):
            out += entries_of(param_key(m["name"], group(m)), t, like(key, m["name"], t.shape), int(m["t"]), T)
        elif m := _OPTIM.match(key):
            okey = optim_key(m["opt"], m["moment"], param_key(m["name"], group(m)))
            model = f"model/g{m['g']}/tp{m['t']}/pp{m['p']}/c{m['c']}/{m['name']}"
            if t.dim() == 0:
                out.append(whole(okey, t))
                continue
            shard = tensors[model].shape if model in tensors else t.shape
            flat = None if m["start"] is None else (int(m["start"]), int(m["end"]))
            out += entries_of(okey, t.reshape(-1) if flat else t, like(key, m["name"], shard), int(m["t"]), T, flat)
        elif m := _KNOWN.match(key):  # per (tp, pp) position -> a column per rank of the group
            n = T * D * P
            for d in range(D):
                col = int(m["t"]) + T * (d + D * int(m["p"]))
                out.append(Entry(outer_key(m["cat"], "eager_known", group=int(m["g"])), t.view(-1, 1).clone(),
                                 (t.numel(), n), (0, col)))
        elif m := _OUTER.match(key):
            g = None if m["g"] is None else int(m["g"])
            out += entries_of(outer_key(m["cat"], m["kind"], m["name"], group=g), t, like(key, m["name"], t.shape),
                              int(m["t"]), T)
        elif _COUNTER.match(key):
            out.append(whole(key, t))
        else:
            raise CheckpointError(f"{where}: key {key!r} is not a format-1 key this tool knows")
    return out


def convert(run_dir: str, step: int | None = None, config: str | None = None) -> str:
    """Convert step ``step`` (None: ``latest``) of ``run_dir`` to format 2; returns its path."""
    from dept_mega.config import load_config
    from dept_mega.export.checkpoint_reader import _structure
    from dept_mega.manifest import local_problem
    from dept_mega.resume import latest_step, step_dir
    if step is None:
        step = latest_step(run_dir)
        if step is None:
            raise CheckpointError(f"{run_dir}: no checkpoints/latest (no checkpoint to convert)")
    path = step_dir(run_dir, step)
    problem = local_problem(path)
    if problem:
        raise CheckpointError(f"checkpoint {path} is not usable: {problem}")
    fmt = read_manifest(path)["format"]
    if fmt != 1:
        raise CheckpointError(f"checkpoint {path} is in format {fmt}, not 1: nothing to convert")
    cfg = load_config(config or os.path.join(run_dir, "config.yaml"))
    entries = convert_entries(_read_all(path), read_json(path, LAYOUT_FILE), _structure(cfg), path)
    tmp, old = path + ".convert.tmp", path + ".format1"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_entries(entries, tmp)
    data = set(os.listdir(tmp))
    for name in os.listdir(path):  # layout, positions, hook state, dropout streams: unchanged
        if name != "manifest.json" and not name.endswith(".distcp") and name != ".metadata" and name not in data:
            shutil.copy2(os.path.join(path, name), os.path.join(tmp, name))
    seal(tmp, step)
    problem = local_problem(tmp)
    if problem:
        raise CheckpointError(f"the converted checkpoint {tmp} does not verify: {problem}")
    if os.path.exists(old):
        raise CheckpointError(f"{old} exists (an earlier conversion's backup): move it away first")
    os.replace(path, old)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--step", type=int, default=None, help="default: the run's latest checkpoint")
    ap.add_argument("--config", default=None, help="the run's config (default: RUN/config.yaml)")
    args = ap.parse_args(argv)
    try:
        path = convert(args.run_dir, args.step, args.config)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"converted {path} to checkpoint format 2 (format 1 kept as {path}.format1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
