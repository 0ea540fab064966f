"""A DEPT checkpoint taken at a round boundary loads with another number of source groups G
(another process count): the body, GLOB's embeddings and the outer state are the same in
every group there, the sources' own state (SPEC: embeddings) is keyed by source, and the
schedule continues from the checkpoint's history (``RoundScheduler.rebase``); inner optimizer
state owned by a group goes to new group g from old group g mod G_old; another tensor size may
change in the same launch."""
import io

import pytest
import torch

from tests.dept_utils import SyntheticSource, allowed_ids, body_vector, source_infos, tiny_config
from tests.mp_utils import run_distributed


def test_rebased_schedule_continues_the_same_plans():
    """Rebasing a scheduler at round r with its own history gives the plans it would have
    given anyway (so a run resumed with its own number of groups is unchanged by this)."""
    from dept_mega.dept.rounds import RoundScheduler
    full = RoundScheduler(5, 2, seed=3, sampling="proportional", sizes=[1, 2, 3, 4, 5])
    rebased = RoundScheduler(5, 2, seed=3, sampling="proportional", sizes=[1, 2, 3, 4, 5])
    p = full.plan(4)
    rebased.rebase(4, p.last_group, p.rounds_before)
    for r in range(4, 12):
        assert rebased.plan(r) == full.plan(r)
        for k in range(5):
            assert rebased.steps_trained(k, r * 3 + 1, 3) == full.steps_trained(k, r * 3 + 1, 3)
    with pytest.raises(ValueError, match="rebased"):
        rebased.plan(3)
    assert rebased.origin() == {"round": 4, "last_group": list(p.last_group), "rounds_before": list(p.rounds_before)}


def _make(cfg, run_dir, K, tensor=1, data=1):
    vocabs = (60, 200, 96, 120) if cfg.dept.variant == "spec_opt" else None
    from dept_mega.checkpoint import Checkpointer
    from dept_mega.dept.driver import DeptHooks
    from dept_mega.loop import TrainLoop
    from dept_mega.metrics import MetricsWriter
    from dept_mega.parallel.groups import build_groups
    from dept_mega.trainer import Trainer
    pg = build_groups(tensor, data, 1)  # G = world size / (tensor x data)
    infos = source_infos(K, vocabs=vocabs, trim=cfg.dept.variant == "trim")
    torch.manual_seed(cfg.train.seed)
    trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=infos[0].vocab_size)
    hooks = DeptHooks(cfg, pg, trainer, torch.device("cpu"), infos)
    by_name = {s.name: s for s in infos}

    def make_iterator(name):
        return SyntheticSource(cfg, infos.index(by_name[name]) + 1, allowed_ids(by_name[name]), pg.dp_rank, pg.dp_size)

    writer = MetricsWriter(run_dir, enabled=False, stream=io.StringIO())
    loop = TrainLoop(cfg, pg, trainer, hooks, writer, make_iterator, checkpointer=Checkpointer(run_dir))
    losses = []
    step = trainer.train_step

    def recording(batch):
        res = step(batch)
        losses.append(float(res.loss))
        return res

    trainer.train_step = recording
    return loop, losses


def _held(loop) -> dict[str, dict]:
    """The per-source state this rank holds (installed and stored), by source: embeddings,
    their AdamW moments, the body's AdamW moments when kept per source. (TRIM: not the
    compact tables' weights, which are refilled from φ when a source is installed.)"""
    import copy
    h, tr = loop.hooks, loop.trainer
    trim = h.strategy.name == "trim"

    def entry(embs, opt, body):
        out = {} if trim else {f"{c}.{k}": v.clone() for c, e in enumerate(embs) if e is not None
                               for k, v in e.state_dict().items()}
        if opt is not None:
            out["optimizer"] = copy.deepcopy(opt.state_dict()["state"])
        if body is not None:
            out["body_optimizer"] = copy.deepcopy(body["state"])
        return out

    out = {}
    if h.installed is not None and h.strategy.source_embeddings:
        reset = loop.cfg.dept.reset_inner_optimizer
        out[h.installed] = entry(tr.embeddings(), None if reset else tr.embedding_optimizer,
                                 tr.body_optimizer.state_dict() if h.body_per_source else None)
    for name in h.store.names():
        st = h.store.get(name)
        out[name] = entry(st.embeddings, st.optimizer if not loop.cfg.dept.reset_inner_optimizer else None,
                          st.body_optimizer)
    return out


