"""DEPT hooks inside the real TrainLoop: metrics records, evaluation with each source's own
embeddings on every group, TRIM evaluation with the synchronised rows."""
import io
import json
import os

import pytest
import torch

from tests.dept_utils import SyntheticSource, allowed_ids, source_infos, tiny_config
from tests.mp_utils import run_distributed


def _loop_worker(rank, world, over, run_dir):
    import functools

    import dept_mega.loop as loop_module
    from dept_mega.dept.driver import DeptHooks
    from dept_mega.loop import EvalStep, TrainLoop
    from dept_mega.metrics import MetricsWriter, ThroughputMeter
    # FLOPs are reported on CUDA only; force them (and a peak) to check the reduction over groups
    loop_module.ThroughputMeter = functools.partial(ThroughputMeter, report_flops=True, peak_flops=1e12)
    from dept_mega.parallel.groups import build_groups
    from dept_mega.trainer import Trainer
    cfg = tiny_config(over)
    pg = build_groups(cfg.parallel.tensor, cfg.parallel.data, cfg.parallel.pipeline)
    v = cfg.dept.variant
    infos = source_infos(3, trim=v == "trim", vocabs=(60, 200, 130) if v == "spec_opt" else None)
    by_name = {s.name: s for s in infos}
    torch.manual_seed(cfg.train.seed)
    trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=infos[0].vocab_size)
    hooks = DeptHooks(cfg, pg, trainer, torch.device("cpu"), infos)

    def make_iterator(name):
        return SyntheticSource(cfg, infos.index(by_name[name]) + 1, allowed_ids(by_name[name]), pg.dp_rank,
                               pg.dp_size)

    def make_eval_batches(name):
        src = SyntheticSource(cfg, 99 + infos.index(by_name[name]), allowed_ids(by_name[name]), pg.dp_rank,
                              pg.dp_size)
        for _ in range(2):
            yield EvalStep(micro_batches=src.next_step(), nbytes=100.0)

    writer = MetricsWriter(run_dir, enabled=rank == 0, stream=io.StringIO())
    loop = TrainLoop(cfg, pg, trainer, hooks, writer, make_iterator, eval_sources=[s.name for s in infos],
                     make_eval_batches=make_eval_batches)
    loop.run()
    return {"eval": loop.eval_history}


def world_size_of(rec) -> int:
    return len(rec["sources"])  # one rank per group in this test


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", ["spec_opt", "trim"])
def test_loop_records_and_eval_on_every_group(tmp_path, variant):
    over = {"dept": {"variant": variant, "local_steps": 2},
            "train": {"steps": 6, "eval_interval": 4, "log_interval": 1, "run_dir": str(tmp_path),
                      "profile": {"start": 1, "stop": 3, "ranks": [1]}}}
    res = run_distributed(_loop_worker, 2, args=(over, str(tmp_path)), timeout=150)
    recs = [json.loads(l) for l in open(os.path.join(tmp_path, "metrics.jsonl"))]
    train = [r for r in recs if r["kind"] == "train"]
    outer = [r for r in recs if r["kind"] == "outer"]
    evals = [r for r in recs if r["kind"] == "eval"]
    assert len(train) == 6 and len(outer) == 3 and len(evals) == 2
    from dept_mega.metrics import check_record, train_flops_per_token
    cfg = tiny_config(over)
    vocab = dict(zip(["s0", "s1", "s2"], (60, 200, 130)))
    for r in train:
        check_record(r)
        assert set(r["sources"]) == {"0", "1"} and len(set(r["sources"].values())) == 2
        assert set(r["loss_by_source"]) == set(r["sources"].values())
        assert r["tokens_per_s"] > 0 and "mem_peak_gb" not in r  # CPU: no memory fields
        assert r["loss_window"] == pytest.approx(r["loss"], rel=1e-12)  # log_interval 1: the step's, over both groups
        assert r["mfu"] == pytest.approx(r["tflops_per_device"])  # peak 1e12 in this test
        if variant == "spec_opt":  # FLOPs per token of each group's own vocabulary, two equal groups
            fpt = sum(train_flops_per_token(cfg.model, vocab[s]) for s in r["sources"].values()) / 2
            assert r["tflops_per_device"] * 1e12 * world_size_of(r) / r["tokens_per_s"] == pytest.approx(fpt)
    # train.profile: a trace of steps 2-3 on rank 1 only
    assert os.listdir(tmp_path / "profile") == ["rank1_steps2-3.json"]
    trace = json.load(open(tmp_path / "profile" / "rank1_steps2-3.json"))
    assert sum(1 for e in trace["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")) == 2
    for r in outer:
        assert r["bytes"]["outer_body"] > 0 and r["seconds"] >= 0
        assert (r["bytes"]["outer_embedding"] > 0) == (variant == "trim")
    # every group evaluated every source with the same (moved or copied) embeddings
    for e0, e1 in zip(res[0]["eval"], res[1]["eval"]):
        assert e0["by_source"].keys() == {"s0", "s1", "s2"}
        for name in e0["by_source"]:
            assert e0["by_source"][name]["loss"] == pytest.approx(e1["by_source"][name]["loss"], rel=1e-6)


