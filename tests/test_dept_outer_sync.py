"""The outer synchronisation beyond the blocking sync (issue 14) and its lean state (issue 10):
quantisation round trips, lean chunk state and its layout-free form, fragments and overlap
against a plain-tensor reference on 2 groups × 2 replicas, DEPT runs of every variant with
the options on, and the hiding of a simulated slow link."""
import time

import pytest
import torch

from dept_mega.dept.outer import FlatSync, OuterOptimizer
from dept_mega.dept.quant import QUANT_FORMATS, decode, encode, error_bound, packed_nbytes
from dept_mega.dept.streaming import OuterSchedule, SyncUnit, fragment_offsets
from tests.mp_utils import run_distributed


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


SHAPES = [[(5, 3), (7,)], [(4, 4), (9,)]]  # two fragments of two parameters
LR, MU = 0.7, 0.9


def _nesterov(theta, buf, d):
    buf = d.clone() if buf is None else MU * buf + d
    return theta - LR * (d + MU * buf), buf


def _reference(G, D, L, T, tau, F, fmt, block, ef):
    """Plain tensors: every group's parameters, per-fragment θ_prev and momentum, the
    schedule of streaming.py and quantisation of each replica's chunk."""
    from dept_mega.dept.outer import chunk_bounds
    torch.manual_seed(0)
    shapes = [sh for f in range(F) for sh in (SHAPES[f] if F == 2 else SHAPES[0] + SHAPES[1])]
    frag_of = [0, 0, 1, 1] if F == 2 else [0, 0, 0, 0]
    init = [torch.randn(sh) for sh in shapes]
    theta = {g: [t.clone() for t in init] for g in range(G)}
    flat = lambda ts, f: torch.cat([t.reshape(-1) for t, q in zip(ts, frag_of) if q == f])
    prev = [flat(init, f) for f in range(F)]
    buf = [None] * F
    resid = {(g, f): torch.zeros_like(prev[f]) for g in range(G) for f in range(F)}
    offsets = fragment_offsets(L, F)
    pending = []

    def write(g, f, vec, add):
        o = 0
        for i, q in enumerate(frag_of):
            if q == f:
                n = theta[g][i].numel()
                part = vec[o:o + n].view_as(theta[g][i])
                theta[g][i] = theta[g][i] + part if add else part.clone()
                o += n

    def mean_delta(f):
        deltas = []
        for g in range(G):
            d = prev[f] - flat(theta[g], f)
            if fmt is None:
                deltas.append(d)
                continue
            out = torch.empty_like(d)
            for r in range(D):
                a, b = chunk_bounds(d.numel(), D, r)
                x = d[a:b] + resid[(g, f)][a:b]
                q = decode(encode(x, fmt, block), b - a, fmt, block)
                if ef:
                    resid[(g, f)][a:b] = x - q
                out[a:b] = q
            deltas.append(out)
        return sum(deltas) / G

    def launch(f, s, blocking):
        m = mean_delta(f)
        snaps = {g: flat(theta[g], f) for g in range(G)}
        if blocking:
            apply(f, m, None)
        else:
            pending.append((s + tau, f, m, snaps))

    def apply(f, m, snaps):
        prev[f], buf[f] = _nesterov(prev[f], buf[f], m)
        for g in range(G):
            if snaps is None:
                write(g, f, prev[f], add=False)
            else:
                write(g, f, prev[f] - snaps[g], add=True)

    for s in range(T):
        if s % L and s > 0:
            for f in range(F):
                if offsets[f] == s % L:
                    launch(f, s, tau == 0)
        for g in range(G):
            theta[g] = [t + _inc(g, s, i, t.shape) for i, t in enumerate(theta[g])]
        s1 = s + 1
        due = [p for p in pending if p[0] <= s1]
        pending = [p for p in pending if p[0] > s1]
        for _, f, m, snaps in due:
            apply(f, m, snaps)
        if s1 % L == 0:
            launch(F - 1, s1, tau == 0 or s1 == T)
            if s1 == T:
                for _, f, m, snaps in pending:
                    apply(f, m, snaps)
                pending = []
                for f in range(F - 1):  # the final extra sync of the other fragments
                    launch(f, s1, True)
    return theta


