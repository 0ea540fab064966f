"""setup.py's choice of what to build: the CUDA kernels only when torch's own version check
would pass, else the CPU kernels with the reason logged, and a CPU retry whenever the CUDA
build fails (torch's checks raise before any kernel compiles); the C++ runtime linked explicitly
(a tiny library is compiled for that test, nothing else is)."""
from __future__ import annotations

import importlib.util
import os

import pytest
from setuptools import Distribution
from torch.utils import cpp_extension as cx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def setup_mod(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("dept_mega_setup", os.path.join(ROOT, "setup.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # not __main__: setup() does not run
    monkeypatch.setattr(mod, "LOG", str(tmp_path / "build.log"))
    return mod


@pytest.mark.parametrize("torch_cuda,home,nvcc,env,want,why", [
    ("13.0", "/usr/local", "13.0", {}, False, "/usr/local (CUDA_HOME, or where nvcc on PATH is) has no "
                                             "include/cuda_runtime_api.h"),
    (None, "/cuda", "13.0", {}, False, "CPU build"),
    ("13.0", "/cuda", "13.0", {"DEPT_MEGA_NO_CUDA": "1"}, False, "DEPT_MEGA_NO_CUDA=1"),
    ("13.0", None, None, {}, False, "no CUDA toolkit"),
    ("13.0", "/cuda", None, {}, False, "no working nvcc at /cuda/bin/nvcc"),
    ("12.8", "/cuda", "13.0", {}, False, "CUDA 13.0, torch was built with CUDA 12.8"),
    ("13.0", "/cuda", "13.1", {}, True, "nvcc CUDA 13.1"),
])
def test_cuda_plan(setup_mod, torch_cuda, home, nvcc, env, want, why):
    got, reason = setup_mod.cuda_plan(torch_cuda, home, env, release=lambda h: nvcc,
                                      headers=lambda h: h != "/usr/local")
    assert got is want and why in reason


def test_nvcc_release_reads_the_toolkit(setup_mod, tmp_path):
    assert setup_mod.nvcc_release(str(tmp_path)) is None  # no bin/nvcc there
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.8, V12.8.93'\n")
    nvcc.chmod(0o755)
    assert setup_mod.nvcc_release(str(tmp_path)) == "12.8"


def _fake_torch_cuda(monkeypatch, setup_mod, torch_cuda, nvcc):
    import torch
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    monkeypatch.setattr(cx, "CUDA_HOME", "/usr/local/cuda")
    monkeypatch.setattr(setup_mod, "nvcc_release", lambda home: nvcc)
    monkeypatch.setattr(setup_mod, "has_cuda_headers", lambda home: True)


def _sources(exts):
    return [s for e in exts for s in e.sources]


def test_mismatched_nvcc_builds_the_cpu_kernels(setup_mod, monkeypatch, tmp_path):
    _fake_torch_cuda(monkeypatch, setup_mod, "12.8", "13.0")
    exts, cmdclass = setup_mod.extensions({})
    assert _sources(exts) == setup_mod.CPU_SOURCES and "build_ext" in cmdclass
    log = (tmp_path / "build.log").read_text()
    assert "CPU kernels only" in log and "CUDA 13.0" in log and "12.8" in log


def _build_ext(setup_mod, exts, cmdclass, tmp_path):
    dist = Distribution({"name": "dept_mega", "ext_modules": exts, "cmdclass": cmdclass})
    cmd = dist.get_command_obj("build_ext")
    cmd.build_lib, cmd.build_temp = str(tmp_path / "lib"), str(tmp_path / "tmp")
    cmd.ensure_finalized()
    return cmd


@pytest.mark.parametrize("cpu_fails", [False, True])
def test_failed_cuda_build_retries_with_the_cpu_kernels(setup_mod, monkeypatch, tmp_path, cpu_fails):
    """torch's build raises before compiling anything (as its CUDA version check does): the
    same extension is built again with the CPU sources; if that fails too, no error escapes."""
    _fake_torch_cuda(monkeypatch, setup_mod, "13.0", "13.0")
    exts, cmdclass = setup_mod.extensions({})
    assert "csrc/cuda/kernels.cu" in _sources(exts)
    cmd = _build_ext(setup_mod, exts, cmdclass, tmp_path)
    built, compilers = [], []
    option = cmd.compiler

    def fake_run(self):
        srcs = _sources(self.extensions)
        built.append(srcs)
        compilers.append(self.compiler)
        self.compiler = object()  # distutils' build_ext.run replaces the option by a compiler object
        if any(s.endswith(".cu") for s in srcs) or cpu_fails:
            raise RuntimeError("The detected CUDA version mismatches the version that was used to compile PyTorch")

    monkeypatch.setattr(cx.BuildExtension, "run", fake_run)
    cmd.run()
    assert len(built) == 2 and built[1] == setup_mod.CPU_SOURCES
    assert compilers == [option, option]  # the retry starts from the option, not the first run's object
    assert cmd.extensions[0] is exts[0] and exts[0]._full_name == setup_mod.EXT_NAME
    log = (tmp_path / "build.log").read_text()
    assert "retrying with the CPU kernels only" in log
    assert ("continuing without the extension" in log) is cpu_fails
    assert ("built dept_mega.ops._C (CPU kernels)" in log) is not cpu_fails


@pytest.mark.parametrize("env,gpus,want", [
    ({}, 0, ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
             "-gencode=arch=compute_90,code=compute_90"]),
    ({"TORCH_CUDA_ARCH_LIST": "9.0"}, 0, []),
    ({}, 1, []),
])
def test_a_build_without_a_visible_gpu_gets_default_architectures(setup_mod, monkeypatch, env, gpus, want):
    """torch 2.11's build stops with an IndexError where no GPU is visible and no
    TORCH_CUDA_ARCH_LIST is set (a login node): the CUDA extension then carries nvcc flags for
    the default architectures, which torch's build takes instead of choosing its own."""
    import torch
    _fake_torch_cuda(monkeypatch, setup_mod, "13.0", "13.0")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    (ext,), _ = setup_mod.extensions(env)
    nvcc = ext.extra_compile_args["nvcc"]
    assert [f for f in nvcc if f.startswith("-gencode")] == want
    if want:
        assert cx._get_cuda_arch_flags(nvcc) == []  # torch's build then skips its own choice


def test_cublaslt_plan_finds_the_headers_and_the_library(setup_mod, tmp_path):
    """The cuBLASLt GEMM (csrc/cuda/fp8_gemm_lt.cpp) is built when cublasLt.h and the headers
    torch's CUDAContextLight.h includes are found (toolkit or NVIDIA's wheels); linked with
    libcublasLt.so when there is one, else the library of torch's CUDA major version, else not."""
    home, wheel = tmp_path / "cuda", tmp_path / "nvidia" / "cu13"
    for d in (home / "include", wheel / "include", wheel / "lib"):
        d.mkdir(parents=True)

    def plan():
        return setup_mod.cublaslt_plan(str(home), "13.0", [str(wheel / "include")], [str(wheel / "lib")])

    fields, why = plan()
    assert fields is None and "cublasLt.h not found" in why
    (wheel / "include" / "cublasLt.h").touch()
    fields, why = plan()
    assert fields is None and "cublas_v2.h, cusparse.h, cusolverDn.h not found" in why
    for h in setup_mod.LT_HEADERS:
        (wheel / "include" / h).touch()
    fields, why = plan()
    assert fields == {"include_dirs": [str(wheel / "include")]} and "not linked" in why
    (wheel / "lib" / "libcublasLt.so.12").touch()  # another CUDA major: not this torch's
    assert plan()[0] == {"include_dirs": [str(wheel / "include")]}
    (wheel / "lib" / "libcublasLt.so.13").touch()
    fields, why = plan()
    assert fields["extra_link_args"] == [f"-L{wheel / 'lib'}", "-l:libcublasLt.so.13"] and "linking" in why
    (home / "lib64").mkdir()
    (home / "lib64" / "libcublasLt.so").touch()
    for h in setup_mod.LT_HEADERS:
        (home / "include" / h).touch()
    fields, _ = plan()  # the toolkit's headers (already on the include path) and its library
    assert fields == {"include_dirs": [], "library_dirs": [str(home / "lib64")], "libraries": ["cublasLt"]}


@pytest.mark.parametrize("found", [True, False])
def test_the_cuda_build_has_the_cublaslt_gemm_when_planned(setup_mod, monkeypatch, found):
    _fake_torch_cuda(monkeypatch, setup_mod, "13.0", "13.0")
    fields = {"include_dirs": ["/w/include"], "extra_link_args": ["-L/w/lib", "-l:libcublasLt.so.13"]}
    monkeypatch.setattr(setup_mod, "cublaslt_plan", lambda home, cuda: (fields if found else None, "why"))
    (ext,), _ = setup_mod.extensions({"TORCH_CUDA_ARCH_LIST": "9.0"})
    assert (setup_mod.LT_SOURCE in ext.sources) is found
    assert set(setup_mod.CUDA_SOURCES) <= set(ext.sources)
    assert ("/w/include" in ext.include_dirs and "-l:libcublasLt.so.13" in ext.extra_link_args) is found


def test_sdist_holds_every_source_and_header(tmp_path):
    """A source distribution can build the extension: every file under csrc/ is in it."""
    import subprocess
    import sys
    import tarfile
    env = dict(os.environ, DEPT_MEGA_NO_EXT="1")
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path), "egg_info",
                    "--egg-base", str(tmp_path)], cwd=ROOT, env=env, check=True, capture_output=True)
    (sdist,) = tmp_path.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    want = {os.path.relpath(os.path.join(d, f), ROOT) for d, _, fs in os.walk(os.path.join(ROOT, "csrc")) for f in fs}
    assert want and want <= names, sorted(want - names)
    assert not any(n.endswith(".so") for n in names)


