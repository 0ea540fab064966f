"""tools/convert_from_hf.py: a Hugging Face Llama / MPT model as a dept_mega run directory that
``train.init_from`` starts runs from.

* the mapping is the exact inverse of the export's (random weights, every Llama option);
* a trained run exported and imported back holds the trained weights bit for bit (fp32), and
  runs started from either have the same first loss;
* a Hugging Face model we did not write (random, every norm weight random too; sharded
  safetensors and a pytorch_model.bin) gives its own logits in our model;
* a config whose model keys differ is refused naming the keys; what our model cannot compute
  is refused naming the config.json key; so are tensors the config has no place for."""
from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import pytest
import torch
import yaml

from tests.trainer_utils import read_jsonl

TOL = 1e-4
LLAMA = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
         "ffn_hidden_size": 64, "activation": "swiglu", "normalization": "rmsnorm", "position_embedding": "rope",
         "tie_embeddings": True, "bias": False, "rope_theta": 5000.0}
MPT = {"num_layers": 2, "position_embedding": "alibi", "normalization": "layernorm", "activation": "gelu",
       "num_attention_heads": 6, "num_query_groups": 6, "hidden_size": 48, "ffn_hidden_size": 192,
       "bias": False, "norm_bias": False, "tie_embeddings": False}


def _over(model: dict) -> list[str]:
    return [f"model.{k}={json.dumps(v)}" for k, v in model.items()]


def _import(*args: str) -> tuple[int, str, str]:
    import contextlib
    import io

    from dept_mega.export.import_run import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return rc, out.getvalue(), err.getvalue()


# ----------------------------------------------------------------------------- the mapping


@pytest.mark.parametrize("model", [LLAMA, dict(LLAMA, bias=True, tie_embeddings=False),
                                   dict(LLAMA, num_query_groups=1), MPT])
@pytest.mark.slow
def test_the_mapping_is_the_exact_inverse_of_the_export(model):
    """Our weights (random, tables of 200 rows padded to 256) → to_hf → the import's plan:
    every tensor back bit for bit (the tables' first 200 rows)."""
    from dept_mega.config import config_from_dict
    from dept_mega.export.hf_import import weight_plan
    from dept_mega.export.hf_mapping import to_hf
    from dept_mega.model import build_model
    from dept_mega.parallel.groups import build_groups
    cfg = config_from_dict({"model": dict(model, vocab_size=200), "dept": {"variant": "std"}, "precision": "fp32"})
    torch.manual_seed(0)
    stage = build_model(cfg, build_groups(1, 1, 1), 200, 0, "cpu")[0]
    ours = {n: p.detach().clone() for n, p in stage.named_parameters()}
    for n, t in ours.items():  # norms start at one / zero: make every tensor distinct
        t.copy_(torch.randn_like(t))
    hf = to_hf(cfg, ours, 200).state_dict
    plan = weight_plan(cfg.model, "llama" if model["position_embedding"] == "rope" else "mpt")
    assert {s for p in plan for s in p.sources} == set(hf)
    assert {p.name for p in plan} == set(ours)
    for piece in plan:
        back = piece.combine(*(hf[s] for s in piece.sources))
        want = ours[piece.name][:200] if piece.name.startswith("embeddings.") else ours[piece.name]
        assert torch.equal(back, want), piece.name


# ----------------------------------------------------------------------------- round trip of a trained run


def _first_loss(cfg: str, model: list[str], run: str, init_from: Optional[str], *more: str) -> float:
    from tests.test_train_cli import _train_here
    r = _train_here("--config", cfg, *model, "train.steps=1", "train.log_interval=1", "train.eval_interval=0",
                    "train.eval_iters=0", "train.save_interval=0", f"train.run_dir={run}",
                    f"train.init_from={json.dumps(init_from)}", *more)
    assert r.returncode == 0, r.stderr
    return [x for x in read_jsonl(os.path.join(run, "metrics.jsonl")) if x["kind"] == "train"][0]["loss"]


