"""tools/torch_cxx_std.py: the C++ standard flag torch's BuildExtension adds to an extension's C++
compile, observed (torch 2.11: -std=c++17, later: -std=c++20), which tools/check_cuda_compile.sh
syntax-checks the CUDA operators with."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

from setuptools.command.build_ext import build_ext

from tests.trainer_utils import ROOT


def _tool():
    spec = importlib.util.spec_from_file_location("torch_cxx_std", os.path.join(ROOT, "tools", "torch_cxx_std.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_it_reports_the_flag_buildextension_adds(monkeypatch):
    """Whatever -std= the build command adds is what it reports (a stand-in BuildExtension adding
    -std=c++03 after the caller's flags: c++03, the last -std wins as with g++); the installed
    torch's is a C++ standard, printed alone on stdout by the command line."""
    from torch.utils import cpp_extension

    class Adds03(build_ext):
        @classmethod
        def with_options(cls, **options):
            return cls

        def build_extensions(self):
            inner = self.compiler._compile

            def compile_one(obj, src, ext, cc_args, extra_postargs, pp_opts):
                return inner(obj, src, ext, cc_args, [*extra_postargs, "-std=c++14", "-std=c++03"], pp_opts)
            self.compiler._compile = compile_one
            super().build_extensions()

    tool = _tool()
    real = tool.build_ext_std()
    assert re.fullmatch(r"-std=c\+\+\d\d", real), real
    monkeypatch.setattr(cpp_extension, "BuildExtension", Adds03)
    assert tool.build_ext_std() == "-std=c++03"
    monkeypatch.undo()
    # the command line, with the include folders tools/check_cuda_compile.sh reads from the same start
    res = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "torch_cxx_std.py"), "--include-paths"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout == f"{real}\n{' '.join(cpp_extension.include_paths())}\n", (res.stdout,
                                                                                                        res.stderr)
