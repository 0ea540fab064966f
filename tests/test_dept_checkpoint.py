"""Checkpoint / resume of DEPT state through dept_mega.checkpoint: a run resumed from step 2
ends bit-identical to the uninterrupted run (GLOB with a Nesterov outer optimizer: θ_{t-1} and
the momentum must come back; SPEC and TRIM: per-source state and φ too)."""
import io
import json

import pytest
import torch

from tests.dept_utils import (SavingOnly, SyntheticSource, allowed_ids, body_vector, emb_state, source_infos,
                              tiny_config)
from tests.mp_utils import run_distributed


def _make(cfg, run_dir, rank, saves=None):
    """The run's TrainLoop and Checkpointer; ``saves``: the only steps it writes checkpoints
    of (SavingOnly; None: every one the loop saves)."""
    from dept_mega.checkpoint import Checkpointer
    from dept_mega.dept.driver import DeptHooks
    from dept_mega.loop import TrainLoop
    from dept_mega.metrics import MetricsWriter
    from dept_mega.parallel.groups import build_groups
    from dept_mega.trainer import Trainer
    pg = build_groups(cfg.parallel.tensor, cfg.parallel.data, cfg.parallel.pipeline)
    infos = source_infos(2, trim=cfg.dept.variant == "trim")
    torch.manual_seed(cfg.train.seed)
    trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=infos[0].vocab_size)
    hooks = DeptHooks(cfg, pg, trainer, torch.device("cpu"), infos)
    by_name = {s.name: s for s in infos}

    def make_iterator(name):
        # a new batch every step: the resumed run must also continue each source's data
        return SyntheticSource(cfg, infos.index(by_name[name]) + 1, allowed_ids(by_name[name]),
                               pg.dp_rank, pg.dp_size)

    writer = MetricsWriter(run_dir, enabled=rank == 0, stream=io.StringIO())
    ck = Checkpointer(run_dir) if saves is None else SavingOnly(run_dir, saves)
    return TrainLoop(cfg, pg, trainer, hooks, writer, make_iterator, checkpointer=ck), ck


def _resume_worker(rank, world, over, run_dir, step=2, saves=None, also=()):
    """Train the whole run, then resume a second loop from checkpoint ``step`` and finish:
    (the uninterrupted run's body and embeddings, the resumed run's). The uninterrupted run
    writes the checkpoints of ``saves`` only (default: ``step``'s and ``also``'s), the resumed
    one none: the others would be read by nothing. ``also``: more checkpoint steps resumed from
    the same way, their resumed states appended to the result."""
    cfg = tiny_config(over)
    loop, _ = _make(cfg, run_dir, rank, saves=[step, *also] if saves is None else saves)
    loop.run()
    full = {"body": body_vector(loop.trainer), "emb": emb_state(loop.trainer)}
    out = [full]
    for at in (step, *also):
        loop2, ck = _make(cfg, run_dir, rank, saves=())
        assert ck.load(loop2, step=at) == at
        loop2.run()
        out.append({"body": body_vector(loop2.trainer), "emb": emb_state(loop2.trainer)})
    return tuple(out)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_glob_resume_restores_outer_state(tmp_path):
    # with dropout: group 1 resumes from the dropout streams group 0 saved (one file per tp/pp)
    over = {"dept": {"variant": "glob", "local_steps": 2,
                     "outer_optimizer": {"name": "nesterov", "lr": 0.7, "momentum": 0.9}},
            "model": {"hidden_dropout": 0.1, "attention_dropout": 0.1},
            "train": {"steps": 6, "save_interval": 2, "eval_interval": 0}}
    res = run_distributed(_resume_worker, 2, args=(over, str(tmp_path)), timeout=200)
    for full, resumed in res:
        assert torch.equal(full["body"], resumed["body"])


