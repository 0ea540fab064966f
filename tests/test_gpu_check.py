"""benchmarks/gpu_check.sh, the one-call device check, rehearsed on the CPU (``--dry-run``: the
whole sequence with a tiny model of the same config), so that the device call never discovers a
bug in the script itself; and its time budget, which skips a stage whose expected time is not
left."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from tests.trainer_utils import ROOT

SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.sh")
STAGES_FILE = os.path.join(ROOT, "benchmarks", "gpu_check_stages.sh")  # its stage_NAME functions, sourced
FILES = {"summary.md", "gpu_check.log", "build.log", "ops_bench.json", "bench.jsonl", "kernels.txt", "memory.json",
         "vs_megatron.json"}
STAGES = ("env", "tests", "ops_tests", "bf16", "fp8", "fp8_prev", "fp8_all_fused", "fp8_tuned", "fp8_cuda", "fp8_lt", "fp8_fused", "fp8_lt_fused", "fp8_tlt_fused", "fp8_host", "fp8_casts", "attention", "fp8_fast_accum", "fp8_compile_triton", "compile", "fp8_compile", "ops", "torchao",
          "megatron", "flex_autotune", "fp8_current", "fp8_current_compile", "fp8_mb8", "fp8_lt_mb8", "vocab250k", "memory", "nofusion",
          "compile_nofusion", "mb8")


# the C++ casts' fused dGELU cast of fc1's output gradient, as fp8_fused_casts: true lists it
_DGELU = "dgelu (fc1's output gradient, one kernel in fc2's backward once the gradient has a delayed scale"


def _run(out, *args, timeout=420):
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.pop("OUT", None)
    return subprocess.run(["bash", SCRIPT, "--dry-run", "--out", str(out), *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _stage_log(log: str, stage: str) -> str:
    """The lines of ``stage`` in gpu_check.log, from its header to its 'finished' line."""
    m = re.search(rf"^### stage {stage} \(.*?(^### stage {stage} finished[^\n]*|\Z)", log, re.S | re.M)
    return m.group(0) if m else f"(no stage {stage} in the log; its last lines:)\n{log[-3000:]}"


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_dry_run_writes_every_figure(tmp_path):
    res = _run(tmp_path)
    log = (tmp_path / "gpu_check.log").read_text() if (tmp_path / "gpu_check.log").exists() else ""
    assert res.returncode == 0, res.stderr[-2000:] + log[-4000:]
    assert {p.name for p in tmp_path.iterdir()} == FILES  # at most 8: what the device tool returns
    summary = (tmp_path / "summary.md").read_text()
    megatron = importlib.util.find_spec("megatron") is not None
    for stage in STAGES:
        want = "ok" if stage != "megatron" or megatron else "failed rc=1"
        if f"| {stage} | {want} |" not in summary:  # (pytest.fail: a message assert would cut short)
            row = next((line for line in summary.splitlines() if line.startswith(f"| {stage} |")), None)
            pytest.fail(f"stage {stage}: {row} in the summary, not {want}; its log:\n{_stage_log(log, stage)[-8000:]}",
                        pytrace=False)
    # every stage ok: no second call to suggest (megatron-core absent: only its stage)
    rerun = "" if megatron else "`bash benchmarks/gpu_check.sh --stages megatron`"
    assert ("--stages " in summary) == bool(rerun) and rerun in summary
    rows = [json.loads(line) for line in (tmp_path / "bench.jsonl").read_text().splitlines()]
    torchao = [r for r in rows if r.get("kind") == "vs_torchao"]
    host = [r for r in rows if r.get("kind") == "fp8_host"]
    casts = [r for r in rows if r.get("kind") == "fp8_cast_bench"]
    attention = [r for r in rows if r.get("kind") == "attention_bench"]
    rows = [r for r in rows if r.get("kind") not in ("vs_torchao", "fp8_host", "fp8_cast_bench", "attention_bench")]
    # the attention stage: attention_bench.py's rows (the math backend's ALiBi and no-ALiBi rows on the CPU)
    assert len(attention) == 1 and attention[0]["rc"] == 0 and len(attention[0]["rows"]) == 2, attention
    assert "## Attention: device time per forward + backward by kernel" in summary and "| bias math (fastest) |" in summary
    # the fp8_casts stage: fp8_cast_bench.py's rows (the C++ operator and the torch casts on the CPU)
    assert len(casts) == 1 and casts[0]["rc"] == 0 and casts[0]["rows"], casts
    assert "## FP8 casts: device time per cast by kernel" in summary and "| copy (bf16 clone) |" in summary
    # and its fused rows: the C++ operator's LayerNorm and GELU casts against F.layer_norm / F.gelu then the cast
    fused = {(r["op"], r["variant"], r["path"]) for r in casts[0]["fused"] if "error" not in r}
    assert {("layernorm", "fused", "cuda"), ("gelu", "fused", "cuda"), ("layernorm", "unfused", "cuda")} <= fused
    assert "### Fused vs unfused" in summary and "| layernorm | cuda | " in summary
    # one fork server, with inductor's compiler for the compiled stages (TORCH_COMPILE_DISABLE=1 set in
    # their forks; the max-autotune run's TORCHINDUCTOR_MAX_AUTOTUNE=1 too: its record says True below)
    assert ("# fork server: torch, the training modules and inductor's compiler (the compiled stages: "
            "TORCH_COMPILE_DISABLE=1 set in their forks)\n") in log, log[:2000]
    assert log.count("# fork server") == 1
    # its imports waited for before the first stage's clock started (not in the env stage's limit)
    done = re.search(r"^#   its imports done after \d+ s \(before the first stage's clock\)$", log, re.MULTILINE)
    assert done and done.start() < log.index("### stage "), log[:2000]
    # the stages' order: the main runs first, then the variants, the model checks and the ablations
    assert [r["name"] for r in rows] == ["bf16", "fp8", "fp8_prev", "fp8_all_fused", "fp8_tuned", "fp8_cuda", "fp8_lt", "fp8_fused", "fp8_lt_fused", "fp8_tlt_fused", "fp8_fast_accum", "fp8_compile_triton", "bf16_compile", "fp8_compile", "bf16_flex_autotune", "fp8_current",
                                           "fp8_current_compile", "fp8_mb8", "fp8_lt_mb8", "std_vocab250k", "bf16_nofusion",
                                           "bf16_compile_nofusion", "bf16_mb8"]
    assert all("error" not in r and r["tokens_per_s"] > 0 for r in rows), rows
    by = {r["name"]: r for r in rows}
    assert by["std_vocab250k"]["vocab_size"] == 2000 and by["bf16"]["vocab_size"] == 1000
    assert by["bf16"]["micro_batch_size"] == 2 and by["bf16_mb8"]["micro_batch_size"] == 4
    assert by["fp8_mb8"]["micro_batch_size"] == 4 and by["fp8_lt_mb8"]["micro_batch_size"] == 4
    assert "grad_accum_fusion=off" in by["bf16_nofusion"]["backends"] and "grad_accum_fusion=on" in by["bf16"]["backends"]
    kernels = (tmp_path / "kernels.txt").read_text()
    assert "# kernels: bf16" in kernels and "# kernels: fp8" in kernels and "| kind | ms |" in kernels
    assert "# kernels: bf16_compile" in kernels and "# kernels: fp8_compile_triton" in kernels
    # the C++ cast operator's run (its CPU kernel here) and the run with the forward GEMM's fast accumulation
    assert "# kernels: fp8_cuda" in kernels and "C++ cast operator" in by["fp8_cuda"]["backends"]
    assert "fast accumulation: forward" in by["fp8_fast_accum"]["backends"]
    assert "# kernels: fp8_lt" in kernels and "cuBLASLt operator dept_mega::fp8_gemm" in by["fp8_lt"]["backends"]
    assert "(fp8_lt): " in summary
    # the fused casts' runs (LayerNorm / GELU fused into the FP8 casts), each beside its unfused run
    for run in ("fp8_fused", "fp8_lt_fused"):
        line = by[run]["backends"]
        assert f"# kernels: {run}" in kernels and "fused casts (fp8_fused_casts) [qkv (layernorm, " in line, line
        assert "), fc1 (layernorm, " in line and "), fc2 (gelu, " in line, line
    assert "fc2 (gelu, one kernel)" in by["fp8_lt_fused"]["backends"]  # the C++ casts (their CPU kernels here)
    # the Triton casts (torch here) with the cuBLASLt GEMMs, fused, beside fp8_fused
    assert "cuBLASLt operator" in by["fp8_tlt_fused"]["backends"] and "C++ cast" not in by["fp8_tlt_fused"]["backends"]
    assert re.search(r"\(fp8_tlt_fused\): [\d.]+x fp8_fused \(", summary), summary
    assert "cuBLASLt operator" in by["fp8_lt_fused"]["backends"]
    # the defaults (the torch casts and GEMM on the CPU: auto fuses nothing, and says why) beside the
    # previous defaults (named explicitly: fp8_fused_casts=false) and every producer fused
    assert ("fused casts (fp8_fused_casts: null = auto) [none, not fused: qkv, fc1, fc2, dgelu (auto: not on a GPU (auto "
            "fuses for the fused kernels' GPU speed))]") in by["fp8"]["backends"], by["fp8"]["backends"]
    assert "fp8=hybrid backend=local fp8_casts=torch fp8_gemm=torch fp8_fused_casts=false" in log
    assert "fused casts" not in by["fp8_prev"]["backends"] and "torch._scaled_mm" in by["fp8_prev"]["backends"]
    line = by["fp8_all_fused"]["backends"]
    assert "cuBLASLt operator" in line and "C++ cast operator" in line and f"fc2 (gelu, one kernel), {_DGELU}" in line, line
    assert "# kernels: fp8_all_fused" in kernels and re.search(r"\(fp8_all_fused\): [\d.]+x fp8 \(", summary)
    assert re.search(r"- FP8 with the defaults \(fp8\): [\d.]+x fp8_prev \(_scaled_mm, torch casts, ", summary), summary
    # fp8_lt_fused has fp8_all_fused's settings: its record again, not a second run
    assert by["fp8_lt_fused"]["same_run_as"] == "fp8_all_fused" and "same_run_as" not in by["fp8_all_fused"]
    assert by["fp8_lt_fused"]["tokens_per_s"] == by["fp8_all_fused"]["tokens_per_s"]
    assert "fp8_lt_fused: the settings of fp8_all_fused, which ran in this call" in log
    assert log.count("fp8_casts=cuda fp8_gemm=cublaslt fp8_fused_casts=true") == 1
    # fp8_tuned: fp8_all_fused's settings with fp8_gemm_tuning (the CPU kernel has nothing to tune: said)
    assert "fp8_gemm_tuning 8 not applied: the operator's cpu kernel has one algorithm" in by["fp8_tuned"]["backends"]
    assert "(fp8_fused): " in summary and "x fp8 (_scaled_mm, torch casts, delayed scaling, exact sums)" in summary
    # each variant against its unfused / base runs, and every run's backends line in the summary
    assert re.search(r"\(fp8_lt_fused\): [\d.]+x fp8_lt \(cuBLASLt GEMMs, C\+\+ casts, [^)]*\), [\d.]+x fp8_fused \(",
                     summary), summary
    assert re.search(r"\(fp8_lt_mb8\): [\d.]+x fp8_lt \(", summary), summary
    assert f"  - bf16: {by['bf16']['backends']}\n" in summary
    assert "  - fp8_lt_fused: backend=local: linear=native fp8 (cuBLASLt operator" in summary
    assert f"fc2 (gelu, one kernel), {_DGELU}" in summary.split("  - fp8_lt_fused: ")[1].splitlines()[0]
    assert "fast accumulation: none" in by["fp8"]["backends"]
    assert "FP8 with the C++/CUDA cast operator (fp8_cuda): " in summary and "(fp8_fast_accum): " in summary
    assert "# kernels: bf16_flex_autotune" in kernels and "inductor autotuning (TORCHINDUCTOR_MAX_AUTOTUNE=1" in summary
    # inductor's autotuning reached that run only
    assert by["bf16_flex_autotune"]["inductor_max_autotune"] is True and by["bf16"]["inductor_max_autotune"] is False
    # the dry run's stage runs the torch casts (no Triton here); the device's names fp8_casts=triton
    assert "fp8=hybrid backend=local fp8_casts=torch train.compile=true" in log
    assert "FP8 GEMMs traced into the compiled blocks (delayed scaling) with" in by["fp8_compile_triton"]["backends"]
    assert "FP8 with train.compile and our Triton casts inside the graphs (fp8_compile_triton): " in summary
    # the memory stage: dept_costs.py given the vocabulary sizes (the config's tokenizers do not exist)
    assert "--global-vocab 1000 --source-vocab 1000 --memory" in log
    mem = json.loads((tmp_path / "memory.json").read_text())
    assert mem["variant"] == "spec_opt" and mem["comparison"]["trainer"]["predicted_gb"] > 0
    big = mem["comparison"]["trainer, STD 250,112-token head"]
    assert big["predicted_gb"] > 0 and big["measured_gb"] == by["std_vocab250k"]["peak_mem_gb"]
    fp8 = mem["comparison"]["trainer, FP8 (fp8=hybrid backend=local)"]  # the FP8 terms of the model
    assert fp8["measured_gb"] == by["fp8"]["peak_mem_gb"] and fp8["predicted_gb"] > 0
    assert "fp8=hybrid backend=local --global-vocab 1000 --source-vocab 1000 --memory" in log
    assert "FP8 with micro-batches of 8 (fp8_mb8): " in summary
    assert "FP8 GEMMs traced into the compiled blocks (current scaling)" in by["fp8_current_compile"]["backends"], by["fp8_current_compile"]["backends"]
    assert "FP8 GEMMs traced into the compiled blocks (delayed scaling)" in by["fp8_compile"]["backends"], by["fp8_compile"]["backends"]
    assert "| fp8_current_compile | " in summary and "| fp8_current | " in summary
    assert "FP8 current scaling traced into the compiled blocks (fp8_current_compile): " in summary
    assert "x fp8_current (" in summary and "FP8 current scaling, eager (fp8_current): " in summary
    assert "optim.grad_accum_fusion (the default run against the same run without it) (bf16): " in summary and "optim.grad_accum_fusion under train.compile" in summary and "STD 250,112-token head: predicted" in summary
    assert json.loads((tmp_path / "ops_bench.json").read_text())["results"]
    # the pytest results reached the summary: pytest's last line in the stage's row
    # (e.g. "20 skipped, 121 deselected in 3.13s" in the dry run, where every GPU test skips)
    for stage in ("tests", "ops_tests"):
        assert re.search(rf"^\| {stage} \| ok \| \d+ \| \d+ (passed|skipped|deselected)[^|]* in [\d.]+s", summary,
                         re.MULTILINE), (stage, summary)
    # the fp8_host stage: benchmarks/fp8_host_bench.py's record, one row of bench.jsonl, and its section
    assert len(host) == 1 and host[0]["name"] == "fp8_host" and host[0]["rc"] == 0 and "error" not in host[0], host
    combos = host[0]["combos"]
    from dept_mega.parallel.fp8_casts import op_unavailable  # the cuda casts: where the C++ cast operator runs
    from dept_mega.parallel.fp8_gemm import op_unavailable as gemm_unavailable  # cublaslt: the GEMM operator
    ops_here = op_unavailable("cpu") is None and gemm_unavailable("cpu") is None
    assert set(combos) == {"bf16", "bf16_unfused", "torch+torch",
                           *(["torch+cublaslt", "cuda+torch", "cuda+cublaslt", "tritonpy+cublaslt",
                              # the fused casts' chain (LayerNorm / GELU before the linears) and its unfused twin
                              "cuda+cublaslt+fused", "cuda+cublaslt+unfused", "tritonpy+cublaslt+fused",
                              "tritonpy+cublaslt+unfused"] if ops_here else [])}
    assert all(x["fwd_us"] > 0 and x["bwd_us"] > 0 for x in combos.values()), combos
    assert host[0]["device"] == "cpu" and host[0]["kernels"] == "real" and host[0]["depth"] == 2
    if ops_here:
        total = {c: x["fwd_us"] + x["bwd_us"] for c, x in combos.items()}
        assert host[0]["derived"]["scaled_mm_host"]["us"] == total["cuda+torch"] - total["cuda+cublaslt"]
        assert combos["cuda+cublaslt"]["fwd_ops"] == 2 and combos["cuda+cublaslt"]["bwd_ops"] == 4
        assert re.search(r"^\| cuda\+cublaslt \| [\d.]+ \| [\d.]+ \| [\d.]+ \| 2 / 4 \| ", summary, re.MULTILINE), summary
        assert re.search(r"^- cast_fp8_python: -?[\d.]+ us per call = tritonpy\+cublaslt - cuda\+cublaslt", summary,
                         re.MULTILINE), summary
    assert "## FP8: the host's cost per linear call (benchmarks/fp8_host_bench.py)" in summary
    assert "| bf16_unfused | " in summary
    assert "- triton_launcher: n/a us per call = triton+cublaslt - tritonpy+cublaslt" in summary  # no Triton on the CPU
    assert "--device cpu --kernels real --repeats 4" in log
    # the last stage: torchao's float8 against bf16 (benchmarks/vs_torchao.py), one row of bench.jsonl
    assert len(torchao) == 1 and torchao[0]["name"] == "torchao" and torchao[0]["rc"] == 0, torchao
    if "skipped" in torchao[0]:  # torchao not importable where the script ran (the suite's venv lacks it)
        assert torchao[0]["skipped"].startswith("torchao is not importable") and "- skipped: torchao" in summary
    else:
        assert torchao[0]["loss_errors"] == [] and torchao[0]["ratios"]["float8_tensorwise"] > 0
        assert torchao[0]["arms"]["float8_tensorwise"]["float8_linears"] == 8 and "its bf16 tokens/s" in summary
    assert "float8 against bf16 on a plain PyTorch GPT of the same shape (eager)" in summary
    if megatron:
        vs = json.loads((tmp_path / "vs_megatron.json").read_text())
        assert vs["ratio"] > 0 and vs["precision"] == "bf16" and vs["micro_batch_size"] == 2


def test_budget_skips_what_does_not_fit_and_still_summarises(tmp_path):
    """Under a budget smaller than a stage's expected time the stage is skipped, not started; the
    summary says so; an unknown stage or a missing output folder is one clear error."""
    res = _run(tmp_path, "--budget", "9", "--stages", "env,bf16", timeout=120)
    assert res.returncode == 0, res.stderr
    summary = (tmp_path / "summary.md").read_text()
    assert "| env | skipped (expected 4s, " in summary and "| bf16 | skipped (expected 12s, " in summary
    assert "| tests |" not in summary  # not selected
    assert "`bash benchmarks/gpu_check.sh --stages env,bf16`" in summary  # what a second call runs
    assert not (tmp_path / "bench.jsonl").exists()
    bad = _run(tmp_path, "--stages", "env,nope", timeout=60)
    assert bad.returncode == 2 and "unknown stage 'nope'" in bad.stderr
    env = dict(os.environ)
    env.pop("OUT", None)
    none = subprocess.run(["bash", SCRIPT, "--dry-run"], capture_output=True, text=True, env=env, timeout=60)
    assert none.returncode == 2 and "no output folder" in none.stderr


@pytest.mark.timeout(120)
def test_a_missing_megatron_wheel_is_warned_at_the_start(tmp_path):
    """A call whose stages include megatron, without megatron-core's wheel in .whl/ and without an
    importable megatron-core (hidden here by a shim package first on PYTHONPATH), starts with one
    warning line on stderr and at the top of gpu_check.log: the command that fetches the wheels and
    the device tool's carry entry that takes .whl along (the stage itself is skipped for time here)."""
    import glob
    if glob.glob(os.path.join(ROOT, ".whl", "megatron_core-*.whl")):
        pytest.skip("this checkout has megatron-core's wheel in .whl/")
    shim = tmp_path / "shim" / "megatron"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("")  # a regular package: megatron.core is not found under it

    def run(out, path):
        env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=path, OMP_NUM_THREADS="1")
        env.pop("OUT", None)
        return subprocess.run(["bash", SCRIPT, "--dry-run", "--out", str(out), "--budget", "9", "--stages", "megatron"],
                              capture_output=True, text=True, env=env, timeout=60)

    res = run(tmp_path / "out", f"{tmp_path / 'shim'}:{ROOT}")
    assert res.returncode == 0, res.stderr
    first = (tmp_path / "out" / "gpu_check.log").read_text().splitlines()[0]
    for text in (first, res.stderr):
        assert "warning: not in .whl/ and not importable here: megatron-core (the megatron stage fails" in text, text
        assert "`bash benchmarks/fetch_device_wheels.sh`" in text and 'carry: [".whl"]' in text, text
    if importlib.util.find_spec("megatron.core") is not None:  # importable: no warning
        res = run(tmp_path / "ok", ROOT)
        assert res.returncode == 0 and "warning" not in res.stderr, res.stderr
        assert "fetch_device_wheels" not in (tmp_path / "ok" / "gpu_check.log").read_text()


