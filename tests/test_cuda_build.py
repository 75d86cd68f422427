"""The CUDA backend on a machine without a GPU: what can be checked here.

`make cuda` (run by CI before the tests) compiles every CUDA file for sm_80 and
sm_90, plus PTX for newer GPUs, with warnings as errors and links cuBLAS and NCCL. These tests then run
the CUDA build's binaries as far as they go without a GPU (flag parsing, the
backend checks, the one-line error when no device is visible) and test the
GPU-vs-CPU comparison that `make gpu-check` relies on, on two CPU runs."""
import os
import subprocess
import sys

import pytest

from helpers import BASELINE, CORPUS, ROOT, no_cuda_build_reason, nvcc_path, run_train

CUDA_BUILD = os.path.join(ROOT, "build-cuda")
CUDA_BASELINE = os.path.join(CUDA_BUILD, "baseline", "train")
HAVE_NVCC = nvcc_path() is not None
PYTHON = sys.executable


def have_gpu():
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


needs_cuda_build = pytest.mark.skipif(not os.path.exists(CUDA_BASELINE), reason=no_cuda_build_reason())


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc (the CUDA toolkit) is not installed: `make cuda` needs it")
def test_cuda_build_is_complete():
    """make cuda built the runtime, the baseline, every stage, the op and collective checkers and make gpu-calibrate's
    program (tests/test_gpu_calibrate.py runs it)."""
    p = subprocess.run(["make", "-s", "--no-print-directory", "cuda"], cwd=ROOT, capture_output=True, text=True,
                       timeout=1800)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "compiled only" in p.stdout
    stages = sorted(d for d in os.listdir(os.path.join(ROOT, "stages")) if d[:2].isdigit())
    for b in [CUDA_BASELINE] + [os.path.join(CUDA_BUILD, "tests", t) for t in ("check_ops", "check_colls")] + \
             [os.path.join(CUDA_BUILD, "tools", "gpu_calibrate")] + \
             [os.path.join(CUDA_BUILD, "stages", s, "train") for s in stages]:
        assert os.access(b, os.X_OK), b


