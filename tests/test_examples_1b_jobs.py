"""examples/1b's sbatch scripts run for real on the CPU (tiny model, fake SLURM): a job trains,
a preempted job requeues itself and resumes, a two-node job does the same across both nodes."""
from __future__ import annotations

import os
import re
import stat
import subprocess
import sys

import pytest

from dept_mega.config import load_config
from tests.test_examples_1b import VARIANTS, sbatch_headers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EX = os.path.join(ROOT, "examples", "1b")


def _tiny_sources(tmp_path) -> str:
    """Two small random-token sources (no tokenizer: model.vocab_size) as a YAML flow list."""
    import numpy as np

    from dept_mega.data.indexed import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    items = []
    for name in ("a", "b"):
        prefix = str(tmp_path / "data" / f"{name}_text_document")
        b = IndexedDatasetBuilder(prefix)
        for _ in range(60):
            n = int(rng.integers(40, 120))
            b.add_document(rng.integers(3, 300, n), nbytes=3 * n)
        b.finalize()
        items.append(f"{{name: {name}, prefix: {prefix}}}")
    return "[" + ", ".join(items) + "]"


# srun of the sbatch test and of the two-node test's requeued launch: instead of one torchrun per
# node, which would start a fresh interpreter per rank (torch, torch._dynamo for the optimizer,
# the trainer: ~6 s of CPU each, and ~3 s per torchrun), srun hands its command line and the
# script's environment to the test (_run_script), which runs the job's ranks forked from its
# forkserver (tests/mp_utils.py: started once per test process) with the variables torchrun gives
# them (node by node, consecutive ranks: what the two-node test's real torchruns log), each node's
# ranks writing to that node's log, and srun ends with the job's status. What torchrun does (c10d
# rendezvous, is_host, SIGUSR1 to the ranks) is the two-node test's first launch; the jobs run
# here check the scripts' own steps: the pre-flight, the overrides passed through, the requeue
# path, the resume.
FAKE_SRUN_HANDOFF = r"""#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
env -0 > "$FAKE_SRUN_DIR/env"
printf '%s\0' "$@" > "$FAKE_SRUN_DIR/args.tmp" && mv "$FAKE_SRUN_DIR/args.tmp" "$FAKE_SRUN_DIR/args"
while [ ! -e "$FAKE_SRUN_DIR/rc" ]; do sleep 0.05; done
exit "$(cat "$FAKE_SRUN_DIR/rc")"
"""


