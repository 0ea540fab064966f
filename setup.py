"""Build the optional custom-ops extension `dept_mega.ops._C` (csrc/); metadata: pyproject.toml.

What is built, decided here before torch's own build step runs:
- the CPU kernels whenever torch is importable at build time (install with
  `pip install --no-build-isolation .`, so the build sees the torch you run with) and a C++
  compiler works;
- plus the CUDA kernels when torch has CUDA and an nvcc of the same CUDA major version is found
  (CUDA_HOME, else nvcc on PATH); with them the FP8 GEMM operator's cuBLASLt kernel when
  cuBLASLt's headers are found (the toolkit's, or NVIDIA's pip wheels': see cublaslt_plan). torch refuses another major version before any kernel is
  compiled; we check first and build the CPU kernels instead, saying why.
A build that fails is logged (stderr and build/dept_mega_ops_build.log) and never fatal: a
CUDA build that fails is retried with the CPU kernels, and without any extension dept_mega.ops
uses its pure PyTorch fallback. `python -m dept_mega.ops` says which kernels are active.
Environment: DEPT_MEGA_NO_EXT=1 builds nothing, DEPT_MEGA_NO_CUDA=1 the CPU kernels only,
TORCH_CUDA_ARCH_LIST (e.g. "9.0") picks the GPU architectures. Unset, torch builds for this
machine's GPUs; where none is visible (a cluster's login node; torch 2.11 then stops with an
IndexError before compiling anything) we build for DEFAULT_CUDA_ARCHS and say so.
"""
from __future__ import annotations

import copy
import glob
import os
import re
import subprocess
import sys
import time
import traceback
from typing import Callable, Mapping, Optional

from setuptools import setup

EXT_NAME = "dept_mega.ops._C"
HERE = os.path.dirname(os.path.abspath(__file__))
LOG = os.path.join(HERE, "build", "dept_mega_ops_build.log")
# registration.cpp, cpu/ops_cpu.cpp and cpu/dgelu_cast_cpu.cpp as one translation unit (why: its header)
CPU_SOURCES = ["csrc/cpu_extension.cpp"]
CUDA_SOURCES = ["csrc/cuda/ops_cuda.cpp", "csrc/cuda/kernels.cu", "csrc/cuda/remap_ranked.cu",
                "csrc/cuda/fp8_cast.cu", "csrc/cuda/layernorm_cast.cu", "csrc/cuda/dgelu_cast.cu"]
LT_SOURCE = "csrc/cuda/fp8_gemm_lt.cpp"  # built when cuBLASLt's headers are found (cublaslt_plan)
CXX_FLAGS = ["-O3", "-g0", "-ffp-contract=off"]  # BuildExtension adds the -std= its torch needs
# built where no GPU is visible: A100 (8.0), H100/H200 (9.0), and PTX that newer GPUs compile at load
DEFAULT_CUDA_ARCHS = "8.0;9.0+PTX"


def _log(msg: str) -> None:
    print(f"dept_mega setup: {msg}", file=sys.stderr)
    try:
        os.makedirs(os.path.dirname(LOG), exist_ok=True)
        with open(LOG, "a") as f:
            f.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {msg}\n")
    except OSError:
        pass


def nvcc_release(cuda_home: str) -> Optional[str]:
    """The CUDA release ("13.0") that ``cuda_home/bin/nvcc --version`` reports; None when
    there is no nvcc there or it says no release."""
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return f"{m.group(1)}.{m.group(2)}" if m else None


def has_cuda_headers(cuda_home: str) -> bool:
    return os.path.isfile(os.path.join(cuda_home, "include", "cuda_runtime_api.h"))


