"""tools/convert_checkpoint.py: a format-1 checkpoint (keys by rank position, written here by
the format-1 writers in dept_mega.checkpoint_v1, as the previous release wrote them) is
refused under another layout with one line naming the converter; converted, it resumes under
another layout with the losses of the original resumed at its own layout (within 1e-6)."""
import os
import shutil

import pytest

from tests.mp_utils import run_distributed
from tests.reshard_utils import make_loop, read_losses
from tests.trainer_utils import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STD = {"dept": {"variant": "std"}, "optim": {"distributed": True}}


def _write_format1(rank, world, run_dir):
    import dept_mega.checkpoint as ck
    import dept_mega.manifest as manifest
    from dept_mega.checkpoint_format import whole
    from dept_mega.checkpoint_v1 import model_state
    from dept_mega.config import save_config
    ck.FORMAT = manifest.FORMAT = 1
    ck.model_entries = lambda trainer, optimizer=True, replicated=frozenset(): [
        whole(k, v) for k, v in model_state(trainer).items()]
    loop = make_loop(STD, run_dir, rank, data=2)
    loop.cfg.train.steps = 2
    if rank == 0:
        save_config(loop.cfg, os.path.join(run_dir, "config.yaml"))
    loop.run()


def _resume(rank, world, run_dir, data, tensor, expect_refusal=False):
    from dept_mega.manifest import CheckpointError
    loop = make_loop(STD, run_dir, rank, data=data, tensor=tensor, save=False)  # (its step 4: read by nothing)
    if expect_refusal:
        with pytest.raises(CheckpointError) as err:
            loop.checkpointer.load(loop)
        return str(err.value)
    assert loop.checkpointer.load(loop) == 2
    loop.writer.resume_at(2)
    loop.run()
    return None


