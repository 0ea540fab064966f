"""A job of several ranks that fails prints its ``error:`` line once when every rank has it (a
config error before the process group, a check the ranks agree on), and each rank's own line,
as ``error: [rank R] ...``, when it may be that rank's alone; every rank exits with the status.
One process prints what it always printed. ``python -m dept_mega.train`` runs in forked ranks
with torchrun's environment (tests/mp_utils.py), each rank's stderr in its own file."""
from __future__ import annotations

import multiprocessing
import os
import time

import pytest

from dept_mega.config import ConfigError, load_config, validate
from tests.mp_utils import _start_method, free_port, torchrun_env
from tests.trainer_utils import ROOT, TINY_STD, ensure_sample_corpus

QUICK = ["train.steps=1", "train.eval_interval=0", "train.eval_iters=1", "train.save_interval=0",
         "train.log_interval=1", "train.init_timeout_s=60"]
OWN = "a problem only this rank has"


def layout(world: int) -> list:
    return [f"parallel.data={world}", "train.micro_batch_size=1", "train.global_batch_size=6"]


def _rank_main(argv: list, env: dict, err: str, fail: tuple) -> None:
    """One rank of ``python -m dept_mega.train ARGV``; ``fail = (where, ranks)`` makes the listed
    ranks fail there: ``data`` (a data file, in the checks every rank agrees on) or ``trainer``
    (building the trainer: no agreement)."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    os.close(fd)
    out = os.open(os.devnull, os.O_WRONLY)
    os.dup2(out, 1)
    import torch
    torch.set_num_threads(1)
    from dept_mega import train
    from dept_mega.process_exit import exit_after
    where, ranks = fail
    rank = int(env.get("RANK", "0"))
    if where == "data" and rank in ranks:
        from dept_mega.data.gpt_dataset import DatasetError

        def load_run_data(cfg, pg, *parts):
            raise DatasetError(f"{OWN} (rank {rank})")
        train.load_run_data = load_run_data
    if where == "trainer" and rank in ranks:
        def trainer(*a, **kw):
            raise ConfigError(OWN)
        train.Trainer = trainer
    exit_after(lambda: train.main(argv))


def _launch(tmp_path, world: int, overrides: list, fail: tuple = ("", ()), timeout: float = 240.0):
    """Start ``world`` ranks; once every rank in ``fail`` has exited (or all, without one),
    kill the others as torchrun would. Returns ([exit status], [stderr text]) in rank order."""
    ctx = multiprocessing.get_context(_start_method())
    argv = ["--config", TINY_STD, f"train.run_dir={tmp_path / 'run'}", *QUICK, *layout(world), *overrides]
    port = free_port()
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    base.update({"OMP_NUM_THREADS": "1", "DEPT_MEGA_DEVICE": "cpu"})
    envs = [dict(base, **torchrun_env(r, world, port)) for r in range(world)] if world > 1 else [base]
    errs = [str(tmp_path / f"rank{r}.err") for r in range(world)]
    procs = [ctx.Process(target=_rank_main, args=(argv, e, p, fail)) for e, p in zip(envs, errs)]
    for p in procs:
        p.start()
    watched = [procs[r] for r in fail[1] if r < world] or procs
    deadline = time.monotonic() + timeout
    try:
        for p in watched:
            p.join(max(0.0, deadline - time.monotonic()))
        assert all(p.exitcode is not None for p in watched), "the ranks did not finish"
        for p in procs:  # the ranks a failed one left waiting in a collective
            if p not in watched:
                p.join(2.0)
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
                p.join()
    texts = []
    for path in errs:
        with open(path, encoding="utf-8") as f:
            texts.append(f.read())
    return [p.exitcode for p in procs], texts


def _error_lines(texts: list) -> list:
    return [(r, ln) for r, t in enumerate(texts) for ln in t.splitlines() if ln.startswith("error:")]


@pytest.fixture(scope="module")
def corpus():
    ensure_sample_corpus()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_config_error_is_one_line_for_the_job(tmp_path, world):
    """Before the process group: every rank computes the same; rank 0 says it, all exit 2."""
    with pytest.raises(ConfigError) as exc:
        load_config(TINY_STD, ["train.no_such_key=1"])
    codes, texts = _launch(tmp_path, world, ["train.no_such_key=1"])
    assert codes == [2] * world, (codes, texts)
    assert _error_lines(texts) == [(0, f"error: {exc.value}")], texts  # one process: as always
    assert not any("Traceback" in t for t in texts), texts


def test_an_agreed_check_after_the_process_group_is_one_line(corpus, tmp_path):
    """A layout the world size cannot hold, found by rank 0's check that every rank shares."""
    cfg = load_config(TINY_STD, [*layout(2), "parallel.tensor=4"])
    with pytest.raises(ConfigError) as exc:
        validate(cfg, 2)
    codes, texts = _launch(tmp_path, 2, ["parallel.tensor=4"])
    assert codes == [2, 2], (codes, texts)
    assert _error_lines(texts) == [(0, f"error: {exc.value}")], texts


