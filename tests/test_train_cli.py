"""``python -m dept_mega.train``'s checks without a launch: ``--print-config`` (the resolved
YAML, defaults included) and ``--check --world-size N`` (the pre-flight: layout, files,
vocabulary, memory per rank, disk space; exit 0, or 2 with one line naming the key)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

from tests.data_utils import train_tiny_tokenizer, write_docs
from tests.trainer_utils import ROOT

TINY_MODEL = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 4,
              "ffn_hidden_size": 64, "seq_length": 16}


def _setup(tmp_path, variant="glob", vocab_hi=100) -> str:
    """A config with a tiny SentencePiece tokenizer and two sources whose ids are < ``vocab_hi``."""
    tok = train_tiny_tokenizer(str(tmp_path / "tok"))
    rng = np.random.default_rng(0)
    sources = []
    for name in ("a", "b"):
        docs = [rng.integers(3, vocab_hi, int(rng.integers(20, 60))).tolist() for _ in range(40)]
        prefix = write_docs(str(tmp_path / f"{name}_text_document"), docs, nbytes=[3 * len(d) for d in docs])
        sources.append({"name": name, "prefix": prefix})
    cfg = {"model": TINY_MODEL, "precision": "fp32", "backend": "local",
           "dept": {"variant": variant, "local_steps": 2},
           "data": {"tokenizer": tok, "sources": sources, "split": "90,10"},
           "train": {"steps": 4, "micro_batch_size": 2, "global_batch_size": 4, "eval_iters": 1, "run_dir": str(tmp_path / "run")}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _train(*args: str) -> subprocess.CompletedProcess:
    """``python -m dept_mega.train ARGS`` as a fresh process (the real entry point)."""
    env = dict(os.environ, PYTHONPATH=ROOT, DEPT_MEGA_DEVICE="cpu")
    env.pop("DEPT_GROUP", None)  # (a federated group job's index)
    return subprocess.run([sys.executable, "-m", "dept_mega.train", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)


def _train_here(*args: str) -> subprocess.CompletedProcess:
    """``dept_mega.train.main(ARGS)`` in this process, its status and what it printed as
    :func:`_train` returns them: what these tests check is main's, not the interpreter's, and a
    fresh process costs ~2 s of the 2-core CI machine importing torch (the entry point itself is
    run as a process by test_print_config_is_the_resolved_yaml and tests/test_process_exit.py)."""
    import contextlib
    import io
    from unittest import mock

    from dept_mega import train as train_cli
    out, err = io.StringIO(), io.StringIO()
    env = {k: v for k, v in os.environ.items() if k != "DEPT_GROUP"}  # (a federated group job's index)
    env["DEPT_MEGA_DEVICE"] = "cpu"
    with mock.patch.dict(os.environ, env, clear=True), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        try:
            status = train_cli.main(list(args))
        except SystemExit as exc:  # argparse's usage errors
            status = exc.code
    return subprocess.CompletedProcess(["dept_mega.train", *args], status, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One finished run of :func:`_setup`'s config (4 steps, checkpoint at step 4), shared by the
    tests that look at a run directory holding a checkpoint: (config, run directory). A test
    that writes into the run works on its own copy (:func:`_copy_run`)."""
    tmp = tmp_path_factory.mktemp("trained")
    cfg = _setup(tmp)
    first = _train_here("--config", cfg)
    assert first.returncode == 0, first.stderr
    assert "\nexport to Hugging Face: " in first.stdout  # a launch's summary says it, not only --check
    assert os.path.isdir(os.path.join(str(tmp / "run"), "checkpoints", "step_4")), os.listdir(tmp / "run")
    return cfg, str(tmp / "run")


def _copy_run(trained, dest) -> tuple[str, str]:
    """A copy of the shared finished run at ``dest``: (config, the ``train.run_dir=`` override)."""
    import shutil
    cfg, run = trained
    shutil.copytree(run, str(dest))
    return cfg, f"train.run_dir={dest}"


