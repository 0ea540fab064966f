"""The evaluation of the same weights is the same under any layout: ``train.eval_iters``
counts global batches of ``train.global_batch_size`` validation sequences (Megatron-LM's
``--eval-iters``), so the per-source loss, token count, bytes and bits per byte do not depend
on ``parallel.data``, ``train.micro_batch_size`` or ``parallel.pipeline``
(dept_mega.data.sources.ValidationBatches, through the real RunData.make_eval_batches and
TrainLoop.evaluate)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.data_utils import write_docs
from tests.dept_utils import VOCAB, tiny_config
from tests.mp_utils import run_distributed

GBS = 8
SEQ = 8  # tiny_config's model.seq_length


def _write_sources(tmp_path) -> list[dict]:
    """Two sources: ``big``'s validation part holds 21 samples (two full batches of 8 and a
    last one of 5, which splits 3 + 2 over two ranks), ``small``'s 3 (fewer than one batch)."""
    rng = np.random.default_rng(0)
    out = []
    for name, n_docs in (("big", 21), ("small", 3)):
        # data.split "1,99": one training document, then n_docs validation documents of SEQ
        # tokens each (the last one SEQ + 1: the part's last sample needs its label)
        docs = [rng.integers(0, VOCAB, SEQ).tolist() for _ in range(n_docs + 1)]
        docs[-1].append(int(rng.integers(0, VOCAB)))
        nbytes = rng.integers(SEQ, 4 * SEQ, n_docs + 1).tolist()
        out.append({"name": name, "prefix": write_docs(str(tmp_path / name), docs, nbytes=nbytes)})
    return out


def _config(sources, data: int = 1, pipeline: int = 1, mbs: int = 1, eval_iters: int = 1):
    return tiny_config({"dept": {"variant": "std"}, "parallel": {"data": data, "pipeline": pipeline},
                        "data": {"sources": sources, "split": "1,99"},
                        "train": {"micro_batch_size": mbs, "global_batch_size": GBS, "eval_iters": eval_iters}})


def _evaluate(sources, data: int, pipeline: int, mbs: int, eval_iters: int) -> dict:
    from dept_mega.data.sources import source_datasets
    from dept_mega.loop import StdHooks, TrainLoop
    from dept_mega.metrics import MetricsWriter
    from dept_mega.parallel.groups import build_groups
    from dept_mega.train import RunData
    from dept_mega.trainer import Trainer
    cfg = _config(sources, data, pipeline, mbs, eval_iters)
    pg = build_groups(1, data, pipeline)
    torch.manual_seed(cfg.train.seed)
    trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=VOCAB)
    names = [s["name"] for s in sources]
    run = RunData(cfg, pg, {}, dict(zip(names, source_datasets(cfg, "valid"))))
    loop = TrainLoop(cfg, pg, trainer, StdHooks(), MetricsWriter(None, enabled=False), run.make_iterator,
                     eval_sources=names, make_eval_batches=run.make_eval_batches)
    return loop.evaluate()


def _two_ranks(rank, world, sources, eval_iters):
    return {("data 2", 1): _evaluate(sources, 2, 1, 1, eval_iters),
            ("data 2", 2): _evaluate(sources, 2, 1, 2, eval_iters),
            ("pipeline 2", 2): _evaluate(sources, 1, 2, 2, eval_iters)}


@pytest.mark.parametrize("eval_iters", [1, 50])  # 1: one global batch; 50: more than the parts hold
def test_the_evaluated_set_and_its_numbers_do_not_depend_on_the_layout(tmp_path, eval_iters):
    sources = _write_sources(tmp_path)
    got = {("data 1", 4): _evaluate(sources, 1, 1, 4, eval_iters),
           ("data 1", 8): _evaluate(sources, 1, 1, 8, eval_iters)}
    rank0 = run_distributed(_two_ranks, 2, args=(sources, eval_iters), timeout=120)[0]
    got.update(rank0)
    ref = got[("data 1", 8)]
    # the documented set: the first min(eval_iters × GBS, samples in the part) samples
    from dept_mega.data.sources import source_datasets
    parts = dict(zip(["big", "small"], source_datasets(_config(sources), "valid")))
    assert {n: d.samples_per_epoch for n, d in parts.items()} == {"big": 21, "small": 3}
    for name, d in parts.items():
        n = min(eval_iters * GBS, d.samples_per_epoch)
        assert ref[name]["tokens"] == n * SEQ
        assert ref[name]["bytes"] == round(sum(d.sample_bytes(i) for i in range(n))) > 0
    for layout, by_source in got.items():
        for name, r in ref.items():
            v = by_source[name]
            assert (v["tokens"], v["bytes"]) == (r["tokens"], r["bytes"]), (layout, name, v, r)
            assert v["loss"] == pytest.approx(r["loss"], rel=1e-9, abs=0), (layout, name, v, r)
            assert v["bpb"] == pytest.approx(r["bpb"], rel=1e-9, abs=0), (layout, name, v, r)


def test_a_training_step_refuses_filler_rows():
    """Filler rows (MicroBatch.rows) are for evaluation: a training step would count them."""
    from dept_mega.parallel.groups import build_groups
    from dept_mega.trainer import MicroBatch, Trainer
    cfg = tiny_config({"dept": {"variant": "std"}, "train": {"micro_batch_size": 2, "global_batch_size": 2}})
    trainer = Trainer(cfg, build_groups(1, 1, 1), torch.device("cpu"), vocab_size=VOCAB)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1))
    with pytest.raises(ValueError, match="for evaluation only"):
        trainer.train_step([MicroBatch(tokens, rows=1)])
    loss_sum, count = trainer.eval_batches([MicroBatch(tokens, rows=1)])
    assert count == SEQ and loss_sum == pytest.approx(trainer.eval_batches([tokens[:1]])[0], rel=1e-12)
