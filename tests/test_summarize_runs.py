import json
from pathlib import Path

import pytest

from dept_mega.config import load_config, save_config
from tests.tool_run import run_tool

ROOT = Path(__file__).resolve().parents[1]
TOOL = str(ROOT / "tools/summarize_runs.py")


@pytest.fixture
def io(capsys, monkeypatch):
    """run_tool's capture and patching (the tool runs in this process)."""
    return {"capsys": capsys, "monkeypatch": monkeypatch}


def _ok(res) -> str:
    assert res.returncode == 0, res.stderr
    return res.stdout


def _fake_run(d: Path, variant: str, bpb: dict, outer_bytes: list[int], dtype: str = "fp32",
              eval_bytes: dict | None = None, eval_tokens: int = 1) -> None:
    d.mkdir()
    cfg = load_config(None, [f"dept.variant={variant}", "model.vocab_size=300", "model.num_layers=2",
                             "model.hidden_size=32", "model.num_attention_heads=4", "model.seq_length=64",
                             "train.eval_iters=4", "train.global_batch_size=8",
                             "dept.local_steps=5", "train.steps=10", f"dept.outer_comm_dtype={dtype}"])
    save_config(cfg, d / "config.yaml")
    recs = [{"kind": "train", "step": 10, "round": 1, "time": 0, "loss": 3.0, "tokens": 64}]
    recs += [{"kind": "outer", "step": 5 * (i + 1), "round": i, "time": 0,
              "bytes": {"outer_body": b, "outer_embedding": 0}, "seconds": 0.1} for i, b in enumerate(outer_bytes)]
    recs.append({"kind": "eval", "step": 10, "round": 1, "time": 0,
                 "by_source": {k: {"loss": 1, "ppl": 2.7, "bpb": v, "tokens": eval_tokens,
                                   "bytes": (eval_bytes or {}).get(k, 1)} for k, v in bpb.items()}})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (d / "params.json").write_text(json.dumps({"ranks": [{"body": 100, "embeddings": 7}, {"body": 100, "embeddings": 9}]}))


def test_summary_table_and_json(tmp_path, io):
    _fake_run(tmp_path / "a", "std", {"en": 2.0, "fr": 3.0}, [])
    _fake_run(tmp_path / "b", "glob", {"en": 1.0, "fr": 2.0}, [1000, 3000])
    out = _ok(run_tool(TOOL, str(tmp_path / "a"), str(tmp_path / "b"), "--json", str(tmp_path / "s.json"), **io))
    lines = {ln.split()[0]: ln.split()[1:] for ln in out.splitlines() if ln.strip() and not ln.startswith("-")}
    assert lines["mean"] == ["2.5000", "1.5000"]
    # decimal units, spelt as everywhere else (dept_mega.metrics.format_bytes: kB = 1000 bytes)
    assert lines["outer_body/round"] == ["-", "2.00", "kB"]
    # measured cross-group bytes: 4000 over the run's 10 inner steps
    assert lines["cross-group/step"] == ["-", "400", "B"] and lines["cross-group"] == ["total", "-", "4.00", "kB"]
    assert lines["emb"][-1] == "7-9"
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary[1]["rounds"] == 2 and summary[1]["outer_bytes_per_round"]["outer_body"] == 2000
    assert summary[1]["cross_group_bytes_per_step"] == 400 and summary[1]["steps"] == 10


def test_a_diverged_source_shows_nan_not_a_crash(tmp_path, io):
    """A non-finite BPB is written as null (metrics.make_record): the source's cell and the
    run's mean show nan, with a line saying why, instead of a TypeError; a source the run did
    not evaluate stays "-". The federated mean line likewise."""
    _fake_run(tmp_path / "a", "std", {"en": 2.0, "fr": 3.0}, [])
    _fake_run(tmp_path / "b", "glob", {"en": 1.0, "fr": None}, [1000, 3000])
    _fake_run(tmp_path / "c", "glob", {"en": 1.0}, [1000, 3000])
    out = _ok(run_tool(TOOL, *(str(tmp_path / n) for n in "abc"), **io))
    lines = {ln.split()[0]: ln.split()[1:] for ln in out.splitlines() if ln.strip() and not ln.startswith("-")}
    assert lines["fr"] == ["3.0000", "nan", "-"] and lines["mean"] == ["2.5000", "nan", "1.0000"]
    assert "nan: a BPB that is not finite (the run diverged" in out
    for g, bpb in ((0, {"en": 1.0}), (1, {"fr": None})):
        _fake_run(tmp_path / f"g{g}", "spec", bpb, [1000, 1000])
        cfg = load_config(tmp_path / f"g{g}" / "config.yaml",
                          ["federation.lighthouse=lh:1", f"federation.group={g}", "federation.groups=2"])
        save_config(cfg, tmp_path / f"g{g}" / "config.yaml")
    out = _ok(run_tool(TOOL, str(tmp_path / "g0"), str(tmp_path / "g1"), **io))
    assert "federated SPEC (SPEC g0, SPEC g1): mean over its 2 sources nan" in out