def test_compiled_stages_listed_for_the_fork_servers_compiler():
    """The dry run's fork server imports inductor's compiler only when a stage in COMPILED_STAGES
    runs: every stage that runs compiled_bench is listed there (one missing would import it in its
    own command, ~2 s more of the dry run). The list is gpu_check.sh's, the stage functions
    gpu_check_stages.sh's."""
    listed = re.search(r"^COMPILED_STAGES=\(([^)]*)\)", open(SCRIPT).read(), re.MULTILINE)
    assert listed, "COMPILED_STAGES=(...) not found in benchmarks/gpu_check.sh"
    text = open(STAGES_FILE).read()
    # each stage function's text: from its line to the next line that starts a definition or a section
    starts = [m for m in re.finditer(r"^stage_(\w+)\(\) \{", text, re.MULTILINE)]
    compiled = set()
    for m in starts:
        end = re.compile(r"^(\w+\(\) \{|# -{10})", re.MULTILINE).search(text, m.end())
        if "compiled_bench" in text[m.end():end.start() if end else len(text)]:
            compiled.add(m.group(1))
    assert len(compiled) >= 5 and set(listed.group(1).split()) == compiled, (listed.group(1), compiled)


def test_the_stages_file_is_not_run_on_its_own():
    """gpu_check_stages.sh is sourced by gpu_check.sh: run by itself it stops at its first command
    with an error, defining and running nothing."""
    res = subprocess.run(["bash", STAGES_FILE], capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "is sourced by benchmarks/gpu_check.sh, not run on its own" in res.stderr, res
    assert not os.access(STAGES_FILE, os.X_OK)  # not executable either


def _stage_lines(log: str) -> list[tuple[str, str]]:
    """(stage, "ran" / "skipped") for each stage the log started or skipped, in the log's order."""
    return [(m.group(1), "skipped" if m.group(2) == "skipped:" else "ran")
            for m in re.finditer(r"^### stage (\S+) (skipped:|\(expected)", log, re.MULTILINE)]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_stages_run_in_the_order_listed(tmp_path):
    """--stages runs its stages in the order listed, not the script's (a budget spent on a stage listed
    late must not push out one listed first): here torchao before attention, the reverse of the
    fixed order; the summary's rerun line keeps the listed order; env, when listed, runs first (the
    summary's device line reads it); an order that breaks what a stage reads from another, or a stage
    listed twice, is one clear error before anything runs."""
    res = _run(tmp_path, "--stages", "torchao,attention", timeout=240)
    log = (tmp_path / "gpu_check.log").read_text() if (tmp_path / "gpu_check.log").exists() else ""
    assert res.returncode == 0, res.stderr[-2000:] + log[-4000:]
    assert "# stages, in this order: torchao attention\n" in log
    # no compiled stage listed: the fork server without inductor's compiler (~2 s to import)
    assert "# fork server: torch and the training modules (no compiled stage in this call" in log, log[:2000]
    assert _stage_lines(log) == [("torchao", "ran"), ("attention", "ran")], log[-4000:]
    for stage in ("torchao", "attention"):
        assert f"### stage {stage} finished: rc=0 " in log, log[-4000:]
    # every stage skipped for time (nothing runs): the rerun line lists them in the same order, env first
    skip = tmp_path / "skip"
    res = _run(skip, "--budget", "9", "--stages", "torchao,memory,attention,env", timeout=120)
    assert res.returncode == 0, res.stderr
    log = (skip / "gpu_check.log").read_text()
    want = ["env", "torchao", "memory", "attention"]
    assert _stage_lines(log) == [(s, "skipped") for s in want], log
    assert f"`bash benchmarks/gpu_check.sh --stages {','.join(want)}`" in (skip / "summary.md").read_text()
    for stages, error in (("bf16,memory,fp8", "list fp8 before memory: it compares the memory model"),
                          ("fp8_lt_fused,fp8_all_fused", "list fp8_all_fused before fp8_lt_fused: it reuses"),
                          ("env,bf16,env", "stage 'env' is listed twice")):
        bad = _run(tmp_path / "bad", "--stages", stages, timeout=60)
        assert bad.returncode == 2 and error in bad.stderr, (stages, bad.stderr)
        assert not (tmp_path / "bad" / "gpu_check.log").exists()


def _hung_run(out, stages: str, hang: str, **env):
    """A dry run of ``stages`` whose commands hang (GPU_CHECK_DRY_HANG: each stage's limit and every
    command a sleep its deadline stops): no Python command runs, so no fork server starts (seconds)."""
    extra = {"GPU_CHECK_DRY_HANG": hang, **env}
    full = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **extra)
    full.pop("OUT", None)
    res = subprocess.run(["bash", SCRIPT, "--dry-run", "--out", str(out), "--stages", stages], capture_output=True,
                         text=True, env=full, timeout=120)
    log = (out / "gpu_check.log").read_text() if (out / "gpu_check.log").exists() else ""
    assert res.returncode == 0, res.stderr[-2000:] + log[-4000:]
    return log, (out / "summary.md").read_text()


