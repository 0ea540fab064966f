"""GPTDataset: split, determinism, samples across documents, epochs, cache, bytes."""
from __future__ import annotations

import os

import numpy as np
import pytest

from dept_mega.data.gpt_dataset import EPOCH_ARRAYS, PART_ARRAYS, GPTDataset, split_bounds
from tests.data_utils import numbered_docs, write_docs


@pytest.fixture()
def data(tmp_path):
    docs = numbered_docs(50, seed=1)
    nbytes = [3 * len(d) + 1 for d in docs]
    return write_docs(str(tmp_path / "src"), docs, nbytes=nbytes), docs, nbytes


def test_split_bounds():
    assert split_bounds(100, "98,2") == [(0, 98), (98, 100), (100, 100)]
    assert split_bounds(10, "98,2") == [(0, 9), (9, 10), (10, 10)]  # valid gets at least one
    assert split_bounds(10, "8,1,1") == [(0, 8), (8, 9), (9, 10)]
    assert split_bounds(10, "1,0") == [(0, 10), (10, 10), (10, 10)]
    with pytest.raises(ValueError, match="too few"):
        split_bounds(1, "98,2")
    with pytest.raises(ValueError, match="weights"):
        split_bounds(10, "a,b")


def test_parts_hold_their_documents_only(data, tmp_path):
    prefix, docs, _ = data
    tr = GPTDataset(prefix, 8, "80,20", "train", seed=1, cache_dir=str(tmp_path / "c"))
    va = GPTDataset(prefix, 8, "80,20", "valid", seed=1, cache_dir=str(tmp_path / "c"))
    assert tr.doc_ids.tolist() == list(range(40)) and va.doc_ids.tolist() == list(range(40, 50))
    train_tokens = {t for d in docs[:40] for t in d}
    valid_tokens = {t for d in docs[40:] for t in d}
    for i in range(len(tr)):
        assert set(tr[i].tolist()) <= train_tokens
    for i in range(len(va)):
        assert set(va[i].tolist()) <= valid_tokens


def test_samples_are_the_shuffled_stream_and_cross_documents(data, tmp_path):
    prefix, docs, _ = data
    L = 16
    ds = GPTDataset(prefix, L, "1,0", "train", seed=7, cache_dir=str(tmp_path / "c"))
    idx = ds.epoch_index(0)
    stream = np.concatenate([docs[int(ds.doc_ids[p])] for p in idx.doc_order])
    assert ds.samples_per_epoch == (len(stream) - 1) // L
    crossing = 0
    for j in range(ds.samples_per_epoch):
        k = int(idx.sample_order[j])
        s = ds[j]
        assert s.dtype == np.int64 and s.shape == (L + 1,)
        assert s.tolist() == stream[k * L:k * L + L + 1].tolist()
        crossing += len(ds.sample_documents(j)) > 1
    assert crossing > ds.samples_per_epoch // 2  # docs are shorter than samples: most cross
    # consecutive stream samples share one token (Megatron layout)
    inv = np.argsort(idx.sample_order)
    assert ds[int(inv[0])][-1] == ds[int(inv[1])][0]


def test_determinism_and_seed_dependence(data, tmp_path):
    prefix, _, _ = data
    a = GPTDataset(prefix, 8, "98,2", "train", seed=3, cache_dir=str(tmp_path / "a"))
    b = GPTDataset(prefix, 8, "98,2", "train", seed=3, cache_dir=str(tmp_path / "b"))
    c = GPTDataset(prefix, 8, "98,2", "train", seed=4, cache_dir=str(tmp_path / "a"))
    n = a.samples_per_epoch
    sa = np.stack([a[i] for i in range(2 * n)])
    assert np.array_equal(sa, np.stack([b[i] for i in range(2 * n)]))
    assert not np.array_equal(sa[:n], np.stack([c[i] for i in range(n)]))
    # epochs are reshuffled: same multiset of documents, different order
    e0, e1 = a.epoch_index(0), a.epoch_index(1)
    assert sorted(e0.doc_order.tolist()) == sorted(e1.doc_order.tolist())
    assert e0.doc_order.tolist() != e1.doc_order.tolist()


