"""make gpu-check's driver (tools/gpu_check.sh) on a machine without a GPU: its arguments, its one-line
refusals, the timeout of a step and the final `gpu-check: N passed, N failed` line, with a fake nvidia-smi.
(What it checks on a GPU is in tests/test_cuda_build.py: the harnesses run against themselves on the CPU.)"""
import os
import re
import subprocess
import sys

import pytest

from helpers import ROOT, SOLVED

SCRIPT = os.path.join(ROOT, "tools", "gpu_check.sh")

FAKE_SMI = """#!/bin/sh
case "$*" in
  -L) i=0; while [ $i -lt ${FAKE_GPUS:-2} ]; do echo "GPU $i: Fake GPU (UUID: GPU-$i)"; i=$((i + 1)); done ;;
  *) echo "0, Fake GPU, 0.0, 1 MiB" ;;
esac
"""


@pytest.fixture
def fake_path(tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    smi = d / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    return str(d)


def gpu_check(*args, path=None, env=None, timeout=120):
    e = dict(os.environ)
    e.pop("CUDA_VISIBLE_DEVICES", None)
    if path:
        e["PATH"] = path + os.pathsep + e["PATH"]
    e.update(env or {})
    return subprocess.run(["bash", SCRIPT] + list(args), cwd=ROOT, env=e, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_bad_arguments_get_one_line_and_status_2():
    for args, want in [(["--bogus"], "unknown argument '--bogus'"), (["--only"], "--only needs a pattern"),
                       (["--time-scale", "x"], "--time-scale needs a positive number"),
                       (["--time-scale", "0"], "--time-scale needs a positive number")]:
        p = gpu_check(*args)
        assert p.returncode == 2, (args, p.stdout, p.stderr)
        assert p.stdout.splitlines()[0].startswith("gpu_check.sh: ") and want in p.stdout, p.stdout


def test_no_nvidia_smi_is_one_line(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    e = {"PATH": "%s:/usr/bin:/bin" % empty}
    p = subprocess.run(["bash", SCRIPT], cwd=ROOT, env=e, capture_output=True, text=True, timeout=60)
    lines = [l for l in p.stdout.splitlines() if l.strip()]
    if os.path.exists("/usr/bin/nvidia-smi"):
        pytest.skip("this machine has /usr/bin/nvidia-smi")
    assert p.returncode == 2 and len(lines) == 1 and "nvidia-smi not found" in lines[0], p.stdout


def test_list_names_every_part():
    p = gpu_check("--list")
    assert p.returncode == 0, p.stdout + p.stderr
    names = p.stdout.split()
    for part in ("ops-f32", "ops-tf32", "colls-local-w4", "colls-nccl-wN", "nccl-wN", "grader"):
        assert part in names, p.stdout
    for kind in ("train", "rerun", "poison", "trace") if SOLVED else ():  # per solution: none in a student copy
        assert any(n.startswith(kind + "-") for n in names), p.stdout
    assert all(n in p.stdout for n in ("sanitizer-memcheck", "sanitizer-racecheck", "sanitizer-synccheck",
                                       "sanitizer-initcheck"))


def test_failures_are_counted_and_named(fake_path, tmp_path):
    """No GPU behind the fake nvidia-smi: the CUDA op harness fails, and the summary says so by name."""
    p = gpu_check("--only", "ops-*", "--out", str(tmp_path / "out"), path=fake_path)
    last = p.stdout.rstrip().splitlines()[-1]
    assert p.returncode == 1, p.stdout
    assert last == "gpu-check: 0 passed, 2 failed (failed: ops-f32 ops-tf32)", p.stdout
    assert re.search(r"== ops-f32 == FAIL \(exit \d+; log: ", p.stdout), p.stdout
    assert "gpus used: 2" in p.stdout


def test_visible_devices_bound_the_gpus_used(fake_path, tmp_path):
    p = gpu_check("--only", "none", "--out", str(tmp_path / "o"), path=fake_path,
                  env={"FAKE_GPUS": "4", "CUDA_VISIBLE_DEVICES": "2"})
    assert "gpus used: 1" in p.stdout, p.stdout
    assert p.stdout.rstrip().splitlines()[-1].startswith("gpu-check: 0 passed, 0 failed"), p.stdout


def test_a_step_that_hangs_is_stopped_and_named(fake_path, tmp_path):
    """A step that never ends (a python that sleeps forever in the trace check stands in for a hung run) is killed at its
    limit and reported as a hang; the run goes on to the summary."""
    hang = tmp_path / "hang"
    hang.write_text('#!/bin/sh\ncase "$*" in *trace_sanity.py*) exec sleep 100000 ;; esac\nexec %s "$@"\n'
                    % sys.executable)
    hang.chmod(0o755)
    p = gpu_check("--only", "trace-01", "--time-scale", "0.01", "--out", str(tmp_path / "o"), path=fake_path,
                  env={"PYTHON": str(hang)})
    if "trace-01" not in p.stdout:
        pytest.skip("this copy holds no stage 01 solution")
    assert "== trace-01 == FAIL: no result within 1s (a hang?" in p.stdout, p.stdout
    assert p.stdout.rstrip().splitlines()[-1] == "gpu-check: 0 passed, 1 failed (failed: trace-01)", p.stdout