def test_load_weights_of_an_earlier_step_installs_that_steps_source(tmp_path):
    """``evaluate --step S`` / ``Checkpointer.load(step=S)`` with S older than ``latest``: the
    group trained another source at S (SPEC-OPT: another vocabulary size), whose embeddings
    must be installed before the weights load in place. Single process, K=2 sources, G=1."""
    from dept_mega.checkpoint import load_weights
    from tests.dept_utils import emb_state
    cfg = tiny_config({"dept": {"variant": "spec_opt", "local_steps": 1},
                       "train": {"steps": 4, "save_interval": 1, "eval_interval": 0, "run_dir": str(tmp_path)}})
    loop, _ = _make_opt(cfg, str(tmp_path))
    saved = {}
    orig_round_end = loop.hooks.round_end

    def round_end(lp, r):
        saved[loop.trainer.step] = (loop.hooks.installed, emb_state(loop.trainer))
        return orig_round_end(lp, r)

    loop.hooks.round_end = round_end
    loop.run()
    # rounds 0-2 train s0 (vocabulary 60), round 3 trains s1 (200): latest = step 4
    assert saved[2][0] == "s0" and saved[4][0] == "s1"
    loop2, _ = _make_opt(cfg, str(tmp_path))  # pre-installs latest's source (s1)
    load_weights(loop2.trainer, str(tmp_path), 2, hooks=loop2.hooks, optimizer=False)
    assert loop2.hooks.installed == "s0"
    got = emb_state(loop2.trainer)
    assert got.keys() == saved[2][1].keys()
    for k in got:
        assert torch.equal(got[k], saved[2][1][k]), k


def _make_opt(cfg, run_dir):
    from dept_mega.checkpoint import Checkpointer
    from dept_mega.dept.driver import DeptHooks
    from dept_mega.loop import TrainLoop
    from dept_mega.metrics import MetricsWriter
    from dept_mega.parallel.groups import build_groups
    from dept_mega.trainer import Trainer
    pg = build_groups(cfg.parallel.tensor, cfg.parallel.data, cfg.parallel.pipeline)
    infos = source_infos(2, vocabs=(60, 200))
    torch.manual_seed(cfg.train.seed)
    trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=infos[0].vocab_size)
    hooks = DeptHooks(cfg, pg, trainer, torch.device("cpu"), infos)
    by_name = {s.name: s for s in infos}

    def make_iterator(name):
        return SyntheticSource(cfg, infos.index(by_name[name]) + 1, allowed_ids(by_name[name]),
                               pg.dp_rank, pg.dp_size)

    writer = MetricsWriter(run_dir, enabled=True, stream=io.StringIO())
    return TrainLoop(cfg, pg, trainer, hooks, writer, make_iterator, checkpointer=Checkpointer(run_dir)), None


def _as_if_written_by(step_path, **layout_changes):
    """Edit a checkpoint's layout.json as if another layout had written it: the per-group
    files that layout has (copies), and a new manifest."""
    import json
    import shutil
    from dept_mega.manifest import seal
    layout_path = step_path / "layout.json"
    layout = dict(json.loads(layout_path.read_text()), **layout_changes)
    layout_path.write_text(json.dumps(layout))
    for g in range(1, layout["groups"]):
        shutil.copy(step_path / "group0.json", step_path / f"group{g}.json")
    seal(str(step_path), int(step_path.name.split("_")[1]))


def test_another_number_of_groups_is_refused_inside_a_round(tmp_path):
    """Inside a round the groups hold different bodies: a checkpoint there loads only with its
    own number of groups (ConfigError naming 'parallel', the step and dept.local_steps); so
    does a TRIM checkpoint inside a round (its per-rank hook state is joined, but the groups'
    compact tables and bodies differ there). (At a round boundary TRIM loads:
    tests/test_regroup.py.)"""
    from dept_mega.checkpoint import load_weights
    from dept_mega.config import ConfigError
    cfg = tiny_config({"dept": {"variant": "spec", "local_steps": 2, "reset_inner_optimizer": True},
                       "train": {"steps": 2, "save_interval": 1, "eval_interval": 0, "run_dir": str(tmp_path)}})
    loop, _ = _make_opt(cfg, str(tmp_path))
    loop.run()
    _as_if_written_by(tmp_path / "checkpoints" / "step_1", groups=2)
    with pytest.raises(ConfigError, match=r"'parallel'.*step 1 is inside a round \(dept.local_steps=2\).*"
                                          "launch 2 processes"):
        load_weights(loop.trainer, str(tmp_path), 1, hooks=loop.hooks, optimizer=False)
    trim = tmp_path / "trim"
    cfg = tiny_config({"dept": {"variant": "trim", "local_steps": 2, "reset_inner_optimizer": True},
                       "train": {"steps": 2, "save_interval": 1, "eval_interval": 0, "run_dir": str(trim)}})
    loop, _ = _make_trim(cfg, str(trim))
    loop.run()
    _as_if_written_by(trim / "checkpoints" / "step_1", groups=2)
    with pytest.raises(ConfigError, match=r"'parallel'.*2 source group.*step 1 is inside a round "
                                          r"\(dept.local_steps=2\)"):
        load_weights(loop.trainer, str(trim), 1, hooks=loop.hooks, optimizer=False)