def cuda_plan(torch_cuda: Optional[str], cuda_home: Optional[str], env: Mapping[str, str],
              release: Optional[Callable[[str], Optional[str]]] = None,
              headers: Optional[Callable[[str], bool]] = None) -> tuple[bool, str]:
    """(build the CUDA kernels too?, why). The same condition torch's build applies (nvcc's
    CUDA major version = torch's), checked here so that a mismatch builds the CPU kernels
    instead of nothing; and the toolkit's headers, which torch looks for under the CUDA_HOME it
    derived (from an nvcc on PATH that is a wrapper script, ``/usr/local``: no headers there)."""
    if env.get("DEPT_MEGA_NO_CUDA") == "1":
        return False, "DEPT_MEGA_NO_CUDA=1"
    if torch_cuda is None:
        return False, "this torch is a CPU build"
    if cuda_home is None:
        return False, (f"no CUDA toolkit found for torch's CUDA {torch_cuda} (set CUDA_HOME or put "
                       "nvcc on PATH)")
    nvcc = (release or nvcc_release)(cuda_home)
    if nvcc is None:
        return False, f"no working nvcc at {os.path.join(cuda_home, 'bin', 'nvcc')}"
    if nvcc.split(".")[0] != torch_cuda.split(".")[0]:
        return False, (f"nvcc at {cuda_home} is CUDA {nvcc}, torch was built with CUDA {torch_cuda}: "
                       "torch builds no CUDA extension across major versions (install the matching "
                       "toolkit and set CUDA_HOME)")
    if not (headers or has_cuda_headers)(cuda_home):
        return False, (f"the CUDA toolkit at {cuda_home} (CUDA_HOME, or where nvcc on PATH is) has no "
                       "include/cuda_runtime_api.h: set CUDA_HOME to the toolkit's folder (e.g. /usr/local/cuda)")
    return True, f"nvcc CUDA {nvcc} at {cuda_home}, torch's CUDA {torch_cuda}"


def default_arch_flags(env: Mapping[str, str], visible_gpus: int) -> list[str]:
    """nvcc's ``-gencode`` flags for :data:`DEFAULT_CUDA_ARCHS` when the build would otherwise
    have no architecture (no ``TORCH_CUDA_ARCH_LIST`` and no visible GPU), else none: torch's
    build then picks (the list, or the visible GPUs). Passed as the extension's nvcc flags,
    which torch's build takes instead of choosing its own."""
    if env.get("TORCH_CUDA_ARCH_LIST") or visible_gpus > 0:
        return []
    flags = []
    for arch in DEFAULT_CUDA_ARCHS.split(";"):
        num = arch.replace("+PTX", "").replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if arch.endswith("+PTX"):
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def nvidia_dirs(kind: str) -> list[str]:
    """The ``kind`` (``include`` | ``lib``) folders of NVIDIA's pip wheels of this Python
    (``nvidia/cu13/include``, ``nvidia/cublas/lib``, ...): where a torch from PyPI finds cuBLAS."""
    try:
        import nvidia  # a namespace package of the wheels
    except ImportError:
        return []
    out = []
    for base in getattr(nvidia, "__path__", []):
        for name in sorted(os.listdir(base)):
            if os.path.isdir(os.path.join(base, name, kind)):
                out.append(os.path.join(base, name, kind))
    return out


# the headers of csrc/cuda/fp8_gemm_lt.cpp beyond the CUDA runtime's: cuBLASLt's, and those torch's
# ATen/cuda/CUDAContextLight.h includes
LT_HEADERS = ("cublasLt.h", "cublas_v2.h", "cusparse.h", "cusolverDn.h")


def cublaslt_plan(cuda_home: Optional[str], torch_cuda: str, wheel_includes: Optional[list[str]] = None,
                  wheel_libs: Optional[list[str]] = None) -> tuple[Optional[dict[str, list[str]]], str]:
    """How to build csrc/cuda/fp8_gemm_lt.cpp (the FP8 GEMM operator's cuBLASLt kernel): the
    Extension fields it needs (include and library folders, libraries, link arguments), or None
    (not built, the other CUDA kernels are) when cublasLt.h is not found; and what was found.

    Headers: the toolkit's include folder, else the NVIDIA wheels' (a torch from PyPI brings
    them; a toolkit installed without cuBLAS has none). Library: ``libcublasLt.so`` in the
    toolkit (``lib64``, ``lib``, ``targets/*/lib``) or the wheels (``-lcublasLt``), else
    ``libcublasLt.so.<torch's CUDA major>`` (the wheels ship only that; ``-l:`` names the file).
    No library found: none is linked, and the extension resolves cuBLASLt's symbols when it loads,
    from the copy torch's own CUDA library has loaded (a shared object may keep undefined symbols)."""
    toolkit_inc = [os.path.join(cuda_home, "include")] if cuda_home else []
    wheel_includes = nvidia_dirs("include") if wheel_includes is None else wheel_includes
    has = {h: [d for d in toolkit_inc + wheel_includes if os.path.isfile(os.path.join(d, h))] for h in LT_HEADERS}
    if not has["cublasLt.h"]:
        return None, (f"cublasLt.h not found (in {cuda_home}/include or NVIDIA's pip wheels): the FP8 GEMM "
                      "operator's CUDA kernel (fp8_gemm: cublaslt) is not built")
    missing = [h for h in LT_HEADERS if not has[h]]
    if missing:
        return None, (f"{', '.join(missing)} not found next to cublasLt.h: the FP8 GEMM operator's CUDA kernel "
                      "(fp8_gemm: cublaslt) is not built")
    fields: dict[str, list[str]] = {"include_dirs": sorted({ds[0] for ds in has.values()} - set(toolkit_inc))}
    lib_dirs = []
    if cuda_home:
        lib_dirs += [os.path.join(cuda_home, "lib64"), os.path.join(cuda_home, "lib")]
        lib_dirs += sorted(glob.glob(os.path.join(cuda_home, "targets", "*", "lib")))
    lib_dirs += nvidia_dirs("lib") if wheel_libs is None else wheel_libs
    versioned = f"libcublasLt.so.{torch_cuda.split('.')[0]}"
    lib = next(((d, "libcublasLt.so") for d in lib_dirs if os.path.isfile(os.path.join(d, "libcublasLt.so"))),
               None) or next(((d, versioned) for d in lib_dirs if os.path.isfile(os.path.join(d, versioned))), None)
    where = f"headers in {has['cublasLt.h'][0]}"
    if lib is None:
        return fields, (f"{where}; no libcublasLt.so or {versioned} found: not linked, its symbols resolve from "
                        "torch's own CUDA libraries when the extension loads")
    d, name = lib
    if name == "libcublasLt.so":
        fields.update(library_dirs=[d], libraries=["cublasLt"])
    else:
        fields.update(extra_link_args=[f"-L{d}", f"-l:{name}"])
    return fields, f"{where}, linking {d}/{name}"


