"""The outer synchronisation beyond the blocking sync (issue 14) and its lean state (issue 10):
quantisation round trips, lean chunk state and its layout-free form, fragments and overlap
against a plain-tensor reference on 2 groups × 2 replicas, DEPT runs of every variant with
the options on, and the hiding of a simulated slow link."""
import os
import sys

import pytest
import torch

from dept_mega.dept.outer import FlatSync, OuterOptimizer
from dept_mega.dept.quant import QUANT_FORMATS, decode, encode, error_bound, packed_nbytes
from dept_mega.dept.streaming import OuterSchedule, fragment_offsets
from tests.mp_utils import run_distributed

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))


# ----------------------------------------------------------------------------- quantisation
@pytest.mark.parametrize("fmt", QUANT_FORMATS)
@pytest.mark.parametrize("n,block", [(1001, 64), (7, 256), (512, 128)])
def test_quantise_round_trip_within_bound(fmt, n, block):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * torch.linspace(1e-3, 5.0, n)
    x[: min(n, block)] = 0.0  # an all-zero block decodes to zeros
    buf = encode(x, fmt, block)
    assert buf.dtype == torch.uint8 and buf.numel() == packed_nbytes(n, fmt, block)
    y = decode(buf, n, fmt, block)
    assert torch.equal(y[: min(n, block)], torch.zeros(min(n, block)))
    err = (y - x).abs()
    assert bool((err <= error_bound(x, fmt, block) * (1 + 1e-6) + 1e-12).all()), fmt
    # the bound is not vacuous: int8 is ~16x finer than int4
    if fmt == "int8" and n > block:
        assert float(err.max()) < float(decode(encode(x, "int4", block), n, "int4", block).sub(x).abs().max())


def test_packed_bytes():
    assert packed_nbytes(1000, "int8", 256) == 4 * 4 + 1000
    assert packed_nbytes(1001, "int4", 256) == 4 * 4 + 501
    assert packed_nbytes(256, "fp8", 256) == 4 + 256


# ----------------------------------------------------------------------------- reference
def _inc(g, s, i, shape):
    gen = torch.Generator().manual_seed(1000 * s + 10 * g + i)
    return 0.1 * torch.randn(shape, generator=gen)


def _inner_step(g, s, i, t):
    """A stand-in for an inner step that depends on where it starts (a pull towards 0 plus
    noise), so that what the overlapped steps start from shows in the result."""
    return _inc(g, s, i, t.shape) - 0.1 * t.detach()


SHAPES = [[(5, 3), (7,)], [(4, 4), (9,)]]  # two fragments of two parameters
TABLE = (6, 5)  # an embedding table (GLOB's): synchronised in F parts, part f with fragment f
LR, MU = 0.7, 0.9