def _outer(loop) -> dict:
    """The outer state of every FlatSync; TRIM's φ (whole) with its per-row outer state and the
    learned positions' outer state too."""
    out = {cat: s.param_state() for cat, s in sorted(loop.hooks.outer_syncs().items())}
    st = loop.hooks.strategy
    if st.name == "trim":
        out["phi"] = st.full_table("phi")
        out["phi_optimizer"] = st.phi.optimizer.state_dict()["state"]  # one group, one rank: the whole table
        if st.position_sync is not None:
            out["positions"] = st.positions.detach().clone()
            out["position_sync"] = st.position_sync.param_state()
    return out


def _group_buffers(loop) -> dict:
    """Every FlatSync's error-feedback residuals and eager estimates, per parameter (group_state)."""
    return {cat: s.group_state() for cat, s in sorted(loop.hooks.outer_syncs().items())}


def _inner(loop) -> dict:
    """The body optimizer's AdamW state (moments, steps) as the trainer holds it, and GLOB's
    shared embeddings' (the installed source's own under SPEC / SPEC-OPT / TRIM: not here)."""
    import copy
    out = {"body": copy.deepcopy(loop.trainer.body_optimizer.state_dict()["state"])}
    if loop.hooks.strategy.name == "glob":
        out["embeddings"] = copy.deepcopy(loop.trainer.embedding_optimizer.state_dict()["state"])
    return out


def _moments(inner: dict) -> list:
    return [v for part in inner.values() for i in sorted(part) for k, v in sorted(part[i].items())
            if torch.is_tensor(v) and v.dim() > 0]


def _first_phase(rank, world, over, run_dir, K, step):
    cfg = tiny_config(dict(over, train=dict(over["train"], steps=step, run_dir=run_dir)))
    loop, _ = _make(cfg, run_dir, K)
    loop.run()  # its last step is a round boundary, where the run ends with a save
    return {"body": body_vector(loop.trainer), "held": _held(loop), "outer": _outer(loop),
            "buffers": _group_buffers(loop), "inner": _inner(loop),
            "emb": {n: p.detach().clone() for n, p in loop.trainer.stages[0].named_parameters()
                    if n.startswith("embeddings.")},
            "positions": {n: loop.hooks.source_steps(n, step) for n in loop.hooks.names}}


def _second_phase(rank, world, over, run_dir, native_dir, K, steps, data=1):
    over = dict(over, parallel={"data": data})
    cfg = tiny_config(dict(over, train=dict(over["train"], steps=steps, run_dir=run_dir)))
    loop, losses = _make(cfg, run_dir, K, data=data)
    step = loop.checkpointer.load(loop)
    state = {"step": step, "dp_rank": loop.trainer.pg.dp_rank, "body": body_vector(loop.trainer), "held": _held(loop), "outer": _outer(loop),
             "buffers": _group_buffers(loop), "notes": list(loop.checkpointer.notes), "inner": _inner(loop),
             "emb": {n: p.detach().clone() for n, p in loop.trainer.stages[0].named_parameters()
                     if n.startswith("embeddings.")},
             "positions": {n: loop.hooks.source_steps(n, step) for n in loop.hooks.names}}
    from dept_mega.checkpoint import Checkpointer
    Checkpointer(native_dir).save(loop)  # the same state, written in this launch's own layout
    loop.checkpointer = None  # (its later checkpoints are read by nothing)
    loop.run()
    # reference: a run of this layout started from that native checkpoint (no change of groups)
    cfg2 = tiny_config(dict(over, train=dict(over["train"], steps=steps, run_dir=native_dir)))
    loop2, losses2 = _make(cfg2, native_dir, K, data=data)
    assert loop2.checkpointer.load(loop2) == step
    loop2.checkpointer = None  # (the reference's own checkpoints are read by nothing)
    loop2.run()
    return dict(state, losses=losses, reference=losses2, body_end=body_vector(loop.trainer),
                body_end_ref=body_vector(loop2.trainer))