def _stream_worker(rank, world, cases):
    from dept_mega.parallel.groups import build_groups
    pg = build_groups(tensor=1, data=2, pipeline=1)
    g = pg.group_index
    out = []
    for L, T, tau, F, fmt, block, ef, state_device in cases:
        torch.manual_seed(0)
        shapes = SHAPES[0] + SHAPES[1]
        params = [torch.nn.Parameter(torch.randn(sh)) for sh in shapes]
        parts = [params[:2], params[2:]] if F == 2 else [params]
        syncs = [FlatSync(ps, pg, OuterOptimizer("nesterov", lr=LR, momentum=MU), comm_dtype=fmt or "fp32",
                          quant_block=block, error_feedback=ef, state_device=state_device) for ps in parts]
        units = [SyncUnit(s, o, f"f{f}") for f, (s, o) in enumerate(zip(syncs, fragment_offsets(L, F)))]
        sched = OuterSchedule(units, L, tau, T)
        idle = []
        for s in range(T):
            sched.before_step(s)
            with torch.no_grad():
                for i, p in enumerate(params):
                    p.add_(_inc(g, s, i, p.shape))
            sched.after_step(s + 1)
            if (s + 1) % L == 0:
                sched.round_end(s + 1)
            idle.append(sched.idle)
        # lean: θ_prev and the momentum hold this rank's chunk only
        for sy in syncs:
            assert sy.theta_prev.numel() == sy.end - sy.start < sy.numel
            assert sy.optimizer.state["momentum"].numel() == sy.end - sy.start
        # the layout-free state round-trips (gathered over dp, rank keeps its chunk)
        states = [sy.param_state() for sy in syncs]
        for sy, st in zip(syncs, states):
            assert [tuple(t.shape) for t in st["reference"]] == [tuple(p.shape) for p in sy.params]
            before = (sy.theta_prev.clone(), sy.optimizer.state["momentum"].clone())
            sy.theta_prev.zero_()
            sy.load_param_state(st)
            assert torch.equal(sy.theta_prev, before[0])
            assert torch.equal(sy.optimizer.state["momentum"], before[1])
            sd = sy.state_dict()
            sy.load_state_dict(sd)
            assert torch.equal(sy.theta_prev, before[0])
        out.append({"final": [p.detach().clone() for p in params], "group": g, "idle": idle,
                    "bytes": pg.comm.snapshot(), "reference": states[0]["reference"]})
    return out


CASES = [  # L, T, tau, F, fmt, block, error feedback, state device
    (4, 8, 0, 1, None, 256, False, "device"),
    (4, 8, 1, 2, None, 256, False, "cpu"),
    (4, 8, 3, 2, None, 256, False, "device"),
    (4, 8, 0, 2, "int8", 8, True, "device"),
    (4, 8, 1, 1, "int4", 8, True, "cpu"),
    (4, 8, 2, 2, "fp8", 16, False, "device"),
]


@pytest.mark.timeout(200)
def test_fragments_overlap_quantised_match_plain_reference():
    res = run_distributed(_stream_worker, 4, args=(CASES,), timeout=180)
    for i, (L, T, tau, F, fmt, block, ef, _) in enumerate(CASES):
        ref = _reference(2, 2, L, T, tau, F, fmt, block, ef)
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
                    "idle": res["hooks"].can_save_now()})
    return out