def test_print_config_is_the_resolved_yaml(tmp_path):
    from dept_mega.config import load_config
    cfg = _setup(tmp_path)
    r = _train("--config", cfg, "train.steps=6", "--print-config", "optim.lr=1e-3")
    assert r.returncode == 0, r.stderr
    printed = yaml.safe_load(r.stdout)
    assert printed == load_config(cfg, ["train.steps=6", "optim.lr=1e-3"]).to_dict()
    assert printed["train"]["steps"] == 6 and printed["optim"]["lr"] == 1e-3
    assert printed["model"]["rope_theta"] == 10000.0  # a default the file does not set
    assert not os.path.exists(tmp_path / "run")
    bad = _train("--config", cfg, "train.stepz=6", "--print-config")
    assert bad.returncode == 2 and bad.stderr.strip() == ("error: unknown config key 'train.stepz'; did you mean "
                                                         "'train.steps'? (every key: docs/config.md)")


@pytest.mark.parametrize("world,overrides,want", [
    (2, [], None),
    (3, ["parallel.data=2"], "config key 'parallel': world size 3 is not divisible"),
    (2, ["data.sources.0.prefix=/nonexistent/x"], "config key 'data.sources[0].prefix': file '/nonexistent/x.bin'"),
    (2, ["model.vocab_size=50"], None),  # the tokenizer decides the vocabulary, not model.vocab_size
    # a federated group job: one source group, its index (DEPT_GROUP unset here) in range
    (2, ["federation.lighthouse=127.0.0.1:1", "federation.groups=2"], "config key 'parallel': a federated group job"),
    (1, ["federation.lighthouse=127.0.0.1:1", "federation.groups=2"],
     "config key 'federation.group': null and DEPT_GROUP is not set"),
    (1, ["federation.lighthouse=127.0.0.1:1", "federation.groups=2", "federation.group=2"],
     "config key 'federation.group': 2 is not a group index in [0, 2)"),
    # eager-only FP8 options with compiled blocks: refused before the job takes its GPUs
    (1, ["precision=bf16", "fp8=hybrid", "fp8_fused_casts=true", "train.compile=true"],
     "config key 'fp8_fused_casts': the fused casts run in the eager FP8 linears"),
    # CUDA asked for where it cannot be used (here: the DEPT_MEGA_DEVICE=cpu of _train_here), as the launch refuses it
    (2, ["train.device=cuda"], "config key 'train.device': cuda, but the environment sets DEPT_MEGA_DEVICE=cpu"),
])
def test_check_runs_the_preflight_without_torchrun(tmp_path, world, overrides, want):
    cfg = _setup(tmp_path)
    r = _train_here("--config", cfg, *overrides, "--check", "--world-size", str(world))
    if want is not None:
        assert r.returncode == 2, r.stdout + r.stderr
        assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and want in r.stderr, r.stderr
        return
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "pre-flight: glob, world 2 = 2 group(s) x tensor 1 x pipeline 1 x data 1" in out
    assert "batch: 4 sequences per group (train.global_batch_size) × 2 group(s) = 8 sequences" in out
    assert "vocabulary: 120 ids" in out
    assert "device: auto -> CPU here (train.device: auto, DEPT_MEGA_DEVICE=cpu)" in out
    assert "memory per rank (predicted, largest rank):" in out and "checkpoint: about" in out
    assert "export to Hugging Face: " in out  # its cases: tests/test_export_hf.py
    assert not os.path.exists(tmp_path / "run")  # nothing written


def test_check_warns_when_backend_auto_could_pick_transformer_engine(tmp_path):
    """--check on a login node cannot know whether ``backend: auto`` will find Transformer Engine
    on the GPU nodes; with a native-only FP8 setting it warns (and still passes), naming the fix."""
    cfg = _setup(tmp_path)
    fp8 = ["precision=bf16", "fp8=hybrid", "backend=auto"]
    r = _train_here("--config", cfg, *fp8, "fp8_fused_casts=true", "--check", "--world-size", "1")
    assert r.returncode == 0, r.stderr
    assert ("warning: config key 'backend': auto picks Transformer Engine on a node where it is installed, and that "
            "run would stop: config key 'fp8_fused_casts': true applies to the native FP8 linears") in r.stderr
    assert "set backend: local" in r.stderr
    quiet = _train_here("--config", cfg, *fp8, "--check", "--world-size", "1")
    assert quiet.returncode == 0 and "Transformer Engine" not in quiet.stderr, quiet.stderr


