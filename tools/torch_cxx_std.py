"""Prints the C++ standard flag (e.g. ``-std=c++17``) that this Python's torch builds extensions
with: the one its ``BuildExtension`` (setup.py's route, which builds dept_mega.ops) adds to a
C++ compile. torch 2.11 adds ``-std=c++17``, later versions ``-std=c++20``; torch exposes no
constant for it, so it is observed: BuildExtension compiles an empty probe source with a
compiler stand-in that records the flags and stops before running anything.

tools/check_cuda_compile.sh uses it so that its syntax checks use the standard of the torch the
extension is built with. Exits 2 when torch is not importable, 1 with a message when no -std
flag was seen or the arguments are not understood (a torch whose BuildExtension works otherwise: set CXX_STD for the check script).

    python tools/torch_cxx_std.py                    # -std=c++17
    python tools/torch_cxx_std.py --include-paths    # and a second line: torch's include folders
                                                     # (space-separated), as a C++ extension gets them
"""
from __future__ import annotations

import os
import sys
import tempfile


class _Seen(Exception):
    """Raised by the compiler stand-in with the flags of the first compile."""


def build_ext_std() -> str:
    """The -std=... flag torch's BuildExtension passes to a C++ compile ("" when none)."""
    from setuptools import Distribution
    from torch.utils import cpp_extension

    class Probe(cpp_extension.BuildExtension.with_options(use_ninja=False)):
        def build_extensions(self):
            def compile_one(obj, src, ext, cc_args, extra_postargs, pp_opts):
                raise _Seen(list(extra_postargs))
            self.compiler._compile = compile_one  # BuildExtension wraps it, adding its flags
            super().build_extensions()

    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as d:
        os.chdir(d)
        try:
            open("probe.cpp", "w").close()
            dist = Distribution({"name": "probe", "ext_modules": [cpp_extension.CppExtension("probe", ["probe.cpp"])],
                                 "script_args": ["build_ext", "--build-temp", d, "--build-lib", d]})
            dist.parse_command_line()
            dist.cmdclass["build_ext"] = Probe
            try:
                dist.run_commands()
            except _Seen as e:
                stds = [f for f in e.args[0] if f.startswith("-std=")]
                return stds[-1] if stds else ""  # the last one wins, as with g++
        finally:
            os.chdir(cwd)
    raise RuntimeError("torch's BuildExtension compiled nothing for the probe extension")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args not in ([], ["--include-paths"]):
        print("usage: python tools/torch_cxx_std.py [--include-paths]", file=sys.stderr)
        return 1
    try:
        import torch  # noqa: F401
    except ImportError as e:
        print(f"torch_cxx_std: torch is not importable with {sys.executable}: {e}", file=sys.stderr)
        return 2
    std = build_ext_std()
    if not std:
        print("torch_cxx_std: torch's BuildExtension passed no -std= flag to the probe compile",
              file=sys.stderr)
        return 1
    print(std)
    if args:  # (one Python start with torch for both: tools/check_cuda_compile.sh)
        from torch.utils.cpp_extension import include_paths
        print(" ".join(include_paths()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
