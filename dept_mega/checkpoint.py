"""Checkpoints: ``RUN/checkpoints/step_N/`` with torch.distributed.checkpoint, atomically.

Checkpoint format 2 (``dept_mega.checkpoint_format``; docs/architecture.md): every owner of
state declares boxes of global tensors under keys of global names — the model and the inner
optimizers (``dept_mega.checkpoint_state.model_entries``), each outer synchronisation's state
and per-group buffers (``outer_entries``, ``group_entries``), the DEPT round driver's stored
sources and TRIM's tables (``DeptHooks.checkpoint_entries``) — and DCP writes each box once,
whatever the layout. Loading builds this launch's entries, applies DEPT's load plan (the
identity, or under another number of groups :func:`_regroup_plan` and
``DeptHooks.checkpoint_targets``) and makes one read, so any tensor, pipeline, data-parallel
or distributed-optimizer layout loads any other (:func:`check_layout` refuses only another
number of groups inside a round). The step directory is first written as ``step_N.tmp``,
then renamed by global rank 0 after a barrier, and ``RUN/checkpoints/latest`` (text: N) is
replaced atomically, so ``latest`` always names a complete checkpoint. Scalars (trainer
counters, data positions, loss scale, DEPT's round position) go to ``step_N/group{g}.json``,
one per source group. ``step_N/layout.json`` records the layout. Native FP8 with delayed
scaling: each rank's amax history goes to ``step_N/fp8_tp{t}_dp{d}_pp{p}_g{g}.pt``, restored
under the same layout and recipe only (``dept_mega.checkpoint_fp8``; else an empty history and a
line in ``notes``). The dropout streams
(``RNGTracker``) go to ``step_N/rng_tp{t}_pp{p}.pt``; under another tensor / pipeline /
virtual-pipeline layout they are re-seeded from (seed, step, tensor rank, pipeline rank)
instead (logged through ``notes``). Format 1 (``dept_mega.checkpoint_v1``) loads with its own
layout only; ``tools/convert_checkpoint.py`` converts it.

Integrity (``dept_mega.manifest``, ``dept_mega.checkpoint_seal``, ``dept_mega.resume``): every file is fsynced, then hashed
(the ranks share the work) into ``step_N/manifest.json``, written last, before the rename; the
directories and ``latest`` are fsynced after their renames. ``step_N/depends.json`` records
the config values, tokenizers and data the checkpoint depends on; ``step_N/config.yaml`` the
resolved config of the launch that wrote it. Loading verifies the manifest
(a damaged newest checkpoint makes :meth:`Checkpointer.load` fall back to the newest verified
one before it), then the layout and ``depends.json`` (a ConfigError naming the key), and reads
the per-rank files with ``torch.load(weights_only=True)``. DCP's own ``.metadata`` is a
pickle: a checkpoint from an untrusted source is never safe to load.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist

from .manifest import (DEPENDS_FILE, LAYOUT_FILE, CheckpointError, fsync_dir, fsync_file, read_json, read_manifest,
                       replace_durable, write_durable, write_json_durable)
from .run_configs import CONFIG_FILE, config_text
from .checkpoint_format import Entry, load_entries, save_entries, shared_params, with_group
from .checkpoint_state import (group_entries, group_targets, has_group_state, has_outer_state, model_entries,
                               outer_entries, outer_targets, unused_group_buffers)
from .checkpoint_fp8 import FLAG as FP8_FLAG, fp8_file, restore_fp8, stage_fp8
from .checkpoint_space import CheckpointSpaceError, gather_texts, no_space, state_sizes
from .checkpoint_seal import SealError, seal
from .checkpoint_retention import apply_retention, dir_bytes  # noqa: F401 - re-exported
from .checkpoint_layout import (  # noqa: F401 - check_layout is re-exported
    _layout, _rng_tracker, _rng_file, check_layout, _uncounted, _safe_load)
from .parallel.agree import agree_errors, mark_agreed
from .config_diff import check_differing
from .resume import (CKPT_DIR, check_depends, depends_differences, fingerprint, latest_step, select_checkpoint, step_dir,  # noqa: F401
                     verify_checkpoint)


def _barrier(group=None) -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier(group=group)


def _to_host(obj: Any) -> Any:
    """A copy of ``obj`` whose tensors are host copies (containers rebuilt, values kept)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(v) for v in obj)
    return obj


