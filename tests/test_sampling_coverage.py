"""This run's rounds as the scheduler draws them (dept_mega.sampling_plan): a warning when they
train a source in no round or far from its expected share, SPEC / SPEC-OPT refused for a source
in no round unless dept.untrained_sources: warn, in --check and at the launch, from one drawing
of the plans; and the warnings for an evaluation or a periodic checkpoint inside a round
(dept_mega.schedule_warnings)."""
from __future__ import annotations

import glob
import os

import pytest
import yaml

from dept_mega.config import ConfigError, config_from_dict
from dept_mega.sampling_plan import (check_untrained, coverage_warning, make_scheduler, planned_rounds,
                                     sampling_warnings)
from dept_mega.dept.rounds import RoundScheduler
from dept_mega.schedule_warnings import (eval_interval_warning, exit_interval_warning, save_interval_warning,
                                         schedule_warnings)
from tests.test_train_cli import _setup, _train_here

NAMES = ("en", "fr", "ja", "ru", "code")
QUICK = ["train.eval_interval=0", "train.save_interval=0", "train.log_interval=1"]


def _cfg(variant="glob", sampling="uniform", steps=8, local_steps=2, seed=1, names=NAMES, groups=None, **dept):
    sources = [{"name": n, "prefix": f"/nonexistent/{n}"} for n in names]
    for s, g in zip(sources, groups or ()):
        s["group"] = g
    return config_from_dict({"dept": {"variant": variant, "sampling": sampling, "local_steps": local_steps, **dept},
                             "train": {"seed": seed, "steps": steps}, "data": {"sources": sources}})


def _sched(cfg, G):
    return make_scheduler(cfg, G, [1.0] * len(cfg.data.sources), [s.weight for s in cfg.data.sources])