def _make_trim(cfg, run_dir):
    from dept_mega.checkpoint import Checkpointer
    from dept_mega.dept.driver import DeptHooks
    from dept_mega.loop import TrainLoop
    from dept_mega.metrics import MetricsWriter
    from dept_mega.parallel.groups import build_groups
    from dept_mega.trainer import Trainer
    pg = build_groups(cfg.parallel.tensor, cfg.parallel.data, cfg.parallel.pipeline)
    infos = source_infos(2, trim=True)
    torch.manual_seed(cfg.train.seed)
    trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=infos[0].vocab_size)
    hooks = DeptHooks(cfg, pg, trainer, torch.device("cpu"), infos)
    by_name = {s.name: s for s in infos}

    def make_iterator(name):
        return SyntheticSource(cfg, infos.index(by_name[name]) + 1, allowed_ids(by_name[name]),
                               pg.dp_rank, pg.dp_size)

    writer = MetricsWriter(run_dir, enabled=True, stream=io.StringIO())
    return TrainLoop(cfg, pg, trainer, hooks, writer, make_iterator, checkpointer=Checkpointer(run_dir)), None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant,async_save", [("glob", False), ("trim", False), ("spec", False),
                                                ("spec_opt", False), ("trim", True)])
def test_mid_round_checkpoint_resumes_bit_exactly(tmp_path, variant, async_save):
    """A checkpoint at step 3 of rounds of 2 steps (inside round 1, as a preemption writes
    it): the resumed run ends bit-identical to the uninterrupted one (body, the installed
    embeddings), with an Adam outer optimizer whose state must come back. Also written by
    train.async_save's thread (host copies of the DEPT state, taken at the step). SPEC and
    TRIM (their per-source state, TRIM's φ) also resume from the round boundary of step 2 the
    same way."""
    also = (2,) if variant in ("spec", "trim") and not async_save else ()
    over = {"dept": {"variant": variant, "local_steps": 2,
                     "outer_optimizer": {"name": "adam", "lr": 0.5, "betas": [0.9, 0.99]}},
            "train": {"steps": 6, "save_interval": 1 if also else 3, "eval_interval": 0, "async_save": async_save}}
    res = run_distributed(_resume_worker, 2, args=(over, str(tmp_path), 3, None, also), timeout=200)
    for full, *resumed in res:
        assert len(resumed) == 1 + len(also)
        for got in resumed:
            assert torch.equal(full["body"], got["body"])
            assert full["emb"].keys() == got["emb"].keys()
            for k in full["emb"]:
                assert torch.equal(full["emb"][k], got["emb"][k]), k


