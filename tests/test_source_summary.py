"""A federated group job reads only its own sources' files; the other sites' sources are known by
their summaries (dept_mega.data.summary): the same round plans, sizes, data identity and
vocabularies as a job that has every file; a wrong or missing summary is refused by key."""
from __future__ import annotations

import json
import os

import pytest
import yaml

from tests.trainer_utils import ROOT, ensure_sample_corpus

BUILD = os.path.join(ROOT, "examples", "data", "build")
NAMES = ["en", "fr", "ja", "ru"]  # K = 4 on G = 2 group jobs: en, ja in job 0; fr, ru in job 1


def _config(tmp_path, variant: str, foreign: dict, group: int = 0, federated: bool = True):
    """A K = 4 config of ``variant`` (spec: the global tokenizer; spec_opt: one per source);
    ``foreign``: {name: summary path or None} for the sources whose files are at another site."""
    from dept_mega.config import load_config
    ensure_sample_corpus()
    ex = os.path.join(ROOT, "examples", "tiny", f"{variant}.yaml")
    with open(ex, encoding="utf-8") as f:
        c = yaml.safe_load(f)
    if c["data"].get("tokenizer"):
        c["data"]["tokenizer"] = os.path.join(ROOT, c["data"]["tokenizer"])
    sources = []
    for i, s in enumerate(c["data"]["sources"][:4]):
        s = dict(s, group=i % 2, **{k: os.path.join(ROOT, s[k]) for k in ("prefix", "tokenizer") if k in s})
        if s["name"] in foreign:  # another site's: its files are not here
            s["prefix"] = f"/nonexistent/site/{s['name']}"
            if s.get("tokenizer"):
                s["tokenizer"] = f"/nonexistent/site/{s['name']}.model"
            if foreign[s["name"]]:
                s["summary"] = foreign[s["name"]]
        sources.append(s)
    c["data"]["sources"] = sources
    c["dept"].update(sampling="temperature", temperature=0.5)
    c["train"].update(steps=4000, run_dir=str(tmp_path / "run"))
    if federated:
        c["federation"] = {"lighthouse": "localhost:1", "group": group, "groups": 2}
    path = tmp_path / f"{variant}_{group}_{len(foreign)}_{federated}.yaml"
    path.write_text(yaml.safe_dump(c))
    return load_config(str(path))


def _summaries(tmp_path, variant: str, names) -> dict:
    """Each source's summary as its site would make it (the command line tool)."""
    from dept_mega.data.summary import main
    out = {}
    full = _config(tmp_path, variant, {}, federated=False)
    for s in full.data.sources:
        if s.name in names:
            path = str(tmp_path / f"{s.name}.summary.json")
            args = [s.prefix, "--name", s.name, "--out", path] + (["--tokenizer", s.tokenizer] if s.tokenizer else [])
            assert main(args) == 0
            out[s.name] = path
    return out


def _plans(cfg, rounds=200):
    from dept_mega.sampling_plan import plan_scheduler
    sched = plan_scheduler(cfg, 2)
    return [sched.plan(r).sources for r in range(rounds)]


def test_group_job_with_summaries_plans_and_records_what_the_job_with_every_file_does(tmp_path, monkeypatch):
    from dept_mega.config import validate
    from dept_mega.data.checks import check_sources
    from dept_mega.data.summary import agreed_facts
    from dept_mega.dept.cost_vocabs import resolve_vocabs
    from dept_mega.dept.source_info import sources_from_config
    from dept_mega.resume import fingerprint
    monkeypatch.delenv("DEPT_GROUP", raising=False)
    summaries = _summaries(tmp_path, "spec", ["fr", "ru"])
    every = _config(tmp_path, "spec", {})  # group job 0 with every site's files (one file system)
    mine = _config(tmp_path, "spec", summaries)  # group job 0 with its own files and the others' summaries
    single = _config(tmp_path, "spec", {}, federated=False)  # the single 2-group job, same group keys
    validate(mine, 1)
    check_sources(mine)  # only en and ja are opened: fr's and ru's files do not exist here
    assert _plans(mine) == _plans(every) == _plans(single)
    assert [(s.name, s.size, s.vocab_size) for s in sources_from_config(mine, 8000)] == \
        [(s.name, s.size, s.vocab_size) for s in sources_from_config(single, 8000)]
    # depends.json: the other sites' data identified by their summaries, as by their files
    assert fingerprint(mine)["data"] == fingerprint(single)["data"] | {"sources": {
        n: dict(v, prefix=mine.data.sources[NAMES.index(n)].prefix) for n, v in fingerprint(single)["data"]["sources"].items()}}
    assert fingerprint(mine)["data"]["sources"]["ru"]["identity"] is not None
    assert agreed_facts(mine) == agreed_facts(every)
    assert resolve_vocabs(mine).trim_vocabs == resolve_vocabs(every).trim_vocabs  # TRIM's |V_k| (costs)
    # the single job is unchanged: it reads every file (a missing one is named as before)
    single = _config(tmp_path, "spec", summaries, federated=False)
    with pytest.raises(Exception, match=r"data.sources\[1\].prefix': file '/nonexistent/site/fr.bin'"):
        validate(single, 2)


