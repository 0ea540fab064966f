"""``python -m dept_mega.evaluate`` of a run trained in another layout: a launch whose process
count the run's layout does not divide is one line saying what to launch or override, and the
overrides evaluate the checkpoint in another layout (here one process for a pipeline-2 run)
with the run's own final numbers; an override of the run's sources is refused with evaluate's
own advice (not a training launch's "resume ... or start a new train.run_dir"): for STD, whose
sources share one table, --extra-source (not dept_mega.adapt, which trains per-source embeddings)."""
from __future__ import annotations

import json
import os

import pytest
import yaml

from dept_mega import evaluate as evaluate_cli
from dept_mega.eval_sources import not_the_runs_config
from tests.federation_utils import run_single_job
from tests.test_train_cli import _setup
from tests.trainer_utils import read_jsonl


def test_evaluate_a_pipeline_run_in_one_process(tmp_path, capsys, monkeypatch):
    cfg = _setup(tmp_path, variant="std")
    run = str(tmp_path / "run")
    run_single_job(cfg, run, 2, "parallel.pipeline=2", "data.split=80,20")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = str(tmp_path / "e.json")
    assert evaluate_cli.main(["--run-dir", run, "--out", out]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: config key 'parallel': the run's tensor × pipeline × data = 1×2×1 = 2 does "
                          "not divide the 1 process(es) of this launch: start a multiple of 2"), err
    assert "parallel.pipeline=1" in err and not os.path.exists(out)
    assert evaluate_cli.main(["--run-dir", run, "--out", out, "parallel.pipeline=1"]) == 0
    final = [r for r in read_jsonl(os.path.join(run, "metrics.jsonl")) if r["kind"] == "eval"][-1]
    got = json.load(open(out))
    assert got["step"] == final["step"] and set(got["by_source"]) == set(final["by_source"])
    assert all(v["loss"] is not None for v in final["by_source"].values())
    for name, v in final["by_source"].items():
        assert got["by_source"][name]["loss"] == pytest.approx(v["loss"], rel=1e-6)
    # another set of sources: refused, naming the key, with evaluate's advice
    sources = yaml.safe_load(open(os.path.join(run, "config.yaml")))["data"]["sources"]
    fewer = yaml.safe_dump(sources[:-1], default_flow_style=True, width=1 << 20).strip()
    os.remove(out)
    assert evaluate_cli.main(["--run-dir", run, "--out", out, "parallel.pipeline=1", f"data.sources={fewer}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: config key 'data.sources' differs from checkpoint "), err
    assert err.endswith(not_the_runs_config("std")) and "--extra-source NAME=PREFIX" in err, err
    assert "adapt" not in err, err
    assert "train.run_dir" not in err and not os.path.exists(out)
