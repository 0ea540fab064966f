"""Helpers of the federation tests (tests/test_federation*.py): the lighthouse and group jobs as processes (CPU, gloo),
their records and dumps (dept_mega/dept/federation_dump.py), and the waits that stand in for
racing the jobs' progress. One-process group jobs and the reference single job's ranks are
forked from the test process's forkserver (tests/mp_utils.py), which has imported torch and
the trainer once; group jobs of several ranks are torchrun commands."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager

import yaml

from tests.mp_utils import free_port, run_distributed
from tests.netns_sites import NETNS_ENV, enter, in_site
from tests.trainer_utils import ROOT, ensure_sample_corpus, read_jsonl

ENV = dict(os.environ, OMP_NUM_THREADS="1", DEPT_MEGA_DEVICE="cpu", PYTHONPATH=ROOT)
SOURCES = 3


def write_config(tmp_path, steps=6, local_steps=2, sources=SOURCES, owners=None, example="spec") -> str:
    """``example``: examples/tiny/{example}.yaml (spec: the global tokenizer; spec_opt: one per source)."""
    ensure_sample_corpus()
    with open(os.path.join(ROOT, "examples", "tiny", f"{example}.yaml"), encoding="utf-8") as f:
        c = yaml.safe_load(f)
    if c["data"].get("tokenizer"):
        c["data"]["tokenizer"] = os.path.join(ROOT, c["data"]["tokenizer"])
    c["data"]["sources"] = [dict(s, **{k: os.path.join(ROOT, s[k]) for k in ("prefix", "tokenizer") if k in s})
                            for s in c["data"]["sources"][:sources]]
    for s, g in zip(c["data"]["sources"], owners or []):  # data.sources[i].group
        s["group"] = g
    c["dept"]["local_steps"] = local_steps
    c["model"]["seq_length"] = 32
    c["train"].update(steps=steps, micro_batch_size=2, global_batch_size=2, log_interval=1, eval_interval=0,
                      eval_iters=1, save_interval=0)
    path = os.path.join(tmp_path, "spec.yaml" if owners is None else "spec_owned.yaml")
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(c, f)
    return path


class Lighthouse:
    """A lighthouse for the group jobs: in this process by default (``dept_mega.lighthouse.serve``,
    torchft's Rust server on its own threads: no second Python + torch start of 2-3 s per test),
    or with ``process=True`` the command ``python -m dept_mega.lighthouse``'s ``main`` (its
    options, its address line, its own process killed at the end), which one test runs, in a
    process forked from the test's forkserver (ForkedJob: the command would import torch again
    through torchft, ~3 s of CPU)."""

    def __init__(self, min_groups: int, join_s: float = 30.0, heartbeat_s: float = 2.0, process: bool = False,
                 env: dict = ENV, host: str = "127.0.0.1"):
        """``env``, ``host``: the process's environment (a site's: tests/netns_sites.py) and the
        address the jobs reach it at."""
        self.port = free_port()
        self.host, self.env = host, env
        self.proc = self.server = None
        if not process:
            from dept_mega.lighthouse import serve
            self.server = serve(self.port, min_groups, join_timeout_s=join_s, heartbeat_timeout_s=heartbeat_s)
            assert self.server.address().endswith(f":{self.port}"), self.server.address()
            return
        import tempfile
        fd, self.log = tempfile.mkstemp(prefix="lighthouse", suffix=".txt")
        os.close(fd)
        self.proc = ForkedJob(["--port", str(self.port), "--min-groups", str(min_groups), "--join-timeout-s",
                               str(join_s), "--heartbeat-timeout-s", str(heartbeat_s)], env, self.log,
                              module="lighthouse")
        try:  # its address line (the log also has torchft's own lines, from its standard error, which
            # are not written in one piece: the address line can land inside one of them)
            deadline, line = time.monotonic() + 120, None
            while line is None:
                with open(self.log, encoding="utf-8", errors="replace") as f:
                    text = f.read()
                line = re.search(rf"lighthouse: http://[^\s:]+:{self.port}\b", text)
                if line is None and (self.proc.poll() is not None or time.monotonic() > deadline):
                    raise AssertionError(f"the lighthouse (status {self.proc.poll()}) did not start: {text[-3000:]}")
                time.sleep(0.02)
        except BaseException:
            self.stop()
            raise

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    def status(self) -> str:
        """The "Next quorum status" line of torchft's lighthouse page ``/status`` (computed under
        the lock that registers quorum requests), e.g. ``New quorum not ready, only have 1
        participants, need at least half of 2 healthy workers [1/1 participants healthy][2
        heartbeating][shrink_only=false]``."""
        url = f"http://{self.addr}/status"

        def read() -> str:
            with urllib.request.urlopen(url, timeout=10) as r:
                return r.read().decode("utf-8", "replace")
        site = self.env.get(NETNS_ENV)  # (a lighthouse at a site: read from there)
        page = in_site(site, read) if site else read()
        m = re.search(r"Next quorum status: *([^\n<]*)", page)
        assert m and re.search(r"\[\d+/\d+ participants healthy\]", m.group(1)), \
            f"{url}: no '[N/M participants healthy]' in torchft's status page (torchft changed?): {page[:600]!r}"
        return m.group(1).strip()

    def waiting(self) -> int:
        """How many live groups have asked for a quorum that the lighthouse has not formed yet."""
        return int(re.search(r"\[(\d+)/\d+ participants healthy\]", self.status()).group(1))

    def stop(self) -> None:
        if self.proc is None:
            self.server.shutdown()
            return
        self.proc.kill()
        self.proc.wait()
        os.unlink(self.log)


class Jobs(list):
    """The group jobs a test started (a list: every job ``launch`` started or ``add`` took) and
    their lighthouse ``lh``; :func:`federation` kills those still running at the test's end."""

    def __init__(self, lh: "Lighthouse") -> None:
        super().__init__()
        self.lh = lh

    def launch(self, cfg, run, g, *extra, **kw):
        """:func:`launch_group` on this federation's lighthouse; the job is returned and kept."""
        return self.add(launch_group(cfg, run, self.lh.addr, g, *extra, **kw))

    def add(self, p):
        self.append(p)
        return p


