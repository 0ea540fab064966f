"""The tokenizers a run reads: SentencePiece models (:class:`Tokenizer`) and Hugging Face
``tokenizers`` files (:class:`HuggingFaceTokenizer`), behind one interface (``kind``, ``path``,
``vocab_size``, ``eos_id``, ``encode``/``encode_batch``, ``decode``/``decode_batch``).

:func:`load_tokenizer` is what every use of a configured tokenizer path (``data.tokenizer``,
``data.sources[].tokenizer``) goes through: the type is read from the path
(:func:`tokenizer_kind`), so a config names either kind the same way. ``tools/preprocess_data.py``
takes the type from ``--tokenizer-type`` instead, as Megatron-LM's does (:func:`open_tokenizer`)."""
from __future__ import annotations

import hashlib
import os
from typing import Optional, Sequence

import sentencepiece as spm


def model_sha256(path: str, cache: Optional[dict] = None) -> str:
    """sha256 of a tokenizer's model file (a SentencePiece ``.model``, or the ``tokenizer.json``
    of a Hugging Face tokenizer or of its directory): what identifies the vocabulary, wherever
    the file is moved. ``cache`` ({(path, size, mtime): digest}) spares reading a file again
    that has not changed (a tokenizer several sources or checkpoints name). OSError when the
    file cannot be read."""
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    st = os.stat(file)
    key = (os.path.abspath(file), st.st_size, st.st_mtime_ns)
    if cache is not None and key in cache:
        return cache[key]
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    digest = h.hexdigest()
    if cache is not None:
        cache[key] = digest
    return digest


class TokenizerError(ValueError):
    """A tokenizer model that cannot be used (missing file, not a model, no EOS id)."""


class NotATokenizer(TokenizerError):
    """The file exists but cannot be read as the tokenizer type it was taken for (``detail``:
    what the reader said)."""

    def __init__(self, message: str, detail: str):
        super().__init__(message)
        self.detail = detail


SENTENCEPIECE, HUGGINGFACE = "sentencepiece", "huggingface"
#: what a path that is neither kind gets told (the two forms a configured tokenizer takes)
KINDS_HINT = ("a SentencePiece model is a .model file (tools/train_tokenizer.py); a Hugging Face tokenizer is "
              "a tokenizer.json file or a directory holding one, with its tokenizer_config.json")


