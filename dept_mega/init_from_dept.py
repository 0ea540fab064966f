"""``train.init_from`` under the DEPT variants: which of the checkpoint's tensors a fresh DEPT
run starts from (docs/launching.md section 11).

* The body (and GLOB's embeddings, which every group shares): the checkpoint's group-free
  model keys, the synchronised values every group held at a round boundary (what a resume
  installs there). A checkpoint taken inside a round (several groups, each its own body) is
  refused, naming ``dept.local_steps``. STD and GLOB checkpoints hold the same keys, so
  either starts the other.
* SPEC / SPEC-OPT: each source's embeddings by source name, from where the checkpoint kept
  them: the group that had it installed (``model[/g{g}]/embeddings...``) or a group's store
  (``source/{name}/model/embeddings...``). They are read when the new run first installs
  (or evaluates) the source — as a fresh run seeds them then — on the rank that needs them,
  with no collective. A source of this config that the checkpoint does not hold is an error
  naming it, unless ``train.init_from_new_sources: fresh`` (seeded as in a new run). SPEC
  from a STD / GLOB checkpoint: every source's table is its shared table; from TRIM, its φ
  (``dept_mega.init_from_trim``).
* TRIM: its global tables φ / φ_head and positions (``dept_mega.init_from_trim``); the
  compact tables are filled from φ when a source is installed, as in any TRIM run.
* Never: the outer optimizer's state, the inner optimizers', the round position. The outer
  synchronisations' reference θ_{t-1} is set to the loaded weights (they were built from the
  seeded ones).
"""
from __future__ import annotations

from typing import Callable, Optional

from .checkpoint_format import entries_of, load_entries, param_key, saved_keys, source_key, with_group
from .config import Config, ConfigError
from .config_diff import both, check_differing
from .manifest import DEPENDS_FILE, LAYOUT_FILE, read_json
from .variant import variant_of

KEY = "train.init_from"
WORD = "embeddings.word_embeddings.weight"


def weight_entries(trainer, path: str, new: str, old: str) -> list:
    """This rank's boxes of the weights to load into a ``new``-variant run from checkpoint
    ``path`` of variant ``old``, under group-free keys (the values every group held at a round
    boundary). The embeddings: as saved (STD / GLOB from either), from TRIM's tables (STD /
    GLOB from TRIM: ``init_from_trim.from_phi``), or not here where each source owns its own
    (SPEC / SPEC-OPT: :class:`SourceTables`) or TRIM's φ feeds them (``init_from_trim``). A
    key the checkpoint holds only per group: a ConfigError (the checkpoint is inside a round)."""
    from .checkpoint_state import model_entries
    from .init_from_trim import from_phi
    every = frozenset(id(p) for st in trainer.stages for p in st.parameters())
    entries = model_entries(trainer, optimizer=False, replicated=every)
    body = [e for e in entries if "/embeddings." not in e.key]
    # the model holds a source's embeddings (not a shared table): they are not read here
    embeddings = [] if variant_of(new).source_embeddings else [e for e in entries if "/embeddings." in e.key]
    if variant_of(old).trimmed:
        embeddings = from_phi(embeddings, path)
    saved = saved_keys(path)
    for e in body + embeddings:
        if e.key not in saved and e.key.replace("model/", "model/g0/", 1) in saved:
            local = read_json(path, DEPENDS_FILE).get("config", {}).get("dept.local_steps")
            raise ConfigError(f"config key '{KEY}': checkpoint {path} was taken inside a round, where its source "
                              f"groups hold different values of {e.key[len('model/'):]!r}; name a checkpoint at "
                              f"a round boundary (a step that is a multiple of dept.local_steps={local})")
    return body + embeddings


def reset_references(hooks) -> None:
    """Every outer synchronisation's θ_{t-1} := the (loaded) weights; its optimizer state stays fresh."""
    for sync in hooks.checkpoint_syncs().values():
        sync.reset_reference()


