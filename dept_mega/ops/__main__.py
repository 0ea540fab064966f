"""``python -m dept_mega.ops``: which kernels and backends this installation uses.

Prints torch's build, whether the compiled custom ops (``dept_mega.ops._C``) loaded and with
which kernels, the optional packages the model can use (Transformer Engine, flash-attn,
apex), and with ``--config CFG [key=value ...]`` the ``backends:`` line a run of that config
logs on this machine. ``--require cpp|cuda`` exits with status 1 when the custom ops would not
run compiled kernels on that device, ``--require compile`` when ``torch.compile`` cannot compile
and run a small function on this machine's GPU (what every GPU run does at its first step), ``--require fp8`` when an FP8 operator of the extension
(``cast_fp8``, ``layernorm_cast_fp8``, ``dgelu_cast_fp8``, ``fp8_gemm``) has no CUDA kernel, so that FP8's defaults
would fall back on a GPU (for a cluster's install check; ``--require`` may be repeated).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

import torch


def _optional_packages() -> list[tuple[str, str]]:
    from dept_mega.model import layers
    from dept_mega.model.attention import flash_attn_available
    from dept_mega.parallel.te import te_importable, te_installed

    ok, info = te_importable()
    te = f"yes ({info})" if ok else (info if te_installed() else "not installed")
    return [("transformer_engine (backend: transformer_engine, fp8)", te),
            ("flash_attn (model.attention_backend: flash)",
             "yes" if flash_attn_available() else "not installed"),
            ("apex (fused LayerNorm / RMSNorm on CUDA)", "yes" if layers._apex_ln is not None else "not installed")]


def _fp8_operators() -> list[tuple[str, str, tuple[str, ...]]]:
    """The FP8 operators of the extension, each as (what it is and which config selects it,
    operator, the arguments this source passes that an older build lacks: such a build counts as
    missing the operator); ``fp8_casts: cuda`` needs the three cast operators (``fp8_casts.op_unavailable``)."""
    from dept_mega.parallel import fp8_casts

    cast_args = fp8_casts.OPS["dept_mega::cast_fp8"]
    return [("FP8 cast operator dept_mega::cast_fp8 (fp8_casts: cuda; gelu=True: the GELU fused into the cast, "
             "fp8_fused_casts)", "dept_mega::cast_fp8", cast_args),
            ("fused LayerNorm + FP8 cast operator dept_mega::layernorm_cast_fp8 (fp8_casts: cuda with "
             "fp8_fused_casts)", "dept_mega::layernorm_cast_fp8", fp8_casts.OPS["dept_mega::layernorm_cast_fp8"]),
            ("fused GELU backward + FP8 cast operator dept_mega::dgelu_cast_fp8 (fp8_casts: cuda with "
             "fp8_fused_casts: fc1's output gradient)", "dept_mega::dgelu_cast_fp8",
             fp8_casts.OPS["dept_mega::dgelu_cast_fp8"]),
            ("FP8 GEMM operator dept_mega::fp8_gemm (fp8_gemm: cublaslt)", "dept_mega::fp8_gemm", ())]


# What a GPU run does instead when an FP8 operator has no CUDA kernel (fp8_casts.auto_cast_kernels
# needs every cast operator, fp8_gemm.auto_gemm the GEMM operator).
_GEMM_FALLBACK = "fp8_gemm auto runs torch._scaled_mm instead (fp8_gemm: cublaslt is refused)"
_CASTS_FALLBACK = "fp8_casts auto runs the Triton casts (without Triton the torch casts) instead (fp8_casts: cuda is refused)"


def _fp8_missing() -> list[str]:
    """``op: why; what runs instead`` for each FP8 operator of the extension without a CUDA
    kernel (the build decides: no GPU needed)."""
    from dept_mega.ops import loader
    from dept_mega.parallel import fp8_gemm

    missing = []
    for _, op, newer in _fp8_operators():
        why = (fp8_gemm.op_unavailable("cuda") if op == "dept_mega::fp8_gemm"
               else loader.kernel_missing(op, "cuda", args=newer))
        if why is not None:
            missing.append(f"{op}: {why}; {_GEMM_FALLBACK if op == 'dept_mega::fp8_gemm' else _CASTS_FALLBACK}")
    return missing


def _compile_problem(cuda: bool) -> Optional[str]:
    """None when ``torch.compile`` compiles and runs a small function on this machine's GPU;
    else why not. On CUDA inductor generates Triton kernels, and Triton builds its driver
    module with the C compiler against Python's headers and writes both caches
    (docs/launching.md, "Compute nodes"): what a run's first step needs."""
    if not cuda:
        return "no CUDA device is visible"
    from dept_mega.model.backends import compile_problem
    return compile_problem("cuda")


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dept_mega.ops", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", help="also print the backends a run of this config uses here")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides (with --config)")
    ap.add_argument("--require", choices=("cpp", "cuda", "fp8", "compile"), action="append",
                    help="exit 1 unless the custom ops run compiled kernels on cpu (cpp) or cuda (cuda), "
                         "unless the FP8 operators have their CUDA kernels (fp8: the build only, no GPU "
                         "needed), or unless torch.compile works on this machine's GPU (compile: Triton's "
                         "C compiler, Python headers and cache directories); may be repeated")
    args = ap.parse_args(argv)

    from dept_mega.ops import backend, extension_status, loader

    cuda = torch.cuda.is_available()
    gpus = f"{torch.cuda.device_count()} visible ({torch.cuda.get_device_name(0)})" if cuda else "none visible"
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda or 'none (CPU build)'}, GPUs: {gpus}")
    st = extension_status()
    print(f"custom ops: {st.reason}")
    print(f"  cpu tensors: {backend('cpu')}" + (f", cuda tensors: {backend('cuda')}" if cuda else ""))
    for what, op, newer in _fp8_operators():
        where = [f"{dev} {'yes' if loader.kernel_missing(op, dev, args=newer) is None else 'no'}"
                 for dev in ("cpu", "cuda")]
        print(f"  {what}: {', '.join(where)}")
    print("optional packages:")
    for name, state in _optional_packages():
        print(f"  {name}: {state}")
    if args.config:
        from dept_mega.config import ConfigError, load_config
        from dept_mega.model.gpt import describe_backends

        device = "cuda" if cuda else "cpu"
        try:
            print(f"backends ({device}): {describe_backends(load_config(args.config, args.overrides), device)}")
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    rc = 0
    for req in dict.fromkeys(args.require or ()):
        if req == "compile":
            if (problem := _compile_problem(cuda)) is not None:
                print(f"error: --require compile: torch.compile cannot run on CUDA here ({problem}); a run on a GPU "
                      f"compiles with it at its first step (Triton needs a C compiler, Python's headers and writable "
                      f"cache directories: docs/launching.md, \"Compute nodes\")", file=sys.stderr)
                rc = 1
            else:
                print(f"torch.compile on cuda: works (TORCHINDUCTOR_CACHE_DIR={os.environ.get('TORCHINDUCTOR_CACHE_DIR')}, "
                      f"TRITON_CACHE_DIR={os.environ.get('TRITON_CACHE_DIR')})")
            continue
        if req == "fp8":
            if missing := _fp8_missing():
                print(f"error: --require fp8: {len(missing)} of the extension's {len(_fp8_operators())} FP8 operators "
                      f"{'has' if len(missing) == 1 else 'have'} no CUDA kernel, so FP8's defaults take slower "
                      f"paths on a GPU (the run log's backends: line names them):", file=sys.stderr)
                for line in missing:
                    print(f"  {line}", file=sys.stderr)
                rc = 1
            continue
        dev = "cpu" if req == "cpp" else "cuda"
        got = backend(dev) if dev == "cpu" or cuda else None
        if got != req:
            why = "no CUDA device is visible" if got is None else f"they run '{got}' on {dev} tensors"
            print(f"error: --require {req}: {why} ({st.reason})", file=sys.stderr)
            rc = 1
    return rc


if __name__ == "__main__":
    from dept_mega.process_exit import exit_after
    exit_after(main)
