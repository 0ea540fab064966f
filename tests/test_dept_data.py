"""A source's data position travels with it (K > G): whichever group trains a source next
continues where the source stopped, also after a resume from a checkpoint taken inside a
round (which also ends with the same weights, bit for bit). The real TrainLoop, real
SourceBatches over tiny indexed data, every DEPT variant."""
import io
import os

import numpy as np
import pytest
import torch

from tests.data_utils import write_docs
from tests.dept_utils import SavingOnly, tiny_config
from tests.mp_utils import run_distributed

# (variant, dept.body_optimizer_state): every variant; GLOB also with the body state per source
RUNS = (("glob", "group"), ("glob", "source"), ("trim", "group"), ("spec", "source"), ("spec_opt", "group"))
K, G, L, STEPS, RESUME_AT = 4, 2, 2, 10, 5  # 5 rounds; step 5 is inside round 2
# (no plan of K=4, G=2 moves a source before round 2: 5 rounds are the fewest with 3 moves, and
# with them the resumed run continues through the moves of rounds 3 and 4)
SPEC_OPT_VOCABS = (60, 200, 130, 96)


def _write_sources(root):
    """K sources of ~2000 tokens; source k uses ids [10k, 10k + 30) (all < 60)."""
    rng = np.random.default_rng(3)
    prefixes = []
    for k in range(K):
        docs = [list(10 * k + rng.integers(0, 30, size=int(rng.integers(5, 30)))) for _ in range(120)]
        prefixes.append(write_docs(os.path.join(root, f"src{k}"), docs))
    return prefixes


def _seed_with_moves():
    """A train.seed whose plan moves sources between groups at least 3 times in STEPS // L rounds."""
    from dept_mega.dept.rounds import RoundScheduler
    rounds = STEPS // L
    return next(sd for sd in range(200)
                if sum(len(RoundScheduler(K, G, seed=sd).plan(r).moves) for r in range(rounds)) >= 3)


def _config(variant, run_dir, seed, body="group"):
    return tiny_config({"dept": {"variant": variant, "local_steps": L, "body_optimizer_state": body},
                        "train": {"steps": STEPS, "seed": seed, "save_interval": RESUME_AT, "eval_interval": 0,
                                  "log_interval": 100, "run_dir": run_dir}})


def _make_loop(cfg, prefixes, rank, log, save_at=None):
    """The run's TrainLoop; ``save_at``: the one step whose checkpoint it writes (the run's
    other saves, every save_interval and at the end, are read by nothing here: ~0.3 s each)."""
    from dept_mega.checkpoint import Checkpointer
    from dept_mega.data.gpt_dataset import GPTDataset
    from dept_mega.data.sources import SourceBatches, vocab_set
    from dept_mega.dept.driver import DeptHooks, SourceInfo
    from dept_mega.loop import TrainLoop
    from dept_mega.metrics import MetricsWriter
    from dept_mega.parallel.groups import build_groups
    from dept_mega.trainer import Trainer
    pg = build_groups(1, 1, 1)
    v = cfg.dept.variant
    infos = []
    for k, prefix in enumerate(prefixes):
        vocab = SPEC_OPT_VOCABS[k] if v == "spec_opt" else cfg.model.vocab_size
        ids = torch.as_tensor(vocab_set(prefix), dtype=torch.int64) if v == "trim" else None
        infos.append(SourceInfo(f"s{k}", vocab, 1.0, ids))
    datasets = {f"s{k}": GPTDataset(p, cfg.model.seq_length, "98,2", "train", seed=cfg.train.seed)
                for k, p in enumerate(prefixes)}
    torch.manual_seed(cfg.train.seed)
    trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=infos[0].vocab_size)
    hooks = DeptHooks(cfg, pg, trainer, torch.device("cpu"), infos)
    t = cfg.train

    class Recording(SourceBatches):
        """SourceBatches that note which samples each training step reads (nothing else)."""
        name = ""

        def next_step(self):
            log.append((trainer.step, self.name, self.step_indices().tolist()))
            return super().next_step()

    def make_iterator(name):
        it = Recording(datasets[name], t.global_batch_size, t.micro_batch_size, pg.dp_rank, pg.dp_size)
        it.name = name
        return it

    writer = MetricsWriter(t.run_dir, enabled=rank == 0, stream=io.StringIO())
    ck = Checkpointer(t.run_dir) if save_at is None else SavingOnly(t.run_dir, [save_at])
    return TrainLoop(cfg, pg, trainer, hooks, writer, make_iterator, checkpointer=ck)


def _final_state(loop):
    from tests.dept_utils import body_vector, emb_state
    phi = loop.hooks.phi
    return {"body": body_vector(loop.trainer), "emb": emb_state(loop.trainer),
            "phi": None if phi is None else phi.weight.clone()}


