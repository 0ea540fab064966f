"""Evaluation must not change what is being trained: an evaluation in the middle of a round
(``train.eval_interval`` not a multiple of ``dept.local_steps``) leaves the installed source's
embeddings and the rest of the round exactly as without it."""
import pytest
import torch

from tests.dept_utils import SyntheticSource, allowed_ids, emb_state, source_infos, tiny_config


def _round_with_eval(variant: str, eval_after: int):
    from dept_mega.dept.driver import DeptHooks
    from dept_mega.parallel.groups import build_groups
    from dept_mega.trainer import Trainer
    cfg = tiny_config({"dept": {"variant": variant, "local_steps": 4}, "train": {"steps": 4}})
    infos = source_infos(1, trim=variant == "trim")
    pg = build_groups(1, 1, 1)
    torch.manual_seed(cfg.train.seed)
    trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=infos[0].vocab_size)
    hooks = DeptHooks(cfg, pg, trainer, torch.device("cpu"), infos)
    name = hooks.round_start(None, 0)[0]
    it = SyntheticSource(cfg, 1, allowed_ids(infos[0]))
    before = None
    for step in range(cfg.dept.local_steps):
        if step == eval_after:
            before = emb_state(trainer)
            with hooks.eval_context(None, name):
                trainer.eval_batches(SyntheticSource(cfg, 7, allowed_ids(infos[0])).next_step())
            after = emb_state(trainer)
            for k in before:
                assert torch.equal(before[k], after[k]), f"evaluation changed the installed embeddings ({k})"
        trainer.train_step(it.next_step())
    hooks.round_end(None, 0)
    return emb_state(trainer), [p.detach().clone() for p in trainer.body_parameters()]


@pytest.mark.parametrize("variant", ["trim", "spec", "glob"])
def test_mid_round_eval_leaves_training_unchanged(variant):
    emb_a, body_a = _round_with_eval(variant, eval_after=2)
    emb_b, body_b = _round_with_eval(variant, eval_after=-1)  # no evaluation
    for k in emb_b:
        assert torch.equal(emb_a[k], emb_b[k]), k
    for a, b in zip(body_a, body_b):
        assert torch.equal(a, b)
