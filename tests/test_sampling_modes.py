"""dept.sampling: each mode's source shares, in STD's blend and DEPT's round sampler, and the
start-up log line that states them (dept.sampling=weights: the weights alone, as Megatron-LM's
--data-path 0.3 A 0.7 B)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from dept_mega.data.sources import source_weights
from dept_mega.dept.rounds import RoundScheduler

TOKENS = [100.0, 300.0, 600.0]
WEIGHTS = [3.0, 1.0, 1.0]
# by hand: tokens × weight = 300, 300, 600
SHARES = {
    "uniform": [1 / 3, 1 / 3, 1 / 3],
    "proportional": [0.25, 0.25, 0.5],
    "temperature": [1 / (2 + 2 ** 0.5), 1 / (2 + 2 ** 0.5), 2 ** 0.5 / (2 + 2 ** 0.5)],  # τ = 0.5
    "weights": [0.6, 0.2, 0.2],
}


@pytest.mark.parametrize("mode", sorted(SHARES))
def test_blend_shares_per_mode(mode):
    w = [1.0] * 3 if mode == "uniform" else WEIGHTS  # a weight under uniform is refused by the config
    assert source_weights(TOKENS, mode, 0.5, weights=w) == pytest.approx(SHARES[mode], rel=1e-12)


@pytest.mark.parametrize("mode", ["proportional", "weights"])
def test_round_sampler_honours_the_mode(mode):
    """One group, three sources: the fraction of rounds each source trains follows the mode."""
    s = RoundScheduler(3, 1, seed=2, sampling=mode, temperature=0.5, sizes=TOKENS, weights=WEIGHTS)
    assert s.weights == pytest.approx(SHARES[mode], rel=1e-12)
    assert s.shares(0, 4000) == pytest.approx(SHARES[mode], abs=0.02)


def test_weights_mode_ignores_sizes():
    assert source_weights([1.0, 1e9], "weights", weights=[0.3, 0.7]) == pytest.approx([0.3, 0.7])
    with pytest.raises(ValueError, match="one weight > 0 per source"):
        source_weights([1.0, 2.0], "weights", weights=[1.0])


def _line_of(mode, groups, steps=8000, local_steps=2):
    """DeptHooks.sampling_line on the parts of a driver it reads."""
    from dept_mega.dept.driver import DeptHooks
    from dept_mega.dept.source_info import SourceInfo
    infos = [SourceInfo(n, 10, t, weight=w) for n, t, w in zip(("en", "fr", "code"), TOKENS, WEIGHTS)]
    sched = RoundScheduler(3, groups, seed=1, sampling=mode, temperature=0.5, sizes=TOKENS, weights=WEIGHTS)
    cfg = SimpleNamespace(train=SimpleNamespace(steps=steps), dept=SimpleNamespace(local_steps=local_steps,
                                                                                   sampling=mode))
    return DeptHooks.sampling_line(SimpleNamespace(scheduler=sched, cfg=cfg, sources=infos, num_groups=groups))


def test_the_log_line_states_each_sources_actual_share():
    from dept_mega.data.sources import sampling_line
    assert sampling_line("proportional", ["en", "fr", "code"], [0.412, 0.33, 0.258]) == \
        "sampling (proportional): en 41.2 %, fr 33.0 %, code 25.8 %"
    line = _line_of("weights", 1)
    assert line.startswith("sampling (weights; DEPT: 1 of 3 sources a round, without repeats; shares of rounds "
                           "0-3999): en 6"), line
    # a long run of short rounds: the line counts the first SAMPLING_LINE_ROUNDS rounds and says so
    assert "shares of rounds 0-9999 of 0-19999): en 6" in _line_of("weights", 1, steps=40000)
    # as many groups as sources: every source every round, whatever the weights
    assert _line_of("weights", 3) == ("sampling (weights; DEPT: 3 sources on 3 groups, each every round): "
                                      "en 33.3 %, fr 33.3 %, code 33.3 %")
    # two of three drawn without repeats: no source above 50 %, though en's weight is 60 %
    shares = [float(p.split()[-2]) for p in _line_of("weights", 2).split("): ", 1)[1].split(", ")]
    assert max(shares) <= 50.0 and np.isclose(sum(shares), 100.0, atol=0.2)


@pytest.mark.parametrize("mode", ["proportional", "weights"])
def test_the_driver_passes_the_configured_weights_to_its_round_sampler(mode):
    """DeptHooks._make_scheduler (what a DEPT run uses) hands data.sources[].weight and the
    sources' sizes to the round sampler, so a configured weight is never silently dropped."""
    from dept_mega.config import config_from_dict
    from dept_mega.dept.driver import DeptHooks
    from dept_mega.dept.source_info import SourceInfo
    cfg = config_from_dict({"dept": {"variant": "glob", "sampling": mode},
                            "data": {"sources": [{"name": n, "prefix": f"/nonexistent/{n}", "weight": w}
                                                 for n, w in zip(("en", "fr", "code"), WEIGHTS)]}})
    infos = [SourceInfo(s.name, 10, t, weight=s.weight) for s, t in zip(cfg.data.sources, TOKENS)]
    sched = DeptHooks._make_scheduler(SimpleNamespace(cfg=cfg, sources=infos), 1)
    assert sched.weights == pytest.approx(SHARES[mode], rel=1e-12)