def _positions_worker(rank, world, prefixes, root, seed):
    out = {}
    for variant, body in RUNS:
        cfg = _config(variant, os.path.join(root, f"{variant}_{body}"), seed, body)
        full, resumed = [], []
        loop = _make_loop(cfg, prefixes, rank, full, save_at=RESUME_AT)
        loop.run()
        loop2 = _make_loop(cfg, prefixes, rank, resumed, save_at=RESUME_AT)  # (saves nothing)
        assert loop2.checkpointer.load(loop2, step=RESUME_AT) == RESUME_AT
        loop2.run()
        out[(variant, body)] = {"full": full, "resumed": resumed, "state": _final_state(loop),
                                "state_resumed": _final_state(loop2)}
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_data_position_travels_with_the_source(tmp_path):
    from dept_mega.data.gpt_dataset import GPTDataset
    from dept_mega.data.sources import SourceBatches
    prefixes = _write_sources(str(tmp_path))
    seed = _seed_with_moves()
    res = run_distributed(_positions_worker, G, args=(prefixes, str(tmp_path), seed), timeout=250)
    cfg = _config("glob", "unused", seed)
    gbs = cfg.train.global_batch_size
    for variant in RUNS:
        by_source: dict[str, list] = {}
        groups_of: dict[str, set] = {}
        for g, r in enumerate(res):  # rank g is group g (T = P = D = 1)
            steps = [e[0] for e in r[variant]["full"]]
            assert steps == list(range(STEPS)), (variant, g, steps)
            for step, name, idx in r[variant]["full"]:
                by_source.setdefault(name, []).append((step, idx))
                groups_of.setdefault(name, set()).add(g)
            # the run resumed inside round 2 reads exactly what the uninterrupted run read,
            # and ends with the same weights, bit for bit
            assert r[variant]["resumed"] == [e for e in r[variant]["full"] if e[0] >= RESUME_AT], (variant, g)
            a, b = r[variant]["state"], r[variant]["state_resumed"]
            assert torch.equal(a["body"], b["body"]) and a["emb"].keys() == b["emb"].keys(), (variant, g)
            assert all(torch.equal(a["emb"][k], b["emb"][k]) for k in a["emb"]), (variant, g)
            assert (a["phi"] is None) == (b["phi"] is None) and (a["phi"] is None or torch.equal(a["phi"], b["phi"]))
        assert any(len(gs) == G for gs in groups_of.values()), "the plan must move a source between groups"
        for name, seen in by_source.items():
            read = [i for _, idx in sorted(seen) for i in idx]
            ds = GPTDataset(prefixes[int(name[1:])], cfg.model.seq_length, "98,2", "train", seed=seed)
            assert len(read) < ds.samples_per_epoch  # all within the first epoch
            assert len(set(read)) == len(read), f"{variant}: source {name} re-read samples: {read}"
            # what one group training this source alone for as many steps reads
            alone = SourceBatches(ds, gbs, cfg.train.micro_batch_size)
            expect = []
            for _ in range(len(seen)):
                expect += alone.step_indices().tolist()
                alone.next_step()
            assert read == expect, (variant, name)


def test_resume_refuses_a_data_position_the_plan_does_not_give(tmp_path):
    """A checkpoint's data position must agree with the round plan (one process, G = 1);
    a disagreeing one (e.g. the plan's inputs changed since) is an error, not a silent re-read."""
    import json
    from dept_mega.config import ConfigError
    prefixes = _write_sources(str(tmp_path))
    cfg = tiny_config({"dept": {"variant": "glob", "local_steps": L},
                       "train": {"steps": 6, "save_interval": 3, "eval_interval": 0, "log_interval": 100,
                                 "run_dir": str(tmp_path / "run")}})
    log = []
    _make_loop(cfg, prefixes, 0, log, save_at=3).run()  # (only the checkpoint read below)
    meta_path = tmp_path / "run" / "checkpoints" / "step_3" / "group0.json"
    meta = json.loads(meta_path.read_text())
    (name, pos), = meta["iterators"].items()  # only the source the group trains
    assert pos["steps"] == sum(1 for step, n, _ in log if n == name and step < 3)
    loop = _make_loop(cfg, prefixes, 0, [], save_at=3)  # (saves nothing)
    loop.checkpointer.load(loop, step=3)
    loop.run()  # agrees: resumes
    meta["iterators"][name] = {"consumed_samples": 0, "steps": 0}
    meta_path.write_text(json.dumps(meta))
    from dept_mega.manifest import seal
    seal(str(meta_path.parent), 3)  # a consistent checkpoint whose position disagrees with the plan
    loop = _make_loop(cfg, prefixes, 0, [])
    with pytest.raises(ConfigError, match=f"step_3: source '{name}' has read 0 steps, the round plan of this "
                                          f"launch gives {pos['steps']} at step 3 .*dept.sampling"):
        loop.checkpointer.load(loop, step=3)
