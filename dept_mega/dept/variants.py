"""What each DEPT variant shares across source groups (docs/dept.md, paper Table 1), and the
strategy object that implements it (strategy.py).

| variant  | body        | token table / untied head          | learned positions | per-source state     |
|----------|-------------|------------------------------------|-------------------|----------------------|
| glob     | outer sync  | outer sync (dense, like the body)  | outer sync        | none (group-owned)   |
| trim     | outer sync  | global φ; outer optimizer on the   | outer sync        | compact-table optim. |
|          |             | rows of V_k (sparse)               |                   |                      |
| spec     | outer sync  | per source, never averaged         | per source        | embeddings + optim.  |
| spec_opt | outer sync  | per source, own tokenizer          | per source        | embeddings + optim.  |

With ``dept.body_optimizer_state: source`` every variant's sources also own the body's inner
AdamW state. Categories: body → ``outer_body``; every embedding part that is synchronised
(GLOB's tables and positions, TRIM's rows and positions) → ``outer_embedding``; per-source
state moving between groups → ``source_move``.
"""
from __future__ import annotations

from ..variant import VARIANTS
from .source_info import source_seed  # noqa: F401  (importable from here too)

#: the variants with rounds (a strategy each); std trains without them
DEPT_VARIANTS = tuple(name for name, v in VARIANTS.items() if v.rounds)


def make_strategy(name: str, ctx):
    """The strategy of variant ``name`` (imported here, so that importing dept_mega.dept does
    not import the model package)."""
    if name == "glob":
        from .glob_strategy import GlobStrategy
        return GlobStrategy(ctx)
    if name == "trim":
        from .trim_strategy import TrimStrategy
        return TrimStrategy(ctx)
    if name in ("spec", "spec_opt"):
        from .spec_strategy import SpecStrategy
        return SpecStrategy(ctx, name)
    raise ValueError(f"dept.variant: {name!r} has no DEPT round hooks (expected one of "
                     f"{' | '.join(DEPT_VARIANTS)}; std uses the loop's StdHooks)")
