"""Runs every C unit test binary and checks its summary line.

The list comes from the sources, as the Makefile's does (TEST_SRC := $(wildcard tests/test_*.c), each built to
build/tests/test_*), not from the binaries found: a test that failed to build is a failing test that names it,
not one missing from the list."""
import glob
import os
import re
import subprocess

import pytest

from helpers import BUILD, ROOT

# Sources whose binary needs a launcher (mpirun): their own Python wrapper runs them.
SKIP = {"test_runtime_mpi": "tests/test_mpi.py"}
SOURCES = sorted(glob.glob(os.path.join(ROOT, "tests", "test_*.c")))
NAMES = [os.path.splitext(os.path.basename(s))[0] for s in SOURCES]
UNITS = [n for n in NAMES if n not in SKIP]


def test_the_list_is_the_makefiles():
    """The Makefile still builds every tests/test_*.c to build/tests/ (this list's rule), and what SKIP leaves
    out is there and has its wrapper."""
    with open(os.path.join(ROOT, "Makefile")) as fh:
        mk = fh.read()
    assert re.search(r"^TEST_SRC\s*:=\s*\$\(wildcard tests/test_\*\.c\)\s*$", mk, re.M), \
        "the Makefile's TEST_SRC is no longer $(wildcard tests/test_*.c): update SOURCES here to its rule"
    assert re.search(r"^TEST_BIN\s*:=\s*\$\(patsubst tests/%\.c,\$\(BUILD\)/tests/%,\$\(TEST_SRC\)\)\s*$", mk, re.M), \
        "the Makefile's TEST_BIN no longer builds tests/X.c to $(BUILD)/tests/X: update the binaries' path here"
    assert UNITS, "no tests/test_*.c"
    for name, wrapper in SKIP.items():
        assert name in NAMES and os.path.isfile(os.path.join(ROOT, wrapper)), (name, wrapper)


@pytest.mark.parametrize("name", UNITS)
def test_c_unit(name):
    binary = os.path.join(BUILD, "tests", name)
    shown = os.path.relpath(binary, ROOT) if binary.startswith(ROOT + os.sep) else binary
    assert os.access(binary, os.X_OK), "%s is missing: tests/%s.c did not build (run make: its errors say why)" % (
        shown, name)
    p = subprocess.run([binary], capture_output=True, text=True, timeout=600, cwd=ROOT)
    lines = p.stdout.strip().splitlines()
    m = re.match(r"(\d+) passed, (\d+) failed", lines[-1] if lines else "")
    assert m, "no summary line from %s:\n%s\n%s" % (binary, p.stdout[-3000:], p.stderr[-3000:])
    assert int(m.group(2)) == 0 and p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert int(m.group(1)) > 0
