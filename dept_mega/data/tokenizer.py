"""SentencePiece tokenizer wrapper: the one interface the rest of dept_mega uses."""
from __future__ import annotations

import os
from typing import Sequence

import sentencepiece as spm


class TokenizerError(ValueError):
    """A tokenizer model that cannot be used (missing file, not a model, no EOS id)."""


class Tokenizer:
    """A loaded SentencePiece model. ``eos_id`` is the end-of-document token that
    ``tools/preprocess_data.py --append-eod`` appends."""

    def __init__(self, path: str):
        if not os.path.exists(path):
            raise TokenizerError(f"tokenizer model {path!r} does not exist")
        self.path = path
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(path)
        except (OSError, RuntimeError) as exc:
            raise TokenizerError(f"{path!r} is not a SentencePiece model: {exc}") from None
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

    def id_to_piece(self, i: int) -> str:
        return self._sp.IdToPiece(int(i))


def load_tokenizer(path: str) -> Tokenizer:
    return Tokenizer(path)
