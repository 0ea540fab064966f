"""Consumed samples and tokens (Megatron-LM's "consumed samples"): the train record and the log
line count one source group's sequences so far, and a resumed run continues the count, also
with another train.global_batch_size, and from a checkpoint written before the count was kept."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.trainer_utils import read_jsonl

SEQ = 16  # tests.test_train_cli's tiny model


def _copy_checkpoint(src_run: str, dst_run: str, step: int) -> str:
    os.makedirs(os.path.join(dst_run, "checkpoints"))
    dst = os.path.join(dst_run, "checkpoints", f"step_{step}")
    shutil.copytree(os.path.join(src_run, "checkpoints", f"step_{step}"), dst)
    with open(os.path.join(dst_run, "checkpoints", "latest"), "w") as f:
        f.write(f"{step}\n")
    return dst


def _consumed(run: str) -> dict[int, tuple[int, int]]:
    return {r["step"]: (r["consumed_samples"], r["consumed_tokens"])
            for r in read_jsonl(os.path.join(run, "metrics.jsonl")) if r["kind"] == "train"}


@pytest.mark.timeout(300)
def test_consumed_samples_and_tokens_count_on_through_a_resume(tmp_path, monkeypatch, capsys):
    from dept_mega import train as train_cli
    from dept_mega.manifest import seal
    from tests.test_train_cli import _setup
    cfg = _setup(tmp_path, variant="std")
    common = ["train.log_interval=1", "train.eval_interval=0", "train.eval_iters=0", "train.save_interval=4"]
    monkeypatch.setenv("DEPT_MEGA_DEVICE", "cpu")
    monkeypatch.delenv("DEPT_GROUP", raising=False)
    ref = str(tmp_path / "ref")
    assert train_cli.main(["--config", cfg, *common, "train.steps=4", "train.global_batch_size=4",
                           f"train.run_dir={ref}"]) == 0
    assert _consumed(ref) == {s: (4 * s, 4 * s * SEQ) for s in range(1, 5)}
    out = capsys.readouterr().out
    assert "| consumed 16 samples 256 tokens | " in out, out

    # resumed with a batch twice as large: 16 samples by step 4, then 8 a step
    run = str(tmp_path / "run")
    _copy_checkpoint(ref, run, 4)
    assert train_cli.main(["--config", cfg, *common, "train.steps=6", "train.global_batch_size=8",
                           f"train.run_dir={run}"]) == 0
    assert _consumed(run) == {5: (24, 24 * SEQ), 6: (32, 32 * SEQ)}
    assert "| consumed 32 samples 512 tokens | " in capsys.readouterr().out

    # a checkpoint without the count (written before it was kept): its steps count with this
    # launch's batch
    old = str(tmp_path / "old")
    step4 = _copy_checkpoint(ref, old, 4)
    meta_path = os.path.join(step4, "group0.json")
    with open(meta_path) as f:
        meta = json.load(f)
    assert meta["trainer"].pop("consumed_samples") == 16
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    seal(step4, 4)
    assert train_cli.main(["--config", cfg, *common, "train.steps=5", "train.global_batch_size=8",
                           f"train.run_dir={old}"]) == 0
    assert _consumed(old) == {5: (40, 40 * SEQ)}
