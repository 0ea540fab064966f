"""Convert a checkpoint of format 1 (keys by rank position) to format 2 (boxes of global tensors).

    python tools/convert_checkpoint.py RUN/checkpoints/step_N [--output DIR] [--config RUN/config.yaml]
    python tools/convert_checkpoint.py --run-dir RUN [--step S] [--output DIR] [--config RUN/config.yaml]

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
from the run's config. DEPT's per-rank hook files (``hooks_rank{r}.pt``) become format 2's
entries (:func:`convert_hooks`): each stored source's embeddings and optimizer states under
``source/{name}/...`` (joined by the parameter names saved with them), TRIM's tables as row
boxes and its learned positions' outer state, and each group's round position in
``group{g}.json`` (``dept``); the installed source's state is the model's. Hook state this tool
cannot place (optimizer states saved without parameter names, outer buffers kept in the hook
files by older releases) is an error: resume such a checkpoint once with its own layout
instead (its next checkpoint is format 2). The other files (layout, data positions, dropout
streams) are copied unchanged. Integrity: the new step is written as ``step_S.convert.tmp``
with a manifest of checksums, then the old directory is renamed ``step_S.format1`` (kept:
delete it once the run resumed) and the new one renamed to ``step_S``; ``latest`` is not
touched (it names the step, which keeps its number). An existing ``step_S.format1`` (an
earlier conversion's backup) is refused before anything is written. With ``--output DIR`` the
checkpoint is left as it is and the format-2 copy written to DIR (a new directory), through
``DIR.convert.tmp``. The temporary directory is removed on any failure; errors are one
``error:`` line, exit status 2.
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
                                         save_entries, source_key, trim_key, whole)
from dept_mega.manifest import (LAYOUT_FILE, CheckpointError, fsync_dir, read_json, read_manifest,  # noqa: E402
                                seal, write_json_durable)

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


def _like(layout: dict, structure: dict, where: str):
    """``like(key, name, shard shape)``: a stand-in for parameter ``name``'s tensor-parallel
    split (``checkpoint_format.entries_of``), from the model code's ``structure``."""
    T = int(layout["tensor"])

    def like(key: str, name: str, shard_shape) -> SimpleNamespace:
        if name not in structure:
            raise CheckpointError(f"{where}: {key!r}: no parameter {name!r} in the run's model (another config?)")
        (dim, stride), full = structure[name]
        sharded = dim is not None and T > 1 and (full is None or tuple(full) != tuple(shard_shape))
        return SimpleNamespace(shape=tuple(shard_shape), partition_dim=dim, partition_stride=stride,
                               tensor_parallel=sharded)

    return like


def convert_entries(tensors: dict[str, torch.Tensor], layout: dict, structure: dict, where: str) -> list[Entry]:
    """The format-2 entries of the format-1 ``tensors`` of a checkpoint with ``layout``
    (``structure``: name → ((partition dim, stride), full shape or None), from the model code)."""
    T, D, P, G = (int(layout[k]) for k in ("tensor", "data", "pipeline", "groups"))
    like = _like(layout, structure, where)

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


def _hook_error(where: str, what: str) -> CheckpointError:
    return CheckpointError(f"{where}: {what}, which this tool does not convert; resume the checkpoint once with "
                           f"its own layout instead (its next checkpoint is format 2)")


def _optim_entries(key_of, kind: str, sd: dict, names: dict, like, shapes: dict, t: int, T: int,
                   where: str) -> list[Entry]:
    """One saved optimizer state dict (plain, or a distributed optimizer's pieces: ``shard``)
    as entries, its tensors found by the parameter names saved with it (``names``: ``state``
    per state index, ``params`` per ``main_params`` entry)."""
    out: list[Entry] = []
    pieces = {}
    if "shard" in sd:
        for (_, a, b), n in zip(sd["shard"]["pieces"], names["params"]):
            pieces[n] = (int(a), int(b))

    def add(moment: str, name: str, v: torch.Tensor) -> None:
        key = key_of(optim_key(kind, moment, param_key(name, None)))
        if v.dim() == 0:
            out.append(whole(key, v))
            return
        flat = pieces.get(name) if "shard" in sd else None
        if "shard" in sd and flat is None:
            raise _hook_error(where, f"a {kind} optimizer piece of {name!r} without its range")
        out.extend(entries_of(key, v.reshape(-1) if flat else v, like(key, name, shapes[name]), t, T, flat))

    for i, st in sd.get("state", {}).items():
        for moment, v in st.items():
            if torch.is_tensor(v):
                add(moment, names["state"][int(i)], v)
    for n, v in zip(names["params"], sd.get("main_params") or []):
        add("main_param", n, v)
    return out


