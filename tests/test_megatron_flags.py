"""Megatron-LM flags given to the entry points: refused with the override that replaces them
(dept_mega.megatron_flags), from a table that matches docs/migrating.md and the config schema."""
from __future__ import annotations

import dataclasses
import os
import re
import types
import typing

import pytest

from dept_mega.config_schema import Config
from dept_mega.megatron_flags import MEGATRON_FLAGS, Flag, unknown_flags_message
from tests.trainer_utils import ROOT


def _schema_has(key: str) -> bool:
    """Whether ``key`` (dotted) is a field of the config schema."""
    cls: typing.Any = Config
    for part in key.split("."):
        if not dataclasses.is_dataclass(cls):
            return False
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return False
        tp = hints[part]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1
        cls = args[0] if optional else tp
    return True


def _doc_rows() -> list[tuple[str, str]]:
    """(Megatron-LM cell, dept_mega cell) of each row of docs/migrating.md's Megatron-LM table."""
    with open(os.path.join(ROOT, "docs", "migrating.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Megatron-LM arguments", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 3 and not set(cells[0]) <= set("-") and cells[0] != "Megatron-LM":
            rows.append((cells[0], cells[1]))
    return rows


def _flags_in(cell: str) -> set[str]:
    return {m for span in re.findall(r"`([^`]*)`", cell) for m in re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", span)}


def _keys_in(cell: str) -> list[str]:
    return re.findall(r"`([^`]*)`", cell)


def _names_key(span: str, key: str) -> bool:
    """Whether a backticked span of the dept_mega column names ``key`` (``key``, ``key: v``,
    ``key.sub``)."""
    return span == key or (span.startswith(key) and span[len(key)] in ":.= ")


def test_every_key_the_table_names_is_a_config_key():
    keys = {f.key for f in MEGATRON_FLAGS.values() if f.key is not None}
    assert keys and not [k for k in sorted(keys) if not _schema_has(k)]
    assert not _schema_has("parallel.tensr") and not _schema_has("train.profile.begin")  # the check can fail


def test_the_table_and_docs_migrating_md_list_the_same_flags_and_keys():
    rows = _doc_rows()
    assert len(rows) > 40
    documented = set().union(*(_flags_in(flags) for flags, _ in rows))
    assert documented == set(MEGATRON_FLAGS), (sorted(documented - set(MEGATRON_FLAGS)),
                                               sorted(set(MEGATRON_FLAGS) - documented))
    for flag, f in MEGATRON_FLAGS.items():
        if f.key is None:
            continue
        assert any(flag in _flags_in(flags) and any(_names_key(s, f.key) for s in _keys_in(keys))
                   for flags, keys in rows), f"docs/migrating.md has no row of {flag} with `{f.key}`"


def test_a_megatron_flag_is_answered_with_its_override():
    argv = ["--config", "c.yaml", "--tensor-model-parallel-size", "2", "--sequence-parallel",
            "--lr-decay-style=WSD", "--distributed-timeout-minutes", "10", "--tensorboard-dir", "tb"]
    unknown = ["--tensor-model-parallel-size", "--sequence-parallel", "--lr-decay-style=WSD",
               "--distributed-timeout-minutes", "--tensorboard-dir", "tb"]
    msg = unknown_flags_message(unknown, argv)
    assert msg.startswith("Megatron-LM flags are not options here; config keys are set as key=value overrides: "
                          "--tensor-model-parallel-size: parallel.tensor=2; "
                          "--sequence-parallel: parallel.sequence_parallel=true; "
                          "--lr-decay-style: optim.lr_decay_style=wsd; "
                          "--distributed-timeout-minutes: train.init_timeout_s=600 (seconds); "
                          "--tensorboard-dir: no key: TensorBoard files go to RUN/tb/"), msg
    assert msg.endswith("(every flag and its key: docs/migrating.md)") and "unrecognized" not in msg, msg


def test_other_unknown_options_keep_argparses_words_and_point_to_overrides():
    msg = unknown_flags_message(["--bogus", "--num-layers"], ["--bogus", "3", "--num-layers"])
    assert "--num-layers: model.num_layers=VALUE" in msg
    assert msg.endswith("; unrecognized arguments: --bogus (config keys are set as key=value overrides, e.g. "
                        "parallel.tensor=2: docs/config.md; Megatron-LM's flags: docs/migrating.md)"), msg


@pytest.mark.parametrize("module", ["dept_mega.train", "dept_mega.evaluate"])
def test_the_entry_points_refuse_megatron_flags_with_the_hint(module, capsys):
    import importlib
    main = importlib.import_module(module).main
    first = ["--config", "c.yaml"] if module == "dept_mega.train" else ["--run-dir", "r", "--out", "o.json"]
    with pytest.raises(SystemExit) as exc:
        main([*first, "--pipeline-model-parallel-size", "4", "parallel.data=1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error: Megatron-LM flags are not options here" in err and "parallel.pipeline=4" in err, err


def test_the_suggested_overrides_are_accepted_by_the_config():
    """The override a value flag suggests, with Megatron's own spelling of the value, loads."""
    from dept_mega.config import load_config
    examples = {"--lr-decay-style": "inverse-square-root", "--position-embedding-type": "learned_absolute",
                "--normalization": "RMSNorm", "--fp8-recipe": "tensorwise", "--distributed-timeout-minutes": "2",
                "--split": "969,30,1", "--tensor-model-parallel-size": "2"}
    for flag, value in examples.items():
        override = unknown_flags_message([flag], [flag, value]).split(f"{flag}: ", 1)[1].split(" ", 1)[0]
        override = override.rstrip(";")
        key = MEGATRON_FLAGS[flag].key
        cfg = load_config(None, [override]).to_dict()
        node = cfg
        for part in key.split("."):
            node = node[part]
        assert node not in (None, ""), (flag, override)
    assert load_config(None, ["optim.lr_decay_style=inverse-square-root"]).optim.lr_decay_style == \
        "inverse-square-root"


def test_flag_records_are_well_formed():
    for flag, f in MEGATRON_FLAGS.items():
        assert isinstance(f, Flag) and flag.startswith("--")
        assert f.key is not None or f.note.startswith("no key"), flag
        assert not f.switch or f.value is not None or f.key is None, flag


def test_overrides_may_follow_options_in_every_entry_point(tmp_path, capsys):
    """key=value overrides after an option (``--steps 6 train.micro_batch_size=8 --out X``), as a
    user writes them, parse in tools/benchmark.py and dept_mega.evaluate as in dept_mega.train."""
    import importlib.util
    import os

    from dept_mega import evaluate
    spec = importlib.util.spec_from_file_location("benchmark_tool", os.path.join(ROOT, "tools", "benchmark.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cfg = os.path.join(ROOT, "examples", "tiny", "std.yaml")
    # parsed, then refused for --steps 0 (after parsing: no "unrecognized arguments")
    assert bench.main(["--config", cfg, "--steps", "0", "train.micro_batch_size=4", "--out", str(tmp_path / "b.json"),
                       "model.vocab_size=64"]) == 2
    err = capsys.readouterr().err
    assert "--steps must be >= 1" in err and "unrecognized" not in err, err
    try:  # parsed, then refused: no config.yaml in the run directory
        rc = evaluate.main(["--run-dir", str(tmp_path / "nope"), "--eval-iters", "1", "parallel.data=1",
                            "--out", str(tmp_path / "e.json"), "parallel.tensor=1"])
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2 and "unrecognized" not in err and "config.yaml" in err, (rc, err)