def test_check_names_token_ids_outside_the_vocabulary(tmp_path):
    cfg = _setup(tmp_path, vocab_hi=500)  # ids up to 499, the tokenizer has 120
    r = _train_here("--config", cfg, "--check", "--world-size", "2")
    assert r.returncode == 2 and "config key 'data.sources[0].prefix'" in r.stderr and "120 ids" in r.stderr
    assert _train_here("--config", cfg, "--check").returncode == 2  # --world-size is required


def test_check_warns_below_the_kept_checkpoints_of_free_space(tmp_path, monkeypatch):
    """The warning compares the free space with the checkpoints the run holds at once (its
    saves, or train.keep_checkpoints plus the one written beside them) times the checkpoint
    size the memory model predicts; that prediction is close to a real checkpoint of the run
    (std, fp32). The line names the write rate a save within TORCH_ELASTIC_SHUTDOWN_TIMEOUT needs."""
    import io

    import torch

    from dept_mega.checkpoint import Checkpointer, dir_bytes
    from dept_mega.config import load_config
    from dept_mega.dept.memory import predict_memory
    from dept_mega.loop import StdHooks, TrainLoop
    from dept_mega.metrics import MetricsWriter
    from dept_mega.parallel.groups import build_groups
    from dept_mega.preflight import checkpoint_bytes, preflight
    from dept_mega.trainer import Trainer
    from tests.dept_utils import SyntheticSource

    path, small = _setup(tmp_path, variant="std"), ["model.hidden_size=128", "model.ffn_hidden_size=512"]
    cfg = load_config(path, small)
    mem = predict_memory(cfg, 120)
    want = checkpoint_bytes(cfg, 1, mem, 120)
    usage = type("Usage", (), {})

    def disk(free):
        def du(path):
            u = usage()
            u.free = free
            return u
        return du

    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "100")
    lines, warnings = preflight(cfg, 1, disk_usage=disk(2 * want))
    assert not warnings and f"({want:,} bytes) predicted" in lines[-1]
    rate = f"{want / 100 / 1e6:.0f}" if want / 100 >= 1e7 else f"{want / 100 / 1e6:.2g}"
    assert f"a preemption's save in 100 s (TORCH_ELASTIC_SHUTDOWN_TIMEOUT) needs ~{rate} MB/s" in lines[-1]
    # 4 steps: saves at the end only, at steps 1, 2, 3 and the end (all kept), or with 2 kept
    for train, kept in (([], 1), (["train.save_interval=1"], 4),
                        (["train.save_interval=1", "train.keep_checkpoints=2"], 3)):
        c = load_config(path, small + train)
        size = checkpoint_bytes(c, 1, predict_memory(c, 120), 120)  # (its config.yaml counted)
        assert not preflight(c, 1, disk_usage=disk(kept * size))[1], train
        warnings = preflight(c, 1, disk_usage=disk(kept * size - 1))[1]
        assert len(warnings) == 1 and f"{kept * size - 1:,} bytes free, below the {kept} checkpoint(s)" \
            in warnings[0], (train, warnings)
        assert warnings[0].startswith("config key 'train.run_dir'")

    run = str(tmp_path / "ck")
    pg = build_groups(1, 1, 1)
    trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=120)
    loop = TrainLoop(cfg, pg, trainer, StdHooks(), MetricsWriter(run, stream=io.StringIO(), tensorboard=False),
                     lambda n: SyntheticSource(cfg, 1, torch.arange(120)), checkpointer=Checkpointer(run))
    trainer.train_step(loop.iterator("blend").next_step())
    real = dir_bytes(loop.save())
    assert 0.9 * real <= want <= 1.1 * real, (want, real)


def test_relaunching_a_finished_run_keeps_its_params_json(tmp_path, trained):
    """A launch that finds the run complete trains nothing and so leaves RUN/params.json (the
    parameters per rank of the layout that trained, which tools/summarize_runs.py reports) as it
    was, instead of rewriting it for its own, possibly other, layout."""
    import json
    cfg, run_dir = _copy_run(trained, tmp_path / "run")
    params = tmp_path / "run" / "params.json"
    assert json.loads(params.read_text())["ranks"][0]["rank"] == 0
    params.write_text('{"ranks": "written by the launch that trained"}')
    again = _train_here("--config", cfg, run_dir)
    assert again.returncode == 0 and "nothing to do: the run is complete at step 4" in again.stdout, again.stderr
    assert params.read_text() == '{"ranks": "written by the launch that trained"}'


