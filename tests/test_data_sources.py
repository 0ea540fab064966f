"""Source weights, per-rank batches, blended batches, vocabulary sets, validation batches."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from dept_mega.config import config_from_dict
from dept_mega.data.gpt_dataset import GPTDataset
from dept_mega.data.sources import (BlendedBatches, SourceBatches, ValidationBatches, source_datasets,
                                    source_weights, token_counts, vocab_set)
from tests.data_utils import numbered_docs, write_docs


def _source(tmp_path, name, n_docs, offset, seed=0):
    """A source whose token ids all lie in [offset, offset + 10000): ids reveal the source."""
    docs = [[offset + (t % 10000) for t in d] for d in numbered_docs(n_docs, seed=seed)]
    return write_docs(str(tmp_path / name), docs, nbytes=[2 * len(d) for d in docs])


def test_source_weights():
    sizes = [100, 300, 600]
    assert np.allclose(source_weights(sizes, "uniform"), [1 / 3] * 3)
    assert np.allclose(source_weights(sizes, "proportional"), [0.1, 0.3, 0.6])
    assert np.allclose(source_weights(sizes, "temperature", 1.0), [0.1, 0.3, 0.6])
    assert np.allclose(source_weights(sizes, "temperature", 0.0), [1 / 3] * 3)
    w = source_weights(sizes, "temperature", 0.5)
    assert np.allclose(w, np.sqrt(sizes) / np.sqrt(sizes).sum()) and w.sum() == pytest.approx(1)
    assert np.all(np.isfinite(source_weights([1e300, 1e-300], "temperature", 3.0)))
    with pytest.raises(ValueError, match="not one of"):
        source_weights(sizes, "zipf")
    with pytest.raises(ValueError, match="> 0"):
        source_weights([1, 0], "proportional")
    with pytest.raises(ValueError, match="temperature"):
        source_weights(sizes, "temperature", -1)


def test_source_batches_ranks_cover_the_global_batch(tmp_path):
    ds = GPTDataset(_source(tmp_path, "a", 60, 0), 8, "98,2", "train", seed=1)
    single = SourceBatches(ds, global_batch_size=8, micro_batch_size=2)
    ranks = [SourceBatches(ds, 8, 2, dp_rank=r, dp_size=4) for r in range(4)]
    for _ in range(3):
        full = torch.cat(single.next_step())
        parts = [r.next_step() for r in ranks]
        assert all(len(p) == 1 and p[0].shape == (2, 9) and p[0].dtype == torch.int64 for p in parts)
        assert torch.equal(torch.cat([p[0] for p in parts]), full)
    expect = np.stack([ds[i] for i in range(24, 32)])  # the 4th step
    assert torch.equal(torch.cat(single.next_step()), torch.from_numpy(expect))
    with pytest.raises(ValueError, match="divisible"):
        SourceBatches(ds, 10, 2, 0, 4)


def test_source_batches_resume(tmp_path):
    ds = GPTDataset(_source(tmp_path, "a", 60, 0), 8, "98,2", "train", seed=1)
    a = SourceBatches(ds, 4, 2)
    for _ in range(5):
        a.next_step()
    state = a.state_dict()
    expect = a.next_step()
    b = SourceBatches(ds, 4, 2)
    b.load_state_dict(state)
    assert all(torch.equal(x, y) for x, y in zip(b.next_step(), expect))
    sized = GPTDataset(ds.prefix, 8, "98,2", "train", seed=1, num_samples=6)
    s = SourceBatches(sized, 4, 2)
    s.next_step()
    with pytest.raises(IndexError, match="no samples left"):
        s.next_step()


def test_blended_batches(tmp_path):
    srcs = [_source(tmp_path, f"s{k}", 80, k * 10000, seed=k) for k in range(3)]
    dss = [GPTDataset(p, 8, "98,2", "train", seed=2) for p in srcs]
    w = np.array([0.6, 0.3, 0.1])
    full = BlendedBatches(dss, w, global_batch_size=16, micro_batch_size=4, seed=5)
    ranks = [BlendedBatches(dss, w, 16, 4, dp_rank=r, dp_size=2, seed=5) for r in range(2)]
    counts = np.zeros(3)
    for step in range(30):
        st = full.next_step()
        tokens, src = torch.cat(st.micro_batches), torch.cat(st.source_ids)
        assert tokens.shape == (16, 9) and src.shape == (16,)
        # the source ids say where each row came from
        assert torch.equal(tokens[:, 0] // 10000, src)
        parts = [r.next_step() for r in ranks]
        assert torch.equal(torch.cat([torch.cat(p.micro_batches) for p in parts]), tokens)
        assert torch.equal(torch.cat([torch.cat(p.source_ids) for p in parts]), src)
        counts += np.bincount(src.numpy(), minlength=3)
    assert np.allclose(counts / counts.sum(), w, atol=0.06)
    # each source is read in its own order, without gaps
    assert full.consumed.tolist() == counts.astype(int).tolist()
    # resume gives the same next step
    again = BlendedBatches(dss, w, 16, 4, seed=5)
    again.load_state_dict(full.state_dict())
    a, b = again.next_step(), full.next_step()
    assert all(torch.equal(x, y) for x, y in zip(a.micro_batches, b.micro_batches))
    other_seed = BlendedBatches(dss, w, 16, 4, seed=6)
    first = BlendedBatches(dss, w, 16, 4, seed=5)
    assert not torch.equal(torch.cat(other_seed.next_step().source_ids), torch.cat(first.next_step().source_ids))


def test_shared_cache_dir_keeps_one_cache_per_source(tmp_path, monkeypatch):
    """Sources of the same name in different folders, one data.cache_dir: the token counts and
    the id range are cached once each (named by a hash of the prefix's path), not recomputed
    on every use because the other source replaced the file."""
    import dept_mega.data.token_counts as tc
    import dept_mega.data.token_range as tr
    prefixes = {}
    for lang, hi in (("en", 50), ("fr", 90)):
        os.makedirs(tmp_path / lang)
        prefixes[lang] = write_docs(str(tmp_path / lang / "text_document"), [list(range(hi))], nbytes=[hi])
    cache = str(tmp_path / "cache")
    for lang, p in prefixes.items():
        assert np.count_nonzero(tc.token_counts(p, cache)) == (50 if lang == "en" else 90)
        assert tr.token_id_range(p, cache) == (0, 49 if lang == "en" else 89)
    assert len(os.listdir(cache)) == 4 and not os.path.exists(prefixes["en"] + ".token_range.json")
    monkeypatch.setattr(tr, "IndexedDataset", lambda p: pytest.fail(f"{p}: read again"))
    counted = lambda done, total: pytest.fail("counted again")  # noqa: E731 (called only when not cached)
    for lang, p in prefixes.items():
        assert np.count_nonzero(tc.token_counts(p, cache, progress=counted)) == (50 if lang == "en" else 90)
        assert tr.token_id_range(p, cache) == (0, 49 if lang == "en" else 89)


def test_vocab_set_and_cache(tmp_path):
    docs = [[5, 9, 9, 300], [7, 5], [65000]]
    prefix = write_docs(str(tmp_path / "v"), docs, nbytes=[1, 1, 1])
    v = vocab_set(prefix)
    assert v.dtype == np.int64 and v.tolist() == [5, 7, 9, 300, 65000]
    counts = token_counts(prefix)
    assert counts[9] == 2 and counts[5] == 2 and counts.sum() == 7
    cache = tmp_path / "v.token_counts.npz"
    assert cache.exists()
    # chunked counting gives the same answer
    assert np.array_equal(token_counts(prefix, cache_dir=str(tmp_path / "other"), chunk_tokens=2), counts)
    # the cache is used, and refreshed when the data change
    mtime = cache.stat().st_mtime_ns
    vocab_set(prefix)
    assert cache.stat().st_mtime_ns == mtime
    write_docs(prefix, [[1, 2, 3]], nbytes=[1])
    os.utime(prefix + ".bin", ns=(mtime + 10**9, mtime + 10**9))
    assert vocab_set(prefix).tolist() == [1, 2, 3]
    # agrees with a direct computation on a bigger source
    big = _source(tmp_path, "big", 200, 0)
    from dept_mega.data.indexed import IndexedDataset

    assert np.array_equal(vocab_set(big), np.unique(np.asarray(IndexedDataset(big).tokens)).astype(np.int64))


def test_validation_batches(tmp_path):
    prefix = _source(tmp_path, "val", 100, 0)
    ds = GPTDataset(prefix, 8, "80,20", "valid", shuffle=False)
    n = ds.samples_per_epoch
    assert n % 4  # the part ends in a partial batch below
    vb = ValidationBatches(ds, global_batch_size=4, micro_batch_size=2, eval_iters=3)
    batches = list(vb)
    assert len(batches) == len(vb) == 3
    want = [torch.from_numpy(np.stack([ds[4], ds[5]])), torch.from_numpy(np.stack([ds[6], ds[7]]))]
    assert len(batches[1].micro_batches) == 2
    assert all(torch.equal(a, b) for a, b in zip(batches[1].micro_batches, want))
    assert batches[1].bytes.tolist() == [ds.sample_bytes(i) for i in range(4, 8)] and batches[1].rows == [2, 2]
    assert all(torch.equal(a.micro_batches[0], b.micro_batches[0]) for a, b in zip(batches, vb))  # fixed order


@pytest.mark.parametrize("gbs,eval_iters,samples", [(4, 3, None), (4, 10_000, None), (8, 1, None), (24, 2, None),
                                                     (100, 1, None), (8, 1, 13), (4, 2, 0), (24, 1, 10_000)])
def test_validation_batches_cover_the_same_samples_under_any_layout(tmp_path, gbs, eval_iters, samples):
    """``eval_iters`` global batches: the first min(eval_iters × GBS, n) samples of the part,
    each once, whatever the data-parallel size and micro-batch size; every rank runs the same
    micro-batches (count and shape) in each iteration, rows beyond its share filling only.
    ``samples`` (train.eval_samples): the first min(samples, n) instead."""
    prefix = _source(tmp_path, "val", 100, 0)
    ds = GPTDataset(prefix, 8, "80,20", "valid", shuffle=False)
    n = ds.samples_per_epoch
    want = np.arange(min(eval_iters * gbs if samples is None else samples, n))
    for dp_size in (1, 2, 4):
        for mbs in (1, 2, 4):
            if gbs % (mbs * dp_size):
                continue
            ranks = [list(ValidationBatches(ds, gbs, mbs, eval_iters, r, dp_size, samples=samples))
                     for r in range(dp_size)]
            assert len({len(b) for b in ranks}) == 1
            seen = []
            for k in range(len(ranks[0])):
                shapes = {tuple(t.shape) for b in ranks for t in b[k].micro_batches}
                assert shapes == {(mbs, 9)} and len({len(b[k].micro_batches) for b in ranks}) == 1
                for b in ranks:
                    batch = b[k]
                    assert sum(batch.rows) == len(batch.samples) == len(batch.bytes)
                    rows = torch.cat([t[:r] for t, r in zip(batch.micro_batches, batch.rows)])
                    own = np.array([ds[int(i)] for i in batch.samples], dtype=np.int64).reshape(-1, 9)
                    assert torch.equal(rows, torch.from_numpy(own))
                    seen.extend(batch.samples.tolist())
            assert seen == want.tolist(), (dp_size, mbs)


def test_source_datasets_from_config(tmp_path):
    a = _source(tmp_path, "a", 40, 0)
    b = _source(tmp_path, "b", 40, 10000)
    cfg = config_from_dict({"model": {"seq_length": 8}, "train": {"seed": 3},
                            "data": {"sources": [{"name": "a", "prefix": a}, {"name": "b", "prefix": b}],
                                     "split": "90,10", "cache_dir": str(tmp_path / "cache")}})
    tr = source_datasets(cfg, "train")
    va = source_datasets(cfg, "valid")
    assert [d.prefix for d in tr] == [a, b] and all(d.shuffle for d in tr) and not any(d.shuffle for d in va)
    assert tr[1][0][0] >= 10000 and tr[0].seed == 3 and tr[0].seq_length == 8
    tr[0][0]
    assert os.listdir(tmp_path / "cache")


def test_a_truncated_source_file_names_the_source_and_the_key(tmp_path):
    """A damaged ``.bin`` (here cut short) opened from a config is reported with the source's
    name and its key ``data.sources[i].prefix``, not only the file: at the pre-flight / launch
    check (check_sources) and where the datasets are built (source_datasets)."""
    from dept_mega.config import ConfigError
    from dept_mega.data.checks import check_sources
    a = _source(tmp_path, "a", 40, 0)
    b = _source(tmp_path, "b", 40, 10)
    with open(b + ".bin", "r+b") as f:
        f.truncate(100)
    cfg = config_from_dict({"model": {"seq_length": 8, "vocab_size": 100000},
                            "data": {"sources": [{"name": "a", "prefix": a}, {"name": "legal", "prefix": b}],
                                     "cache_dir": str(tmp_path / "cache")}})
    for call in (lambda: check_sources(cfg), lambda: source_datasets(cfg, "train")):
        with pytest.raises(ConfigError) as err:
            call()
        msg = str(err.value)
        assert msg.startswith(f"config key 'data.sources[1].prefix': source 'legal': {b}.bin: data file is shorter "
                              f"than its index says: 100 bytes"), msg


def test_data_without_byte_counts_is_refused_at_the_check_not_at_the_first_evaluation(tmp_path):
    """Megatron-LM's preprocess_data.py writes no PREFIX.bytes.npy; evaluation needs it for bits
    per byte. The check names the file and both ways out; with train.eval_iters=0 it passes."""
    from dept_mega.config import ConfigError
    from dept_mega.data.checks import check_sources
    a = _source(tmp_path, "a", 40, 0)
    docs = numbered_docs(40, seed=1)
    b = write_docs(str(tmp_path / "megatron_text_document"), docs)  # no byte counts
    sources = [{"name": "a", "prefix": a}, {"name": "meg", "prefix": b}]
    base = {"model": {"seq_length": 8, "vocab_size": 100000}, "data": {"sources": sources, "split": "90,10"}}
    with pytest.raises(ConfigError) as err:
        check_sources(config_from_dict(base))
    msg = str(err.value)
    assert msg.startswith(f"config key 'data.sources[1].prefix': source 'meg': {b}.bytes.npy does not exist"), msg
    assert "tools/preprocess_data.py" in msg and "train.eval_iters=0" in msg
    assert f"tools/add_byte_counts.py --prefix {b} --input" in msg
    check_sources(config_from_dict({**base, "train": {"eval_iters": 0}}))
    write_docs(b, docs, nbytes=[3 * len(d) for d in docs])
    check_sources(config_from_dict(base))


@pytest.mark.parametrize("split,seq,mbs,data,ok", [
    ("98,2", 8, 2, 1, True),     # 1 validation document of 17 tokens: 2 samples of 9 tokens
    ("98,2", 8, 4, 2, True),     # ... fewer than one batch (or one micro-batch per rank): evaluated whole
    ("98,2", 16, 2, 1, True),    # ... 1 sample of 17 tokens
    ("98,2", 17, 2, 1, False),   # ... no sample of 18 tokens
    ("98,2", 17, 4, 2, False),
])
def test_a_validation_part_without_a_sample_is_refused(tmp_path, split, seq, mbs, data, ok):
    """Evaluation over a validation part without one sample of seq_length + 1 tokens computes
    loss and bits per byte from no tokens: NaN at every evaluation. The check refuses it naming
    the source, the numbers and the ways out; eval_iters=0 passes. A part smaller than a batch
    is evaluated whole (ValidationBatches), whatever the layout."""
    from dept_mega.config import ConfigError
    from dept_mega.data.checks import check_sources
    a = _source(tmp_path, "a", 40, 0)
    cfg = {"model": {"seq_length": seq, "vocab_size": 100000}, "parallel": {"data": data},
           "data": {"sources": [{"name": "a", "prefix": a}], "split": split},
           "train": {"micro_batch_size": mbs, "global_batch_size": 8 * data}}
    if ok:
        check_sources(config_from_dict(cfg))
        return
    with pytest.raises(ConfigError) as err:
        check_sources(config_from_dict(cfg))
    msg = str(err.value)
    assert msg.startswith("config key 'data.split': source 'a': its validation part (1 of 40 documents"), msg
    assert f"holds no sample of model.seq_length + 1 = {seq + 1} tokens: its loss and bits per byte would be NaN" \
        in msg and "train.eval_iters=0" in msg
    check_sources(config_from_dict({**cfg, "train": {**cfg["train"], "eval_iters": 0}}))


@pytest.mark.parametrize("variant", ["std", "spec"])
def test_a_train_part_without_a_sample_is_refused(tmp_path, variant):
    """Every variant: a train part without one sample of seq_length + 1 tokens is refused by the
    check (--check, before the launch takes its nodes), naming the key, the source and the numbers."""
    from dept_mega.config import ConfigError
    from dept_mega.data.checks import check_sources
    a = _source(tmp_path, "a", 40, 0)
    from dept_mega.data.indexed import IndexedDataset
    ds = IndexedDataset(a)
    train_tokens = int(ds.document_token_ranges()[1][:20].sum())  # data.split 50,50: 20 documents
    base = {"model": {"seq_length": train_tokens - 1, "vocab_size": 100000}, "dept": {"variant": variant},
            "data": {"sources": [{"name": "a", "prefix": a}], "split": "50,50"},
            "train": {"eval_iters": 0, "micro_batch_size": 1, "global_batch_size": 1}}
    check_sources(config_from_dict(base))  # exactly one sample
    too_long = {**base, "model": {**base["model"], "seq_length": train_tokens}}
    with pytest.raises(ConfigError) as err:
        check_sources(config_from_dict(too_long))
    msg = str(err.value)
    assert msg.startswith("config key 'data.sources[0].prefix': source 'a': its train part (20 of 40 documents"), msg
    assert f"{train_tokens} tokens) holds no sample of model.seq_length + 1 = {train_tokens + 1} tokens" in msg, msg
