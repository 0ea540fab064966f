"""Run a function on N gloo ranks (CPU) inside a test and collect each rank's return value.

    results = run_distributed(fn, world_size=4, args=(x,))   # fn(rank, world_size, *args)

``fn`` must be a module-level function (it is pickled to spawned processes). Every rank gets
``torch.distributed`` initialised with gloo, one CPU thread, and the environment variables
torchrun would set. An exception on any rank fails the call with that rank's traceback; a
hang fails after ``timeout`` seconds.

The ranks are forked from a forkserver that has imported torch and the trainer once (see
PRELOAD), with the caller's environment: a rank starts in well under a second, where a spawned
one imports them again (about 3 s of CPU each, most of a small test's time).
DEPT_MEGA_TEST_START_METHOD=spawn starts fresh interpreters instead.
"""
from __future__ import annotations

import faulthandler
import gc
import os
import pickle
import random
import socket
import tempfile
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _port_slice() -> range:
    """This process's ports: 8000 below the kernel's ephemeral range (from which it hands out
    the ports of outgoing connections and of ``bind(0)``), one slice per pytest-xdist worker."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    width = 8000 // max(count, 1)
    start = low - 8000 + index * width
    return range(start, start + width)


_NEXT_PORT: list[int] = []  # the next candidate in this process's slice


def free_port() -> int:
    """A TCP port that is free now, for a store or rendezvous endpoint bound a moment later.

    ``bind(0)`` would give a free port but one from the ephemeral range, where a connection
    opened meanwhile (by a gloo group of a test running beside this one, under ``pytest -n``)
    can take it before the store binds it. Ports below that range are taken only by explicit
    binds: this one comes from this worker's slice, in turn (a random start, so that two test
    sessions on one machine rarely meet), skipping ports that are in use."""
    ports = _port_slice()
    if ports.start < 1024:  # an unusual ephemeral range: let the kernel choose
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    if not _NEXT_PORT:
        _NEXT_PORT.append(random.randrange(len(ports)))
    for _ in range(len(ports)):
        port = ports[_NEXT_PORT[0] % len(ports)]
        _NEXT_PORT[0] += 1
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {ports}")


def torchrun_env(rank: int, world_size: int, port: int) -> dict:
    """The variables torchrun gives rank ``rank`` of a one-node job (rank 0 holds the store)."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)}


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out_dir: str,
            env: dict) -> None:
    # what the forkserver imported (PRELOAD) moves to the collector's permanent generation: a
    # collection in this rank (the one below, any during ``fn``) then skips it instead of
    # walking, and so copying, every page of the inherited heap (~0.2 s of CPU a rank)
    gc.freeze()
    # the environment of the caller at this call (a forkserver child starts with the server's)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(torchrun_env(rank, world_size, port))
    os.environ.update({"OMP_NUM_THREADS": "1", "DEPT_MEGA_DEVICE": "cpu"})
    torch.set_num_threads(1)
    # a rank killed by a signal (SIGABRT from C++, SIGSEGV) prints every thread's Python stack
    # to the test's captured stderr: where it was is otherwise lost
    faulthandler.enable(all_threads=True)
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        payload = ("ok", result)
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        payload = ("error", traceback.format_exc())
    with open(path, "wb") as f:
        pickle.dump(payload, f)
    if dist.is_initialized():
        try:
            if payload[0] == "ok":  # as train.py does: nobody tears down while another rank still talks
                dist.barrier()
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    # what ``fn`` left in reference cycles (trainer <-> loop <-> hooks) holds the C++ gloo groups:
    # freed by the interpreter's shutdown, their worker threads abort the process now and then
    # (SIGABRT, "terminate called without an active exception"); as dept_mega.process_exit does
    # for the launched entry points, collect them while the interpreter is whole
    gc.collect()


# Imported once by the forkserver (one per test process, started at the first call), so that
# every rank starts from a fork of an interpreter that has them. Imports only: the server holds
# no process group, no thread but numpy's BLAS pool (which handles forks) and no custom-ops
# status (dept_mega.ops computes it on first use): each rank is as a freshly started one.
# torch._dynamo: the trainer's modules do not import it (compile_guard.py), but a rank that
# builds an optimizer does (torch.optim imports it at the first add_param_group): ~1 s a rank.
# dept_mega.model (its backends register the custom FP8 cast op) and torch.distributed.checkpoint
# (the first save or load): imported lazily by the trainer and the checkpointer, ~1 s a rank.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.distributed.checkpoint", "dept_mega.trainer",
           "dept_mega.loop", "dept_mega.model", "dept_mega.dept.driver", "dept_mega.checkpoint"]


def _start_method() -> str:
    method = os.environ.get("DEPT_MEGA_TEST_START_METHOD", "forkserver")
    if method == "forkserver":
        import multiprocessing
        multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    return method


def run_distributed(fn: Callable, world_size: int, args: tuple = (), timeout: float = 300.0) -> list[Any]:
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_worker, args=(world_size, port, fn, args, out_dir, dict(os.environ)),
                                 nprocs=world_size, join=False, start_method=_start_method())
        import time
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()
                raise TimeoutError(f"distributed test did not finish in {timeout:.0f} s")
        results = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pkl")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {rank} produced no result")
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results