@needs_cuda_build
def test_cuda_binary_parses_flags_without_a_gpu():
    p = subprocess.run([CUDA_BASELINE, "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "--tf32" in p.stdout and "nccl-mpi" in p.stdout


@needs_cuda_build
@pytest.mark.parametrize("flags, message", [
    (["--backend", "mpi"], "error: --backend mpi is the CPU build's multi-process backend; "
                           "the CUDA build uses nccl-mpi under mpirun"),
    (["--world", "0"], "error: --world must be in [1, 16384], got 0"),
])
def test_cuda_binary_bad_flags(flags, message):
    p = subprocess.run([CUDA_BASELINE, "--flavor", "tiny", "--steps", "1", "--quiet"] + flags,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert p.stderr.strip().splitlines()[-1] == message


@needs_cuda_build
@pytest.mark.skipif(have_gpu(), reason="a GPU is visible: make gpu-check covers this machine")
def test_cuda_binary_without_gpu_is_one_line(tmp_path):
    p = subprocess.run([CUDA_BASELINE, "--flavor", "tiny", "--steps", "1", "--quiet", "--data", CORPUS,
                        "--out", str(tmp_path / "r")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, (p.returncode, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no CUDA device is visible ("), p.stderr
    assert lines[0].endswith("the CPU build (make) runs without one")


@needs_cuda_build
@pytest.mark.skipif(have_gpu(), reason="a GPU is visible: make gpu-check runs check_colls there")
def test_check_colls_cuda_without_gpu_is_one_line():
    p = subprocess.run([os.path.join(CUDA_BUILD, "tests", "check_colls"), "--world", "1"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no CUDA device is visible ("), p.stderr


def test_compare_runs_accepts_equal_and_rejects_different(tmp_path):
    """gpu-check's comparison: a run against itself passes; a run with another seed fails."""
    flags = ["--flavor", "tiny", "--world", "1", "--steps", "4", "--warmup-steps", "1"]
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    run_train(BASELINE, a, *flags)
    run_train(BASELINE, b, *flags)
    run_train(BASELINE, c, *flags, "--seed", "7")
    cmp = os.path.join(ROOT, "tools", "compare_runs.py")
    ok = subprocess.run([PYTHON, cmp, "same", str(a), str(b)], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.rstrip().endswith("OK"), ok.stdout
    bad = subprocess.run([PYTHON, cmp, "seed", str(a), str(c)], capture_output=True, text=True)
    assert bad.returncode == 1 and "FAIL" in bad.stdout, bad.stdout
    missing = subprocess.run([PYTHON, cmp, "missing", str(a), str(tmp_path / "nope")], capture_output=True, text=True)
    assert missing.returncode == 1 and "cannot read the runs" in missing.stdout


def test_gpu_op_harness_against_itself():
    """check_ops (gpu-check part 1) built on the CPU with the CPU kernels on both sides: every op is
    compared, every op with an [a] tensor (kernels.h) also with bfloat16 activations, every error is exactly 0,
    both runs agree bitwise (so the harness's buffer plumbing is right, bf16 buffers included)."""
    exe = os.path.join(BASELINE.rsplit(os.sep, 2)[0], "tests", "check_ops_selftest")
    p = subprocess.run([exe], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    lines = [l for l in p.stdout.splitlines() if l.startswith("op ")]
    ops = {l.split()[1] for l in lines}
    by_dtype = {dt: {l.split()[1] for l in lines if l.split()[2] == dt} for dt in ("f32", "bf16")}
    activation_ops = {"embedding_forward", "embedding_backward", "rmsnorm_forward", "rmsnorm_backward",
                      "matmul_forward", "matmul_backward", "rope_forward", "rope_backward", "attention_forward",
                      "attention_backward", "swiglu_forward", "swiglu_backward", "add"}
    assert by_dtype["f32"] == ops
    assert activation_ops | {"rope_tables", "sumsq_accumulate", "adamw", "crossentropy_forward",
                             "crossentropy_backward"} <= ops
    assert by_dtype["bf16"] == activation_ops, by_dtype["bf16"]
    assert all(l.split()[2] in ("f32", "bf16") for l in lines), p.stdout
    assert all("max_rel_err 0.00e+00" in l and l.endswith("OK") for l in lines), p.stdout
    assert p.stdout.rstrip().endswith("%d ops passed, 0 failed" % len(lines))


@needs_cuda_build
@pytest.mark.skipif(have_gpu(), reason="a GPU is visible: make gpu-check runs the grader there")
def test_grader_cuda_mode_builds_and_reports_the_missing_gpu(tmp_path):
    """grade.py --cuda builds the stage against the CUDA runtime and relays its one-line error."""
    base = os.path.join(ROOT, "solutions")
    if not os.path.isdir(base):
        pytest.skip("student tree: no solutions/")
    p = subprocess.run([PYTHON, os.path.join(ROOT, "grader", "grade.py"), "--solutions", "--cuda", "--stage", "02",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert "no CUDA device is visible" in p.stdout, p.stdout[-3000:]
    assert "Score: 0/" in p.stdout


def test_cuda_builds_ptx_for_newer_gpus():
    """Machine code for each CUDA_ARCHS, and the lowest one's PTX, which the driver compiles at load time for
    any newer GPU (without it, sm_100 or sm_120 fail at the first launch with "no kernel image")."""
    rule = "hwfsdp-print-vars: ; @printf '%s\\n%s\\n' \"$(CUDA_ARCHS)\" \"$(NVCC_GENCODE)\""
    p = subprocess.run(["make", "-s", "--no-print-directory", "--eval", rule, "hwfsdp-print-vars"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    archs, gencode = p.stdout.split("\n")[:2]
    archs = archs.split()
    assert archs == sorted(archs, key=int) and archs, archs
    for a in archs:
        assert "arch=compute_%s,code=sm_%s" % (a, a) in gencode, gencode
    assert "arch=compute_%s,code=compute_%s" % (archs[0], archs[0]) in gencode, gencode
