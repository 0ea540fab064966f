"""The learning-rate schedules (optim.lr_decay_style): each against a reference written here
from Megatron-LM's definitions at the steps where they change, the cosine default unchanged to
the bit, the keys' checks, and a resumed run continuing the same learning rates."""
from __future__ import annotations

import math
import os
import shutil

import pytest

from dept_mega.config import ConfigError, config_from_dict
from dept_mega.optim import lr_at

LR, MIN = 1.0e-3, 1.0e-4


def reference(step: int, style: str, warmup: int, decay_end: int, wsd_steps: int = 0,
              wsd_style: str = "linear") -> float:
    """Megatron-LM's OptimizerParamScheduler.get_lr written out per phase, with its num_steps
    the number of updates already taken (= ``step`` after warmup), and dept_mega's warmup
    (one step earlier than Megatron's: update ``step`` takes LR·(step + 1)/warmup)."""
    if step < warmup:
        return LR * (step + 1) / warmup
    if style == "constant":
        return LR
    if step > decay_end:
        return MIN
    if style == "inverse-square-root":
        return max(MIN, LR * (max(warmup, 1) / max(step, 1)) ** 0.5)
    frac = (step - warmup) / (decay_end - warmup)  # 0 right after warmup, 1 at the end
    if style == "linear":
        return LR - (LR - MIN) * frac
    if style == "cosine":
        return MIN + (LR - MIN) * (1 + math.cos(math.pi * frac)) / 2
    assert style == "wsd"
    stable_until = decay_end - wsd_steps
    if step <= stable_until:
        return LR
    x = (step - stable_until) / wsd_steps
    left = {"linear": 1 - x, "cosine": (1 + math.cos(math.pi * x)) / 2,
            "exponential": 2 * 0.5 ** x - 1, "minus_sqrt": 1 - x ** 0.5}[wsd_style]
    return MIN + (LR - MIN) * left


CASES = [  # (style, warmup, lr_decay_steps or None (= train.steps 40), lr_wsd_decay_steps, lr_wsd_decay_style)
    ("cosine", 5, None, None, None),
    ("cosine", 5, 30, None, None),
    ("cosine", 0, 60, None, None),
    ("linear", 5, None, None, None),
    ("linear", 4, 24, None, None),
    ("constant", 5, None, None, None),
    ("inverse-square-root", 5, None, None, None),
    ("inverse-square-root", 0, 20, None, None),
    ("wsd", 5, None, 10, "linear"),
    ("wsd", 5, 30, 8, "cosine"),
    ("wsd", 2, None, 38, "exponential"),
    ("wsd", 5, None, 1, "minus_sqrt"),
]


@pytest.mark.parametrize("style,warmup,decay_steps,wsd_steps,wsd_style", CASES)
def test_schedule_matches_the_reference(style, warmup, decay_steps, wsd_steps, wsd_style):
    optim = {"lr": LR, "min_lr": MIN, "warmup_steps": warmup, "lr_decay_style": style,
             "lr_decay_steps": decay_steps, "lr_wsd_decay_steps": wsd_steps}
    if wsd_style:
        optim["lr_wsd_decay_style"] = wsd_style
    cfg = config_from_dict({"dept": {"variant": "std"}, "train": {"steps": 40}, "optim": optim})
    end = decay_steps or 40
    steps = {0, max(warmup - 1, 0), warmup, warmup + 1, (warmup + end) // 2, end - 1, end, end + 1, end + 50}
    if wsd_steps:
        steps |= {end - wsd_steps - 1, end - wsd_steps, end - wsd_steps + 1}
    for s in sorted(steps):
        want = reference(s, style, warmup, end, wsd_steps or 0, wsd_style or "linear")
        assert lr_at(s, cfg.optim, 40) == pytest.approx(want, rel=1e-12, abs=1e-15), (s, want)
    # every style starts its decay from lr, and all but constant are at min_lr past its end
    assert lr_at(warmup, cfg.optim, 40) == pytest.approx(LR)
    assert lr_at(end + 1, cfg.optim, 40) == pytest.approx(LR if style == "constant" else MIN)


def test_the_default_cosine_gives_the_same_floats_as_before():
    """The schedule of every run before lr_decay_style existed: bit for bit the old expression,
    also with lr_decay_steps spelled out as train.steps."""
    def old(step, w, total):
        if step < w:
            return LR * (step + 1) / w
        if total <= w:
            return LR
        progress = min(1.0, (step - w) / max(1, total - w))
        return MIN + 0.5 * (LR - MIN) * (1.0 + math.cos(math.pi * progress))
    for w, total in ((5, 40), (0, 7), (10, 10), (12, 5)):
        plain = config_from_dict({"optim": {"lr": LR, "min_lr": MIN, "warmup_steps": w}}).optim
        for s in range(total + 3):
            assert lr_at(s, plain, total) == old(s, w, total), (w, total, s)
        if total > w:
            spelled = config_from_dict({"optim": {"lr": LR, "min_lr": MIN, "warmup_steps": w,
                                                  "lr_decay_steps": total}}).optim
            assert [lr_at(s, spelled, total) for s in range(total + 3)] == [old(s, w, total)
                                                                           for s in range(total + 3)]


@pytest.mark.parametrize("overrides,message", [
    (["optim.lr_decay_steps=0"], "config key 'optim.lr_decay_steps': must be > 0, got 0"),
    (["optim.lr_decay_steps=-5"], "config key 'optim.lr_decay_steps': must be > 0, got -5"),
    (["optim.lr_decay_steps=100"], "config key 'optim.lr_decay_steps': 100 must be above optim.warmup_steps=100"),
    (["optim.lr_decay_style=WSD"], "config key 'optim.lr_decay_style': 'WSD' is not one of cosine | linear | "
                                   "constant | inverse-square-root | wsd"),
    (["optim.lr_decay_style=wsd"], "config key 'optim.lr_wsd_decay_steps': optim.lr_decay_style=wsd needs"),
    (["optim.lr_decay_style=wsd", "optim.lr_wsd_decay_steps=0"], "config key 'optim.lr_wsd_decay_steps': must be > 0"),
    (["optim.lr_wsd_decay_steps=10"], "config key 'optim.lr_wsd_decay_steps': 10 has no effect under "
                                      "optim.lr_decay_style='cosine'"),
    (["optim.lr_decay_style=wsd", "optim.lr_wsd_decay_steps=901"],
     "config key 'optim.lr_wsd_decay_steps': 901 is more than the 900 steps between warmup "
     "(optim.warmup_steps=100) and the end of the decay (train.steps=1000)"),
    (["optim.lr_decay_style=wsd", "optim.lr_wsd_decay_steps=301", "optim.lr_decay_steps=400"],
     "(optim.lr_decay_steps=400)"),
    (["optim.lr_decay_style=wsd", "optim.lr_wsd_decay_steps=5", "optim.lr_wsd_decay_style=sqrt"],
     "config key 'optim.lr_wsd_decay_style': 'sqrt' is not one of exponential | linear | cosine | minus_sqrt"),
])
def test_bad_schedule_keys_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError) as exc:
        config_from_dict({"train": {"steps": 1000}}, overrides)
    assert message in str(exc.value), str(exc.value)


