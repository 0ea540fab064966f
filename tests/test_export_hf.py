"""tools/convert_to_hf.py: a source's model as a Hugging Face ``transformers`` directory.

Runs are trained on the sample corpus with the real training session (tiny models, a few
steps); "our logits" are computed by the training processes themselves (the source's
embeddings installed as evaluation installs them, tensor shards gathered, pipeline stages
chained), the exported model is loaded with ``AutoModelForCausalLM`` and must give the same
logits (fp32, within 1e-4) on the same tokens; ``generate`` must run; the exported tokenizer
must encode and decode as ours."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.export_utils import (TINY_MODEL, config_overrides, hf_logits, max_abs_diff, source_text,
                                train_and_reference)
from tests.mp_utils import run_distributed
from tests.trainer_utils import ROOT, ensure_sample_corpus, run_script

TOL = 1e-4
MPT_MODEL = {"position_embedding": "alibi", "normalization": "layernorm", "activation": "gelu",
             "num_attention_heads": 6, "num_query_groups": 6, "hidden_size": 48, "ffn_hidden_size": 192}


@pytest.fixture(scope="module")
def corpus():
    ensure_sample_corpus()


def _sources(*names: str, own: bool = False) -> str:
    kind = "own" if own else "global"
    items = []
    for n in names:
        item = {"name": n, "prefix": f"examples/data/build/{n}_{kind}_text_document"}
        if own:
            item["tokenizer"] = f"examples/data/build/tok/{n}.model"
        items.append(item)
    return json.dumps(items)


def _train_overrides(run_dir: str, model=None, **top) -> list[str]:
    """config_overrides for a run trained here: its final evaluation (which the export does not
    read) of one batch per source, not the tiny configs' 12 (most of a 4-rank run's time)."""
    return config_overrides(run_dir, model, **{"train.eval_iters": 1, **top})


def _one(results):
    refs = [r for r in results if r is not None]
    assert len(refs) == 1
    return refs[0]


def _check_model(out_dir: str, tokens: torch.Tensor, ours: torch.Tensor, vocab_ids=None) -> float:
    """Exported logits vs ours (``vocab_ids``: TRIM's V_k, whose compact logits ours are)."""
    hf = hf_logits(out_dir, tokens)
    if vocab_ids is None:
        V = hf.shape[-1]
        assert ours.shape[-1] >= V and torch.isinf(ours[..., V:]).all()  # the rest is padding
        diff = max_abs_diff(hf, ours[..., :V])
    else:
        diff = max_abs_diff(hf[..., vocab_ids], ours[..., :len(vocab_ids)])
    assert diff <= TOL, f"{out_dir}: exported logits differ from ours by {diff}"
    return diff


def _generate(out_dir: str, text: str, n: int = 4) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out_dir)
    enc = tok(text, return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    assert out.shape == (1, enc["input_ids"].shape[1] + n)
    assert isinstance(tok.decode(out[0], skip_special_tokens=True), str)
    return out[0, enc["input_ids"].shape[1]:]


# ----------------------------------------------------------------------------- mappings


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_llama_tp2_pp2_checkpoint_exports_with_our_logits(corpus, tmp_path, monkeypatch, capsys):
    """rope + rmsnorm + swiglu + GQA with biases, tied head, trained with tensor 2 × pipeline 2:
    the export writes a Llama directory with our logits; the command line (the script run as
    ``__main__``) runs the same main and exits with its status (here refusing to write over that
    export)."""
    from dept_mega.export.convert import main
    monkeypatch.chdir(ROOT)
    run, out = str(tmp_path / "run"), str(tmp_path / "hf")
    over = _train_overrides(run, {"bias": True}, **{"parallel.tensor": 2, "parallel.pipeline": 2})
    refs = _one(run_distributed(train_and_reference, 4, args=("examples/tiny/std.yaml", over), timeout=240))
    assert main(["--run-dir", run, "--source", "en", "--output", out]) == 0
    # the script as `python tools/convert_to_hf.py ARGS` runs it, in this process: a process of its
    # own would only add its imports, torch's and transformers' (~5 s of CPU)
    capsys.readouterr()
    assert run_script("tools/convert_to_hf.py", "--run-dir", run, "--source", "en", "--output", out,
                      monkeypatch=monkeypatch) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --output {out} holds an earlier export"), err
    info = json.load(open(os.path.join(out, "dept_export.json")))
    assert info["architecture"] == "llama" and info["step"] == 4
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert (cfg["model_type"], cfg["num_key_value_heads"], cfg["attention_bias"], cfg["mlp_bias"],
            cfg["tie_word_embeddings"]) == ("llama", 2, True, True, True)
    tokens, ours = refs["en"]
    _check_model(out, tokens, ours)
    _generate(out, source_text("en")[:80])


def test_mpt_export_exact_without_norm_biases_and_refused_with_them(corpus, tmp_path, monkeypatch, capsys):
    """alibi + layernorm + gelu → MPT, with 6 heads (ALiBi slopes of a head count that is not a
    power of two), tied head. Trained LayerNorm biases (which MPT lacks) are refused, naming
    the key; a model trained with ``model.norm_bias: false`` exports exactly."""
    from dept_mega.export.convert import main
    monkeypatch.chdir(ROOT)
    run_a, run_b = str(tmp_path / "a"), str(tmp_path / "b")
    train_and_reference(0, 1, "examples/tiny/std.yaml", _train_overrides(run_a, MPT_MODEL))
    capsys.readouterr()
    assert main(["--run-dir", run_a, "--source", "fr", "--output", str(tmp_path / "hf_a")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: config key 'model.norm_bias'"), err
    assert not os.path.exists(tmp_path / "hf_a")
    refs = train_and_reference(0, 1, "examples/tiny/std.yaml",
                               _train_overrides(run_b, dict(MPT_MODEL, norm_bias=False)))
    out = str(tmp_path / "hf_b")
    assert main(["--run-dir", run_b, "--source", "fr", "--output", out]) == 0
    conf = json.load(open(os.path.join(out, "config.json")))
    assert (conf["model_type"], conf["max_seq_len"]) == ("mpt", 8 * TINY_MODEL["seq_length"])
    tokens, ours = refs["fr"]
    _check_model(out, tokens, ours)
    # past model.seq_length (ALiBi has no length limit; transformers' MPT has max_seq_len): the
    # first positions' logits are still ours (causal)
    longer = torch.cat([tokens, tokens.flip(1)], dim=1)
    assert longer.shape[1] > TINY_MODEL["seq_length"]
    assert max_abs_diff(hf_logits(out, longer)[:, :tokens.shape[1]], ours[..., :conf["vocab_size"]]) <= TOL
    _generate(out, source_text("fr")[:80])
    # the tokenizer at the config's path is not the one the checkpoint recorded (depends.json):
    # refused, naming the key and the file, before anything is written
    import yaml
    conf_path = os.path.join(run_b, "config.yaml")
    raw = yaml.safe_load(open(conf_path))
    raw["data"]["tokenizer"] = os.path.join(ROOT, "examples/data/build/tok/en.model")
    yaml.safe_dump(raw, open(conf_path, "w"))
    capsys.readouterr()
    assert main(["--run-dir", run_b, "--source", "fr", "--output", str(tmp_path / "hf_c")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: config key 'data.tokenizer' differs from checkpoint "), err
    assert "depends.json" in err and "en.model" in err and not os.path.exists(tmp_path / "hf_c"), err


@pytest.mark.parametrize("trim", [False, True])
@pytest.mark.parametrize("rows", [-1, 0, 1, 128])
def test_a_table_of_other_rows_than_the_tokenizer_gives_is_refused(trim, rows):
    """The table's rows must be the tokenizer's vocabulary padded to a multiple of 128 (TRIM's φ:
    exactly the vocabulary); anything else is another tokenizer's table, refused naming the key."""
    from dept_mega.config import config_from_dict
    from dept_mega.export.checkpoint_reader import FullWeights
    from dept_mega.export.convert import check_table_rows
    from dept_mega.export.hf_mapping import ExportError
    cfg = config_from_dict({"model": dict(TINY_MODEL, tie_embeddings=False), "dept": {"variant": "trim" if trim else "std"}})
    vocab = 300
    want = vocab if trim else 384
    for name in ("embeddings.word_embeddings.weight", "embeddings.output_layer.weight"):
        weights = FullWeights({"embeddings.word_embeddings.weight": torch.zeros(want, 4),
                               "embeddings.output_layer.weight": torch.zeros(want, 4)})
        weights[name] = torch.zeros(want + rows, 4)
        if rows == 0:
            check_table_rows(cfg, weights, vocab, "tok.model", "data.tokenizer")
            continue
        with pytest.raises(ExportError, match=rf"config key 'data.tokenizer': tokenizer 'tok.model' has {vocab} "
                                              rf"pieces, which need a table of {want} rows, .*{name}"):
            check_table_rows(cfg, weights, vocab, "tok.model", "data.tokenizer")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_spec_opt_all_sources_export_own_embeddings_and_tokenizers(corpus, tmp_path, monkeypatch):
    """SPEC-OPT, 3 sources on 2 groups (a source not trained in the last round comes from its
    group's store): --all-sources writes one directory per source with that source's
    embeddings and its own tokenizer; each gives our logits for that source."""
    from transformers import AutoTokenizer

    from dept_mega.data.tokenizer import load_tokenizer
    from dept_mega.export.convert import main
    monkeypatch.chdir(ROOT)
    run, out = str(tmp_path / "run"), str(tmp_path / "hf")
    over = _train_overrides(run, None, **{"train.steps": 6}) + [f"data.sources={_sources('en', 'fr', 'ru', own=True)}"]
    refs = _one(run_distributed(train_and_reference, 2, args=("examples/tiny/spec_opt.yaml", over), timeout=240))
    assert main(["--run-dir", run, "--all-sources", "--output", out]) == 0
    origins = []
    for name in ("en", "fr", "ru"):
        d = os.path.join(out, name)
        info = json.load(open(os.path.join(d, "dept_export.json")))
        own = load_tokenizer(f"examples/data/build/tok/{name}.model")
        assert info["source"] == name and info["vocab_size"] == own.vocab_size
        origins.append(info["from"])
        tokens, ours = refs[name]
        _check_model(d, tokens, ours)
        text = source_text(name, 1)
        hf_tok = AutoTokenizer.from_pretrained(d)
        assert hf_tok.encode(text, add_special_tokens=False) == own.encode(text)
    assert any("store" in o for o in origins), origins  # the per-rank store path was exercised
    _generate(os.path.join(out, "ru"), source_text("ru")[:80])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trim_export_uses_global_table_and_restricts_generation_to_v_k(corpus, tmp_path, monkeypatch):
    """TRIM, 2 sources on 2 groups, untied head: the export is the body + the global tables φ
    (global tokenizer); the logits of the source's V_k equal ours (its compact table), and
    generation_config suppresses every id outside V_k."""
    from dept_mega.data.sources import vocab_set
    from dept_mega.export.convert import main
    monkeypatch.chdir(ROOT)
    run, out = str(tmp_path / "run"), str(tmp_path / "hf")
    over = _train_overrides(run, {"tie_embeddings": False}) + [f"data.sources={_sources('en', 'ja')}"]
    refs = _one(run_distributed(train_and_reference, 2, args=("examples/tiny/trim.yaml", over), timeout=240))
    assert main(["--run-dir", run, "--all-sources", "--output", out]) == 0
    for name in ("en", "ja"):
        d = os.path.join(out, name)
        ids = vocab_set(f"examples/data/build/{name}_global_text_document").tolist()
        gen = json.load(open(os.path.join(d, "generation_config.json")))
        assert sorted(gen["suppress_tokens"]) == sorted(set(range(8000)) - set(ids))
        tokens, ours = refs[name]
        _check_model(d, tokens, ours, vocab_ids=ids)
    new = _generate(os.path.join(out, "ja"), source_text("ja")[:80], n=6)
    assert set(new.tolist()) <= set(vocab_set("examples/data/build/ja_global_text_document").tolist())


def test_trim_step_inside_a_round_exports_the_installed_groups_rows(corpus, tmp_path, monkeypatch):
    """TRIM on one group, a checkpoint inside a round (local_steps 4, step 2): φ still holds the
    round-start rows, the group trains its compact tables (untied head). The installed source's
    export is the model evaluation uses then (φ with the compact rows of V_k, the step's body):
    its logits over V_k are ours at that step; so are the other source's (φ's rows). The round's
    end (step 4) exports φ."""
    from dept_mega.data.sources import vocab_set
    from dept_mega.export.convert import main
    from tests.export_utils import reference_at
    monkeypatch.chdir(ROOT)
    run, out = str(tmp_path / "run"), str(tmp_path / "hf")
    over = _train_overrides(run, {"tie_embeddings": False}, **{"dept.local_steps": 4, "train.save_interval": 1,
                                                               "train.eval_iters": 0}) + \
        [f"data.sources={_sources('en', 'fr')}"]
    last = train_and_reference(0, 1, "examples/tiny/trim.yaml", over)
    dept = json.load(open(os.path.join(run, "checkpoints", "step_2", "group0.json")))["dept"]
    assert dept["in_round"] and dept["installed"] in ("en", "fr"), dept
    refs = reference_at(run, 2)
    assert main(["--run-dir", run, "--step", "2", "--all-sources", "--output", out]) == 0
    for name in ("en", "fr"):
        info = json.load(open(os.path.join(out, name, "dept_export.json")))
        assert info["step"] == 2 and ("compact table" in info["from"]) == (name == dept["installed"]), info
        tokens, ours = refs[name]
        _check_model(os.path.join(out, name), tokens, ours,
                     vocab_ids=vocab_set(f"examples/data/build/{name}_global_text_document").tolist())
    assert main(["--run-dir", run, "--source", "en", "--output", out + "_last"]) == 0
    info = json.load(open(os.path.join(out + "_last", "dept_export.json")))
    assert info["step"] == 4 and info["from"] == "step 4, group 0 (TRIM: the global table φ)", info
    _check_model(out + "_last", *last["en"], vocab_ids=vocab_set("examples/data/build/en_global_text_document").tolist())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_glob_exports_round_boundaries_and_refuses_a_step_inside_a_round(corpus, tmp_path, monkeypatch, capsys):
    """GLOB on 2 groups, checkpoints every step: a step inside a round holds two different local
    models (refused, naming --step); the last step (a round boundary) exports our model."""
    from dept_mega.export.convert import main
    monkeypatch.chdir(ROOT)
    run, out = str(tmp_path / "run"), str(tmp_path / "hf")
    over = _train_overrides(run, {"tie_embeddings": False}, **{"train.save_interval": 1}) + \
        [f"data.sources={_sources('fr', 'code')}"]
    refs = _one(run_distributed(train_and_reference, 2, args=("examples/tiny/glob.yaml", over), timeout=240))
    capsys.readouterr()
    assert main(["--run-dir", run, "--step", "3", "--source", "fr", "--output", out]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "inside a round" in err and "--step" in err, err
    assert main(["--run-dir", run, "--step", "2", "--source", "code", "--output", out]) == 0
    capsys.readouterr()
    assert main(["--run-dir", run, "--source", "code", "--output", out]) == 2  # an earlier export is kept
    assert "pass --overwrite" in capsys.readouterr().err
    assert json.load(open(os.path.join(out, "dept_export.json")))["step"] == 2
    assert main(["--run-dir", run, "--source", "code", "--output", out, "--overwrite"]) == 0  # replaced
    assert "(replacing the earlier export there)" in capsys.readouterr().out
    assert json.load(open(os.path.join(out, "dept_export.json")))["step"] == 4
    tokens, ours = refs["code"]
    _check_model(out, tokens, ours)


# ----------------------------------------------------------------------------- refusals, errors


@pytest.mark.parametrize("model,key", [
    ({"position_embedding": "learned"}, "model.position_embedding"),
    ({"normalization": "layernorm"}, "model.normalization"),
    ({"activation": "gelu"}, "model.activation"),
    (dict(MPT_MODEL, normalization="rmsnorm"), "model.normalization"),
    (dict(MPT_MODEL, activation="swiglu"), "model.activation"),
    (dict(MPT_MODEL, bias=True), "model.bias"),
    (dict(MPT_MODEL, num_query_groups=3), "model.num_query_groups"),
    (dict(MPT_MODEL, ffn_hidden_size=96), "model.ffn_hidden_size"),
])
def test_configurations_no_architecture_expresses_are_refused_naming_the_key(tmp_path, capsys, model, key):
    from dept_mega.config import load_config, save_config
    from dept_mega.export.convert import main
    run = str(tmp_path / "run")
    os.makedirs(run)
    save_config(load_config(os.path.join(ROOT, "examples/tiny/std.yaml"), config_overrides(run, model)),
                os.path.join(run, "config.yaml"))
    assert main(["--run-dir", run, "--source", "en", "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"error: config key '{key}'"), err


@pytest.mark.parametrize("model,want", [
    ({}, "none exact (config key 'model.norm_bias': true trains LayerNorm biases"),  # the schema's defaults
    (dict(MPT_MODEL, norm_bias=False), "exact, as MPT"),
    (MPT_MODEL, "none exact (config key 'model.norm_bias'"),
    ({"position_embedding": "rope", "normalization": "rmsnorm", "activation": "swiglu"}, "exact, as Llama"),
    ({"position_embedding": "rope", "normalization": "layernorm"}, "none exact (config key 'model.normalization'"),
    (dict(MPT_MODEL, bias=True), "none exact (config key 'model.bias'"),
])
def test_the_preflight_says_whether_the_model_exports(model, want):
    """Before training (--check, the launch's pre-flight): the architecture the model exports to,
    or why none does, naming the key (the LayerNorm biases' refusal otherwise comes at export)."""
    from dept_mega.config import ModelConfig
    from dept_mega.export.hf_mapping import export_line
    assert export_line(ModelConfig(**model)).startswith(f"export to Hugging Face: {want}")


def test_an_existing_output_is_replaced_only_with_overwrite_and_only_if_an_export(tmp_path, capsys):
    """Refused before anything is read: an earlier export without --overwrite, a directory that
    is not an export whatever the flag; with --overwrite the export goes on (and stops here at
    the run's missing checkpoint). --all-sources checks every source's directory first."""
    from dept_mega.config import load_config, save_config
    from dept_mega.export.convert import MARKER, main
    run = str(tmp_path / "run")
    os.makedirs(run)
    save_config(load_config(os.path.join(ROOT, "examples/tiny/std.yaml"), config_overrides(run)),
                os.path.join(run, "config.yaml"))
    earlier, other = tmp_path / "earlier", tmp_path / "other"
    for d, name in ((earlier, MARKER), (other, "notes.txt")):
        d.mkdir()
        (d / name).write_text("{}")
    capsys.readouterr()
    assert main(["--run-dir", run, "--source", "en", "--output", str(earlier)]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: --output {earlier} holds an earlier export ({MARKER}); pass --overwrite to replace it, "
                   f"or choose a new directory\n"), err
    for flags in ([], ["--overwrite"]):
        assert main(["--run-dir", run, "--source", "en", "--output", str(other), *flags]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--output {other} exists, is not empty and is not an earlier export" in err
    assert main(["--run-dir", run, "--source", "en", "--output", str(earlier), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "latest" in err and "--output" not in err, err  # past the output check: no checkpoint in this run
    assert os.listdir(earlier) == [MARKER] and os.listdir(other) == ["notes.txt"]  # nothing removed
    # --all-sources: the second source's directory holds an export: refused before the first is written
    (tmp_path / "all" / "ja").mkdir(parents=True)
    (tmp_path / "all" / "ja" / MARKER).write_text("{}")
    names = [s.name for s in load_config(os.path.join(run, "config.yaml")).data.sources]
    assert names.index("ja") > 0, names
    assert main(["--run-dir", run, "--all-sources", "--output", str(tmp_path / "all")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path / 'all' / 'ja'} holds an earlier export" in err, err
    assert sorted(os.listdir(tmp_path / "all")) == ["ja"]


def test_bad_run_directory_and_source_are_one_line_errors(tmp_path, capsys):
    from dept_mega.config import load_config, save_config
    from dept_mega.export.convert import main
    run = str(tmp_path / "run")
    assert main(["--run-dir", run, "--source", "en", "--output", str(tmp_path / "o")]) == 2
    assert "config.yaml" in capsys.readouterr().err
    os.makedirs(run)
    save_config(load_config(os.path.join(ROOT, "examples/tiny/std.yaml"), config_overrides(run)),
                os.path.join(run, "config.yaml"))
    assert main(["--run-dir", run, "--source", "en", "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "latest" in err, err
    assert main(["--run-dir", run, "--source", "xx", "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'xx'" in err, err
    # a federated group job's run directory holds its own sources only (group 0 of 2: en, ja, code)
    save_config(load_config(os.path.join(ROOT, "examples/tiny/spec.yaml"),
                            config_overrides(run) + ["federation.lighthouse=lh:1", "federation.group=0",
                                                     "federation.groups=2"]), os.path.join(run, "config.yaml"))
    assert main(["--run-dir", run, "--source", "fr", "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'fr' is trained by group job 1" in err and "group job 0's" in err, err
    assert main(["--run-dir", run, "--all-sources", "--output", str(tmp_path / "o")]) == 2
    assert "exported 0 of 3 sources before 'en' failed" in capsys.readouterr().err


# ----------------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("model", ["global", "en", "fr", "ja", "ru", "code"])
def test_tokenizer_encodes_and_decodes_like_ours(corpus, tmp_path, model):
    """On the sample corpus's documents (every language) the exported tokenizer decodes as
    ours and encodes to the same ids, except where two segmentations have exactly the same
    pieces in another order (a tie, e.g. inside a run of '-'): SentencePiece and tokenizers
    break such ties differently; both segmentations have the same probability."""
    from transformers import AutoTokenizer

    from dept_mega.data.tokenizer import load_tokenizer
    from dept_mega.export.hf_tokenizer import save_hf_tokenizer
    path = os.path.join(ROOT, "examples", "data", "build", "tok", f"{model}.model")
    save_hf_tokenizer(path, str(tmp_path))
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    ours = load_tokenizer(path)
    texts = [source_text(s, i) for s in ("en", "fr", "ja", "ru", "code") for i in range(12)]
    texts += ["", "  hello \t  world \n", "ﬁ Ｆｕｌｌ　ｗｉｄｔｈ 🙂 𝔘𝔫𝔦", "a\u00a0b\u200bc"]
    ties = 0
    for text in texts:
        a, b = ours.encode(text), hf.encode(text, add_special_tokens=False)
        if a != b:
            assert sorted(a) == sorted(b), f"{model}: {text[:60]!r} encodes differently"
            ties += 1
        assert hf.decode(a) == ours.decode(a)
    assert ties <= len(texts) // 10, ties
    assert hf.convert_tokens_to_ids(hf.eos_token) == ours.eos_id


def test_an_output_under_a_file_or_through_a_link_is_refused_first(tmp_path, capsys):
    """One line, before any weight is read: an --output below a file (--all-sources' FILE/name),
    and a symbolic link (replacing it would replace the link)."""
    from dept_mega.config import load_config, save_config
    from dept_mega.export.convert import main
    run = str(tmp_path / "run")
    os.makedirs(run)
    save_config(load_config(os.path.join(ROOT, "examples/tiny/std.yaml"), config_overrides(run)),
                os.path.join(run, "config.yaml"))
    (tmp_path / "afile").write_text("x")
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    capsys.readouterr()
    for args, why in ((["--all-sources", "--output", str(tmp_path / "afile")], "is a file, not a directory"),
                      (["--source", "en", "--output", str(tmp_path / "afile" / "x" / "y")], "is a file, not a directory"),
                      (["--source", "en", "--output", str(tmp_path / "link")], "is a symbolic link"),
                      (["--source", "en", "--output", str(tmp_path / "link") + os.sep], "is a symbolic link")):
        assert main(["--run-dir", run, *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and why in err, err
