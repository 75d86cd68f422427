"""check_colls (gpu-check's collectives harness, tests/gpu/check_colls.c) on the CPU runtime: every
collective, dtype, in-place form, count and process group passes against the float64 reference; a run
compared with itself (--ref) is bitwise; the mpi backend under mpirun gives the local backend's bits;
and the harness itself fails where it must (a corrupted or missing ref line)."""
import os
import re
import shutil
import subprocess

import pytest

from helpers import BUILD, ROOT

EXE = os.path.join(BUILD, "tests", "check_colls")
CUDA_EXE = os.path.join(ROOT, "build-cuda", "tests", "check_colls")
MPIRUN = shutil.which("mpirun")
LINE = re.compile(r"^coll (\S+) (\S+) (\S+) (\S+) n(\d+) rank(\d+) ([0-9a-f]{16}) max_rel_err (\S+) bound (\S+)"
                  r"( ref (?:bitwise|differs|missing))?( send-modified)? (OK|FAIL)$")


def run(*args, launcher=(), timeout=120):
    if not os.access(EXE, os.X_OK):
        pytest.fail("%s missing: run make first" % EXE)
    return subprocess.run(list(launcher) + [EXE] + [str(a) for a in args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def cases(stdout):
    """The case lines, parsed: every line starting 'coll ' must match the documented format."""
    out = []
    for l in stdout.splitlines():
        if l.startswith("coll "):
            m = LINE.match(l)
            assert m, "malformed line: %r" % l
            out.append(m)
    return out


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    p = run("--world", 4)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    path = tmp_path_factory.mktemp("colls") / "cpu_w4.txt"
    path.write_text(p.stdout)
    return p.stdout, path


def test_every_collective_passes_the_float64_reference_at_world_4(world4):
    stdout, _ = world4
    cs = cases(stdout)
    assert all(m.group(12) == "OK" for m in cs), [m.group(0) for m in cs if m.group(12) != "OK"][:5]
    assert stdout.rstrip().splitlines()[-1] == "%d collectives passed, 0 failed" % len(cs)
    names = {m.group(1) for m in cs}
    assert names == {"all_gather", "reduce_scatter_sum", "reduce_scatter_avg", "all_reduce_sum", "all_reduce_avg",
                     "broadcast_root0", "broadcast_root3", "barrier"}
    assert {(m.group(1), m.group(2)) for m in cs} >= {("all_gather", "bf16"), ("reduce_scatter_sum", "bf16"),
                                                      ("reduce_scatter_avg", "bf16"), ("all_reduce_sum", "f32")}
    assert {m.group(3) for m in cs if m.group(1) != "barrier"} == {"inplace", "outofplace"}
    # the world, the 2x2 mesh's shard and replicate groups, the parity groups of dev_group_new
    assert {m.group(4) for m in cs} == {"world", "shard0", "shard1", "replicate0", "replicate1", "parity0", "parity1"}
    counts = {int(m.group(5)) for m in cs}
    assert {1, 7, 1001} <= counts and max(counts) * 4 * 4 >= 4 << 20  # a 4 MB all-gather output at world 4
    assert {int(m.group(6)) for m in cs} == {0, 1, 2, 3}
    # the inputs make float sums inexact (a reordered sum would show); copies are exact
    red = [float(m.group(8)) for m in cs if m.group(1).startswith(("reduce", "all_reduce")) and m.group(2) == "f32"]
    assert max(red) > 1e-8 and all(e <= 2.99e-7 for e in red)
    assert all(float(m.group(8)) == 0 for m in cs if m.group(1).startswith(("all_gather", "broadcast")))


def test_world_1_and_out_file(world4, tmp_path):
    p = run("--world", 1)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    cs = cases(p.stdout)
    assert cs and all(m.group(12) == "OK" and m.group(4) == "world" for m in cs)
    assert p.stdout.rstrip().endswith("%d collectives passed, 0 failed" % len(cs))
    # --out: the same lines in a file, stdout keeps the header and the summary
    p = run("--world", 4, "--out", tmp_path / "w4.txt")
    assert p.returncode == 0 and not cases(p.stdout)
    want = "".join(l + "\n" for l in world4[0].splitlines() if l.startswith("coll "))
    assert (tmp_path / "w4.txt").read_text() == want


def test_a_run_against_itself_is_bitwise(world4):
    _, ref = world4
    p = run("--world", 4, "--ref", ref)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    cs = cases(p.stdout)
    assert cs and all(m.group(10) == " ref bitwise" and m.group(12) == "OK" for m in cs)


def test_a_corrupted_ref_line_fails(world4, tmp_path):
    """Test the test: one hash changed in the ref fails that case (and the run); a line taken out fails too."""
    stdout, _ = world4
    lines = stdout.splitlines()
    key = "coll reduce_scatter_sum f32 outofplace world n7 rank2 "
    target = next(i for i, l in enumerate(lines) if l.startswith(key))
    f = lines[target].split()
    f[7] = "%016x" % (int(f[7], 16) ^ 1)
    bad = lines[:target] + [" ".join(f)] + lines[target + 1:]
    (tmp_path / "bad.txt").write_text("\n".join(bad) + "\n")
    p = run("--world", 4, "--ref", tmp_path / "bad.txt")
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    failed = [m.group(0) for m in cases(p.stdout) if m.group(12) == "FAIL"]
    assert len(failed) == 1 and "reduce_scatter_sum f32 outofplace world n7 rank2" in failed[0], failed
    assert "ref differs FAIL" in failed[0]
    assert p.stdout.rstrip().endswith("collectives passed, 1 failed")

    gone = [l for l in lines if not l.startswith("coll all_gather bf16 inplace shard1 n7 rank3 ")]
    assert len(gone) == len(lines) - 1
    (tmp_path / "gone.txt").write_text("\n".join(gone) + "\n")
    p = run("--world", 4, "--ref", tmp_path / "gone.txt")
    assert p.returncode == 1
    failed = [m.group(0) for m in cases(p.stdout) if m.group(12) == "FAIL"]
    assert len(failed) == 1 and failed[0].startswith("coll all_gather bf16 inplace shard1 n7 rank3 "), failed
    assert "ref missing FAIL" in failed[0]


def test_bad_arguments_and_ref_files(tmp_path):
    p = run("--backend", "gloo")
    assert p.returncode == 2 and "unknown backend 'gloo'" in p.stderr
    p = run("--ref", tmp_path / "nope.txt")
    assert p.returncode == 2 and "cannot open" in p.stderr and "nope.txt" in p.stderr
    (tmp_path / "empty.txt").write_text("nothing here\n")
    p = run("--ref", tmp_path / "empty.txt")
    assert p.returncode == 2 and "holds no 'coll' line" in p.stderr


@pytest.mark.skipif(MPIRUN is None, reason="mpirun not found (install openmpi-bin libopenmpi-dev)")
def test_mpi_backend_gives_the_local_bits(world4, tmp_path):
    """One process per rank under mpirun: every case passes and equals the local backend's bits."""
    _, ref = world4
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    out = tmp_path / "mpi.txt"  # the processes' stdout interleaves under mpirun: the lines go to --out
    cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-np", "4", EXE, "--backend", "mpi", "--ref", str(ref),
           "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    if "no MPI support" in p.stderr:
        pytest.skip("this build has no MPI support")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    cs = cases(out.read_text())
    assert [int(m.group(6)) for m in cs] == sorted(int(m.group(6)) for m in cs)  # rank by rank
    assert len(cs) == len(cases(ref.read_text()))
    assert all(m.group(10) == " ref bitwise" and m.group(12) == "OK" for m in cs)
    assert "%d collectives passed, 0 failed" % len(cs) in p.stdout
