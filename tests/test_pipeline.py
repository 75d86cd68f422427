"""Pipeline parallelism (--pp, hw_pipe.h; stages 11 and 12) on the runtime, independent of the grader:

- a pipeline of P stages with S = 1 computes what one rank computes on the whole batch as M accumulated
  microbatches (the baseline with --grad-accum M), under GPipe and 1F1B, with even and uneven stages: the
  first step's loss bit for bit, everything else within float32's rounding of the grad norm's sum (the
  stages sum their squares apart, then add the P partial sums);
- the two schedules keep what their definitions say on the first stage: GPipe every microbatch's
  activations, 1F1B at most P (the memory snapshots' live activation bytes);
- ranks as threads and ranks as processes under mpirun give the same metrics and the same modelled trace
  (both pipeline stages' solutions);
- a schedule that breaks the contract stops with one line: a microbatch run twice, a backward before its
  forward, a schedule that returns early, and flags that do not go with --pp.
"""
import json
import os
import shutil
import subprocess

import pytest

from gradelib.trace_model import activation_peaks
from helpers import BASELINE, CORPUS, ROOT, SOLVED, metrics, run_train, snapshot, solution_bin, trace_events

# the pipeline stages, by what the manifest says of them: the one that keeps the params between passes (12's
# reshard-after-forward=false, FSDP inside each stage) and the one before it (11)
PIPES = [s for s in SOLVED if s.pipeline]
PP = next((s.id for s in PIPES if "--reshard-after-forward=false" not in s.flags), None)
PP_FSDP = next((s.id for s in PIPES if "--reshard-after-forward=false" in s.flags), None)
OTHER = next((s.id for s in SOLVED if not s.pipeline and not s.forward_only), None)
pytestmark = pytest.mark.skipif(PP is None or PP_FSDP is None,
                                reason="the pipeline stages' solutions are the instructors' (not in a student tree)")

COMMON = ["--flavor", "tiny", "--seq-len", "64", "--steps", "3", "--profile-steps", "3", "--max-norm", "0.5",
          "--data", CORPUS]