def test_a_summary_of_other_data_changes_the_plan_and_is_refused(tmp_path, monkeypatch):
    from dept_mega.config import ConfigError
    from dept_mega.data.checks import check_sources
    from dept_mega.data.summary import agreed_facts
    from dept_mega.dept.federation_config import AGREE_KEYS, agree_hashes
    monkeypatch.delenv("DEPT_GROUP", raising=False)
    summaries = _summaries(tmp_path, "spec", ["fr", "ru"])
    every = _config(tmp_path, "spec", {}, federated=False)
    s = json.load(open(summaries["fr"]))
    s["tokens"] *= 5  # a summary of other data (made before the data changed, or of other files)
    json.dump(s, open(summaries["fr"], "w"))
    wrong = _config(tmp_path, "spec", summaries)
    assert _plans(wrong) != _plans(every)
    # at the fresh start (or a heal) the jobs compare what they know of every source: refused
    right = _config(tmp_path, "spec", {}, group=1)  # the job that holds fr counts its files
    assert agreed_facts(wrong) != agreed_facts(right)
    key = AGREE_KEYS.index("data.sources[].summary")
    assert agree_hashes(wrong)[key] != agree_hashes(right)[key]
    _the_error_names_the_source_its_fields_and_the_stale_copy(wrong, right)
    # a summary of another source, or none at all: a ConfigError naming the key and the command
    json.dump(dict(s, name="ja"), open(summaries["fr"], "w"))
    with pytest.raises(ConfigError, match=r"data.sources\[1\].summary'.*summary of source 'ja'"):
        check_sources(_config(tmp_path, "spec", summaries))
    with pytest.raises(ConfigError, match=r"data.sources\[1\].summary'.*does not exist: make it at the site that "
                                          r"holds source 'fr' with python -m dept_mega.data.summary PREFIX"):
        check_sources(_config(tmp_path, "spec", {"fr": None, "ru": summaries["ru"]}))