def _runs():
    base = {"train": {"steps": 8}, "model": {"num_layers": 2}}
    stream = {"outer_overlap": True, "outer_delay": 1, "outer_fragments": 2, "local_steps": 4}
    return [
        {**base, "dept": {"variant": "glob", "local_steps": 4}, "model": {"position_embedding": "learned"},
         "parallel": {"data": 2}},
        {**base, "dept": {"variant": "glob", **stream, "outer_comm_dtype": "int8", "outer_error_feedback": True},
         "model": {"position_embedding": "learned"}, "parallel": {"data": 2}},
        {**base, "dept": {"variant": "spec_opt", **stream, "outer_comm_dtype": "int4", "outer_quant_block": 32},
         "parallel": {"pipeline": 2}},
        {**base, "dept": {"variant": "trim", **stream, "outer_comm_dtype": "int8", "outer_state_device": "cpu"},
         "model": {"position_embedding": "learned"}, "parallel": {"tensor": 2}},
        {**base, "dept": {"variant": "spec", "local_steps": 4, "outer_fragments": 2, "outer_comm_dtype": "fp8"},
         "parallel": {"data": 2}},
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
        extra = sum(pred["outer_per_step"][:L - 1])
        for k, o in enumerate(rounds):
            assert o["bytes"]["outer_body"] == pred["round"]["outer_body"] + (extra if k == len(rounds) - 1 else 0), \
                (i, o["bytes"], pred)
            if not trim:
                assert o["bytes"]["outer_embedding"] == pred["round"]["outer_embedding"], (i, o["bytes"], pred)
        assert sum(pred["outer_per_step"]) == pred["round"]["outer_body"] + pred["round"]["outer_embedding"]
        if cfg.dept.outer_fragments == 2:  # half of the body on each of two steps of the round
            assert sum(1 for b in pred["outer_per_step"] if b) == 2
            assert pred["peak_step_bytes"] < pred["round"]["outer_body"] + pred["round"]["outer_embedding"]
    # quantised GLOB sends about a quarter of fp32's outer bytes (payload + scales)
    fp32 = res[0][0]["outer"][0]["bytes"]["outer_body"]
    int8 = res[0][1]["outer"][0]["bytes"]["outer_body"]
    assert int8 < fp32 / 3.5, (int8, fp32)


# ----------------------------------------------------------------------------- hiding
def _hiding_worker(rank, world, delays, step_s, tau):
    from dept_mega.parallel.groups import build_groups
    pg = build_groups(tensor=1, data=1, pipeline=1)
    out = {}
    for overlap in (False, True):
        for delay in delays:
            pg.comm.simulate_slow_link(pg.outer, latency_s=delay)
            params = [torch.nn.Parameter(torch.randn(64))]
            L = 4
            sync = FlatSync(params, pg, OuterOptimizer("fedavg"))
            sched = OuterSchedule([SyncUnit(sync, L, "body")], L, tau if overlap else 0, 3 * L)
            exposed = []
            for s in range(3 * L):
                sched.before_step(s)
                time.sleep(step_s)  # the inner step's compute
                with torch.no_grad():
                    params[0].add_(0.01)
                sched.after_step(s + 1)
                if (s + 1) % L == 0 and s + 1 < 3 * L:  # the last step flushes: not counted
                    sched.round_end(s + 1)
                    exposed.append(sched.take_times())
            sched.round_end(3 * L)
            out[(overlap, delay)] = exposed
            pg.comm.simulate_slow_link(None)
    return out


def hiding_table(delays=(0.0, 0.05, 0.1, 0.2), step_s=0.1, tau=3):
    """Per simulated link delay: seconds exposed per sync, blocking and overlapped (τ steps of
    ``step_s`` seconds of compute), and seconds hidden per overlapped sync."""
    res = run_distributed(_hiding_worker, 2, args=(tuple(delays), step_s, tau), timeout=120)[0]
    # records of rounds 1 and 2 (the last step's flush is left out): the blocking run applied
    # 2 syncs there, the overlapped one 1 (round 1's, τ steps into round 2; round 2's is flushed)
    rows = []
    for d in delays:
        blk = sum(e for _, e in res[(False, d)]) / 2
        ovl = sum(e for _, e in res[(True, d)]) / 1
        hid = sum(o for o, _ in res[(True, d)]) / 1
        rows.append((d, blk, ovl, hid))
    return rows


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
    loop2, ck = _make(cfg, run_dir, rank)
    ck.load(loop2, step=5)
    loop2.run()
    return {"full": full, "resumed": body_vector(loop2.trainer), "saved": saved}


def tiny_config_of(over):
    from tests.dept_utils import tiny_config
    return tiny_config(over)


# (world size, extra config): 2 groups; 2 groups × D 2 with bf16 weights and the distributed
# optimizer (the outer state on its master shards, dept/master_shards.py)
RESUME_LAYOUTS = {"plain": (2, {}),
                  "dist_bf16_dp2": (4, {"parallel": {"data": 2}, "precision": "bf16",
                                        "optim": {"distributed": True, "grad_bucket_size": 500}})}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", sorted(RESUME_LAYOUTS))
def test_streamed_run_saves_only_between_syncs_and_resumes_bit_exactly(tmp_path, layout):
    # saves fall due at the round ends 4 and 8, where the last fragment has just been launched:
    # they are taken at 5 and 9, after it is applied (τ = 1), and a resume from 5 is exact
    world, extra = RESUME_LAYOUTS[layout]
    over = {"dept": {"variant": "glob", "local_steps": 4, "outer_fragments": 2, "outer_overlap": True,
                     "outer_delay": 1, "outer_comm_dtype": "int8", "outer_error_feedback": True,
                     "outer_optimizer": {"name": "nesterov", "lr": 0.7, "momentum": 0.9}},
            "train": {"steps": 12, "save_interval": 4, "eval_interval": 0}, **extra}
    res = run_distributed(_resume_streamed_worker, world, args=(over, str(tmp_path)), timeout=250)
    for r in res:
        assert 5 in r["saved"] and 9 in r["saved"] and 4 not in r["saved"], r["saved"]
        assert torch.equal(r["full"], r["resumed"])
