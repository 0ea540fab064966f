"""A local Hugging Face model directory, read without the network and without building the model.

* ``config.json``: the raw JSON (what the file says, keys ``transformers`` would ignore
  included) and the ``transformers`` config of its ``model_type`` (Llama or MPT), read with
  ``local_files_only=True``;
* the weights, found in this order: ``model.safetensors.index.json`` (its shards),
  ``model.safetensors``, ``pytorch_model.bin.index.json`` (its shards), ``pytorch_model.bin``.
  Only the names, shapes and dtypes are read at first; a tensor is read when it is asked for
  (safetensors: ``safe_open``; ``.bin``: ``torch.load(weights_only=True, mmap=True)``, never
  executing code from the file), so the memory is about one copy of the model.

Anything else (no config, no weight file, a shard the index names that is missing, a tensor
the index places in a shard that lacks it, a shard cut short, a quantised model) is an
:class:`HFDirError` naming the file (and the tensor).
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from typing import Any, Iterator

import torch

CONFIG = "config.json"
WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json",
                "pytorch_model.bin")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ARCHITECTURES = ("llama", "mpt")  # config.json's model_type values dept_mega expresses


class HFDirError(ValueError):
    """The directory cannot be read as a Hugging Face model (one line naming the file)."""


class HFDirectory:
    """``path``'s config (``raw``: config.json as written; ``config``: the transformers config)
    and its weights by name (:meth:`names`, :meth:`shape`, :meth:`get`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        if not os.path.isdir(path):
            raise HFDirError(f"--hf-dir {path} is not a directory")
        cfg_file = os.path.join(path, CONFIG)
        try:
            with open(cfg_file, encoding="utf-8") as f:
                self.raw: dict[str, Any] = json.load(f)
        except FileNotFoundError:
            raise HFDirError(f"{cfg_file} does not exist (a Hugging Face model directory holds config.json)") from None
        except (OSError, ValueError) as exc:
            raise HFDirError(f"{cfg_file}: cannot be read as JSON ({exc})") from None
        if not isinstance(self.raw, dict):
            raise HFDirError(f"{cfg_file}: not a JSON object")
        self.model_type = self.raw.get("model_type")
        if self.model_type not in ARCHITECTURES:
            raise HFDirError(f"{cfg_file}: model_type {self.model_type!r} (architectures "
                             f"{self.raw.get('architectures')}) is not one dept_mega's model expresses; "
                             f"supported: llama (rope + rmsnorm + swiglu), mpt (alibi + layernorm + gelu)")
        if self.raw.get("quantization_config"):
            raise HFDirError(f"{cfg_file}: a quantised model (quantization_config "
                             f"{self.raw['quantization_config'].get('quant_method', '?')!r}); import the "
                             f"unquantised weights")
        self.config = _transformers_config(path, self.model_type)
        self.weight_file, self._where = _index(path)
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._open: dict[str, Any] = {}
        self._scan()

    # ------------------------------------------------------------------ weights
    def names(self) -> list[str]:
        return sorted(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._meta[name][0]

    def dtype(self, name: str) -> torch.dtype:
        return self._meta[name][1]

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name`` as float32 (bf16 / fp16 values are exact in fp32)."""
        file = self._where[name]
        handle = self._handle(file)
        with self._reading(file, name):
            t = handle.get_tensor(name) if file.endswith(".safetensors") else handle[name]
            return t.to(torch.float32)

    @contextmanager
    def _reading(self, file: str, name: str) -> Iterator[None]:
        """A tensor the file lacks (an index naming the wrong shard) or cannot give (a shard
        cut short): an HFDirError naming the file and the tensor, not the library's traceback."""
        try:
            yield
        except HFDirError:
            raise
        except Exception as exc:  # noqa: BLE001 - a damaged or mismatched file: one line naming it
            raise HFDirError(f"{os.path.join(self.path, file)}: tensor {name!r} cannot be read (named by "
                             f"{self.weight_file}; {type(exc).__name__}: {exc})") from None

    def close(self) -> None:
        self._open.clear()

    def _handle(self, file: str):
        if file not in self._open:
            full = os.path.join(self.path, file)
            if not os.path.isfile(full):
                raise HFDirError(f"{full} does not exist (named by {self.weight_file})")
            try:
                if file.endswith(".safetensors"):
                    from safetensors import safe_open
                    self._open[file] = safe_open(full, framework="pt", device="cpu")
                else:
                    self._open[file] = _load_bin(full)
            except HFDirError:
                raise
            except Exception as exc:  # noqa: BLE001 - a damaged or foreign file: one line naming it
                raise HFDirError(f"{full}: cannot be read ({type(exc).__name__}: {exc})") from None
        return self._open[file]

    def _scan(self) -> None:
        """Every tensor's shape and dtype (safetensors: from the headers; .bin: the mapped file)."""
        for file in sorted(set(self._where.values())):
            handle = self._handle(file)
            names = [n for n, f in self._where.items() if f == file]
            for name in names:
                with self._reading(file, name):
                    if file.endswith(".safetensors"):
                        sl = handle.get_slice(name)
                        shape, dtype = tuple(sl.get_shape()), _st_dtype(sl.get_dtype(), name, file)
                    else:
                        t = handle[name]
                        if not isinstance(t, torch.Tensor):
                            raise HFDirError(f"{os.path.join(self.path, file)}: {name!r} is not a tensor")
                        shape, dtype = tuple(t.shape), t.dtype
                if dtype not in FLOAT_DTYPES:
                    raise HFDirError(f"{os.path.join(self.path, file)}: tensor {name!r} has dtype {dtype}; only "
                                     f"float32 / bfloat16 / float16 weights import (a quantised model?)")
                self._meta[name] = (shape, dtype)


def _st_dtype(code: str, name: str, file: str) -> torch.dtype:
    table = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
             "I8": torch.int8, "U8": torch.uint8, "I32": torch.int32, "I64": torch.int64}
    if code not in table:
        raise HFDirError(f"{file}: tensor {name!r} has dtype {code}; only float32 / bfloat16 / float16 weights import")
    return table[code]


def _load_bin(path: str) -> dict[str, torch.Tensor]:
    try:
        out = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as exc:
        if "mmap" not in str(exc):
            raise
        out = torch.load(path, map_location="cpu", weights_only=True)  # a legacy (non-zip) file cannot be mapped
    if not isinstance(out, dict):
        raise HFDirError(f"{path}: holds a {type(out).__name__}, not a state dict of tensors")
    return out


def _index(path: str) -> tuple[str, dict[str, str]]:
    """(the weight file used, {tensor name: the file holding it})."""
    for file in WEIGHT_FILES:
        full = os.path.join(path, file)
        if not os.path.isfile(full):
            continue
        if not file.endswith(".index.json"):
            return file, _names_of(path, file)
        try:
            with open(full, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise HFDirError(f"{full}: no readable weight_map ({type(exc).__name__}: {exc})") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise HFDirError(f"{full}: weight_map is empty")
        for shard in sorted(set(weight_map.values())):
            if not os.path.isfile(os.path.join(path, shard)):
                raise HFDirError(f"{os.path.join(path, shard)} does not exist (named by {file})")
        return file, {str(k): str(v) for k, v in weight_map.items()}
    raise HFDirError(f"{path} holds none of {', '.join(WEIGHT_FILES)} (other formats, e.g. Meta's consolidated.*.pth "
                     f"or GGUF, convert to a transformers directory first)")


def _names_of(path: str, file: str) -> dict[str, str]:
    full = os.path.join(path, file)
    try:
        if file.endswith(".safetensors"):
            from safetensors import safe_open
            with safe_open(full, framework="pt", device="cpu") as f:
                return {k: file for k in f.keys()}
        return {k: file for k in _load_bin(full)}
    except HFDirError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise HFDirError(f"{full}: cannot be read ({type(exc).__name__}: {exc})") from None


def _transformers_config(path: str, model_type: str):
    from transformers import LlamaConfig, MptConfig
    cls = {"llama": LlamaConfig, "mpt": MptConfig}[model_type]
    try:
        return cls.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers' validation: one line naming the file
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise HFDirError(f"{os.path.join(path, CONFIG)}: transformers refuses it as a {cls.__name__}: {first}") from None


def tokenizer_files(path: str) -> list[str]:
    """The tokenizer files of the directory (their names), for the record and the tokenizer note."""
    return [f for f in ("tokenizer.json", "tokenizer.model", "sentencepiece.model") if
            os.path.isfile(os.path.join(path, f))]


def describe_weights(d: HFDirectory) -> str:
    """``model.safetensors (291 tensors, bfloat16)``: the weight file read, for the record."""
    dtypes = sorted({str(d.dtype(n)).replace("torch.", "") for n in d.names()})
    return f"{d.weight_file} ({len(d.names())} tensors, {'/'.join(dtypes)})"