@pytest.mark.timeout(400)
def test_format1_checkpoint_converts_and_resumes_under_another_layout(tmp_path, monkeypatch, capsys):
    run, same = str(tmp_path / "run"), str(tmp_path / "same")
    run_distributed(_write_format1, 2, args=(run,), timeout=200)
    step = os.path.join(run, "checkpoints", "step_2")
    with open(os.path.join(step, "manifest.json")) as f:
        assert '"format": 1' in f.read()
    shutil.copytree(run, same)
    # before conversion: one line naming the converter
    msg = run_distributed(_resume, 2, args=(run, 1, 2, True), timeout=200)[0]
    assert "format 1" in msg and f"tools/convert_checkpoint.py --run-dir {run} --step 2" in msg and "\n" not in msg
    import tools.convert_checkpoint as cc
    from dept_mega.manifest import CheckpointError
    capsys.readouterr()
    # an earlier conversion's backup: refused before anything is written
    os.makedirs(step + ".format1")
    assert cc.main([step]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {step}.format1 exists"), err
    assert not os.path.exists(step + ".convert.tmp")
    os.rmdir(step + ".format1")
    # a failure part way leaves no temporary directory (and the checkpoint as it was)
    copy = str(tmp_path / "copy")

    def fail(*_):
        raise CheckpointError("disk full")
    with monkeypatch.context() as m:
        m.setattr(cc, "seal", fail)
        assert cc.main([step, "--output", copy]) == 2
    assert capsys.readouterr().err == "error: disk full\n"
    assert not os.path.exists(copy) and not os.path.exists(copy + ".convert.tmp")
    # --output: a format-2 copy, the original left as it is
    same_step = os.path.join(same, "checkpoints", "step_2")
    assert cc.main([same_step, "--output", copy]) == 0, capsys.readouterr().err
    for d, fmt in ((copy, 2), (same_step, 1)):
        with open(os.path.join(d, "manifest.json")) as f:
            assert f'"format": {fmt}' in f.read(), d
    assert not os.path.exists(same_step + ".format1")
    # the design's command line ``python tools/convert_checkpoint.py RUN/checkpoints/step_N``: in
    # place; run as a script, in this process (a process of its own would only add its imports: ~4 s
    # of CPU); the --run-dir form: the test below
    capsys.readouterr()
    assert run_script(os.path.join(ROOT, "tools", "convert_checkpoint.py"), step,
                      monkeypatch=monkeypatch) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith(f"converted {step} to checkpoint format 2")
    with open(os.path.join(step, "manifest.json")) as f:
        assert '"format": 2' in f.read()
    with open(os.path.join(run, "checkpoints", "latest")) as f:
        assert f.read().strip() == "2"
    assert os.path.isdir(step + ".format1")
    assert cc.main([step]) == 2  # once converted: nothing to convert
    assert "is in format 2, not 1" in capsys.readouterr().err
    # the original at its own layout (data 2, distributed optimizer); the converted one under tensor 2
    run_distributed(_resume, 2, args=(same, 2, 1), timeout=200)
    run_distributed(_resume, 2, args=(run, 1, 2), timeout=200)
    got, want = read_losses(run), read_losses(same)
    assert [s for s in got if s > 2] == [s for s in want if s > 2] == [3, 4]
    for s in (3, 4):
        assert got[s] == pytest.approx(want[s], rel=1e-6, abs=0), (s, got[s], want[s])


# GLOB, 2 groups, Nesterov, int8 error feedback (blocks of 2: both layouts quantise the same pairs)
GLOB_EF = {"dept": {"variant": "glob", "local_steps": 2, "outer_comm_dtype": "int8", "outer_error_feedback": True,
                    "outer_quant_block": 2, "outer_optimizer": {"name": "nesterov", "lr": 0.7, "momentum": 0.9}}}


def _write_format1_dept(rank, world, run_dir):
    """A format-1 DEPT checkpoint as the previous release wrote it: positional keys (model,
    optimizer, the outer state and the per-group residuals: dept_mega.checkpoint_v1's writers)
    and the round driver's state in a hook file per (tp, pp, group) (GLOB: its round position)."""
    import json
    import torch
    import torch.distributed as dist
    import dept_mega.checkpoint as ck
    import dept_mega.manifest as manifest
    from dept_mega.checkpoint_format import whole
    from dept_mega.checkpoint_v1 import group_state_tensors, model_state, outer_state_tensors
    from dept_mega.config import save_config
    ck.FORMAT = manifest.FORMAT = 1
    ck.model_entries = lambda trainer, optimizer=True, replicated=frozenset(): [
        whole(k, v) for k, v in model_state(trainer).items()]
    ck.outer_entries = lambda hooks, trainer: [whole(k, v) for k, v in outer_state_tensors(hooks, trainer).items()]
    ck.group_entries = lambda hooks, trainer: [whole(k, v) for k, v in group_state_tensors(hooks, trainer).items()]
    loop = make_loop(GLOB_EF, run_dir, rank, data=1)
    loop.cfg.train.steps = 2
    if rank == 0:
        save_config(loop.cfg, os.path.join(run_dir, "config.yaml"))
    loop.run()
    step = os.path.join(run_dir, "checkpoints", "step_2")
    hooks = loop.hooks
    torch.save({"round": hooks.plan.round, "installed": None, "in_round": False, "mark": {}, "store": {}},
               os.path.join(step, f"hooks_rank{rank}.pt"))
    dist.barrier()
    if rank == 0:
        for name in os.listdir(step):
            f = os.path.join(step, name)
            if name.startswith("group"):
                with open(f) as fh:
                    meta = json.load(fh)
                meta.pop("dept")
                with open(f, "w") as fh:
                    json.dump(meta, fh)
        with open(os.path.join(step, "layout.json")) as fh:
            layout = json.load(fh)
        with open(os.path.join(step, "layout.json"), "w") as fh:
            json.dump(dict(layout, per_rank_hooks=True, hooks_dp0=True), fh)
        manifest.seal(step, 2)
    dist.barrier()


def _resume_dept(rank, world, run_dir, tensor):
    loop = make_loop(GLOB_EF, run_dir, rank, data=1, tensor=tensor, save=False)  # (its step 4: read by nothing)
    assert loop.checkpointer.load(loop) == 2
    loop.writer.resume_at(2)
    loop.run()


@pytest.mark.timeout(400)
@pytest.mark.slow
def test_format1_dept_outer_state_converts(tmp_path):
    """A format-1 GLOB checkpoint (2 groups) with Nesterov outer state and int8 error-feedback
    residuals: converted, every outer tensor — θ_{t-1}, the momentum, each group's residuals —
    is the format-1 tensor under its global key (the positional key's group kept for the
    residuals, dropped for the state every group shares), the counters carried, the round
    position in group{g}.json; resumed under tensor 2 it continues with the losses of the
    original resumed at its own layout (within 1e-6)."""
    import json
    import torch
    from dept_mega.checkpoint_format import read_full, saved_keys
    from tools.convert_checkpoint import _read_all, main as convert
    run, same = str(tmp_path / "run"), str(tmp_path / "same")
    run_distributed(_write_format1_dept, 2, args=(run,), timeout=200)
    shutil.copytree(run, same)
    # the tool's main in this process (its command line: the test above)
    assert convert(["--run-dir", run]) == 0
    step = os.path.join(run, "checkpoints", "step_2")
    old = _read_all(step + ".format1")
    new = saved_keys(step)
    assert not [f for f in os.listdir(step) if f.startswith("hooks_rank")]
    for g in (0, 1):
        with open(os.path.join(step, f"group{g}.json")) as f:
            assert json.load(f)["dept"] == {"round": 0, "in_round": False, "installed": None, "store": {}}
    pairs = {}
    for key in old:
        parts = key.split("/")
        if parts[0] != "dept" or parts[-1] == "eager_known" or len(parts) < 4:
            continue
        group = parts[2] + "/" if parts[2].startswith("g") else ""
        name, kind = parts[-2], parts[-1]
        pairs[key] = f"dept/{parts[1]}/{group}{kind}/{name}"
    kinds = {k.split("/")[-1] for k in pairs}
    assert {"reference", "momentum", "residual"} <= kinds, kinds
    assert sum(k.split("/")[-1] == "residual" and "/g1/" in k for k in pairs) > 0
    got = read_full(step, sorted(set(pairs.values())))
    for k1, k2 in pairs.items():
        assert k2 in new, k2
        assert torch.equal(got[k2].reshape(old[k1].shape), old[k1]), (k1, k2)
    for c in ("outer_body", "outer_embedding"):
        key = f"dept/{c}/steps"
        assert torch.equal(read_full(step, [key])[key], old[key]), key
    run_distributed(_resume_dept, 2, args=(same, 1), timeout=300)
    run_distributed(_resume_dept, 4, args=(run, 2), timeout=300)
    got_l, want_l = read_losses(run), read_losses(same)
    assert [s for s in got_l if s > 2] == [s for s in want_l if s > 2] == [3, 4]
    for s in (3, 4):
        assert got_l[s] == pytest.approx(want_l[s], rel=1e-6, abs=0), (s, got_l[s], want_l[s])
