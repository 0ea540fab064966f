"""``train.device`` (dept_mega.parallel.device): ``cuda`` refuses a launch that cannot use CUDA,
naming the key and why (a CPU build of torch, no device visible, fewer devices than processes,
CUDA's own initialisation error), instead of the silent CPU fallback of ``auto``; ``cpu`` stays on
the CPU where CUDA works; ``auto`` is what it was. CUDA's states are stood in for where this
machine cannot have them (a CPU build of torch, no GPU)."""
from __future__ import annotations

import pytest
import torch

from dept_mega.config import ConfigError, load_config
from dept_mega.parallel import device as dev
from dept_mega.parallel.groups import init_distributed
from tests.trainer_utils import TINY_STD

CUDA_HERE = torch.cuda.is_available()


@pytest.fixture
def clean_env(monkeypatch):
    for k in ("DEPT_MEGA_DEVICE", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "RANK", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def _cuda_build(monkeypatch, init_error=None, count=8, available=True):
    """This process as a CUDA build of torch whose ``torch.cuda.init`` raises ``init_error``
    (None: succeeds) and which sees ``count`` devices."""
    monkeypatch.setattr(torch.version, "cuda", "13.0")

    def init():
        if init_error is not None:
            raise RuntimeError(init_error)
    monkeypatch.setattr(torch.cuda, "init", init)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)


def test_the_key_takes_three_values():
    assert load_config(TINY_STD).train.device == "auto"
    for value in ("auto", "cuda", "cpu"):
        assert load_config(TINY_STD, [f"train.device={value}"]).train.device == value
    with pytest.raises(ConfigError, match=r"config key 'train.device': 'gpu' is not one of auto \| cuda \| cpu"):
        load_config(TINY_STD, ["train.device=gpu"])


@pytest.mark.skipif(CUDA_HERE, reason="this machine can use CUDA: nothing to refuse")
def test_cuda_without_cuda_here_is_refused_naming_the_key_and_why(clean_env):
    """Here (no usable CUDA): the launch's own device choice, init_distributed, refuses."""
    with pytest.raises(ConfigError) as exc:
        init_distributed(device="cuda")
    msg = str(exc.value)
    assert msg.startswith("config key 'train.device': cuda, but "), msg
    assert "does not fall back to the CPU" in msg and "train.device=cpu" in msg, msg
    if torch.version.cuda is None:  # the CPU build the CI machine has: named, with how to get a CUDA one
        assert f"torch {torch.__version__}" in msg and "CPU-only build (torch.version.cuda is None)" in msg, msg
        assert "--index-url https://download.pytorch.org/whl/cu" in msg, msg


def test_a_cpu_build_is_named_with_its_environment(clean_env):
    clean_env.setattr(torch.version, "cuda", None)
    clean_env.setattr(torch.version, "hip", None, raising=False)
    with pytest.raises(ConfigError, match=r"torch \S+ in \S+ is a CPU-only build .*pip install torch==\S+ "
                                          r"--index-url https://download.pytorch.org/whl/cu130"):
        dev.use_cuda("cuda")


@pytest.mark.parametrize("visible,shown", [("", "CUDA_VISIBLE_DEVICES=''"), (None, "CUDA_VISIBLE_DEVICES unset")])
def test_cuda_that_cannot_initialise_says_torchs_reason(clean_env, visible, shown):
    """A driver too old for torch's CUDA, or no device visible: torch.cuda.is_available() only
    says False (and warns); the refusal carries CUDA's own error text and CUDA_VISIBLE_DEVICES."""
    if visible is not None:
        clean_env.setenv("CUDA_VISIBLE_DEVICES", visible)
    too_old = "The NVIDIA driver on your system is too old (found version 12020)."
    _cuda_build(clean_env, init_error=too_old, count=0, available=False)
    with pytest.raises(ConfigError) as exc:
        dev.use_cuda("cuda")
    msg = str(exc.value)
    assert msg.startswith("config key 'train.device': cuda, but CUDA cannot be used by torch"), msg
    assert too_old in msg and f"({shown})" in msg and "(CUDA 13.0)" in msg, msg
    assert "pip install" not in msg, msg  # not a CPU build: no install advice
    assert dev.use_cuda("auto") is False  # auto: the CPU, as before


def test_fewer_devices_than_processes_on_the_node(clean_env):
    clean_env.setenv("LOCAL_WORLD_SIZE", "8")
    clean_env.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    _cuda_build(clean_env, count=4)
    with pytest.raises(ConfigError, match=r"only 4 CUDA device\(s\) visible to this process "
                                          r"\(CUDA_VISIBLE_DEVICES='0,1,2,3'\) for the 8 process\(es\)"):
        dev.use_cuda("cuda", dev.local_world_size())
    clean_env.setenv("LOCAL_WORLD_SIZE", "4")
    assert dev.use_cuda("cuda", dev.local_world_size()) is True