def _reference(G, D, L, T, tau, F, fmt, block, ef, rule="correction"):
    """Plain tensors: every group's parameters, per-vector θ_prev, momentum and residual
    (element-wise), the schedule of streaming.py and quantisation of each replica's piece.
    How an overlapped sync lands (``rule``): "correction": θ_t + θ_now − θ_at_launch;
    "eager": overlapped steps start from θ_eager, the Nesterov step of θ_prev with
    Δ̂ = Δ_g / G + (Δ̄_prev − Δ_g,prev / G) (a unit's first sync: from θ_local); a float α
    (the merge): α·θ_now + (1 − α)·θ_t.
    Vectors: the body's F fragments and the table; a *unit* is what one launch sends: a
    vector and, per replica, the flat range it carries (a fragment: the replica's 1/D chunk;
    table part f: the f-th 1/F slice of the replica's chunk)."""
    from dept_mega.dept.outer import chunk_bounds
    torch.manual_seed(0)
    shapes = SHAPES[0] + SHAPES[1]
    vec_of = ([0, 0, 1, 1] if F == 2 else [0, 0, 0, 0]) + [F]  # parameter -> vector
    init = [torch.randn(sh) for sh in shapes] + [torch.randn(TABLE)]
    theta = {g: [t.clone() for t in init] for g in range(G)}
    flat = lambda ts, k: torch.cat([t.reshape(-1) for t, q in zip(ts, vec_of) if q == k])
    prev = [flat(init, k) for k in range(F + 1)]
    buf = [torch.zeros_like(v) for v in prev]
    resid = {(g, k): torch.zeros_like(prev[k]) for g in range(G) for k in range(F + 1)}
    estimate_base = {(g, k): torch.zeros_like(prev[k]) for g in range(G) for k in range(F + 1)}
    eager = rule == "eager"
    mix = rule if isinstance(rule, float) else None
    known = set()  # units whose previous mean is known (eager)
    offsets = fragment_offsets(L, F)

    def chunks(n):
        return [chunk_bounds(n, D, r) for r in range(D)]

    units = [(f, offsets[f], chunks(prev[f].numel())) for f in range(F)]
    for f in range(F):
        ranges = []
        for a, b in chunks(prev[F].numel()):
            c0, c1 = chunk_bounds(b - a, F, f)
            ranges.append((a + c0, a + c1))
        units.append((F, offsets[f], ranges))
    pending = []

    def write(g, k, idx, vals, add):
        cur = flat(theta[g], k)
        cur[idx] = cur[idx] + vals if add else vals
        o = 0
        for i, q in enumerate(vec_of):
            if q == k:
                n = theta[g][i].numel()
                theta[g][i] = cur[o:o + n].view_as(theta[g][i]).clone()
                o += n

    def launch(u, s, blocking):
        k, _, ranges = u
        idx = torch.cat([torch.arange(a, b) for a, b in ranges])
        deltas, own = [], {}
        for g in range(G):
            d = prev[k] - flat(theta[g], k)
            own[g] = d[idx].clone()
            if fmt is not None:
                for a, b in ranges:
                    x = d[a:b] + resid[(g, k)][a:b]
                    q = decode(encode(x, fmt, block), b - a, fmt, block)
                    if ef:
                        resid[(g, k)][a:b] = x - q
                    d[a:b] = q
            deltas.append(d[idx])
        m = sum(deltas) / G
        snaps = {g: flat(theta[g], k)[idx] for g in range(G)}
        if blocking:
            apply(k, idx, m, None)
            return
        if eager and id(u) in known:
            for g in range(G):
                est = estimate_base[(g, k)][idx] + own[g] / G
                b = MU * buf[k][idx] + est
                snaps[g] = prev[k][idx] - LR * (est + MU * b)
                write(g, k, idx, snaps[g], add=False)
        pending.append((s + tau, k, idx, m, snaps, (u, own)))

    def apply(k, idx, m, snaps, eager_of=None):
        if eager_of is not None and eager:
            u, own = eager_of
            for g in range(G):
                estimate_base[(g, k)][idx] = m - own[g] / G
            known.add(id(u))
        b = MU * buf[k][idx] + m
        buf[k][idx] = b
        prev[k][idx] = prev[k][idx] - LR * (m + MU * b)
        for g in range(G):
            if snaps is None:
                write(g, k, idx, prev[k][idx], add=False)
            elif mix is not None:
                write(g, k, idx, mix * flat(theta[g], k)[idx] + (1 - mix) * prev[k][idx], add=False)
            else:
                write(g, k, idx, prev[k][idx] - snaps[g], add=True)

    for s in range(T):
        if s % L and s > 0:
            for u in units:
                if u[1] == s % L:
                    launch(u, s, tau == 0)
        for g in range(G):
            theta[g] = [t + _inner_step(g, s, i, t) for i, t in enumerate(theta[g])]
        s1 = s + 1
        due = [p for p in pending if p[0] <= s1]
        pending = [p for p in pending if p[0] > s1]
        for _, k, idx, m, snaps, of in due:
            apply(k, idx, m, snaps, of)
        if s1 % L == 0:
            for u in units:
                if u[1] == L:
                    launch(u, s1, tau == 0 or s1 == T)
            if s1 == T:
                for _, k, idx, m, snaps, of in pending:
                    apply(k, idx, m, snaps, of)
                pending = []
                for u in units:  # the final extra sync of the units launched before the round end
                    if u[1] != L:
                        launch(u, s1, True)
    return theta


