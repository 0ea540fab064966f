"""The shipped sample corpus: size, sources, well-formed lines, scripts."""
from __future__ import annotations

import json
import os
import re

from dept_mega.data.jsonl import BadInputReport, iter_texts
from tests.data_utils import ROOT

DATA = os.path.join(ROOT, "examples", "data")
SOURCES = ("en", "fr", "ja", "ru", "code")


def test_corpus_is_small_clean_and_heterogeneous():
    files = [os.path.join(DATA, f"{s}.jsonl") for s in SOURCES]
    sizes = [os.path.getsize(f) for f in files]
    assert sum(sizes) <= 5_000_000 and all(s >= 300_000 for s in sizes)
    texts = {}
    for s, f in zip(SOURCES, files):
        report = BadInputReport()
        texts[s] = list(iter_texts([f], "text", report))
        assert report.total == 0, (f, report.counts)
        assert len(texts[s]) >= 100
        assert max(len(t.encode()) for t in texts[s]) < 20_000  # documents of a few KB
        with open(f, encoding="utf-8") as fh:
            assert all(json.loads(line)["source"] == s for line in fh)
    joined = {s: "".join(t) for s, t in texts.items()}
    assert len(re.findall(r"[\u3040-\u30ff\u4e00-\u9fff]", joined["ja"])) > 50_000  # kana / kanji
    assert len(re.findall(r"[\u0400-\u04ff]", joined["ru"])) > 100_000  # Cyrillic
    assert len(re.findall(r"[àâçéèêëîïôûùüœ]", joined["fr"])) > 1_000
    assert joined["code"].count("def ") > 500 and joined["code"].count("import ") > 50
    assert "Debian" in joined["en"]
    assert os.path.exists(os.path.join(DATA, "SOURCES.md")) and os.path.exists(os.path.join(DATA, "build_corpus.py"))
