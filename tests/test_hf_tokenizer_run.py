"""A Hugging Face tokenizer (``tokenizer.json``, or a directory holding it with its
``tokenizer_config.json``) wherever a run names a tokenizer: ``data.tokenizer`` and
``data.sources[].tokenizer``. A tiny byte-level BPE is trained on the sample corpus's text (its
EOS an added token past the model's vocabulary, as many Hugging Face tokenizers have it, and a
BOS put in front by its post-processor), the text is preprocessed with it, and a tiny STD run
trains, checks, evaluates and exports with it; a SPEC-OPT run mixes it with a SentencePiece
source. A path that is neither kind is one error naming the config key."""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil

import numpy as np
import pytest

from tests.data_utils import run_tool, write_jsonl
from tests.export_utils import config_overrides, hf_logits, max_abs_diff, train_and_reference
from tests.test_train_cli import _train_here
from tests.trainer_utils import ROOT, ensure_sample_corpus, read_jsonl

N_DOCS = 60  # documents per source: a few thousand tokens, enough for a 4-step run and its evaluation
VOCAB = 320


def _texts(name: str, n: int = N_DOCS, skip: int = 0) -> list[str]:
    with open(os.path.join(ROOT, "examples", "data", f"{name}.jsonl"), encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f][skip:skip + n]


