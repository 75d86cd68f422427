"""Shared helpers for the Python tests: where things are, how to run a training binary."""
import importlib
import json
import os
import subprocess
import sys

from gradelib.trace_model import RunDir
import manifest  # the stages: grader/rubric.json (grader/ is on sys.path: tests/conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# HWFSDP_BUILD=build-asan runs the suite against the sanitizer build (make asan-test)
BUILD = os.path.join(ROOT, os.environ.get("HWFSDP_BUILD", "build"))
BASELINE = os.path.join(BUILD, "baseline", "train")
# every stage of the manifest, and those whose solution is here (none in the student tree)
STAGES = manifest.stages()
SOLVED = [s for s in STAGES if os.path.isfile(s.solution_src())]
SOLUTIONS = [s.dir for s in SOLVED]
CORPUS = os.path.join(ROOT, "data", "corpus.txt")


def solution_bin(stage):
    """build/solutions/NN_x/train for stage 'NN' (or a manifest Stage)."""
    st = stage if isinstance(stage, manifest.Stage) else manifest.stage(stage)
    return os.path.join(BUILD, "solutions", st.dir, "train")


def stage_or_skip(sid):
    """Stage sid of the manifest, its test skipped where this tree has no solution for it (the student tree) or
    no such stage (a staged release holds the stages up to its own)."""
    import pytest
    try:
        st = manifest.stage(sid)
    except KeyError:
        pytest.skip("no stage %s in this release" % sid)
    if not os.path.exists(st.solution_src()):
        pytest.skip("no solutions/%s" % st.dir)
    return st


def run_train(binary, out, *flags, timeout=300, check=True, env=None, launcher=()):
    """Run a training binary into run directory `out`; return the CompletedProcess."""
    cmd = list(launcher) + [binary, "--out", str(out), "--quiet", "--data", CORPUS] + [str(f) for f in flags]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    if check and p.returncode != 0:
        raise AssertionError("%s failed (%d):\n%s\n%s" % (" ".join(cmd), p.returncode, p.stdout[-2000:], p.stderr[-2000:]))
    return p


def metrics(out):
    with open(os.path.join(str(out), "metrics.jsonl")) as fh:
        return [json.loads(l) for l in fh if l.strip()]


def snapshot(out, rank=0):
    with open(os.path.join(str(out), "memory_rank%d.json" % rank)) as fh:
        return json.load(fh)


def trace_events(out):
    """Every rank's slices of run directory `out` (gradelib.trace_model, the one reader of traces)."""
    return RunDir(out).events()


def find_cycle(graph):
    """One cycle of a dependency graph {node: nodes it depends on} as [a, b, ..., a], or None (depth-first
    search; the include-layer and import-cycle tests)."""
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == "open":
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = "done"
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def apply_mutant(mutant, dest):
    """Write mutant["base"] with the mutant's text replacements (each old text exactly once) to dest."""
    with open(os.path.join(ROOT, mutant["base"])) as fh:
        text = fh.read()
    for old, new in mutant["replace"]:
        n = text.count(old)
        assert n == 1, ("mutant %s: its text occurs %d times in %s (must be exactly once; the solution changed? "
                        "update tests/mutants/mutants.json):\n%s" % (mutant["name"], n, mutant["base"], old))
        text = text.replace(old, new)
    with open(dest, "w") as fh:
        fh.write(text)
    return dest


def params_or_skip(items, ids=None, why="needs the instructors' solutions/ (this tree has none)"):
    """items as pytest.mark.parametrize's values; where there are none (the student tree has no solutions/), one
    value whose test is skipped saying why (pytest itself would only say "got empty parameter set")."""
    import pytest
    if items:
        return list(items) if ids is None else [pytest.param(x, id=i) for x, i in zip(items, ids)]
    return [pytest.param(None, marks=pytest.mark.skip(reason=why), id="none")]