@pytest.mark.timeout(120)
def test_a_stage_stops_at_its_deadline_and_the_next_stage_still_runs(tmp_path):
    """A stage's limit is one deadline for all its commands (it was each command's: a stage of n
    commands could run n times its limit, past --budget): the command running at the deadline is
    stopped, the next is not started, the stage's line and summary.md say it was cut and what, and
    the next stage still runs. Here every command hangs: tests' two pytest runs under a 4 s limit,
    then ops_tests (its build waited for, then its first command cut at 2 s)."""
    log, summary = _hung_run(tmp_path, "tests,ops_tests", "tests:4,ops_tests:2")
    tests = _stage_log(log, "tests")
    assert "(stopped at the stage's limit of 4s: python -m pytest)" in tests, tests
    assert "(not started: the stage's limit of 4s is spent: python -m pytest)" in tests, tests
    cut = "cut at its limit of 4 s (stopped: python -m pytest; not started: python -m pytest)"
    m = re.search(rf"^### stage tests finished: rc=1 in (\d+) s, {re.escape(cut)}$", log, re.MULTILINE)
    assert m and int(m.group(1)) <= 6, tests  # the limit, not twice it (two commands)
    assert f"| tests | failed rc=1, {cut} | " in summary, summary
    # the next stage ran: the build waited for, its first command stopped at its own deadline
    ops = _stage_log(log, "ops_tests")
    assert "build finished: rc=0" in ops and "(stopped at the stage's limit of 2s: python -c)" in ops, ops
    assert "| ops_tests | failed rc=1, cut at its limit of 2 s (stopped: python -c) | " in summary, summary
    assert "`bash benchmarks/gpu_check.sh --stages tests,ops_tests`" in summary


