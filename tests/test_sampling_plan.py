"""Each source's share before a launch (dept_mega.sampling_plan): ``--check`` prints the
``sampling (...)`` line the launch logs, and both warn once when the configured weighting
cannot be the shares (DEPT with as many sources as groups; ``weights`` a round plan cannot
honour)."""
from __future__ import annotations

import contextlib
import io
import os

import pytest

from dept_mega.config import config_from_dict
from dept_mega.sampling_plan import sampling_warning
from tests.mp_utils import run_distributed
from tests.test_train_cli import _setup, _train_here

WEIGHTS = ["dept.sampling=weights", "data.sources.0.weight=0.3", "data.sources.1.weight=0.7"]
QUICK = ["train.steps=2", "train.eval_interval=0", "train.save_interval=0", "train.log_interval=1"]


def _cfg(variant="glob", sampling="weights", weights=(0.6, 0.2, 0.2), groups=None, steps=4000):
    sources = [{"name": n, "prefix": f"/nonexistent/{n}", "weight": w} for n, w in zip(("en", "fr", "code"), weights)]
    if groups is not None:
        for s, g in zip(sources, groups):
            s["group"] = g
    return config_from_dict({"dept": {"variant": variant, "sampling": sampling, "local_steps": 2},
                             "train": {"steps": steps}, "data": {"sources": sources}})


def _sampling_line(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("sampling (")]
    assert len(lines) == 1, out
    return lines[0]


def _shares(warning: str) -> dict[str, float]:
    """The shares a warning states (``... give en 45.5 %, fr 27.0 %, code 27.5 %; ...``)."""
    given = warning.split("round plans give ", 1)[1].split(";", 1)[0]
    return {part.split()[0]: float(part.split()[1]) for part in given.split(", ")}


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("warning: ")]


def test_as_many_sources_as_groups_warns_that_the_weights_change_nothing():
    w = sampling_warning(_cfg(weights=(0.3, 0.5, 0.2)), 3)
    assert w == ("config key 'dept.sampling': dept.sampling: weights and data.sources[].weight change nothing here: "
                 "with 3 sources on 3 groups, group g trains source g every round, so each source gets 1/3 (33.3 %) "
                 "of the training; for a weighted mix use dept.variant: std (the weights set every batch's mix) or "
                 "more sources than groups (each round then draws 3 of them, a source at most 1/3 of the rounds) "
                 "(docs/dept_guide.md §3)")
    # any weighting, tied to groups or not
    assert "dept.sampling: proportional changes nothing" in sampling_warning(_cfg(sampling="proportional",
                                                                                 weights=(1, 1, 1)), 3)
    assert "change nothing" in sampling_warning(_cfg(weights=(0.3, 0.5, 0.2), groups=(0, 1, 2)), 3)


def test_weights_a_round_plan_cannot_honour_are_named_with_the_shares_it_gives():
    w = sampling_warning(_cfg(weights=(0.6, 0.2, 0.2)), 2)
    assert w.startswith("config key 'dept.sampling': the weights cannot be the shares here: each round draws 2 "
                        "distinct sources, so a source trains at most 1/2 (50.0 %) of the rounds and a heavy source "
                        "less than its weight (weights: en 60.0 %, fr 20.0 %, code 20.0 %); this run's round plans "
                        "give en "), w
    # sequential draws without replacement: en is in a round with probability 0.6 + 0.4 · 0.6 / 0.8 = 0.9
    assert _shares(w) == pytest.approx({"en": 45.0, "fr": 27.5, "code": 27.5}, abs=1.5), w
    assert w.endswith("the weights are the exact shares under dept.variant: std or with one group "
                      "(docs/dept_guide.md §3)"), w
    # at most 1/G each, still not the shares: en in a round with probability 0.5 + 0.5 · 0.5 / 0.75
    w = sampling_warning(_cfg(weights=(0.5, 0.25, 0.25)), 2)
    assert _shares(w) == pytest.approx({"en": 41.7, "fr": 29.2, "code": 29.2}, abs=1.5), w
    # tied to groups: each group's sources share 1/G whatever their weights
    w = sampling_warning(_cfg(weights=(0.2, 0.4, 0.4), groups=(0, 1, 1)), 2)
    assert "(theirs add up to group 0 20.0 %, group 1 80.0 %)" in w, w
    assert _shares(w) == pytest.approx({"en": 50.0, "fr": 25.0, "code": 25.0}, abs=1.5), w