@contextmanager
def federation(min_groups: int, **lighthouse):
    """A :class:`Lighthouse` (``min_groups``, its other options) and the :class:`Jobs` started on
    it: on leaving, whatever happened, the jobs still running are killed and the lighthouse
    stopped (every multi-job test's ``try: ... finally: kill, lh.stop()``)."""
    jobs = Jobs(Lighthouse(min_groups, **lighthouse))
    try:
        yield jobs
    finally:
        for p in jobs:
            if p.poll() is None:
                p.kill()
        jobs.lh.stop()


def launch_group(cfg, run, lighthouse, g, *extra, groups=SOURCES, min_groups=SOURCES, timeout_s=20, env=ENV, nproc=1,
                 torchrun=True, checkpoints=True):
    """Group job ``g``: one process forked from the test's forkserver (ForkedJob), or ``nproc``
    ranks under torchrun's launcher (TorchrunJob), or (``torchrun=False``) ``nproc`` ranks forked
    with the environment torchrun would give them, its store on rank 0 (ForkedJob: no launcher
    process; torchrun's own store is covered by the jobs launched with it). ``checkpoints=False``
    (a forked job): it writes none (:func:`no_checkpoints`)."""
    args = ["--config", cfg, f"train.run_dir={run}", f"federation.lighthouse={lighthouse}", f"federation.group={g}",
            f"federation.groups={groups}", f"federation.min_groups={min_groups}", f"federation.timeout_s={timeout_s}",
            *extra]
    # output to a file: torchft logs every quorum, and a full pipe would stop the job
    os.makedirs(run, exist_ok=True)
    log = os.path.join(run, f"out{time.monotonic_ns()}.txt")
    if nproc == 1 or not torchrun:
        return ForkedJob(args, env, log, nproc, checkpoints=checkpoints)
    assert checkpoints, "a job under torchrun's launcher writes its checkpoints"
    return TorchrunJob(args, env, log, nproc)


def no_checkpoints() -> None:
    """In a job's process: its Checkpointer writes nothing (the loop's saves are skipped, its
    loads work), for the runs of a test whose checkpoints nothing reads (a DCP save of a group
    job's state is ~0.3 s of CPU; the federated jobs of other tests write and read theirs)."""
    from dept_mega.checkpoint import Checkpointer
    Checkpointer.save = lambda self, loop: None


FAIL_CONFIGURE_ENV = "DEPT_TEST_FAIL_CONFIGURE"  # a forked job's first N process group configures fail


def fail_configures(n: int) -> None:
    """In a job's process: the first ``n`` times torchft's Manager configures the cross-group
    Gloo process group for a quorum fail (as when a peer cannot be reached); later
    configures are torchft's own."""
    from torchft.process_group import ProcessGroupGloo
    own, left = ProcessGroupGloo._create_pg, [n]

    def create_pg(self, store, rank, world_size):
        if left[0] > 0:
            left[0] -= 1
            raise RuntimeError("injected: this quorum's process group could not be made")
        return own(self, store, rank, world_size)
    ProcessGroupGloo._create_pg = create_pg