def test_one_ranks_data_problem_is_agreed_and_printed_once(corpus, tmp_path):
    """A data file only rank 1 fails to open: every rank stops, rank 0 prints rank 1's line."""
    codes, texts = _launch(tmp_path, 2, [], fail=("data", (1,)))
    assert codes == [2, 2], (codes, texts)
    assert _error_lines(texts) == [(0, f"error: {OWN} (rank 1)")], texts


@pytest.mark.parametrize("world", [1, 3])
def test_a_rank_specific_error_keeps_its_rank(corpus, tmp_path, world):
    """An error outside any agreement, on the last rank only: that rank prints it with its
    number (one process: without), and exits 2."""
    last = world - 1
    codes, texts = _launch(tmp_path, world, [], fail=("trainer", (last,)))
    assert codes[last] == 2, (codes, texts)
    want = f"error: {OWN}" if world == 1 else f"error: [rank {last}] {OWN}"
    assert (last, want) in _error_lines(texts), texts
    assert [r for r, ln in _error_lines(texts) if OWN in ln] == [last], texts


def test_no_usable_cuda_for_train_device_cuda_stops_every_rank_at_once(tmp_path):
    """train.device: cuda where the ranks cannot use CUDA (here the DEPT_MEGA_DEVICE=cpu these
    launches set, a reason that holds on any machine): each rank refuses before the process
    group, so none waits for another, nothing is written, and rank 0's line speaks for all."""
    from dept_mega.parallel.device import use_cuda
    with pytest.MonkeyPatch.context() as m:
        m.setenv("DEPT_MEGA_DEVICE", "cpu")
        with pytest.raises(ConfigError) as exc:
            use_cuda("cuda")
    start = time.monotonic()
    codes, texts = _launch(tmp_path, 2, ["train.device=cuda"], timeout=60.0)
    assert codes == [2, 2], (codes, texts)
    assert _error_lines(texts) == [(0, f"error: {exc.value}")], texts
    assert "config key 'train.device'" in texts[0] and not any("Traceback" in t for t in texts), texts
    assert time.monotonic() - start < 50 and not os.path.exists(tmp_path / "run"), texts


def test_a_backend_this_machine_lacks_is_one_line_and_the_pre_flight_says_it(corpus, tmp_path):
    """``backend: transformer_engine`` where it is not installed: every rank finds it, rank 0
    prints it once (each rank printed its own ``[rank R]`` line: a user audit's finding), and
    ``--check`` refuses it the same way instead of passing it."""
    from dept_mega.model.backends import BackendError
    from dept_mega.parallel.te import te_installed
    from dept_mega.preflight import preflight
    if te_installed():
        pytest.skip("Transformer Engine is installed here")
    want = "config key 'backend': transformer_engine was requested but transformer_engine is not installed"
    for device in ("cpu", "auto"):  # (auto: the launch's device is not known on this machine)
        with pytest.raises(BackendError, match=f"^{want}$"):
            preflight(load_config(TINY_STD, [*layout(2), "backend=transformer_engine", f"train.device={device}"]), 2)
    codes, texts = _launch(tmp_path, 2, ["backend=transformer_engine"])
    assert codes == [2, 2], (codes, texts)
    assert _error_lines(texts) == [(0, f"error: {want}")], texts