def nvcc_path():
    """The nvcc the Makefile finds (NVCC: on the PATH or /usr/local/cuda/bin/nvcc), or None."""
    import shutil
    found = shutil.which("nvcc")
    return found or ("/usr/local/cuda/bin/nvcc" if os.access("/usr/local/cuda/bin/nvcc", os.X_OK) else None)


def no_cuda_build_reason():
    """Why build-cuda/ is not there, in words that say what to run: `make cuda` not yet run where nvcc and NCCL
    are here (as `make` prints them: CUDA ✓ NCCL ✓), else which of the two is missing."""
    nvcc = nvcc_path()
    home = os.environ.get("CUDA_HOME") or (os.path.dirname(os.path.dirname(nvcc)) if nvcc else "/usr/local/cuda")
    nccl = any(os.path.exists(os.path.join(d, "nccl.h")) for d in (os.path.join(home, "include"), "/usr/include"))
    if nvcc and nccl:
        return "`make cuda` has not been run (nvcc and NCCL are here: run `make cuda`, then these tests run)"
    missing = " and ".join(w for w, have in (("nvcc (the CUDA toolkit)", nvcc), ("NCCL (nccl.h)", nccl)) if not have)
    return "no CUDA build: `make cuda` needs %s, which this machine does not have" % missing


def require_torch(what):
    """Import-time guard of a test module that compares with Debian's python3-torch: skipped with the
    reason on a developer machine without it, an error under CI (CI=true), where ./hwfsdp installs it."""
    try:
        for name in ("numpy", "torch"):
            importlib.import_module(name)
    except ImportError as e:
        if os.environ.get("CI"):
            raise RuntimeError("PyTorch is missing under CI (%s): the %s cannot run; install python3-torch "
                               "(./hwfsdp does)" % (e, what))
        import pytest
        pytest.skip("PyTorch not installed for %s (%s): install python3-torch to run the %s"
                    % (sys.executable, e, what), allow_module_level=True)


def sandbox_tmp(request, prefix):
    """A fresh folder (mode 755, removed after the test) that the grader sandbox's users can reach, for the
    tests whose runs are theirs (grade.py --class, Gradescope). Not under build/: a clone in a mode-700 home
    (root's /root) is out of their reach, and pytest's own tmp folders are private (0700). Skipped, with the
    reason, where no temp folder is reachable."""
    import shutil

    import pytest
    from gradelib.runner import reachable_temp_dir
    path = reachable_temp_dir(prefix)
    if path is None:
        pytest.skip("no temp folder the grader sandbox's users can reach ($TMPDIR, /var/tmp and /tmp each need "
                    "o+x on every folder above them)")
    request.addfinalizer(lambda: shutil.rmtree(path, ignore_errors=True))
    return path


def overlap_of(stage, run_dir, key, variant=None, world=None):
    """The OverlapFigures of overlap check `key` on the run in run_dir, read with the grader's own function
    (world: the run's, where it is not the grading configuration's)."""
    from gradelib.checks import overlap_figures
    from gradelib.context import Context
    from gradelib.runner import RunResult
    ctx = Context(manifest.rubric(), stage, RunResult(str(run_dir), True, "", 0.0, []), None, None, variant=variant)
    if world:
        ctx.world = world
    return overlap_figures(ctx, key)


def assert_overlap_figures(stage, run_dir, want, variant=None):
    """The overlap figures of the run in run_dir, read with the grader's own function at full precision, are
    `want` ({check key: [compute share, collective share]}, as grader/figures/overlap.json documents
    them to 10 significant digits): equal to 1e-9 relative, a documented 0 exactly. Returns {key: OverlapFigures}."""
    got = {}
    for key, (compute, collective) in want.items():
        f = got[key] = overlap_of(stage, run_dir, key, variant)
        for what, g, w in (("compute share", f.compute_share, compute),
                           ("collective share", f.collective_share, collective)):
            assert abs(g - w) <= 1e-9 * abs(w), "stage %s%s %s %s: %r, grader/figures/overlap.json says %r" % (
                stage, "/" + variant if variant else "", key, what, g, w)
    return got