NUM_SRC = r"""
#include <cstdio>
#include <sstream>
#include <string>
extern "C" int fmt(long x, char* out, int n) {
  std::ostringstream s;
  s << "got " << x;
  return std::snprintf(out, n, "%s", s.str().c_str());
}
"""


def test_a_compiler_that_links_libstdcxx_statically_gets_the_runtime_one(setup_mod, tmp_path):
    """A compiler that links libstdc++ statically (the GPU image's /opt/gcc g++: -static-libstdc++
    here) left the extension a private copy whose streams have no locale: a number formatted into
    a C++ error message crashed the process there, and comes out empty here. With the runtime's
    libstdc++ linked explicitly (setup.py's extra link argument) nothing is copied, the number is
    formatted, and the build's check tells the two apart."""
    import ctypes
    import shutil
    import subprocess

    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++ on PATH")
    lib = setup_mod.runtime_libstdcxx()  # torch is imported: its C++ runtime is loaded
    assert lib is not None and os.path.basename(lib).startswith("libstdc++.so")
    (tmp_path / "num.cpp").write_text(NUM_SRC)
    built = {}
    for name, fields in (("static", {}), ("fixed", setup_mod.with_runtime_libstdcxx({}, lib))):
        out = str(tmp_path / f"{name}.so")
        p = subprocess.run([gxx, "-shared", "-fPIC", "-O2", str(tmp_path / "num.cpp"), "-o", out,
                            *fields.get("extra_link_args", []), "-static-libstdc++"], capture_output=True, text=True)
        if p.returncode != 0:
            pytest.skip(f"g++ cannot link libstdc++ statically here: {p.stderr[-300:]}")
        built[name] = out
    assert setup_mod.static_libstdcxx(built["static"]) == list(setup_mod.STATIC_LIBSTDCXX_SYMBOLS)
    assert setup_mod.static_libstdcxx(built["fixed"]) == []
    buf = ctypes.create_string_buffer(64)
    ctypes.CDLL(built["fixed"]).fmt(-5, buf, 64)
    assert buf.value == b"got -5"
    setup_mod.check_built_library(built["static"])
    setup_mod.check_built_library(built["fixed"])
    log = open(setup_mod.LOG).read()
    assert "static.so defines libstdc++'s own" in log and "fixed.so uses the process's libstdc++" in log
    assert setup_mod.static_libstdcxx(built["fixed"], run=lambda *a, **k: (_ for _ in ()).throw(OSError())) is None


def test_runtime_libstdcxx_reads_the_process_maps(setup_mod, tmp_path):
    maps = tmp_path / "maps"
    real = tmp_path / "libstdc++.so.6.0.33"
    real.write_text("")
    maps.write_text(f"7f00-7f10 r-xp 0 08:01 1 {real}\n7f10-7f20 r-xp 0 08:01 2 /lib/libc.so.6\n")
    assert setup_mod.runtime_libstdcxx(str(maps)) == str(real)
    maps.write_text("7f10-7f20 r-xp 0 08:01 2 /lib/libc.so.6\n")
    assert setup_mod.runtime_libstdcxx(str(maps)) is None
    assert setup_mod.runtime_libstdcxx(str(tmp_path / "none")) is None
    assert setup_mod.with_runtime_libstdcxx({"extra_link_args": ["-L/x"]}, "/l.so") == {"extra_link_args": ["-L/x", "/l.so"]}
    assert setup_mod.with_runtime_libstdcxx({"a": 1}, None) == {"a": 1}
