"""What each DEPT variant shares across source groups (design.md §3, paper Table 1).

| variant  | body        | token table / untied head          | learned positions | per-source state     |
|----------|-------------|------------------------------------|-------------------|----------------------|
| glob     | outer sync  | outer sync (dense, like the body)  | outer sync        | none (group-owned)   |
| trim     | outer sync  | global φ; sparse row means of V_k  | outer sync        | compact-table optim. |
| spec     | outer sync  | per source, never averaged         | per source        | embeddings + optim.  |
| spec_opt | outer sync  | per source, own tokenizer          | per source        | embeddings + optim.  |

Categories: body → ``outer_body``; every embedding part that is synchronised (GLOB's tables
and positions, TRIM's rows and positions) → ``outer_embedding``; per-source state moving
between groups → ``source_move``.
"""
from __future__ import annotations

from dataclasses import dataclass

DEPT_VARIANTS = ("glob", "trim", "spec", "spec_opt")


@dataclass(frozen=True)
class VariantSpec:
    name: str
    sync_embeddings_dense: bool  # GLOB: every embedding parameter like the body
    trimmed: bool  # TRIM: global table outside the model, compact per-source tables
    per_source_embeddings: bool  # SPEC / SPEC-OPT: a source owns its embeddings
    own_tokenizer: bool  # SPEC-OPT

    @property
    def has_source_state(self) -> bool:
        """Whether sources carry state of their own between rounds (moved with the source)."""
        return self.trimmed or self.per_source_embeddings


VARIANTS = {
    "glob": VariantSpec("glob", True, False, False, False),
    "trim": VariantSpec("trim", False, True, False, False),
    "spec": VariantSpec("spec", False, False, True, False),
    "spec_opt": VariantSpec("spec_opt", False, False, True, True),
}


def variant_spec(name: str) -> VariantSpec:
    if name not in VARIANTS:
        raise ValueError(f"dept.variant: {name!r} has no DEPT round hooks (expected one of "
                         f"{' | '.join(DEPT_VARIANTS)}; std uses the loop's StdHooks)")
    return VARIANTS[name]


def source_seed(seed: int, source_index: int) -> int:
    """The init seed of source k's own embeddings (SPEC/SPEC-OPT): reproducible per source,
    different between sources, independent of the group that first samples it."""
    return int(seed) + 1_000_003 * (int(source_index) + 1)
