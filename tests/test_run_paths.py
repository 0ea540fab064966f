"""A run's relative paths read from any directory (dept_mega.run_paths): the trainer records the
directory it was launched from in ``RUN/launch_dir.json``, and the tools that read the run's
config (dept_mega.evaluate, dept_mega.adapt, tools/summarize_runs.py, tools/convert_to_hf.py)
resolve its relative paths against it, saying so; a run without the record keeps reading them
from the current directory, and their errors say why."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import typing

import numpy as np
import pytest
import yaml

from dept_mega import config_schema
from dept_mega.config_schema import CHOICES, NOT_PATHS, PATH_KEYS, Config
from tests.data_utils import write_docs
from tests.test_train_cli import _setup, _train_here
from tests.trainer_utils import ROOT


def _string_keys(cls: type, prefix: str = "") -> set[str]:
    """Every key of the schema whose value is a string (list items as ``key[].field``)."""
    out: set[str] = set()
    hints = typing.get_type_hints(cls, vars(config_schema))
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = args[0] if typing.get_origin(tp) is typing.Union and len(args) == 1 else tp
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            out |= _string_keys(tp, key + ".")
        elif typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
            out |= _string_keys(typing.get_args(tp)[0], key + "[].")
        elif tp is str:
            out.add(key)
    return out


def test_every_string_key_is_a_path_a_choice_or_named_as_neither():
    """A new path key must join PATH_KEYS (or the tools would read it from the wrong directory)."""
    keys = _string_keys(Config)
    assert "data.sources[].prefix" in keys and "train.init_from" in keys
    assert keys == set(PATH_KEYS) | set(NOT_PATHS) | (keys & set(CHOICES)), \
        keys - set(PATH_KEYS) - set(NOT_PATHS) - set(CHOICES)
    assert not set(PATH_KEYS) & set(NOT_PATHS)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """A GLOB run (4 steps) launched from ``launch/`` with a config of relative paths (tokenizer,
    data, run directory), and an empty directory ``elsewhere/`` to run the tools from."""
    tmp = tmp_path_factory.mktemp("paths")
    launch, elsewhere = tmp / "launch", tmp / "elsewhere"
    launch.mkdir()
    elsewhere.mkdir()
    cfg = yaml.safe_load(open(_setup(launch)))
    cfg["data"]["tokenizer"] = os.path.relpath(cfg["data"]["tokenizer"], launch)
    for s in cfg["data"]["sources"]:
        s["prefix"] = os.path.relpath(s["prefix"], launch)
    cfg["model"].update({"norm_bias": False, "ffn_hidden_size": None})  # exportable (MPT)
    cfg["train"]["run_dir"] = "runs/r"
    (launch / "rel.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(launch)
        res = _train_here("--config", "rel.yaml")
    assert res.returncode == 0, res.stderr[-2000:]
    run = str(launch / "runs" / "r")
    # the same run as a run from before the record: no launch_dir.json
    old = str(tmp / "old")
    shutil.copytree(run, old)
    os.remove(os.path.join(old, "launch_dir.json"))
    return {"launch": os.path.realpath(launch), "elsewhere": str(elsewhere), "run": run, "old": old,
            "tokenizer": cfg["data"]["tokenizer"]}


def _note(run: str, launch: str) -> str:
    return (f"paths in {run}/config.yaml are relative to the launch directory {launch} (recorded in "
            f"{run}/launch_dir.json): data.tokenizer, data.sources[0].prefix, data.sources[1].prefix read from "
            f"there, not from the current directory")


def test_the_trainer_records_its_launch_directory(launched):
    run = launched["run"]
    with open(os.path.join(run, "launch_dir.json"), encoding="utf-8") as f:
        assert json.load(f) == {"launch_dir": launched["launch"]}
    with open(os.path.join(run, "config.yaml"), encoding="utf-8") as f:
        assert yaml.safe_load(f)["data"]["tokenizer"] == launched["tokenizer"]  # kept as given
    with open(os.path.join(run, "configs", "launch_1.yaml"), encoding="utf-8") as f:
        f.readline()
        assert f.readline().rstrip().endswith(f"relative to the directory it was launched from, {launched['launch']}")


def _evaluate(capsys, run: str) -> tuple[int, str]:
    from dept_mega import evaluate as evaluate_cli
    capsys.readouterr()
    status = evaluate_cli.main(["--run-dir", run, "--out", "e.json"])
    return status, capsys.readouterr().err


def test_evaluate_from_another_directory(launched, capsys, monkeypatch):
    monkeypatch.chdir(launched["elsewhere"])
    status, err = _evaluate(capsys, launched["run"])
    assert status == 0, err
    assert err.count(_note(launched["run"], launched["launch"])) == 1, err
    with open("e.json", encoding="utf-8") as f:
        assert set(json.load(f)["by_source"]) == {"a", "b"}
    monkeypatch.chdir(launched["launch"])  # from the launch directory: nothing to say
    status, err = _evaluate(capsys, launched["run"])
    assert status == 0 and "launch directory" not in err, err


def test_a_run_without_the_record_reads_from_here_and_its_error_says_why(launched, capsys, monkeypatch):
    monkeypatch.chdir(launched["elsewhere"])
    status, err = _evaluate(capsys, launched["old"])
    assert status == 2, err
    line = [ln for ln in err.splitlines() if ln.startswith("error: ")][-1]
    assert "does not exist" in line, line
    assert (f"{launched['old']}/config.yaml holds paths relative to the directory the run was launched from, which "
            f"this run does not record (it has no launch_dir.json") in line, line
    assert f"read from the current directory {os.path.realpath(launched['elsewhere'])}" in line, line
    monkeypatch.chdir(launched["launch"])  # today's behaviour: from the launch directory it works
    status, err = _evaluate(capsys, launched["old"])
    assert status == 0, err


def test_a_recorded_launch_directory_whose_files_are_gone_is_named(launched, capsys, monkeypatch, tmp_path):
    from dept_mega.run_paths import record_launch_dir
    moved = str(tmp_path / "moved")
    shutil.copytree(launched["run"], moved)
    record_launch_dir(moved, str(tmp_path / "gone"))
    monkeypatch.chdir(launched["launch"])  # (where the files are: not where the record says)
    status, err = _evaluate(capsys, moved)
    assert status == 2, err
    line = [ln for ln in err.splitlines() if ln.startswith("error: ")][-1]
    assert "does not exist" in line and repr(str(tmp_path / "gone")).rstrip("'") in line, line
    assert line.endswith(f"(a path of {moved}/config.yaml relative to the launch directory {tmp_path / 'gone'}, "
                         f"recorded in {moved}/launch_dir.json: was the run's data moved since?)"), line


def _summarize():
    spec = importlib.util.spec_from_file_location("summarize_runs", os.path.join(ROOT, "tools", "summarize_runs.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def test_summarize_runs_from_another_directory(launched, capsys, monkeypatch):
    main = _summarize()
    monkeypatch.chdir(launched["elsewhere"])
    capsys.readouterr()
    assert main([launched["run"]]) == 0
    out, err = capsys.readouterr()
    assert err.count(_note(launched["run"], launched["launch"])) == 1 and "no Table 1" not in err, err
    table1 = next(ln for ln in out.splitlines() if ln.startswith("Table 1 params/step"))
    assert table1.split()[-1] != "-", out
    assert main([launched["old"]]) == 0  # the figure left out, and why
    err = capsys.readouterr().err
    assert "no Table 1 params/step (config key 'data.tokenizer'" in err and "this run does not record" in err, err
    assert "on the command line" not in err  # (advice for tools/dept_costs.py, which takes the sizes)


def test_export_from_another_directory(launched, capsys, monkeypatch):
    pytest.importorskip("transformers")
    from dept_mega.export.convert import main
    monkeypatch.chdir(launched["elsewhere"])
    capsys.readouterr()
    assert main(["--run-dir", launched["run"], "--source", "a", "--output", "hf_a"]) == 0
    out = capsys.readouterr().out
    assert out.count(_note(launched["run"], launched["launch"])) == 1, out
    with open(os.path.join("hf_a", "dept_export.json"), encoding="utf-8") as f:
        assert json.load(f)["tokenizer"] == os.path.join(launched["launch"], launched["tokenizer"])
    assert main(["--run-dir", launched["old"], "--source", "a", "--output", "hf_old"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: config key 'data.tokenizer': tokenizer {launched['tokenizer']!r} does not exist"), err
    assert "this run does not record" in err and err.count("\n") == 1, err


def test_adapt_from_another_directory(launched, capsys, monkeypatch):
    """The run's paths from its launch directory, NEW.yaml's from the current one (recorded in
    the adaptation's own run directories)."""
    from dept_mega.adapt import main
    here = launched["elsewhere"]
    monkeypatch.chdir(here)
    rng = np.random.default_rng(3)
    write_docs("c_text_document", [rng.integers(3, 100, 40).tolist() for _ in range(40)], nbytes=[120] * 40)
    with open("new.yaml", "w", encoding="utf-8") as f:
        yaml.safe_dump({"data": {"sources": [{"name": "c", "prefix": "c_text_document"}]},
                        "train": {"eval_iters": 1}}, f)
    capsys.readouterr()
    assert main(["--run-dir", launched["run"], "--source-config", "new.yaml", "--steps", "1", "--out", "ad",
                 "--no-random-baseline"]) == 0
    out = capsys.readouterr().out
    assert out.count(_note(launched["run"], launched["launch"])) == 1, out
    with open(os.path.join("ad", "trained", "config.yaml"), encoding="utf-8") as f:
        data = yaml.safe_load(f)["data"]
    assert data["tokenizer"] == os.path.join(launched["launch"], launched["tokenizer"])
    assert data["sources"] == [{**data["sources"][0], "name": "c", "prefix": "c_text_document"}]
    with open(os.path.join("ad", "trained", "launch_dir.json"), encoding="utf-8") as f:
        assert json.load(f) == {"launch_dir": os.path.realpath(here)}