# A private copy of libstdc++ inside the extension: its streams' locale is never set up (that
# copy's static initialisers are not the process's), so formatting a number into a C++ message
# crashed (the GPU image's /opt/gcc g++ links libstdc++ statically: std::ostream::_M_insert<long>
# defined in our library, a segmentation fault at every error message with a number and at every
# FP8 GEMM tuning record). These are the symbols whose definition in the built library shows it.
STATIC_LIBSTDCXX_SYMBOLS = ("_ZNSt6locale7classicEv", "_ZNSo9_M_insertIlEERSoT_")


def runtime_libstdcxx(maps: str = "/proc/self/maps") -> Optional[str]:
    """The libstdc++ shared library this process has loaded (torch imported: the C++ runtime the
    extension runs with), or None (not Linux, or none loaded). Linked explicitly, before the
    compiler's own -lstdc++, it provides every libstdc++ symbol, so that a compiler that links
    libstdc++ statically pulls nothing from its archive."""
    try:
        with open(maps) as f:
            paths = {line.split()[-1] for line in f if "/libstdc++.so" in line}
    except OSError:
        return None
    found = sorted(p for p in paths if os.path.isfile(p))
    return found[0] if found else None


def static_libstdcxx(library: str, run: Callable = subprocess.run) -> Optional[list[str]]:
    """Which of STATIC_LIBSTDCXX_SYMBOLS the built ``library`` defines itself ([]: none, as it
    should be), or None when it cannot be checked (no ``nm``)."""
    try:
        p = run(["nm", "--defined-only", library], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    if p.returncode != 0:
        return None
    defined = {line.split()[-1] for line in p.stdout.splitlines() if line.strip()}
    return [s for s in STATIC_LIBSTDCXX_SYMBOLS if s in defined]


def check_built_library(library: str, run: Callable = subprocess.run) -> None:
    """Logs whether the built library carries its own libstdc++ (see STATIC_LIBSTDCXX_SYMBOLS)."""
    got = static_libstdcxx(library, run)
    if got is None:
        _log(f"could not check {library} for a static copy of libstdc++ (nm not found, or it failed)")
    elif got:
        _log(f"WARNING: {library} defines libstdc++'s own {', '.join(got)}: the compiler linked "
             "libstdc++ statically, and the extension's C++ errors with a number in their message "
             "can crash the process. Build with a compiler that links libstdc++ dynamically "
             "(CXX=/usr/bin/g++ pip install --no-build-isolation -e .)")
    else:
        _log(f"checked: {os.path.basename(library)} uses the process's libstdc++ (no static copy)")


def with_runtime_libstdcxx(fields: dict, lib: Optional[str]) -> dict:
    """``fields`` (Extension keyword arguments) with ``lib`` (runtime_libstdcxx) linked."""
    if lib is None:
        return fields
    return {**fields, "extra_link_args": [*fields.get("extra_link_args", []), lib]}


# The public build fields of a setuptools Extension (the private ones setuptools adds when it
# finalizes the command stay those of the extension the distribution was given).
_EXT_FIELDS = ("sources", "include_dirs", "define_macros", "undef_macros", "library_dirs", "libraries",
               "runtime_library_dirs", "extra_objects", "extra_compile_args", "extra_link_args",
               "export_symbols", "depends", "language")


def make_build_ext(cx, cpu_ext, cuda_ext):
    """A build_ext command that builds the distribution's extension (``cuda_ext`` when given)
    and, when that fails at any point (torch's version checks included), turns it into
    ``cpu_ext`` and builds that; never fatal."""

    class OptionalBuildExt(cx.BuildExtension):
        def run(self):
            what = "CPU+CUDA" if cuda_ext is not None else "CPU"
            compiler = self.compiler  # the option (a name or None); a run replaces it by a compiler object
            while True:
                self.compiler = compiler  # a retry with the object fails in distutils' new_compiler
                try:
                    super().run()
                    _log(f"built {EXT_NAME} ({what} kernels)")
                    try:  # a finished build stays built whatever the check meets
                        for ext in self.extensions:
                            check_built_library(self.get_ext_fullpath(ext.name))
                    except Exception as e:
                        _log(f"could not check the built library for a static copy of libstdc++: {e!r}")
                    return
                except Exception:
                    _log(f"building {EXT_NAME} ({what} kernels) failed:\n{traceback.format_exc()}")
                if what == "CPU":
                    break
                _log("retrying with the CPU kernels only")
                what = "CPU"
                for ext in self.extensions:
                    for name in _EXT_FIELDS:
                        setattr(ext, name, copy.deepcopy(getattr(cpu_ext, name)))
            _log("continuing without the extension: dept_mega.ops uses the PyTorch fallback")

    return OptionalBuildExt.with_options(use_ninja=True)


def extensions(env: Mapping[str, str] = os.environ):
    """(ext_modules, cmdclass); empty when the extension cannot be attempted."""
    if env.get("DEPT_MEGA_NO_EXT") == "1":
        _log("DEPT_MEGA_NO_EXT=1: not building the custom ops extension")
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension as cx
    except Exception as e:  # isolated build without torch, broken torch, ...
        _log(f"torch is not importable at build time ({e!r}); not building the custom ops "
             "extension (install torch first, then this package with --no-build-isolation)")
        return [], {}
    libstdcxx = runtime_libstdcxx()
    if libstdcxx is not None:
        _log(f"linking the C++ runtime this torch runs with ({libstdcxx}) explicitly: no static copy "
             "of libstdc++ in the extension, whatever the compiler's default")
    elif sys.platform.startswith("linux"):
        _log("no libstdc++ found loaded in this process (/proc/self/maps): the compiler's default "
             "C++ runtime is linked (the built library is checked for a static copy)")
    cpu_ext = cx.CppExtension(EXT_NAME, CPU_SOURCES,
                              **with_runtime_libstdcxx({"extra_compile_args": {"cxx": CXX_FLAGS}}, libstdcxx))
    with_cuda, why = cuda_plan(torch.version.cuda, cx.CUDA_HOME, env)
    cuda_ext = None
    if with_cuda:
        _log(f"building the CPU and CUDA kernels ({why})")
        arch_flags = default_arch_flags(env, torch.cuda.device_count())
        if arch_flags:
            _log(f"no GPU visible and no TORCH_CUDA_ARCH_LIST: building for {DEFAULT_CUDA_ARCHS} (A100, "
                 "H100/H200, PTX for newer GPUs); set TORCH_CUDA_ARCH_LIST to choose")
        lt, found = cublaslt_plan(cx.CUDA_HOME, torch.version.cuda)
        _log(f"cuBLASLt (the FP8 GEMM operator dept_mega::fp8_gemm): {found}")
        sources = CPU_SOURCES + CUDA_SOURCES + ([LT_SOURCE] if lt is not None else [])
        cuda_ext = cx.CUDAExtension(
            EXT_NAME, sources, define_macros=[("DEPT_MEGA_WITH_CUDA", "1")],
            extra_compile_args={"cxx": CXX_FLAGS, "nvcc": ["-O3", "--fmad=false", *arch_flags]},
            **with_runtime_libstdcxx(lt or {}, libstdcxx))
    else:
        _log(f"building the CPU kernels only: {why}")
    return [cuda_ext or cpu_ext], {"build_ext": make_build_ext(cx, cpu_ext, cuda_ext)}


if __name__ == "__main__":  # setuptools runs this file as __main__; tests import it
    ext_modules, cmdclass = extensions()
    setup(ext_modules=ext_modules, cmdclass=cmdclass)