def test_cuda_with_the_cpu_forcing_environment_is_a_contradiction(clean_env):
    """DEPT_MEGA_DEVICE=cpu makes auto the CPU; with cuda asked for it is an error, not a CPU run."""
    _cuda_build(clean_env)
    clean_env.setenv("DEPT_MEGA_DEVICE", "cpu")
    with pytest.raises(ConfigError, match="config key 'train.device': cuda, but the environment sets DEPT_MEGA_DEVICE=cpu"):
        dev.use_cuda("cuda")
    assert dev.use_cuda("auto") is False


def test_auto_takes_cuda_where_available_and_cpu_stays_on_the_cpu(clean_env):
    _cuda_build(clean_env)
    assert dev.use_cuda("auto") is True
    assert dev.use_cuda("cuda") is True
    assert dev.use_cuda("cpu") is False
    # the launch itself under cpu: the CPU and no CUDA call, where CUDA would be available
    clean_env.setattr(torch.cuda, "set_device", lambda d: pytest.fail(f"set_device({d}) under train.device: cpu"))
    assert init_distributed(device="cpu")[2] == torch.device("cpu")


def test_auto_with_more_processes_than_devices_names_the_key(clean_env):
    """auto takes CUDA where it is available; a process whose LOCAL_RANK has no device (more
    processes per node than GPUs) stops naming the key, not with CUDA's "invalid device ordinal"."""
    _cuda_build(clean_env, count=2)
    clean_env.setenv("LOCAL_RANK", "2")
    clean_env.setattr(torch.cuda, "set_device", lambda d: pytest.fail(f"set_device({d}) before the check"))
    with pytest.raises(ConfigError) as exc:
        init_distributed(device="auto")
    assert str(exc.value).startswith("config key 'train.device': auto took CUDA, but this process is LOCAL_RANK=2 "
                                     "and only 2 CUDA device(s) are visible ("), exc.value
    assert "--nproc-per-node" in str(exc.value) and "train.device=cpu" in str(exc.value)


def test_the_run_log_says_why_it_runs_on_the_cpu(clean_env):
    assert dev.describe_device("cuda", torch.device("cuda", 3)) == "device cuda:3"
    assert dev.describe_device("cpu", torch.device("cpu")) == "device cpu (train.device: cpu)"
    clean_env.setattr(torch.version, "cuda", None)
    clean_env.setattr(torch.version, "hip", None, raising=False)
    note = dev.describe_device("auto", torch.device("cpu"))
    assert note.startswith("device cpu (train.device: auto, torch ") and "CPU-only build" in note, note
    clean_env.setenv("DEPT_MEGA_DEVICE", "cpu")
    assert dev.describe_device("auto", torch.device("cpu")) == "device cpu (train.device: auto, DEPT_MEGA_DEVICE=cpu)"


def test_auto_is_unchanged_here(clean_env):
    """auto on this machine: CUDA exactly when torch says it is available, as before the key."""
    want = torch.device("cuda", 0) if CUDA_HERE else torch.device("cpu")
    assert init_distributed()[2] == want
    assert init_distributed(device="auto")[2] == want


def test_the_preflight_line(clean_env):
    """--check's device line: what the launch would take on this machine; cuda without CUDA is
    the launch's refusal, saying that the pre-flight checked the machine it ran on."""
    clean_env.setattr(torch.version, "cuda", None)
    clean_env.setattr(torch.version, "hip", None, raising=False)
    assert dev.preflight_line("cpu") == "device: cpu (train.device), gloo"
    assert dev.preflight_line("auto").startswith("device: auto -> CPU here (train.device: auto, torch ")
    with pytest.raises(ConfigError, match="CPU-only build.*the pre-flight checks the machine it runs on"):
        dev.preflight_line("cuda")
    _cuda_build(clean_env, count=2)
    clean_env.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    assert dev.preflight_line("cuda") == ("device: cuda -> CUDA here (2 device(s), NVIDIA H200; "
                                          f"torch {torch.__version__}, CUDA 13.0)")
    assert dev.preflight_line("auto").startswith("device: auto -> CUDA here (2 device(s)")


def test_an_unreadable_local_world_size_is_named(clean_env):
    clean_env.setenv("LOCAL_WORLD_SIZE", "eight")
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE='eight' is not a number of processes"):
        dev.local_world_size()
    # only train.device: cuda counts devices: auto and cpu do not read it
    assert init_distributed(device="cpu")[2].type == "cpu"


def test_the_benchmark_tool_honours_train_device(tmp_path, capsys, clean_env):
    """tools/benchmark.py initialises with the config's train.device: cuda on this CPU machine
    is refused with the key named, not benchmarked on the CPU."""
    import importlib.util
    import os

    import tests.trainer_utils as tu
    spec = importlib.util.spec_from_file_location("benchmark_tool", os.path.join(tu.ROOT, "tools", "benchmark.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    if torch.cuda.is_available():
        pytest.skip("CUDA is usable here")
    cfg = os.path.join(tu.ROOT, "examples", "tiny", "std.yaml")
    assert bench.main(["--config", cfg, "--steps", "1", "--out", str(tmp_path / "b.json"), "model.vocab_size=64",
                       "train.device=cuda"]) == 2
    err = capsys.readouterr().err
    assert "error: config key 'train.device': cuda, but " in err, err