def _job_rank(rank, world, argv, nproc, job_env, logs):
    """One rank of a handed-off job: ``python -m dept_mega.train ARGV``'s ``main`` in the script's
    environment with torchrun's variables, its output appended to its node's log."""
    import sys as _sys
    node, local = divmod(rank, nproc)
    store = {k: os.environ[k] for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}  # this job's
    os.environ.clear()
    os.environ.update(job_env)
    os.environ.update(store, LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK=str(node),
                      GROUP_WORLD_SIZE=str(world // nproc))
    fd = os.open(os.path.join(logs, f"node{node}.log"), os.O_WRONLY | os.O_APPEND)
    _sys.stdout.flush()
    _sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    from dept_mega.train import main
    status = main(argv)
    _sys.stdout.flush()
    _sys.stderr.flush()
    return status


def _run_script(script, env, cwd, handoff, logs, timeout=300) -> subprocess.CompletedProcess:
    """Run an sbatch script whose srun is FAKE_SRUN_HANDOFF: when srun has handed over its
    command line (``bash -c TORCHRUN_ON_NODE torchrun OPTIONS -m dept_mega.train ARGS``), the
    job's ranks run here (_job_rank, forked), then srun ends with the job's status."""
    import time

    from .mp_utils import run_distributed
    handoff.mkdir()
    p = subprocess.Popen(script, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(env, FAKE_SRUN_DIR=str(handoff)), cwd=cwd)
    try:
        deadline = time.monotonic() + timeout
        while not (handoff / "args").exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if (handoff / "args").exists():
            args = (handoff / "args").read_text().split("\0")[:-1]
            job_env = dict(kv.split("=", 1) for kv in (handoff / "env").read_text().split("\0") if "=" in kv)
            assert args[:2] == ["bash", "-c"] and args[3] == "torchrun", args[:4]
            m = args.index("-m")
            opt = dict(zip(args[4:m:2], args[5:m:2]))
            assert args[m + 1] == "dept_mega.train", args[m + 1]
            nnodes, nproc = int(opt["--nnodes"]), int(opt["--nproc-per-node"])
            for node in range(nnodes):
                open(os.path.join(logs, f"node{node}.log"), "w").close()
            try:
                statuses = run_distributed(_job_rank, nnodes * nproc, args=(args[m + 2:], nproc, job_env, str(logs)),
                                           timeout=timeout)
            except Exception as exc:  # noqa: BLE001 - the job failed: srun's status, the error in node0's log
                with open(os.path.join(logs, "node0.log"), "a") as f:
                    f.write(f"\n{exc}\n")
                statuses = [1]
            (handoff / "rc").write_text("0" if not any(statuses) else "1")
        out, err = p.communicate(timeout=timeout)
    finally:
        if not (handoff / "rc").exists():  # an error here: a waiting srun ends too, not left polling
            (handoff / "rc").write_text("1")
        if p.poll() is None:
            p.kill()
            p.wait()
    return subprocess.CompletedProcess(script, p.returncode, out, err)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sbatch_script_trains_on_cpu(tmp_path):
    """std.sh end to end on one fake node with 2 CPU ranks: fake ``scontrol``/``srun`` (which
    hands its torchrun command line to the test, which forks the ranks: FAKE_SRUN_HANDOFF), the
    pre-flight, real dept_mega.train, the 1B config shrunk by overrides passed through the
    script. (torchrun itself, its c10d rendezvous and spec.sh end to end, with its measured outer
    bytes against tools/dept_costs.py's prediction: the two-node test below.)"""
    variant, data = "std", 2
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "scontrol").write_text("#!/bin/bash\necho 127.0.0.1\n")
    (bindir / "srun").write_text(FAKE_SRUN_HANDOFF)
    for f in bindir.iterdir():
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    run_dir = tmp_path / "run"
    env = dict(os.environ, PATH=os.pathsep.join([str(bindir), os.path.dirname(sys.executable), os.environ["PATH"]]),
               SLURM_NNODES="1", SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID=str(20000 + os.getpid() % 9000),
               SLURM_SUBMIT_DIR=ROOT, GPUS_PER_NODE="2", SLURM_CPUS_PER_TASK="2", DEVICE="cpu",
               RUN_DIR=str(run_dir), PYTHON=sys.executable)
    from .mp_utils import free_port

    env["MASTER_PORT"] = str(free_port())
    overrides = [f"parallel.data={data}", "dept.local_steps=1", "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4",
                 "model.num_query_groups=4", "model.ffn_hidden_size=64", "model.seq_length=32",
                 "model.vocab_size=300", "data.tokenizer=null", "precision=fp32", "backend=local",
                 "train.steps=2", "train.micro_batch_size=1", "train.global_batch_size=2",
                 "train.eval_interval=2", "train.eval_samples=2", "train.save_interval=2", "train.log_interval=1",
                 f"data.sources={_tiny_sources(tmp_path)}"]
    logs = tmp_path / "nodes"
    logs.mkdir()
    r = _run_script(["bash", os.path.join(EX, f"{variant}.sh"), *overrides], env, str(tmp_path), tmp_path / "handoff",
                    logs, timeout=280)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:] + (logs / "node0.log").read_text()[-4000:]
    groups = 2 // data
    assert f"world 2 = {groups} group(s) x tensor 1 x pipeline 1 x data {data}" in r.stdout
    import json

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [rec for rec in records if rec["kind"] == "train"]
    assert [rec["step"] for rec in train] == [1, 2]
    cfg = load_config(run_dir / "config.yaml")
    assert cfg.model.num_layers == 2 and cfg.train.run_dir == str(run_dir) and cfg.parallel.data == data
    assert not [rec for rec in records if rec["kind"] == "outer"]


@pytest.mark.parametrize("script,preempted,override", [("std", True, False), ("std", False, False),
                                                        ("std", True, True), ("federated_group", True, True)])
