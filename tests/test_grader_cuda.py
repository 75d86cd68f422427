"""What grade.py --cuda changes that can be checked without a GPU: the resource limits of a CUDA run (no
address-space limit: the CUDA driver maps far more than the rubric's 16 GiB before the first allocation, so
cudaSetDevice failed under it on an H100) and the wording of an out-of-memory failure."""
import os
import resource
import sys

from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "grader"))
from gradelib.runner import Runner, classify_run, run_limited  # noqa: E402

import manifest  # noqa: E402

LIMITS = manifest.rubric()["limits"]

PROBE = [sys.executable, "-c", "import resource; print('AS', resource.getrlimit(resource.RLIMIT_AS)[0])"]


def child_address_space(tmp_path, runner):
    log = tmp_path / "log.txt"
    rc, _ = run_limited(PROBE, str(log), 60, runner.limits)
    assert rc == 0, log.read_text()
    return int(log.read_text().split("AS ")[-1])


def test_cpu_runs_keep_the_address_space_limit(tmp_path):
    want = int(LIMITS["run_address_space_gib"] * (1 << 30))
    assert child_address_space(tmp_path, Runner(LIMITS, 60)) == want


def test_cuda_runs_have_no_address_space_limit(tmp_path):
    assert child_address_space(tmp_path, Runner(LIMITS, 60, cuda=True)) == resource.RLIM_INFINITY
    assert LIMITS["run_address_space_gib"] is not None  # the rubric's own dict is not changed


def test_out_of_memory_names_the_limit_only_where_it_applies(tmp_path):
    log = tmp_path / "log.txt"
    log.write_text("error: rank 0: CUDA out of memory allocating 64 bytes for 'x'\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _, cpu = classify_run(2, str(log), str(run_dir), 60, 3, Runner(LIMITS, 60).limits)
    _, gpu = classify_run(2, str(log), str(run_dir), 60, 3, Runner(LIMITS, 60, cuda=True).limits)
    assert "address space" in cpu, cpu
    assert "out of memory" in gpu and "address space" not in gpu, gpu


def test_clock_checks_are_left_out_on_a_gpu():
    """grade.py --cuda leaves out exactly the checks that judge durations (Check.clock): on one shared GPU the
    solution of stage 11 read a 56% bubble against 38% on the modelled clock (make gpu-check on an H100)."""
    from gradelib.checks import CHECKS, OVERLAP_CHECKS
    from gradelib.cli import not_graded
    clock = {k for k, c in CHECKS.items() if c.clock}
    assert set(OVERLAP_CHECKS) | {"pp_bubble"} <= clock
    assert "pp_schedule" not in clock and "loss" not in clock  # the order of passes and the numbers hold on a GPU
    for key in CHECKS:
        assert not_graded(key, cuda=False) is None
        assert (not_graded(key, cuda=True) is not None) == (key in clock), key