def test_a_decay_past_or_before_the_end_of_the_run_is_allowed():
    """As in Megatron-LM: lr_decay_steps above train.steps (the run ends before min_lr) or
    below it (min_lr from there on)."""
    for decay in (50, 2000):
        cfg = config_from_dict({"train": {"steps": 1000}, "optim": {"lr_decay_steps": decay, "warmup_steps": 10,
                                                                    "lr_decay_style": "linear"}})
        assert lr_at(999, cfg.optim, 1000) == (cfg.optim.min_lr if decay == 50 else
                                               pytest.approx(cfg.optim.lr - (cfg.optim.lr - cfg.optim.min_lr)
                                                             * 989 / 1990))


@pytest.mark.timeout(300)
def test_a_resumed_run_continues_the_same_learning_rates(tmp_path, monkeypatch):
    """A WSD schedule with its own decay length: a run resumed from its step-4 checkpoint (a
    copy in another run directory) takes at steps 5..8 the learning rates and losses of the
    uninterrupted run, and those are the schedule's."""
    from dept_mega import train as train_cli
    from tests.test_train_cli import _setup
    from tests.trainer_utils import read_jsonl
    cfg = _setup(tmp_path, variant="std")
    common = ["train.steps=8", "train.log_interval=1", "train.eval_interval=0", "train.save_interval=4",
              "optim.warmup_steps=2", "optim.lr_decay_style=wsd", "optim.lr_decay_steps=7",
              "optim.lr_wsd_decay_steps=3", "optim.lr_wsd_decay_style=linear"]
    monkeypatch.setenv("DEPT_MEGA_DEVICE", "cpu")
    monkeypatch.delenv("DEPT_GROUP", raising=False)

    def records(run):
        return {r["step"]: (r["lr"], r["loss"]) for r in read_jsonl(os.path.join(run, "metrics.jsonl"))
                if r["kind"] == "train"}
    ref = str(tmp_path / "ref")
    assert train_cli.main(["--config", cfg, *common, f"train.run_dir={ref}"]) == 0
    full = records(ref)
    o = config_from_dict({}, [c for c in common if c.startswith("optim.")]).optim
    assert [full[s][0] for s in range(1, 9)] == [lr_at(s - 1, o, 8) for s in range(1, 9)]
    assert [full[s][0] for s in (5, 8)] == [o.lr, o.min_lr] and o.min_lr < full[7][0] < full[6][0] < o.lr
    run = str(tmp_path / "run")
    os.makedirs(os.path.join(run, "checkpoints"))
    shutil.copytree(os.path.join(ref, "checkpoints", "step_4"), os.path.join(run, "checkpoints", "step_4"))
    with open(os.path.join(run, "checkpoints", "latest"), "w") as f:
        f.write("4\n")
    assert train_cli.main(["--config", cfg, *common, f"train.run_dir={run}"]) == 0
    resumed = records(run)
    assert sorted(resumed) == [5, 6, 7, 8]
    assert resumed == {s: full[s] for s in range(5, 9)}
