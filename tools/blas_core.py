#!/usr/bin/env python3
"""blas_core.py [--other] — the OpenBLAS core type (kernel family) this machine runs the training binary on, or
with --other one it does not pick but can run: the second kernel `make blas-check` tests under.

OpenBLAS picks a kernel per CPU at load time (DYNAMIC_ARCH builds, as Debian's), and OPENBLAS_CORETYPE overrides
it; kernels round differently in the last bits. --other prefers Haswell (AVX2 + FMA), then Prescott (SSE3, any
x86-64), then Sandybridge (AVX), the first that differs from the current one and that this CPU supports."""
import argparse
import os
import sys

from repo_paths import ROOT
from gradelib.runner import openblas_core

BINARY = os.path.join(ROOT, "build", "baseline", "train")
# each core type with the CPU flags (/proc/cpuinfo) its kernels need
CANDIDATES = (("Haswell", {"avx2", "fma"}), ("Prescott", {"pni"}), ("Sandybridge", {"avx"}))


def cpu_flags():
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def main(argv=None):
    ap = argparse.ArgumentParser(prog="blas_core.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--other", action="store_true", help="a core type this CPU runs that OpenBLAS does not pick here")
    args = ap.parse_args(argv)
    if not os.access(BINARY, os.X_OK):
        print("blas_core.py: %s is missing: run make first" % os.path.relpath(BINARY, ROOT), file=sys.stderr)
        return 2
    core = openblas_core(BINARY, os.environ.get("OPENBLAS_CORETYPE") or None)
    if core is None:
        print("blas_core.py: OpenBLAS does not name its core here (OPENBLAS_VERBOSE=2 printed none)", file=sys.stderr)
        return 2
    if not args.other:
        print(core)
        return 0
    flags = cpu_flags()
    for name, need in CANDIDATES:
        if name != core and need <= flags and openblas_core(BINARY, name) == name:
            print(name)
            return 0
    print("blas_core.py: no core type other than %s runs on this CPU" % core, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