def test_preempted_job_requeues_itself(tmp_path, script, preempted, override):
    """The scripts ask for SIGUSR1 before the time limit and may be requeued; when the ranks
    leave ``RUN_DIR/preempted.json`` (dept_mega.preemption) the script runs ``scontrol requeue
    $SLURM_JOB_ID`` and ends 0; otherwise it ends with srun's status and requeues nothing.
    A stale marker from an earlier job is removed before the launch. ``override``: the run
    directory given as ``train.run_dir=`` arguments after the script name (the last one wins,
    as in the trainer) instead of RUN_DIR: the script removes the stale marker, names the
    directory, creates it and finds the marker there, not in RUN_DIR. torchrun's shutdown
    timeout is the lead time of ``--signal=USR1@N`` less 10 s: N from the script's header, or
    PREEMPT_LEAD_S (the override cases: 600). (Without the pre-flight, which reads no marker:
    the two-node test's requeued launch runs it beside one.)"""
    for variant in (*VARIANTS, "federated_group"):
        h = sbatch_headers(os.path.join(EX, f"{variant}.sh"))
        assert h.get("signal") == "USR1@120" and "requeue" in h, variant
        # a requeued job starts again with the same job id, hence the same log file: Slurm
        # truncates it (JobFileAppend=0, the default) unless the job asks to append
        assert h.get("open-mode") == "append", variant
    bindir = tmp_path / "qbin"
    bindir.mkdir()
    log = tmp_path / "scontrol.log"
    (bindir / "scontrol").write_text(f'#!/bin/bash\nif [ "$1" = requeue ]; then echo "$@" >> {log}; exit 0; fi\n'
                                     'for i in 1 2 3 4 5 6 7 8; do echo node0$i; done\n')
    write = "1" if preempted else "0"
    (bindir / "srun").write_text(
        '#!/bin/bash\necho "$PET_SIGNALS_TO_HANDLE $TORCH_ELASTIC_SHUTDOWN_TIMEOUT" > "$FAKE_SRUN_LOG"\n'
        'for a in "$@"; do case "$a" in train.run_dir=*) d="${a#train.run_dir=}";; esac; done\n'
        'test ! -e "$d/preempted.json" || exit 9\n'  # the stale marker was removed
        f'if [ {write} = 1 ]; then echo \'{{"step": 7, "signal": "SIGUSR1", "exit_code": 75}}\' > "$d/preempted.json"; fi\n'
        'exit 1\n')
    for f in bindir.iterdir():
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "preempted.json"), "w") as f:
        f.write("{}")  # stale
    env = dict(os.environ, PATH=str(bindir) + os.pathsep + os.environ["PATH"], SLURM_NNODES="8",
               SLURM_JOB_NODELIST="node0[1-8]", SLURM_JOB_ID="4242", SLURM_CPUS_PER_TASK="64",
               SLURM_GPUS_ON_NODE="8", SLURM_SUBMIT_DIR=ROOT, FAKE_SRUN_LOG=str(tmp_path / "srun.log"),
               PYTHON=sys.executable, RUN_DIR=run_dir, DEPT_SKIP_PREFLIGHT="1",
               DEPT_GROUP="0", LIGHTHOUSE="127.0.0.1:29510")  # (federated_group.sh's)
    for k in ("DEPT_MEGA_ROOT", "PET_SIGNALS_TO_HANDLE", "TORCHELASTIC_SIGNALS_TO_HANDLE", "CONFIG",
              "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "PREEMPT_LEAD_S"):
        env.pop(k, None)
    args, lead = [], int(h["signal"].split("@")[1])
    if override:
        lead = 600
        env.update(RUN_DIR=str(tmp_path / "env_run"), PREEMPT_LEAD_S=str(lead))
        args = [f"train.run_dir={tmp_path / 'first'}", f"train.run_dir={run_dir}"]
    r = subprocess.run(["bash", os.path.join(ROOT, "examples", "1b", f"{script}.sh"), *args],
                       capture_output=True, text=True, timeout=120, env=env, cwd=str(tmp_path))
    handled, shutdown = (tmp_path / "srun.log").read_text().split()
    assert "SIGUSR1" in handled, r.stdout + r.stderr  # torchrun passes it on to the ranks
    assert int(shutdown) == lead - 10
    assert f"run dir {run_dir}" in r.stdout
    assert not (tmp_path / "env_run").exists() and not (tmp_path / "first").exists()
    if preempted:
        assert r.returncode == 0, r.stdout + r.stderr
        assert log.read_text().split() == ["requeue", "4242"]
        assert "preempted:" in r.stdout and "requeueing job 4242" in r.stdout
    else:
        assert r.returncode == 1, r.stdout + r.stderr
        assert not log.exists()


FAKE_SRUN_NODES = r'''#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
mapfile -t names < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do
  SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 SLURMD_NODENAME=${names[$i]} "$@" > "$FAKE_NODE_LOGS/node$i.log" 2>&1 &
  pids+=($!)
done
echo "${pids[@]}" > "$FAKE_SRUN_PIDS"
rc=0
for p in "${pids[@]}"; do
  s=0; wait "$p" || s=$?
  if [ "$s" -gt "$rc" ]; then rc=$s; fi
done
exit "$rc"
'''


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_node_job_preempted_requeued_and_resumed(tmp_path):
    """spec.sh on a simulated 2-node allocation (fake ``srun`` starting one real torchrun per
    node, c10d rendezvous on the first node; 2 CPU ranks per node, data 2: one source group per
    node), then Slurm's ``--signal=USR1@120`` (SIGUSR1 to each node's torchrun): the ranks save
    and exit 75, the script requeues the job (``scontrol requeue``) and ends 0; the requeued job
    (same job id, same environment) resumes from that checkpoint and finishes; its srun forks the
    ranks handed to the test (FAKE_SRUN_HANDOFF: torchrun's part is the first launch's). The
    layout of docs/launching.md section 2: torchrun gives each node consecutive ranks (its log in
    the first launch), and a group of T·P·D = ranks per node is one node, with its 2 data-parallel
    replicas on that node (params.json).
    The 1B config shrunk by overrides passed through the script reaches the run, and every
    round's measured outer bytes are what tools/dept_costs.py predicts.

    Kept small for the CI budget: 24 steps (the signal comes after step 2; the steps left are
    the margin for it to arrive before the end), no periodic eval or save (the preemption's save
    is the one resumed from), and the pre-flight (a Python start with torch, ~2 s here) on the
    requeued launch only (``DEPT_SKIP_PREFLIGHT=1`` on the first): there it also shows that the
    pre-flight accepts the preempted run's directory and its checkpoint."""
    import json
    import signal
    import time

    bindir = tmp_path / "bin"
    bindir.mkdir()
    requeues = tmp_path / "requeue.log"
    (bindir / "scontrol").write_text(f'#!/bin/bash\nif [ "$1" = requeue ]; then echo "$@" >> {requeues}; exit 0; fi\n'
                                     'echo 127.0.0.1\necho 127.0.0.2\n')
    (bindir / "srun").write_text(FAKE_SRUN_NODES)
    for f in bindir.iterdir():
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    logs = tmp_path / "nodes"
    logs.mkdir()
    run_dir = tmp_path / "run"
    from .mp_utils import free_port

    env = dict(os.environ, PATH=os.pathsep.join([str(bindir), os.path.dirname(sys.executable), os.environ["PATH"]]),
               SLURM_NNODES="2", SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="node[0-1]",
               SLURM_JOB_ID=str(30000 + os.getpid() % 9000), SLURM_NTASKS_PER_NODE="1", SLURM_GPUS_ON_NODE="2",
               SLURM_GPUS_PER_NODE="2", SLURM_CPUS_PER_TASK="2", SLURM_SUBMIT_DIR=ROOT, DEVICE="cpu",
               RUN_DIR=str(run_dir), PYTHON=sys.executable, MASTER_PORT=str(free_port()),
               FAKE_NODE_LOGS=str(logs), FAKE_SRUN_PIDS=str(tmp_path / "srun.pids"),
               LOGLEVEL="INFO")  # torchrun logs its launch configs, is_host among them
    for k in ("DEPT_MEGA_ROOT", "GPUS_PER_NODE", "PET_SIGNALS_TO_HANDLE", "TORCHELASTIC_SIGNALS_TO_HANDLE",
              "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        env.pop(k, None)
    steps = 24
    overrides = ["parallel.data=2", "dept.local_steps=4", "model.num_layers=2", "model.hidden_size=32",
                 "model.num_attention_heads=4", "model.num_query_groups=4", "model.ffn_hidden_size=64",
                 "model.seq_length=32", "model.vocab_size=300", "data.tokenizer=null", "precision=fp32",
                 "backend=local", f"train.steps={steps}", "train.micro_batch_size=1", "train.global_batch_size=2",
                 "train.eval_interval=0", "train.eval_iters=1", "train.save_interval=0", "train.log_interval=1",
                 "train.init_timeout_s=120", f"data.sources={_tiny_sources(tmp_path)}"]
    script = ["bash", os.path.join(EX, "spec.sh"), *overrides]

    def train_steps():
        try:
            lines = (run_dir / "metrics.jsonl").read_text().splitlines()
            return [json.loads(line)["step"] for line in lines if '"kind": "train"' in line]
        except (OSError, ValueError):
            return []

    def node_logs():
        return "".join((logs / f"node{i}.log").read_text() for i in range(2) if (logs / f"node{i}.log").exists())

    p = subprocess.Popen(script, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(env, DEPT_SKIP_PREFLIGHT="1"), cwd=str(tmp_path))
    try:
        deadline = time.monotonic() + 300
        while max(train_steps(), default=0) < 2 and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert p.poll() is None and max(train_steps(), default=0) >= 2, "the job ended before the signal: " + node_logs()[-3000:]
        for pid in (tmp_path / "srun.pids").read_text().split():
            os.kill(int(pid), signal.SIGUSR1)
        out, _ = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, out[-3000:] + node_logs()[-3000:]
    assert "pre-flight:" not in out
    assert "launch: spec on 2 node(s) x 2 GPU(s)" in out
    assert "world 4 = groups 2 × data 2 × pipeline 1 (virtual 1) × tensor 1" in node_logs()
    # the first node of the list (scontrol show hostnames, SLURMD_NODENAME) hosts the store: on
    # one machine the rendezvous would work whichever node hosted it, so look at what each said
    for i in range(2):
        text = (logs / f"node{i}.log").read_text()
        assert re.search(rf"rdzv_configs *: {{'is_host': '{1 - i}'", text), i
        # torchrun gives each node consecutive ranks (the requeued launch's ranks are placed so)
        assert re.search(rf"group_rank={i}$", text, re.MULTILINE), i
        assert re.search(rf"global_ranks=\[{2 * i}, {2 * i + 1}\]$", text, re.MULTILINE), i
    job = env["SLURM_JOB_ID"]
    assert requeues.read_text().split() == ["requeue", job]
    assert f"requeueing job {job}" in out
    marker = json.loads((run_dir / "preempted.json").read_text())
    stopped = marker["step"]
    assert marker["signal"] == "SIGUSR1" and marker["exit_code"] == 75 and 2 <= stopped < steps
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == str(stopped)
    assert max(train_steps()) == stopped  # every rank stopped after the same step
    assert "exiting with status 75" in node_logs()
    assert "| custom ops=" in node_logs()  # the backends: line names the custom ops' kernels

    # Slurm starts the requeued job: the same script, job id and environment (its ranks handed to
    # the test: FAKE_SRUN_HANDOFF)
    (bindir / "srun").write_text(FAKE_SRUN_HANDOFF)
    r = _run_script(script, env, str(tmp_path), tmp_path / "handoff", logs, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:] + node_logs()[-3000:]
    assert "pre-flight: spec, world 4 = 2 group(s) x tensor 1 x pipeline 1 x data 2" in r.stdout
    assert f"resume: from {run_dir}/checkpoints/step_{stopped}; the model, DEPT, source and tokenizer keys" in r.stdout
    assert requeues.read_text().split() == ["requeue", job]  # not requeued again
    assert not (run_dir / "preempted.json").exists()
    assert f"resumed from {run_dir}/checkpoints/step_{stopped}" in node_logs()
    assert train_steps() == list(range(1, steps + 1))
    ranks = json.loads((run_dir / "params.json").read_text())["ranks"]
    assert [(q["rank"], q["node"], q["local_rank"], q["group"], q["dp"]) for q in ranks] == \
        [(0, 0, 0, 0, 0), (1, 0, 1, 0, 1), (2, 1, 0, 1, 0), (3, 1, 1, 1, 1)]
    # the 1B config shrunk by the overrides passed through the script; every round's measured
    # outer bytes (both launches') are what tools/dept_costs.py predicts
    from dept_mega.dept.costs import predict_outer_round_bytes
    cfg = load_config(run_dir / "config.yaml")
    assert cfg.model.num_layers == 2 and cfg.train.run_dir == str(run_dir) and cfg.parallel.data == 2
    outer = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"kind": "outer"' in line]
    assert [rec["step"] for rec in outer] == list(range(4, steps + 1, 4))
    predicted = predict_outer_round_bytes(cfg, 2)
    for rec in outer:
        assert rec["bytes"]["outer_body"] == predicted["outer_body"] > 0
        assert rec["bytes"]["outer_embedding"] == predicted["outer_embedding"] == 0