def test_outer_dtype_shows_in_bytes_not_in_predicted_parameters(tmp_path, io):
    """fp32 and int8 GLOB predict the same parameters per step (paper Table 1, labelled as
    parameters); the row of bytes is measured and shows the dtype's saving, and the dtype is
    printed."""
    _fake_run(tmp_path / "fp32", "glob", {"en": 1.0}, [40000, 40000])
    _fake_run(tmp_path / "int8", "glob", {"en": 1.0}, [10300, 10300], dtype="int8")
    out = _ok(run_tool(TOOL, str(tmp_path / "fp32"), str(tmp_path / "int8"), **io))
    rows = {ln[:22].strip(): ln[22:].split() for ln in out.splitlines() if ln.strip() and not ln.startswith("-")}
    assert rows["outer dtype"] == ["fp32", "int8"]
    assert rows["cross-group/step"] == ["8.00", "kB", "2.06", "kB"]
    table1 = rows["Table 1 params/step"]
    assert len(table1) == 2 and table1[0] == table1[1]  # parameters: dtype-blind by definition
    assert "sync params/step" not in out


def test_federated_group_job_shows_membership(tmp_path, io):
    """Group jobs' membership records (leave, join, heal), one line per job under the table,
    the groups per round, columns named by run directory where the variants are the same,
    and the tokens trained: logged every few steps, none over a healed job's jump."""
    _fake_run(tmp_path / "g0", "spec", {"en": 1.0}, [1000, 1000])
    _fake_run(tmp_path / "g1", "spec", {"fr": 1.5}, [1000, 1000])
    recs = [json.loads(ln) for ln in (tmp_path / "g0" / "metrics.jsonl").read_text().splitlines()]
    for rec, groups in zip([r for r in recs if r["kind"] == "outer"], ([0, 1, 2], [0, 1])):
        rec["groups"] = groups
    recs += [{"kind": "membership", "step": 0, "round": 0, "time": 0, "groups": [0, 1, 2], "joined": [0, 1, 2],
              "left": [], "healed": False},
             {"kind": "membership", "step": 10, "round": 1, "time": 0, "groups": [0, 1], "joined": [], "left": [2],
              "healed": False},
             {"kind": "membership", "step": 10, "round": 2, "time": 0, "groups": [0, 1, 2, 3], "joined": [2, 3],
              "left": [], "healed": True}]
    (tmp_path / "g0" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    # g1: logged every 2 steps; trained steps 1-4, healed at the peers' step 8, trained 9-10
    recs = [r for r in (json.loads(ln) for ln in (tmp_path / "g1" / "metrics.jsonl").read_text().splitlines())
            if r["kind"] != "train"]
    recs += [{"kind": "train", "step": s, "round": 0, "time": 0, "loss": 3.0, "tokens": 64} for s in (2, 4, 10)]
    recs += [{"kind": "membership", "step": 0, "round": 0, "time": 0, "groups": [0, 1], "joined": [0, 1],
              "left": [], "healed": False},
             {"kind": "membership", "step": 8, "round": 4, "time": 0, "groups": [0, 1], "joined": [0, 1],
              "left": [], "healed": True}]
    (tmp_path / "g1" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    for g in (0, 1):  # group jobs 0 and 1 of a federated run of 3
        cfg = load_config(tmp_path / f"g{g}" / "config.yaml",
                          ["federation.lighthouse=lh:1", f"federation.group={g}", "federation.groups=3"])
        save_config(cfg, tmp_path / f"g{g}" / "config.yaml")
    out = _ok(run_tool(TOOL, str(tmp_path / "g0"), str(tmp_path / "g1"), "--json", str(tmp_path / "s.json"), **io))
    lines = {ln.split()[0]: ln.split()[1:] for ln in out.splitlines() if ln.strip() and not ln.startswith("-")}
    assert lines["validation"] == ["BPB", "SPEC", "g0", "SPEC", "g1"]
    assert lines["groups/round"] == ["2-3", "-"]
    assert "  SPEC g0: r0+0,1,2 r1-2 r2+2,3h" in out.splitlines()
    assert "  SPEC g1: r0+0,1 r4+0,1h" in out.splitlines()
    assert lines["train"] == ["tokens", "640", "384"]  # g0: 10 steps x 64; g1: (2 + 2 + 2) x 64
    assert ("federated SPEC (SPEC g0, SPEC g1): mean over its 2 sources 1.2500 (group job(s) 2 not given: their "
            "sources are missing)") in out.splitlines()
    recs = (tmp_path / "g1" / "metrics.jsonl").read_text().replace('"kind": "eval", "step": 10', '"kind": "eval", "step": 8')
    (tmp_path / "g1" / "metrics.jsonl").write_text(recs)
    out = _ok(run_tool(TOOL, str(tmp_path / "g0"), str(tmp_path / "g1"), **io))
    assert "not given: their sources are missing) (evaluated at different steps: 10, 8)" in out, out
    summary = json.loads((tmp_path / "s.json").read_text())
    assert [m["left"] for m in summary[0]["membership"]] == [[], [2], []]
    assert [s["train_tokens"] for s in summary] == [640, 384]


def test_missing_run_is_a_clear_error(tmp_path):
    """(The command line itself, in a fresh interpreter, as the docs give it.)"""
    import subprocess
    import sys
    res = subprocess.run([sys.executable, TOOL, str(tmp_path / "nope")], capture_output=True, text=True)
    assert res.returncode == 2 and "config.yaml does not exist" in res.stderr


def test_unreachable_tokenizer_leaves_out_one_figure(tmp_path, io):
    """A run whose tokenizer file is not reachable from here (copied runs, relative paths read
    from another directory) is still summarised: only the predicted sync params/step is '-'."""
    _fake_run(tmp_path / "a", "glob", {"en": 1.0}, [1000])
    cfg = load_config(tmp_path / "a" / "config.yaml", [f"data.tokenizer={tmp_path / 'gone.model'}"])
    save_config(cfg, tmp_path / "a" / "config.yaml")
    res = run_tool(TOOL, str(tmp_path / "a"), **io)
    assert res.returncode == 0, res.stderr
    lines = {ln.split()[0]: ln.split()[1:] for ln in res.stdout.splitlines() if ln.strip() and not ln.startswith("-")}
    assert lines["Table"] == ["1", "params/step", "-"]
    assert lines["mean"] == ["1.0000"]
    assert "gone.model" in res.stderr and "Traceback" not in res.stderr


def test_note_when_the_runs_evaluated_different_bytes(tmp_path, io):
    """SPEC-OPT's own tokenizers cut a validation part into other sequences than GLOB's: the same
    number of sequences is other text, so the BPB side by side are of different bytes. The
    summary says which sources and how many bytes each run read, and how to compare on the same
    text; runs that read the same bytes get no note, and runs that each read the parts whole
    are told that only the parts' edges differ."""
    full = 4 * 8 * 64  # train.eval_iters × train.global_batch_size sequences of model.seq_length: not whole
    _fake_run(tmp_path / "so", "spec_opt", {"lic": 2.81, "man": 3.07, "code": 1.0}, [1000],
              eval_bytes={"lic": 5691, "man": 4995, "code": 777}, eval_tokens=full)
    _fake_run(tmp_path / "gl", "glob", {"lic": 2.91, "man": 3.29, "code": 1.1}, [1000],
              eval_bytes={"lic": 5730, "man": 5289, "code": 777}, eval_tokens=full)
    out = _ok(run_tool(TOOL, str(tmp_path / "so"), str(tmp_path / "gl"), **io)).splitlines()
    i = out.index("note: not the same validation text: the runs' final evaluations read different bytes, so "
                  "these BPB are of different text:")
    assert out[i + 1:i + 3] == ["  lic: SPEC_OPT 5,691 bytes, GLOB 5,730 bytes",
                                "  man: SPEC_OPT 4,995 bytes, GLOB 5,289 bytes"], out
    why = " ".join(ln.strip() for ln in out[i + 3:i + 12])
    assert "code" not in " ".join(out[i:i + 3])  # read the same bytes in both runs
    assert "train.eval_samples" in why and "eval_whole: true" in why, why
    assert i > next(k for k, ln in enumerate(out) if ln.startswith("mean"))  # under the BPB table

    _fake_run(tmp_path / "so2", "spec_opt", {"lic": 2.81}, [1000], eval_bytes={"lic": 5691}, eval_tokens=full)
    _fake_run(tmp_path / "gl2", "glob", {"lic": 2.91}, [1000], eval_bytes={"lic": 5691}, eval_tokens=full)
    assert "note:" not in _ok(run_tool(TOOL, str(tmp_path / "so2"), str(tmp_path / "gl2"), **io))

    _fake_run(tmp_path / "so3", "spec_opt", {"lic": 2.81}, [1000], eval_bytes={"lic": 5691}, eval_tokens=full - 64)
    _fake_run(tmp_path / "gl3", "glob", {"lic": 2.91}, [1000], eval_bytes={"lic": 5730}, eval_tokens=full - 128)
    out = _ok(run_tool(TOOL, str(tmp_path / "so3"), str(tmp_path / "gl3"), **io))
    assert "  lic: SPEC_OPT 5,691 bytes, GLOB 5,730 bytes" in out
    assert "Every run read these parts whole" in out and "eval_whole" not in out, out