class SourceTables:
    """SPEC / SPEC-OPT: each source's embeddings from checkpoint ``path``, by name
    (``keys[name]``: the checkpoint key of a group-free model key). Call ``(name, embs)`` to
    fill freshly built embeddings of ``name`` in place (no-op for a source the checkpoint lacks,
    allowed by ``train.init_from_new_sources: fresh``)."""

    def __init__(self, path: str, keys: dict[str, Callable[[str], str]], pg, trim: bool = False) -> None:
        self.path, self.keys, self.pg, self.trim = path, keys, pg, trim

    def __call__(self, name: str, embs: list) -> None:
        if name not in self.keys:
            return
        from .dept.hook_state import _emb_params
        from .dept.store import SourceState
        key_of, pg = self.keys[name], self.pg
        entries = [e for n, p in _emb_params(SourceState(embs))
                   for e in entries_of(key_of(param_key(n, None)), p.data, p, pg.tp_rank, pg.tp_size)]
        if self.trim:  # every source's table is the TRIM checkpoint's φ
            from .init_from_trim import from_phi
            entries = from_phi(entries, self.path)
        load_entries(entries, self.path)


def held_sources(path: str) -> dict[str, Callable[[str], str]]:
    """source name → its key in checkpoint ``path`` of a group-free model key: the group that
    had it installed, or a group's store."""
    groups = int(read_json(path, LAYOUT_FILE).get("groups", 1))
    out: dict[str, Callable[[str], str]] = {}
    for g in range(groups):
        meta = read_json(path, f"group{g}.json").get("dept")
        if not isinstance(meta, dict):
            raise ConfigError(f"config key '{KEY}': checkpoint {path}: group{g}.json has no DEPT round state "
                              f"('dept')")
        for name in meta.get("store", {}):
            out[name] = lambda k, n=name: source_key(n, k)
        if meta.get("installed") is not None:
            out[meta["installed"]] = lambda k, g=g: with_group(k, None, g if groups > 1 else None)
    return out


def source_tables(cfg: Config, path: str, pg, sources) -> SourceTables:
    """:class:`SourceTables` of ``cfg``'s sources (``sources``: their SourceInfo), checked: each
    is held by the checkpoint (or ``train.init_from_new_sources: fresh``), with a table of its
    vocabulary size and (SPEC-OPT) the same tokenizer. One ConfigError naming every problem.
    A STD / GLOB checkpoint (SPEC only: the same global tokenizer, ``init_from.check_source``)
    holds every source's table: its shared one; a TRIM checkpoint its φ (``init_from_trim``)."""
    from .init_from_trim import saved_variant
    from .model.embeddings import padded_vocab_size
    from .resume import fingerprint
    old = saved_variant(path)
    if variant_of(old).global_table:  # std / glob: the shared table, trim: φ
        return SourceTables(path, {s.name: (lambda k: k) for s in sources}, pg, trim=variant_of(old).trimmed)
    held = held_sources(path)
    saved = saved_keys(path)
    depends = read_json(path, DEPENDS_FILE)
    old_names = depends.get("config", {}).get("data.sources") or []
    old_tok, new_tok = depends.get("tokenizers", {}), fingerprint(cfg)["tokenizers"]
    fresh = cfg.train.init_from_new_sources == "fresh"
    rows = []  # (config key, what)
    for i, s in enumerate(sources):
        if s.name not in held:
            if not fresh:
                rows.append((f"data.sources[{i}]", f"source {s.name!r}: the checkpoint holds no embeddings of it (its "
                             f"run {'never trained it' if s.name in old_names else 'had no such source'}); "
                             f"train.init_from_new_sources: fresh seeds it as a new run would"))
            continue
        key = held[s.name](param_key(WORD, None))
        want = padded_vocab_size(s.vocab_size, 1)
        if key in saved and saved[key][0] != want:
            rows.append((f"data.sources[{i}]", f"source {s.name!r}: checkpoint key {key!r} has {saved[key][0]} rows, "
                         f"this launch's vocabulary of {s.vocab_size} needs {want}"))
        if variant_of(cfg).own_tokenizer and s.name in old_names:
            a = old_tok.get(f"data.sources[{old_names.index(s.name)}].tokenizer") or {}
            b = new_tok.get(f"data.sources[{i}].tokenizer") or {}
            if a.get("sha256") != b.get("sha256"):
                rows.append((f"data.sources[{i}].tokenizer", f"source {s.name!r}: " + both(
                    a.get("path"), b.get("path"), ("the checkpoint's embeddings were trained with", "this launch has"))
                    + " (another vocabulary)"))
    check_differing(rows, f"from checkpoint {path}", f"{KEY} takes each source's embeddings from it")
    return SourceTables(path, held, pg)


def attach(hooks, tables: Optional[SourceTables]) -> None:
    """The source tables a source's first installation (and evaluation) reads."""
    hooks.strategy.initial_tables = tables