def _counts(cfg, G):
    """Each source's rounds in the run, counted here from the plans themselves."""
    sched, counts = _sched(cfg, G), [0] * len(cfg.data.sources)
    for r in range(cfg.train.steps // cfg.dept.local_steps):
        for k in sched.plan(r).sources:
            counts[k] += 1
    return counts


def _seed(pred, G=2, **kw) -> int:
    """The first train.seed whose plans (of ``_cfg(**kw)`` on G groups) satisfy ``pred(counts)``."""
    for seed in range(500):
        if pred(_counts(_cfg(seed=seed, **kw), G)):
            return seed
    raise AssertionError("no seed found")


def test_a_source_in_no_round_is_named():
    seed = _seed(lambda c: c.count(0) >= 1)
    cfg = _cfg(seed=seed)
    counts = _counts(cfg, 2)
    missing = [n for n, c in zip(NAMES, counts) if c == 0]
    assert planned_rounds(cfg, _sched(cfg, 2)) == counts
    w = coverage_warning(cfg, _sched(cfg, 2))
    assert w.startswith(f"config key 'dept.sampling': this run's round plans (4 rounds = train.steps 8 / "
                        f"dept.local_steps 2, drawn with train.seed {seed}) train {', '.join(missing)} in no round "
                        f"(no step reads its data)"), w
    assert "set dept.sampling: balanced (every source trained once before any again)" in w
    # the same config under balanced: 4 rounds x 2 groups cover the 5 sources
    assert coverage_warning(_cfg(seed=seed, sampling="balanced"), _sched(_cfg(seed=seed, sampling="balanced"), 2)) \
        is None
    # too few rounds for all: no sampling helps, more rounds do
    short = _cfg(seed=seed, sampling="balanced", steps=4)
    assert "2 round(s) cannot train all 5 sources (2 a round): raise train.steps or lower dept.local_steps to " \
           "at least 3 rounds" in coverage_warning(short, _sched(short, 2))


def test_a_share_far_from_the_expected_one_is_named():
    """20 rounds of 5 sources on 2 groups: 8 group-rounds expected each; a source with 13 or
    more (or 3 or fewer, but some) is far from it, one with 6 to 10 is not."""
    far = lambda c: 0 not in c and any(x >= 13 or x <= 3 for x in c)  # noqa: E731
    near = lambda c: all(6 <= x <= 10 for x in c)  # noqa: E731
    seed = _seed(far, steps=40)
    cfg = _cfg(seed=seed, steps=40)
    counts = _counts(cfg, 2)
    w = coverage_warning(cfg, _sched(cfg, 2))
    named = [f"{n} {100 * c / 40:.1f} % (expected 20.0 %)" for n, c in zip(NAMES, counts) if c >= 13 or c <= 3]
    assert w and f"give {', '.join(named)} of the training" in w, w
    quiet = _cfg(seed=_seed(near, steps=40), steps=40)
    assert coverage_warning(quiet, _sched(quiet, 2)) is None
    # the expected share is the sampler's, not 1/K: proportional sizes
    prop = _cfg(sampling="proportional", steps=400)
    sched = make_scheduler(prop, 2, [1.0, 1.0, 1.0, 1.0, 40.0], [1.0] * 5)
    assert coverage_warning(prop, sched) is None  # code nearly every round is what the sampler means


def test_sources_tied_to_groups_count_per_group():
    owners = (0, 1, 0, 1, 0)
    seed = _seed(lambda c: c.count(0) >= 1, groups=owners)
    cfg = _cfg(seed=seed, groups=owners)
    w = coverage_warning(cfg, _sched(cfg, 2))
    assert w and "in no round" in w, w
    ok = _cfg(seed=seed, groups=owners, sampling="balanced")
    assert coverage_warning(ok, _sched(ok, 2)) is None


def test_spec_refuses_a_source_in_no_round_unless_asked():
    seed = _seed(lambda c: c.count(0) >= 1)
    missing = [n for n, c in zip(NAMES, _counts(_cfg(seed=seed), 2)) if c == 0]
    for variant in ("spec", "spec_opt"):
        cfg = _cfg(variant=variant, seed=seed)
        with pytest.raises(ConfigError, match=rf"'dept.untrained_sources': .* train {missing[0]}.* in no round: under "
                                              rf"{variant} its own embeddings would keep their initial values"):
            check_untrained(cfg, _sched(cfg, 2))
        asked = _cfg(variant=variant, seed=seed, untrained_sources="warn")
        check_untrained(asked, _sched(asked, 2))
        assert "(its own embeddings keep their initial values)" in coverage_warning(asked, _sched(asked, 2))
    for variant in ("glob", "trim"):  # shared embeddings: a warning only
        check_untrained(_cfg(variant=variant, seed=seed), _sched(_cfg(variant=variant, seed=seed), 2))
    covered = _cfg(variant="spec", seed=_seed(lambda c: 0 not in c))
    check_untrained(covered, _sched(covered, 2))


def test_eval_interval_inside_a_round_is_named():
    for variant in ("glob", "trim", "spec", "spec_opt"):
        w = eval_interval_warning(config_from_dict({"dept": {"variant": variant, "local_steps": 4},
                                                    "train": {"steps": 20, "eval_interval": 6}}))
        assert w.startswith("config key 'train.eval_interval': 6 is not a multiple of dept.local_steps=4: the "
                            "evaluations at steps such as 6 fall inside a round, before its outer sync"), w
        assert "group 0's body" in w
        if variant in ("spec", "spec_opt"):
            assert "copied from the group that trains it this round" in w and "never trained together" in w
    for over in ({"eval_interval": 8}, {"eval_interval": 0}, {"eval_interval": 20}, {"eval_interval": 30}):
        cfg = config_from_dict({"dept": {"variant": "spec", "local_steps": 4}, "train": {"steps": 20, **over}})
        assert eval_interval_warning(cfg) is None, over
    std = config_from_dict({"dept": {"variant": "std", "local_steps": 4}, "train": {"steps": 20, "eval_interval": 6}})
    assert eval_interval_warning(std) is None


def test_save_interval_inside_a_round_is_named():
    for variant in ("glob", "trim", "spec", "spec_opt"):
        w = save_interval_warning(config_from_dict({"dept": {"variant": variant, "local_steps": 4},
                                                    "train": {"steps": 20, "save_interval": 6}}))
        assert w.startswith("config key 'train.save_interval': 6 is not a multiple of dept.local_steps=4: the "
                            "checkpoints at steps such as 6 fall inside a round, where the groups' bodies differ"), w
        assert "resumes only with the same number of source groups, cannot start a train.init_from run" in w
        assert ("convert_to_hf.py refuses them" in w) == (variant == "glob"), w
        assert w.endswith("set train.save_interval to a multiple of 4 (docs/launching.md, Changing the layout "
                          "between launches, and train.init_from)"), w
    for over in ({"save_interval": 8}, {"save_interval": 0}, {"save_interval": 20}, {"save_interval": 30}):
        cfg = config_from_dict({"dept": {"variant": "glob", "local_steps": 4}, "train": {"steps": 20, **over}})
        assert save_interval_warning(cfg) is None, over
    std = config_from_dict({"dept": {"variant": "std", "local_steps": 4}, "train": {"steps": 20, "save_interval": 6}})
    assert save_interval_warning(std) is None


def test_exit_interval_inside_a_round_is_named():
    for variant in ("glob", "trim", "spec", "spec_opt"):
        cfg = config_from_dict({"dept": {"variant": variant, "local_steps": 4}, "train": {"steps": 20, "exit_interval": 6}})
        w = exit_interval_warning(cfg)
        assert w.startswith("config key 'train.exit_interval': 6 is not a multiple of dept.local_steps=4: the run "
                            "stops at step 6, inside a round"), w
        assert w in schedule_warnings(cfg)
    for over in ({"exit_interval": 8}, {"exit_interval": None}, {"exit_interval": 20}, {"exit_interval": 30}):
        cfg = config_from_dict({"dept": {"variant": "glob", "local_steps": 4}, "train": {"steps": 20, **over}})
        assert exit_interval_warning(cfg) is None and schedule_warnings(cfg) == [], over
    std = config_from_dict({"dept": {"variant": "std", "local_steps": 4}, "train": {"steps": 20, "exit_interval": 6}})
    assert exit_interval_warning(std) is None


def test_the_shipped_configs_and_study_grids_do_not_warn():
    from dept_mega.config import load_config
    from dept_mega.study.grid import load_study
    root = os.path.join(os.path.dirname(__file__), "..", "examples")
    configs = sorted(glob.glob(os.path.join(root, "tiny", "*.yaml")) + glob.glob(os.path.join(root, "1b", "*.yaml")))
    assert len(configs) == 10
    assert {p: schedule_warnings(load_config(p)) for p in configs} == {p: [] for p in configs}
    grids = [p for p in sorted(glob.glob(os.path.join(root, "study", "*.yaml")))
             if "runs" in (yaml.safe_load(open(p)) or {})]  # (not the held-out source configs)
    assert len(grids) >= 8
    for p in grids:
        study = load_study(p)
        assert (study.warnings, study.checkpoint_warnings) == ({}, {}), p


# ----------------------------------------------------------------------------- --check and the launch

def _one_group_seed(cfg_path, variant="glob"):
    """A train.seed whose 2 rounds on one group train only one of _setup's two sources."""
    base = yaml.safe_load(open(cfg_path))
    for seed in range(200):
        cfg = config_from_dict({**base, "dept": {**base["dept"], "variant": variant},
                                "train": {**base["train"], "seed": seed}})
        counts = planned_rounds(cfg, _sched(cfg, 1))
        if 0 in counts:
            return seed, ["a", "b"][counts.index(0)]
    raise AssertionError("no seed found")


def _warnings(err):
    return [line for line in err.splitlines() if line.startswith("warning: ")]


def test_check_and_launch_warn_from_one_drawing_of_the_plans(tmp_path, monkeypatch):
    cfg = _setup(tmp_path)  # glob, sources a and b, 4 steps of 2-step rounds
    seed, missing = _one_group_seed(cfg)
    made = []  # the round schedulers built (each draws its plans)
    real = RoundScheduler.__init__
    monkeypatch.setattr(RoundScheduler, "__init__", lambda self, *a, **k: made.append(1) or real(self, *a, **k))
    over = [f"train.seed={seed}", *QUICK, "train.eval_interval=3", "train.save_interval=3"]
    check = _train_here("--config", cfg, *over, "--check", "--world-size", "1")
    assert check.returncode == 0, check.stderr
    assert len(made) == 1  # the sampling line, the check and the warnings share the plans
    mine = [w for w in _warnings(check.stderr) if "'dept.sampling'" in w]
    assert len(mine) == 1 and f"train {missing} in no round" in mine[0], check.stderr
    assert [w for w in _warnings(check.stderr) if "'train.eval_interval': 3" in w], check.stderr
    assert [w for w in _warnings(check.stderr) if "'train.save_interval': 3" in w], check.stderr
    made.clear()
    run = _train_here("--config", cfg, *over)
    assert run.returncode == 0, run.stderr[-2000:]
    assert len(made) == 1  # the driver's scheduler, nothing drawn again for the warnings
    keys = ("'dept.sampling'", "'train.eval_interval'", "'train.save_interval'")
    assert [w for w in _warnings(run.stderr) if any(k in w for k in keys)] == \
        [w for w in _warnings(check.stderr) if any(k in w for k in keys)]


def test_spec_is_refused_by_check_and_launch_before_training(tmp_path):
    cfg = _setup(tmp_path, variant="spec")
    seed, missing = _one_group_seed(cfg, "spec")
    over = [f"train.seed={seed}", *QUICK]
    check = _train_here("--config", cfg, *over, "--check", "--world-size", "1")
    assert check.returncode == 2
    assert check.stderr.startswith(f"error: config key 'dept.untrained_sources': this run's round plans (2 rounds = "
                                   f"train.steps 4 / dept.local_steps 2, drawn with train.seed {seed}) train "
                                   f"{missing} in no round"), check.stderr
    run = _train_here("--config", cfg, *over)
    assert run.returncode == 2 and run.stderr == check.stderr, run.stderr[-2000:]
    run_dir = yaml.safe_load(open(cfg))["train"]["run_dir"]
    metrics = os.path.join(run_dir, "metrics.jsonl")
    # a fresh run: refused before its session (no metrics writer: no metrics.jsonl, tb/ or W&B run)
    assert not os.path.exists(metrics) and not os.path.exists(os.path.join(run_dir, "tb"))
    assert not glob.glob(os.path.join(run_dir, "checkpoints", "step_*"))
    asked = _train_here("--config", cfg, *over, "dept.untrained_sources=warn", "--check", "--world-size", "1")
    assert asked.returncode == 0 and f"train {missing} in no round" in asked.stderr, asked.stderr


def test_sampling_warnings_build_the_plans_when_not_given():
    seed = _seed(lambda c: c.count(0) >= 1)
    cfg = _cfg(seed=seed)
    assert sampling_warnings(cfg, 2) == [coverage_warning(cfg, _sched(cfg, 2))]
    assert sampling_warnings(_cfg(variant="std", seed=seed), 1) == []


def test_a_source_first_drawn_after_the_counted_rounds_is_trained(monkeypatch):
    """The log line counts the first SAMPLING_LINE_ROUNDS plans; the untrained verdict reads on
    past them while a source has none (a review's finding: a long run whose rare source is first
    drawn after them was refused under SPEC), and says it read every round."""
    from dept_mega import sampling_plan
    monkeypatch.setattr(sampling_plan, "SAMPLING_LINE_ROUNDS", 100)
    sources = [{"name": n, "prefix": f"/nonexistent/{n}", "weight": w} for n, w in (("a", 1.0), ("b", 1.0), ("r", 0.004))]

    def cfg(steps, seed):
        return config_from_dict({"dept": {"variant": "spec", "sampling": "weights", "local_steps": 1},
                                 "train": {"seed": seed, "steps": steps}, "data": {"sources": sources}})

    def first_round(c):
        sched = _sched(c, 2)
        return next((r for r in range(c.train.steps) if 2 in sched.plan(r).sources), None)
    seed = next(s for s in range(500) if (f := first_round(cfg(600, s))) is not None and 100 < f < 500)
    late = cfg(first_round(cfg(600, seed)) + 1, seed)  # r trained in the run's last round alone
    assert sampling_plan.planned_rounds(late, _sched(late, 2))[2] == 0  # (none in the counted rounds)
    assert sampling_plan.untrained_sources(late, _sched(late, 2)) == []
    check_untrained(late, _sched(late, 2))
    assert coverage_warning(late, _sched(late, 2)) is None or "in no round" not in coverage_warning(late, _sched(late, 2))
    early = cfg(late.train.steps - 1, seed)  # the run ends just before r's round: refused, every round read
    with pytest.raises(ConfigError) as exc:
        check_untrained(early, _sched(early, 2))
    assert f"({early.train.steps} rounds = train.steps {early.train.steps} / dept.local_steps 1, drawn with " \
           f"train.seed {seed}) train r in no round" in str(exc.value), exc.value
