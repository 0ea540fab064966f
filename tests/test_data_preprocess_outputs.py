"""What a preprocessing run removes before and after it writes: exactly its own files and its
own partitions directory, never another dataset whose name starts with its output prefix."""
from __future__ import annotations

import os

import pytest

import dept_mega.data.preprocess as pp
from dept_mega.data.indexed import IndexedDatasetBuilder
from dept_mega.data.preprocess import PreprocessError, preprocess
from dept_mega.data.preprocess_outputs import PARTITIONS_MARKER, partitions_dir, remove_earlier_run
from tests.data_utils import synthetic_texts, train_tiny_tokenizer, write_jsonl


@pytest.fixture(scope="module")
def tok_model(tmp_path_factory):
    return train_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")), vocab=200)


def _files(directory) -> dict[str, bytes]:
    return {f: open(os.path.join(directory, f), "rb").read() for f in sorted(os.listdir(directory))
            if os.path.isfile(os.path.join(directory, f))}


def test_other_datasets_named_like_parts_are_kept(tmp_path, tok_model):
    """The reviewer's case: shards preprocessed on their own as en_part2 and en_part2024 (the
    shards-then-merge workflow) beside --output-prefix en; runs into en, with and without
    --partitions, leave them as they were."""
    shards = tmp_path / "shards"
    shards.mkdir()
    src = write_jsonl(str(tmp_path / "a.jsonl"), synthetic_texts(40, seed=1))
    for name in ("en_part2", "en_part2024", "en_part0"):
        preprocess([src], ["text"], tok_model, str(shards / name), log=None)
    os.remove(shards / "en_part2024_text_document.bin")  # an .idx alone is kept too
    before = _files(shards)
    assert "en_part2_text_document.idx" in before and "en_part2024_text_document.idx" in before
    logged: list[str] = []
    remove_earlier_run(str(shards / "en"), ["text"], logged.append)  # nothing of "en" yet: nothing to remove
    assert logged == [] and _files(shards) == before
    for partitions in (1, 2, 1):
        preprocess([src], ["text"], tok_model, str(shards / "en"), log=logged.append, partitions=partitions)
        now = _files(shards)
        assert {f: now[f] for f in before} == before, partitions
        assert sorted(set(now) - set(before)) == sorted(
            "en_text_document" + ext for ext in (".bin", ".idx", ".bytes.npy", ".tokenizer.json", ".token_range.json"))
    assert not os.path.exists(partitions_dir(str(shards / "en")))
    assert [line for line in logged if "removed" in line and "part" in line] == []


def test_a_killed_partitioned_run_is_cleaned_up_by_the_next(tmp_path, tok_model, monkeypatch):
    """A run killed while merging (SIGKILL: no cleanup; here the cleanup is switched off) leaves
    its partitions directory with finished parts; the next run into the prefix removes it first
    and writes what a clean run writes."""
    src = write_jsonl(str(tmp_path / "a.jsonl"), synthetic_texts(60, seed=2))
    clean = str(tmp_path / "clean")
    preprocess([src], ["text"], tok_model, clean, log=None)
    out = str(tmp_path / "out")

    def killed(self, prefix):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(pp, "remove_partitions_dir", lambda prefix: [])
        m.setattr(IndexedDatasetBuilder, "add_index", killed)
        with pytest.raises(KeyboardInterrupt):
            preprocess([src], ["text"], tok_model, out, log=None, partitions=3)
    left = sorted(os.listdir(partitions_dir(out)))
    assert PARTITIONS_MARKER in left and "part2_text_document.idx" in left, left
    logged: list[str] = []
    preprocess([src], ["text"], tok_model, out, log=logged.append, partitions=2)
    assert any(line.startswith(f"[preprocess] removed {partitions_dir(out)} (the parts of an earlier --partitions "
                               f"run that was stopped: {len(left) - 1} files)") for line in logged), logged
    assert not os.path.exists(partitions_dir(out))
    for ext in (".bin", ".idx", ".bytes.npy"):
        assert open(out + "_text_document" + ext, "rb").read() == open(clean + "_text_document" + ext, "rb").read()


def test_a_foreign_partitions_path_is_refused_not_removed(tmp_path, tok_model):
    """A directory (with files) or a file at OUT.partitions.tmp that no run made: --partitions
    refuses before writing and leaves it; without --partitions the run does not need it and
    leaves it too."""
    src = write_jsonl(str(tmp_path / "a.jsonl"), synthetic_texts(20, seed=3))
    out = str(tmp_path / "out")
    d = partitions_dir(out)
    os.mkdir(d)
    with open(os.path.join(d, "mine.txt"), "w") as f:
        f.write("user data")
    with pytest.raises(PreprocessError, match=r"out\.partitions\.tmp, where --partitions writes its parts, exists "
                                              r"and was not made by this tool"):
        preprocess([src], ["text"], tok_model, out, log=None, partitions=2)
    preprocess([src], ["text"], tok_model, out, log=None)
    assert open(os.path.join(d, "mine.txt")).read() == "user data"
    os.remove(os.path.join(d, "mine.txt"))
    os.rmdir(d)
    with open(d, "w") as f:
        f.write("a file")
    with pytest.raises(PreprocessError, match="was not made by this tool"):
        preprocess([src], ["text"], tok_model, out, log=None, partitions=2)
    assert open(d).read() == "a file"


def test_a_partitions_dir_made_meanwhile_by_another_run_is_left_to_it(tmp_path, tok_model, monkeypatch):
    """Another run into the same --output-prefix makes OUT.partitions.tmp after this run removed
    an earlier run's files and before it makes its own: this run refuses, naming the directory,
    and leaves it and its parts alone (its cleanup must not remove another run's directory)."""
    src = write_jsonl(str(tmp_path / "a.jsonl"), synthetic_texts(20, seed=3))
    out = str(tmp_path / "out")
    d = partitions_dir(out)
    real = pp.remove_earlier_run

    def remove_then_other_run(*args):
        real(*args)
        os.mkdir(d)  # as make_partitions_dir does in the other run
        for name, text in ((PARTITIONS_MARKER, "marker"), ("part0_text_document.bin", "its part")):
            with open(os.path.join(d, name), "w") as f:
                f.write(text)

    monkeypatch.setattr(pp, "remove_earlier_run", remove_then_other_run)
    with pytest.raises(PreprocessError, match=r"out\.partitions\.tmp, where --partitions writes its parts, "
                                              r"appeared after this run removed an earlier run's files"):
        preprocess([src], ["text"], tok_model, out, log=None, partitions=2)
    assert open(os.path.join(d, "part0_text_document.bin")).read() == "its part"