@pytest.mark.parametrize("cfg,groups", [
    (_cfg(weights=(2, 2, 2)), 2),  # equal weights: equal shares whatever the draw
    (_cfg(weights=(0.5, 0.25, 0.25), groups=(0, 1, 1)), 2),  # each group's weights add up to 1/G
    (_cfg(weights=(0.6, 0.2, 0.2)), 1),  # one group: the weights are the shares
    (_cfg(variant="std", weights=(0.6, 0.2, 0.2)), 1),
    (_cfg(sampling="uniform", weights=(1, 1, 1)), 3),  # nothing asked
    (_cfg(sampling="proportional", weights=(1, 1, 1)), 2),  # proportional promises no exact shares
])
def test_no_warning_where_the_weighting_applies(cfg, groups):
    assert sampling_warning(cfg, groups) is None


def test_check_prints_the_warning_and_the_shares_line(tmp_path):
    cfg = _setup(tmp_path)  # glob, sources a and b
    r = _train_here("--config", cfg, *WEIGHTS, "--check", "--world-size", "2")
    assert r.returncode == 0, r.stderr
    assert _sampling_line(r.stdout) == "sampling (weights; DEPT: 2 sources on 2 groups, each every round): a 50.0 %, b 50.0 %"
    warned = _warnings(r.stderr)
    assert len(warned) == 1 and warned[0].startswith("warning: config key 'dept.sampling': dept.sampling: weights "
                                                     "and data.sources[].weight change nothing here"), r.stderr
    one = _train_here("--config", cfg, *WEIGHTS, "--check", "--world-size", "1")  # 2 sources on 1 group
    assert one.returncode == 0 and not _warnings(one.stderr), one.stderr
    assert _sampling_line(one.stdout).startswith("sampling (weights; DEPT: 1 of 2 sources a round, without repeats; "
                                                 "shares of rounds 0-1): "), one.stdout


@pytest.mark.parametrize("variant", ["std", "glob"])
def test_the_check_line_is_the_launch_line(tmp_path, variant, monkeypatch):
    """proportional reads the data's token counts (STD: the train parts', DEPT: the .bin's):
    --check's line is the one the launch logs."""
    cfg = _setup(tmp_path, variant=variant)
    # a schedule of 1000 rounds (DEPT: shares of many draws), stopped after the first round
    over = ["dept.sampling=proportional", "data.sources.1.weight=2", *QUICK, "train.steps=2000", "train.exit_interval=2"]
    check = _train_here("--config", cfg, *over, "--check", "--world-size", "1")
    assert check.returncode == 0, check.stderr
    run = _train_here("--config", cfg, *over)
    assert run.returncode == 0, run.stderr[-2000:]
    line = _sampling_line(run.stdout)
    assert line.startswith(f"sampling (proportional{'' if variant == 'std' else '; DEPT'}"), line
    assert _sampling_line(check.stdout) == line


def _launch(rank, world, cfg, over):
    from unittest import mock

    from dept_mega import train as train_cli
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, {"DEPT_MEGA_DEVICE": "cpu"}), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        status = train_cli.main(["--config", cfg, *over])
    return status, out.getvalue(), err.getvalue()


@pytest.mark.timeout(200)
def test_the_launch_warns_once_and_logs_the_line_check_printed(tmp_path):
    cfg = _setup(tmp_path)
    check = _train_here("--config", cfg, *WEIGHTS, "--check", "--world-size", "2")
    (s0, out0, err0), (s1, _, err1) = run_distributed(_launch, 2, args=(cfg, [*WEIGHTS, *QUICK]), timeout=180)
    assert s0 == s1 == 0, err0[-2000:] + err1[-2000:]
    assert _sampling_line(out0) == _sampling_line(check.stdout)
    mine = [w for w in _warnings(err0) if "'dept.sampling'" in w]
    assert mine == _warnings(check.stderr) and len(mine) == 1, err0
    assert not [w for w in _warnings(err1) if "'dept.sampling'" in w]  # rank 0 speaks for the job


def test_a_federated_group_job_counts_the_federations_groups():
    from dept_mega.sampling_plan import sampling_groups
    cfg = _cfg(weights=(0.3, 0.5, 0.2))
    assert sampling_groups(cfg, 2) == 2  # world 2 of tensor × pipeline × data 1
    fed = config_from_dict({**cfg.to_dict(), "federation": {"lighthouse": "lh:1", "groups": 3}})
    assert sampling_groups(fed, 1) == 3  # each group job is one group; the sources spread over 3