def losses_and_norms(out):
    return [(m["loss"], m["grad_norm"]) for m in metrics(out)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("layers", [4, 6])
def test_pipeline_equals_one_rank_accumulating(tmp_path, schedule, layers):
    """P = 4 stages of one rank each, M = 8: the baseline on one rank with --grad-accum 8 over the same batch adds
    the same microbatch gradients in the same order. The first loss agrees to the last bit; the grad norm's sum
    of squares adds in another order (per stage, then across), so from there on within 2e-7 relative."""
    pp, base = tmp_path / "pp", tmp_path / "base"
    run_train(solution_bin(PP), pp, *COMMON, "--world", "4", "--n-layers", str(layers), "--batch-size", "8",
              "--pp", "4", "--microbatches", "8", "--pp-schedule", schedule)
    run_train(BASELINE, base, *COMMON, "--world", "1", "--n-layers", str(layers), "--batch-size", "8",
              "--grad-accum", "8", "--grad-sync", "last")
    got, want = losses_and_norms(pp), losses_and_norms(base)
    assert got[0][0] == want[0][0], (got, want)
    for g, w in zip(got, want):
        assert all(abs(a - b) <= 2e-7 * abs(b) for a, b in zip(g, w)), (got, want)
    assert len(got) == len(want) == 3 and len(set(got)) == 3  # the steps differ: not a comparison of constants


def live_activation_peak(out, rank, step):
    """The most bytes tagged activation live at once on `rank` during `step` (0-based), from its snapshot."""
    return activation_peaks(snapshot(out, rank)["events"], step + 1)[step][0]


def test_gpipe_holds_every_microbatch_and_1f1b_at_most_p(tmp_path):
    """On the first stage GPipe's activation peak grows with M; 1F1B's stops growing once M passes P (it never
    holds more than P microbatches). Measured in bytes from the snapshots, at M = 4 (= P) and M = 8."""
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        for m in (4, 8):
            out = tmp_path / ("%s%d" % (schedule, m))
            run_train(solution_bin(PP), out, *COMMON, "--world", "4", "--n-layers", "4", "--batch-size", "16",
                      "--pp", "4", "--microbatches", str(m), "--pp-schedule", schedule)
            peaks[schedule, m] = live_activation_peak(out, 0, 1)
    # at M = P both hold all four microbatches at once (1F1B's steady state adds a received grad beside them)
    assert abs(peaks["gpipe", 4] - peaks["1f1b", 4]) < 0.05 * peaks["gpipe", 4], peaks
    # twice the microbatches of half the size: GPipe's peak stays (all 8 held, each half as large) ...
    assert peaks["gpipe", 8] > 0.9 * peaks["gpipe", 4], peaks
    # ... and 1F1B's halves (still 4 held, each half as large)
    assert peaks["1f1b", 8] < 0.6 * peaks["gpipe", 8], peaks


def modelled(out):
    return [(e["pid"], e["tid"], e["name"], e["ts"], e["dur"]) for e in trace_events(out)]


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not found (Debian: openmpi-bin)")
@pytest.mark.parametrize("which,flags", [
    ("pipeline", ["--pp", "4", "--microbatches", "4", "--batch-size", "4"]),
    ("pipeline x FSDP", ["--pp", "2", "--microbatches", "4", "--batch-size", "4", "--reshard-after-forward=false"]),
])
def test_threads_and_mpirun_agree_bitwise(tmp_path, which, flags):
    """The same pipeline as threads and as mpirun processes: every metric but the wall clock's, and every op of
    every rank's trace on the modelled clock (sends and receives included), identical."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    local, mpi = tmp_path / "local", tmp_path / "mpi"
    args = COMMON + ["--world", "4", "--n-layers", "4"] + flags
    stage = PP if which == "pipeline" else PP_FSDP
    run_train(solution_bin(stage), local, *args)
    run_train(solution_bin(stage), mpi, *args, "--backend", "mpi", env=env,
              launcher=("mpirun", "--oversubscribe", "-np", "4"))
    wall = {"step_ms", "tokens_per_s"}
    a = [{k: v for k, v in m.items() if k not in wall} for m in metrics(local)]
    b = [{k: v for k, v in m.items() if k not in wall} for m in metrics(mpi)]
    assert a == b
    ta, tb = modelled(local), modelled(mpi)
    assert any("p2p" in e.get("args", {}) for e in trace_events(local))
    assert len(ta) == len(tb) and ta == tb, next((x, y) for x, y in zip(ta, tb) if x != y)


# --------------------------------------------------------------------------- the contract's one-liners

SCHEDULE_BUGS = {
    # a microbatch's forward twice
    "twice": ("pipe_forward(pipe, 0, NULL); pipe_forward(pipe, 0, NULL);",
              "error: pipe_forward on stage 0 (rank 0): microbatch 0's forward already ran this step"),
    # a backward first
    "backward_first": ("pipe_backward(pipe, 0, NULL);",
                       "error: pipe_backward(microbatch 0) on stage 0 (rank 0): its forward has not run this step"),
    # returning with nothing run
    "early_return": ("",
                     "error: pipe_schedule returned on stage 0 (rank 0) with microbatch 0's forward not run"),
}


@pytest.mark.parametrize("bug", sorted(SCHEDULE_BUGS))
def test_a_broken_schedule_is_one_line(tmp_path, bug):
    """A one-stage pipeline (--pp 1) whose pipe_schedule breaks the contract: one line, exit status 2."""
    body, want = SCHEDULE_BUGS[bug]
    src = tmp_path / "hw_fsdp.c"
    with open(os.path.join(ROOT, "common", "driver", "baseline.c")) as fh:
        base = fh.read()
    src.write_text(base + "\n#include \"hw_pipe.h\"\nvoid pipe_schedule(Pipe *pipe) { %s }\n" % body)
    exe = tmp_path / "train"
    p = subprocess.run(["make", "-s", "--no-print-directory", "impl", "SRC=%s" % src, "OUT=%s" % exe], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    r = subprocess.run([str(exe), *COMMON, "--world", "1", "--pp", "1", "--microbatches", "2", "--quiet"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(want), r.stderr


@pytest.mark.parametrize("flags,want", [
    (["--world", "4", "--pp", "3"], "error: --pp 3 must divide --world 4"),
    (["--world", "4", "--pp", "2", "--microbatches", "3", "--batch-size", "4"], "error: --microbatches 3 must divide"),
    (["--world", "4", "--pp", "2", "--grad-accum", "2", "--batch-size", "4"], "error: --pp splits the batch"),
    (["--world", "4", "--pp", "4"], "error: --pp 4 needs at least 3 blocks"),  # the tiny flavour has 2
    (["--world", "4", "--pp", "2", "--grad-sync", "last"], "error: --pp: your pipe_schedule decides"),
    (["--world", "4", "--pp", "2", "--reshard-after-backward=false"], "error: --pp: your pipe_schedule decides"),
    (["--world", "4", "--pp", "2", "--mesh", "2,2"], "error: --pp makes its own mesh"),
    (["--world", "8", "--pp", "8", "--n-layers", "2"], "error: --pp 8 needs at least 7 blocks"),
    (["--world", "2", "--microbatches", "2"], "error: --microbatches splits a pipeline's batch: it needs --pp"),
])
def test_bad_pipeline_flags_are_one_line(flags, want):
    p = subprocess.run([solution_bin(PP), *COMMON, *flags, "--quiet"], capture_output=True, text=True, cwd=ROOT,
                       timeout=60)
    assert p.returncode != 0
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(want), p.stderr


@pytest.mark.parametrize("P", [3, 4])
def test_the_split_holds_a_module_on_every_stage_at_its_boundary(tmp_path, P):
    """hw_pipe.h's split gives L / P blocks to a stage, one more to the first L % P: with L < P the last stages get
    none, so a middle stage is empty at L = P - 2 (refused before the run, naming it) and not at L = P - 1 or P
    (they train). One definition (driver/pipe_split.h) decides both the split and the refusal."""
    for L in (P - 2, P - 1, P):
        out = tmp_path / ("L%d" % L)
        p = subprocess.run([solution_bin(PP), *COMMON, "--world", str(P), "--pp", str(P), "--n-layers", str(L),
                            "--batch-size", str(P), "--steps", "1", "--out", str(out), "--quiet"],
                           capture_output=True, text=True, cwd=ROOT, timeout=120)
        if L == P - 2:
            lines = p.stderr.strip().splitlines()
            assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith(
                "error: --pp %d needs at least %d blocks" % (P, P - 1)) and \
                "stage %d would hold no module" % (P - 2) in lines[0], p.stderr
        else:
            assert p.returncode == 0, p.stderr[-2000:]
            assert len(metrics(out)) == 1, (P, L)


def test_a_stage_without_a_schedule_refuses_pp():
    """A stage before the pipeline defines no pipe_schedule: the runtime's stand-in says so in one line."""
    if OTHER is None:
        pytest.skip("no other stage's solution in this tree")
    p = subprocess.run([solution_bin(OTHER), *COMMON, "--world", "2", "--pp", "2", "--quiet"], capture_output=True,
                       text=True, cwd=ROOT, timeout=60)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: --pp needs a pipeline schedule, and this binary's hw_fsdp.c defines no pipe_schedule"), p.stderr
