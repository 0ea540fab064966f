"""What a DEPT variant is, as facts: one frozen :class:`Variant` per ``dept.variant`` value.

The code asks these questions instead of comparing the variant's name, so that the meaning of
each test is written once (docs/dept.md "Variants: what crosses groups"; the runtime behaviour
lives in the strategies, dept/variants.py ``make_strategy``):

| variant  | rounds | own_embeddings | own_tokenizer | source_embeddings | synced_table | trimmed |
|----------|--------|----------------|---------------|-------------------|--------------|---------|
| std      |        |                |               |                   |              |         |
| glob     | x      |                |               |                   | x            |         |
| trim     | x      |                |               | x                 |              | x       |
| spec     | x      | x              |               | x                 |              |         |
| spec_opt | x      | x              | x             | x                 |              |         |

Dependency-free (the schema's choices list and config.py import it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config_error import ConfigError


@dataclass(frozen=True)
class Variant:
    """One DEPT variant's static facts (see the module table)."""

    name: str
    #: Groups train apart and synchronise every ``dept.local_steps`` (every variant but std).
    rounds: bool
    #: Each source owns its token table (and positions, head), never averaged (spec, spec_opt).
    own_embeddings: bool
    #: Each source has its own tokenizer and vocabulary, ``data.sources[].tokenizer`` (spec_opt).
    own_tokenizer: bool
    #: A source's embeddings are installed per round, kept per source in the store and the
    #: checkpoint, and move with it (trim's compact tables, spec's and spec_opt's own tables).
    source_embeddings: bool
    #: The global token table / head is outer-synchronised whole, densely, like the body (glob).
    synced_table: bool
    #: Global table φ outside the model; a source trains the rows of its V_k in a compact
    #: table, synchronised sparsely row by row (trim).
    trimmed: bool

    @property
    def global_table(self) -> bool:
        """One token table of the global vocabulary (std, glob, trim): a source the run never
        trained can be evaluated with it."""
        return not self.own_embeddings


VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant("std", rounds=False, own_embeddings=False, own_tokenizer=False, source_embeddings=False,
            synced_table=False, trimmed=False),
    Variant("glob", rounds=True, own_embeddings=False, own_tokenizer=False, source_embeddings=False,
            synced_table=True, trimmed=False),
    Variant("trim", rounds=True, own_embeddings=False, own_tokenizer=False, source_embeddings=True,
            synced_table=False, trimmed=True),
    Variant("spec", rounds=True, own_embeddings=True, own_tokenizer=False, source_embeddings=True,
            synced_table=False, trimmed=False),
    Variant("spec_opt", rounds=True, own_embeddings=True, own_tokenizer=True, source_embeddings=True,
            synced_table=False, trimmed=False),
)}

#: Every ``dept.variant`` value, in the order the docs list them.
VARIANT_NAMES: tuple[str, ...] = tuple(VARIANTS)


def variant_of(name_or_cfg: Any) -> Variant:
    """The :class:`Variant` of a name, or of a config (anything with ``.dept.variant``, or a
    ``DeptConfig``-like object with ``.variant``). An unknown name: the ConfigError of
    ``dept.variant``'s choices."""
    name = name_or_cfg
    if not isinstance(name, str):
        name = getattr(getattr(name_or_cfg, "dept", name_or_cfg), "variant")
    v = VARIANTS.get(name)
    if v is None:
        raise ConfigError(f"config key 'dept.variant': {name!r} is not one of {' | '.join(VARIANT_NAMES)}")
    return v


def one_group_data_hint(cfg: Any, world_size: int) -> str:
    """What makes a world of ``world_size`` ranks one group under std (the only variant that
    trains one): the ``parallel.data`` that fills it, or as many processes as the layout has.
    Empty for the DEPT variants, and where tensor × pipeline does not divide the world."""
    p = cfg.parallel
    tp = p.tensor * p.pipeline
    if variant_of(cfg).rounds or world_size % tp:
        return ""
    return (f"set parallel.data={world_size // tp} (world size / (tensor × pipeline); Megatron-LM infers the "
            f"data-parallel size, dept_mega does not: the ranks left over form DEPT source groups), "
            f"or launch {tp * p.data} process(es)")
