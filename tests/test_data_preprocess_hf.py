"""tools/preprocess_data.py with ``--tokenizer-type HuggingFaceTokenizer`` (a local
``tokenizer.json``): the .bin/.idx hold what Megatron-LM's preprocess_data.py writes for the
same tokenizer — ``transformers``' ``tokenizer(text).input_ids`` (the post-processor's special
tokens included) plus the ``eos_token`` per document —, and progress lines give percent and ETA."""
from __future__ import annotations

import json
import os

import pytest

import numpy as np

from tests.data_utils import run_tool, synthetic_texts, write_docs, write_jsonl

TEXTS = ["the quick brown fox", "héllo wörld, ünïcode ✓", "a literal </s> inside", "  spaced   out  "]


def _train_bpe(directory: str) -> str:
    """A small BPE tokenizer.json whose post-processor puts <s> in front, and a
    tokenizer_config.json naming </s> as the EOS token (as a Hugging Face model directory has)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(synthetic_texts(200, seed=3) + TEXTS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "unk_token": "<unk>"}, f)
    return directory


def _megatron_ids(directory: str, texts: list[str]) -> list[list[int]]:
    """What Megatron's HuggingFaceTokenizer gives: transformers' AutoTokenizer when installed,
    else the same encoding through ``tokenizers`` (special tokens added, EOS appended)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        AutoTokenizer = None
    if AutoTokenizer is not None:
        hf = AutoTokenizer.from_pretrained(directory)
        return [hf(t).input_ids + [hf.eos_token_id] for t in texts]
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
    return [tok.encode(t).ids + [tok.token_to_id("</s>")] for t in texts]


def test_huggingface_tokenizer_output_is_megatrons(tmp_path):
    from tokenizers import Tokenizer
    d = _train_bpe(str(tmp_path / "hf"))
    texts = TEXTS + synthetic_texts(30, seed=5)
    src = write_jsonl(str(tmp_path / "in.jsonl"), texts)
    want = _megatron_ids(d, texts)
    bos, eos = (Tokenizer.from_file(os.path.join(d, "tokenizer.json")).token_to_id(t) for t in ("<s>", "</s>"))
    assert all(ids[0] == bos and ids[-1] == eos for ids in want)  # special tokens are part of the output
    for model in (d, os.path.join(d, "tokenizer.json")):
        out = str(tmp_path / "out" / "x")
        r = run_tool("preprocess_data.py", ["--input", src, "--tokenizer-type", "HuggingFaceTokenizer",
                                            "--tokenizer-model", model, "--output-prefix", out, "--append-eod"])
        assert r.returncode == 0, r.stderr
        ref = write_docs(str(tmp_path / "ref"), want, dtype=np.uint16)  # vocabulary 300 < 65500: uint16
        for ext in (".bin", ".idx"):
            with open(out + "_text_document" + ext, "rb") as a, open(ref + ext, "rb") as b:
                assert a.read() == b.read(), ext


def test_huggingface_tokenizer_without_eos_and_missing_file(tmp_path):
    d = _train_bpe(str(tmp_path / "hf"))
    os.remove(os.path.join(d, "tokenizer_config.json"))
    src = write_jsonl(str(tmp_path / "in.jsonl"), TEXTS)
    args = ["--input", src, "--tokenizer-type", "HuggingFaceTokenizer", "--output-prefix", str(tmp_path / "o")]
    r = run_tool("preprocess_data.py", args + ["--tokenizer-model", d, "--append-eod"])
    assert r.returncode == 2 and "names no eos_token" in r.stderr
    assert run_tool("preprocess_data.py", args + ["--tokenizer-model", d]).returncode == 0  # no EOS needed
    r = run_tool("preprocess_data.py", args + ["--tokenizer-model", str(tmp_path / "nope")])
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_progress_gives_percent_and_eta(tmp_path):
    from dept_mega.data.preprocess import preprocess
    d = _train_bpe(str(tmp_path / "hf"))
    src = write_jsonl(str(tmp_path / "in.jsonl"), synthetic_texts(1500, seed=2, words=8))
    lines: list[str] = []
    preprocess([src], ["text"], d, str(tmp_path / "o"), log=lines.append, progress_interval=0.0,
               tokenizer_type="HuggingFaceTokenizer")
    progress = [ln for ln in lines if "%" in ln]
    assert len(progress) >= 3  # batches of 512 lines
    pct = [float(ln.split("]")[1].split("%")[0]) for ln in progress]
    assert pct == sorted(pct) and pct[-1] == 100.0 and pct[0] < 50
    size = os.path.getsize(src) / 1e6
    assert f"of {size:.1f} MB" in progress[0] and "ETA " in progress[0] and progress[-1].endswith("ETA 0:00:00")


def test_a_huggingface_tokenizer_without_its_type_is_named():
    """Megatron's --tokenizer-type stays explicit; a Hugging Face tokenizer given under the
    default (SentencePieceTokenizer) says which flag to pass, for the directory and the file."""
    import tempfile

    from dept_mega.data.tokenizer import TokenizerError, open_tokenizer
    with tempfile.TemporaryDirectory() as tmp:
        d = _train_bpe(os.path.join(tmp, "hf"))
        for path in (d, os.path.join(d, "tokenizer.json")):
            with pytest.raises(TokenizerError, match="pass --tokenizer-type HuggingFaceTokenizer"):
                open_tokenizer("SentencePieceTokenizer", path)