def _slow_first_round_start_worker(rank, world, run_dir, sleep):
    import time

    from tests.reshard_utils import make_loop
    loop = make_loop({"dept": {"variant": "std"}}, run_dir, rank, 1, steps=3)
    loop.checkpointer = None
    start, calls = loop.hooks.round_start, []

    def slow(lp, r):  # the first round start waits, as a federated fresh start waits for its peers
        calls.append(r)
        if len(calls) == 1:
            time.sleep(sleep)
        return start(lp, r)

    loop.hooks.round_start = slow
    loop.run()


@pytest.mark.timeout(120)
def test_first_round_start_wait_is_not_throughput(tmp_path):
    """The process's first round start (a federated fresh start's wait for the other group jobs,
    a relaunched job's healing) is left out of the first window's tokens/s."""
    sleep = 2.0
    run_distributed(_slow_first_round_start_worker, 1, args=(str(tmp_path), sleep), timeout=100)
    train = [json.loads(l) for l in open(os.path.join(tmp_path, "metrics.jsonl"))]
    train = [r for r in train if r["kind"] == "train"]
    first = train[0]
    seconds = first["consumed_tokens"] / first["tokens_per_s"]  # the first window's time
    # (the wait counted: >= sleep; a loaded 2-core machine has taken 0.55 s for the step itself)
    assert first["step"] == 1 and 0 < seconds < sleep / 2, (seconds, train)


def _save_after_recorded_error_worker(rank, world, run_dir):
    import torch

    from dept_mega import ops
    from tests.reshard_utils import make_loop
    loop = make_loop({"dept": {"variant": "std"}}, run_dir, rank, 1, steps=1)
    if ops.backend("cpu") != "cpp":
        return "no extension"
    # an invalid id met by a compiled op (recorded, raised at a check, as on CUDA)
    torch.ops.dept_mega.remap_ids(torch.tensor([0, 9]), torch.arange(4))
    try:
        loop.save()
    except IndexError as exc:
        return str(exc)
    return "saved"


@pytest.mark.timeout(120)
def test_a_recorded_invalid_id_is_raised_before_a_checkpoint(tmp_path):
    """Invalid ids that the compiled ops met since the last log step are raised before a
    checkpoint is written, not saved with the garbage rows they left."""
    res = run_distributed(_save_after_recorded_error_worker, 1, args=(str(tmp_path),), timeout=100)[0]
    if res == "no extension":
        pytest.skip("the dept_mega.ops extension is not built")
    assert res.startswith("remap_ids: global id 9 at flat position 1"), res
    assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints").glob("step_*"))