def _same(a, b, what):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), what
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            _same(a[k], b[k], f"{what}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{what}[{i}]")
    else:
        assert a == b, what


@pytest.mark.slow
@pytest.mark.timeout(400)
# (GLOB's plain G 4 -> 2 is glob_ef_eager_group_state without error feedback, the eager start and
# the group-owned inner state: not run separately, for the suite's time)
# (SPEC-OPT's G with D or the distributed optimizer: tests/test_checkpoint_property.py compares its state in full)
@pytest.mark.parametrize("variant,g_old,g_new", [("spec_group_state", 2, 4), ("trim_distributed_ef_eager", 4, 2),
                                                  ("glob_ef_eager_group_state", 4, 2)])
def test_resume_with_another_number_of_groups(tmp_path, variant, g_old, g_new):
    """Train 2 rounds under G=g_old (K=4 sources, Nesterov outer optimizer; TRIM with
    dept.reset_inner_optimizer), save at the round boundary, resume under G=g_new for 2 rounds.
    ``spec_group_state``: SPEC without either (the body's AdamW state belongs to
    the group, dept.reset_inner_optimizer: false, the default): new group g continues with old
    group g mod G_old's, as a replica joining a DiLoCo job receives a peer's, and the load logs
    it.

    What "equal" means: (1) the state the G=g_new run holds after loading is the G=g_old
    run's, tensor for tensor — the body, GLOB's embeddings, the outer reference and momentum
    on every rank; every source's own embeddings (SPEC) held by exactly one new group; every
    source's data position (steps trained so far); (2) the G=g_new run then continues exactly
    like a G=g_new run started from that state without any change of layout: the same state
    saved by the resumed run in its own layout (its schedule's history included) and resumed
    from there by a fresh launch; the losses of every step agree within 1e-6 (fp32, CPU).

    ``trim_distributed_ef_eager``: TRIM (learned positions) with the distributed optimizer,
    int8 error feedback and the eager start, G 4 -> 2: φ, its per-row Nesterov momentum and the
    positions' outer state are the same in every group at a round boundary and come from old
    group 0's files; each source's compact-table AdamW state (pieces) goes with the source to
    its new group, whose installed source's tables are filled from φ; the body's residuals and
    estimates as GLOB's below.
    ``glob_ef_eager_group_state``: GLOB with int8 error feedback, the eager start (τ = 1) and
    group-owned inner state (the body's and the embeddings' AdamW state, as for
    ``spec_group_state``), G 4 -> 2: the
    residuals and estimates are saved per parameter and group; every new group's residual is
    the mean of the old groups' (Σ_g r_g / G_old: the mass the mean over groups has not yet
    received stays in the next mean), the estimates are reset (no part knows a previous mean:
    the next sync of each starts from the local weights), and the load logs one line for each
    (``Checkpointer.notes``)."""
    data = 1
    group_state = variant.endswith("_group_state")
    variant = variant.removesuffix("_group_state")
    ef_eager = variant.endswith("_ef_eager")
    variant = variant.removesuffix("_ef_eager")
    distributed = variant.endswith("_distributed")
    variant = variant.removesuffix("_distributed")
    over = {"dept": {"variant": variant, "local_steps": 2, "outer_optimizer": {"name": "nesterov", "lr": 0.7,
                                                                               "momentum": 0.9}},
            "train": {"save_interval": 0, "eval_interval": 0}}
    if ef_eager:
        over["dept"].update(outer_comm_dtype="int8", outer_error_feedback=True, outer_overlap=True, outer_delay=1,
                            outer_overlap_rule="eager")
    if distributed:
        over["optim"] = {"distributed": True, "grad_bucket_size": 500}
    if variant == "trim":
        over["model"] = {"position_embedding": "learned"}
    if variant == "spec_opt":
        over["dept"]["body_optimizer_state"] = "source"
    elif not group_state:
        over["dept"]["reset_inner_optimizer"] = True
    K = 4
    run_dir, native = str(tmp_path / "run"), str(tmp_path / "native")
    first = run_distributed(_first_phase, g_old, args=(over, run_dir, K, 4), timeout=200)
    second = run_distributed(_second_phase, g_new * data, args=(over, run_dir, native, K, 8, data), timeout=300)
    held_before = {}
    for r in first:
        for name, sd in r["held"].items():
            assert name not in held_before
            held_before[name] = sd
    held_after = {}
    held_by_group = {n: sd for r in second if not r["dp_rank"] for n, sd in r["held"].items()}
    for r in second:
        assert r["step"] == 4
        _same(r["body"], first[0]["body"], "body")
        _same(r["outer"], first[0]["outer"], "outer state")
        _same(r["positions"], first[0]["positions"], "data positions")
        if variant == "glob":
            _same(r["emb"], first[0]["emb"], "GLOB embeddings")
        for name, sd in r["held"].items():
            if r["dp_rank"]:  # a replica: the same as its group's data rank 0
                _same(sd, held_by_group[name], f"{name} on a data-parallel replica")
                continue
            assert name not in held_after, f"{name} held by two groups"
            held_after[name] = sd
        assert len(r["losses"]) == 4
        assert torch.allclose(torch.tensor(r["losses"]), torch.tensor(r["reference"]), rtol=0, atol=1e-6), \
            (r["losses"], r["reference"])
        _same(r["body_end"], r["body_end_ref"], "body at the end")
    _same(held_after, held_before, "per-source embeddings")
    if variant != "glob":  # exactly the sources trained so far own state
        trained = {n for n, steps in first[0]["positions"].items() if steps}
        assert set(held_before) == trained and len(trained) >= 3
    if ef_eager:
        _check_regrouped_buffers(first, second)
    if group_state:  # new group g continues with old group g mod G_old's body AdamW state, logged
        assert any(not torch.equal(a, b) for a, b in zip(_moments(first[0]["inner"]), _moments(first[1]["inner"])))
        for g, r in enumerate(second):
            _same(r["inner"], first[g % g_old]["inner"], f"group {g}'s body optimizer state")
            assert any("dept.reset_inner_optimizer" in n and f"g mod {g_old}" in n for n in r["notes"]), r["notes"]
    # the groups' bodies agree at the end (a round boundary)
    for r in second[1:]:
        _same(r["body_end"], second[0]["body_end"], "bodies of the groups")


