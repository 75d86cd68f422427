"""Runs every C unit test binary (build/tests/test_*) and checks its summary line."""
import glob
import os
import re
import subprocess

import pytest

from helpers import BUILD, ROOT

# Binaries that need a launcher (mpirun) have their own Python wrapper.
SKIP = {"test_runtime_mpi"}
BINARIES = sorted(b for b in glob.glob(os.path.join(BUILD, "tests", "test_*"))
                  if os.access(b, os.X_OK) and os.path.basename(b) not in SKIP)


def test_unit_binaries_were_built():
    assert BINARIES, "no build/tests/test_* binaries: run make first"


@pytest.mark.parametrize("binary", BINARIES, ids=[os.path.basename(b) for b in BINARIES])
def test_c_unit(binary):
    p = subprocess.run([binary], capture_output=True, text=True, timeout=600, cwd=ROOT)
    lines = p.stdout.strip().splitlines()
    m = re.match(r"(\d+) passed, (\d+) failed", lines[-1] if lines else "")
    assert m, "no summary line from %s:\n%s\n%s" % (binary, p.stdout[-3000:], p.stderr[-3000:])
    assert int(m.group(2)) == 0 and p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert int(m.group(1)) > 0