def test_infinite_and_sized(data, tmp_path):
    prefix, _, _ = data
    ds = GPTDataset(prefix, 8, "98,2", "train", seed=3, cache_dir=str(tmp_path))
    far = ds[7 * ds.samples_per_epoch + 3]  # epoch 7
    assert far.shape == (9,)
    sized = GPTDataset(prefix, 8, "98,2", "train", seed=3, cache_dir=str(tmp_path), num_samples=5)
    assert len(sized) == 5
    with pytest.raises(IndexError):
        sized[5]


def test_unshuffled_is_file_order(data, tmp_path):
    prefix, docs, _ = data
    ds = GPTDataset(prefix, 10, "90,10", "valid", shuffle=False, cache_dir=str(tmp_path))
    stream = np.concatenate(docs[45:50])
    for j in range(len(ds)):
        assert ds[j].tolist() == stream[j * 10:j * 10 + 11].tolist()


def _epoch_stems(cdir):
    return sorted({f.rsplit(".", 2)[0] for f in os.listdir(cdir)
                   if f.endswith((".doc_order.npy", ".sample_order.npy"))})


def test_cache_hit_miss_and_key(data, tmp_path):
    prefix, _, _ = data
    cdir = str(tmp_path / "cache")
    a = GPTDataset(prefix, 8, "98,2", "train", seed=3, cache_dir=cdir)
    assert not a.part_cached
    first = a[0]
    assert (a.cache_misses, a.cache_hits) == (1, 0)
    stems = _epoch_stems(cdir)
    assert len(stems) == 1 and stems[0].startswith("src_train_")
    assert sorted(os.listdir(cdir)) == sorted([f"{stems[0]}.{k}.npy" for k in EPOCH_ARRAYS]
                                              + [f"{os.path.basename(a.part_stem())}.{k}.npy" for k in PART_ARRAYS])
    b = GPTDataset(prefix, 8, "98,2", "train", seed=3, cache_dir=cdir)
    assert b.part_cached
    assert np.array_equal(b[0], first) and (b.cache_misses, b.cache_hits) == (0, 1)
    assert isinstance(b.epoch_index(0).sample_order, np.memmap) and isinstance(b.doc_lengths, np.memmap)
    for kw in (dict(seed=4), dict(seq_length=9), dict(split="90,10"), dict(shuffle=False)):
        args = dict(seq_length=8, split="98,2", seed=3, shuffle=True)
        args.update(kw)
        c = GPTDataset(prefix, args["seq_length"], args["split"], "train", seed=args["seed"], cache_dir=cdir,
                       shuffle=args["shuffle"])
        c[0]
        assert (c.cache_misses, c.cache_hits) == (1, 0), kw
        assert c.part_cached == ("split" not in kw), kw  # the part's documents depend on the split only
    b[b.samples_per_epoch]  # a new epoch is a new cache entry
    assert b.cache_misses == 1
    assert len(_epoch_stems(cdir)) == 6 and not [f for f in os.listdir(cdir) if f.endswith(".tmp")]
    # cached arrays equal freshly built ones, in int32 (the counts of this part fit)
    built = a._build(0)
    for k, v in built.items():
        z = np.load(f"{a.cache_path(0)}.{k}.npy")
        assert z.dtype == np.int32 and np.array_equal(z, v)


def test_damaged_cache_file_is_named_and_rebuilt(data, tmp_path):
    prefix, _, _ = data
    cdir = str(tmp_path / "cache")
    a = GPTDataset(prefix, 8, "98,2", "train", seed=3, cache_dir=cdir)
    want = [a[i].tolist() for i in range(a.samples_per_epoch)]
    bad = f"{a.cache_path(0)}.sample_doc.npy"
    np.save(bad, np.zeros(3, dtype=np.int32))  # wrong length
    b = GPTDataset(prefix, 8, "98,2", "train", seed=3, cache_dir=cdir)
    with pytest.warns(UserWarning, match="sample_doc.npy"):
        got = [b[i].tolist() for i in range(b.samples_per_epoch)]
    assert got == want and b.cache_misses == 1 and len(np.load(bad)) == b.samples_per_epoch


