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


def _trim_mid_round_worker(rank, world):
    from dept_mega.dept.driver import DeptHooks
    from dept_mega.parallel.groups import build_groups
    from dept_mega.trainer import Trainer
    from tests.dept_utils import source_infos
    cfg = tiny_config({"dept": {"variant": "trim", "local_steps": 4}, "train": {"steps": 4}})
    infos = source_infos(3, trim=True)
    pg = build_groups(1, 1, 1)
    torch.manual_seed(cfg.train.seed)
    trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=infos[0].vocab_size)
    hooks = DeptHooks(cfg, pg, trainer, torch.device("cpu"), infos)
    assignment = hooks.round_start(None, 0)
    mine = assignment[pg.group_index]
    it = SyntheticSource(cfg, 1 + pg.group_index, allowed_ids(infos[int(mine[1:])]))
    for _ in range(2):  # the middle of the round
        trainer.train_step(it.next_step())
    installed = emb_state(trainer)
    used = {}
    for s in infos:
        with hooks.eval_context(None, s.name):
            used[s.name] = emb_state(trainer)
    return {"assignment": assignment, "installed": installed, "used": used,
            "phi": {s.name: hooks.phi.weight[s.vocab_ids].clone() for s in infos}}


@pytest.mark.timeout(200)
def test_trim_mid_round_eval_uses_what_the_group_trains_now():
    """In the middle of a round a TRIM source that some group trains is evaluated with that
    group's compact table as trained so far — on every group (copied like SPEC) — not with
    the round-start rows of φ; a source no group trains uses its rows of φ."""
    from tests.mp_utils import run_distributed
    res = run_distributed(_trim_mid_round_worker, 2)
    assignment = res[0]["assignment"]
    held = {name: g for g, name in assignment.items()}
    assert len(held) == 2
    for r in res:
        for name, used in r["used"].items():
            if name in held:
                expect = res[held[name]]["installed"]
                assert used.keys() == expect.keys()
                for k in expect:
                    assert torch.equal(used[k], expect[k]), (name, k)
                rows = r["phi"][name]
                # trained for two steps: not the round-start rows of φ any more
                assert not torch.equal(used["0.word_embeddings.weight"][:rows.shape[0]], rows)
            else:
                rows = r["phi"][name]
                assert torch.equal(used["0.word_embeddings.weight"][:rows.shape[0]], rows)
