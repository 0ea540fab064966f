"""Which config each part of a run used: RUN/config.yaml is the config of the launch that
trained (a launch that trains nothing leaves it), every launch keeps its resolved config as
RUN/configs/launch_N.yaml, and every checkpoint holds the config of the launch that wrote it
(step_N/config.yaml, in its manifest)."""
from __future__ import annotations

import json
import os

import yaml

from dept_mega.config import load_config
from tests.test_train_cli import _copy_run, _train_here, trained  # noqa: F401 - the shared finished run


def _lr(path: str) -> float:
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)["optim"]["lr"]


def test_each_launch_and_checkpoint_keeps_its_config(tmp_path, trained):  # noqa: F811
    cfg, run = _copy_run(trained, tmp_path / "run")
    d = str(tmp_path / "run")
    trained_lr = _lr(os.path.join(d, "config.yaml"))
    assert os.listdir(os.path.join(d, "configs")) == ["launch_1.yaml"]
    assert _lr(os.path.join(d, "checkpoints", "step_4", "config.yaml")) == trained_lr
    # a launch of the finished run trains nothing: config.yaml stays the config that trained it
    idle = _train_here("--config", cfg, run, "optim.lr=1.0")
    assert idle.returncode == 0 and "nothing to do" in idle.stdout, idle.stderr
    assert _lr(os.path.join(d, "config.yaml")) == trained_lr
    launch2 = os.path.join(d, "configs", "launch_2.yaml")
    assert _lr(launch2) == 1.0 and f"config: {launch2} ({d}/config.yaml left as" in idle.stdout, idle.stdout
    with open(launch2, encoding="utf-8") as f:
        assert "resumed from checkpoint step 4; trains nothing" in f.readline()
    # a launch that trains: its config everywhere it applies, the older checkpoint keeps its own
    more = _train_here("--config", cfg, run, "optim.lr=0.5", "train.steps=6")
    assert more.returncode == 0, more.stderr
    launch3 = os.path.join(d, "configs", "launch_3.yaml")
    assert _lr(os.path.join(d, "config.yaml")) == 0.5 and _lr(launch3) == 0.5
    with open(launch3, encoding="utf-8") as f:
        assert "resumed from checkpoint step 4; trains from step 4 to 6" in f.readline()
    step6 = os.path.join(d, "checkpoints", "step_6")
    assert _lr(os.path.join(step6, "config.yaml")) == 0.5
    assert _lr(os.path.join(d, "checkpoints", "step_4", "config.yaml")) == trained_lr
    with open(os.path.join(step6, "manifest.json"), encoding="utf-8") as f:
        assert "config.yaml" in json.load(f)["files"]  # verified as the checkpoint's other files
    # each file is a config the trainer takes back as it is
    assert load_config(launch3).to_dict() == load_config(os.path.join(d, "config.yaml")).to_dict()
    assert load_config(os.path.join(step6, "config.yaml")).to_dict() == load_config(launch3).to_dict()


def test_a_run_without_config_yaml_gets_one_even_from_a_launch_that_trains_nothing(tmp_path, trained):  # noqa: F811
    """(config.yaml lost, e.g. a run directory copied without it: evaluate and the export need one.)"""
    cfg, run = _copy_run(trained, tmp_path / "run")
    main = os.path.join(str(tmp_path / "run"), "config.yaml")
    os.remove(main)
    r = _train_here("--config", cfg, run, "optim.lr=1.0")
    assert r.returncode == 0 and "nothing to do" in r.stdout, r.stderr
    assert _lr(main) == 1.0 and "left as" not in r.stdout