def _the_error_names_the_source_its_fields_and_the_stale_copy(wrong, right):
    """Group 0 (``wrong``) read a stale summary of fr, which group 1 (``right``) holds. The error
    said ``config key 'data.sources[].summary[1][1]': group 0 has 886060, group 1 has 177212``
    (and ``[1][2]`` with two sha256): now the source by name, the field, which copy is stale
    and the command that remakes it, at a fresh start and at a heal (either side healing)."""
    from dept_mega.config import ConfigError
    from dept_mega.dept.federation_bookkeeping import value_rows
    from dept_mega.dept.federation_config import (COMPARED_KEYS, OWNER_KEY, SUMMARY_KEY, agree_hashes, agree_values,
                                                  check_agree)
    key, owner = COMPARED_KEYS.index(SUMMARY_KEY), COMPARED_KEYS.index(OWNER_KEY)
    stale, counted = agree_values(wrong)[key][1][1], agree_values(right)[key][1][1]
    command = "python -m dept_mega.data.summary PREFIX --name fr"
    by_group = {0: [agree_values(wrong)[key]], 1: [agree_values(right)[key]]}
    assert value_rows([SUMMARY_KEY], by_group, agree_values(wrong)[owner]) == [(
        "data.sources[1].summary", f"source 'fr': tokens: group 0 has {stale}, group 1 has {counted}; group 1 holds "
        f"its files and counts them, so the summary in group 0 is stale (made before the data changed, or of other "
        f"files): make it again at group 1's site with {command} and copy it to group 0 (data.sources[1].summary)")]
    unknown = value_rows([SUMMARY_KEY], by_group, None)  # the jobs disagree on who holds it
    assert "the group job that holds its files (data.sources[1].group)" in unknown[0][1], unknown
    with pytest.raises(ConfigError) as exc:  # group 1 heals into group 0: the running group's copy is stale
        check_agree(right, {"agree": agree_hashes(wrong), "agree_values": agree_values(wrong)})
    assert str(exc.value).startswith(
        f"config key 'data.sources[1].summary' differs from the running groups': source 'fr': tokens: this job has "
        f"{counted}, the running groups have {stale}; this job holds its files and counts them, so the summary in "
        f"the running groups is stale"), str(exc.value)
    with pytest.raises(ConfigError) as exc:  # group 0 heals: its peer may or may not be the holder
        check_agree(wrong, {"agree": agree_hashes(right), "agree_values": agree_values(right)})
    assert f"source 'fr': tokens: this job has {stale}, the running groups have {counted}; group 1 holds its " \
        f"files and counts them" in str(exc.value) and f"group 1's site with {command}" in str(exc.value)
    # a sha256 by its first 12 digits; every field that differs, named
    sha = [["fr", 5, "a" * 64, None]], [["fr", 5, "b" * 64, "c" * 64]]
    (_, what), = value_rows([SUMMARY_KEY], {0: [sha[0]], 1: [sha[1]]}, [["fr", 1]])
    assert what.startswith("source 'fr': data sha256: group 0 has 'aaaaaaaaaaaa…', group 1 has 'bbbbbbbbbbbb…'; "
                           "tokenizer sha256: group 0 has none, group 1 has 'cccccccccccc…'; group 1 holds"), what
    assert "--tokenizer TOKENIZER --name fr" in what


def test_spec_opt_group_job_knows_the_other_sites_vocabularies_from_their_summaries(tmp_path, monkeypatch):
    from dept_mega.config import validate
    from dept_mega.data.checks import check_sources
    from dept_mega.dept.cost_vocabs import resolve_vocabs
    from dept_mega.dept.source_info import sources_from_config
    from dept_mega.resume import fingerprint
    from dept_mega.run_inputs import vocab_size_of
    monkeypatch.delenv("DEPT_GROUP", raising=False)
    summaries = _summaries(tmp_path, "spec_opt", ["en", "ja"])
    every = _config(tmp_path, "spec_opt", {}, group=1)
    mine = _config(tmp_path, "spec_opt", summaries, group=1)  # job 1: fr, ru here; en (source 0), ja elsewhere
    validate(mine, 1)
    check_sources(mine)
    assert vocab_size_of(mine) == vocab_size_of(every)  # the model's start vocabulary is source 0's
    assert [(s.name, s.size, s.vocab_size) for s in sources_from_config(mine, None)] == \
        [(s.name, s.size, s.vocab_size) for s in sources_from_config(every, None)]
    assert resolve_vocabs(mine).source_vocabs == resolve_vocabs(every).source_vocabs
    assert fingerprint(mine)["tokenizers"]["data.sources[0].tokenizer"]["sha256"] == \
        fingerprint(every)["tokenizers"]["data.sources[0].tokenizer"]["sha256"]
    assert _plans(mine) == _plans(every) == _plans(_config(tmp_path, "spec_opt", {}, federated=False))
    s = json.load(open(summaries["en"]))
    s["tokenizer"] = None  # made without --tokenizer: spec_opt needs the vocabulary
    json.dump(s, open(summaries["en"], "w"))
    with pytest.raises(Exception, match=r"data.sources\[0\].summary'.*no tokenizer vocabulary.*--tokenizer"):
        check_sources(_config(tmp_path, "spec_opt", summaries, group=1))


