"""dept_mega.variant: the facts table says what docs/dept.md's variant table and the
strategies say (sabotage: flip any one fact, and a test here fails)."""
from __future__ import annotations

import os

import pytest

from dept_mega.config import CHOICES, ConfigError, config_from_dict
from dept_mega.variant import VARIANT_NAMES, VARIANTS, variant_of

DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "dept.md")


def _doc_rows() -> dict[str, list[str]]:
    """docs/dept.md "Variants: what crosses groups": variant → its cells."""
    text = open(DOC, encoding="utf-8").read()
    table = text.split("## Variants: what crosses groups", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines()[3:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def test_the_names_are_the_configs_choices_in_order():
    assert VARIANT_NAMES == ("std", "glob", "trim", "spec", "spec_opt")
    assert CHOICES["dept.variant"] is VARIANT_NAMES
    assert all(VARIANTS[n].name == n for n in VARIANT_NAMES)


def test_facts_match_the_docs_table():
    rows = _doc_rows()
    assert set(rows) == {"glob", "trim", "spec", "spec_opt"}  # std: no rounds, nothing crosses groups
    for name, v in VARIANTS.items():
        assert v.rounds == (name in rows), name
        if not v.rounds:
            assert not (v.own_embeddings or v.own_tokenizer or v.source_embeddings or v.synced_table
                        or v.trimmed), name
            continue
        body, table, positions, state = rows[name]
        assert v.own_embeddings == table.startswith("per source"), name
        assert v.own_embeddings == (positions == "per source"), name
        assert v.own_tokenizer == ("own tokenizer" in table), name
        assert v.source_embeddings == (state != "none"), name
        assert v.synced_table == ("like the body" in table), name
        assert v.trimmed == ("trimmed rows" in table), name
        assert v.global_table == (not v.own_embeddings)


def test_facts_by_name():
    """The sets the code relied on by name, spelled out."""
    def having(fact):
        return {n for n, v in VARIANTS.items() if getattr(v, fact)}
    assert having("rounds") == {"glob", "trim", "spec", "spec_opt"}
    assert having("own_embeddings") == {"spec", "spec_opt"}
    assert having("own_tokenizer") == {"spec_opt"}
    assert having("source_embeddings") == {"trim", "spec", "spec_opt"}
    assert having("synced_table") == {"glob"}
    assert having("trimmed") == {"trim"}
    assert having("global_table") == {"std", "glob", "trim"}


def test_source_embeddings_is_what_the_strategies_say():
    from dept_mega.dept.glob_strategy import GlobStrategy
    from dept_mega.dept.spec_strategy import SpecStrategy
    from dept_mega.dept.trim_strategy import TrimStrategy
    for name, cls in (("glob", GlobStrategy), ("trim", TrimStrategy), ("spec", SpecStrategy),
                      ("spec_opt", SpecStrategy)):
        assert VARIANTS[name].source_embeddings == cls.source_embeddings, name


def test_variant_of_a_name_a_config_and_an_unknown_name():
    assert variant_of("trim") is VARIANTS["trim"]
    cfg = config_from_dict({"dept": {"variant": "glob"}})
    assert variant_of(cfg) is VARIANTS["glob"]
    assert variant_of(cfg.dept) is VARIANTS["glob"]
    with pytest.raises(ConfigError, match=r"config key 'dept.variant': 'spec-opt' is not one of "
                                          r"std \| glob \| trim \| spec \| spec_opt"):
        variant_of("spec-opt")