def _stream_worker(rank, world, cases):
    from dept_mega.dept.streaming import sync_units
    from dept_mega.parallel.groups import build_groups
    pg = build_groups(tensor=1, data=2, pipeline=1)
    g = pg.group_index
    out = []
    for L, T, tau, F, fmt, block, ef, state_device, rule in cases:
        eager = rule == "eager"
        torch.manual_seed(0)
        shapes = SHAPES[0] + SHAPES[1]
        params = [torch.nn.Parameter(torch.randn(sh)) for sh in shapes] + [torch.nn.Parameter(torch.randn(TABLE))]
        parts = [params[:2], params[2:4]] if F == 2 else [params[:4]]

        def flat_sync(ps):
            return FlatSync(ps, pg, OuterOptimizer("nesterov", lr=LR, momentum=MU), comm_dtype=fmt or "fp32",
                            quant_block=block, error_feedback=ef, state_device=state_device)
        syncs = [flat_sync(ps) for ps in parts]
        table = flat_sync(params[4:])
        units = sync_units(syncs, [table], L)
        assert len(units) == 2 * F and [u.part for u in units[F:]] == ([None] if F == 1 else list(range(F)))
        sched = OuterSchedule(units, L, tau, T, eager=eager, mix=rule if isinstance(rule, float) else None)
        idle = []
        for s in range(T):
            sched.before_step(s)
            with torch.no_grad():
                for i, p in enumerate(params):
                    p.add_(_inner_step(g, s, i, p))
            sched.after_step(s + 1)
            if (s + 1) % L == 0:
                sched.round_end(s + 1)
            idle.append(sched.idle)
        # lean: θ_prev and the momentum hold this rank's chunk only
        for sy in syncs + [table]:
            assert sy.theta_prev.numel() == sy.end - sy.start < sy.numel
            assert sy.optimizer.state["momentum"].numel() == sy.end - sy.start
        # every part took one outer step per round and one more at the end (all but the last)
        rounds = T // L
        assert table.optimizer.part_steps == ([] if F == 1 else [rounds + 1] * (F - 1) + [rounds])
        # the layout-free state round-trips (gathered over dp, rank keeps its chunk)
        states = [sy.param_state() for sy in syncs + [table]]
        for sy, st in zip(syncs + [table], states):
            assert [tuple(t.shape) for t in st["reference"]] == [tuple(p.shape) for p in sy.params]
            before = (sy.theta_prev.clone(), sy.optimizer.state["momentum"].clone(), list(sy.optimizer.part_steps))
            sy.theta_prev.zero_()
            sy.optimizer.part_steps = [0] * len(sy.optimizer.part_steps)
            sy.load_param_state(st)
            assert torch.equal(sy.theta_prev, before[0])
            assert torch.equal(sy.optimizer.state["momentum"], before[1])
            assert sy.optimizer.part_steps == before[2]
            sd = sy.state_dict()
            sy.load_state_dict(sd)
            assert torch.equal(sy.theta_prev, before[0]) and sy.optimizer.part_steps == before[2]
        if eager:  # E and which parts know a previous mean: saved, and joined over the replicas
            import torch.distributed as dist
            from dept_mega.dept.outer import join_flat_sync_chunks
            for sy in syncs + [table]:
                sd = sy.state_dict()
                assert sy.eager_base.abs().max() > 0 and all(sd["eager_known"]), sd.get("eager_known")
                sds = [None] * pg.dp_size
                dist.all_gather_object(sds, sd, group=pg.dp)
                before, known = sy.eager_base.clone(), list(sy.eager_known)
                sy.eager_base.zero_()
                sy.eager_known = [False] * sy.parts
                sy.load_state_dict(join_flat_sync_chunks(sds))  # the whole shard's: this rank cuts its chunk
                assert torch.equal(sy.eager_base, before) and sy.eager_known == known
        out.append({"final": [p.detach().clone() for p in params], "group": g, "idle": idle,
                    "bytes": pg.comm.snapshot(), "reference": states[0]["reference"]})
    return out


