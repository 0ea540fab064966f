// The extension's C++ sources for the CPU, built as one translation unit (setup.py's
// CPU_SOURCES): torch's headers are most of a unit's compile (about 18 s of g++ each), the
// kernels' own code a few seconds, so one unit builds in about 40 s of one core where three
// took about 53 s on two (83 s of CPU). The files keep their own includes and purposes; in
// this unit their file-scope names (namespace dept_mega and its anonymous namespaces) must not
// collide.
#include "registration.cpp"
#include "cpu/ops_cpu.cpp"
#include "cpu/dgelu_cast_cpu.cpp"