def _reference_samples(docs, lo, hi, L, seed, epochs, shuffle=True):
    """The module doc's rule written out directly (one token stream per epoch, documents in
    the order of PCG64((seed, e, 0)), samples in the order of PCG64((seed, e, 1))): independent
    of the index arrays GPTDataset builds and caches."""
    part = [np.asarray(d, dtype=np.int64) for d in docs[lo:hi] if len(d)]
    out = []
    for e in range(epochs):
        order = np.arange(len(part))
        if shuffle:
            order = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, e, 0]))).permutation(len(part))
        stream = np.concatenate([part[int(p)] for p in order])
        S = (len(stream) - 1) // L
        samples = np.arange(S)
        if shuffle:
            samples = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, e, 1]))).permutation(S)
        out.extend(stream[int(k) * L:int(k) * L + L + 1] for k in samples)
    return np.stack(out)


@pytest.mark.parametrize("which,shuffle", [("train", True), ("valid", False), ("test", True)])
def test_samples_equal_an_independent_reference(tmp_path, which, shuffle):
    docs = numbered_docs(120, seed=4)
    docs[3] = docs[70] = docs[110] = []  # empty documents are left out of every part
    prefix = write_docs(str(tmp_path / "r"), docs, nbytes=[2 * len(d) + 1 for d in docs])
    lo, hi = split_bounds(len(docs), "70,20,10")[["train", "valid", "test"].index(which)]
    for L in (3, 16):
        want = _reference_samples(docs, lo, hi, L, 11, 3, shuffle)
        for cached in (False, True):  # built here, then loaded memory-mapped by a second instance
            ds = GPTDataset(prefix, L, "70,20,10", which, seed=11, shuffle=shuffle, cache_dir=str(tmp_path / "c"))
            assert ds.part_cached == cached or L == 16
            got = np.stack([ds[i] for i in range(len(want))])
            assert got.dtype == np.int64 and np.array_equal(got, want), (L, cached)


def test_sample_bytes_equal_float64_reference(tmp_path):
    # cumulative bytes in float64, documents in the epoch's order, interpolated at the target
    # ends: the same floats (==) as the rule in the module doc computes them
    docs = numbered_docs(60, seed=2)
    nbytes = [int(b) for b in np.random.default_rng(0).integers(1, 10**9, size=60)]
    prefix = write_docs(str(tmp_path / "f"), docs, nbytes=nbytes)
    L = 5
    ds = GPTDataset(prefix, L, "1,0", "train", seed=9, cache_dir=str(tmp_path / "c"))
    for e in range(2):
        order = np.random.Generator(np.random.PCG64(np.random.SeedSequence([9, e, 0]))).permutation(60)
        cum_t = np.concatenate([[0], np.cumsum([len(docs[int(p)]) for p in order])])
        cum_b = np.zeros(61)
        np.cumsum(np.asarray(nbytes, dtype=np.float64)[order], out=cum_b[1:])
        samples = np.random.Generator(np.random.PCG64(np.random.SeedSequence([9, e, 1]))).permutation(
            ds.samples_per_epoch)
        for j, k in enumerate(samples):
            a = int(k) * L + 1
            ends = np.interp([a, a + L], cum_t, cum_b)
            assert ds.sample_bytes(e * ds.samples_per_epoch + j) == float(ends[1] - ends[0])


