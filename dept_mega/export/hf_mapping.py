"""Which Hugging Face ``transformers`` architecture expresses a dept_mega model, and the weights
in its layout.

Our model (dept_mega/model): pre-norm blocks ``x + attn(norm(x))``, ``x + mlp(norm(x))``, a
final norm, no norm after the embedding, softmax scale 1/sqrt(head_dim), the same ``model.bias``
flag for every linear layer, LayerNorm with a (trained) bias unless ``model.norm_bias: false``,
RMSNorm without one.

* ``rope`` + ``rmsnorm`` + ``swiglu`` (MHA or GQA, tied or untied head, ``model.bias`` on or
  off) → **Llama** (``LlamaForCausalLM``): RoPE in the rotate-half convention on the natural
  head dimension (ours too: q/k weights need no permutation), θ = ``model.rope_theta``;
  ``attention_bias`` = ``mlp_bias`` = ``model.bias``; the fused QKV (grouped by query group:
  [q heads; k; v] per group) splits into q/k/v_proj, fc1 = [gate; up] into gate/up_proj.
* ``alibi`` + ``layernorm`` + ``gelu`` → **MPT** (``MptForCausalLM``) — the only one of MPT,
  BLOOM and Falcon that can express it, and only partly:
  - MPT: exact GELU, no embedding norm, ALiBi slopes 2^(-8i/n) with the same order for head
    counts that are not powers of two (the next power's odd-indexed slopes, then the even
    ones = ours), scale 1/sqrt(head_dim), fused QKV as [all q; all k; all v], tied or untied
    head. But it has NO biases at all: LayerNorm without bias, linear layers without bias,
    MLP width fixed at 4·hidden, multi-head attention only.
  - BLOOM: LayerNorm after the embedding and tanh-approximated GELU: never our model.
  - Falcon (``alibi: true``): the ALiBi bias is scaled by 1/sqrt(head_dim) with the scores
    (and its slopes are rounded to bf16): never our model.
  So an ALiBi model exports to MPT only with ``model.bias: false``, ``num_query_groups`` =
  ``num_attention_heads``, ``ffn_hidden_size`` = 4·``hidden_size`` AND LayerNorm without
  bias: train with ``model.norm_bias: false`` (as examples/1b does). A checkpoint whose
  LayerNorm biases were trained is refused, naming ``model.norm_bias``, unless those biases
  stayed exactly zero.
* ``learned`` positions and every other combination → refused, naming the config key.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..config import Config, ModelConfig


#: exported MPT's ``max_seq_len`` = this × ``model.seq_length``. transformers' MPT builds its
#: ALiBi bias for ``max_seq_len`` keys at every forward and fails on a longer input (prompt
#: plus generated tokens), while our ALiBi model has no length limit. The bias is relative
#: (the last keys' columns are taken), so a larger value leaves every logit unchanged; it
#: costs heads × max_seq_len floats per forward (32 heads × 16k: 2 MB), nothing quadratic.
#: 8× covers the extrapolation ALiBi is known for (Press et al. 2022 train short, test a few
#: times longer); past it quality, not the code, is the limit, and a user may raise it in
#: config.json.
MPT_LENGTH_FACTOR = 8


class ExportError(ValueError):
    """The model cannot be exported: one line naming the config key (or file) and why."""


@dataclass
class HFExport:
    architecture: str  # "llama" | "mpt"
    config: Any  # a transformers PretrainedConfig
    state_dict: dict[str, torch.Tensor]
    model_class: Any  # the transformers *ForCausalLM class


def architecture_for(m: ModelConfig) -> str:
    """"llama" or "mpt", or an :class:`ExportError` naming the first key no architecture expresses."""
    if m.position_embedding == "rope":
        if m.normalization != "rmsnorm":
            raise ExportError(f"config key 'model.normalization': {m.normalization!r} with rope: only "
                              f"rope + rmsnorm + swiglu maps to an architecture (Llama)")
        if m.activation != "swiglu":
            raise ExportError(f"config key 'model.activation': {m.activation!r} with rope: only "
                              f"rope + rmsnorm + swiglu maps to an architecture (Llama)")
        return "llama"
    if m.position_embedding == "alibi":
        if m.normalization != "layernorm":
            raise ExportError(f"config key 'model.normalization': {m.normalization!r} with alibi: only "
                              f"alibi + layernorm + gelu maps to an architecture (MPT)")
        if m.activation != "gelu":
            raise ExportError(f"config key 'model.activation': {m.activation!r} with alibi: only "
                              f"alibi + layernorm + gelu maps to an architecture (MPT)")
        if m.bias:
            raise ExportError("config key 'model.bias': true, but MPT (the only architecture with our ALiBi, "
                              "exact GELU and no embedding norm) has no linear-layer biases")
        if m.query_groups != m.num_attention_heads:
            raise ExportError(f"config key 'model.num_query_groups': {m.query_groups} query groups for "
                              f"{m.num_attention_heads} heads, but MPT has multi-head attention only")
        if m.ffn_size != 4 * m.hidden_size:
            raise ExportError(f"config key 'model.ffn_hidden_size': {m.ffn_size}, but MPT's MLP is "
                              f"4 × hidden_size = {4 * m.hidden_size}")
        return "mpt"
    raise ExportError(f"config key 'model.position_embedding': {m.position_embedding!r} maps to no "
                      f"supported architecture (alibi → MPT, rope → Llama)")


def export_line(m: ModelConfig) -> str:
    """The pre-flight's word on exporting the trained model to Hugging Face ``transformers``
    exactly (``tools/convert_to_hf.py``): the architecture it maps to, or why none does and what to
    set, known before training (the LayerNorm biases' refusal otherwise comes only at export)."""
    try:
        arch = architecture_for(m)
    except ExportError as exc:
        return f"export to Hugging Face: none exact ({exc})"
    if arch == "mpt" and m.norm_bias:
        return ("export to Hugging Face: none exact (config key 'model.norm_bias': true trains LayerNorm biases, "
                "which MPT, the only architecture with our ALiBi, lacks; set model.norm_bias: false to export)")
    return f"export to Hugging Face: exact, as {'Llama' if arch == 'llama' else 'MPT'} (tools/convert_to_hf.py)"


def _split_qkv(w: torch.Tensor, m: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our fused QKV rows (per query group g: its q heads, its k head, its v head) → q, k, v
    rows in head order (q head j belongs to group j // (heads / groups), as in Llama/MPT)."""
    G, hd = m.query_groups, m.head_dim
    qpg = m.num_attention_heads // G
    x = w.reshape(G, qpg + 2, hd, *w.shape[1:])
    q = x[:, :qpg].reshape(G * qpg * hd, *w.shape[1:])
    k = x[:, qpg].reshape(G * hd, *w.shape[1:])
    v = x[:, qpg + 1].reshape(G * hd, *w.shape[1:])
    return q, k, v


def _table(weights: dict[str, torch.Tensor], name: str, vocab: int) -> torch.Tensor:
    t = weights[name]
    if t.shape[0] < vocab:
        raise ExportError(f"{name} has {t.shape[0]} rows, fewer than the tokenizer's {vocab} pieces "
                          f"(is it the tokenizer the run trained with?)")
    return t[:vocab].contiguous()


def _llama(cfg: Config, w: dict[str, torch.Tensor], vocab: int, special: dict[str, Optional[int]]) -> HFExport:
    from transformers import LlamaConfig, LlamaForCausalLM
    m = cfg.model
    conf = LlamaConfig(vocab_size=vocab, hidden_size=m.hidden_size, intermediate_size=m.ffn_size,
                       num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
                       num_key_value_heads=m.query_groups, head_dim=m.head_dim, hidden_act="silu",
                       max_position_embeddings=m.seq_length, rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta,
                       tie_word_embeddings=m.tie_embeddings, attention_bias=m.bias, mlp_bias=m.bias,
                       attention_dropout=0.0, **special)
    sd = {"model.embed_tokens.weight": _table(w, "embeddings.word_embeddings.weight", vocab),
          "model.norm.weight": w["body.final_norm.weight"]}
    if not m.tie_embeddings:
        sd["lm_head.weight"] = _table(w, "embeddings.output_layer.weight", vocab)
    ffn = m.ffn_size
    for i in range(m.num_layers):
        src, dst = f"body.layers.{i}", f"model.layers.{i}"
        sd[f"{dst}.input_layernorm.weight"] = w[f"{src}.input_norm.weight"]
        sd[f"{dst}.post_attention_layernorm.weight"] = w[f"{src}.mlp_norm.weight"]
        for kind in ("weight", "bias") if m.bias else ("weight",):
            q, k, v = _split_qkv(w[f"{src}.attention.qkv.{kind}"], m)
            sd[f"{dst}.self_attn.q_proj.{kind}"] = q
            sd[f"{dst}.self_attn.k_proj.{kind}"] = k
            sd[f"{dst}.self_attn.v_proj.{kind}"] = v
            sd[f"{dst}.self_attn.o_proj.{kind}"] = w[f"{src}.attention.proj.{kind}"]
            fc1 = w[f"{src}.mlp.fc1.{kind}"]
            sd[f"{dst}.mlp.gate_proj.{kind}"] = fc1[:ffn]
            sd[f"{dst}.mlp.up_proj.{kind}"] = fc1[ffn:]
            sd[f"{dst}.mlp.down_proj.{kind}"] = w[f"{src}.mlp.fc2.{kind}"]
    return HFExport("llama", conf, sd, LlamaForCausalLM)


def _mpt(cfg: Config, w: dict[str, torch.Tensor], vocab: int, special: dict[str, Optional[int]]) -> HFExport:
    from transformers import MptConfig, MptForCausalLM
    m = cfg.model
    worst_name, worst = "", 0.0
    for name, t in w.items():
        if name.endswith("norm.bias"):
            v = float(t.abs().max()) if t.numel() else 0.0
            if v > worst:
                worst_name, worst = name, v
    if worst > 0.0:
        raise ExportError(f"config key 'model.norm_bias': layernorm biases are trained (|{worst_name}| "
                          f"up to {worst:.3g}), but MPT, the only architecture with our ALiBi, has LayerNorm "
                          f"without bias (BLOOM and Falcon differ more); no exact export exists. Train with "
                          f"model.norm_bias: false to export ALiBi models")
    conf = MptConfig(d_model=m.hidden_size, n_heads=m.num_attention_heads, n_layers=m.num_layers,
                     expansion_ratio=4, max_seq_len=MPT_LENGTH_FACTOR * m.seq_length, vocab_size=vocab,
                     layer_norm_epsilon=m.norm_eps,
                     no_bias=True, learned_pos_emb=False,
                     attn_config={"alibi": True, "alibi_bias_max": 8, "softmax_scale": None, "clip_qkv": None,
                                  "qk_ln": False},
                     tie_word_embeddings=m.tie_embeddings, **special)
    sd = {"transformer.wte.weight": _table(w, "embeddings.word_embeddings.weight", vocab),
          "transformer.norm_f.weight": w["body.final_norm.weight"]}
    if not m.tie_embeddings:
        sd["lm_head.weight"] = _table(w, "embeddings.output_layer.weight", vocab)
    for i in range(m.num_layers):
        src, dst = f"body.layers.{i}", f"transformer.blocks.{i}"
        q, k, v = _split_qkv(w[f"{src}.attention.qkv.weight"], m)
        sd[f"{dst}.norm_1.weight"] = w[f"{src}.input_norm.weight"]
        sd[f"{dst}.attn.Wqkv.weight"] = torch.cat([q, k, v], dim=0)
        sd[f"{dst}.attn.out_proj.weight"] = w[f"{src}.attention.proj.weight"]
        sd[f"{dst}.norm_2.weight"] = w[f"{src}.mlp_norm.weight"]
        sd[f"{dst}.ffn.up_proj.weight"] = w[f"{src}.mlp.fc1.weight"]
        sd[f"{dst}.ffn.down_proj.weight"] = w[f"{src}.mlp.fc2.weight"]
    return HFExport("mpt", conf, sd, MptForCausalLM)


def to_hf(cfg: Config, weights: dict[str, torch.Tensor], vocab_size: int,
          special: Optional[dict[str, Optional[int]]] = None) -> HFExport:
    """The transformers config and state dict (fp32) expressing ``weights`` (full tensors, as
    ``checkpoint_reader.read_full_weights`` names them) with a ``vocab_size`` vocabulary.
    ``special``: ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` for the config, each
    passed as given, None included: a tokenizer without an eos token must export without one
    (left out, ``LlamaConfig`` would write its own defaults bos 1 / eos 2, ids of whatever
    pieces our tokenizer has there, and ``generate`` would stop at id 2)."""
    arch = architecture_for(cfg.model)
    special = {k: (special or {}).get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    build = {"llama": _llama, "mpt": _mpt}[arch]
    out = build(cfg, weights, vocab_size, special)
    out.state_dict = {k: v.detach().to(torch.float32).contiguous() for k, v in out.state_dict.items()}
    return out


def build_model(export: HFExport):
    """The transformers model holding the exported weights (every parameter checked present)."""
    model = export.model_class(export.config)
    model.to(torch.float32)
    missing, unexpected = model.load_state_dict(export.state_dict, strict=False)
    tied_ok = {"lm_head.weight"} if getattr(export.config, "tie_word_embeddings", False) else set()
    missing = [k for k in missing if k not in tied_ok]
    if missing or unexpected:
        raise ExportError(f"{export.architecture}: the mapped weights do not fit the transformers model "
                          f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    if export.config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()