def test_group_job_reads_only_its_own_sources_records(tmp_path, monkeypatch):
    """The pre-flight's warnings from PREFIX.tokenizer.json: a group job reads its own sources'
    records only, even where the other sites' files are on the same file system."""
    import dept_mega.data.checks as checks
    monkeypatch.delenv("DEPT_GROUP", raising=False)
    read = []
    real = checks._read_record
    monkeypatch.setattr(checks, "_read_record", lambda prefix: read.append(os.path.basename(prefix)) or real(prefix))
    checks.source_warnings(_config(tmp_path, "spec", {}))  # group job 0: en and ja
    assert [p.split("_")[0] for p in read] == ["en", "ja"], read
    read.clear()
    checks.source_warnings(_config(tmp_path, "spec", {}, federated=False))  # the single job: every source
    assert [p.split("_")[0] for p in read] == NAMES, read


def test_foreign_summaries_are_exactly_the_other_sites_sources(tmp_path, monkeypatch):
    """foreign_summaries: {} in the single job (no summary read, even of files not here); in a
    group job the summaries of exactly the sources it does not hold; a missing summary, or a
    config that does not say which group this job is, is a ConfigError naming the key (only the
    cost tools choose to read every file then)."""
    from dept_mega.config import ConfigError
    from dept_mega.data.summary import foreign_summaries
    from dept_mega.dept.cost_vocabs import resolve_vocabs
    monkeypatch.delenv("DEPT_GROUP", raising=False)
    summaries = _summaries(tmp_path, "spec", ["fr", "ru"])
    assert foreign_summaries(_config(tmp_path, "spec", summaries, federated=False)) == {}
    got = foreign_summaries(_config(tmp_path, "spec", summaries))  # group job 0: en, ja here; fr, ru elsewhere
    assert sorted(got) == [1, 3]
    for i, name in ((1, "fr"), (3, "ru")):
        with open(summaries[name], encoding="utf-8") as f:
            assert got[i] == json.load(f)
    # group job 1 on one file system: en's and ja's numbers from their files, as their summaries say
    other = foreign_summaries(_config(tmp_path, "spec", {}, group=1))
    assert sorted(other) == [0, 2] and [other[i]["name"] for i in (0, 2)] == ["en", "ja"]
    with pytest.raises(ConfigError, match=r"data.sources\[1\].summary'.*does not exist: make it at the site that "
                                          r"holds source 'fr' with python -m dept_mega.data.summary PREFIX"):
        foreign_summaries(_config(tmp_path, "spec", {"fr": None, "ru": summaries["ru"]}))
    unknown = _config(tmp_path, "spec", {}, group=None)  # federation.group null, DEPT_GROUP unset
    with pytest.raises(ConfigError, match=r"'federation.group': null and DEPT_GROUP is not set"):
        foreign_summaries(unknown)
    # the cost estimates of such a config read every source's files, as the single job's do
    assert resolve_vocabs(unknown).trim_vocabs == resolve_vocabs(_config(tmp_path, "spec", {}, federated=False)).trim_vocabs


def test_distinct_id_pass_prints_progress(tmp_path, monkeypatch, capsys):
    """The summary's pass over the .bin (the distinct ids) prints progress lines, percent of the
    tokens with an ETA, reaching 100 %; a second run reads the cached count and prints none."""
    import functools

    import dept_mega.data.sources as sources
    from dept_mega.data.summary import main
    from tests.data_utils import numbered_docs, write_docs
    prefix = write_docs(str(tmp_path / "d"), numbered_docs(30, seed=2))
    n = sum(len(d) for d in numbered_docs(30, seed=2))
    monkeypatch.setattr(sources, "token_counts", functools.partial(sources.token_counts, chunk_tokens=100))
    assert main([prefix, "--log-interval", "0"]) == 0
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("[summary] distinct ids:")]
    assert len(lines) == -(-n // 100), lines
    assert lines[0].split()[4] == "(100" and lines[-1].split()[4] == f"({n:,}" and " 100.0% " in lines[-1]
    assert "ETA 0:00:00" in lines[-1]
    assert main([prefix, "--log-interval", "0"]) == 0
    assert "[summary] distinct ids" not in capsys.readouterr().err
