"""Resuming a checkpoint under another layout: the training continues as if uninterrupted.

Format 2 saves every tensor as a box of a global tensor under a key of global names, so another
tensor, pipeline, virtual-pipeline or data-parallel size, and the distributed optimizer
switched on or off, are one DCP load of the boxes the new layout needs
(``dept_mega.checkpoint_format``). These tests keep one loss-continuation case per kind of
change of data, tensor, pipeline or virtual-pipeline size: train to a step, resume under the
other layout and continue; the losses equal an uninterrupted run of the new layout from the
same initial weights within 1e-6 (they differ only in the order of sums), with dropout
re-seeded under another T / P, error-feedback residuals and eager estimates resharded, and the
refusals named by key. The distributed optimizer switched on or off, with another bucket size
or together with another T / P: tests/test_reshard_optimizer.py (shared helpers:
tests/reshard_utils.py). Full-tensor equality of every piece of state under random layout
pairs: tests/test_checkpoint_property.py; another number of groups: tests/test_regroup.py."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.mp_utils import run_distributed
from tests.reshard_utils import CASES, LAYOUT_CASES, buffer_differences, make_loop, read_losses


def _train_a(rank, world, over, run_dir):
    loop = make_loop(over, run_dir, rank, data=1)
    loop.cfg.train.steps = 2
    loop.run()


def _resume_b(rank, world, over, run_dir, ref_dir):
    ref = make_loop(over, ref_dir, rank, data=2)
    ref.run()
    loop = make_loop(over, run_dir, rank, data=2, save=False)  # (its checkpoints: read by nothing)
    assert loop.checkpointer.load(loop) == 2
    loop.writer.resume_at(2)
    loop.run()
    # the error-feedback residuals after the step-4 sync (which used the resumed ones): the
    # largest difference from the uninterrupted run's and the largest residual
    if not hasattr(loop.hooks, "outer_syncs"):
        return None
    got, want = loop.hooks.outer_syncs(), ref.hooks.outer_syncs()
    pairs = [(got[k].residual, want[k].residual) for k in want if want[k].residual is not None]
    if not pairs:
        return None
    return (max(float((g - w).abs().max()) for g, w in pairs), max(float(w.abs().max()) for _, w in pairs))



@pytest.mark.slow
@pytest.mark.timeout(400)
# (TRIM's plain D change is the trim_int8_ef case without its residuals, GLOB's the glob_int8_ef
# case with another outer optimizer: not run separately, for the suite's time)
# (SPEC's plain D change: tests/test_checkpoint_property.py compares its state in full)
@pytest.mark.parametrize("case", sorted(set(CASES) - {"trim", "glob", "spec"}))
def test_resume_under_another_data_parallel_size(tmp_path, case):
    over = CASES[case]
    groups = 1 if case == "std" else 2
    a, ref = str(tmp_path / "a"), str(tmp_path / "ref")
    run_distributed(_train_a, groups, args=(over, a), timeout=200)
    residuals = run_distributed(_resume_b, 2 * groups, args=(over, a, ref), timeout=300)
    if over["dept"].get("outer_error_feedback"):  # the resumed residuals fed the step-4 sync
        for diff, largest in residuals:
            assert largest > 0 and diff <= 1e-6 * largest, (diff, largest)
    got, want = read_losses(a), read_losses(ref)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    for s in (3, 4):
        assert got[s] == pytest.approx(want[s], rel=1e-6, abs=0), (s, got[s], want[s])
    # D = 1 and D = 2 checkpoints of the same step hold the same tensors (saved once)
    import torch.distributed.checkpoint as dcp
    meta = lambda d: {k: tuple(v.size) for k, v in dcp.FileSystemReader(os.path.join(d, "checkpoints", "step_2"))
                      .read_metadata().state_dict_metadata.items() if hasattr(v, "size")}
    assert meta(a) == meta(ref)



def _train_a_layout(rank, world, run_dir, tensor, pipeline, case="std", steps=2, virtual=1, data=1, keep=None):
    """Run A to ``steps``; ``keep``: the one checkpoint step it writes (default ``steps``, its
    last: the one run B loads; the others would be read by nothing)."""
    loop = make_loop(LAYOUT_CASES[case], run_dir, rank, data, tensor, pipeline, virtual=virtual,
                     save=(keep or steps,))
    loop.cfg.train.steps = steps
    loop.run()
    return sorted(loop.hooks.store.names()) if hasattr(loop.hooks, "store") else []


def _resume_b_layout(rank, world, run_dir, ref_dir, tensor, pipeline, case="std", steps=4, virtual=1, data=1,
                     load_step=None, saved_tensor=2):
    ref = make_loop(LAYOUT_CASES[case], ref_dir, rank, data, tensor, pipeline, steps, virtual, save=False)
    ref.run()
    loop = make_loop(LAYOUT_CASES[case], run_dir, rank, data, tensor, pipeline, steps, virtual, save=False)
    at = loop.checkpointer.load(loop, step=load_step)
    assert at == (load_step or (4 if case.startswith("spec_opt_source") else 2))
    loaded = buffer_differences(loop, run_dir, at, saved_tensor) if "error_feedback" in json.dumps(LAYOUT_CASES[case]) \
        else {}
    loop.writer.resume_at(at)
    loop.run()
    return loaded



@pytest.mark.slow
@pytest.mark.timeout(400)
# (other T / P pairs: tests/test_checkpoint_property.py)
@pytest.mark.parametrize("a,b", [((1, 1), (2, 2))])
def test_std_resume_under_another_tensor_and_pipeline_size(tmp_path, a, b):
    """STD (model and AdamW state; no dropout): written with (tensor, pipeline) = a, resumed
    with b (tensor shards joined and cut again, layers found on their new stages): the losses
    equal an uninterrupted b run from the same initial weights within 1e-6."""
    run, ref = str(tmp_path / "a"), str(tmp_path / "ref")
    run_distributed(_train_a_layout, a[0] * a[1], args=(run, *a), timeout=200)
    run_distributed(_resume_b_layout, b[0] * b[1], args=(run, ref, *b), timeout=300)
    got, want = read_losses(run), read_losses(ref)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    for s in (3, 4):
        assert got[s] == pytest.approx(want[s], rel=1e-6, abs=0), (s, got[s], want[s])


@pytest.mark.slow
@pytest.mark.timeout(400)
# (the plain glob_nesterov case is this one without error feedback and the eager start, and its
# round-boundary save under another T / P is test_distributed_optimizer_under_another_tensor_and_
# pipeline_size's GLOB cases in tests/test_reshard_optimizer.py: not run separately, for the
# suite's time)
@pytest.mark.parametrize("case", ["glob_int8_ef_eager"])
def test_glob_resume_under_another_tensor_and_pipeline_size(tmp_path, case):
    """DEPT GLOB (2 groups, Nesterov outer optimizer), written with (tensor, pipeline) = (2, 1) at a
    round boundary, resumed with (1, 2) for 2 rounds: the model, the AdamW state and the outer state
    (θ_{t-1}, momentum: dept/... keys, joined and cut like their parameters) reshard; the
    losses equal an uninterrupted (1, 2) run from the same initial weights within 1e-6 (the
    layouts differ only in the order of the tensor-parallel sums over the first 2 steps).

    ``glob_int8_ef_eager``: with int8 error feedback and the eager start (τ = 1), saved at step
    3 (the step-2 sync applied; its residuals and the estimates E it recorded are the group's,
    per parameter under dept/{category}/g{g}/... keys), resumed from there: the step-4 sync
    adds the resharded residuals and starts step 5 from θ_eager made with the resharded E
    (the step-5 loss depends on it); the residuals and estimates held right after the load are
    run A's saved shards joined, exactly (the residuals at the end are not compared with the
    uninterrupted run's: the layouts' tensor-parallel sum orders differ by ~1e-7 over the first
    2 steps, which moves a few values across an int8 rounding boundary)."""
    run, ref = str(tmp_path / "a"), str(tmp_path / "ref")
    eager = case == "glob_int8_ef_eager"
    saved = 3 if eager else 2  # the step-2 round end's save waits for its overlapped sync
    run_distributed(_train_a_layout, 4, args=(run, 2, 1, case, 4 if eager else 2, 1, 1, saved), timeout=200)
    if eager:
        layout = json.loads((tmp_path / "a" / "checkpoints" / "step_3" / "layout.json").read_text())
        assert layout["outer_group_keys"]
    buffers = run_distributed(_resume_b_layout, 4, args=(run, ref, 1, 2, case, 6, 1, 1, saved), timeout=300)
    got, want = read_losses(run), read_losses(ref)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4, 5, 6]
    for s in range(saved + 1, 7):  # after an outer step that used the resharded outer state
        assert got[s] == pytest.approx(want[s], rel=1e-6, abs=0), (s, got[s], want[s])
    if eager:
        for r in buffers:
            assert r == {"residual": 0.0, "eager_base": 0.0}, r


@pytest.mark.slow
@pytest.mark.timeout(400)
# (SPEC-OPT with the body's state per source under another T: spec_opt_source_t1p2_to_t2p1 of
# test_spec_resume_under_another_pipeline_size, which changes T and P at once)
# (plain SPEC under another T alone is this case without error feedback and the eager start)
@pytest.mark.parametrize("case", ["spec_int8_ef_eager"])
def test_spec_resume_under_another_tensor_size(tmp_path, case):
    """DEPT SPEC (2 groups, 2 sources) with int8 error feedback and the eager start (τ = 1),
    written with parallel.tensor = 1 at step 3 (the step-2 round end's save waits for its
    overlapped sync; inside round 2) and resumed with 2: besides the model, AdamW and outer
    state, each source's own embeddings and their AdamW moments (the hook files, one per tensor
    rank) are joined and cut, and the residuals and estimates (per parameter and group) are
    run A's joined, exactly, right after the load; the losses of steps 4-6 (the step-4 sync
    adds the resharded residuals, step 5 starts from θ_eager made with the resharded estimate)
    equal an uninterrupted tensor = 2 run from the same initial weights within 1e-6."""
    run, ref = str(tmp_path / "a"), str(tmp_path / "ref")
    saved = 3
    run_distributed(_train_a_layout, 2, args=(run, 1, 1, case, 4, 1, 1, saved), timeout=200)
    layout = json.loads((tmp_path / "a" / "checkpoints" / "step_3" / "layout.json").read_text())
    assert layout["outer_group_keys"]
    buffers = run_distributed(_resume_b_layout, 4, args=(run, ref, 2, 1, case, 6, 1, 1, saved, 1), timeout=300)
    for r in buffers:
        assert r == {"residual": 0.0, "eager_base": 0.0}, r
    got, want = read_losses(run), read_losses(ref)
    assert sorted(got) == sorted(want) == list(range(1, 7))
    for s in range(saved + 1, 7):
        assert got[s] == pytest.approx(want[s], rel=1e-6, abs=0), (s, got[s], want[s])


# (case, (tensor, pipeline, virtual pipeline) of run A, the same of run B)
# (SPEC's P 1 -> 2 takes the same path as SPEC-OPT's: not run separately, for the suite's time)
# (SPEC-OPT's T and P at once: tests/test_checkpoint_property.py compares its state in full)
PIPELINE_LAYOUTS = {
    "spec_opt_source_vp1_to_vp2": ("spec_opt_source_4l", (1, 2, 1), (1, 2, 2)),
}


@pytest.mark.slow
@pytest.mark.timeout(500)
@pytest.mark.parametrize("name", sorted(PIPELINE_LAYOUTS))
def test_spec_resume_under_another_pipeline_size(tmp_path, name):
    """DEPT SPEC (2 groups, 2 sources) and SPEC-OPT (2 groups, 3 sources, the body's AdamW
    state per source), written under one (tensor, pipeline, virtual pipeline) layout and resumed
    under another for 2 rounds: each source's embeddings (the input table on the first chunk,
    the head or the tied table's copy on the last), their AdamW state and its body AdamW state
    are taken from the old stages' hook files by the parameter names saved with them, joined
    over the old tensor ranks and cut for the new stage / chunk; the losses equal an
    uninterrupted run of the new layout from the same initial weights within 1e-6."""
    case, la, lb = PIPELINE_LAYOUTS[name]
    run, ref = str(tmp_path / "a"), str(tmp_path / "ref")
    saved = 4 if case.startswith("spec_opt_source") else 2  # 2 rounds: a source waits in a store
    stored = run_distributed(_train_a_layout, 2 * la[0] * la[1], args=(run, la[0], la[1], case, saved, la[2]),
                             timeout=250)
    if saved == 4:
        assert any(stored), stored
    run_distributed(_resume_b_layout, 2 * lb[0] * lb[1], args=(run, ref, lb[0], lb[1], case, saved + 4, lb[2]),
                    timeout=400)
    got, want = read_losses(run), read_losses(ref)
    assert sorted(got) == sorted(want) == list(range(1, saved + 5))
    for s in range(saved + 1, saved + 5):
        assert got[s] == pytest.approx(want[s], rel=1e-6, abs=0), (s, got[s], want[s])


# (case, (tensor, pipeline, data, virtual pipeline) of run A, the same of run B); T 1 -> 2 with
# D 2 -> 1: φ's rows split over the old data-parallel ranks are joined and split over the new
# tensor ranks; P 1 -> P 2 x VP 2: φ_head from the old last stage onto the new last chunk
TRIM_LAYOUTS = {"trim_t1d2_to_t2d1": ("trim", (1, 1, 2, 1), (2, 1, 1, 1)),
                "trim_untied_p1_to_p2vp2": ("trim_untied_4l", (1, 1, 1, 1), (1, 2, 1, 2))}


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", sorted(TRIM_LAYOUTS))
def test_trim_resume_under_another_tensor_or_pipeline_size(tmp_path, name):
    """DEPT TRIM (2 groups, Nesterov outer optimizer with per-row momentum, learned positions),
    written at a round boundary under one (tensor, pipeline, data, virtual pipeline) layout and
    resumed under another for 2 rounds: φ (tied) or φ and φ_head (untied: the head's table on the last stage) are
    joined from the old ranks' row shards with their momentum and cut into the new ranks' rows,
    the positions' outer state joined from the old chunks, each source's compact tables and
    their AdamW state joined over the old tensor ranks (by parameter name over the old stages)
    and cut (DeptHooks.load_state_dict_rank_resharded); the losses equal an uninterrupted run of
    the new layout from the same initial weights within 1e-6 (steps 5, 6: after an outer step
    that used the resharded row momentum)."""
    case, la, lb = TRIM_LAYOUTS[name]
    run, ref = str(tmp_path / "a"), str(tmp_path / "ref")
    size = lambda l: 2 * l[0] * l[1] * l[2]
    run_distributed(_train_a_layout, size(la), args=(run, la[0], la[1], case, 2, la[3], la[2]), timeout=200)
    run_distributed(_resume_b_layout, size(lb), args=(run, ref, lb[0], lb[1], case, 6, lb[3], lb[2]), timeout=300)
    got, want = read_losses(run), read_losses(ref)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4, 5, 6]
    for s in (3, 4, 5, 6):
        assert got[s] == pytest.approx(want[s], rel=1e-6, abs=0), (s, got[s], want[s])



def test_dropout_streams_reseeded_under_another_layout(tmp_path):
    """With dropout, a checkpoint loads under another tensor or pipeline size (as Megatron-LM
    does): the saved streams belong to the old ranks, so each rank's are re-seeded from (seed,
    the checkpoint's step, tensor rank, pipeline rank) and a note says so; under the same
    layout the saved streams are restored exactly, without a note."""
    import shutil
    from dept_mega.checkpoint import check_layout, load_weights
    from dept_mega.manifest import seal
    from dept_mega.parallel.random import RNGTracker
    # a fresh run's seeds are unchanged (step 0)
    assert RNGTracker(7, tp_rank=1, pp_rank=2).seeds == {"default": 207, "tensor_parallel": 207 + 2718 + 1}
    over = {"dept": {"variant": "std"}, "model": {"hidden_dropout": 0.1, "attention_dropout": 0.1}}
    run = str(tmp_path / "run")
    loop = make_loop(over, run, 0, data=1)
    loop.cfg.train.steps = 2
    loop.run()
    step = tmp_path / "run" / "checkpoints" / "step_2"
    layout = json.loads((step / "layout.json").read_text())
    assert layout["dropout_rng"]
    saved = torch.load(step / "rng_tp0_pp0.pt", weights_only=True)
    tracker = loop.trainer.stages[0].rng
    for t, p in ((0, 1), (1, 0), (1, 1)):  # as if written by 2 tensor or pipeline ranks
        shutil.copy(step / "rng_tp0_pp0.pt", step / f"rng_tp{t}_pp{p}.pt")
    (step / "layout.json").write_text(json.dumps(dict(layout, tensor=2)))
    assert check_layout(loop.trainer, str(step), hooks=loop.hooks) == (False, True)  # was refused
    (step / "layout.json").write_text(json.dumps(dict(layout, pipeline=2)))
    seal(str(step), 2)
    notes: list = []
    load_weights(loop.trainer, run, 2, hooks=loop.hooks, notes=notes)
    assert len(notes) == 1 and "model.hidden_dropout" in notes[0] and "re-seeded" in notes[0], notes
    assert "parallel.pipeline=2" in notes[0] and "step 2" in notes[0], notes
    seed = loop.cfg.train.seed
    want = RNGTracker(seed, tp_rank=0, pp_rank=0, step=2).state_dict()
    fresh = RNGTracker(seed, tp_rank=0, pp_rank=0).state_dict()
    for k, g in tracker.state_dict().items():
        assert torch.equal(g, want[k]), k
        assert not torch.equal(g, fresh[k]), k  # the step is folded in: not step 0's masks
        assert not torch.equal(g, saved[k]), k
    # the same layout: the saved streams, exactly
    (step / "layout.json").write_text(json.dumps(layout))
    for t, p in ((0, 1), (1, 0), (1, 1)):
        (step / f"rng_tp{t}_pp{p}.pt").unlink()
    seal(str(step), 2)
    notes = []
    load_weights(loop.trainer, run, 2, hooks=loop.hooks, notes=notes)
    assert notes == []
    for k, g in tracker.state_dict().items():
        assert torch.equal(g, saved[k]), k
