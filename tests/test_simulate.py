"""tools/simulate.py on the pipeline stages (11, 12) and its pipeline options (issue 48, point 6).

- A pipeline stage simulates the flavour as it is (its own layer count and the local batch asked for), not the
  grading configuration's 4 layers and batch, with the pipeline's shape from --pp / --microbatches /
  --pp-schedule; the report states P, M, the schedule and the bubble.
- The bubble, taken over the stages' first ranks (the only ones a pipeline dry run traces), is the grader's
  pipeline_bubble over every rank of the same run traced in full; each stage's peak memory is that rank's, and
  tokens/s/GPU counts a data shard's batch once over its P ranks.
- --pp, --microbatches and --pp-schedule on a stage without a pipeline, and a pipeline's flags in --flags, are
  one line and exit status 2; a combination train refuses is train's own line.
"""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from gradelib.trace_model import RunDir, pipeline_bubble
from helpers import BUILD, ROOT, metrics, run_train, solution_bin, stage_or_skip

sys.path.insert(0, os.path.join(ROOT, "tools"))
import simulate  # noqa: E402


def simulate_run(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "simulate.py"), "--solutions", *map(str, args)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, HWFSDP_BUILD=BUILD))


def read(path):
    with open(path) as fh:
        return json.load(fh)


W, P, SEQ = 4, 2, 128
DEBUGMODEL_LAYERS = 6  # torchtitan's debugmodel (common/model: dim 256, 6 layers); the grading runs use 4


