"""``train.init_from`` between TRIM's global tables and a shared embedding table
(docs/launching.md section 11).

TRIM keeps its global tables outside the model (``dept/trim/{phi|phi_head|positions}`` in a
checkpoint, ``dept.trim``): φ and the untied head's φ_head hold the |V| real rows of the global
vocabulary, unpadded; STD and GLOB hold the same tables as model parameters
(``model/embeddings.{word_embeddings|output_layer|position_embeddings}.weight``), padded to a
multiple of 128 rows. With the same model and tokenizer (``init_from.check_source``) the one
is the other's first |V| rows:

* TRIM from STD / GLOB: φ := the shared word table's rows [0, |V|), φ_head := the untied
  head's, the learned positions := the model's. The compact per-source tables are then filled
  from φ at each source's installation, as in any TRIM run.
* STD / GLOB / SPEC from TRIM: the word table's rows [0, |V|) := φ, the head's := φ_head, the
  positions := TRIM's synchronised positions. The padded rows keep their seeded values: no
  token id reaches them and their logits are −inf, so they change no loss.
* TRIM from TRIM: φ, φ_head and the positions as saved; their rows' outer optimizer state
  starts fresh, like every outer state under ``train.init_from``.

Each rank reads its boxes only (its row shard of φ; its tensor-parallel rows of the word
table), so the two runs' layouts do not matter.
"""
from __future__ import annotations

from .checkpoint_format import Entry, param_key, saved_keys, trim_key
from .config import ConfigError
from .manifest import DEPENDS_FILE, read_json
from .variant import variant_of

KEY = "train.init_from"
TABLES = {"phi": "embeddings.word_embeddings.weight", "phi_head": "embeddings.output_layer.weight",
          "positions": "embeddings.position_embeddings.weight"}  # TRIM's table → the model's parameter


def saved_variant(path: str) -> str:
    """The ``dept.variant`` of the run that wrote checkpoint ``path``."""
    return str(read_json(path, DEPENDS_FILE).get("config", {}).get("dept.variant", "std"))


def _shape(saved: dict, key: str, path: str) -> tuple[int, ...]:
    if key not in saved:
        raise ConfigError(f"config key '{KEY}': checkpoint {path} has no tensor {key!r} (another model?)")
    return tuple(saved[key])


def trim_entries(strategy, path: str, old: str) -> list[Entry]:
    """TRIM (this launch): the entries of this rank's rows of φ / φ_head and of the learned
    positions, read from checkpoint ``path`` of variant ``old`` — its own tables (trim) or
    the first |V| rows of the shared table (std, glob). Their rows' outer state is not read."""
    from .dept.hook_state import _trim
    tables = {trim_key(t): t for t in TABLES}
    saved = saved_keys(path)
    out = []
    for e in _trim(strategy):
        if e.key not in tables:  # a row's outer optimizer state: fresh
            continue
        if variant_of(old).trimmed:
            out.append(e)
            continue
        key = param_key(TABLES[tables[e.key]], None)
        shape = _shape(saved, key, path)
        if shape[0] < e.shape[0] or shape[1:] != e.shape[1:]:
            raise ConfigError(f"config key '{KEY}': checkpoint {path}: {key!r} has shape {shape}, this launch's "
                              f"{tables[e.key]} needs {e.shape[0]} rows of {e.shape[1:]}")
        out.append(Entry(key, e.tensor, shape, e.offset))
    return out


def from_phi(entries: list[Entry], path: str) -> list[Entry]:
    """The model's embedding entries (group-free ``model/embeddings...`` keys) read from a TRIM
    checkpoint's tables instead: a word table or head box clipped to the rows below |V| (the
    padded rows are left as they are), the positions whole."""
    names = {param_key(v, None): trim_key(k) for k, v in TABLES.items()}
    saved = saved_keys(path)
    out = []
    for e in entries:
        if e.key not in names:
            raise ConfigError(f"config key '{KEY}': checkpoint {path} is a TRIM run's, which holds no "
                              f"{e.key[len('model/'):]!r}")
        key = names[e.key]
        shape = _shape(saved, key, path)
        if key == trim_key("positions"):
            out.append(Entry(key, e.tensor, e.shape, e.offset))
            continue
        if any(e.offset[1:]) or tuple(e.tensor.shape[1:]) != shape[1:]:
            raise ValueError(f"{e.key}: a box of whole rows expected, got offset {e.offset} of {e.shape}")
        n = max(0, min(e.tensor.shape[0], shape[0] - e.offset[0]))
        if n:
            out.append(Entry(key, e.tensor[:n], shape, e.offset))
    return out