CASES = [  # L, T, tau, F, fmt, block, error feedback, state device, overlap rule (α: the merge)
    (4, 8, 0, 1, None, 256, False, "device", "correction"),
    (4, 8, 1, 2, None, 256, False, "cpu", "correction"),
    (4, 8, 3, 2, None, 256, False, "device", "correction"),
    (4, 8, 0, 2, "int8", 8, True, "device", "correction"),
    (4, 8, 1, 1, "int4", 8, True, "cpu", "correction"),
    (4, 8, 2, 2, "fp8", 16, False, "device", "correction"),
    (4, 12, 2, 1, None, 256, False, "device", "eager"),
    (4, 8, 1, 2, "int8", 8, True, "cpu", "eager"),
    (4, 8, 2, 2, None, 256, False, "device", 0.3),
    (4, 8, 1, 2, "int8", 8, True, "cpu", 0.0),
]


@pytest.mark.timeout(200)
def test_fragments_overlap_quantised_match_plain_reference():
    res = run_distributed(_stream_worker, 4, args=(CASES,), timeout=180)
    for i, (L, T, tau, F, fmt, block, ef, _, rule) in enumerate(CASES):
        ref = _reference(2, 2, L, T, tau, F, fmt, block, ef, rule)
        for r in res:
            got = r[i]
            for a, b in zip(got["final"], ref[got["group"]]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"case {i}: {m}")
            assert all(torch.equal(a, b) for a, b in zip(got["final"], res[0 if got["group"] == 0 else 2][i]["final"]))
        if tau == 0:
            assert all(res[0][i]["idle"])
        else:
            assert not all(res[0][i]["idle"]) and res[0][i]["idle"][-1]
    # two ranks' replicas of one group agree, and the reference is the same on every rank
    for i in range(len(CASES)):
        assert all(torch.equal(a, b) for a, b in zip(res[0][i]["reference"], res[3][i]["reference"]))


def _parts_worker(rank, world, F):
    from dept_mega.parallel.groups import build_groups
    pg = build_groups(tensor=1, data=2, pipeline=1)
    g = pg.group_index
    out = {}
    for name in ("adam", "nesterov"):
        torch.manual_seed(0)
        init = [torch.randn(7, 3), torch.randn(11)]  # 32 values: chunks of 16, parts of 6/5/5
        copies = {}
        for mode in ("whole", "parts"):
            params = [torch.nn.Parameter(t.clone()) for t in init]
            opt = OuterOptimizer(name, lr=0.7, momentum=0.9)
            sync = FlatSync(params, pg, opt)
            if mode == "parts":
                sync.use_parts(F)
            before = pg.comm.snapshot()["outer_body"]
            for r in range(2):  # two rounds: the state carries over
                with torch.no_grad():
                    for i, p in enumerate(params):
                        p.add_(_inc(g, r, i, p.shape))
                if mode == "whole":
                    sync.sync()
                else:
                    for f in range(F):
                        sync.sync(part=f)
            copies[mode] = {"params": [p.detach().clone() for p in params], "prev": sync.theta_prev.clone(),
                            "state": {k: v.clone() for k, v in opt.state.items()}, "steps": opt.steps,
                            "part_steps": list(opt.part_steps),
                            "bytes": pg.comm.snapshot()["outer_body"] - before,
                            "wire": [sync.wire_nbytes(f) for f in range(F)] if mode == "parts" else sync.wire_nbytes()}
        out[name] = copies
    return out