def train_hf_tokenizer(directory: str, texts: list[str], config: bool = True) -> str:
    """A byte-level BPE of VOCAB model pieces (``<s>`` among them) plus ``</s>`` added after
    training (id VOCAB, outside the model's vocabulary: only ``len(tokenizer)`` counts it), a
    post-processor putting ``<s>`` in front, and (``config``) a tokenizer_config.json naming both."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>"], show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens(["</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    if config:
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                       "clean_up_tokenization_spaces": False}, f)
    return directory


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """The tokenizer directory and en / fr / ru data made with it (``--append-eod``): en by the
    command line, the others by its engine."""
    from dept_mega.data.preprocess import preprocess
    ensure_sample_corpus()
    d = tmp_path_factory.mktemp("hf")
    tok_dir = train_hf_tokenizer(str(d / "tok"), _texts("en") + _texts("fr") + _texts("ru"))
    prefixes = {}
    for name in ("en", "fr", "ru"):
        src = write_jsonl(str(d / f"{name}.jsonl"), _texts(name))
        out = str(d / f"{name}_hf")
        if name == "en":
            r = run_tool("preprocess_data.py", ["--input", src, "--json-keys", "text", "--tokenizer-type",
                                                "HuggingFaceTokenizer", "--tokenizer-model", tok_dir,
                                                "--output-prefix", out, "--append-eod"])
            assert r.returncode == 0, r.stderr
        else:
            preprocess([src], ["text"], tok_dir, out, append_eod=True, log=None, tokenizer_type="HuggingFaceTokenizer")
        prefixes[name] = out + "_text_document"
    return {"dir": tok_dir, "root": str(d), **prefixes}


def _sources(hf, *names: str, tokenizer=None) -> str:
    items = [{"name": n, "prefix": hf[n]} for n in names]
    if tokenizer is not None:
        for it in items:
            it["tokenizer"] = tokenizer
    return json.dumps(items)


def test_the_tokenizer_is_read_from_its_path_with_its_added_tokens(hf):
    """The kind comes from the path (a directory, its tokenizer.json, a JSON file under another
    name); the vocabulary counts the added EOS (the data holds it: preprocessing's count); the
    byte counts behind bits per byte are the texts' UTF-8 bytes, not a decoding's."""
    from dept_mega.data.indexed import IndexedDataset
    from dept_mega.data.tokenizer import load_tokenizer, tokenizer_kind
    renamed = os.path.join(hf["root"], "renamed_tokenizer")
    shutil.copyfile(os.path.join(hf["dir"], "tokenizer.json"), renamed)  # JSON, no .json suffix
    for path in (hf["dir"], os.path.join(hf["dir"], "tokenizer.json"), renamed):
        tok = load_tokenizer(path)
        assert tokenizer_kind(path) == tok.kind == "huggingface"
        assert tok.vocab_size == VOCAB + 1
    tok = load_tokenizer(hf["dir"])
    assert tok.eos_id == VOCAB and tok.encode("hello")[0] == tok.token_to_id("<s>")
    assert load_tokenizer(renamed).eos_id is None  # no tokenizer_config.json beside it
    assert load_tokenizer(os.path.join(ROOT, "examples/data/build/tok/en.model")).kind == "sentencepiece"
    ds = IndexedDataset(hf["en"])
    assert int(ds.tokens.max()) == VOCAB  # the added EOS, appended to every document
    nbytes = np.load(hf["en"] + ".bytes.npy")
    assert nbytes.tolist() == [len(t.encode("utf-8")) for t in _texts("en")]


def test_a_std_run_trains_evaluates_and_exports_with_a_hugging_face_tokenizer(hf, tmp_path, monkeypatch, capsys):
    """data.tokenizer = the tokenizer's directory: the pre-flight passes, the run trains and
    records the checksum of its tokenizer.json, evaluation's bits per byte are the tokens'
    nats over the texts' bytes, and the export holds the tokenizer's own files, encoding as
    ours, with its special ids, and our logits."""
    from transformers import AutoTokenizer

    from dept_mega import evaluate as evaluate_cli
    from dept_mega.data.tokenizer import load_tokenizer
    from dept_mega.export.convert import main as export
    monkeypatch.chdir(ROOT)
    run, out = str(tmp_path / "run"), str(tmp_path / "hf")
    over = config_overrides(run, None, **{"train.eval_iters": 2}) + [
        f"data.tokenizer={hf['dir']}", f"data.sources={_sources(hf, 'en', 'fr')}"]
    check = _train_here("--config", "examples/tiny/std.yaml", *over, "--check", "--world-size", "1")
    assert check.returncode == 0, check.stderr
    refs = train_and_reference(0, 1, "examples/tiny/std.yaml", over)
    sha = hashlib.sha256(open(os.path.join(hf["dir"], "tokenizer.json"), "rb").read()).hexdigest()
    depends = json.load(open(os.path.join(run, "checkpoints", "step_4", "depends.json")))
    assert depends["tokenizers"] == {"data.tokenizer": {"path": hf["dir"], "sha256": sha}}
    final = [r for r in read_jsonl(os.path.join(run, "metrics.jsonl")) if r["kind"] == "eval"][-1]
    for name, v in final["by_source"].items():
        # (the record's bytes are rounded to an integer: bytes are interpolated over a sample's tokens)
        assert v["bytes"] > 0 and v["bpb"] == pytest.approx(v["loss"] * v["tokens"] / math.log(2) / v["bytes"],
                                                            rel=1 / v["bytes"])
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert evaluate_cli.main(["--run-dir", run, "--out", str(tmp_path / "e.json")]) == 0
    got = json.load(open(tmp_path / "e.json"))["by_source"]
    for name, v in final["by_source"].items():
        assert got[name]["bpb"] == pytest.approx(v["bpb"], rel=1e-6) and got[name]["bytes"] == v["bytes"]
    capsys.readouterr()
    assert export(["--run-dir", run, "--source", "en", "--output", out]) == 0
    assert "warning" not in capsys.readouterr().err
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the tokenizer's own files
        assert open(os.path.join(out, name), "rb").read() == open(os.path.join(hf["dir"], name), "rb").read()
    assert not os.path.exists(os.path.join(out, "sentencepiece.model"))
    ours = load_tokenizer(hf["dir"])
    conf = json.load(open(os.path.join(out, "config.json")))
    assert (conf["vocab_size"], conf["eos_token_id"], conf["bos_token_id"]) == (VOCAB + 1, VOCAB, ours.token_to_id("<s>"))
    info = json.load(open(os.path.join(out, "dept_export.json")))
    assert info["tokenizer_kind"] == "huggingface" and info["vocab_size"] == VOCAB + 1
    theirs = AutoTokenizer.from_pretrained(out)
    for text in _texts("en", 8, skip=N_DOCS) + ["", "  two  spaces\n\ttab"]:
        assert theirs(text)["input_ids"] == ours.encode(text)
    assert theirs.eos_token_id == VOCAB
    tokens, logits = refs["en"]
    assert tokens[0, 0] == ours.token_to_id("<s>")  # the reference is the training data's encoding
    hf_out = hf_logits(out, tokens)
    assert max_abs_diff(hf_out, logits[..., :hf_out.shape[-1]]) <= 1e-4


def test_a_spec_opt_source_may_use_a_hugging_face_tokenizer(hf, tmp_path, monkeypatch):
    """SPEC-OPT with en on its SentencePiece model and fr on the Hugging Face tokenizer: each
    source's vocabulary is its tokenizer's, the checkpoint records both checksums, and
    --all-sources exports each source with its own tokenizer's files. dept_mega.adapt gives
    the body a new source (ru) on the Hugging Face tokenizer: fresh embeddings of its size."""
    from dept_mega.adapt import main as adapt
    from dept_mega.data.tokenizer import model_sha256
    from dept_mega.export.checkpoint_reader import read_full_weights
    from dept_mega.export.convert import main as export
    monkeypatch.chdir(ROOT)
    run, out = str(tmp_path / "run"), str(tmp_path / "hf")
    en_model = "examples/data/build/tok/en.model"
    sources = json.dumps([{"name": "en", "prefix": "examples/data/build/en_own_text_document", "tokenizer": en_model},
                          {"name": "fr", "prefix": hf["fr"], "tokenizer": hf["dir"]}])
    over = config_overrides(run) + [f"data.sources={sources}"]
    refs = train_and_reference(0, 1, "examples/tiny/spec_opt.yaml", over)
    depends = json.load(open(os.path.join(run, "checkpoints", "step_4", "depends.json")))["tokenizers"]
    assert depends["data.sources[1].tokenizer"]["sha256"] == model_sha256(hf["dir"])
    assert depends["data.sources[0].tokenizer"]["sha256"] == model_sha256(en_model)
    assert export(["--run-dir", run, "--all-sources", "--output", out]) == 0
    assert os.path.exists(os.path.join(out, "en", "sentencepiece.model"))
    assert json.load(open(os.path.join(out, "fr", "dept_export.json")))["vocab_size"] == VOCAB + 1
    assert (open(os.path.join(out, "fr", "tokenizer.json"), "rb").read()
            == open(os.path.join(hf["dir"], "tokenizer.json"), "rb").read())
    tokens, logits = refs["fr"]
    hf_out = hf_logits(os.path.join(out, "fr"), tokens)
    assert hf_out.shape[-1] == VOCAB + 1 and max_abs_diff(hf_out, logits[..., :VOCAB + 1]) <= 1e-4
    new = tmp_path / "new.yaml"
    new.write_text(json.dumps({"data": {"sources": [{"name": "ru", "prefix": hf["ru"], "tokenizer": hf["dir"]}]},
                               "train": {"eval_iters": 1, "global_batch_size": 4, "micro_batch_size": 2}}))
    adapted = tmp_path / "adapted"
    assert adapt(["--run-dir", run, "--source-config", str(new), "--steps", "2", "--out", str(adapted),
                  "--no-random-baseline"]) == 0
    report = json.load(open(adapted / "adapt.json"))
    assert report["sources"] == ["ru"] and report["trained"]["ru"]["bpb"] > 0
    table = read_full_weights(str(adapted / "trained"), 2)["embeddings.word_embeddings.weight"]
    assert VOCAB + 1 <= table.shape[0] < 1000  # the Hugging Face tokenizer's, padded; not en's 3000


def test_trim_on_a_hugging_face_tokenizer_exports_its_v_k(hf, tmp_path, monkeypatch):
    """TRIM with the Hugging Face tokenizer as the global one: the global table has its
    len(tokenizer) rows, each source trains on V_k (the ids of its data, the added EOS among
    them), and the export suppresses every other id and gives our logits on V_k."""
    from dept_mega.data.sources import vocab_set
    from dept_mega.export.convert import main as export
    monkeypatch.chdir(ROOT)
    run, out = str(tmp_path / "run"), str(tmp_path / "hf")
    over = config_overrides(run) + [f"data.tokenizer={hf['dir']}", f"data.sources={_sources(hf, 'en', 'fr')}"]
    refs = train_and_reference(0, 1, "examples/tiny/trim.yaml", over)
    assert export(["--run-dir", run, "--source", "fr", "--output", out]) == 0
    ids = vocab_set(hf["fr"]).tolist()
    assert VOCAB in ids and len(ids) < VOCAB
    gen = json.load(open(os.path.join(out, "generation_config.json")))
    assert sorted(gen["suppress_tokens"]) == sorted(set(range(VOCAB + 1)) - set(ids))
    tokens, logits = refs["fr"]
    hf_out = hf_logits(out, tokens)
    assert hf_out.shape[-1] == VOCAB + 1 and max_abs_diff(hf_out[..., ids], logits[..., :len(ids)]) <= 1e-4


def test_a_path_that_is_no_tokenizer_is_one_error_naming_the_key(hf, tmp_path, capsys):
    """A text file, a directory without tokenizer.json, a broken tokenizer.json: the launch's
    pre-flight and the vocabulary lookups name the config key, the path and the two kinds; an
    export of a run whose tokenizer file went bad says so before reading any weight."""
    from dept_mega.config import load_config, save_config
    from dept_mega.data.tokenizer import TokenizerError
    from dept_mega.export.convert import main as export
    from dept_mega.run_inputs import vocab_size_of
    text, empty, broken = tmp_path / "notes.txt", tmp_path / "empty", tmp_path / "broken.json"
    text.write_text("hello\n")
    empty.mkdir()
    broken.write_text('{"model": ')
    cfg_path = os.path.join(ROOT, "examples/tiny/std.yaml")
    for bad, why in ((text, "(read as SentencePiece: "), (broken, "(read as a tokenizer.json: "),
                     (empty, "is a directory without a tokenizer.json")):
        cfg = load_config(cfg_path, [f"data.tokenizer={bad}", f"data.sources={_sources(hf, 'en')}"])
        with pytest.raises(TokenizerError) as exc:
            vocab_size_of(cfg)
        msg = str(exc.value)
        assert msg.startswith(f"config key 'data.tokenizer': '{bad}' is ") and why in msg, msg
        assert "neither a SentencePiece model nor a Hugging Face tokenizer" in msg, msg
        r = _train_here("--config", cfg_path, f"data.tokenizer={bad}", f"data.sources={_sources(hf, 'en')}",
                        "--check", "--world-size", "1")
        err = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 2 and err == f"error: {msg}", r.stderr
    spec_opt = load_config(os.path.join(ROOT, "examples/tiny/spec_opt.yaml"), [
        "model.vocab_size=null", "data.sources=" + json.dumps([{"name": "en", "prefix": hf["en"], "tokenizer": hf["dir"]},
                                                              {"name": "x", "prefix": hf["fr"], "tokenizer": str(text)}])])
    from dept_mega.data.checks import check_sources
    with pytest.raises(TokenizerError, match=r"^config key 'data.sources\[1\].tokenizer': '.*notes.txt' is neither"):
        check_sources(spec_opt)
    run = str(tmp_path / "run")
    os.makedirs(run)
    save_config(load_config(cfg_path, config_overrides(run) + [f"data.tokenizer={broken}"]),
                os.path.join(run, "config.yaml"))
    capsys.readouterr()
    assert export(["--run-dir", run, "--source", "en", "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: config key 'data.tokenizer': ") and "neither" in err, err


def test_data_made_with_another_hugging_face_tokenizer_is_refused(hf, tmp_path):
    """The checksum check covers Hugging Face tokenizers: another tokenizer of the same size is
    refused naming the key (the id range cannot see it); the same tokenizer moved elsewhere, or
    named by its tokenizer.json, passes; the checkpoint's record tells them apart too."""
    from dept_mega.config import ConfigError, load_config
    from dept_mega.data.checks import check_sources
    from dept_mega.resume import depends_differences, fingerprint
    other = train_hf_tokenizer(str(tmp_path / "other"), _texts("ru") + _texts("ja"))
    moved = str(tmp_path / "moved")
    shutil.copytree(hf["dir"], moved)

    def cfg(tok):
        return load_config(os.path.join(ROOT, "examples/tiny/std.yaml"),
                           [f"data.tokenizer={tok}", f"data.sources={_sources(hf, 'en')}", "train.eval_iters=0"])
    for ok in (hf["dir"], moved, os.path.join(moved, "tokenizer.json")):
        check_sources(cfg(ok))
    with pytest.raises(ConfigError) as exc:
        check_sources(cfg(other))
    msg = str(exc.value)
    assert msg.startswith("config key 'data.tokenizer': source 'en': ") and f"tokenized with {hf['dir']}" in msg
    assert f"but data.tokenizer is {other}, another tokenizer" in msg, msg
    rows = depends_differences(fingerprint(cfg(hf["dir"])), fingerprint(cfg(other)))
    assert [k for k, _ in rows] == ["data.tokenizer"]
    assert depends_differences(fingerprint(cfg(hf["dir"])), fingerprint(cfg(moved))) == []


def _save_tiny_model(vocab: int, special: dict, out: str) -> None:
    """A random tiny Llama of ``vocab`` pieces through the export's own mapping (``to_hf`` with
    the tokenizer's special ids, ``build_model``, ``save_pretrained``) to ``out``."""
    import torch

    from dept_mega.config import config_from_dict
    from dept_mega.export.checkpoint_reader import _structure
    from dept_mega.export.hf_mapping import build_model, to_hf
    cfg = config_from_dict({"model": {"num_layers": 1, "hidden_size": 16, "num_attention_heads": 2,
                                      "ffn_hidden_size": 32, "activation": "swiglu", "normalization": "rmsnorm",
                                      "position_embedding": "rope", "seq_length": 16, "vocab_size": vocab},
                            "dept": {"variant": "std"}})
    weights = {n: torch.randn(shape if shape is not None else (vocab, 16)) for n, (_, shape) in _structure(cfg).items()}
    ids = {k: special[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    build_model(to_hf(cfg, weights, vocab, ids)).save_pretrained(out)


def test_exported_tokenizer_files_special_ids_and_encoding_check(hf, tmp_path):
    """A bare tokenizer.json (no config, so no EOS: training needs none) exports as it is with no
    special ids; a special token its config names but the vocabulary lacks is refused; a config
    that makes transformers encode otherwise than the training data is reported."""
    from dept_mega.data.tokenizer import load_tokenizer
    from dept_mega.export.hf_tokenizer import TokenizerExportError
    from dept_mega.export.tokenizer_files import encoding_difference, export_tokenizer
    bare = str(tmp_path / "bare" / "my_tokenizer.json")
    os.makedirs(os.path.dirname(bare))
    shutil.copyfile(os.path.join(hf["dir"], "tokenizer.json"), bare)
    tok = load_tokenizer(bare)
    out = tmp_path / "out"
    out.mkdir()
    special = export_tokenizer(tok, str(out))
    assert special == {f"{k}_token{s}": None for k in ("bos", "eos", "unk", "pad") for s in ("", "_id")}
    assert sorted(os.listdir(out)) == ["tokenizer.json"]
    assert encoding_difference(str(out), tok) is None
    # ... and the model's config and generation config say so (not LlamaConfig's bos 1 / eos 2)
    _save_tiny_model(tok.vocab_size, special, str(out))
    for name in ("config.json", "generation_config.json"):
        conf = json.load(open(out / name))
        assert [conf.get(f"{k}_token_id") for k in ("bos", "eos", "pad")] == [None] * 3, (name, conf)
    # a pad token the vocabulary lacks
    with open(os.path.join(os.path.dirname(bare), "special_tokens_map.json"), "w") as f:
        json.dump({"pad_token": "<pad>", "eos_token": {"content": "</s>"}}, f)
    with pytest.raises(TokenizerExportError, match=r"its pad_token '<pad>' .* is not in the vocabulary"):
        export_tokenizer(load_tokenizer(bare), str(out))
    # transformers adding a token of its own: its ids are not the training data's
    odd = tmp_path / "odd"
    shutil.copytree(hf["dir"], odd)
    conf = json.load(open(odd / "tokenizer_config.json"))
    json.dump(dict(conf, additional_special_tokens=["Hello"]), open(odd / "tokenizer_config.json", "w"))
    out2 = tmp_path / "out2"
    out2.mkdir()
    tok = load_tokenizer(str(odd))
    assert export_tokenizer(tok, str(out2))["eos_token_id"] == VOCAB
    differs = encoding_difference(str(out2), tok)
    assert differs is not None and 'encodes "Hello, world!' in differs and "tokenizer_config.json" in differs