def _lean_worker(rank, world, run_dir, data):
    from dept_mega.checkpoint import Checkpointer
    from dept_mega.dept.driver import DeptHooks
    from dept_mega.loop import TrainLoop
    from dept_mega.metrics import MetricsWriter
    from dept_mega.parallel.groups import build_groups
    from dept_mega.trainer import Trainer
    cfg = tiny_config({"dept": {"variant": "glob", "local_steps": 1,
                                "outer_optimizer": {"name": "adam", "lr": 0.5}},
                       "model": {"hidden_size": 64, "ffn_hidden_size": 128},
                       "parallel": {"data": data},
                       "train": {"steps": 2, "save_interval": 0, "eval_interval": 0, "run_dir": run_dir}})
    pg = build_groups(1, data, 1)
    infos = source_infos(2)
    torch.manual_seed(cfg.train.seed)
    trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=infos[0].vocab_size)
    hooks = DeptHooks(cfg, pg, trainer, torch.device("cpu"), infos)
    by_name = {s.name: s for s in infos}
    writer = MetricsWriter(run_dir, enabled=rank == 0, stream=io.StringIO())
    loop = TrainLoop(cfg, pg, trainer, hooks, writer,
                     lambda n: SyntheticSource(cfg, infos.index(by_name[n]) + 1, allowed_ids(by_name[n]),
                                               pg.dp_rank, pg.dp_size),
                     checkpointer=Checkpointer(run_dir))
    loop.run()
    return loop.checkpointer.last_size


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_glob_checkpoint_size_does_not_grow_with_data_parallel_size(tmp_path):
    """GLOB with 2 groups and an Adam outer optimizer: the outer state (θ_{t-1}, moments of the
    body and the embeddings) is saved once per checkpoint under dept/... keys without group or
    replica, so doubling parallel.data adds only the per-rank bookkeeping files (< 2 %), where
    per-rank files used to hold G·D copies of it."""
    import os

    import torch.distributed.checkpoint as dcp
    sizes, data_bytes = {}, {}
    for data in (1, 2):
        run = str(tmp_path / f"d{data}")
        res = run_distributed(_lean_worker, 2 * data, args=(run, data), timeout=200)
        sizes[data] = res[0]
        step = os.path.join(run, "checkpoints", "step_2")
        data_bytes[data] = sum(os.path.getsize(os.path.join(step, f)) for f in os.listdir(step) if f.endswith(".distcp"))
        keys = dcp.FileSystemReader(step).read_metadata().state_dict_metadata
        outer = [k for k in keys if k.startswith("dept/")]
        assert "dept/outer_body/steps" in keys and "dept/outer_embedding/steps" in keys
        assert any(k.startswith("dept/outer_body/exp_avg_sq/body.") for k in outer) \
            and not any("/g0/" in k or "/g1/" in k for k in outer)
        assert not [f for f in os.listdir(step) if f.startswith("hooks_rank")]
    assert abs(data_bytes[2] - data_bytes[1]) <= 0.005 * data_bytes[1], data_bytes
    assert abs(sizes[2] - sizes[1]) <= 0.02 * sizes[1], sizes


def test_eager_start_estimates_are_saved_per_parameter_and_group(tmp_path):
    """The eager start's estimates E (dept.outer_overlap_rule: eager) are a chunk per rank of
    its group's flattened body: saved per parameter under DCP keys that carry the group
    (dept/{category}/g{g}/..., layout.json: outer_group_keys), so a checkpoint with them
    reshards under another layout and loads under another number of groups (E reset there).
    A resumed run gets E and which parts know a previous mean back exactly; one resumed
    without the eager start logs that the estimates were not loaded."""
    from dept_mega.checkpoint import check_layout, load_weights
    import torch.distributed.checkpoint as dcp
    cfg = tiny_config({"dept": {"variant": "glob", "local_steps": 2, "outer_overlap": True, "outer_delay": 1,
                                "outer_overlap_rule": "eager", "reset_inner_optimizer": True},
                       "train": {"steps": 4, "save_interval": 2, "eval_interval": 0, "run_dir": str(tmp_path)}})
    loop, _ = _make(cfg, str(tmp_path), 0)
    loop.run()
    hooks = loop.hooks
    assert hooks.regroup_refusal(4, 2) is None
    step = sorted((tmp_path / "checkpoints").glob("step_*"))[0]  # step 3: after the step-2 sync was applied
    layout = json.loads((step / "layout.json").read_text())
    assert layout["outer_group_keys"]
    keys = dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata
    syncs = hooks.outer_syncs()
    assert {k.split("/")[1] for k in keys if k.split("/")[2:4] == ["g0", "eager_base"]} == set(syncs)
    assert {k for k in keys if k.endswith("/eager_known")} == {f"dept/{c}/g0/eager_known" for c in syncs}
    # the state at the save, from a fresh launch that loads it
    loop2, _ = _make(cfg, str(tmp_path), 0)
    load_weights(loop2.trainer, str(tmp_path), int(step.name.split("_")[1]), hooks=loop2.hooks)
    for k, s in loop2.hooks.outer_syncs().items():  # (one group: E = Δ̄ − Δ_g / 1 = 0)
        assert all(s.eager_known), (k, s.eager_known)  # every part synced once before the save
    assert check_layout(loop2.trainer, str(step), hooks=loop2.hooks) == (False, False)
    # resumed with the eager start switched off: the saved estimates are not loaded, and that is logged
    plain = tiny_config({"dept": {"variant": "glob", "local_steps": 2, "outer_overlap": True, "outer_delay": 1,
                                  "outer_overlap_rule": "correction", "reset_inner_optimizer": True},
                         "train": {"steps": 4, "save_interval": 2, "eval_interval": 0, "run_dir": str(tmp_path)}})
    loop4, _ = _make(plain, str(tmp_path), 0)
    notes: list = []
    load_weights(loop4.trainer, str(tmp_path), int(step.name.split("_")[1]), hooks=loop4.hooks, notes=notes)
    assert any(n.startswith("dept.outer_overlap_rule:") and "not loaded" in n for n in notes), notes
    notes = []
    load_weights(loop2.trainer, str(tmp_path), int(step.name.split("_")[1]), hooks=loop2.hooks, notes=notes)
    assert not any("not loaded" in n for n in notes), notes


