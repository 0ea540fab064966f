"""Resuming a checkpoint under another distributed-optimizer layout: the training continues as
if uninterrupted.

The distributed optimizer switched on or off, under another data-parallel size and bucket
size, also together with another tensor / pipeline size (``dept_mega.optim_reshard``,
``dept_mega.reshard``): the optimizer state run B loads is run A's, tensor for tensor (the
moments and fp32 masters joined from their pieces, checked here independently of the
loader), and the losses equal an uninterrupted run of the new layout from the same initial
weights within 1e-6 (fp32); DEPT's per-source optimizer state in the hook files (TRIM,
SPEC-OPT, GLOB with the body's state per source) is joined from the old ranks' pieces and cut
for the new ones. Another data, tensor or pipeline size without the distributed optimizer:
tests/test_reshard.py (shared helpers: tests/reshard_utils.py)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.mp_utils import run_distributed
from tests.reshard_utils import CASES, LAYOUT_CASES, LAYOUT_SOURCES, buffer_differences, make_loop, read_losses


# (name, case, precision, (data, optim.distributed, grad_bucket_size) of run A, the same of run B)
OPTIM_LAYOUTS = {
    "std_bf16_dist_dp2_to_plain_dp1": ("std", "bf16", (2, True, 500), (1, False, 3000)),
    "glob_bf16_dist_dp1_to_dist_dp2": ("glob", "bf16", (1, True, 700), (2, True, 500)),
}
# (fp32 switches of STD, TRIM, SPEC-OPT: tests/test_checkpoint_property.py compares their state in full)


def _optim_loop(over, run_dir, rank, precision, layout, steps=4, save=True):
    data, dist, bucket, tensor, pipeline = tuple(layout) + (1, 1)[len(layout) - 3:]
    optim = dict(over.get("optim", {}), distributed=dist, grad_bucket_size=bucket)
    loop = make_loop(dict(over, precision=precision, optim=optim), run_dir, rank, data=data, tensor=tensor,
                     pipeline=pipeline, steps=steps, sources=LAYOUT_SOURCES.get(json.dumps(over, sort_keys=True), 2),
                     save=save)
    return loop


def _optim_train_a(rank, world, over, precision, layout, run_dir):
    loop = _optim_loop(over, run_dir, rank, precision, layout)
    loop.cfg.train.steps = 2
    loop.run()


def _optim_resume_b(rank, world, over, precision, layout, run_dir, ref_dir, again_dir):
    from dept_mega.checkpoint import Checkpointer
    ref = _optim_loop(over, ref_dir, rank, precision, layout, save=False)
    ref.run()
    loop = _optim_loop(over, run_dir, rank, precision, layout, save=False)
    assert loop.checkpointer.load(loop) == 2
    Checkpointer(again_dir).save(loop)  # what was loaded, written in this layout (the run's later saves: none)
    loop.writer.resume_at(2)
    loop.run()


def _full_optimizer_state(step_dir):
    """Every optimizer key of a checkpoint as the whole flattened shard of its parameter,
    joined from distributed-optimizer pieces (``.../dp{d}of{D}:{start}-{end}``) where it was
    saved in pieces (written here independently of dept_mega.optim_reshard)."""
    import re
    import warnings
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    meta = FileSystemReader(step_dir).read_metadata().state_dict_metadata
    raw = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype) for k, md in meta.items()
           if k.startswith("optim/")}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(raw, checkpoint_id=step_dir, no_dist=True)
    parts = {}
    for k, v in raw.items():
        m = re.match(r"^(.*)/dp\d+of\d+:(\d+)-(\d+)$", k)
        base, start = (m.group(1), int(m.group(2))) if m else (k, 0)
        parts.setdefault(base, []).append((start, v))
    out = {}
    for base, ps in parts.items():
        if ps[0][1].dim() == 0:  # step: one value per piece, all equal
            assert all(torch.equal(v, ps[0][1]) for _, v in ps), base
            out[base] = ps[0][1]
        else:
            out[base] = torch.cat([v.reshape(-1) for _, v in sorted(ps, key=lambda x: x[0])])
    return out


def _per_group(state, groups):
    """State written once for every group (``.../model/{name}``: at a round boundary after a
    blocking sync) as each group's copy (``.../model/g{g}/{name}``), so that a checkpoint that
    wrote a tensor once compares with one that wrote it per group (a run resumed at that step
    does not know the sync happened before its start, and writes per group)."""
    import re
    if groups < 2:
        return state
    out = {}
    for k, v in state.items():
        head, sep, tail = k.partition("/model/")
        if sep and not re.match(r"g\d+/", tail):
            for g in range(groups):
                out[f"{head}/model/g{g}/{tail}"] = v
        else:
            out[k] = v
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", sorted(OPTIM_LAYOUTS))
def test_resume_with_another_distributed_optimizer_layout(tmp_path, name):
    """The distributed optimizer switched on or off, under another data-parallel size and
    bucket size (dept_mega.optim_reshard): what run B loads and writes back in its own layout
    is the state run A saved, tensor for tensor (the moments and fp32 masters joined from
    their pieces); B then trains on, in fp32 with the losses of an uninterrupted B run
    (within 1e-6; they differ only in the gradient sum order of the first 2 steps)."""
    case, precision, la, lb = OPTIM_LAYOUTS[name]
    over = CASES[case]
    groups = 1 if case == "std" else 2
    a, ref, again = (str(tmp_path / n) for n in ("a", "ref", "again"))
    run_distributed(_optim_train_a, groups * la[0], args=(over, precision, la, a), timeout=200)
    run_distributed(_optim_resume_b, groups * lb[0], args=(over, precision, lb, a, ref, again), timeout=300)
    saved = _per_group(_full_optimizer_state(os.path.join(a, "checkpoints", "step_2")), groups)
    loaded = _per_group(_full_optimizer_state(os.path.join(again, "checkpoints", "step_2")), groups)
    assert saved.keys() == loaded.keys() and len(saved) > 0
    assert any(k.split("/")[2] == "main_param" for k in saved) == (precision == "bf16")
    for k in saved:
        assert torch.equal(saved[k], loaded[k]), k
    got, want = read_losses(a), read_losses(ref)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    for s in (3, 4):
        tol = 1e-6 if precision == "fp32" else 2e-2
        assert got[s] == pytest.approx(want[s], rel=tol, abs=0), (s, got[s], want[s])


# (case, (data, optim.distributed, grad_bucket_size, tensor, pipeline) of run A, the same of run B)
TP_OPTIM_LAYOUTS = {
    "std_dist_dp2_to_dist_pp2_dp2": ("std", (2, True, 500, 1, 1), (2, True, 700, 1, 2)),
    "glob_dist_dp2_to_plain_tp2": ("glob_nesterov", (2, True, 500, 1, 1), (1, False, 3000, 2, 1)),
    # GLOB with the body's AdamW state per source (3 sources over 2 groups, saved after 2 rounds):
    # each source's body moments (hook files) joined over the old tensor ranks by parameter name,
    # cut for the new stage and into the distributed optimizer's pieces
    "glob_source_plain_tp2_to_dist_pp2_dp1": ("glob_source", (1, False, 3000, 2, 1), (1, True, 300, 1, 2)),
    # TRIM with int8 error feedback: φ's row shards joined over the old tp x dp ranks; each
    # source's compact-table AdamW pieces joined by parameter name over the old replicas,
    # resharded, cut into the new pieces; the body's residuals (per parameter and group) joined
    # and cut like θ_{t-1} (the step-4 sync uses them: steps 5, 6)
    "trim_int8_ef_dist_dp2_to_dist_tp2_dp1": ("trim_int8_ef", (2, True, 500, 1, 1), (1, True, 300, 2, 1)),
    # SPEC-OPT (3 sources over 2 groups, the body's AdamW state per source) with int8 error
    # feedback, saved after 2 rounds (a source waits in a store): each source's embedding and
    # body AdamW pieces joined by parameter name over the old replicas, resharded over tensor
    # ranks, cut into the new pieces; the residuals (per parameter and group) are run A's, joined
    # and cut, exactly. Run to step 6 only: the step-6 sync quantises a pseudo-gradient
    # whose ~1e-6 layout differences (the two layouts' int8 syncs at steps 2 and 4 before the
    # save differ; the uninterrupted T = 1 and T = 2 runs differ by 4e-5 at step 7 with the same
    # code) move values across int8 rounding steps, so steps 7, 8 differ by more than 1e-6
    "spec_opt_source_ef_dist_dp2_to_dist_tp2_dp1": ("spec_opt_source_ef", (2, True, 500, 1, 1),
                                                    (1, True, 300, 2, 1), 6),
}


def _tp_optim_train_a(rank, world, case, layout, run_dir, saved=2, total=4):
    # B's LR schedule; the one checkpoint run B loads (step ``saved``'s), no other
    loop = _optim_loop(LAYOUT_CASES[case], run_dir, rank, "fp32", layout, steps=total, save=(saved,))
    loop.cfg.train.steps = saved
    loop.run()
    return sorted(loop.hooks.store.names()) if hasattr(loop.hooks, "store") else []


def _tp_optim_resume_b(rank, world, case, layout, run_dir, ref_dir, saved=2, total=4, saved_tensor=1):
    ref = _optim_loop(LAYOUT_CASES[case], ref_dir, rank, "fp32", layout, steps=total, save=False)
    ref.run()
    loop = _optim_loop(LAYOUT_CASES[case], run_dir, rank, "fp32", layout, steps=total, save=False)
    assert loop.checkpointer.load(loop) == saved
    loaded = buffer_differences(loop, run_dir, saved, saved_tensor) \
        if "error_feedback" in json.dumps(LAYOUT_CASES[case]) else {}
    loop.writer.resume_at(saved)
    loop.run()
    return loaded


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", sorted(TP_OPTIM_LAYOUTS))
def test_distributed_optimizer_under_another_tensor_and_pipeline_size(tmp_path, name):
    """The distributed optimizer's pieces with another tensor / pipeline size at the same time
    (dept_mega.reshard joins the saved pieces into shards, the shards into the full tensor,
    cuts the new shard and the piece this rank holds), also with D, the bucket size or the
    optimizer switched: fp32 losses within 1e-6 of an uninterrupted run of the new layout.
    TRIM and SPEC-OPT (per-rank hook files): DeptHooks.load_state_dict_rank_resharded joins
    each source's optimizer pieces (optim_reshard.join_named_pieces; TRIM's φ too) and cuts
    them for the new rank."""
    case, la, lb = TP_OPTIM_LAYOUTS[name][:3]
    groups = 1 if case == "std" else 2
    three = json.dumps(LAYOUT_CASES[case], sort_keys=True) in LAYOUT_SOURCES  # 2 rounds: a source waits
    saved, total = (4, 8) if three else (2, 6) if case == "trim_int8_ef" else (2, 4)
    total = TP_OPTIM_LAYOUTS[name][3] if len(TP_OPTIM_LAYOUTS[name]) > 3 else total  # (see its entry)
    a, ref = str(tmp_path / "a"), str(tmp_path / "ref")
    size = lambda l: groups * l[0] * l[3] * l[4]
    stored = run_distributed(_tp_optim_train_a, size(la), args=(case, la, a, saved, total), timeout=200)
    if three:
        assert any(stored), stored
    buffers = run_distributed(_tp_optim_resume_b, size(lb), args=(case, lb, a, ref, saved, total, la[3]),
                              timeout=300)
    for r in buffers:  # error feedback: the residuals right after the load are run A's, joined
        assert r == ({"residual": 0.0} if "error_feedback" in json.dumps(LAYOUT_CASES[case]) else {}), r
    got, want = read_losses(a), read_losses(ref)
    assert sorted(got) == sorted(want) == list(range(1, total + 1))
    for s in range(saved + 1, total + 1):
        assert got[s] == pytest.approx(want[s], rel=1e-6, abs=0), (s, got[s], want[s])


# SPEC-OPT (3 sources over 2 groups, the body's AdamW state per source) with the distributed
# optimizer on one side or both: ((data, optim.distributed, grad_bucket_size) of run A, of run B)
SOURCE_OPTIM_LAYOUTS = {
    "plain_dp1_to_dist_dp2": ((1, False, 3000), (2, True, 500)),
}


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", sorted(SOURCE_OPTIM_LAYOUTS))
def test_spec_opt_per_source_state_under_another_distributed_optimizer_layout(tmp_path, name):
    """SPEC-OPT's per-source state (each source's embeddings, their AdamW state and its body
    AdamW moments, in the hook files: per rank with the distributed optimizer, its pieces of
    each moment) written at a round boundary after 2 rounds (a source waits in a store) and
    resumed under another data-parallel size and bucket size, the distributed optimizer on or
    off (DeptHooks.dp_joined_state: each source's optimizer states joined from the old
    replicas' pieces and cut for this rank's optimizers; the model's keys through
    dept_mega.optim_reshard): the losses of 2 more rounds equal an uninterrupted run of the new
    layout from the same initial weights within 1e-6 (fp32)."""
    la, lb = SOURCE_OPTIM_LAYOUTS[name]
    a, ref = str(tmp_path / "a"), str(tmp_path / "ref")
    stored = run_distributed(_tp_optim_train_a, 2 * la[0], args=("spec_opt_source", la, a, 4), timeout=200)
    assert any(stored), stored
    run_distributed(_tp_optim_resume_b, 2 * lb[0], args=("spec_opt_source", lb, a, ref, 4, 8), timeout=300)
    got, want = read_losses(a), read_losses(ref)
    assert sorted(got) == sorted(want) == list(range(1, 9))
    for s in range(5, 9):
        assert got[s] == pytest.approx(want[s], rel=1e-6, abs=0), (s, got[s], want[s])

