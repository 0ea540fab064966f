"""tools/preprocess_data.py --partitions: the line numbers of bad lines are those of the whole
input in every part, counted in one pass at most, and the output is the unpartitioned one."""
from __future__ import annotations

import pytest

import dept_mega.data.preprocess as pp
from dept_mega.data.preprocess import preprocess
from tests.data_utils import synthetic_texts, train_tiny_tokenizer, write_jsonl

BAD = {"invalid_json": b"not json\n", "missing_key": b'{"body": "x"}\n', "non_string": b'{"text": 7}\n',
       "empty_text": b'{"text": ""}\n'}


@pytest.fixture(scope="module")
def tok_model(tmp_path_factory):
    return train_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")), vocab=200)


def _inputs(tmp_path) -> tuple[list[str], dict[str, list[str]]]:
    """Two files with bad lines of every kind spread over them (so over every part); the
    expected places of each kind."""
    want: dict[str, list[str]] = {k: [] for k in BAD}
    paths = []
    for name, n, seed in (("a.jsonl", 230, 1), ("b.jsonl", 170, 2)):
        path = write_jsonl(str(tmp_path / name), synthetic_texts(n, seed=seed))
        with open(path, "rb") as f:
            lines = f.readlines()
        kinds = list(BAD)
        for i in range(7, len(lines), 23):  # every 23rd line, the kinds in turn
            kind = kinds[(i // 23) % len(kinds)]
            lines[i] = BAD[kind]
            want[kind].append(f"{path}:{i + 1}")
        with open(path, "wb") as f:
            f.write(b"".join(lines))
        paths.append(path)
    return paths, want


@pytest.mark.parametrize("partitions,workers", [(1, 1), (3, 1), (4, 2), (5, 3)])
def test_bad_line_numbers_are_the_inputs_in_every_part(tmp_path, tok_model, monkeypatch, partitions, workers):
    paths, want = _inputs(tmp_path)
    counted = []
    real = pp._count_newlines
    monkeypatch.setattr(pp, "_count_newlines", lambda path, start, end: counted.append((path, start, end))
                        or real(path, start, end))
    monkeypatch.setattr("dept_mega.data.jsonl.MAX_EXAMPLES", 100)  # every place, not the first 5
    st = preprocess(paths, ["text"], tok_model, str(tmp_path / "o"), partitions=partitions, workers=workers,
                    log=None, round_trip_every=3)
    assert st.report.counts == {k: len(v) for k, v in want.items()}
    assert {k: [e.split(" ('")[0] for e in v] for k, v in st.report.examples.items()} == want
    assert st.lines == 400
    # the line numbers at the cuts: no byte is counted twice (not from byte 0 for each part)
    for path in paths:
        spans = sorted((a, b) for p, a, b in counted if p == path)
        assert all(b0 <= a1 for (_, b0), (a1, _) in zip(spans, spans[1:])), spans
    out = {ext: open(str(tmp_path / "o_text_document") + ext, "rb").read() for ext in (".bin", ".idx", ".bytes.npy")}
    ref = preprocess(paths, ["text"], tok_model, str(tmp_path / "r"), log=None, round_trip_every=3)
    assert st.round_trip[0] == ref.round_trip[0]  # the same lines checked (every 3rd of the whole input)
    assert out == {ext: open(str(tmp_path / "r_text_document") + ext, "rb").read()
                   for ext in (".bin", ".idx", ".bytes.npy")}
