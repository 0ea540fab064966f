"""tools/train_tokenizer.py and dept_mega.data.tokenizer."""
from __future__ import annotations

import os

import pytest
import sentencepiece as spm

from dept_mega.data.tokenizer import TokenizerError, load_tokenizer
from tests.data_utils import run_tool, synthetic_texts, train_tiny_tokenizer, write_jsonl


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tok"))


def test_cli_contract_writes_model_and_vocab(tmp_path):
    a = write_jsonl(str(tmp_path / "a.jsonl"), synthetic_texts(200, seed=2))
    b = write_jsonl(str(tmp_path / "b.jsonl"), ["Привет, мир! " * 3] * 50)
    r = run_tool("train_tokenizer.py", ["--input", a, b, "--json-key", "text", "--vocab-size", "100",
                                        "--model-type", "unigram", "--output-prefix", str(tmp_path / "t"),
                                        "--no-byte-fallback"])
    assert r.returncode == 0, r.stderr
    assert os.path.exists(tmp_path / "t.model") and os.path.exists(tmp_path / "t.vocab")
    assert "250 documents" in r.stderr and "100 pieces" in r.stderr
    tok = load_tokenizer(str(tmp_path / "t.model"))
    assert tok.vocab_size == 100
    assert (tok.unk_id, tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2, 3)
    text = "the quick brown fox"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode("Привет")) == "Привет"  # second input was used
    assert not any(f.endswith(".tmp.model") for f in os.listdir(tmp_path))


def test_bpe_and_encode_batch(tokdir):
    tok = load_tokenizer(train_tiny_tokenizer(tokdir, vocab=150, model_type="bpe"))
    texts = synthetic_texts(5, seed=9)
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    assert all(tok.decode(tok.encode(t)) == t for t in texts)


def test_byte_fallback(tokdir):
    plain = load_tokenizer(train_tiny_tokenizer(tokdir, vocab=120))
    fb = load_tokenizer(train_tiny_tokenizer(os.path.join(tokdir, "fb"), vocab=400, extra=["--byte-fallback"]))
    unseen = "日本"  # never in the training text
    assert plain.unk_id in plain.encode(unseen)
    ids = fb.encode(unseen)
    assert fb.unk_id not in ids and fb.decode(ids) == unseen
    assert all(fb.id_to_piece(i).startswith("<0x") for i in ids if fb.id_to_piece(i) != "▁")


def test_vocab_too_large_gives_advice(tmp_path):
    src = write_jsonl(str(tmp_path / "small.jsonl"), ["tiny corpus"] * 5)
    r = run_tool("train_tokenizer.py", ["--input", src, "--vocab-size", "5000", "--output-prefix",
                                        str(tmp_path / "t")])
    assert r.returncode == 1
    assert "--vocab-size 5000 is too large for this corpus" in r.stderr and "Use --vocab-size <=" in r.stderr
    assert "Traceback" not in r.stderr
    assert not os.path.exists(tmp_path / "t.model")


def test_missing_input_and_empty_input(tmp_path):
    r = run_tool("train_tokenizer.py", ["--input", str(tmp_path / "nope.jsonl"), "--vocab-size", "50",
                                        "--output-prefix", str(tmp_path / "t")])
    assert r.returncode == 2 and "nope.jsonl" in r.stderr and "does not exist" in r.stderr
    src = str(tmp_path / "bad.jsonl")
    with open(src, "w") as f:
        f.write('{"other": "x"}\nnot json\n')
    r = run_tool("train_tokenizer.py", ["--input", src, "--vocab-size", "50", "--output-prefix", str(tmp_path / "t")])
    assert r.returncode == 2 and "no text found under key 'text'" in r.stderr
    assert "missing_key" in r.stderr and "invalid_json" in r.stderr and "bad.jsonl:2" in r.stderr
    assert "Traceback" not in r.stderr


def test_sample_cap_and_strict(tmp_path):
    texts = synthetic_texts(300, seed=4)
    src = write_jsonl(str(tmp_path / "a.jsonl"), texts)
    r = run_tool("train_tokenizer.py", ["--input", src, "--vocab-size", "60", "--max-sentences", "100",
                                        "--no-byte-fallback", "--output-prefix", str(tmp_path / "t")])
    assert r.returncode == 0, r.stderr
    assert "sampled 100 of 300" in r.stderr
    with open(src, "a") as f:
        f.write("{broken\n")
    r = run_tool("train_tokenizer.py", ["--input", src, "--vocab-size", "60", "--strict",
                                        "--output-prefix", str(tmp_path / "s")])
    assert r.returncode == 2 and "a.jsonl:301" in r.stderr  # bad input: 2, as preprocess_data.py
    # --strict stops before training: the lines were found, nothing was written (none "skipped")
    assert r.stderr.startswith("error: bad input lines and --strict given: nothing written; found:\n")
    assert r.stderr.split("\n")[1].split()[:3] == ["invalid_json", "1", "found"] and "skipped" not in r.stderr
    assert not os.path.exists(str(tmp_path / "s.model"))


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing.model"))
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(TokenizerError, match="is neither a SentencePiece model nor a Hugging Face tokenizer.json"):
        load_tokenizer(str(bad))
    # a model without EOS cannot be used for --append-eod
    spm.SentencePieceTrainer.Train(sentence_iterator=iter(synthetic_texts(200)), model_prefix=str(tmp_path / "noeos"),
                                   vocab_size=60, eos_id=-1, minloglevel=2)
    with pytest.raises(TokenizerError, match="no EOS"):
        load_tokenizer(str(tmp_path / "noeos.model"))


