"""Hugging Face → dept_mega: the model keys a Llama or MPT model needs, and its weights in our
layout — the exact inverse of :mod:`dept_mega.export.hf_mapping` (see there for why each
architecture is our model).

:func:`model_keys` reads the ``model:`` section off the Hugging Face config and refuses, naming
the config.json key, whatever our model cannot compute exactly:

* Llama: RoPE scaling (``rope_scaling`` / ``rope_parameters.rope_type`` other than default,
  ``partial_rotary_factor``), a ``head_dim`` other than hidden_size / heads, an activation
  other than SiLU, ``attention_bias`` ≠ ``mlp_bias`` (our ``model.bias`` is one flag).
* MPT: ``attn_config`` ``qk_ln``, ``clip_qkv``, ``softmax_scale`` other than 1/√head_dim,
  ``alibi`` off, ``alibi_bias_max`` ≠ 8 (our slopes are 2^(-8i/n); transformers' MPT ignores the
  key, the model was trained with it), ``attn_type`` other than multi-head, ``prefix_lm``,
  ``rope``; ``no_bias: false``, ``logit_scale``, ``expansion_ratio`` ≠ 4, ``norm_type`` other
  than a LayerNorm, ``learned_pos_emb`` with a position table in the weights.

:func:`weight_plan` lists, per tensor of our single-stage model (names as
``checkpoint_reader`` gives them), the Hugging Face tensors it is made of and how; the
vocabulary tables come with the Hugging Face vocabulary's rows (the importer pads them).
Every tensor of the files must be used (:func:`check_names`), so a model with more weights
than the config says is refused rather than imported without them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..config import ModelConfig

ALIBI_BIAS_MAX = 8  # our ALiBi slopes: 2^(-8 i / n) (dept_mega/model/positions.py)


class HFImportError(ValueError):
    """The Hugging Face model cannot be imported exactly (one line naming the key or tensor)."""


def _refuse(key: str, value: Any, why: str) -> HFImportError:
    return HFImportError(f"config.json key {key!r}: {value!r}: {why}; dept_mega's model cannot compute it, so no "
                         f"exact import exists")


def model_keys(model_type: str, conf: Any, raw: dict[str, Any]) -> dict[str, Any]:
    """The ``model`` keys (dotted, e.g. ``model.hidden_size``) that express the Hugging Face
    model (``conf``: its transformers config; ``raw``: config.json as written), with
    ``model.seq_length`` = its maximum positions and ``model.vocab_size`` = its vocabulary."""
    return {"llama": _llama_keys, "mpt": _mpt_keys}[model_type](conf, raw)


def _llama_keys(c: Any, raw: dict[str, Any]) -> dict[str, Any]:
    rope = dict(getattr(c, "rope_parameters", None) or {})
    if raw.get("rope_scaling"):
        raise _refuse("rope_scaling", raw["rope_scaling"], "RoPE scaling (dept_mega's RoPE is the plain one)")
    if rope.get("rope_type", "default") != "default":
        raise _refuse("rope_parameters.rope_type", rope["rope_type"], "RoPE scaling (dept_mega's RoPE is the plain one)")
    partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise _refuse("partial_rotary_factor", partial, "RoPE on part of each head (ours rotates the whole head)")
    if c.hidden_act != "silu":
        raise _refuse("hidden_act", c.hidden_act, "our swiglu gates with SiLU")
    if c.hidden_size % c.num_attention_heads:
        raise _refuse("num_attention_heads", c.num_attention_heads,
                      f"does not divide hidden_size {c.hidden_size} (our head dimension is hidden_size / heads)")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if head_dim != c.hidden_size // c.num_attention_heads:
        raise _refuse("head_dim", head_dim, f"our head dimension is hidden_size / heads = "
                                            f"{c.hidden_size // c.num_attention_heads}")
    if bool(c.attention_bias) != bool(c.mlp_bias):
        raise _refuse("mlp_bias", c.mlp_bias, f"with attention_bias {c.attention_bias}: model.bias is one flag "
                                              f"for every linear layer")
    theta = rope.get("rope_theta", getattr(c, "rope_theta", None))
    if theta is None:
        raise HFImportError("config.json: no rope_theta (nor rope_parameters.rope_theta)")
    return {"model.num_layers": c.num_hidden_layers, "model.hidden_size": c.hidden_size,
            "model.num_attention_heads": c.num_attention_heads,
            "model.num_query_groups": c.num_key_value_heads or c.num_attention_heads,
            "model.ffn_hidden_size": c.intermediate_size, "model.activation": "swiglu",
            "model.normalization": "rmsnorm", "model.position_embedding": "rope",
            "model.seq_length": c.max_position_embeddings, "model.tie_embeddings": bool(c.tie_word_embeddings),
            "model.norm_eps": float(c.rms_norm_eps), "model.rope_theta": float(theta),
            "model.bias": bool(c.attention_bias), "model.vocab_size": c.vocab_size}


def _mpt_keys(c: Any, raw: dict[str, Any]) -> dict[str, Any]:
    attn = raw.get("attn_config") or {}  # as written: transformers' MPT ignores some keys the model was trained with
    checks = [("attn_config.qk_ln", attn.get("qk_ln", False), lambda v: not v, "LayerNorm on queries and keys"),
              ("attn_config.clip_qkv", attn.get("clip_qkv"), lambda v: v is None, "clipping of q, k and v"),
              ("attn_config.alibi", attn.get("alibi", True), bool, "no position information at all (ours: ALiBi)"),
              ("attn_config.alibi_bias_max", attn.get("alibi_bias_max", ALIBI_BIAS_MAX),
               lambda v: v == ALIBI_BIAS_MAX, f"ALiBi slopes 2^(-v·i/n) with v ≠ {ALIBI_BIAS_MAX} (ours: "
                                              f"{ALIBI_BIAS_MAX}; transformers' MPT ignores the key)"),
              ("attn_config.attn_type", attn.get("attn_type", "multihead_attention"),
               lambda v: v == "multihead_attention", "other than multi-head attention"),
              ("attn_config.prefix_lm", attn.get("prefix_lm", False), lambda v: not v, "a prefix-LM attention mask"),
              ("attn_config.rope", attn.get("rope", False), lambda v: not v, "RoPE inside MPT (ours: ALiBi)"),
              ("no_bias", raw.get("no_bias", True), bool, "MPT with biases (transformers' MPT has none)"),
              ("logit_scale", raw.get("logit_scale"), lambda v: v is None or v == 1, "scaled logits"),
              ("expansion_ratio", raw.get("expansion_ratio", 4), lambda v: v == 4,
               "an MLP width other than 4 × d_model (transformers' MPT and our export: 4)"),
              ("norm_type", raw.get("norm_type", "low_precision_layernorm"),
               lambda v: v in ("layernorm", "low_precision_layernorm"), "a norm other than LayerNorm")]
    for key, value, ok, why in checks:
        if not ok(value):
            raise _refuse(key, value, why)
    n = c.n_heads
    if c.d_model % n:
        raise _refuse("n_heads", n, f"does not divide d_model {c.d_model}")
    scale = attn.get("softmax_scale")
    if scale is not None and not math.isclose(float(scale), 1 / math.sqrt(c.d_model // n), rel_tol=1e-6):
        raise _refuse("attn_config.softmax_scale", scale, f"a softmax scale other than 1/sqrt(head_dim) = "
                                                          f"{1 / math.sqrt(c.d_model // n):.6g}")
    return {"model.num_layers": c.n_layers, "model.hidden_size": c.d_model, "model.num_attention_heads": n,
            "model.num_query_groups": n, "model.ffn_hidden_size": 4 * c.d_model, "model.activation": "gelu",
            "model.normalization": "layernorm", "model.position_embedding": "alibi",
            "model.seq_length": c.max_seq_len, "model.tie_embeddings": bool(getattr(c, "tie_word_embeddings", True)),
            "model.norm_eps": float(c.layer_norm_epsilon), "model.bias": False, "model.norm_bias": False,
            "model.vocab_size": c.vocab_size}


# ------------------------------------------------------------------------------------ weights


@dataclass
class Piece:
    """One tensor of our model: made of the Hugging Face tensors ``sources`` by ``combine``."""
    name: str
    sources: tuple[str, ...]
    combine: Callable[..., torch.Tensor]


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: ModelConfig) -> torch.Tensor:
    """q, k, v rows in head order → our fused QKV rows (per query group g: its q heads, its k
    head, its v head): the inverse of ``hf_mapping._split_qkv``."""
    G, hd = m.query_groups, m.head_dim
    qpg = m.num_attention_heads // G
    rest = tuple(q.shape[1:])
    x = torch.cat([q.reshape(G, qpg, hd, *rest), k.reshape(G, 1, hd, *rest), v.reshape(G, 1, hd, *rest)], dim=1)
    return x.reshape(G * (qpg + 2) * hd, *rest).contiguous()


#: per architecture, the Hugging Face names of the token table and the final norm
TABLE_AND_NORM = {"llama": ("model.embed_tokens.weight", "model.norm.weight"),
                  "mpt": ("transformer.wte.weight", "transformer.norm_f.weight")}
HEAD = "lm_head.weight"  # the output head, in both


def weight_plan(m: ModelConfig, model_type: str) -> list[Piece]:
    """Our tensors and the Hugging Face tensors each is made of (``m``: the checked model keys)."""
    table, norm = TABLE_AND_NORM[model_type]
    out = [Piece("embeddings.word_embeddings.weight", (table,), _same),
           Piece("body.final_norm.weight", (norm,), _same)]
    if not m.tie_embeddings:
        out.append(Piece("embeddings.output_layer.weight", (HEAD,), _same))
    return out + {"llama": _llama_layers, "mpt": _mpt_layers}[model_type](m)


def _llama_layers(m: ModelConfig) -> list[Piece]:
    out: list[Piece] = []
    for i in range(m.num_layers):
        src, dst = f"model.layers.{i}", f"body.layers.{i}"
        out += [Piece(f"{dst}.input_norm.weight", (f"{src}.input_layernorm.weight",), _same),
                Piece(f"{dst}.mlp_norm.weight", (f"{src}.post_attention_layernorm.weight",), _same)]
        for kind in ("weight", "bias") if m.bias else ("weight",):
            att = f"{src}.self_attn"
            out += [Piece(f"{dst}.attention.qkv.{kind}", (f"{att}.q_proj.{kind}", f"{att}.k_proj.{kind}",
                                                          f"{att}.v_proj.{kind}"),
                          lambda q, k, v: fuse_qkv(q, k, v, m)),
                    Piece(f"{dst}.attention.proj.{kind}", (f"{att}.o_proj.{kind}",), _same),
                    Piece(f"{dst}.mlp.fc1.{kind}", (f"{src}.mlp.gate_proj.{kind}", f"{src}.mlp.up_proj.{kind}"),
                          lambda gate, up: torch.cat([gate, up], dim=0)),
                    Piece(f"{dst}.mlp.fc2.{kind}", (f"{src}.mlp.down_proj.{kind}",), _same)]
    return out


def _mpt_layers(m: ModelConfig) -> list[Piece]:
    out: list[Piece] = []
    for i in range(m.num_layers):
        src, dst = f"transformer.blocks.{i}", f"body.layers.{i}"
        out += [Piece(f"{dst}.input_norm.weight", (f"{src}.norm_1.weight",), _same),
                Piece(f"{dst}.attention.qkv.weight", (f"{src}.attn.Wqkv.weight",),
                      lambda w: fuse_qkv(*w.chunk(3, dim=0), m)),
                Piece(f"{dst}.attention.proj.weight", (f"{src}.attn.out_proj.weight",), _same),
                Piece(f"{dst}.mlp_norm.weight", (f"{src}.norm_2.weight",), _same),
                Piece(f"{dst}.mlp.fc1.weight", (f"{src}.ffn.up_proj.weight",), _same),
                Piece(f"{dst}.mlp.fc2.weight", (f"{src}.ffn.down_proj.weight",), _same)]
    return out


def tied_copy(model_type: str) -> tuple[str, str]:
    """(the output head's name, the token table's): a tied model's file may hold the head too,
    as a copy of the table."""
    return HEAD, TABLE_AND_NORM[model_type][0]


def ignorable(name: str) -> bool:
    """Tensors older checkpoints carry that are no weights: RoPE's inverse frequencies (derived
    from rope_theta)."""
    return name.endswith(".rotary_emb.inv_freq")


def check_names(plan: list[Piece], names: list[str], model_type: str, tied: bool) -> list[str]:
    """An :class:`HFImportError` naming the first tensor the plan needs that the files lack, or
    that the files hold and the plan does not use; returns the ignored ones."""
    need = {s for p in plan for s in p.sources}
    have = set(names)
    missing = sorted(need - have)
    if missing:
        raise HFImportError(f"the weights lack {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1
                                                                  else "") + " that config.json's model has")
    head, _ = tied_copy(model_type)
    extra = sorted(n for n in have - need if not ignorable(n) and not (tied and n == head))
    if extra:
        raise HFImportError(f"the weights hold {extra[0]!r}" + (f" (and {len(extra) - 1} more)" if len(extra) > 1
                                                                else "") + ", which config.json's model (as dept_mega "
                            "expresses it) has no place for; refused rather than imported without it")
    return sorted(n for n in have - need)
