"""docs/config.md is generated from dept_mega/config_schema.py and kept in step with it: every key
documented with its meaning, no key documented that is gone, the file not stale, and every
default shown the way an override would set it."""
from __future__ import annotations

import os
import re

import pytest

from dept_mega import config_doc
from dept_mega.config import Config, ProfileConfig, config_from_dict, get_key

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "config.md")


def _documented() -> list[str]:
    with open(DOC, encoding="utf-8") as f:
        return re.findall(r"^\| `([^`]+)` \|", f.read(), flags=re.M)


def test_every_key_documented_and_none_gone():
    keys, documented = config_doc.all_keys(), _documented()
    assert not set(keys) - set(documented), f"missing from docs/config.md: {sorted(set(keys) - set(documented))}"
    assert not set(documented) - set(keys), f"documented but gone: {sorted(set(documented) - set(keys))}"
    assert len(documented) == len(set(documented)) and "train.global_batch_size" in keys


def test_doc_is_not_stale():
    with open(DOC, encoding="utf-8") as f:
        assert f.read() == config_doc.render(), "docs/config.md is stale: run python tools/gen_config_doc.py"


def test_meanings_come_from_the_comments():
    src = ('class A:\n'
           '    #: first line\n'
           '    #: second line\n'
           '    x: int = 1  #: and after\n'
           '    # a plain comment is no meaning\n'
           '    y: int = 2\n'
           '    z: int = 3  #: z\n')
    assert config_doc.field_comments(src) == {("A", "x"): "first line second line and after", ("A", "z"): "z"}


def test_a_key_without_a_meaning_is_an_error(monkeypatch):
    monkeypatch.setattr(config_doc, "field_comments", lambda source: {})
    with pytest.raises(ValueError, match="model.num_layers"):
        config_doc.sections()


@pytest.mark.parametrize("key", [k for k in config_doc.all_keys(strict=False) if "[]" not in k])
def test_documented_default_is_the_default(key):
    row = next(k for s in config_doc.sections(strict=False) for k in s.keys if k.key == key)
    cfg = config_from_dict({}, [f"{key}={row.default}"] if row.default != '""' else [])
    leaf = key.split(".")[-1]
    want = getattr(ProfileConfig(), leaf) if key.startswith("train.profile.") else get_key(Config(), key)
    assert get_key(cfg, key) == want


def test_migration_tables_name_only_keys_that_exist():
    """docs/migrating.md's right-hand column (the dept_mega side of each Megatron-LM / torchtitan
    argument) names config keys; each must be a key of the schema, so a renamed key fails here."""
    with open(os.path.join(ROOT, "docs", "migrating.md"), encoding="utf-8") as f:
        rows = [ln.split(" | ") for ln in f if ln.startswith("| `")]
    keys = set(config_doc.all_keys())
    sections = {k.split(".")[0] for k in keys if "." in k}
    named = set()
    for cells in rows:
        for tok in re.findall(r"`([a-z_0-9.\[\]]+)(?::[^`]*)?`", cells[1]):
            if tok.split(".")[0] in sections or tok in keys:
                named.add(tok)
    missing = sorted(t for t in named if t not in keys)
    assert not missing, f"docs/migrating.md names keys the schema lacks: {missing}"
    assert {"parallel.data", "train.global_batch_size", "optim.warmup_steps", "model.recompute"} <= named