class Tokenizer:
    """A loaded SentencePiece model. ``eos_id`` is the end-of-document token that
    ``tools/preprocess_data.py --append-eod`` appends."""

    kind = SENTENCEPIECE

    def __init__(self, path: str):
        if not os.path.exists(path):
            raise TokenizerError(f"tokenizer model {path!r} does not exist")
        self.path = path
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(path)
        except (OSError, RuntimeError) as exc:
            raise NotATokenizer(f"{path!r} is not a SentencePiece model: {exc}", str(exc)) from None
        if self._sp.eos_id() < 0:
            raise TokenizerError(f"tokenizer model {path!r} defines no EOS id (train it with an eos id >= 0)")

    @property
    def vocab_size(self) -> int:
        return int(self._sp.GetPieceSize())

    @property
    def eos_id(self) -> int:
        return int(self._sp.eos_id())

    @property
    def bos_id(self) -> int:
        return int(self._sp.bos_id())

    @property
    def pad_id(self) -> int:
        return int(self._sp.pad_id())

    @property
    def unk_id(self) -> int:
        return int(self._sp.unk_id())

    @property
    def processor(self) -> spm.SentencePieceProcessor:
        return self._sp

    def encode(self, text: str) -> list[int]:
        return self._sp.EncodeAsIds(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode several texts in this thread (no SentencePiece thread pool)."""
        return self._sp.Encode(list(texts), out_type=int, num_threads=1)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.DecodeIds([int(i) for i in ids])

    def decode_batch(self, ids: Sequence[Sequence[int]]) -> list[str]:
        """Decode several id lists in this thread."""
        return self._sp.Decode([x if isinstance(x, list) else [int(i) for i in x] for x in ids], num_threads=1)

    def id_to_piece(self, i: int) -> str:
        return self._sp.IdToPiece(int(i))


def tokenizer_kind(path: str) -> str:
    """:data:`HUGGINGFACE` for a directory holding ``tokenizer.json`` or a JSON file (named
    ``*.json``, or whose first byte is ``{``), :data:`SENTENCEPIECE` for any other file.
    TokenizerError for a path that does not exist or a directory without ``tokenizer.json``."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            return HUGGINGFACE
        raise TokenizerError(f"{path!r} is a directory without a tokenizer.json, so it is neither a SentencePiece "
                             f"model nor a Hugging Face tokenizer ({KINDS_HINT})")
    if not os.path.exists(path):
        raise TokenizerError(f"tokenizer {path!r} does not exist")
    if path.endswith(".json"):
        return HUGGINGFACE
    try:
        with open(path, "rb") as f:
            head = f.read(64).lstrip()
    except OSError as exc:
        raise TokenizerError(f"tokenizer {path!r} cannot be read ({exc.strerror})") from None
    return HUGGINGFACE if head.startswith(b"{") else SENTENCEPIECE


def load_tokenizer(path: str, key: Optional[str] = None):
    """The tokenizer at ``path``, of the type :func:`tokenizer_kind` reads from it: a
    :class:`Tokenizer` (SentencePiece) or a :class:`HuggingFaceTokenizer`. ``key``: the config
    key that names the path (``data.tokenizer``, ``data.sources[i].tokenizer``), put in front
    of any error. A file that is neither kind: "... is neither a SentencePiece model nor a
    Hugging Face tokenizer.json (...)"."""
    try:
        kind = tokenizer_kind(path)
        try:
            return HuggingFaceTokenizer(path) if kind == HUGGINGFACE else Tokenizer(path)
        except NotATokenizer as exc:
            raise TokenizerError(f"{path!r} is neither a SentencePiece model nor a Hugging Face tokenizer.json "
                                 f"(read as {'a tokenizer.json' if kind == HUGGINGFACE else 'SentencePiece'}: "
                                 f"{exc.detail}; {KINDS_HINT})") from None
    except TokenizerError as exc:
        if key is None:
            raise
        raise TokenizerError(f"config key {key!r}: {exc}") from None


TOKENIZER_TYPES = ("SentencePieceTokenizer", "HuggingFaceTokenizer")


class HuggingFaceTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer (``tokenizer.json``, or a directory holding it),
    read locally, encoding as Megatron's ``HuggingFaceTokenizer`` does (``tokenizer(text).input_ids``
    of ``transformers``): the post-processor's special tokens are added (``add_special_tokens``),
    no truncation or padding; ``vocab_size`` counts the added tokens (``len(tokenizer)``); the EOS
    id (``--append-eod``) is the ``eos_token`` of ``tokenizer_config.json`` (or
    ``special_tokens_map.json``) beside the file, None when neither names one. Training needs
    no EOS id (documents are the ``.idx``'s); preprocessing with ``--append-eod`` does."""

    kind = HUGGINGFACE

    def __init__(self, path: str):
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise TokenizerError(f"tokenizer {path!r}: {file!r} does not exist")
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as exc:
            raise TokenizerError(f"tokenizer {path!r} needs the tokenizers package (pip install tokenizers): "
                                 f"{exc}") from None
        try:
            self._tok = _HFTokenizer.from_file(file)
        except Exception as exc:  # noqa: BLE001 - the Rust side raises plain Exception
            raise NotATokenizer(f"{file!r} is not a Hugging Face tokenizer.json: {exc}", str(exc)) from None
        self._tok.no_truncation()
        self._tok.no_padding()
        self.path = file
        self.eos_token = special_token(os.path.dirname(file), "eos_token")
        self.eos_id = None if self.eos_token is None else self._tok.token_to_id(self.eos_token)
        if self.eos_token is not None and self.eos_id is None:
            raise TokenizerError(f"{file!r}: its eos_token {self.eos_token!r} is not in the vocabulary")

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=True)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    def decode_batch(self, ids: Sequence[Sequence[int]]) -> list[str]:
        return self._tok.decode_batch([[int(i) for i in x] for x in ids])

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)


#: the files beside a ``tokenizer.json`` that name its special tokens, in the order they are read
SPECIAL_TOKEN_FILES = ("tokenizer_config.json", "special_tokens_map.json")


def special_token(directory: str, name: str) -> Optional[str]:
    """The special token ``name`` (``eos_token``, ``bos_token``, ...) that the first of
    :data:`SPECIAL_TOKEN_FILES` in ``directory`` naming it names (a string, or an AddedToken's
    ``{"content": ...}``), None when none does."""
    import json
    for file in SPECIAL_TOKEN_FILES:
        path = os.path.join(directory, file)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                token = json.load(f).get(name)
        except (OSError, ValueError, AttributeError) as exc:
            raise TokenizerError(f"{path}: not a JSON object ({exc})") from None
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str):
            return token
    return None


def open_tokenizer(tokenizer_type: str, path: str):
    """The tokenizer ``tools/preprocess_data.py --tokenizer-type`` names."""
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(path)
    if tokenizer_type == "SentencePieceTokenizer":
        if os.path.exists(path) and (os.path.isdir(path) or path.endswith(".json")) \
                and tokenizer_kind(path) == HUGGINGFACE:
            raise TokenizerError(f"--tokenizer-type SentencePieceTokenizer (the default): {path!r} is a Hugging Face "
                                 f"tokenizer (tokenizer.json); pass --tokenizer-type HuggingFaceTokenizer")
        return Tokenizer(path)
    raise TokenizerError(f"--tokenizer-type {tokenizer_type!r} is not one of {', '.join(TOKENIZER_TYPES)}")