@pytest.mark.timeout(120)
def test_a_build_with_a_static_libstdcxx_skips_the_gemm_tuning(tmp_path, capsys):
    """Where build.log has setup.py's warning that the built extension carries its own libstdc++
    (the FP8 GEMM tuning crashed the process with one: a segmentation fault on the H200), fp8_tuned
    is skipped, saying why, and ops_tests leaves out the tuning tests, noted in summary.md. The line
    is the one setup.py writes (its check run on a library whose nm lists both symbols)."""
    spec = importlib.util.spec_from_file_location("dept_mega_setup", os.path.join(ROOT, "setup.py"))
    setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup)  # not __main__: setup() does not run
    setup.LOG = str(tmp_path / "setup.log")
    nm = "".join(f"0000000000001000 T {s}\n" for s in setup.STATIC_LIBSTDCXX_SYMBOLS)
    setup.check_built_library("/ext/_C.so", run=lambda *a, **k: subprocess.CompletedProcess(a, 0, nm, ""))
    warning = capsys.readouterr().err.strip()
    assert "defines libstdc++'s own" in warning, warning
    out = tmp_path / "out"
    # (ops_tests's limit includes the wait for the dry build, a Python start of a few seconds on a loaded machine)
    log, summary = _hung_run(out, "ops_tests,fp8_tuned", "ops_tests:8,fp8_tuned:2", GPU_CHECK_DRY_BUILD_NOTE=warning)
    assert warning in (out / "build.log").read_text()
    why = ("the extension carries a static copy of libstdc++ (build.log: it defines libstdc++'s own "
           f"{', '.join(setup.STATIC_LIBSTDCXX_SYMBOLS)}), with which the FP8 GEMM tuning crashes the process")
    assert f"| fp8_tuned | skipped ({why}" in summary, summary
    assert "### stage fp8_tuned (expected" not in log, log  # not started: no run, no cut
    assert f"- note: ops_tests: tests/test_fp8_gemm_tuning.py left out: {why}" in summary, summary
    assert "`bash benchmarks/gpu_check.sh --stages ops_tests,fp8_tuned`" in summary