def test_cache_defaults_beside_data_and_changes_with_data(tmp_path):
    prefix = write_docs(str(tmp_path / "d"), numbered_docs(20), nbytes=[1] * 20)
    GPTDataset(prefix, 4, "98,2", "train")[0]
    assert [f for f in os.listdir(tmp_path) if f.startswith("d_train_")]
    k1 = GPTDataset(prefix, 4, "98,2", "train").cache_path(0)
    write_docs(prefix, numbered_docs(20, seed=9), nbytes=[1] * 20)  # new content, same name
    assert GPTDataset(prefix, 4, "98,2", "train").cache_path(0) != k1


def test_sample_bytes(tmp_path):
    # documents of exactly L tokens with known byte counts; partial documents count
    # proportionally to the tokens covered
    L = 4
    docs = [[d * 10 + k for k in range(L)] for d in range(12)]
    nbytes = [100 + d for d in range(12)]
    prefix = write_docs(str(tmp_path / "b"), docs, nbytes=nbytes)
    ds = GPTDataset(prefix, L, "1,0", "train", shuffle=False, cache_dir=str(tmp_path))
    # sample j targets stream positions [jL+1, jL+L]: 3 tokens of doc j and 1 of doc j+1
    for j in range(len(ds)):
        expect = nbytes[j] * 3 / 4 + nbytes[j + 1] * 1 / 4
        assert ds.sample_bytes(j) == pytest.approx(expect)
    # whole epoch: bytes of everything between position 1 and the last target
    shuffled = GPTDataset(prefix, L, "1,0", "train", seed=5, cache_dir=str(tmp_path))
    total = sum(shuffled.sample_bytes(j) for j in range(len(shuffled)))
    covered = len(shuffled) * L
    assert total == pytest.approx(sum(nbytes) * covered / (12 * L), rel=0.05)
    assert sum(ds.sample_bytes(j) for j in range(len(ds))) == pytest.approx(
        sum(nbytes) - nbytes[0] / 4 - nbytes[-1] * 3 / 4)


def test_sample_bytes_exact_for_whole_documents(tmp_path):
    # seq_length 5, documents of 5 tokens except the first of 1: targets align to documents
    docs = [[1]] + [[2, 3, 4, 5, 6]] * 6
    nbytes = [7] + [11, 13, 17, 19, 23, 29]
    prefix = write_docs(str(tmp_path / "w"), docs, nbytes=nbytes)
    ds = GPTDataset(prefix, 5, "1,0", "train", shuffle=False, cache_dir=str(tmp_path))
    assert [ds.sample_bytes(j) for j in range(len(ds))] == nbytes[1:]


def test_errors(tmp_path):
    prefix = write_docs(str(tmp_path / "s"), [[1, 2], [3]], nbytes=[1, 1])
    with pytest.raises(ValueError, match="one sample needs seq_length"):
        GPTDataset(prefix, 8, "1,0", "train")
    nob = write_docs(str(tmp_path / "nob"), numbered_docs(10))
    ds = GPTDataset(nob, 4, "1,0", "train", cache_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="bytes.npy"):
        ds.sample_bytes(0)
    with pytest.raises(ValueError, match="which"):
        GPTDataset(prefix, 1, "1,0", "dev")


def test_cache_names_follow_the_document_lengths_only(tmp_path):
    """Same token count, other document boundaries: another index; other tokens, same
    lengths: the same index (it depends on the lengths alone)."""
    a = write_docs(str(tmp_path / "a"), [[1, 2, 3], [4, 5, 6, 7]], nbytes=[1, 1])
    b = write_docs(str(tmp_path / "b"), [[1, 2, 3, 4], [5, 6, 7]], nbytes=[1, 1])
    c = write_docs(str(tmp_path / "c"), [[9, 9, 9], [8, 8, 8, 8]], nbytes=[1, 1])

    def stems(prefix):
        ds = GPTDataset(prefix, 2, "1,0", "train", cache_dir=str(tmp_path / "cache"))
        return [os.path.basename(p).split("_", 1)[1] for p in (ds.part_stem(), ds.cache_path(0))]
    assert stems(a) == stems(c) and stems(a)[0] != stems(b)[0] and stems(a)[1] != stems(b)[1]
