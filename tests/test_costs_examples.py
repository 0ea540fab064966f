"""tools/dept_costs.py on every examples/tiny config, as docs/dept_guide.md and docs/metrics.md
document it: the command succeeds (the vocabulary sizes a config cannot give are assumed, with
a note), and the config's own variant predicts the bytes a short run of that config records.

The other byte tests (test_step_bytes.py, test_dept_trim_run.py) run synthetic sources with
sizes given to the cost model; here the sizes come from the configs' own tokenizers and data,
as the tool resolves them."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.mp_utils import run_distributed
from tests.trainer_utils import ROOT, ensure_sample_corpus, read_jsonl

TOOL = os.path.join(ROOT, "tools", "dept_costs.py")
CONFIGS = ("std", "glob", "trim", "spec", "spec_opt")
DEPT = ("glob", "trim", "spec", "spec_opt")
GROUPS = 2  # = the sources kept, so each group trains one source every round (no source moves)


@pytest.fixture(scope="module")
def corpus():
    ensure_sample_corpus()


def _tool():
    import importlib.util
    spec = importlib.util.spec_from_file_location("dept_costs_tool", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def _path(name: str) -> str:
    return os.path.join(ROOT, "examples", "tiny", f"{name}.yaml")


def _overrides(name: str, run_dir: str) -> list[str]:
    """A few steps of the config with its first two sources (rounds of one inner step)."""
    from dept_mega.config import load_config
    sources = [{k: v for k, v in (("name", s.name), ("prefix", s.prefix), ("tokenizer", s.tokenizer)) if v}
               for s in load_config(_path(name)).data.sources[:GROUPS]]
    return [f"train.run_dir={run_dir}", "train.steps=2", "dept.local_steps=1", "train.micro_batch_size=1",
            "train.global_batch_size=2", "train.log_interval=1", "train.eval_interval=0", "train.save_interval=0",
            "optim.warmup_steps=1", f"data.sources={json.dumps(sources)}"]


def test_documented_command_succeeds_on_every_tiny_config(corpus, monkeypatch, capsys):
    """``dept_costs.py --config CFG.yaml [--groups G]``: exit 0 on each tiny config, every
    variant in the table; a one-tokenizer config notes that SPEC-OPT's vocabulary is assumed to
    be the global one, a spec_opt config that the global one is assumed to be its largest
    source's (was: an error asking for --source-vocab / --global-vocab)."""
    from dept_mega.data.tokenizer import load_tokenizer
    monkeypatch.chdir(ROOT)
    tool = _tool()
    own = {n: load_tokenizer(f"examples/data/build/tok/{n}.model").vocab_size for n in ("en", "fr", "ja", "ru", "code")}
    glob = load_tokenizer("examples/data/build/tok/global.model").vocab_size
    for name in CONFIGS:
        for extra in ([], ["--groups", "5"], ["--groups", "5", "--json", "--memory"]):
            assert tool.main(["--config", f"examples/tiny/{name}.yaml", *extra]) == 0, (name, extra)
            out = capsys.readouterr().out
            for variant in ("std", "glob", "trim", "spec", "spec_opt"):
                assert variant in out
        vocab = json.loads(out)["vocab"]
        if name == "spec_opt":
            # the sources' own sizes, as the run's tables; the global one assumed: the largest
            assert vocab["source_mean"] == sum(own.values()) / len(own)
            assert vocab["global"] == max(own.values())
            assert len(vocab["notes"]) == 1 and "largest source vocabulary" in vocab["notes"][0]
            assert "assumed" in vocab["origin"]["global"] and "assumed" not in vocab["origin"]["source"]
        else:
            assert vocab["global"] == glob and vocab["source_mean"] == glob
            assert len(vocab["notes"]) == 1 and "SPEC-OPT's vocabulary is taken as the global one" in vocab["notes"][0]
            assert "assumed" in vocab["origin"]["source"] and "assumed" not in vocab["origin"]["global"]
            # TRIM's |V_k| counted in the sources' data
            assert vocab["trim_mean"] < glob and vocab["origin"]["trim"].startswith("vocab_set")
        assert tool.main(["--config", f"examples/tiny/{name}.yaml"]) == 0
        assert vocab["notes"][0] in capsys.readouterr().out  # the table says it too
    # the command line itself, as documented
    r = subprocess.run([sys.executable, TOOL, "--config", "examples/tiny/spec_opt.yaml", "--groups", "5"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0 and "largest source vocabulary" in r.stdout, r.stderr


def _runs(rank: int, world: int, runs: list[tuple[str, list[str]]]) -> None:
    """Each (config, overrides) with dept_mega.train's session, one after the other."""
    import torch

    from dept_mega.config import load_config, save_config
    from dept_mega.train import build_session
    os.chdir(ROOT)  # the configs' relative data paths
    for name, over in runs:
        torch.manual_seed(0)
        cfg = load_config(_path(name), over)
        session = build_session(cfg)
        if session.rank == 0:
            save_config(cfg, os.path.join(cfg.train.run_dir, "config.yaml"))
        session.loop.run()
        session.writer.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_each_tiny_config_predicts_the_bytes_its_run_records(corpus, tmp_path, monkeypatch):
    """Two groups, two sources, two rounds of one inner step: every ``outer`` record's bytes
    equal the tool's prediction for the config's own variant (``outer_round_bytes`` for the
    categories crossing groups, ``record_bytes`` for dp / tp / pp), GLOB's table from the
    global tokenizer, TRIM's rows from each source's data. (STD writes no outer record; its
    prediction has no outer bytes.)"""
    monkeypatch.chdir(ROOT)
    runs = [(name, _overrides(name, str(tmp_path / name))) for name in DEPT]
    run_distributed(_runs, GROUPS, args=(runs,), timeout=280)
    tool = _tool()
    for name, over in runs:
        pred = tool.compute(tool.parse_args(["--config", _path(name), *over, "--groups", str(GROUPS)]))
        mine = pred["variants"][name]
        outer = [r for r in read_jsonl(str(tmp_path / name / "metrics.jsonl")) if r["kind"] == "outer"]
        assert len(outer) == 2, name
        for rec in outer:
            want = {**{k: mine["outer_round_bytes"][k] for k in ("outer_body", "outer_embedding")},
                    **mine["record_bytes"]}
            assert {k: rec["bytes"].get(k, 0) for k in want} == want, (name, rec["bytes"], want)
            assert rec["bytes"].get("source_move", 0) == 0, name
            assert sum(rec["bytes"].values()) == sum(want.values()), (name, rec["bytes"])
        assert mine["outer_round_bytes"]["outer_body"] > 0
        assert (mine["outer_round_bytes"]["outer_embedding"] > 0) == (name in ("glob", "trim")), name
    std = tool.compute(tool.parse_args(["--config", _path("std"), "--groups", str(GROUPS)]))["variants"]["std"]
    assert not any(std["outer_round_bytes"].values())


def test_federation_byte_figures_in_launching_md_are_the_tools(corpus, monkeypatch, capsys):
    """docs/launching.md §12 quotes the tiny SPEC-OPT's outer bytes per round as shipped and with
    model.norm_bias=false (the form that exports): each figure is what the command next to it
    prints (``--json``: spec_opt's ``outer_round_bytes``, per job = total / 2)."""
    import re
    monkeypatch.chdir(ROOT)
    tool = _tool()
    text = open(os.path.join(ROOT, "docs", "launching.md"), encoding="utf-8").read()
    for extra, per_job, total in (([], "395,776", "791,552"), (["model.norm_bias=false"], "394,496", "788,992")):
        assert tool.main(["--config", "examples/tiny/spec_opt.yaml", "--groups", "2", "--json", *extra]) == 0
        out = json.loads(capsys.readouterr().out)
        body = out["variants"]["spec_opt"]["outer_round_bytes"]["outer_body"]
        assert f"{body:,}" == total and f"{body // 2:,}" == per_job, (extra, body)
        assert re.search(rf"{per_job}\s+bytes (from each of two jobs|per job)", text), per_job
        assert total in text