@pytest.mark.parametrize("fragments", [1, 2])
def test_with_fragments_a_run_keeps_its_number_of_groups(tmp_path, fragments):
    """With dept.outer_fragments > 1 the groups' bodies differ at a round boundary too (below:
    fragment 0 is saved per group at step 6), so a checkpoint does not load under another
    number of groups: new groups took their weights from old group 0 and their fp32 masters
    and moments from old group g mod G_old (a review's finding). Refused naming the key."""
    cfg = tiny_config({"dept": {"variant": "glob", "local_steps": 2, "outer_fragments": fragments},
                       "train": {"steps": 2, "eval_interval": 0, "run_dir": str(tmp_path)}})
    loop, _ = _make(cfg, str(tmp_path), 0)
    refusal = loop.hooks.regroup_refusal(4, 2)
    if fragments == 1:
        assert refusal is None
    else:
        assert refusal[0] == "dept.outer_fragments" and "the checkpoint has 2, this launch 1" in refusal[1], refusal


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fragments", [1, 2])
def test_round_boundary_checkpoint_writes_the_shared_body_once(tmp_path, fragments):
    """GLOB, 2 groups, rounds of 2 steps, checkpoints at steps 3 (inside round 1) and 6 (a
    round boundary, not the run's last step). At step 6 every parameter the round's blocking
    sync made the same in all groups (the body and GLOB's embeddings) has one group-free key,
    no g0/g1 copies; the inner optimizer's moments stay per group; with 2 fragments, fragment
    0 and the embeddings (in 2 parts, part 0 with fragment 0: synchronised before step 5,
    trained locally at step 6) stay per group. At step 3 every
    parameter is per group. Resuming from step 6 ends bit-identical to the uninterrupted run."""
    import torch.distributed.checkpoint as dcp
    over = {"dept": {"variant": "glob", "local_steps": 2, "outer_fragments": fragments,
                     "outer_optimizer": {"name": "adam", "lr": 0.5, "betas": [0.9, 0.99]}},
            "train": {"steps": 8, "save_interval": 3, "eval_interval": 0}}
    res = run_distributed(_resume_worker, 2, args=(over, str(tmp_path), 6, [3, 6]), timeout=200)
    for full, resumed in res:
        assert torch.equal(full["body"], resumed["body"])
        for k in full["emb"]:
            assert torch.equal(full["emb"][k], resumed["emb"][k]), k

    def model_keys(step):
        md = dcp.FileSystemReader(str(tmp_path / "checkpoints" / f"step_{step}")).read_metadata()
        return [k for k in md.state_dict_metadata if k.startswith("model/")], list(md.state_dict_metadata)

    mid, _ = model_keys(3)
    assert mid and all(k.startswith(("model/g0/", "model/g1/")) for k in mid), mid
    names = {k.split("/", 2)[2] for k in mid}
    keys, every = model_keys(6)
    frag0 = {n for n in names if fragments == 2 and n.startswith(("body.layers.0.", "embeddings."))}
    assert frag0 or fragments == 1
    for n in names:
        copies = [k for k in keys if k in (f"model/{n}", f"model/g0/{n}", f"model/g1/{n}")]
        assert copies == ([f"model/g0/{n}", f"model/g1/{n}"] if n in frag0 else [f"model/{n}"]), (n, copies)
    moments = [k for k in every if k.startswith("optim/body/exp_avg/")]
    assert moments and all("/model/g0/" in k or "/model/g1/" in k for k in moments), moments
