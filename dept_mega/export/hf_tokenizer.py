"""A SentencePiece model as a Hugging Face ``transformers`` tokenizer (``tokenizer.json``).

The ``tokenizers`` pipeline is built from the SentencePiece model proto so that encoding
gives the ids ``dept_mega.data.tokenizer.Tokenizer.encode`` gives (no BOS/EOS added: the
training data has none in front and an EOS appended per document by preprocessing), and
decoding gives its text:

* normalizer: the model's precompiled character map (e.g. ``nmt_nfkc``); with
  ``remove_extra_whitespaces`` runs of spaces become one and the ends are stripped; with
  ``add_dummy_prefix`` a "▁" goes in front; spaces become "▁" (``escape_whitespaces``);
* pre-tokenizer: split before every "▁" (SentencePiece's ``split_by_whitespace``: no piece
  spans a word boundary, so encoding word by word equals encoding the whole string); with
  ``allow_whitespace_only_pieces`` (tools/train_tokenizer.py's lossless default) only where a
  run of "▁" starts, since a piece may then be a run of "▁" (an indent);
* model: Unigram with the pieces' scores (BPE: merges ordered by the pieces' scores), unknown
  id and byte fallback as in the proto; control pieces (``<s>``, ``</s>``, ``<pad>``) are
  special tokens that plain text never produces (``split_special_tokens``), as in SentencePiece;
* decoder: "▁" → space, bytes joined (byte fallback), the dummy prefix's space removed.

Known difference: an unknown piece decodes to the ``<unk>`` token's text here, to " ⁇ " in
SentencePiece. Needs ``protobuf`` (to read the model proto) and ``tokenizers``.
"""
from __future__ import annotations

import os
import shutil
from typing import Any


class TokenizerExportError(ValueError):
    """The SentencePiece model cannot be expressed (the message names the file and why)."""


def _proto(path: str):
    try:
        from sentencepiece import sentencepiece_model_pb2 as pb
    except ImportError as exc:  # protobuf missing
        raise TokenizerExportError(f"reading {path} needs the protobuf package ({exc}); "
                                   f"pip install protobuf") from None
    m = pb.ModelProto()
    try:
        with open(path, "rb") as f:
            m.ParseFromString(f.read())
    except Exception as exc:  # noqa: BLE001
        raise TokenizerExportError(f"{path} is not a SentencePiece model ({exc})") from None
    return m


def _bpe_merges(pieces: list[tuple[str, float]], skip: set[int]) -> list[tuple[str, str]]:
    """Merges of a SentencePiece BPE vocabulary: every split of a piece into two pieces of
    the vocabulary, ordered by the merged piece's score (SentencePiece merges the pair whose
    result scores highest), ties by the pieces' ids."""
    vocab = {p: i for i, (p, _) in enumerate(pieces) if i not in skip}
    merges = []
    for i, (piece, score) in enumerate(pieces):
        if i in skip:
            continue
        for k in range(1, len(piece)):
            a, b = piece[:k], piece[k:]
            if a in vocab and b in vocab:
                merges.append((-score, i, vocab[a], vocab[b], a, b))
    merges.sort()
    return [(m[4], m[5]) for m in merges]