@pytest.mark.parametrize("arch,model", [("llama", LLAMA), ("mpt", MPT)])
def test_a_trained_run_exported_and_imported_back_is_bit_for_bit_the_same(tmp_path, arch, model):
    """STD run (SentencePiece tokenizer, 2 steps) → convert_to_hf → convert_from_hf: every
    weight equal in fp32, the padding rows zero; exporting the import gives the same Hugging
    Face tensors; a run started from the import has the first loss of one started from the
    original (std, and trim, which takes its global table φ from the shared table)."""
    from safetensors.torch import load_file

    from dept_mega.data.tokenizer import load_tokenizer
    from dept_mega.export.checkpoint_reader import read_full_weights
    from dept_mega.export.convert import main as export
    from tests.test_train_cli import _setup, _train_here
    cfg = _setup(tmp_path, variant="std")
    over = _over(model)
    run, hf, out = str(tmp_path / "run"), str(tmp_path / "hf"), str(tmp_path / "imported")
    r = _train_here("--config", cfg, *over, "train.steps=2", "train.eval_interval=0", "train.eval_iters=0",
                    "train.save_interval=0", f"train.run_dir={run}")
    assert r.returncode == 0, r.stderr
    assert export(["--run-dir", run, "--source", "a", "--output", hf]) == 0
    rc, said, err = _import("--hf-dir", hf, "--config", cfg, *over, "--run-dir", out)
    assert rc == 0, err
    assert said.startswith(f"imported {hf} ({arch}, ") and "note:" not in said, said  # the same tokenizer file
    vocab = load_tokenizer(yaml.safe_load(open(cfg))["data"]["tokenizer"]).vocab_size
    a, b = read_full_weights(run), read_full_weights(out)
    assert set(a) == set(b) and a.step == 2 and b.step == 0
    for name in a:
        if name.startswith("embeddings."):
            assert torch.equal(a[name][:vocab], b[name][:vocab]), name
            assert b[name].shape == a[name].shape and not b[name][vocab:].any(), name
        else:
            assert torch.equal(a[name], b[name]), name
    assert export(["--run-dir", out, "--source", "a", "--output", str(tmp_path / "hf2")]) == 0
    first, again = load_file(os.path.join(hf, "model.safetensors")), load_file(str(tmp_path / "hf2" / "model.safetensors"))
    assert set(first) == set(again) and all(torch.equal(first[k], again[k]) for k in first)
    for variant in ("std", "trim"):
        v = [f"dept.variant={variant}", "dept.local_steps=1"]
        want = _first_loss(cfg, over, str(tmp_path / f"from_run_{variant}"), run, *v)
        got = _first_loss(cfg, over, str(tmp_path / f"from_import_{variant}"), out, *v)
        assert got == want, (variant, got, want)
    fresh = _first_loss(cfg, over, str(tmp_path / "fresh"), None)
    assert fresh != want  # the weights did come from the checkpoints


# ----------------------------------------------------------------------------- someone else's model