def _as_job(env: dict, log: str) -> None:
    """This forked process given a job's environment ``env``, the repository as its working
    directory and ``log`` as its standard output and error; where ``env`` names a site
    (tests/netns_sites.py), in that site's network."""
    if env.get(NETNS_ENV):
        enter(env[NETNS_ENV])
    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _job_main(argv: list, env: dict, log: str, module: str = "train", checkpoints: bool = True) -> None:
    """``python -m dept_mega.MODULE ARGV`` (train, or evaluate) with environment ``env``, its
    output to ``log``, in a process forked from the test's forkserver (tests/mp_utils.py);
    ``checkpoints=False``: :func:`no_checkpoints`."""
    import gc
    gc.freeze()  # the inherited heap: skipped by this job's collections (tests/mp_utils.py, _worker)
    _as_job(env, log)
    import torch
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    import importlib
    if not checkpoints:
        no_checkpoints()
    if env.get(FAIL_CONFIGURE_ENV):
        fail_configures(int(env[FAIL_CONFIGURE_ENV]))

    from dept_mega.process_exit import exit_after
    main = importlib.import_module(f"dept_mega.{module}").main
    try:
        exit_after(lambda: main(argv))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


class ForkedJob:
    """A group job of ``nproc`` ranks forked from the test's forkserver (torch and the trainer
    imported there once: a fresh ``python -m dept_mega.train`` spends ~2-3 s of CPU importing
    them, while the other jobs of the test start beside it); several ranks get the environment
    torchrun would give them (rank 0 holds the job's store), their output in one log as
    torchrun's. The part of ``subprocess.Popen`` the tests use: ``pid`` (rank 0's process:
    SIGKILL kills it), ``poll``, ``wait``, ``returncode`` (the first rank's nonzero status, -N:
    killed by signal N; None while a rank runs), ``kill`` (every rank), and ``log``."""

    def __init__(self, argv: list, env: dict, log: str, nproc: int = 1, module: str = "train",
                 checkpoints: bool = True) -> None:
        import multiprocessing

        from tests.mp_utils import _start_method, torchrun_env
        self.log = log
        ctx = multiprocessing.get_context(_start_method())
        envs = [env]
        if nproc > 1:
            port = free_port()
            envs = [dict(env, **torchrun_env(r, nproc, port)) for r in range(nproc)]
        self.procs = [ctx.Process(target=_job_main, args=(argv, e, log, module, checkpoints)) for e in envs]
        for p in self.procs:
            p.start()
        self.pid = self.procs[0].pid

    @property
    def returncode(self):
        codes = [p.exitcode for p in self.procs]
        if None in codes:
            return None
        return next((c for c in codes if c != 0), 0)

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        for p in self.procs:
            p.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"group job {self.pid}", timeout)
        return self.returncode

    def kill(self) -> None:
        for p in self.procs:
            if p.exitcode is None:
                p.kill()


def _torchrun_main(argv: list, env: dict, log: str, nproc: int, launcher: tuple = ()) -> None:
    """``torchrun --standalone --nproc-per-node NPROC LAUNCHER -m dept_mega.train ARGV`` as torchrun's
    own ``main`` (its launcher, its c10d rendezvous and the agent's store that the workers
    share), in a process forked from the test's forkserver, its workers forked from it
    (``--start-method fork``) running tests/torchrun_rank.py (``--run-path``): the command
    would import torch in the launcher and in each worker again (~3 s of CPU each)."""
    import gc
    gc.freeze()  # (as _job_main)
    _as_job(env, log)
    from torch.distributed.run import main
    try:
        main(["--standalone", "--nproc-per-node", str(nproc), *launcher, "--start-method", "fork", "--run-path",
              os.path.join(ROOT, "tests", "torchrun_rank.py"), *argv])
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


class TorchrunJob(ForkedJob):
    """A group job of ``nproc`` ranks under torchrun's launcher (:func:`_torchrun_main`): one
    process forked from the test's forkserver, the launcher, whose exit status is the job's
    (nonzero when a worker failed); ``kill`` kills the launcher and its workers. ``launcher``:
    more of torchrun's own options (``--max-restarts 1``)."""

    def __init__(self, argv: list, env: dict, log: str, nproc: int, launcher: tuple = ()) -> None:
        import multiprocessing

        from tests.mp_utils import _start_method
        self.log = log
        self.procs = [multiprocessing.get_context(_start_method()).Process(
            target=_torchrun_main, args=(argv, env, log, nproc, tuple(launcher)))]
        self.procs[0].start()
        self.pid = self.procs[0].pid

    def kill(self) -> None:
        if self.procs[0].exitcode is None:
            for pid in children(self.pid):
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            self.procs[0].kill()