def convert_hooks(path: str, layout: dict, structure: dict, like) -> tuple[list[Entry], dict[int, dict]]:
    """Format-1 hook files as format-2 entries and each group's round position (module doc)."""
    from dept_mega.dept.outer import join_flat_sync_chunks
    from dept_mega.parallel.groups import rank_of
    T, D, P, G = (int(layout[k]) for k in ("tensor", "data", "pipeline", "groups"))
    dp0 = bool(layout.get("hooks_dp0"))
    body = {n: tuple(s[d] // T if d is not None and T > 1 and i == d else s[i] for i in range(len(s)))
            for n, ((d, _), s) in structure.items() if s is not None}
    out: list[Entry] = []
    metas: dict[int, dict] = {}
    for g in range(G):
        files = {}
        for p in range(P):
            for d in range(1 if dp0 else D):
                for t in range(T):
                    f = os.path.join(path, f"hooks_rank{rank_of(t, d, p, g, T, D, P)}.pt")
                    files[(t, d, p)] = (f, torch.load(f, map_location="cpu", weights_only=True))
        first = files[(0, 0, 0)][1]
        store = {}
        for (t, d, p), (f, sd) in files.items():
            for old in ("body_sync", "outer_residuals", "outer_eager"):
                if sd.get(old):
                    raise _hook_error(f, f"its {old!r} (outer state kept in the hook files)")
            for name, payload in sd["store"].items():
                shapes = dict(body)
                for emb in payload["embeddings"]:
                    for n, v in (emb or {}).items():
                        shapes[f"embeddings.{n}"] = tuple(v.shape)
                        key = source_key(name, param_key(f"embeddings.{n}", None))
                        out += entries_of(key, v, like(key, f"embeddings.{n}", v.shape), t, T)
                flags = store.setdefault(name, {"optimizer": False, "body_optimizer": False})
                for kind, opt in (("emb", payload.get("optimizer")), ("body", payload.get("body_optimizer"))):
                    if opt is None:
                        continue
                    names = (payload.get("param_names") or {}).get("optimizer" if kind == "emb" else "body_optimizer")
                    if names is None:
                        raise _hook_error(f, f"source {name!r}: a {kind} optimizer state without parameter names")
                    out += _optim_entries(lambda k, n=name: source_key(n, k), kind, opt, names, like, shapes, t, T, f)
                    moments = any(opt.get("state", {}).values())
                    flags["optimizer" if kind == "emb" else "body_optimizer"] |= moments or kind == "body"
            for table in ("phi", "phi_head"):
                if table in sd:
                    start, _, V = (int(x) for x in sd.get(f"{table}_rows") or (0, 0, sd[table].shape[0]))
                    row_state = (sd.get(f"{table}_optimizer") or {}).get("state", {})
                    for state, v in [(None, sd[table])] + sorted(row_state.items()):
                        out.append(Entry(trim_key(table, state), v, (V,) + tuple(v.shape[1:]),
                                         (start,) + (0,) * (v.dim() - 1)))
            if "positions" in sd:
                out.append(whole(trim_key("positions"), sd["positions"]))
        syncs = [files[(0, d, p)][1] for p in range(P) for d in range(1 if dp0 else D)
                 if "position_sync" in files[(0, d, p)][1]]
        if syncs:
            full = join_flat_sync_chunks([x["position_sync"] for x in syncs])
            if "eager_base" in full:
                raise _hook_error(path, "TRIM positions' eager estimates")
            shape = tuple(syncs[0]["positions"].shape)
            out.append(whole(outer_key("trim_positions", "steps"), torch.tensor(int(full["optimizer"]["steps"]))))
            if full["optimizer"].get("part_steps"):
                out.append(whole(outer_key("trim_positions", "part_steps"),
                                 torch.tensor([int(c) for c in full["optimizer"]["part_steps"]])))
            for kind, v in [("reference", full["theta_prev"])] + sorted(full["optimizer"]["state"].items()):
                out.append(whole(outer_key("trim_positions", kind, "positions"), v.view(shape)))
            if "residual" in full:
                out.append(whole(outer_key("trim_positions", "residual", "positions", group=g),
                                 full["residual"].view(shape)))
        metas[g] = {"round": first.get("round"), "in_round": bool(first.get("in_round", False)),
                    "installed": first.get("installed"), "store": store}
    return out, metas


def convert(run_dir: str, step: int | None = None, config: str | None = None, output: str | None = None) -> str:
    """Convert step ``step`` (None: ``latest``) of ``run_dir`` to format 2, in place or (``output``)
    as a new directory; returns the path of the format-2 checkpoint."""
    from dept_mega.config import load_config
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
    tmp, old = (output or path).rstrip(os.sep) + ".convert.tmp", path + ".format1"
    if output is not None and os.path.lexists(output):
        raise CheckpointError(f"--output {output} exists: give a new directory")
    if output is None and os.path.lexists(old):
        raise CheckpointError(f"{old} exists (an earlier conversion's backup): move it away first")
    cfg = load_config(config or os.path.join(run_dir, "config.yaml"))
    try:
        _write_converted(path, step, cfg, tmp)
        if output is None:
            os.replace(path, old)
            os.replace(tmp, path)
        else:
            os.replace(tmp, output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    done = output or path
    fsync_dir(os.path.dirname(os.path.abspath(done)))
    return done


def _write_converted(path: str, step: int, cfg, tmp: str) -> None:
    """Checkpoint ``path`` (format 1) written in format 2 to ``tmp``, sealed and verified."""
    from dept_mega.export.checkpoint_reader import _structure
    from dept_mega.manifest import local_problem
    from dept_mega.variant import variant_of
    layout = read_json(path, LAYOUT_FILE)
    structure = _structure(cfg)
    entries = convert_entries(_read_all(path), layout, structure, path)
    metas: dict[int, dict] = {}
    if layout.get("per_rank_hooks") and variant_of(cfg).rounds:
        more, metas = convert_hooks(path, layout, structure, _like(layout, structure, path))
        entries += more
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_entries(entries, tmp)
    data = set(os.listdir(tmp))
    for name in os.listdir(path):  # layout, positions, dropout streams: unchanged (hook files: converted)
        if name != "manifest.json" and not name.endswith(".distcp") and name != ".metadata" and name not in data \
                and not name.startswith("hooks_rank"):
            shutil.copy2(os.path.join(path, name), os.path.join(tmp, name))
    if layout.get("per_rank_hooks"):
        fixed = {k: v for k, v in layout.items() if k not in ("per_rank_hooks", "hooks_dp0", "hooks_param_names")}
        write_json_durable(os.path.join(tmp, LAYOUT_FILE), fixed)
    for g, meta in metas.items():
        group = read_json(tmp, f"group{g}.json")
        write_json_durable(os.path.join(tmp, f"group{g}.json"), dict(group, dept=meta))
    seal(tmp, step)
    problem = local_problem(tmp)
    if problem:
        raise CheckpointError(f"the converted checkpoint {tmp} does not verify: {problem}")


def _from_step_dir(step_path: str) -> tuple[str, int]:
    """(run directory, step) of ``RUN/checkpoints/step_N``."""
    from dept_mega.resume import run_and_step
    found = run_and_step(os.path.abspath(step_path))
    if found is None:
        raise CheckpointError(f"{step_path} is not a checkpoint directory RUN/checkpoints/step_N")
    if not os.path.isdir(step_path):
        raise CheckpointError(f"checkpoint {step_path} does not exist")
    return found


def main(argv=None) -> int:
    from dept_mega.config import ConfigError
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("step_dir", nargs="?", default=None, help="the checkpoint to convert, RUN/checkpoints/step_N")
    ap.add_argument("--run-dir", default=None, help="the run (instead of STEP_DIR; with --step)")
    ap.add_argument("--step", type=int, default=None, help="with --run-dir (default: the run's latest checkpoint)")
    ap.add_argument("--output", default=None, help="write the format-2 copy to this new directory (default: in place, "
                                                   "the original kept as step_N.format1)")
    ap.add_argument("--config", default=None, help="the run's config (default: RUN/config.yaml)")
    args = ap.parse_args(argv)
    if (args.step_dir is None) == (args.run_dir is None):
        ap.error("give the checkpoint directory RUN/checkpoints/step_N or --run-dir RUN (not both)")
    if args.step_dir is not None and args.step is not None:
        ap.error("--step goes with --run-dir (STEP_DIR names the step)")
    try:
        run_dir, step = _from_step_dir(args.step_dir) if args.step_dir is not None else (args.run_dir, args.step)
        path = convert(run_dir, step, args.config, args.output)
    except (CheckpointError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.output:
        print(f"converted the checkpoint to format 2 at {path} (the original left as it is)")
    else:
        print(f"converted {path} to checkpoint format 2 (format 1 kept as {path}.format1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