@pytest.mark.parametrize("sid", [s.id for s in simulate.manifest.stages() if s.pipeline])
def test_pipeline_stage_simulates_the_flavour_with_its_pipeline(sid, tmp_path):
    st = stage_or_skip(sid)
    out = tmp_path / "sim"
    p = simulate_run("--stage", sid, "--flavor", "debugmodel", "--world", W, "--pp", P, "--seq", SEQ, "--out", out)
    assert p.returncode == 0, p.stdout + p.stderr
    r, rj, last = read(out / "report.json"), read(out / "run.json"), metrics(out)[-1]
    # the flavour's layers and the defaults: a data shard's batch 2P, microbatches of one sequence, 1F1B
    B, M = 2 * P, 2 * P
    assert (rj["n_layers"], rj["batch_size"], rj["pp"], rj["microbatches"], rj["pp_schedule"]) == (
        DEBUGMODEL_LAYERS, B, P, M, "1f1b")
    assert (r["pp"], r["microbatches"], r["pp_schedule"], r["n_layers"], r["batch"]) == (P, M, "1f1b",
                                                                                      DEBUGMODEL_LAYERS, B)
    assert 0 < r["bubble"] < 1 and 0 < r["bubble_window_ms"] <= r["model_step_ms"]
    assert r["ideal_bubble"] == pytest.approx((P - 1) / (M + P - 1))
    # the stages' first ranks (S = W / P ranks a stage: rank p * S leads stage p) were traced, and only they
    S = W // P
    assert r["stage_first_ranks"] == [p * S for p in range(P)]
    assert sorted(RunDir(str(out)).traces()) == list(range((P - 1) * S + 1))
    # a data shard's batch over its P ranks: tokens/s/GPU x world = the global batch (W / P shards) per second
    step_s = last["model_step_ms"] / 1e3
    assert r["tokens_per_s_per_gpu"] == pytest.approx(B * SEQ / P / step_s, rel=1e-12)
    assert r["tokens_per_s_per_gpu"] * W == pytest.approx((W // P) * B * SEQ / step_s, rel=1e-12)
    # each stage's peak is its first rank's; the report's peak the highest
    assert r["steady_peak_bytes_by_stage"] == [last["peak_mem_bytes_per_rank"][q] for q in r["stage_first_ranks"]]
    assert r["steady_peak_bytes"] == max(r["steady_peak_bytes_by_stage"])
    text = (out / "report.md").read_text()
    assert text.startswith("# Dry run: stage %s, the debugmodel flavour, %d modelled GPUs in %d pipeline stages" % (
        sid, W, P)), text.splitlines()[0]
    assert "| pipeline bubble (step 2): P = %d, M = %d, 1F1B | %.1f%% of a" % (P, M, 100 * r["bubble"]) in text
    assert "(P-1)/(M+P-1) = %d/%d = %.1f%%)" % (P - 1, M + P - 1, 100 * r["ideal_bubble"]) in text

    # the same run traced on every rank: the grader's bubble over the whole world is the report's
    full = tmp_path / "full"
    run_train(solution_bin(st), full, "--dry-run", "--flavor", "debugmodel", "--world", W, "--device-profile",
              "h100-sxm", "--ranks-per-node", W, "--batch-size", B, "--seq-len", SEQ, "--steps", 2, "--warmup-steps",
              0, "--profile-steps", 2, *simulate.stage_flags(st, W, simulate.Pipeline(P, M, "1f1b")))
    assert metrics(full)[-1]["model_step_ms"] == last["model_step_ms"]
    bubble, window = pipeline_bubble(RunDir(str(full)).traces(), last["step"] - 1, W)
    assert r["bubble"] == pytest.approx(bubble, rel=1e-12)
    assert r["bubble_window_ms"] == pytest.approx(window / 1e3, rel=1e-12)


def test_gpipe_and_microbatches_reach_the_run(tmp_path):
    stage_or_skip("11")
    out = tmp_path / "sim"
    p = simulate_run("--stage", "11", "--flavor", "debugmodel", "--world", W, "--pp", P, "--batch", 4,
                     "--microbatches", 2, "--pp-schedule", "gpipe", "--seq", SEQ, "--out", out)
    assert p.returncode == 0, p.stdout + p.stderr
    r = read(out / "report.json")
    assert (r["pp"], r["microbatches"], r["pp_schedule"], r["batch"]) == (P, 2, "gpipe", 4)
    assert r["ideal_bubble"] == pytest.approx(1 / 3) and 0 < r["bubble"] < 1
    assert "M = 2 microbatches of 2 sequences, schedule GPipe" in (out / "report.md").read_text()


def options(**kw):
    return SimpleNamespace(**dict(dict(batch=None, pp=None, microbatches=None, pp_schedule=None, flags=""), **kw))


def test_pipeline_defaults_and_the_stage_flags_kept():
    st11, st04 = stage_or_skip("11"), stage_or_skip("04")
    # P: the largest divisor of the world up to 4; a data shard's batch 2P; M the batch
    assert simulate.batch_and_pipeline(st11, options(), 8) == (8, simulate.Pipeline(4, 8, "1f1b"))
    assert simulate.batch_and_pipeline(st11, options(), 6) == (6, simulate.Pipeline(3, 6, "1f1b"))
    assert simulate.batch_and_pipeline(st11, options(), 2) == (4, simulate.Pipeline(2, 4, "1f1b"))
    assert simulate.batch_and_pipeline(st11, options(batch=3), 8) == (3, simulate.Pipeline(4, 3, "1f1b"))
    assert simulate.batch_and_pipeline(st11, options(microbatches=2), 8) == (2, simulate.Pipeline(4, 2, "1f1b"))
    assert simulate.batch_and_pipeline(st11, options(pp=2, pp_schedule="gpipe"), 8) == (
        4, simulate.Pipeline(2, 4, "gpipe"))
    assert simulate.batch_and_pipeline(st04, options(), 8) == (1, None)
    # the grading configuration's size and pipeline give way; every other flag of the stage stays
    flags = simulate.stage_flags(stage_or_skip("12"), 8, simulate.Pipeline(4, 8, "gpipe"))
    assert not [f for f in flags if f.startswith(("--n-layers", "--batch-size"))]
    assert [f for f in flags if f.startswith(("--pp", "--microbatches"))] == [
        "--pp=4", "--microbatches=8", "--pp-schedule=gpipe"]
    assert "--reshard-after-forward=false" in flags
    assert simulate.stage_flags(st04, 8, None) == st04.flags_at(8)


REFUSED = [
    (["--stage", "04", "--pp", "2"], "simulate.py: stage 04 runs no pipeline: --pp is only for the pipeline stages "
                                     "(11, 12)"),
    (["--stage", "04", "--microbatches", "2", "--pp-schedule", "gpipe"],
     "simulate.py: stage 04 runs no pipeline: --microbatches and --pp-schedule are only for the pipeline stages "
     "(11, 12)"),
    (["--stage", "11", "--flags=--pp=2"], "simulate.py: --pp=2 in --flags: give a pipeline's shape as --pp, "
                                          "--microbatches and --pp-schedule (make simulate PP=P MICROBATCHES=M "
                                          "SCHEDULE=1f1b|gpipe)"),
    (["--stage", "11", "--pp", "0"], "simulate.py: --pp must be at least 1 (got 0)"),
]


@pytest.mark.parametrize("args,line", REFUSED, ids=["pp-on-04", "microbatches-on-04", "pp-in-flags", "pp-0"])
def test_pipeline_options_refused_in_one_line(args, line, tmp_path):
    stage_or_skip(args[1])
    p = simulate_run(*args, "--flavor", "debugmodel", "--world", 4, "--out", tmp_path / "sim")
    assert p.returncode == 2 and p.stderr.strip() == line, p.stderr
    assert not (tmp_path / "sim").exists()


def test_a_combination_train_refuses_is_trains_line(tmp_path):
    stage_or_skip("11")
    p = simulate_run("--stage", "11", "--flavor", "debugmodel", "--world", 4, "--seq", SEQ, "--flags=--param-dtype bf16",
                     "--out", tmp_path / "sim")
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "simulate.py: the dry run of stage 11 (debugmodel, world 4) failed: error: --pp cannot go with --param-dtype "
        "bf16"), p.stderr