@pytest.mark.timeout(120)
def test_a_flat_sync_in_parts_equals_the_whole_sync():
    """GLOB's tables go in F parts (FlatSync.use_parts): syncing every part once is the whole
    sync, bit for bit, for element-wise outer optimizers — Adam's bias correction included,
    since each part counts its own steps — and sends the same bytes (fp32)."""
    F = 3
    for r in run_distributed(_parts_worker, 4, args=(F,), timeout=100):
        for name, c in r.items():
            whole, parts = c["whole"], c["parts"]
            assert all(torch.equal(a, b) for a, b in zip(whole["params"], parts["params"])), name
            assert torch.equal(whole["prev"], parts["prev"]), name
            assert all(torch.equal(whole["state"][k], parts["state"][k]) for k in whole["state"]), name
            assert whole["steps"] == parts["steps"] == 2 and parts["part_steps"] == [2] * F
            assert parts["bytes"] == whole["bytes"] > 0
            assert sum(parts["wire"]) == whole["wire"] and parts["wire"] == [6 * 4, 5 * 4, 5 * 4]


# ----------------------------------------------------------------------------- DEPT runs
def _dept_worker(rank, world, runs):
    from tests.dept_utils import run_dept, source_infos, tiny_config
    out = []
    for over in runs:
        cfg = tiny_config(over)
        v = cfg.dept.variant
        infos = source_infos(3, trim=v == "trim", vocabs=(60, 200, 130) if v == "spec_opt" else None)
        res = run_dept(cfg, infos, cfg.train.steps // cfg.dept.local_steps)
        out.append({"losses": res["losses"], "outer": res["outer"],
                    "body": [p.detach().clone() for p in res["trainer"].body_parameters()],
                    "idle": res["hooks"].can_save_now(), "mix": res["hooks"].schedule.mix})
    return out


def _runs():
    base = {"train": {"steps": 8}, "model": {"num_layers": 2}}
    stream = {"outer_overlap": True, "outer_delay": 1, "outer_fragments": 2, "local_steps": 4}
    return [
        {**base, "dept": {"variant": "glob", "local_steps": 4}, "model": {"position_embedding": "learned"},
         "parallel": {"data": 2}},
        {**base, "dept": {"variant": "glob", **stream, "outer_comm_dtype": "int8", "outer_error_feedback": True},
         "model": {"position_embedding": "learned"}, "parallel": {"data": 2}},
        {**base, "dept": {"variant": "spec_opt", **stream, "outer_comm_dtype": "int4", "outer_quant_block": 32,
                          "outer_overlap_rule": "mix", "outer_mix_alpha": 0.5},  # the merge rule
         "parallel": {"pipeline": 2}},
        {**base, "dept": {"variant": "trim", **stream, "outer_comm_dtype": "int8", "outer_state_device": "cpu"},
         "model": {"position_embedding": "learned"}, "parallel": {"tensor": 2}},
        {**base, "dept": {"variant": "spec", "local_steps": 4, "outer_fragments": 2, "outer_comm_dtype": "fp8"},
         "parallel": {"data": 2}},
        # run 1 with the eager start (its extra dp re-gathers are checked against run 1's)
        {**base, "dept": {"variant": "glob", **stream, "outer_comm_dtype": "int8", "outer_error_feedback": True,
                          "outer_overlap_rule": "eager"},
         "model": {"position_embedding": "learned"}, "parallel": {"data": 2}},
    ]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dept_variants_with_streaming_options():
    res = run_distributed(_dept_worker, 4, args=(_runs(),), timeout=280)
    for i, over in enumerate(_runs()):
        ranks = [r[i] for r in res]
        for r in ranks:
            assert all(x == x and abs(x) < 100 for x in r["losses"]), (i, r["losses"])
            assert r["idle"]  # the last step applied everything
            for o in r["outer"]:
                assert o["exposed_seconds"] >= 0 and o["overlap_seconds"] >= 0
        # the final weights are synchronised: the same body in both groups (rank 2 sits at rank
        # 0's (tp, dp, pp) position in the other group in every layout here)
        other = ranks[2]
        assert all(torch.equal(a, b) for a, b in zip(ranks[0]["body"], other["body"])), i
        # every rank of a job sees the same outer records' bytes
        assert all(r["outer"][k]["bytes"] == ranks[0]["outer"][k]["bytes"] for r in ranks for k in range(2))
        assert ranks[0]["mix"] == (0.5 if over["dept"].get("outer_overlap_rule") == "mix" else None), i
    # the measured records equal dept_mega.dept.costs' prediction: what crosses groups in every
    # round (launches stay inside their round; the records' dp also holds the inner gradient
    # reductions, so the outer sync's dp bytes are checked in tests/test_costs_bytes.py)
    from dept_mega.dept.costs import predict_outer_sync
    from tests.dept_utils import VOCAB, tiny_config
    for i, over in enumerate(_runs()):
        cfg = tiny_config(over)
        rounds = res[0][i]["outer"]
        trim = cfg.dept.variant == "trim"  # TRIM's rows depend on the round's sources: body only here
        pred = predict_outer_sync(cfg, 2, trim_vocabs=[10, 10]) if trim else \
            predict_outer_sync(cfg, 2, global_vocab=VOCAB)
        # the last step syncs the fragments other than the last once more (streaming.py)
        L = cfg.dept.local_steps
        extra = pred["final_extra"]
        assert extra["outer_body"] + extra["outer_embedding"] == sum(pred["outer_per_step"][:L - 1])
        for k, o in enumerate(rounds):
            last = k == len(rounds) - 1
            assert o["bytes"]["outer_body"] == pred["round"]["outer_body"] + (extra["outer_body"] if last else 0), \
                (i, o["bytes"], pred)
            if not trim:
                assert o["bytes"]["outer_embedding"] == \
                    pred["round"]["outer_embedding"] + (extra["outer_embedding"] if last else 0), (i, o["bytes"], pred)
        assert sum(pred["outer_per_step"]) == pred["round"]["outer_body"] + pred["round"]["outer_embedding"]
        if cfg.dept.outer_fragments == 2:  # half of the body (and of GLOB's tables) on each of two steps
            assert sum(1 for b in pred["outer_per_step"] if b) == 2
            assert pred["peak_step_bytes"] < pred["round"]["outer_body"] + pred["round"]["outer_embedding"]
            if cfg.dept.variant == "glob":
                assert extra["outer_embedding"] > 0 and pred["peak_step_bytes"] < \
                    0.6 * (pred["round"]["outer_body"] + pred["round"]["outer_embedding"])
    # the eager start sends what the correction rule sends across groups, plus one dp re-gather
    # of θ_eager per overlapped launch (not at the last step's blocking syncs nor at a unit's
    # first launch, which has no estimate yet): the records' dp difference (the inner gradient
    # reductions are the same) equals the prediction's
    plain, eager = tiny_config(_runs()[1]), tiny_config(_runs()[5])
    pp, pe = (predict_outer_sync(c, 2, global_vocab=VOCAB) for c in (plain, eager))
    gathers = pe["round"]["dp"] - pp["round"]["dp"]
    assert gathers > 0
    for k, (a, b) in enumerate(zip(res[0][1]["outer"], res[0][5]["outer"])):
        last = k == len(res[0][1]["outer"]) - 1
        assert b["bytes"]["dp"] - a["bytes"]["dp"] == gathers + (pe["first_extra"]["dp"] if k == 0 else 0) + \
            (pe["final_extra"]["dp"] - pp["final_extra"]["dp"] if last else 0), (k, a["bytes"], b["bytes"])
        assert {c: b["bytes"][c] for c in ("outer_body", "outer_embedding")} == \
            {c: a["bytes"][c] for c in ("outer_body", "outer_embedding")}
    assert pe["first_extra"]["dp"] == -gathers and pp["first_extra"]["dp"] == 0
    # quantised GLOB sends about a quarter of fp32's outer bytes (payload + scales)
    fp32 = res[0][0]["outer"][0]["bytes"]["outer_body"]
    int8 = res[0][1]["outer"][0]["bytes"]["outer_body"]
    assert int8 < fp32 / 3.5, (int8, fp32)


# ----------------------------------------------------------------------------- hiding
def hiding_table(delays=(0.0, 0.05, 0.1, 0.2), step_s=0.1, tau=3):
    """Per simulated link delay: seconds exposed per sync, blocking and overlapped (τ steps of
    ``step_s`` seconds of compute), and seconds hidden per overlapped sync
    (benchmarks/outer_hiding.py, on two gloo ranks)."""
    from outer_hiding import hiding_rows, hiding_worker
    records = run_distributed(hiding_worker, 2, args=(tuple(delays), step_s, tau), timeout=120)[0]
    return hiding_rows(records, tuple(delays))


@pytest.mark.timeout(120)
def test_slow_link_blocking_exposed_grows_overlapped_stays_hidden():
    rows = hiding_table(delays=(0.0, 0.1, 0.2), step_s=0.08, tau=3)
    (d0, b0, o0, _), (d1, b1, o1, h1), (d2, b2, o2, h2) = rows
    assert b1 >= 0.1 - 0.01 and b2 >= 0.2 - 0.01 and b2 > b1 > b0, rows  # blocking waits the delay
    assert o1 < 0.05 and o2 < 0.05, rows  # τ = 3 steps of 0.08 s hide up to 0.24 s
    assert h2 >= 0.2 - 0.01, rows  # and the overlap counter sees it


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize("dept,model,match", [
    ({"outer_error_feedback": True}, {}, "dept.outer_error_feedback"),
    ({"outer_delay": 1}, {}, "dept.outer_delay"),
    ({"outer_overlap": True, "outer_delay": 2}, {}, "dept.outer_delay"),
    ({"outer_fragments": 3}, {}, "dept.outer_fragments"),
    ({"outer_fragments": 2, "local_steps": 4}, {"num_layers": 1}, "dept.outer_fragments"),
    ({"outer_comm_dtype": "int2"}, {}, "dept.outer_comm_dtype"),
    ({"outer_state_device": "disk"}, {}, "dept.outer_state_device"),
    ({"outer_quant_block": 0}, {}, "dept.outer_quant_block"),
    ({"outer_overlap_rule": "eager"}, {}, "dept.outer_overlap_rule"),
    ({"outer_overlap": True, "outer_delay": 1, "outer_overlap_rule": "early"}, {}, "dept.outer_overlap_rule"),
    ({"outer_overlap_rule": "mix"}, {}, "dept.outer_overlap_rule"),
    ({"outer_overlap": True, "outer_delay": 1, "outer_overlap_rule": "mix", "outer_mix_alpha": 1.5}, {},
     "dept.outer_mix_alpha"),
    ({"variant": "glob", "embedding_rows": "present", "outer_overlap": True, "outer_delay": 1}, {},
     "dept.outer_overlap"),
])
def test_outer_sync_keys_are_validated(dept, model, match):
    from dept_mega.config import ConfigError
    from tests.dept_utils import tiny_config
    with pytest.raises(ConfigError, match=match.replace(".", r"\.")):
        tiny_config({"dept": {"local_steps": 2, **dept}, "model": model})


# ----------------------------------------------------------------------------- checkpoints
def _resume_streamed_worker(rank, world, over, run_dir):
    import os
    from tests.test_dept_checkpoint import _make
    from tests.dept_utils import body_vector
    cfg = tiny_config_of(over)
    loop, _ = _make(cfg, run_dir, rank)
    loop.run()
    full = body_vector(loop.trainer)
    ckdir = os.path.join(run_dir, "checkpoints")
    saved = sorted(int(n.split("_")[1]) for n in os.listdir(ckdir) if n.startswith("step_"))
    loop2, ck = _make(cfg, run_dir, rank, saves=())  # (the resumed run's checkpoints are read by nothing)
    ck.load(loop2, step=5)
    loop2.run()
    return {"full": full, "resumed": body_vector(loop2.trainer), "saved": saved}


def tiny_config_of(over):
    from tests.dept_utils import tiny_config
    return tiny_config(over)


# (world size, extra config): 2 groups; 2 groups × D 2 with bf16 weights and the distributed
# optimizer (the outer state on its master shards, dept/master_shards.py)
RESUME_LAYOUTS = {"plain": (2, {}),
                  # with the eager start, whose estimate buffer is per rank (sharded masters here)
                  "dist_bf16_dp2_eager": (4, {"parallel": {"data": 2}, "precision": "bf16",
                                              "optim": {"distributed": True, "grad_bucket_size": 500},
                                              "dept": {"outer_overlap_rule": "eager"}})}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", sorted(RESUME_LAYOUTS))
def test_streamed_run_saves_only_between_syncs_and_resumes_bit_exactly(tmp_path, layout):
    # saves fall due at the round ends 4 and 8, where the last fragment has just been launched:
    # they are taken at 5 and 9, after it is applied (τ = 1), and a resume from 5 is exact
    world, extra = RESUME_LAYOUTS[layout]
    extra = dict(extra)
    over = {"dept": {"variant": "glob", "local_steps": 4, "outer_fragments": 2, "outer_overlap": True,
                     "outer_delay": 1, "outer_comm_dtype": "int8", "outer_error_feedback": True,
                     "outer_optimizer": {"name": "nesterov", "lr": 0.7, "momentum": 0.9},
                     **extra.pop("dept", {})},
            "train": {"steps": 12, "save_interval": 4, "eval_interval": 0}, **extra}
    res = run_distributed(_resume_streamed_worker, world, args=(over, str(tmp_path)), timeout=250)
    for r in res:
        assert 5 in r["saved"] and 9 in r["saved"] and 4 not in r["saved"], r["saved"]
        assert torch.equal(r["full"], r["resumed"])


def test_a_heal_takes_the_peers_shared_state_and_keeps_the_groups_own():
    """A group healing from a live peer (dept/federation.py) loads the peer's
    ``replicated_state``: θ_{t-1} and the outer optimizer state, which every group holds the
    same, but not the peer's error-feedback residual or eager estimate, which differ between
    groups — loading them sent the peer's quantisation error twice and lost the group's own. A
    checkpoint's ``state_dict`` still carries everything."""
    from types import SimpleNamespace
    pg = SimpleNamespace(dp_size=1, dp_rank=0)

    def flat_sync(seed):
        g = torch.Generator().manual_seed(seed)
        s = FlatSync([torch.nn.Parameter(torch.randn(8, generator=g))], pg, OuterOptimizer("nesterov", lr=0.7,
                     momentum=0.9), comm_dtype="int8", error_feedback=True)
        s.enable_eager()
        s.theta_prev.copy_(torch.randn(8, generator=g))
        s.optimizer.step(s.theta_prev, torch.randn(8, generator=g))  # momentum state
        s.residual.copy_(torch.randn(8, generator=g))
        s.eager_base.copy_(torch.randn(8, generator=g))
        s.eager_known = [True]
        return s

    mine, peer, fresh = flat_sync(1), flat_sync(2), flat_sync(1)
    own = {k: getattr(mine, k).clone() for k in ("residual", "eager_base")}
    mine.load_state_dict(peer.replicated_state())
    assert torch.equal(mine.theta_prev, peer.theta_prev)
    assert all(torch.equal(mine.optimizer.state[n], peer.optimizer.state[n]) for n in peer.optimizer.state_names)
    assert torch.equal(mine.residual, own["residual"]) and torch.equal(mine.eager_base, own["eager_base"])
    fresh.load_state_dict(peer.state_dict())  # a checkpoint: all of it
    assert torch.equal(fresh.residual, peer.residual) and torch.equal(fresh.eager_base, peer.eager_base)