def children(pid: int) -> list:
    """The processes whose parent is ``pid`` (from /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def finish_all(procs, timeout=120):
    outs = []
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        with open(p.log, encoding="utf-8", errors="replace") as f:
            outs.append(f.read())
    return outs


def read_records(run, kind):
    return [r for r in read_jsonl(os.path.join(run, "metrics.jsonl")) if r["kind"] == kind]


def _single_job_rank(rank: int, world: int, argv: list, log: str, checkpoints: bool = True) -> int:
    """One rank of the single job: ``python -m dept_mega.train ARGV``'s ``main``, its output
    (the same lines as a launched rank's) to ``log``.rank; ``checkpoints=False``:
    :func:`no_checkpoints`."""
    import sys as _sys
    if not checkpoints:
        no_checkpoints()
    with open(f"{log}.{rank}", "w") as f:
        _sys.stdout.flush()
        _sys.stderr.flush()
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        from dept_mega.train import main
        status = main(argv)
        _sys.stdout.flush()
        _sys.stderr.flush()
    return status


def run_single_job(cfg, run, nproc=SOURCES, *extra, checkpoints=True):
    """The reference single job (every group in one job of ``nproc`` ranks), run to its end:
    ``dept_mega.train``'s ``main`` on ranks forked from the test process's forkserver
    (tests/mp_utils.py: torch and the trainer imported once), with the environment torchrun
    would give them. The job is the same as ``torchrun --nproc-per-node N -m dept_mega.train``
    (tested as such elsewhere); launched that way it would cost each rank a fresh import of
    torch and torchrun's launcher one more (~2-3 s of CPU each, while the group jobs start
    beside it). ``checkpoints=False``: it writes none (:func:`no_checkpoints`)."""
    os.makedirs(run, exist_ok=True)
    log = os.path.join(run, "single_out")
    argv = ["--config", cfg, f"train.run_dir={run}", *extra]
    try:
        status = run_distributed(_single_job_rank, nproc, args=(argv, log, checkpoints), timeout=180)
    except Exception as exc:  # noqa: BLE001 - with the ranks' output
        status = [repr(exc)[-3000:]]
    if status != [0] * nproc:
        tails = []
        for r in range(nproc):
            if os.path.exists(f"{log}.{r}"):
                with open(f"{log}.{r}", encoding="utf-8", errors="replace") as f:
                    tails.append(f"rank {r}: " + f.read()[-3000:])
        raise AssertionError(f"the single job failed: {status}\n" + "\n".join(tails))


def error_line(out):
    lines = [ln for ln in out.splitlines() if ln.startswith("error: ")]
    return lines[0] if lines else out[-2000:]


def trained_steps(run):
    path = os.path.join(run, "metrics.jsonl")
    try:
        return [r["step"] for r in read_jsonl(path) if r["kind"] == "train"] if os.path.exists(path) else []
    except ValueError:  # a line being written
        return []


def read_dumps(root, g, kind="round"):
    import torch
    out = {}
    for f in os.listdir(root):
        if f.startswith(f"g{g}_rank0_{kind}"):
            d = torch.load(os.path.join(root, f), weights_only=False)
            out[d["round"]] = d
    return out


def wait_for(pred, what, timeout=120):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def is_held(root, g, r):
    """Group ``g`` waits before round ``r``'s quorum (DEPT_FEDERATION_HOLD=r:start:...)."""
    return os.path.exists(os.path.join(root, f"g{g}_rank0_held{r}"))


def wait_for_requests(lh, n, procs, what, timeout=120):
    """Wait until the lighthouse holds ``n`` quorum requests (``procs``', ``what``), called while
    every other group waits at a hold before its own request. Releasing the held groups before
    that would race: when every member of the previous quorum asks, torchft's lighthouse forms
    the quorum at once from the groups that have asked (its "fast quorum"), without waiting for a
    group that heartbeats but has not asked yet — and a relaunched job heartbeats from the moment
    its Manager exists, well before it has built its model, loaded its checkpoint and asked."""
    deadline = time.monotonic() + timeout
    while lh.waiting() < n:
        for p in procs:
            if p.poll() is not None:
                with open(p.log, encoding="utf-8", errors="replace") as f:
                    tail = f.read()[-3000:]
                raise AssertionError(f"{what}: a job exited ({p.returncode}) before its quorum request "
                                     f"reached the lighthouse:\n{tail}")
        assert time.monotonic() < deadline, (f"{what}: the lighthouse does not hold {n} quorum request(s) after "
                                             f"{timeout} s: {lh.status()}")
        time.sleep(0.05)