def _check_regrouped_buffers(first, second):
    """Every new group's residuals: the mean of the old groups'; its estimates reset; one line
    logged for each."""
    old = [r["buffers"] for r in first]  # one rank per old group, in group order
    assert any(float(t.abs().max()) > 0 for b in old for t in b["outer_body"]["residual"])
    assert all(all(b[c]["eager_known"]) for b in old for c in b)  # the step-2 sync recorded E
    for r in second:
        for cat, got in r["buffers"].items():
            mean = [torch.stack(ts).sum(0) / len(old) for ts in zip(*(b[cat]["residual"] for b in old))]
            _same(got["residual"], mean, f"{cat} residual")
            assert not any(got["eager_known"]) and all(float(t.abs().max()) == 0 for t in got["eager_base"]), cat
        assert any("dept.outer_error_feedback" in n and "mean" in n for n in r["notes"]), r["notes"]
        assert any("dept.outer_overlap_rule" in n and "reset" in n for n in r["notes"]), r["notes"]


# TRIM (learned positions, Nesterov with per-row momentum) with int8 error feedback and the body's
# AdamW state owned by the group (dept.reset_inner_optimizer: false)
TRIM_EF_GROUP = {"dept": {"variant": "trim", "local_steps": 2, "outer_comm_dtype": "int8", "outer_error_feedback": True,
                          "outer_quant_block": 2,
                          "outer_optimizer": {"name": "nesterov", "lr": 0.7, "momentum": 0.9}},
                 "model": {"position_embedding": "learned"}, "train": {"save_interval": 0, "eval_interval": 0}}


def _regroup_only(rank, world, over, run_dir, out_dir, K):
    """Load the G = 2, T = 1 checkpoint with G = 1, T = 1 and write it back at once."""
    cfg = tiny_config(dict(over, train=dict(over["train"], steps=8, run_dir=out_dir)))
    loop, _ = _make(cfg, out_dir, K)
    assert loop.checkpointer.load(loop) is None  # (nothing there yet)
    from dept_mega.checkpoint import load_weights
    load_weights(loop.trainer, run_dir, 4, hooks=loop.hooks)
    loop.trainer.step = 4
    loop.checkpointer.save(loop)