def _random_hf(path: str, arch: str, fmt: str = "safetensors", **conf) -> None:
    """A random transformers model saved to ``path`` (norm weights random too)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MptConfig, MptForCausalLM
    torch.manual_seed(1)
    if arch == "llama":
        c = dict(vocab_size=200, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=5000.0, max_position_embeddings=64,
                 tie_word_embeddings=True)
        c.update(conf)
        model = LlamaForCausalLM(LlamaConfig(**c))
    else:
        c = dict(d_model=48, n_heads=6, n_layers=2, max_seq_len=64, vocab_size=200, no_bias=True,
                 learned_pos_emb=False, tie_word_embeddings=False,
                 attn_config={"alibi": True, "alibi_bias_max": 8, "qk_ln": False, "clip_qkv": None})
        c.update(conf)
        model = MptForCausalLM(MptConfig(**c))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or "layernorm" in n:
                p.copy_(1 + 0.5 * torch.randn_like(p))
    if fmt == "bin":  # an older checkpoint: pytorch_model.bin
        os.makedirs(path, exist_ok=True)
        model.config.save_pretrained(path)
        torch.save(model.state_dict(), os.path.join(path, "pytorch_model.bin"))
    else:
        model.save_pretrained(path, max_shard_size="40KB" if fmt == "sharded" else "5GB")


def _config_for(tmp_path, section: str) -> str:
    """A std config whose model is ``--print-model-config``'s section (no tokenizer)."""
    model = yaml.safe_load(section)["model"]
    model["seq_length"] = 16
    cfg = {"model": model, "precision": "fp32", "backend": "local", "dept": {"variant": "std"},
           "data": {"tokenizer": None}, "train": {"run_dir": str(tmp_path / "unused"), "micro_batch_size": 1,
                                                   "global_batch_size": 1}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.parametrize("arch,fmt,conf", [("llama", "sharded", {"attention_bias": True, "mlp_bias": True,
                                                                   "tie_word_embeddings": False}),
                                           ("llama", "bin", {}), ("mpt", "safetensors", {})])
def test_a_hugging_face_model_gives_its_logits_in_ours(tmp_path, arch, fmt, conf):
    """--print-model-config's section as the config; the import started from with
    train.init_from (tensor parallel 2 too): our logits are the Hugging Face model's."""
    from transformers import AutoModelForCausalLM

    from dept_mega.config import load_config
    from dept_mega.init_from import init_from
    from dept_mega.parallel.groups import build_groups
    from dept_mega.trainer import Trainer
    from tests.export_utils import full_logits
    hf, out = str(tmp_path / "hf"), str(tmp_path / "imported")
    _random_hf(hf, arch, fmt, **conf)
    if fmt == "sharded":
        assert os.path.exists(os.path.join(hf, "model.safetensors.index.json"))
    rc, section, err = _import("--hf-dir", hf, "--print-model-config")
    assert rc == 0, err
    cfg_path = _config_for(tmp_path, section)
    rc, said, err = _import("--hf-dir", hf, "--config", cfg_path, "--run-dir", out)
    assert rc == 0, err
    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()(input_ids=tokens).logits
    cfg = load_config(cfg_path, [f"train.init_from={out}"])
    trainer = Trainer(cfg, build_groups(1, 1, 1), torch.device("cpu"), vocab_size=200)
    init_from(trainer, cfg, torch.device("cpu"))
    got = full_logits(trainer, trainer.pg, tokens)
    assert torch.isinf(got[..., 200:]).all()
    diff = float((got[..., :200].double() - want.double()).abs().max())
    assert diff <= TOL, diff
    info = json.load(open(os.path.join(out, "hf_import.json")))
    assert info["model_type"] == arch and info["vocab_size"] == 200
    if fmt == "sharded":  # another layout starts from it: each rank reads its half of every sharded tensor
        from tests.mp_utils import run_distributed
        from tests.test_init_from import _worker
        for r in run_distributed(_worker, 2, args=(cfg_path, out, ["parallel.tensor=2"])):
            assert r["equal"] and all(r["equal"]) and r["step"] == 0, r


# ----------------------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def base_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    for arch in ("llama", "mpt"):
        _random_hf(str(root / arch), arch)
    return root


def _edited(base, tmp_path, arch: str, edit: dict) -> str:
    path = str(tmp_path / f"{arch}_edited")
    shutil.copytree(base / arch, path)
    conf = json.load(open(os.path.join(path, "config.json")))
    for k, v in edit.items():
        if isinstance(v, dict) and isinstance(conf.get(k), dict):
            conf[k].update(v)
        else:
            conf[k] = v
    json.dump(conf, open(os.path.join(path, "config.json"), "w"))
    return path


@pytest.mark.parametrize("arch,edit,key", [
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_parameters.rope_type"),
    ("llama", {"head_dim": 16}, "head_dim"),
    ("llama", {"mlp_bias": True}, "mlp_bias"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    ("mpt", {"attn_config": {"qk_ln": True}}, "attn_config.qk_ln"),
    ("mpt", {"attn_config": {"clip_qkv": 8.0}}, "attn_config.clip_qkv"),
    ("mpt", {"attn_config": {"alibi_bias_max": 16}}, "attn_config.alibi_bias_max"),
    ("mpt", {"attn_config": {"softmax_scale": 0.5}}, "attn_config.softmax_scale"),
    ("mpt", {"no_bias": False}, "no_bias"),
    ("mpt", {"logit_scale": 0.5}, "logit_scale"),
])
def test_what_our_model_cannot_compute_is_refused_naming_the_key(base_dirs, tmp_path, arch, edit, key):
    path = _edited(base_dirs, tmp_path, arch, edit)
    rc, _, err = _import("--hf-dir", path, "--print-model-config")
    assert rc == 2 and err.startswith(f"error: config.json key '{key}': ") and err.count("\n") == 1, err
    assert "no exact import" in err


@pytest.mark.parametrize("arch,edit,why", [
    ("llama", {"model_type": "mistral"}, "model_type 'mistral'"),
    ("llama", {"quantization_config": {"quant_method": "gptq"}}, "a quantised model"),
])
def test_other_architectures_are_refused(base_dirs, tmp_path, arch, edit, why):
    rc, _, err = _import("--hf-dir", _edited(base_dirs, tmp_path, arch, edit), "--print-model-config")
    assert rc == 2 and why in err and err.count("\n") == 1, err


@pytest.mark.parametrize("damage", ["index names the wrong shard", "shard cut short", "bin index names the wrong shard"])
def test_damaged_sharded_weights_are_one_line_naming_the_file_and_tensor(base_dirs, tmp_path, damage):
    """A sharded model whose index places a tensor in a shard that lacks it (a mismatched
    download), or a shard cut short: one ``error:`` line naming the shard (and the tensor)."""
    from safetensors.torch import load_file
    path = str(tmp_path / "sharded")
    shutil.copytree(base_dirs / "llama", path)
    weights = load_file(os.path.join(path, "model.safetensors"))
    os.remove(os.path.join(path, "model.safetensors"))
    names = sorted(weights)
    half = {n: ("a" if i % 2 else "b") for i, n in enumerate(names)}
    bin_ = damage.startswith("bin")
    ext, index = ("bin", "pytorch_model.bin.index.json") if bin_ else ("safetensors", "model.safetensors.index.json")
    for part in ("a", "b"):
        sd = {n: weights[n].clone() for n in names if half[n] == part}
        if bin_:
            torch.save(sd, os.path.join(path, f"part_{part}.bin"))
        else:
            from safetensors.torch import save_file
            save_file(sd, os.path.join(path, f"part_{part}.safetensors"))
    weight_map = {n: f"part_{half[n]}.{ext}" for n in names}
    victim = "model.norm.weight"
    if "wrong shard" in damage:
        weight_map[victim] = f"part_{'b' if half[victim] == 'a' else 'a'}.{ext}"
        bad = weight_map[victim]
    else:
        bad = weight_map[victim]
        full = os.path.join(path, bad)
        with open(full, "r+b") as f:
            f.truncate(os.path.getsize(full) - 64)
    json.dump({"metadata": {}, "weight_map": weight_map}, open(os.path.join(path, index), "w"))
    rc, _, err = _import("--hf-dir", path, "--print-model-config")
    assert rc == 2 and err.startswith(f"error: {os.path.join(path, bad)}: ") and err.count("\n") == 1, err
    if "wrong shard" in damage:
        assert f"tensor {victim!r} cannot be read (named by {index}" in err, err


def test_the_command_line(base_dirs, monkeypatch, capsys):
    """tools/convert_from_hf.py as ``python tools/convert_from_hf.py ARGS`` runs it (its lines run as
    ``__main__`` in this process: a process of its own would only add its imports, torch's and
    transformers', ~5 s of CPU): --print-model-config needs only --hf-dir; an import needs
    --config and --run-dir (else argparse's usage error, exit status 2)."""
    from tests.trainer_utils import ROOT, run_script
    tool = os.path.join(ROOT, "tools", "convert_from_hf.py")
    capsys.readouterr()
    assert run_script(tool, "--hf-dir", str(base_dirs / "mpt"), "--print-model-config", monkeypatch=monkeypatch) == 0
    out = capsys.readouterr()
    model = yaml.safe_load(out.out)["model"]
    assert (model["position_embedding"], model["num_attention_heads"], model["norm_bias"]) == ("alibi", 6, False)
    assert run_script(tool, "--hf-dir", str(base_dirs / "mpt"), "--run-dir", "x", monkeypatch=monkeypatch) == 2
    assert "--config" in capsys.readouterr().err  # argparse's usage error


def test_a_config_of_another_model_is_refused_naming_every_key(base_dirs, tmp_path):
    hf = str(base_dirs / "llama")
    cfg = _config_for(tmp_path, _import("--hf-dir", hf, "--print-model-config")[1])
    out = str(tmp_path / "out")
    rc, _, err = _import("--hf-dir", hf, "--config", cfg, "model.norm_eps=1e-5", "--run-dir", out)
    assert rc == 2 and err == (f"error: config key 'model.norm_eps' differs from the Hugging Face model {hf}: the "
                               "Hugging Face model has 1e-06, this config has 1e-05; print the matching model section "
                               "with --print-model-config\n"), err
    rc, _, err = _import("--hf-dir", hf, "--config", cfg, "model.num_query_groups=4", "model.tie_embeddings=false",
                         "model.vocab_size=256", "--run-dir", out)
    assert rc == 2 and err.startswith("error: 3 config keys differ from the Hugging Face model"), err
    for line in ("config key 'model.num_query_groups': the Hugging Face model has 2, this config has 4",
                 "config key 'model.tie_embeddings': the Hugging Face model has True, this config has False",
                 "config key 'model.vocab_size': the Hugging Face model has a vocabulary of 200, this config has 256"):
        assert line in err, err
    rc, _, err = _import("--hf-dir", hf, "--config", cfg, "dept.variant=spec_opt", "--run-dir", out)
    assert rc == 2 and err.startswith("error: config key 'dept.variant': 'spec_opt'"), err
    assert not os.path.exists(out)


def test_tensors_the_config_has_no_place_for_are_refused(base_dirs, tmp_path):
    from safetensors.torch import load_file, save_file
    hf = str(tmp_path / "hf")
    shutil.copytree(base_dirs / "llama", hf)
    cfg = _config_for(tmp_path, _import("--hf-dir", hf, "--print-model-config")[1])
    weights = load_file(os.path.join(hf, "model.safetensors"))
    weights["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)
    save_file(weights, os.path.join(hf, "model.safetensors"))
    rc, _, err = _import("--hf-dir", hf, "--config", cfg, "--run-dir", str(tmp_path / "out"))
    assert rc == 2 and "the weights hold 'model.layers.0.self_attn.q_norm.weight'" in err, err
    del weights["model.layers.0.self_attn.q_norm.weight"], weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, os.path.join(hf, "model.safetensors"))
    rc, _, err = _import("--hf-dir", hf, "--config", cfg, "--run-dir", str(tmp_path / "out"))
    assert rc == 2 and "the weights lack 'model.layers.1.mlp.up_proj.weight'" in err, err
    assert not os.path.exists(tmp_path / "out")
    # a tied model's file may hold the head as a copy of the table, and RoPE's inverse frequencies
    weights = load_file(os.path.join(base_dirs / "llama", "model.safetensors"))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(weights, os.path.join(hf, "model.safetensors"))
    rc, _, err = _import("--hf-dir", hf, "--config", cfg, "--run-dir", str(tmp_path / "out"))
    assert rc == 0, err
    info = json.load(open(tmp_path / "out" / "hf_import.json"))
    assert info["ignored_tensors"] == ["lm_head.weight", "model.layers.0.self_attn.rotary_emb.inv_freq"]
    weights["lm_head.weight"][0, 0] += 1  # a head that is no copy: the model is not tied
    save_file(weights, os.path.join(hf, "model.safetensors"))
    rc, _, err = _import("--hf-dir", hf, "--config", cfg, "--run-dir", str(tmp_path / "out2"))
    assert rc == 2 and err.startswith("error: lm_head.weight differs from model.embed_tokens.weight, but the model "
                                      "ties them"), err
    assert not os.path.exists(tmp_path / "out2")


def test_the_run_directory_is_new_or_an_earlier_import_and_is_not_a_run_to_continue(base_dirs, tmp_path):
    from tests.test_train_cli import _train_here
    hf = str(base_dirs / "llama")
    cfg = _config_for(tmp_path, _import("--hf-dir", hf, "--print-model-config")[1])
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    rc, _, err = _import("--hf-dir", hf, "--config", cfg, "--run-dir", str(other), "--overwrite")
    assert rc == 2 and "is not an earlier import (no hf_import.json)" in err, err
    out = str(tmp_path / "out")
    assert _import("--hf-dir", hf, "--config", cfg, "--run-dir", out)[0] == 0
    rc, _, err = _import("--hf-dir", hf, "--config", cfg, "--run-dir", out)
    assert rc == 2 and "holds an earlier import (hf_import.json); pass --overwrite" in err, err
    rc, said, _ = _import("--hf-dir", hf, "--config", cfg, "--run-dir", out, "--overwrite")
    assert rc == 0 and "(replacing the earlier import there)" in said
    assert sorted(os.listdir(tmp_path)) == sorted(["cfg.yaml", "other", "out"])  # no temporary left
    r = _train_here("--config", cfg, "train.steps=1", f"train.run_dir={out}")
    assert r.returncode == 2 and "config key 'train.run_dir'" in r.stderr and "train.init_from" in r.stderr, r.stderr
    saved = yaml.safe_load(open(os.path.join(out, "config.yaml")))
    assert (saved["dept"]["variant"], saved["train"]["run_dir"], saved["precision"]) == ("std", out, "fp32")
