"""Every script of grader/ and tools/ starts from any working directory: each finds its own modules
through the folder Python puts first on sys.path (the script's), the tools grader/ through
tools/repo_paths.py, with no PYTHONPATH and nothing of tests/conftest.py's. `--help` goes as far
as the argument parser: every top-level import has run by then (make_starters.py has no parser
and would write stages/: --check only compares)."""
import glob
import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

from helpers import BUILD, ROOT

SCRIPTS = sorted(os.path.relpath(p, ROOT) for folder in ("grader", "tools")
                 for p in glob.glob(os.path.join(ROOT, folder, "*.py"))
                 if 'if __name__ == "__main__":' in open(p, encoding="utf-8").read())
NEEDS_TORCH = {"tools/torch_llama.py"}
ARGS = {"tools/make_starters.py": ["--check"]}


def test_the_scripts_are_found():
    assert {"grader/grade.py", "grader/gradescope.py", "grader/make_reference.py", "tools/fsdp2_check.py",
            "tools/make_gradescope.py", "tools/plots.py", "tools/torch_llama.py"} <= set(SCRIPTS), SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_starts_from_another_folder(script, tmp_path):
    if script in NEEDS_TORCH and importlib.util.find_spec("torch") is None:
        pytest.skip("%s imports torch" % script)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    args = ARGS.get(script, ["--help"])
    p = subprocess.run([sys.executable, os.path.join(ROOT, script)] + args, cwd=str(tmp_path), env=env,
                       capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert "Traceback" not in out and p.returncode in (0, 2), out[-2000:]
    assert args != ["--help"] or "usage" in out.lower(), out[-2000:]


# ---- make run (tools/main_job.py) ---------------------------------------------------------------

def _main_job():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import main_job
    return main_job


def test_main_job_trains_the_highest_stage_you_changed(tmp_path, monkeypatch):
    """In a student tree `make run` trains the highest-numbered stage, core or bonus, whose file the student
    changed and that runs a step at the run's world and batch (a bonus stage's --grad-accum / --mesh included),
    and names the higher stages it passed over and why."""
    import manifest
    stages = manifest.stages()
    accum = next((s for s in stages if any(f.startswith("--grad-accum=") for f in s.flags)), None)
    mesh = next((s for s in stages if any(f.startswith("--mesh=") for f in s.flags)), None)
    top = stages[-1]
    if not (accum and mesh and accum.number < mesh.number < top.number):
        pytest.skip("this release has no gradient-accumulation stage below a mesh stage below the last")
    sol = {s.id: os.path.join(BUILD, "solutions", s.dir, "train") for s in (accum, mesh)}
    if not all(os.path.exists(b) for b in sol.values()):
        pytest.skip("needs the instructors' solutions/ (their binaries stand for working stages)")
    mj = _main_job()
    os.symlink(os.path.join(ROOT, "data"), str(tmp_path / "data"))
    for st in (accum, mesh, top):
        d = tmp_path / "stages" / st.dir
        d.mkdir(parents=True)
        src = os.path.join(ROOT, "stages", st.dir)
        for name in ("hw_fsdp.c", manifest.STARTER_RECORD):
            shutil.copyfile(os.path.join(src, name), str(d / name))
        if st is not top:  # the last stage stays its starter; the other two are the student's
            with open(str(d / "hw_fsdp.c"), "a") as fh:
                fh.write("/* mine */\n")
        b = tmp_path / "build" / "stages" / st.dir
        b.mkdir(parents=True)
        os.symlink(sol.get(st.id, os.path.join(BUILD, "stages", st.dir, "train")), str(b / "train"))
    monkeypatch.setattr(mj, "ROOT", str(tmp_path))
    monkeypatch.setattr(mj, "BUILD", str(tmp_path / "build"))
    flags = ["--flavor", "debugmodel", "--world", "4", "--batch-size", "2"]
    binary, stage_flags, say = mj.student_stage(flags)
    assert binary == str(tmp_path / "build" / "stages" / mesh.dir / "train"), say
    assert stage_flags == mesh.flags_at(4)
    skipped = "; ".join("%s: %s" % (s.id, "unchanged from its starter" if s is top else "no stages/%s/hw_fsdp.c" % s.dir)
                        for s in reversed(stages) if s.number > mesh.number)
    assert say == ("training with your stage %s (stages/%s): the highest-numbered stage you changed that runs a "
                   "step (%s)" % (mesh.id, mesh.dir, skipped)), say
    # the mesh stage stops at its starter's TODO: the accumulation stage (--grad-accum divides the batch of 2) trains
    os.unlink(str(tmp_path / "build" / "stages" / mesh.dir / "train"))
    os.symlink(os.path.join(BUILD, "stages", mesh.dir, "train"), str(tmp_path / "build" / "stages" / mesh.dir / "train"))
    binary, stage_flags, say = mj.student_stage(flags)
    assert binary.endswith(os.path.join(accum.dir, "train")) and stage_flags == accum.flags, say
    assert say.startswith("training with your stage %s" % accum.id) and "%s: TODO not implemented" % mesh.id in say, say


def makefile_run_flags():
    """make run's RUN_FLAGS as the Makefile sets them (continuation lines joined)."""
    import re
    with open(os.path.join(ROOT, "Makefile")) as fh:
        text = fh.read().replace("\\\n", " ")
    return re.search(r"^RUN_FLAGS \?= (.*)$", text, re.M).group(1).split()


def test_make_run_names_each_flag_once():
    """make run's command line with any stage's own flags names each flag once: where the stage sets one the run
    sets too (stage 12's --batch-size=4 over RUN_FLAGS' --batch-size 2), the stage's stays and the run's goes,
    and the line before the command says so."""
    import manifest
    mj = _main_job()
    flags = makefile_run_flags()
    world = int(manifest.flag_value(flags, "--world", "1"))
    assert "--batch-size" in flags
    clashed = 0
    for st in manifest.stages():
        own = st.flags_at(world)
        cmd, said = mj.train_command("train", flags, own, "runs/x")
        names = [name for name, _ in manifest.flag_groups(cmd[1:])]
        assert len(names) == len(set(names)), (st.id, cmd)
        assert cmd[-len(own) - 2:-2] == own and cmd[-2:] == ["--out", "runs/x"], (st.id, cmd)
        both = {n for n, _ in manifest.flag_groups(own)} & {n for n, _ in manifest.flag_groups(flags)}
        for name in both:
            clashed += 1
            assert manifest.flag_value(cmd, name) == manifest.flag_value(own, name), (st.id, name, cmd)
            assert "in place of the run's %s" % name in said, said
        assert bool(both) == bool(said), (st.id, said)
    if any(manifest.flag_value(s.flags, "--batch-size") for s in manifest.stages()):
        assert clashed, "a stage sets --batch-size, which make run sets too: the test should have met it"
    assert mj.train_command("t", ["--ac", "--steps", "3"], ["--ac", "--x=1"], "o") == (
        ["t", "--steps", "3", "--ac", "--x=1", "--out", "o"], "the stage's own --ac in place of the run's --ac")


def test_compact_run_dir_keeps_a_memory_viz_snapshot_of_the_profiled_steps(tmp_path):
    """make run's directory: rank 0's pickle cut after the profiled steps (its segments the blocks alive there,
    as a replay of its trace leaves them; opcodes memory_viz reads), every rank's whole pickle gzipped, the other
    ranks' JSON snapshots and the per-rank traces gzipped."""
    import gzip
    import pickle
    import pickletools
    from test_artifacts import ALLOWED_OPCODES
    mj = _main_job()
    out = tmp_path / "run"
    p = subprocess.run([os.path.join(BUILD, "baseline", "train"), "--flavor", "tiny", "--world", "2", "--seq-len", "16",
                        "--batch-size", "1", "--steps", "4", "--profile-steps", "2", "--quiet", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    with open(str(out / "memory_rank0.pickle"), "rb") as fh:
        whole = fh.read()
    mj.compact_run_dir(str(out), 2)
    names = set(os.listdir(str(out)))
    assert {"memory_rank0.pickle", "memory_rank0.json", "memory_rank1.json.gz", "memory_rank0.all_steps.pickle.gz",
            "memory_rank1.all_steps.pickle.gz", "trace.json", "trace_rank0.json.gz", "trace_rank1.json.gz"} <= names
    assert not {"memory_rank1.pickle", "memory_rank1.json", "trace_rank0.json"} & names
    with gzip.open(str(out / "memory_rank0.all_steps.pickle.gz")) as fh:
        assert fh.read() == whole
    with open(str(out / "memory_rank0.pickle"), "rb") as fh:
        data = fh.read()
    assert {op.name for op, _, _ in pickletools.genops(data)} <= ALLOWED_OPCODES
    cut, full = pickle.loads(data), pickle.loads(whole)
    trace = cut["device_traces"][0]
    assert trace == full["device_traces"][0][:len(trace)] and len(trace) < len(full["device_traces"][0])
    assert {e["frames"][-1]["line"] for e in trace} == {-1, 0, 1}  # fsdp_init and steps 0, 1
    alive = {}
    for e in trace:
        if e["action"] == "alloc":
            alive[e["addr"]] = e["size"]
        elif e["action"] == "free_completed":
            alive.pop(e["addr"])
    assert {s["address"]: s["requested_size"] for s in cut["segments"]} == alive


def test_the_skips_are_said_in_one_line():
    """tests/conftest.py ends a run with one line that groups its skip reasons (pytest_terminal_summary)."""
    from conftest import skip_summary
    reasons = (["student tree: no solutions/", "stage 04's solution is the instructors' (not in a student tree)"] * 3
               + ["needs the git checkout", "not a git checkout: fatal"] + ["nvcc not found"])
    assert skip_summary(reasons) == ("9 skipped: 6 need the instructors' solutions/, 2 need a git checkout, "
                                     "1 because nvcc not found")
    assert skip_summary([]) is None
    assert skip_summary([], ["test_solutions.py"]) == ("1 instructors' test files not collected (no solutions/: "
                                                       "test_solutions.py)")


def test_skip_reasons_say_what_to_run(monkeypatch):
    """The skips a student copy's `make test` prints say what to run, in plain words: a missing CUDA build is
    "`make cuda` has not been run" where nvcc and NCCL are here (as `make` prints CUDA ✓ NCCL ✓), else the part
    missing; a parameter list left empty (no solutions/) is one skipped test saying so, not pytest's "got empty
    parameter set"."""
    import helpers
    nccl = any(os.path.exists(os.path.join(d, "include", "nccl.h")) for d in ("/usr/local/cuda", "/usr"))
    if helpers.nvcc_path() and nccl:
        assert helpers.no_cuda_build_reason().startswith("`make cuda` has not been run")
    monkeypatch.setattr(helpers, "nvcc_path", lambda: None)
    assert "needs nvcc" in helpers.no_cuda_build_reason()
    (param,) = helpers.params_or_skip([])
    (mark,) = param.marks
    assert mark.name == "skip" and "solutions/" in mark.kwargs["reason"]
    assert helpers.params_or_skip([1, 2]) == [1, 2]
    assert [p.id for p in helpers.params_or_skip([1, 2], ids=["a", "b"])] == ["a", "b"]


def test_readme_lists_the_packages_hwfsdp_installs():
    """README's package list is the script's (PKGS in ./hwfsdp), word for word."""
    import re
    with open(os.path.join(ROOT, "hwfsdp")) as fh:
        script = fh.read()
    pkgs = re.search(r'^PKGS="([^"]*)"', script, re.M).group(1).split()
    with open(os.path.join(ROOT, "README.md")) as fh:
        readme = " ".join(fh.read().split())
    m = re.search(r"names them and stops otherwise: `([^`]*)`", readme)
    assert m, "README no longer lists the packages after 'names them and stops otherwise:'"
    assert m.group(1).split() == pkgs, (m.group(1).split(), pkgs)


def test_make_names_missing_packages_in_one_line(tmp_path):
    """Plain `make` where OpenBLAS's <cblas.h> is not the one found (here a netlib-like header without blasint, as a
    machine with libblas-dev but not libopenblas-dev has) stops before compiling, with one line: what is missing and
    the apt-get command (mk/deps.mk)."""
    fake = tmp_path / "include"
    fake.mkdir()
    (fake / "cblas.h").write_text("float cblas_sdot(int n, const float *x, int incx, const float *y, int incy);\n")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}  # under make test
    p = subprocess.run(["make", "-s", "--no-print-directory", "BUILD=%s" % (tmp_path / "build"),
                        "EXTRA_CFLAGS=-I%s" % fake, "detect"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    lines = (p.stdout + p.stderr).strip().splitlines()
    assert p.returncode != 0 and len(lines) == 1, lines
    assert "missing Debian packages: libopenblas-dev" in lines[0] and "sudo apt-get install libopenblas-dev" in lines[0]
    assert not (tmp_path / "build" / ".deps-ok").exists()
