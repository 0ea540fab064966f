"""The tokenizer files of an exported model directory, for either kind of tokenizer a run names.

* A SentencePiece model is converted to a ``tokenizers`` pipeline (:mod:`.hf_tokenizer`):
  ``tokenizer.json`` + ``tokenizer_config.json``, and the model itself as ``sentencepiece.model``.
* A Hugging Face tokenizer (``tokenizer.json``, or a directory holding it) is already in the
  format ``AutoTokenizer`` reads: its own files are copied as they are — ``tokenizer.json`` and
  the config files beside it that name its special tokens (``tokenizer_config.json``,
  ``special_tokens_map.json``) —, so the exported tokenizer is the one the data was made with.
  Its bos / eos / unk / pad tokens (as those files name them; a missing one: None) give the
  model config's ids. A tokenizer without an ``eos_token`` exports without ``eos_token_id``:
  ``generate`` then stops only at ``max_new_tokens``.

Afterwards :func:`encoding_difference` loads the written directory with ``AutoTokenizer`` and
compares its ids with ours on a few texts: a ``tokenizer_class`` in ``tokenizer_config.json``
may change what ``transformers`` does on top of ``tokenizer.json`` (e.g. add a BOS), which the
training data, tokenized with ``tokenizer.json`` alone, did not have.
"""
from __future__ import annotations

import os
import shutil
from typing import Any, Optional

from ..data.tokenizer import HUGGINGFACE, SPECIAL_TOKEN_FILES, special_token
from .hf_tokenizer import TokenizerExportError, save_hf_tokenizer

#: what :func:`encoding_difference` encodes: words, punctuation, runs of whitespace, non-ASCII
PROBES = ("Hello, world! It's 3.14 and   three spaces.", "  indented\n\tline\r\nend ", "héllo wörld ✓ 日本語 ру́сский 🙂",
          "")
SPECIAL_KINDS = ("bos", "eos", "unk", "pad")


def export_tokenizer(tok, output: str) -> dict[str, Any]:
    """Write ``tok`` (``dept_mega.data.tokenizer.load_tokenizer``'s) into ``output``; returns its
    special tokens and their ids (``bos_token``, ``bos_token_id``, ...)."""
    if tok.kind == HUGGINGFACE:
        return copy_hf_tokenizer(tok, output)
    return save_hf_tokenizer(tok.path, output)


def copy_hf_tokenizer(tok, output: str) -> dict[str, Any]:
    """Copy a :class:`~dept_mega.data.tokenizer.HuggingFaceTokenizer`'s files into ``output``
    (``tokenizer.json`` under that name, whatever the file was called, and the
    :data:`~dept_mega.data.tokenizer.SPECIAL_TOKEN_FILES` beside it); returns its special
    tokens and their ids. A special token its files name but the vocabulary lacks is a
    TokenizerExportError (``transformers`` would add it as a new id the model has no row for)."""
    directory = os.path.dirname(tok.path)
    shutil.copyfile(tok.path, os.path.join(output, "tokenizer.json"))
    for name in SPECIAL_TOKEN_FILES:
        if os.path.isfile(os.path.join(directory, name)):
            shutil.copyfile(os.path.join(directory, name), os.path.join(output, name))
    out: dict[str, Any] = {}
    for kind in SPECIAL_KINDS:
        token = special_token(directory, f"{kind}_token")
        i = None if token is None else tok.token_to_id(token)
        if token is not None and i is None:
            raise TokenizerExportError(f"{directory}: its {kind}_token {token!r} ({' or '.join(SPECIAL_TOKEN_FILES)}) "
                                       f"is not in the vocabulary of {tok.path}")
        out[f"{kind}_token"], out[f"{kind}_token_id"] = token, i
    return out


def encoding_difference(output: str, tok) -> Optional[str]:
    """None when ``AutoTokenizer.from_pretrained(output)`` encodes :data:`PROBES` as ``tok``
    does (``tok.encode``: special tokens as training data has them), else a line saying
    where it does not."""
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(output)
    for text in PROBES:
        theirs, ours = list(hf(text)["input_ids"]), list(tok.encode(text))
        if theirs != ours:
            return (f"transformers' {type(hf).__name__} (AutoTokenizer) encodes {text!r} as {theirs[:12]}, the run's "
                    f"tokenizer {tok.path} as {ours[:12]} (the training data's encoding): a tokenizer_class or "
                    f"setting in {output}/tokenizer_config.json changes what transformers does on top of "
                    f"tokenizer.json; encode with tokenizers.Tokenizer.from_file('{output}/tokenizer.json') to "
                    f"get the ids the model was trained on")
    return None
