"""`make gpu-calibrate`'s program (tools/gpu_calibrate.c) on a machine without a GPU: what can be checked here.

The CUDA build (build-cuda/tools/gpu_calibrate, made by `make cuda`) times the CUDA backend's kernels on a GPU; it is
compiled only. Here:
- the CPU build (build/tools/gpu_calibrate, made by `make`): --help, one line and exit status 2 for every bad
  argument, the op list (the GEMMs of 8B and 70B, flash attention, an 8B block's element-wise kernels, a device
  copy) with its modelled times, those times equal to the modelled clock's (--self-test), and the summary of given
  timings (--fake-times): each class's measured/modelled is recomputed here from the fake inputs and the listed
  modelled times;
- the CUDA build, where one was made: the same --help, argument errors and list, and without a GPU one line
  "error: no CUDA device: ..." and exit status 2.
"""
import os
import re
import subprocess

import pytest

from helpers import BUILD, ROOT, no_cuda_build_reason

CPU_BIN = os.path.join(BUILD, "tools", "gpu_calibrate")
CUDA_BIN = os.path.join(ROOT, "build-cuda", "tools", "gpu_calibrate")
CLASSES = ("matmul", "attention", "elementwise", "copy")


def run(binary, *args):
    return subprocess.run([binary, *map(str, args)], capture_output=True, text=True, timeout=120, cwd=ROOT)


def have_gpu():
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def listed(binary=CPU_BIN, *args):
    """[(id, class, modelled us, where)] of --list."""
    p = run(binary, "--list", *args)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    out = []
    for line in p.stdout.splitlines():
        if line.startswith("op "):
            _, op, cls, us, where = line.split(" ", 4)
            out.append((op, cls, float(us), where))
    return out


def summary(stdout):
    """{class: (ratio as printed, n ops)} and the final line."""
    per = {m.group(1): (float(m.group(2)), int(m.group(3))) for m in
           re.finditer(r"^gpu-calibrate: (\w+) measured/modelled = ([\d.]+) \((\d+) ops?\)$", stdout, re.M)}
    final = [l for l in stdout.splitlines() if l.startswith("gpu-calibrate: ") and " over all" in l]
    assert len(final) == 1, stdout
    return per, final[0]


def test_help_and_usage_say_compiled_only():
    p = run(CPU_BIN, "--help")
    assert p.returncode == 0 and p.stderr == ""
    assert p.stdout.startswith("usage: gpu_calibrate ") and "COMPILED ONLY" in p.stdout
    for flag in ("--profile", "--repeats", "--warmup", "--only", "--out", "--list", "--fake-times", "--self-test"):
        assert flag in p.stdout, flag


BAD = [
    (["--bogus"], "error: gpu_calibrate: unknown argument '--bogus' (gpu_calibrate --help lists them)"),
    (["--repeats", "0"], "error: gpu_calibrate: --repeats takes a whole number in [1, 1000], got '0'"),
    (["--warmup", "2x"], "error: gpu_calibrate: --warmup takes a whole number in [0, 100], got '2x'"),
    (["--profile", "h200"], "error: gpu_calibrate: no device profile 'h200' (profiles: "),
    (["--only", "gemm"], "error: gpu_calibrate: --only takes matmul, attention, elementwise or copy, got 'gemm'"),
    (["--out"], "error: gpu_calibrate: --out needs a value (gpu_calibrate --help)"),
    (["--list", "--self-test"], "error: gpu_calibrate: --list, --fake-times and --self-test are three ways to run "
                                "without a GPU: give one"),
]