def _ensure_optimizer_state(trainer) -> None:
    """Create AdamW state tensors (zeros, ``step`` on the device where the AdamW kernel keeps
    it: the parameter's for fused AdamW) so DCP can load into them in place."""
    for opt in trainer.optimizers:
        opt.ensure_state()


class Checkpointer:
    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.last_size: Optional[int] = None  # bytes of the last checkpoint saved (rank 0)
        self.last_removed: list[int] = []  # steps removed by retention after the last save (rank 0)
        self.last_seconds: Optional[float] = None
        # on_saved(step, bytes, removed steps, seconds): called on global rank 0 once a save is
        # complete (from the writer thread under train.async_save)
        self.on_saved = None
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._group = None  # train.async_save: the writer thread's process group
        # the last load: one line per checkpoint passed over, and per piece of state it changed
        # rather than restored (load_weights' notes); the launch logs them
        self.notes: list[str] = []
        self._tokenizer_digests: dict = {}
        self._opened: Optional[dict] = None  # the tokenizers' and data's identity as this launch read them

    def depends(self, cfg) -> dict:
        """``depends.json``'s content: the config values, and the tokenizers' and data's identity
        as this launch first read them (at its :meth:`load`): files replaced while it runs are not
        what its data positions index, so a later save must not record them."""
        now = fingerprint(cfg, self._tokenizer_digests)
        if self._opened is None:
            self._opened = {k: now[k] for k in ("tokenizers", "data")}
        return {**now, **self._opened}

    def save(self, loop) -> str:
        """Write checkpoint ``step_N`` of the loop's current step. With ``train.async_save`` the
        state is copied to host memory here and written by a background thread (at most one
        save in flight: this first waits for the previous one); otherwise written here."""
        self.wait()
        trainer = loop.trainer
        asynchronous = bool(getattr(trainer.cfg.train, "async_save", False))
        staged = self._stage(loop, copy=asynchronous)
        if not asynchronous:
            self._write(staged, group=None)
            return staged["final"]
        if self._group is None and dist.is_initialized() and dist.get_world_size() > 1:
            # the writer thread's collectives (DCP's plan exchange, the manifest, barriers) run
            # on a group of their own: never interleaved with the training thread's collectives
            self._group = dist.new_group(backend="gloo")
        self._thread = threading.Thread(target=self._write_in_thread, args=(staged,), name="dept-checkpoint",
                                        daemon=True)
        self._thread.start()
        return staged["final"]

    def wait(self) -> None:
        """Wait for a save in flight; its error (if any) is raised here."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if isinstance(error, CheckpointSpaceError):
            raise error
        if error is not None:
            raise RuntimeError(f"asynchronous checkpoint save failed: {error}") from error

    def _write_in_thread(self, staged: dict) -> None:
        try:
            self._write(staged, group=self._group)
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread by wait()
            self._error = exc

    def _stage(self, loop, copy: bool) -> dict:
        """Everything a save writes, gathered on the training thread (collectives included:
        the DEPT outer state's gather over dp). ``copy``: tensors are copied to host memory, so
        training may change the originals while a thread writes them."""
        trainer = loop.trainer
        step = trainer.step
        final = step_dir(self.run_dir, step)
        layout = _layout(trainer)
        hooks = loop.hooks
        if has_outer_state(hooks):
            layout["outer_keys"] = True  # DEPT outer state under dept/... keys (checkpoint_state)
        schedule = getattr(hooks, "schedule_state", lambda: None)()
        if schedule is not None:  # DEPT after a change of the number of groups: where the plans restart
            layout["dept_schedule"] = schedule
        # checkpoint format 2: global keys and boxes (checkpoint_state); what every group holds the
        # same now (a round boundary) under group-free keys, written once
        same = frozenset(getattr(hooks, "group_replicated_params", frozenset)())
        state = model_entries(trainer, replicated=same if trainer.pg.num_groups > 1 else frozenset())
        with _uncounted(hooks):
            if layout.get("outer_keys"):
                state += outer_entries(hooks, trainer)
            if has_group_state(hooks):
                # error-feedback residuals, eager estimates: per parameter, keyed by group (checkpoint_state)
                layout["outer_group_keys"] = True
                state += group_entries(hooks, trainer)
        dept = None
        if hasattr(hooks, "checkpoint_entries"):  # DEPT: the stored sources, TRIM's tables (dept.hook_state)
            dept = hooks.checkpoint_meta()
            state += hooks.checkpoint_entries()
        pg = trainer.pg
        tracker = _rng_tracker(trainer)
        fp8 = stage_fp8(trainer)  # native FP8, delayed scaling: this rank's amax history (checkpoint_fp8)
        if fp8 is not None:
            layout[FP8_FLAG] = True
        out = {"step": step, "final": final, "layout": layout, "state": state, "device": trainer.device,
               "depends": self.depends(trainer.cfg),
               "config": config_text(trainer.cfg),
               "keep": int(trainer.cfg.train.keep_checkpoints),
               "rng": tracker.state_dict() if tracker is not None and pg.dp_rank == 0 and pg.group_index == 0
               else None, "rng_file": _rng_file(pg), "group": pg.group_index, "meta": None,
               "fp8": fp8, "fp8_file": fp8_file(pg)}
        if pg.rank == pg.rank_of(0, 0, 0, pg.group_index):
            # positions are the same on every rank of a group, different across groups (DEPT)
            out["meta"] = {"step": step, "trainer": trainer.state_dict(),
                           "iterators": {n: it.state_dict() for n, it in loop.iterators.items()
                                         if hasattr(it, "state_dict")}}
            if dept is not None:
                out["meta"]["dept"] = dept
        if copy:
            out["state"] = [Entry(e.key, _to_host(e.tensor), e.shape, e.offset) for e in out["state"]]
            out["rng"] = _to_host(out["rng"])
            out["meta"] = json.loads(json.dumps(out["meta"]))
            if trainer.device.type == "cuda":
                torch.cuda.synchronize(trainer.device)
        return out

    def _write(self, staged: dict, group) -> None:
        """Write a staged checkpoint: ``step_N.tmp``, manifest, rename, ``latest``, retention.
        Collective over ``group`` (None: the world). A file system that runs out of space on
        any rank fails the save on every rank with :class:`CheckpointSpaceError` (the partial
        ``step_N.tmp`` removed, ``latest`` untouched)."""
        t0 = time.time()
        step, final, layout = staged["step"], staged["final"], staged["layout"]
        tmp = final + ".tmp"
        rank = dist.get_rank() if dist.is_initialized() else 0
        device = None if group is not None else staged["device"]
        failed: Optional[BaseException] = None
        try:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp, exist_ok=True)
                write_json_durable(os.path.join(tmp, LAYOUT_FILE), layout)
                write_json_durable(os.path.join(tmp, DEPENDS_FILE), staged["depends"])
                write_durable(os.path.join(tmp, CONFIG_FILE), staged["config"].encode("utf-8"))
        except OSError as exc:
            failed = exc
        _barrier(group)
        try:  # every rank reaches DCP's collectives whatever failed before; DCP agrees on its own failures
            metadata = save_entries(staged["state"], tmp, process_group=group)
            if failed is None and staged["rng"] is not None:
                torch.save(staged["rng"], os.path.join(tmp, staged["rng_file"]))
                fsync_file(os.path.join(tmp, staged["rng_file"]))
            if failed is None and staged["fp8"] is not None:
                torch.save(staged["fp8"], os.path.join(tmp, staged["fp8_file"]))
                fsync_file(os.path.join(tmp, staged["fp8_file"]))
            if failed is None and staged["meta"] is not None:
                write_json_durable(os.path.join(tmp, f"group{staged['group']}.json"), staged["meta"])
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            failed = failed or exc
        self._agree_on_failure(failed, staged, tmp, group, device)
        renamed = False  # rank 0: step_N is in place (a failure after it is the write of ``latest``)
        try:
            seal(tmp, step, layout, metadata, device, group)  # the same SealError on every rank
            if rank == 0:
                shutil.rmtree(final, ignore_errors=True)
                os.replace(tmp, final)
                renamed = True
                fsync_dir(os.path.dirname(final))
                replace_durable(os.path.join(self.run_dir, CKPT_DIR, "latest"), f"{step}\n".encode())
        except (OSError, SealError) as exc:
            failed = exc
        self._agree_on_failure(failed, staged, tmp, group, device, renamed=renamed)
        after: Optional[BaseException] = None
        if rank == 0:  # what follows a complete save: its size, retention, the log line
            try:
                self.last_size = dir_bytes(final)
                self.last_removed = apply_retention(self.run_dir, staged["keep"], step)
                self.last_seconds = time.time() - t0
                if self.on_saved is not None:
                    self.on_saved(step, self.last_size, self.last_removed, self.last_seconds)
            except Exception as exc:  # noqa: BLE001 - raised below, on every rank
                after = exc
        # a gather, not a barrier: a failure on rank 0 alone stops every rank now (the others
        # would wait at a barrier until its timeout)
        texts = gather_texts(f"{type(after).__name__}: {after}" if after is not None else "", group, device)
        if after is not None:
            raise after
        if texts[0]:
            raise RuntimeError(f"checkpoint step_{step} was saved, then rank 0 failed: {texts[0]}")

    def _agree_on_failure(self, failed: Optional[BaseException], staged: dict, tmp: str, group, device,
                          renamed: bool = False) -> None:
        """Collective: raise on every rank when the save failed on any. Out of space: the
        partial ``tmp`` is removed and :class:`CheckpointSpaceError` says what is needed and left;
        ``renamed`` (rank 0: ``step_N`` was in place when ``latest`` could not be written): that
        the checkpoint is complete and which one a resume takes."""
        full = "ENOSPC (latest)" if renamed else "ENOSPC"
        texts = gather_texts(full if no_space(failed) else (repr(failed) if failed else ""), group, device)
        problems = [(r, t) for r, t in enumerate(texts) if t]
        if not problems:
            return
        if any(t == "ENOSPC (latest)" for _, t in problems):
            if renamed:
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(self.run_dir, CKPT_DIR, "latest.tmp"))
            raise CheckpointSpaceError(self.run_dir, staged["step"], 0, written=True)
        if any(t == "ENOSPC" for _, t in problems):
            sizes: dict[str, int] = {}
            for text in gather_texts(json.dumps(state_sizes(staged)), group, device):
                sizes.update(json.loads(text))
            _barrier(group)
            rank = dist.get_rank() if dist.is_initialized() else 0
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            _barrier(group)
            raise CheckpointSpaceError(self.run_dir, staged["step"], sum(sizes.values()))
        if failed is not None:
            raise failed
        rank, text = problems[0]
        raise RuntimeError(f"checkpoint save {tmp} failed on rank {rank}: {text}")

    def load(self, loop, step: Optional[int] = None) -> Optional[int]:
        """Load ``step`` (default: the newest complete, verified checkpoint, normally ``latest``;
        the ones passed over are in ``self.notes``) into the loop's trainer and iterators;
        returns the step loaded or None when there is no checkpoint."""
        self.wait()
        self.depends(loop.trainer.cfg)  # the files as this launch opens them (what its saves record)
        sel = select_checkpoint(self.run_dir, loop.trainer.device, step)
        self.notes = sel.notes
        if sel.step is None:
            return None
        step = sel.step
        load_weights(loop.trainer, self.run_dir, step, hooks=loop.hooks, verified=True,
                     tokenizer_digests=self._tokenizer_digests, notes=self.notes)
        group = loop.trainer.pg.group_index
        regrouped = read_json(step_dir(self.run_dir, step), LAYOUT_FILE).get("groups") != loop.trainer.pg.num_groups
        if regrouped:  # another number of groups (round boundary): the trainer's counters are every group's;
            group = 0  # the data positions come from the round plan (DeptHooks.rebase_groups)
        meta = read_json(step_dir(self.run_dir, step), f"group{group}.json")
        try:
            loop.trainer.load_state_dict(meta["trainer"])
            for name, st in ({} if regrouped else meta.get("iterators", {})).items():
                it = loop.iterator(name)
                if hasattr(it, "load_state_dict"):
                    it.load_state_dict(st)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{step_dir(self.run_dir, step)}/group{group}.json: unexpected content "
                                  f"({type(exc).__name__}: {exc})") from None
        if hasattr(loop, "check_data_positions"):  # DEPT: positions must agree with the round plan
            loop.check_data_positions(f"checkpoint {step_dir(self.run_dir, step)}")
        return step


def load_weights(trainer, run_dir: str, step: int, hooks: Any = None, optimizer: bool = True,
                 verified: bool = False, tokenizer_digests: Optional[dict] = None,
                 notes: Optional[list] = None, remedy: Optional[str] = None, check_data: bool = True) -> None:
    """Load checkpoint ``step`` into ``trainer`` (and the round hooks). Unless ``verified``, the
    checkpoint's manifest is checked first (:class:`CheckpointError` when damaged). ``notes``:
    a list that receives one line per piece of state the load changed rather than restored
    (e.g. under another number of groups: the error-feedback residuals averaged, the eager
    estimates reset), for the launch to log. ``remedy``: the advice of a config that differs
    from the checkpoint's (``resume.check_depends``; default: a training launch's). ``check_data``:
    also check the data the checkpoint's positions index (a resume; an evaluation reads the
    weights only); a change accepted under ``train.allow_data_change`` goes to ``notes``."""
    path = step_dir(run_dir, step)
    if not verified:
        problem = verify_checkpoint(path, trainer.device)
        if problem:
            raise mark_agreed(CheckpointError(f"checkpoint {path} is not usable: {problem}"))

    def checks():  # each rank's reading of the checkpoint's layout and depends: one agreed error
        found = check_layout(trainer, path, optimizer=optimizer, hooks=hooks)
        return found, check_depends(trainer.cfg, path, tokenizer_digests, remedy, data=check_data)
    from .run_inputs import input_errors
    (regroup, reshard), data_notes = agree_errors(checks, input_errors(), trainer.device)
    if notes is not None:
        notes.extend(line for line in data_notes if line not in notes)
    pg = trainer.pg
    layout = read_json(path, LAYOUT_FILE)
    if hooks is not None and hasattr(hooks, "prepare_load"):
        hooks.prepare_load(step, layout)  # DEPT: the embeddings (vocabulary) installed at that step
    if optimizer:
        _ensure_optimizer_state(trainer)
    fmt = read_manifest(path)["format"]
    saved_groups = int(layout["groups"])
    install_outer = install_groups = install_hooks = None
    if fmt == 1:
        from .checkpoint_v1 import load_model_v1
        load_model_v1(trainer, path, optimizer)
    else:  # this launch's entries, DEPT's load plan, one read
        entries = model_entries(trainer, optimizer)
        if notes is not None and optimizer:  # (a resume: an evaluation reads the weights as saved)
            notes += _masters_note(entries, path)
        if regroup:  # another number of groups, at a round boundary
            entries = _regroup_plan(entries, hooks, pg, saved_groups, path, notes)
        if hooks is not None and has_outer_state(hooks) and layout.get("outer_keys"):
            with _uncounted(hooks):
                more, install_outer = outer_targets(hooks, trainer)
            entries += more
        if hooks is not None and has_group_state(hooks) and layout.get("outer_group_keys"):
            more, install_groups = group_targets(hooks, trainer, path, saved_groups if regroup else None)
            entries += more
        if hooks is not None and hasattr(hooks, "checkpoint_targets"):  # DEPT's sources and tables (dept.hook_state)
            metas = _dept_metas(path, range(saved_groups) if regroup else [pg.group_index])
            try:
                more, install_hooks = hooks.checkpoint_targets(metas, saved_groups if regroup else None, step,
                                                               layout.get("dept_schedule"), optimizer)
            except (KeyError, TypeError, ValueError) as exc:
                raise CheckpointError(f"checkpoint {path}: its DEPT state does not load here "
                                      f"({type(exc).__name__}: {exc})") from None
            entries += more
        read = load_entries(entries, path)
        if hooks is not None and hasattr(hooks, "loaded_replicated"):  # DEPT: evaluation shared out (dept/eval_split.py)
            hooks.loaded_replicated(step, shared_params(trainer, read))
    for opt in trainer.optimizers:  # weights and fp32 masters agree (masters from the weights without optimizer)
        opt.after_checkpoint_load(with_optimizer=optimizer)
    tracker = _rng_tracker(trainer)
    if tracker is not None and reshard:
        _reseed_dropout(trainer, tracker, path, step, layout, notes)
    elif tracker is not None:
        if layout.get("dropout_rng"):
            tracker.load_state_dict(_safe_load(os.path.join(path, _rng_file(pg)), "cpu"))
        elif trainer.cfg.model.hidden_dropout > 0 or trainer.cfg.model.attention_dropout > 0:
            raise CheckpointError(f"checkpoint {path} has no dropout streams (rng_tp*_pp*.pt), which this run's "
                                  f"dropout needs to continue exactly")
    if optimizer:  # a resume: native FP8's amax history (same layout and recipe), else empty and a note
        restore_fp8(trainer, path, layout, _layout(trainer), notes)
    if fmt == 1:
        from .checkpoint_v1 import load_hooks_v1, load_outer_v1
        load_hooks_v1(trainer, hooks, path, layout)
        load_outer_v1(trainer, hooks, path, layout, notes)
        return
    if install_hooks is not None:
        install_hooks()
        if regroup and optimizer:  # the installed source's new optimizer: zeros (= AdamW's first step), as saved
            _ensure_optimizer_state(trainer)
    if install_outer is not None:
        install_outer()
    if install_groups is not None:
        lines = install_groups()
        if notes is not None:
            notes.extend(line for line in lines if line not in notes)
    if hooks is not None and layout.get("outer_group_keys") and notes is not None:
        notes.extend(line for line in unused_group_buffers(hooks, path) if line not in notes)


def _dept_metas(path: str, groups) -> dict[int, dict]:
    """The DEPT round position each old group saved (``group{g}.json``: ``dept``)."""
    out = {}
    for g in groups:
        meta = read_json(path, f"group{g}.json")
        if not isinstance(meta.get("dept"), dict):
            raise CheckpointError(f"checkpoint {path}: group{g}.json has no DEPT round state ('dept'); it was not "
                                  f"written by a DEPT run of checkpoint format 2")
        out[g] = meta["dept"]
    return out


def regroup_note(path: str, saved_groups: int, groups: int, owned: list[str]) -> str:
    """The line a load under another number of groups logs about the inner optimizer state a
    group owns (``owned``: ``DeptHooks.group_owned_inner_state``): what happened first, then
    why (``dept.reset_inner_optimizer: false`` keeps that state across rounds)."""
    return (f"checkpoint {path} was written by {saved_groups} source groups, this launch has {groups}: new group g "
            f"continues with the inner optimizer state of {' and of '.join(owned)} of old group g mod {saved_groups} "
            f"(as a replica joining a DiLoCo job receives a peer's); a group keeps that state across rounds "
            f"because dept.reset_inner_optimizer is false (true clears it at every round start)")


def _masters_note(entries: list[Entry], path: str) -> list[str]:
    """A launch without fp32 master weights (precision fp32) loading a checkpoint that has them
    (written under bf16 / fp16) continues from the saved half-precision weights, not from the
    masters: said, not silent."""
    if any("/main_param/" in e.key for e in entries):
        return []
    from .checkpoint_format import saved_keys
    if not any("/main_param/" in k for k in saved_keys(path)):
        return []
    return [f"precision: checkpoint {path} was written with fp32 master weights (bf16 / fp16 training); this "
            f"launch keeps none (precision fp32) and continues from the saved half-precision weights, so its "
            f"weights differ from the masters by their rounding; resume with the checkpoint's precision to "
            f"continue from the masters"]


def _regroup_plan(entries: list[Entry], hooks, pg, saved_groups: int, path: str, notes: Optional[list]) -> list[Entry]:
    """DEPT's load plan under another number of groups, at a round boundary: this rank's
    entries renamed to the keys of the old group they load from. The weights from old group 0
    (at a round boundary every group holds the same body, GLOB's embeddings and their outer
    state), the inner optimizer state from old group ``g mod saved_groups`` (what a group
    owns: the body's AdamW state with ``dept.body_optimizer_state: group``, GLOB's
    embeddings'; a new group takes an old group's as a replica joining a DiLoCo job receives a
    peer's; with ``dept.reset_inner_optimizer: true`` it is cleared at the next round start
    anyway). With per-source state (SPEC, SPEC-OPT) the installed embeddings and their
    optimizer state are left out: the sources' state comes from the hooks files, by source.
    The residuals' averaging and the estimates' reset: ``checkpoint_state.group_targets``."""
    own = bool(getattr(getattr(hooks, "strategy", None), "source_embeddings", False))  # SPEC, SPEC-OPT
    owned = getattr(hooks, "group_owned_inner_state", lambda: [])()
    if owned and notes is not None:
        notes.append(regroup_note(path, saved_groups, pg.num_groups, owned))
    now = pg.group_index if pg.num_groups > 1 else None
    out = []
    for e in entries:
        if own and "/embeddings." in e.key:
            continue
        src = pg.group_index % saved_groups if e.key.startswith("optim/") else 0
        out.append(Entry(with_group(e.key, now, src if saved_groups > 1 else None), e.tensor, e.shape, e.offset))
    return out


def _reseed_dropout(trainer, tracker, path: str, step: int, layout: dict, notes: Optional[list]) -> None:
    """Under another tensor / pipeline / virtual-pipeline layout the saved dropout streams
    (one pair per old (tp, pp) position, advanced by the old ranks' layers) cannot be mapped
    onto this rank's, as in Megatron-LM, which skips the saved RNG state when (TP, PP) changes:
    re-seed them from (seed, ``step``, tensor rank, pipeline rank) (``RNGTracker.reseed``; the
    step keeps the resumed run from replaying step 0's masks). With dropout on, one line for
    ``notes``: the masks differ from an uninterrupted run of either layout."""
    tracker.reseed(step)
    m = trainer.cfg.model
    if notes is None or not (m.hidden_dropout > 0 or m.attention_dropout > 0):
        return
    now = {k: v for k, v in _layout(trainer).items() if k in ("tensor", "pipeline",
                                                                                      "virtual_pipeline")}
    said = ", ".join(f"parallel.{k}={layout.get(k)}" for k in now)
    line = (f"model.hidden_dropout / model.attention_dropout: checkpoint {path} was written with {said} (this "
            f"launch: {', '.join(f'{v}' for v in now.values())}); its dropout streams (per tensor and pipeline "
            f"rank) do not carry over and were re-seeded from (train.seed, step {step}, tensor rank, pipeline "
            f"rank): the masks differ from an uninterrupted run of either layout")
    if line not in notes:
        notes.append(line)


# config values the body's tensors depend on (the vocabulary and the data may differ)
BODY_KEYS = ("model.num_layers", "model.hidden_size", "model.num_attention_heads", "model.num_query_groups",
             "model.ffn_hidden_size", "model.activation", "model.normalization", "model.position_embedding",
             "model.bias")


def load_body(stages, cfg, pg, run_dir: str, step: int, group: Optional[int] = None,
              device: Optional[torch.device] = None) -> int:
    """Load only the transformer body (``body.*``) of checkpoint ``step`` into model chunks
    ``stages`` (this rank's, built for ``cfg`` / ``pg``), whatever vocabulary, sources or number
    of source groups they are for (plasticity, continued pre-training: ``dept_mega.adapt``).
    Call it before a :class:`~dept_mega.trainer.Trainer` takes the chunks (its fp32 masters
    are then the loaded values). Any tensor / pipeline layout (format 1: the checkpoint's
    only). Inside a round the groups' bodies differ: ``group`` says whose (default: at a
    round boundary, where every group holds the same body, group 0; else an error). Returns
    the group read."""
    from .checkpoint_format import entries_of, param_key
    from .config import ConfigError
    path = step_dir(run_dir, step)
    problem = verify_checkpoint(path, device)
    if problem:
        raise CheckpointError(f"checkpoint {path} is not usable: {problem}")
    saved = read_json(path, LAYOUT_FILE)
    fmt = read_manifest(path)["format"]
    now = {"tensor": pg.tp_size, "pipeline": pg.pp_size, "virtual_pipeline": cfg.parallel.virtual_pipeline}
    wrong = [k for k in now if saved.get(k) != now[k]]
    if wrong and fmt == 1:
        raise ConfigError(f"config key 'parallel.{wrong[0]}': checkpoint {path} was written with "
                          + ", ".join(f"parallel.{k}={saved.get(k)} (this launch: {now[k]})" for k in wrong)
                          + f"; a format-1 checkpoint loads with its own layout only; convert it first: "
                            f"python tools/convert_checkpoint.py --run-dir {run_dir} --step {step}")
    depends = read_json(path, DEPENDS_FILE)
    old = depends.get("config", {})
    check_differing(depends_differences(depends, fingerprint(cfg), BODY_KEYS, tokenizers=()),
                    f"from the body in checkpoint {path}", "the body loads into the same model shape only")
    groups = int(saved.get("groups", 1))
    local_steps = int(old.get("dept.local_steps") or 0)
    if group is None:
        if groups > 1 and local_steps and step % local_steps:
            raise ConfigError(f"checkpoint {path}: step {step} is inside a round, where the {groups} source groups "
                              f"hold different bodies; choose one (--group G) or a step at a round boundary "
                              f"(a multiple of dept.local_steps={local_steps})")
        group = 0
    if not 0 <= group < groups:
        raise ConfigError(f"checkpoint {path} holds {groups} source group(s); there is no group {group}")
    body = [(c, name, p) for c, st in enumerate(stages) for name, p in st.named_parameters()
            if name.startswith("body.")]
    if fmt == 1:
        import torch.distributed.checkpoint as dcp
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({f"model/g{group}/tp{pg.tp_rank}/pp{pg.pp_rank}/c{c}/{name}": p.data for c, name, p in body},
                     checkpoint_id=path, no_dist=True)
        return group
    entries = [e for _, name, p in body
               for e in entries_of(param_key(name, group if groups > 1 else None), p.data, p, pg.tp_rank, pg.tp_size)]
    load_entries(entries, path)
    return group
