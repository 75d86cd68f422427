"""The mpi backend under mpirun: every collective at world 3 and 4 gives the
same bits as the rank-order formula the local backend is tested against, and
mismatches stop with a clear message. Skipped where OpenMPI is absent."""
import os
import shutil
import subprocess

import pytest

from helpers import BUILD, ROOT

BINARY = os.path.join(BUILD, "tests", "test_runtime_mpi")
MPIRUN = shutil.which("mpirun")

pytestmark = pytest.mark.skipif(MPIRUN is None, reason="mpirun not found (install openmpi-bin libopenmpi-dev)")


def mpirun(np, *args, timeout=120):
    if not os.access(BINARY, os.X_OK):
        pytest.fail("%s missing: run make first (with OpenMPI installed)" % BINARY)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1")
    cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-np", str(np), BINARY] + list(args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


@pytest.mark.parametrize("np", [4, 3])
def test_mpi_collectives_bitwise(np):
    p = mpirun(np)
    if "no MPI support" in p.stdout:
        pytest.skip("this build has no MPI support")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "== mpi_collectives (world %d) == OK" % np in p.stdout
    assert "1 passed, 0 failed" in p.stdout


def test_mpi_world_size_mismatch():
    p = mpirun(2, "--world", "4")
    assert p.returncode != 0
    assert "error: --world 4 but mpirun started 2 processes" in p.stderr


def test_mpi_collective_mismatch():
    p = mpirun(3, "--mismatch")
    assert p.returncode != 0
    assert ("error: collective mismatch on stream 'ag' #3: rank 0 all_gather 128 f32 (block2); "
            "rank 1 all_gather 128 f32 (block2); rank 2 reduce_scatter 64 f32 sum (block3)") in p.stderr


def test_mpi_collective_timeout():
    """The last rank skips an all-gather: the others stop after the 1 s watchdog, not hang
    (a hang hits mpirun's 60 s subprocess timeout; the message says the watchdog stopped it)."""
    p = mpirun(3, "--skip", timeout=60)
    assert p.returncode != 0
    assert "error: collective timeout on rank 0: stream 'ag' #3 all_gather 16 f32 (block2) waited 1.0 s" in p.stderr, p.stderr