@pytest.mark.parametrize("args,line", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_a_bad_argument_is_one_line(args, line):
    p = run(CPU_BIN, *args)
    assert p.returncode == 2 and p.stdout == "", (p.returncode, p.stdout)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(line), p.stderr


def test_the_cpu_build_times_nothing_in_one_line():
    p = run(CPU_BIN)
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: gpu_calibrate: this is the CPU build (no CUDA)"), p.stderr


def test_the_ops_are_the_dry_runs_shapes():
    ops = listed()
    ids = [o[0] for o in ops]
    assert len(ids) == len(set(ids))
    by_class = {c: [o for o in ops if o[1] == c] for c in CLASSES}
    assert sum(map(len, by_class.values())) == len(ops)
    # every C x OC of 8B and 70B, forward and backward, at 8192 tokens
    gemms = {(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096), (4096, 128256), (8192, 8192), (8192, 1024),
             (8192, 28672), (28672, 8192), (8192, 128256)}
    want = {"matmul_%s:N8192_C%d_OC%d" % (d, c, oc) for c, oc in gemms for d in ("forward", "backward")}
    assert {o[0] for o in by_class["matmul"]} == want
    assert {o[0] for o in by_class["attention"]} == {"attention_%s:B1_T8192_H%d_KV8_hd128" % (d, h)
                                                     for h in (32, 64) for d in ("forward", "backward")}
    assert {o[0].split(":")[0] for o in by_class["elementwise"]} == {
        "rmsnorm_forward", "rmsnorm_backward", "swiglu_forward", "swiglu_backward", "add", "adamw"}
    assert [o[0] for o in by_class["copy"]] == ["copy_d2d:bytes%d" % (1 << 30)]
    assert all(o[2] > 0 for o in ops)
    # a backward GEMM is two GEMMs: about twice its forward on the same profile
    for c, oc in gemms:
        fwd, bwd = (next(o[2] for o in ops if o[0] == "matmul_%s:N8192_C%d_OC%d" % (d, c, oc))
                    for d in ("forward", "backward"))
        assert 1.9 < bwd / fwd < 2.1, (c, oc, fwd, bwd)
    # --only keeps one class; another profile prices them otherwise
    assert listed(CPU_BIN, "--only", "attention") == by_class["attention"]
    assert [o[0] for o in listed(CPU_BIN, "--profile", "a100-80g")] == ids
    assert [o[2] for o in listed(CPU_BIN, "--profile", "a100-80g")] != [o[2] for o in ops]


@pytest.mark.parametrize("profile", ["h100-sxm", "a100-80g", "teach"])
def test_modelled_times_are_the_clocks(profile):
    p = run(CPU_BIN, "--self-test", "--profile", profile)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "modelled times on %s equal the modelled clock's" % profile in p.stdout


def fake_factor(i):
    """The fake measured/modelled of the i-th listed op: spread, so that each class's time-weighted mean is not any
    one op's."""
    return 0.55 + 0.37 * (i % 7) + 0.011 * i


def test_the_summary_of_given_timings(tmp_path):
    ops = listed()
    fake = tmp_path / "times.txt"
    measured = {}
    lines = ["# fake timings: op id, microseconds"]
    for i, (op, _, model, _) in enumerate(ops):
        if i % 9 == 4:
            continue  # left out: not measured, not summarized
        measured[op] = round(model * fake_factor(i), 3)
        lines.append("%s %.3f" % (op, measured[op]))
    fake.write_text("\n".join(lines) + "\n")
    out = tmp_path / "report.txt"
    p = run(CPU_BIN, "--fake-times", fake, "--out", out)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    per, final = summary(p.stdout)
    for cls in CLASSES:
        mine = [(measured[o], m) for o, c, m, _ in ops if c == cls and o in measured]
        want = sum(x for x, _ in mine) / sum(m for _, m in mine)
        got, n = per[cls]
        assert n == len(mine), cls
        assert abs(got - want) <= 0.005 + 1e-9, (cls, got, want)
    everything = sum(measured.values()) / sum(m for o, _, m, _ in ops if o in measured)
    m = re.fullmatch(r"gpu-calibrate: (\d+) ops on fake timings \(.*\) against profile h100-sxm: "
                     r"measured/modelled = ([\d.]+) over all; written to (.*)", final)
    assert m and int(m.group(1)) == len(measured) and m.group(3) == str(out), final
    assert abs(float(m.group(2)) - everything) <= 0.005 + 1e-9
    # a line per op measured, its ratio; the file holds what was printed
    rows = {l.split()[1]: l for l in p.stdout.splitlines() if l.startswith("op ") and not l.startswith("op (")}
    assert set(rows) == set(measured)
    assert out.read_text() == p.stdout
    # --only: that class's ops alone
    p = run(CPU_BIN, "--fake-times", fake, "--only", "copy")
    per, final = summary(p.stdout)
    assert set(per) == {"copy"} and final.startswith("gpu-calibrate: 1 ops on fake timings")


@pytest.mark.parametrize("text,line", [
    ("matmul_forward:N1_C1_OC1 3\n", "line 1: no op 'matmul_forward:N1_C1_OC1' (gpu_calibrate --list gives the ids)"),
    ("copy_d2d:bytes1073741824 0\n", "line 1: want \"<op id> <microseconds > 0>\""),
    ("# a comment\ncopy_d2d:bytes1073741824 5\ncopy_d2d:bytes1073741824 6\n",
     "line 3: op 'copy_d2d:bytes1073741824' given twice"),
])
def test_bad_fake_times_are_one_line(tmp_path, text, line):
    f = tmp_path / "times.txt"
    f.write_text(text)
    p = run(CPU_BIN, "--fake-times", f)
    assert p.returncode == 2, p.stdout
    lines = p.stderr.strip().splitlines()
    assert lines == ["error: gpu_calibrate: %s %s" % (f, line)], p.stderr


needs_cuda_build = pytest.mark.skipif(not os.path.exists(CUDA_BIN), reason=no_cuda_build_reason())


@needs_cuda_build
def test_cuda_build_parses_its_arguments_without_a_gpu():
    p = run(CUDA_BIN, "--help")
    assert p.returncode == 0 and "COMPILED ONLY" in p.stdout
    p = run(CUDA_BIN, "--repeats", "0")
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "error: gpu_calibrate: --repeats takes a whole number in [1, 1000], got '0'"]
    assert listed(CUDA_BIN) == listed()
    p = run(CUDA_BIN, "--self-test")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "CPU build's" in p.stderr


@needs_cuda_build
@pytest.mark.skipif(have_gpu(), reason="a GPU is visible: make gpu-calibrate times the kernels there")
def test_cuda_build_without_a_gpu_is_one_line(tmp_path):
    p = subprocess.run([CUDA_BIN, "--out", str(tmp_path / "r.txt")], capture_output=True, text=True, timeout=120,
                       cwd=str(tmp_path))
    assert p.returncode == 2 and p.stdout == "", (p.returncode, p.stdout)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no CUDA device: "), p.stderr
    assert not (tmp_path / "r.txt").exists() and not (tmp_path / "logs").exists()