def build_tokenizer(model_path: str):
    """A ``tokenizers.Tokenizer`` equivalent to the SentencePiece model at ``model_path``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE, Unigram
    m = _proto(model_path)
    ts, ns = m.trainer_spec, m.normalizer_spec
    if ts.treat_whitespace_as_suffix:
        raise TokenizerExportError(f"{model_path}: treat_whitespace_as_suffix is not supported by the export")
    if not ns.escape_whitespaces:
        raise TokenizerExportError(f"{model_path}: escape_whitespaces=false is not supported by the export")
    if ns.normalization_rule_tsv:
        raise TokenizerExportError(f"{model_path}: a custom normalization_rule_tsv is not supported by the export")
    # piece types: 1 normal, 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte
    pieces = [(p.piece, float(p.score)) for p in m.pieces]
    control = [i for i, p in enumerate(m.pieces) if p.type == 3]
    user = [i for i, p in enumerate(m.pieces) if p.type == 4]
    byte_fallback = bool(ts.byte_fallback)
    if ts.model_type == 1:  # unigram
        model = Unigram(pieces, unk_id=int(ts.unk_id), byte_fallback=byte_fallback)
    elif ts.model_type == 2:  # bpe
        skip = {i for i, p in enumerate(m.pieces) if p.type not in (1, 4)}
        model = BPE({p: i for i, (p, _) in enumerate(pieces)}, _bpe_merges(pieces, skip),
                    unk_token=ts.unk_piece or "<unk>", fuse_unk=True, byte_fallback=byte_fallback)
    else:
        raise TokenizerExportError(f"{model_path}: SentencePiece model type {ts.model_type} "
                                   f"is neither unigram (1) nor bpe (2)")
    tok = Tokenizer(model)
    norms = []
    if ns.precompiled_charsmap:
        norms.append(normalizers.Precompiled(ns.precompiled_charsmap))
    if ns.remove_extra_whitespaces:
        norms += [normalizers.Replace(Regex(" {2,}"), " "), normalizers.Strip(left=True, right=True)]
    if ns.add_dummy_prefix:
        norms.append(normalizers.Prepend(" "))
    norms.append(normalizers.Replace(" ", "▁"))
    tok.normalizer = normalizers.Sequence(norms)
    if ts.split_by_whitespace and ts.allow_whitespace_only_pieces:
        # a piece holds "▁" only in front, or only "▁"s ("▁▁▁▁", an indent): split where a
        # run of "▁" starts, so that "▁▁▁▁def" stays one word ("▁▁▁▁" + "def" or "▁▁▁" + "▁def")
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("▁*[^▁]+|▁+"), behavior="isolated")
    elif ts.split_by_whitespace:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    dec = [decoders.Replace("▁", " ")]
    if ts.unk_surface and 0 <= ts.unk_id < len(m.pieces):
        dec.insert(0, decoders.Replace(m.pieces[ts.unk_id].piece, ts.unk_surface))
    if byte_fallback:
        dec.append(decoders.ByteFallback())
    dec.append(decoders.Fuse())  # one string, so that the strip below acts on its start only
    if ns.add_dummy_prefix:
        dec.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(dec)
    added = [AddedToken(m.pieces[i].piece, special=True, normalized=False) for i in control]
    added += [AddedToken(m.pieces[i].piece, special=False, normalized=False) for i in user]
    if added:
        # ids stay the proto's: these pieces are already in the model's vocabulary
        tok.add_special_tokens([a for a in added if a.special])
        tok.add_tokens([a for a in added if not a.special])
    return tok, m


def special_tokens(m) -> dict[str, Any]:
    """bos/eos/unk/pad pieces and ids of a model proto (a missing one: None)."""
    ts = m.trainer_spec
    out: dict[str, Any] = {}
    for kind, i in (("bos", ts.bos_id), ("eos", ts.eos_id), ("unk", ts.unk_id), ("pad", ts.pad_id)):
        ok = 0 <= int(i) < len(m.pieces)
        out[f"{kind}_token"] = m.pieces[i].piece if ok else None
        out[f"{kind}_token_id"] = int(i) if ok else None
    return out


def save_hf_tokenizer(model_path: str, output: str) -> dict[str, Any]:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` (``PreTrainedTokenizerFast``) to
    ``output`` and a copy of the SentencePiece model as ``sentencepiece.model``; returns the
    special tokens (for the model config)."""
    from transformers import PreTrainedTokenizerFast
    tok, m = build_tokenizer(model_path)
    sp = special_tokens(m)
    if len(m.pieces) != tok.get_vocab_size(with_added_tokens=True):
        raise TokenizerExportError(f"{model_path}: {len(m.pieces)} pieces became "
                                   f"{tok.get_vocab_size(with_added_tokens=True)} tokens")
    kwargs = {k: v for k, v in sp.items() if k.endswith("_token") and v is not None}
    if "pad_token" not in kwargs and "eos_token" in kwargs:
        kwargs["pad_token"] = kwargs["eos_token"]  # generate() pads finished rows with it
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False, **kwargs)
    hf.save_pretrained(output)
    shutil.copyfile(model_path, os.path.join(output, "sentencepiece.model"))
    return sp
