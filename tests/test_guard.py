"""The device-memory guard (--guard-device-memory, HWFSDP_GUARD_DEVICE=1; common/runtime/guard.h).

Host code that reads or writes device memory stops with one line naming the buffer, its offset and the
function (`build/tests/test_guard --mode KIND`, tests/test_guard.c); the same read through dev_probe_read
passes; and every solution here (and the baseline) trains under the guard: the driver and the runtime touch
device memory only through copies. Skipped, with the guard's own reason, on a machine without x86 memory
protection keys.
"""
import os
import re
import subprocess

import pytest

from helpers import BASELINE, BUILD, ROOT, SOLVED, run_train, solution_bin

BINARY = os.path.join(BUILD, "tests", "test_guard")
GUARD_ENV = dict(os.environ, HWFSDP_GUARD_DEVICE="1")
UNAVAILABLE = "unavailable on this machine"


def run_mode(kind):
    return subprocess.run([BINARY, "--mode", kind], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env=GUARD_ENV)


@pytest.fixture(scope="module")
def guard():
    """Skips the module's tests where the guard cannot run (the line it prints says why)."""
    assert os.access(BINARY, os.X_OK), "%s missing: run make first" % BINARY
    p = run_mode("probe_read")
    for line in p.stderr.splitlines():
        if UNAVAILABLE in line:
            pytest.skip(line)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stdout + p.stderr


TAIL_READ = " on rank 1's host thread: device memory is read on the host only through a copy (dev_probe_read)"
CASES = {
    "host_read": re.escape("error: host code read device memory: 'layers.0.attention.wq.weight' (param, rank 1) "
                           "at byte offset 128, touched by peek_weights (tests/test_guard.c)" + TAIL_READ),
    "host_write": re.escape("error: host code wrote device memory: 'layers.0.attention.wq.weight' (param, rank 1) "
                            "at byte offset 12, touched by poke_weights (tests/test_guard.c) on rank 1's host thread: "
                            "device memory is written on the host only through a copy (dev_memcpy_async from "
                            "host memory)"),
    # memcmp faults inside libc: the code named is its caller in the program
    "host_memcmp": re.escape("error: host code read device memory: 'layers.0.attention.wq.weight' (param, rank 1) "
                             "at byte offset ") + r"\d+" +
                   re.escape(", touched by compare_weights (tests/test_guard.c) through libc.so.6" + TAIL_READ),
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_host_access_stops_with_one_line(guard, kind):
    p = run_mode(kind)
    assert p.returncode == 2, "exit %d, stdout:\n%s\nstderr:\n%s" % (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, "expected one line, got:\n%s" % p.stderr
    assert re.fullmatch(CASES[kind], lines[0]), lines[0]


def test_probe_read_passes(guard):
    p = run_mode("probe_read")
    assert p.returncode == 0 and p.stdout.strip() == "ok" and not p.stderr.strip(), p.stdout + p.stderr


# One short run per implementation here: the flag (not the environment) turns the guard on.
RUNS = [("baseline", BASELINE, [])] + [(s.dir, solution_bin(s), s.flags) for s in SOLVED]


@pytest.mark.parametrize("binary,flags", [r[1:] for r in RUNS], ids=[r[0] for r in RUNS])
def test_trains_under_the_guard(guard, binary, flags, tmp_path):
    p = run_train(binary, tmp_path / "run", "--flavor", "tiny", "--world", 4, "--seq-len", 64, "--batch-size", 2,
                  "--steps", 2, "--profile-steps", 2, "--guard-device-memory", *flags, check=False)
    assert p.returncode == 0, "exit %d:\n%s" % (p.returncode, p.stderr[-3000:])
    assert not p.stderr.strip(), p.stderr