def test_check_against_the_checkpoint_it_would_resume(tmp_path, trained):
    """--check on a run directory that holds a checkpoint checks what the resume would: a key
    the checkpoint depends on (here dept.local_steps) is refused with the launch's own line; an
    allowed change (train.steps) reports the checkpoint it will resume from. (--check only reads
    the run directory: the shared run as it is.)"""
    cfg, run = trained
    ok = _train_here("--config", cfg, "train.steps=8", "--check", "--world-size", "1")
    assert ok.returncode == 0, ok.stderr
    step = os.path.join(run, "checkpoints", "step_4")
    assert f"resume: from {step}; the model, DEPT, source and tokenizer keys it depends on match" in ok.stdout
    bad = _train_here("--config", cfg, "train.steps=8", "dept.local_steps=4", "--check", "--world-size", "1")
    assert bad.returncode == 2 and bad.stderr.strip() == (
        f"error: config key 'dept.local_steps' differs from checkpoint {step}: the checkpoint has 2, this launch "
        f"has 4; resume with the checkpoint's values, or start a new train.run_dir"), bad.stderr
    fresh = _train_here("--config", cfg, "train.run_dir=" + str(tmp_path / "new"), "--check", "--world-size", "1")
    assert fresh.returncode == 0 and "resume:" not in fresh.stdout, fresh.stderr


@pytest.mark.parametrize("over,evaluates", [(["train.eval_iters=0"], False), (["train.eval_samples=0"], False),
                                            (["train.eval_iters=0", "train.eval_samples=4"], True), ([], True)])
def test_no_evaluation_when_it_would_read_no_sequence(tmp_path, over, evaluates):
    """train.eval_iters=0 (or eval_samples=0, which a study run's config sets in its place):
    no evaluation and no eval record, rather than records of 0 tokens and NaN losses."""
    import io

    import torch

    from dept_mega.config import load_config
    from dept_mega.loop import EvalStep, StdHooks, TrainLoop
    from dept_mega.metrics import MetricsWriter
    from dept_mega.parallel.groups import build_groups
    from dept_mega.trainer import MicroBatch, Trainer

    cfg = load_config(_setup(tmp_path, variant="std"), over)
    pg = build_groups(1, 1, 1)
    trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=120)
    out = io.StringIO()
    tokens = torch.randint(0, 120, (2, cfg.model.seq_length + 1), generator=torch.Generator().manual_seed(0))

    def batches(name):
        yield EvalStep(micro_batches=[MicroBatch(tokens)], nbytes=100.0)
    loop = TrainLoop(cfg, pg, trainer, StdHooks(), MetricsWriter(str(tmp_path / "run"), stream=out, tensorboard=False),
                     lambda n: None, eval_sources=["a"], make_eval_batches=batches)
    got = loop.evaluate()
    assert bool(got) == evaluates and ("eval step" in out.getvalue()) == evaluates, out.getvalue()


def test_a_resume_says_which_steps_wandb_keeps_from_the_interrupted_launch(tmp_path, trained, monkeypatch):
    """A launch that resumes the shared run's step-4 checkpoint after an interrupted launch had
    logged steps 5-6 to the same W&B run: its log drops those records from metrics.jsonl and says,
    once, that W&B keeps the abandoned values for steps 5-6 (W&B cannot rewrite logged steps)."""
    import json
    import sys

    from tests.test_metrics_writers import TRAIN, _FakeWandb
    cfg, run_dir = _copy_run(trained, tmp_path / "run")
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:
        for step in (5, 6):
            f.write(json.dumps({"kind": "train", "step": step, "round": 2, "time": 0.0, **TRAIN}) + "\n")
    (tmp_path / "run" / "wandb_id.txt").write_text("run-abc\n")
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    again = _train_here("--config", cfg, run_dir, "train.steps=6", "train.wandb=proj")
    assert again.returncode == 0, again.stderr
    assert fake.calls[0][1]["id"] == "run-abc"
    notes = [ln for ln in again.stdout.splitlines() if ln.startswith("warning: W&B")]
    assert len(notes) == 1 and "already has steps 5-6 from the interrupted launch" in notes[0], again.stdout
    assert "metrics.jsonl: dropped 2 record(s) after step 4" in again.stdout
