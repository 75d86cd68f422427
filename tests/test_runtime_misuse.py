"""Misuse of the runtime is one clear line on stderr and exit status 2.
Runs `build/tests/test_runtime --misuse KIND` (see tests/test_runtime.c)."""
import os
import re
import subprocess

import pytest

from helpers import BUILD, ROOT

BINARY = os.path.join(BUILD, "tests", "test_runtime")

CASES = {
    "event": r"error: event 'ag_done' waited on but never recorded",
    "event_sync": r"error: event 'rs_done' waited on but never recorded",
    "double_free": r"error: dev_free: 0x[0-9a-f]+ is not a live allocation of rank 0 \(double free\?\)",
    "foreign_free": r"error: dev_free: 0x[0-9a-f]+ is not a live allocation of rank 0 \(double free\?\)",
    "mismatch": re.escape("error: collective mismatch on stream 'ag' #14: rank 0 all_gather 8192 f32 (block2); "
                          "rank 1 all_gather 8192 f32 (block2); rank 2 reduce_scatter 16384 f32 sum (block3)"),
    "world0": re.escape("error: world size 0 is out of range (1..64 ranks)"),
    "world_big": re.escape("error: world size 65 is out of range (1..64 ranks)"),
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_misuse(kind):
    assert os.access(BINARY, os.X_OK), "%s missing: run make first" % BINARY
    p = subprocess.run([BINARY, "--misuse", kind], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2, "exit %d, stderr:\n%s" % (p.returncode, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, "expected one line, got:\n%s" % p.stderr
    assert re.fullmatch(CASES[kind], lines[0]), lines[0]


def test_mpi_backend_without_mpi_is_clear():
    """Only meaningful in a build without MPI; with MPI the binary says so and exits 0."""
    assert os.access(BINARY, os.X_OK), "%s missing: run make first" % BINARY
    p = subprocess.run([BINARY, "--misuse", "mpi_no_support"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    if p.returncode == 0:
        assert "mpi supported" in p.stdout
        return
    assert p.returncode == 2
    assert p.stderr.strip() == "error: this build has no MPI support (rebuild with OpenMPI installed)"
