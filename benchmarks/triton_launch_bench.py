#!/usr/bin/env python3
"""Host time of one Triton FP8 cast call, launched directly (``parallel/triton_launch.py``)
against Triton's own ``kernel[grid](...)``, on a machine without a GPU.

    pip install --no-deps --target /tmp/tr triton==3.6.0      # torch 2.11's Triton; any 3.x with a CUDA backend
    PYTHONPATH=/tmp/tr OMP_NUM_THREADS=1 python benchmarks/triton_launch_bench.py [--repeats 40] [--json OUT]

Triton's launch path runs for real up to the compiled kernel's launcher: a stand-in driver
(an sm_90 target, device 0, a fixed stream) and a stand-in compiler whose "compiled kernel"
has a launcher that does nothing. So each figure is the host's Python and binding work of a
cast (``cast_fp8``'s checks and allocations, then either launch path) without the CUDA
driver's launch, which both paths make alike. On a GPU, ``benchmarks/fp8_host_bench.py
--device cuda`` measures the same difference per linear call with the real launches
(``direct_launch_saves``: the ``tritonrun`` casts against ``triton``).

Rows: ``cast_fp8`` of a 16 × 64 bf16 tensor under delayed scaling (one launch; both layouts)
and current scaling (two launches: the amax reduction, then the cast), and the fused
``layernorm_cast_fp8`` (one launch); per row µs per call, the minimum over ``--repeats`` timed
batches, each path alternating with the other to share the machine's noise.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import torch  # noqa: E402


@contextlib.contextmanager
def stand_in_triton(log: list | None = None):
    """Triton's active driver and its compile step replaced (see the module docstring) for the
    duration; each stand-in launch appends its arguments to ``log`` when given. Restored after,
    with our kernels' caches (Triton's and the direct launches'), which meanwhile hold only
    stand-ins: a real launch after the block never finds one (this can run beside a GPU)."""
    from collections import defaultdict

    import triton.runtime.jit as J
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    from dept_mega.parallel import fp8_kernels as K
    from dept_mega.parallel import fp8_norm_kernels as N
    from dept_mega.parallel import triton_launch as TL

    class Driver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device):
            return 11

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    class Compiled:
        function, packed_metadata = 99, (4, 1)

        def launch_metadata(self, grid, stream, *args):
            return None

        def run(self, *args):
            if log is not None:
                log.append(args)

    def compile_stand_in(self, key, signature, device, constexprs, options, attrs, warmup):
        compiled = Compiled()
        self.device_caches[device][0][key] = compiled
        return compiled

    kernels = (K._cast_kernel, K._amax_parts_kernel, N._layernorm_cast_kernel)
    real_caches, real_launchers = [k.device_caches for k in kernels], dict(TL._LAUNCHERS)
    real_compile, real_driver = J.JITFunction._do_compile, driver._active
    driver.set_active(Driver())
    J.JITFunction._do_compile = compile_stand_in
    for k in kernels:
        k.device_caches = defaultdict(k.create_binder)
    TL._LAUNCHERS.clear()
    try:
        yield
    finally:
        J.JITFunction._do_compile = real_compile
        driver._active = real_driver
        for k, caches in zip(kernels, real_caches):
            k.device_caches = caches
        TL._LAUNCHERS.clear()
        TL._LAUNCHERS.update(real_launchers)


def _min_us(fn, batch: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        best = min(best, (time.perf_counter() - t0) / batch * 1e6)
    return best


def measure(repeats: int = 40, batch: int = 200) -> dict:
    """µs per call of each row under both launch paths (see the module docstring)."""
    from dept_mega.parallel import fp8_kernels as K
    from dept_mega.parallel import fp8_norm_kernels as N
    from dept_mega.parallel import triton_launch as TL

    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    t = torch.randn(16, 64).bfloat16()
    w, b = torch.ones(64).bfloat16(), torch.zeros(64).bfloat16()
    scale, amax = torch.ones(8), torch.zeros(8)
    rows = {"cast_fp8 delayed": lambda: K.cast_fp8(t, e4m3, 0, True, True, scale, 1, amax, 0),
            "cast_fp8 current": lambda: K.cast_fp8(t, e5m2, 0, True, False, None, 2, amax, 2),
            "layernorm_cast_fp8": lambda: N.layernorm_cast_fp8(t, w, b, 1e-5, e4m3, 0, True, True, scale=scale,
                                                               scale_index=0, amax_out=amax, amax_index=0)}
    paths = {"direct": TL.launch, "triton": TL.triton_launch}
    out: dict = {name: {} for name in rows}
    saved = (K.launch, N.launch, K.interpreted, N.interpreted)
    K.interpreted = N.interpreted = lambda: True  # the kernels' check of CPU tensors passes
    try:
        with stand_in_triton():
            for _ in range(2):  # a second round: the better of two per path
                for name, fn in rows.items():
                    for path, launch in paths.items():
                        K.launch = N.launch = launch
                        for _ in range(50):
                            fn()
                        us = _min_us(fn, batch, max(1, repeats // 2))
                        out[name][path] = min(us, out[name].get(path, us))
    finally:
        K.launch, N.launch, K.interpreted, N.interpreted = saved
    for r in out.values():
        r["saves"] = r["triton"] - r["direct"]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=40, help="timed batches of 200 calls per path (minimum taken)")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    try:
        import triton
    except ImportError:
        raise SystemExit("needs Triton (pip install --no-deps triton==3.6.0): its launch path is what is timed")
    from dept_mega.parallel import triton_launch as TL
    from dept_mega.parallel import fp8_kernels as K
    if not TL.direct_launch_supported(K._cast_kernel):
        raise SystemExit(f"Triton {triton.__version__}: the direct launch does not support this version "
                         "(casts launch through Triton's own path)")
    res = measure(args.repeats)
    print(f"host µs per call, launches stand-ins (Triton {triton.__version__}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs):")
    print(f"  {'row':<22}{'direct':>8}{'triton':>8}{'saves':>8}")
    for name, r in res.items():
        print(f"  {name:<22}{r['direct']:8.1f}{r['triton']:8.1f}{r['saves']:8.1f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"kind": "triton_launch", "triton": triton.__version__, "torch": torch.__version__,
                       "us": res}, f, indent=1)


if __name__ == "__main__":
    main()
