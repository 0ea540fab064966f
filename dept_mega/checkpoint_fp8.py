"""The FP8 scaling state in checkpoints (native FP8 with ``fp8_recipe: delayed``, ``parallel/fp8.py``).

Delayed scaling scales each step's casts from the amaxes of the previous ``fp8_amax_history``
steps. Those amaxes are per rank (never reduced across ranks: each rank scales its own shards
and its own micro-batches), so unlike the model's tensors they have no global shape and no box
in checkpoint format 2: every rank writes its :class:`~dept_mega.parallel.fp8.Fp8State`
(:meth:`~dept_mega.parallel.fp8.Fp8State.state_dict`: the amax history, the step's scales,
the ring position, the operands with an amax recorded) and the module names of its FP8 layers
to ``step_N/fp8_tp{t}_dp{d}_pp{p}_g{g}.pt``, and ``layout.json`` says ``"fp8_state": true``
(the manifest then expects one such file per rank).

A resume (:func:`dept_mega.checkpoint.load_weights` with the optimizer state) restores it
exactly when the checkpoint was written under this launch's layout (tensor, pipeline, virtual
pipeline, data-parallel sizes and number of source groups), for the same FP8 layers on every
rank, with the same format and ``fp8_amax_history``: the resumed run then scales every step as
the uninterrupted run would have. Otherwise nothing is guessed (amaxes seen by other shards or
other micro-batches do not map onto this rank's): every rank starts with an empty history, as
a run's first step does (current scaling, then delayed), and one line for the launch's log says
why. Every rank takes the same decision (the first problem in rank order)."""
from __future__ import annotations

import os
from typing import Optional

from .checkpoint_layout import _safe_load
from .manifest import FP8_FILE, CheckpointError
from .parallel.agree import first_problem, mark_agreed
from .parallel.fp8 import Fp8Layer, Fp8State

FLAG = "fp8_state"  # layout.json: every rank wrote its FP8 state
_LAYOUT = (("tensor", "parallel.tensor"), ("pipeline", "parallel.pipeline"),
           ("virtual_pipeline", "parallel.virtual_pipeline"), ("data", "parallel.data"), ("groups", "source groups"))


def fp8_file(pg) -> str:
    """This rank's file in a step directory."""
    return FP8_FILE.format(t=pg.tp_rank, d=pg.dp_rank, p=pg.pp_rank, g=pg.group_index)


def delayed_state(trainer) -> Optional[Fp8State]:
    """The FP8 state of the rank's model (one for all its chunks) when it runs native FP8 with
    delayed scaling, else None. The same answer on every rank (it follows from the config),
    also on a rank whose chunks hold no FP8 layer (its state has no layers)."""
    states = {id(s): s for st in trainer.stages
              for s in [getattr(getattr(st, "body", None), "fp8_state", None)] if s is not None}
    if len(states) > 1:
        raise RuntimeError(f"the model chunks of this rank hold {len(states)} FP8 states; build_model makes one")
    state = next(iter(states.values()), None)
    return state if state is not None and state.delayed else None


def _layer_names(trainer, state: Fp8State) -> list[str]:
    """The module of each FP8 layer of ``state``, by its index (``c{chunk}.{module name}``,
    the name holding the global layer id): what the history's columns belong to."""
    names = [""] * len(state.layers)
    for c, st in enumerate(trainer.stages):
        for name, m in st.named_modules():
            layer = getattr(m, "fp8_layer", None)
            if isinstance(layer, Fp8Layer) and layer.state is state:
                names[layer.index] = f"c{c}.{name}"
    return names


def stage_fp8(trainer) -> Optional[dict]:
    """What a save writes to :func:`fp8_file` (host copies), or None without delayed scaling."""
    state = delayed_state(trainer)
    if state is None:
        return None
    return {**state.state_dict(), "names": _layer_names(trainer, state)}


def _problem(trainer, state: Fp8State, path: str, layout: dict, now: dict) -> tuple[Optional[str], Optional[dict]]:
    """(why checkpoint ``path`` cannot give this rank its FP8 state, or None; the saved state)."""
    if not layout.get(FLAG):
        return (f"checkpoint {path} holds no FP8 scaling state (written without fp8_recipe: delayed, or by a "
                f"dept_mega that did not save it)"), None
    changed = [f"{name}={layout.get(key)} (this launch: {now[key]})" for key, name in _LAYOUT
               if layout.get(key) != now[key]]
    if changed:
        return (f"checkpoint {path} was saved under another layout, {', '.join(changed)}; per-rank amaxes "
                f"do not map onto other shards"), None
    file = os.path.join(path, fp8_file(trainer.pg))
    saved = _safe_load(file, "cpu")
    if not isinstance(saved, dict):
        raise CheckpointError(f"{file}: not an FP8 state (a dict)")
    recipe = state.recipe
    if (saved.get("fmt"), saved.get("amax_history")) != (recipe.fmt, recipe.amax_history):
        return (f"checkpoint {path} was saved with fp8={saved.get('fmt')}, fp8_amax_history="
                f"{saved.get('amax_history')} (this launch: {recipe.fmt}, {recipe.amax_history})"), None
    if saved.get("names") != _layer_names(trainer, state):
        return (f"checkpoint {path}: {file} holds the amaxes of other FP8 layers than this rank runs "
                f"(fp8_first_last_layers_bf16 changed?)"), None
    return None, saved


def restore_fp8(trainer, path: str, layout: dict, now: dict, notes: Optional[list]) -> None:
    """Restore this rank's FP8 state from checkpoint ``path`` (``layout``: its layout.json;
    ``now``: this launch's layout), or start every rank's with an empty history and append one
    line to ``notes`` saying why; a damaged or foreign file is a :class:`CheckpointError` on
    every rank. Collective (one small gather) when the model runs delayed scaling; nothing
    otherwise."""
    state = delayed_state(trainer)
    if state is None:
        return
    file = os.path.join(path, fp8_file(trainer.pg))
    try:
        problem, saved = _problem(trainer, state, path, layout, now)
        text = "" if problem is None else "note:" + problem
        if saved is not None:
            state.load_state_dict(saved)
    except CheckpointError as exc:
        text = f"error:{exc}"
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        text = f"error:{file}: unexpected content ({type(exc).__name__}: {exc})"
    first = first_problem(text, trainer.device)
    if first is None:
        return
    state.load_state_dict({"fmt": state.recipe.fmt, "amax_history": state.recipe.amax_history,
                           "layers": len(state.layers)})  # empty: as before a run's first step
    kind, _, what = first.partition(":")
    if kind == "error":
        raise mark_agreed(CheckpointError(what))
    line = f"fp8: amax history not restored: {what}; the first step uses current scaling"
    if notes is not None and line not in notes:
        notes.append(line)