def _state_now(loop) -> dict:
    return {"body": body_vector(loop.trainer), "inner": _inner(loop), "held": _held(loop),
            "outer": {c: s.param_state() for c, s in sorted(loop.hooks.outer_syncs().items())},
            "buffers": _group_buffers(loop), "positions": {n: loop.hooks.source_steps(n, 4) for n in loop.hooks.names},
            "phi": {k: (t.weight.clone(), {n: v.clone() for n, v in t.optimizer.state.items()})
                    for k, t in (("phi", loop.hooks.strategy.phi), ("phi_head", loop.hooks.strategy.phi_head))
                    if t is not None}}


def _combined_and_two_step(rank, world, over, run_dir, two_step_dir, K):
    """T = 2, G = 1: (a) straight from the G = 2, T = 1 checkpoint (another G and T at once);
    (b) from the G = 1, T = 1 checkpoint that _regroup_only wrote (another T alone). Each then
    trains to step 8 (writing no checkpoint: none would be read, and the source stays as it was)."""
    out = {}
    for name, src in (("combined", run_dir), ("two_step", two_step_dir)):
        cfg = tiny_config(dict(over, train=dict(over["train"], steps=8, run_dir=src), parallel={"tensor": 2}))
        loop, losses = _make(cfg, src, K, tensor=2)
        assert loop.checkpointer.load(loop) == 4
        state, notes = _state_now(loop), list(loop.checkpointer.notes)
        loop.checkpointer = None
        loop.run()
        out[name] = dict(state, losses=losses, notes=notes)
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_another_number_of_groups_and_tensor_size_at_once(tmp_path):
    """A round-boundary checkpoint written by G = 2 groups with T = 1 loads into G = 1 with T = 2
    in one launch (DEPT's load plan and the boxes of the new layout in one read). TRIM with int8 error feedback and group-owned body AdamW state:
    the state right after the load — body shards, body AdamW state (old group 0's), each
    source's compact-table AdamW state, φ with its row momentum, the outer state, the averaged
    residuals, the data positions — equals, tensor for tensor, the state reached in two steps
    (the same checkpoint regrouped to G = 1 with T = 1 and written back, then resharded to
    T = 2; each step is tested on its own in this file, tests/test_reshard.py and
    tests/test_reshard_optimizer.py), and the losses of two more rounds agree within 1e-6."""
    K = 4
    run_dir, two = str(tmp_path / "run"), str(tmp_path / "two_step")
    run_distributed(_first_phase, 2, args=(TRIM_EF_GROUP, run_dir, K, 4), timeout=200)
    run_distributed(_regroup_only, 1, args=(TRIM_EF_GROUP, run_dir, two, K), timeout=200)
    res = run_distributed(_combined_and_two_step, 2, args=(TRIM_EF_GROUP, run_dir, two, K), timeout=300)
    for r in res:
        got, want = r["combined"], r["two_step"]
        for key in ("body", "inner", "held", "outer", "buffers", "positions", "phi"):
            _same(got[key], want[key], key)
        assert any(float(t.abs().max()) > 0 for t in got["buffers"]["outer_body"]["residual"])
        assert len(got["losses"]) == 4
        assert torch.allclose(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=1e-6, atol=0), \
            (got["losses"], want["losses"])
        assert any("dept.reset_inner_optimizer" in n for n in got["notes"]), got["notes"]


def test_regroup_note_says_what_happened_before_the_key():
    """The note of a load under another number of groups begins with what happened (the
    checkpoint's and this launch's groups), not with the config key, which reads as a problem
    with that key; the key comes last, saying what it does."""
    from dept_mega.checkpoint import regroup_note
    note = regroup_note("RUN/checkpoints/step_8", 2, 3, ["the body"])
    assert note.startswith("checkpoint RUN/checkpoints/step_8 was written by 2 source groups, this launch has 3: "
                           "new group g continues with the inner optimizer state of the body of old group g mod 2")
    assert note.endswith("because dept.reset_inner_optimizer is false (true clears it at every round start)")
    assert note.index("dept.reset_inner_optimizer") > note.index("g mod 2")