def test_training_is_deterministic(tmp_path):
    a = load_tokenizer(train_tiny_tokenizer(str(tmp_path / "a"), vocab=150))
    b = load_tokenizer(train_tiny_tokenizer(str(tmp_path / "b"), vocab=150))
    pa = [(a.id_to_piece(i), a.processor.GetScore(i)) for i in range(a.vocab_size)]
    assert pa == [(b.id_to_piece(i), b.processor.GetScore(i)) for i in range(b.vocab_size)]


# Code with tab and space indentation, blank and whitespace-only lines, CRLF, leading and
# trailing spaces, runs of spaces, emoji, CJK, NFKC-sensitive forms (full-width, ligature, "…").
MIXED = [
    "def f(x):\n    if x:\n\treturn  x   # two spaces\n\n    \n        pass\n",
    "  leading spaces and trailing  ",
    "line one\r\nline two\r\n",
    "\n\nstarts with newlines and ends with a tab\t",
    "emoji 😀🎉 and CJK 日本語の文 and Ｆｕｌｌ ﬁ ligature…",
    "for i in range(10):\n    print(i)\n",
    "Une phrase en français, avec des accents: é à ç.",
]


def _mixed_corpus(path: str) -> str:
    texts = []
    for i in range(60):
        texts += [t.replace("x", "xyz"[i % 3]) for t in MIXED]
        texts.append("class C%d:\n    def m(self):\n        return %d\n" % (i, i))
    return write_jsonl(path, texts)


@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
def test_default_tokenizer_is_lossless_on_a_mixed_corpus(tmp_path, model_type):
    src = _mixed_corpus(str(tmp_path / "mixed.jsonl"))
    r = run_tool("train_tokenizer.py", ["--input", src, "--vocab-size", "400", "--model-type", model_type,
                                        "--output-prefix", str(tmp_path / "t"), "--threads", "1"])
    assert r.returncode == 0, r.stderr
    assert "normalization identity, byte fallback on" in r.stderr and "LOSSY" not in r.stderr
    tok = load_tokenizer(str(tmp_path / "t.model"))
    unseen = "an unseen character: \u16a0 and Ωmega\u0378"  # runic letter, unassigned code point
    for doc in [*MIXED, unseen]:
        ids = tok.encode(doc)
        assert tok.decode(ids) == doc, (doc, [tok.id_to_piece(i) for i in ids])
        assert tok.unk_id not in ids
    # indents are learned as whitespace-only pieces, and "\n" is a piece of its own
    pieces = [tok.id_to_piece(i) for i in tok.encode("        return 1\n")]
    assert any(len(p) >= 2 and set(p) == {"▁"} for p in pieces) and pieces[-1] == "\n", pieces


def test_nmt_nfkc_opt_out_is_lossy_and_says_so(tmp_path):
    src = _mixed_corpus(str(tmp_path / "mixed.jsonl"))
    r = run_tool("train_tokenizer.py", ["--input", src, "--vocab-size", "120", "--normalization", "nmt_nfkc",
                                        "--output-prefix", str(tmp_path / "t"), "--threads", "1"])
    assert r.returncode == 0, r.stderr
    assert "normalization nmt_nfkc, byte fallback off; LOSSY" in r.stderr
    tok = load_tokenizer(str(tmp_path / "t.model"))
    assert tok.decode(tok.encode(MIXED[0])) == "def f(x): if x: return x # two spaces pass"


def test_vocab_too_small_for_byte_fallback_gives_advice(tmp_path):
    src = write_jsonl(str(tmp_path / "a.jsonl"), synthetic_texts(100, seed=3))
    r = run_tool("train_tokenizer.py", ["--input", src, "--vocab-size", "100", "--output-prefix", str(tmp_path / "t")])
    assert r.returncode == 1 and "--vocab-size 100 is too small" in r.stderr
    assert "--no-byte-fallback" in r.stderr and "Use --vocab-size >=" in r.stderr and "Traceback" not in r.stderr
