#!/usr/bin/env python3
"""simulate.py — a stage's own hooks on a modelled GPU cluster (a dry run: train --dry-run).

    tools/simulate.py --stage 04 --flavor 8B --world 8 --profile h100-sxm [--flags="--ac --param-dtype bf16"]
    tools/simulate.py --stage 08 --flavor 8B --sweep 8,16,32,64 --flags="--ac --param-dtype bf16"
    tools/simulate.py --stage 11 --flavor 8B --world 8 [--pp 4 --microbatches 8 --pp-schedule 1f1b] --flags=--ac
    tools/simulate.py --compare            the dry runs of torchtitan's published FSDP2 configurations, side by side

The driver, the model's schedule and the stage's hw_fsdp.c run as in training; every kernel, copy and
collective is priced on the device profile's modelled clock and executed nowhere; every allocation is
counted as in a real run, with no memory behind it. The report (printed, and report.md / report.json in
the run directory) reads what the run wrote:
  modelled step time         metrics.jsonl model_step_ms of the last step (the max over ranks)
  tokens/s per GPU           local batch x sequence / that step time; with --pp P the P ranks of a data shard
                             (one per stage) share its batch: batch x sequence / P / step time, so that tokens/s/GPU
                             x world is the global batch's tokens per second, as torchtitan counts it
  MFU                        torchtitan's formula: (6 x non-embedding params + 12 x layers x heads x
                             head_dim x seq) FLOPs per token x tokens/s/GPU / the profile's dense BF16 peak,
                             whatever the run's math was (as torchtitan quotes it)
  memory per rank            rank 0's peak from step 2 on (torchtitan reads memory there), by tag, from the
                             memory snapshot; and the peak at init (the full model fsdp_init receives); with --pp,
                             the highest of the stages' first ranks (the stages hold different modules), and each's
  reserved per rank          the bytes PyTorch's CUDA caching allocator would hold in segments for the same
                             allocations in step 2 on (tools/benchlib/caching_allocator.py: its rules, replayed
                             on that rank's snapshot): what torchtitan's published "Memory (GiB)" is (the
                             allocator's reserved_bytes.all.peak), where the figure above is its allocated bytes
  kernel FLOPs / peak        the FLOPs rank 0's kernels declared / (step time x the peak of their matmuls' math):
                             not MFU (it counts what ran, recompute included, at the run's own math's peak)
  exposed communication      rank 0's compute stream in collectives and waits, by phase (the trace)
  device memory              the profile's HBM capacity (run.json hbm_capacity_bytes) and whether every rank's
                             allocations of every step stayed within it (run.json fits); a configuration that does
                             not fit is marked so in the title, the table and --compare's table, with the run's
                             out-of-memory line (train exits 5 then, every file written: driver/step_log.h)
  pipeline (stages 11, 12)   P (--pp), M (--microbatches), the schedule (--pp-schedule) and the bubble: in the
                             last step, the window from the first forward kernel of any stage to the last backward
                             kernel, and the share of it each stage's compute stream runs none of its forward,
                             backward or recompute kernels (waiting for its peers), averaged over the stages' first
                             ranks (gradelib.trace_model.pipeline_bubble: the grader's pipeline-bubble measure),
                             beside the textbook (P-1)/(M+P-1) of equal stages and free transfers
and draws the timeline and memory plots (tools/plots.py). --sweep draws tokens/s/GPU and memory against
the world size (sweep.png). By default STAGE is your stages/NN (build/stages/NN_*/train); --solutions takes
the instructors' solution. Ranks >= 1 record no trace (--trace-ranks 1): FSDP's ranks are symmetric and a
64-rank trace is gigabytes; with --pp the first rank of every stage records one (--trace-ranks (P-1) x S + 1,
S = world / P ranks a stage), as the stages are not symmetric. Above 64 ranks (up to 16,384) train executes one
representative rank per class of symmetric ranks (rank 0; with --pp each stage's first) and prices every
collective on its full group (train --dry-run-ranks; run.json "executed_ranks"): a 70B step at 512 ranks takes
seconds.

The stage's own flags (grader/rubric.json) come with it, except the grading configuration's size: its
--n-layers and --batch-size (stages 11, 12) give way to the flavour's layers and --batch, and its --pp,
--microbatches and --pp-schedule to this tool's (below). A pipeline's defaults: P the largest divisor of the
world up to 4, M the local batch (torchtitan's default: microbatches of one sequence), the local batch 2P
(so M = 2P) unless --batch or --microbatches gives one, the schedule 1F1B. --pp, --microbatches and
--pp-schedule on a stage without a pipeline are refused; a combination train refuses (e.g. --pp with
--param-dtype bf16) is train's one line.
"""
import argparse
import collections
import json
import os
import re
import subprocess
import sys

from repo_paths import ROOT

import manifest
from benchlib.caching_allocator import reserved_in_step
from benchlib.memory_model import flops_per_token, model_dims, n_params, replay_peak
from benchlib.traces import step_on_model_clock
from gradelib.trace_model import RunDir, ideal_bubble, pipeline_bubble
import trace_names as tn

BUILD = os.environ.get("HWFSDP_BUILD", os.path.join(ROOT, "build"))
GIB = 1024.0 ** 3

# torchtitan's published FSDP2-only runs (tokens/s/GPU; memory GiB, the caching allocator's peak reserved bytes;
# MFU %), each as published, with its source. Never tuned: a row is priced by the profiles' sourced constants
# (common/runtime/profile.c) and the dry run of stage 08's solution; the error is what it is.
#   - the A100 rows (docs/performance.md at commit 1ea476e9, 2024-04): 64 A100 80GB, 8 per node; the inter-node
#     network is not published (we price DGX A100's, one HDR NIC per GPU); MFU counted the embedding then;
#   - the H100 rows (benchmarks/llama3_h100_202412_torchtitan.md, tables 1 and 3): Grand Teton H100s (the h100-gt
#     profile), 400 Gb/s per GPU; selective AC is the preset's per-op policy (train_configs/llama3_8b.toml).
# Precision: FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), torchtitan's default.
# Kernels: torchtitan ran eager PyTorch (no torch.compile), so its element-wise math is priced as eager PyTorch
# launches it (train --price-ops, common/model/kernels.h), with the RMSNorm of the row's preset at the publishing
# commit (train_configs/*.toml norm_type: "fused_rmsnorm", a Triton kernel, for 8B and Llama 2 13B at 1ea476e9;
# "rmsnorm", eager, for 70B and Llama 2 70B there and for every preset at 9dec370a).
TT_A100 = "torchtitan docs/performance.md (2024-04, commit 1ea476e9)"
TT_H100 = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (tables 1 and 3)"
TORCHTITAN = [
    {"model": "Llama 3 8B", "flavor": "8B", "world": 64, "profile": "a100-80g", "batch": 1, "seq": 8192,
     "norm": "fused", "ac": "selective (every 2nd block)", "tps": 2904, "memory_gib": None, "mfu": 56.8, "source": TT_A100},
    {"model": "Llama 3 8B", "flavor": "8B", "world": 64, "profile": "a100-80g", "batch": 1, "seq": 8192,
     "norm": "fused", "ac": "selective (per op)", "tps": 2973, "memory_gib": None, "mfu": 58.2, "source": TT_A100},
    {"model": "Llama 3 70B", "flavor": "70B", "world": 64, "profile": "a100-80g", "batch": 1, "seq": 8192,
     "norm": "eager", "ac": "full", "tps": 331, "memory_gib": None, "mfu": 51.7, "source": TT_A100},
    {"model": "Llama 2 13B", "flavor": "llama2-13B", "world": 64, "profile": "a100-80g", "batch": 2, "seq": 4096,
     "norm": "fused", "ac": "none", "tps": 2162, "memory_gib": None, "mfu": 61.1, "source": TT_A100},
    {"model": "Llama 2 13B", "flavor": "llama2-13B", "world": 64, "profile": "a100-80g", "batch": 2, "seq": 4096,
     "norm": "fused", "ac": "selective (every 2nd block)", "tps": 1914, "memory_gib": None, "mfu": 54.1, "source": TT_A100},
    {"model": "Llama 2 13B", "flavor": "llama2-13B", "world": 64, "profile": "a100-80g", "batch": 2, "seq": 4096,
     "norm": "fused", "ac": "selective (per op)", "tps": 1904, "memory_gib": None, "mfu": 53.8, "source": TT_A100},
    {"model": "Llama 2 70B", "flavor": "llama2-70B", "world": 64, "profile": "a100-80g", "batch": 1, "seq": 4096,
     "norm": "eager", "ac": "selective (per op)", "tps": 355, "memory_gib": None, "mfu": 50.8, "source": TT_A100},
    {"model": "Llama 2 70B", "flavor": "llama2-70B", "world": 64, "profile": "a100-80g", "batch": 2, "seq": 4096,
     "norm": "eager", "ac": "full", "tps": 353, "memory_gib": None, "mfu": 50.5, "source": TT_A100},
    {"model": "Llama 3.1 8B", "flavor": "llama3.1-8B", "world": 8, "profile": "h100-gt", "batch": 2, "seq": 8192,
     "norm": "eager", "ac": "selective (per op)", "tps": 5762, "memory_gib": 82.4, "mfu": None, "source": TT_H100},
    {"model": "Llama 3.1 8B", "flavor": "llama3.1-8B", "world": 128, "profile": "h100-gt", "batch": 2, "seq": 8192,
     "norm": "eager", "ac": "selective (per op)", "tps": 5605, "memory_gib": 67.0, "mfu": None, "source": TT_H100},
]
# published beside those and out of this model's scope: what differs is not priced (no compiler, no float8)
TORCHTITAN_OUT_OF_SCOPE = [
    ("Llama 3.1 8B, 8 H100, FSDP + torch.compile", 6667, 77.0, "torch.compile (fused kernels)"),
    ("Llama 3.1 8B, 8 H100, FSDP + torch.compile + Float8", 8532, 76.8, "torch.compile, float8 matmuls"),
    ("Llama 3.1 8B, 128 H100, FSDP + torch.compile", 6514, 62.0, "torch.compile (fused kernels)"),
    ("Llama 3.1 8B, 128 H100, FSDP + torch.compile + Float8", 8380, 61.8, "torch.compile, float8 matmuls"),
]
# our side of every row: stage 08's solution (FSDP2's MixedPrecisionPolicy) with the row's own activation
# checkpointing (torchtitan's per-op selective AC is --ac-op; per block, option "2", is --ac-every 2; full is --ac)
COMPARE_STAGE, COMPARE_FLAGS = "08", ["--param-dtype", "bf16"]
PRICE_OPS = {"fused": ["--price-ops", "eager-fused-norm"], "eager": ["--price-ops", "eager"]}
AC_FLAG = {"selective (per op)": ["--ac-op"], "full": ["--ac"], "selective (every 2nd block)": ["--ac-every", "2"],
           "none": []}
# the targets the validation is held to (issue 48): tokens/s/GPU within 15 %, memory within 10 %
TARGET_TPS, TARGET_MEMORY = 0.15, 0.10
INTER_NODE = {"a100-80g": "HDR 200 Gb/s per GPU (assumed: not published)", "h100-gt": "400 Gb/s per GPU"}


def model_name(flavor):
    """What a flavour is, for titles: the published models by name and release ("Llama 3 8B": the flavours 8B
    and 70B are Llama 3's; "Llama 2 7B", "Llama 3.1 405B" for llama2-7B, llama3.1-405B), this project's own
    (tiny, debugmodel, 1B) as flavours."""
    m = re.fullmatch(r"llama(\d+(?:\.\d+)?)-(\d+B)", flavor)
    if m:
        return "Llama %s %s" % m.groups()
    if flavor in ("8B", "70B"):
        return "Llama 3 %s" % flavor
    return "the %s flavour" % flavor


def fail(msg):
    print("simulate.py: " + msg, file=sys.stderr)
    sys.exit(2)


def binary(stage, solutions):
    path = os.path.join(BUILD, "solutions" if solutions else "stages", stage.dir, "train")
    if not os.access(path, os.X_OK):
        fail("%s is not built (run make first)" % path)
    return path


GPUS_PER_NODE = 8  # a DGX / HGX node: NVLink inside, the profile's InfiniBand between nodes

# A pipeline's shape: P stages (--pp), M microbatches (--microbatches), the schedule (--pp-schedule).
Pipeline = collections.namedtuple("Pipeline", "stages microbatches schedule")
PIPELINE_FLAGS = ("--pp", "--microbatches", "--pp-schedule")  # set by this tool's options, never by --flags
GRADING_SIZE_FLAGS = ("--n-layers", "--batch-size")  # the grading configuration's size (rubric.json): not simulated
PP_SCHEDULES = ("1f1b", "gpipe")  # train --pp-schedule (common/driver/options.c)
MAX_DEFAULT_PP = 4  # --pp's default: the largest divisor of the world up to this


def default_pp(world):
    """P when --pp is not given: the largest divisor of the world up to MAX_DEFAULT_PP (train needs P | world)."""
    return max(d for d in range(1, min(world, MAX_DEFAULT_PP) + 1) if world % d == 0)


def pipeline_stages(data=None):
    """The ids of the stages that run a pipeline (their rubric flags hold --pp)."""
    return [s.id for s in manifest.stages(data) if s.pipeline]


def batch_and_pipeline(stage, a, world):
    """(local batch, Pipeline or None) of a dry run of `stage` at `world` ranks from the options `a`. Without a
    pipeline: --batch (default 1). With one: P = --pp (default_pp), the local batch --batch, else --microbatches,
    else 2P; M = --microbatches, else the local batch (microbatches of one sequence, torchtitan's default); the
    schedule --pp-schedule (default 1F1B)."""
    if not stage.pipeline:
        return (1 if a.batch is None else a.batch), None
    P = a.pp or default_pp(world)
    batch = a.batch if a.batch is not None else (a.microbatches or 2 * P)
    return batch, Pipeline(P, a.microbatches or batch, a.pp_schedule or "1f1b")


def check_pipeline_options(stage, a):
    """One line and exit status 2 for pipeline options on a stage without a pipeline, and for a pipeline's flags
    given in --flags (where they would silently fight this tool's)."""
    given = [n for n, v in (("--pp", a.pp), ("--microbatches", a.microbatches), ("--pp-schedule", a.pp_schedule))
             if v is not None]
    if given and not stage.pipeline:
        fail("stage %s runs no pipeline: %s %s only for the pipeline stages (%s)" % (
            stage.id, " and ".join(given), "is" if len(given) == 1 else "are", ", ".join(pipeline_stages())))
    for name, v in (("--pp", a.pp), ("--microbatches", a.microbatches), ("--batch", a.batch)):
        if v is not None and v < 1:
            fail("%s must be at least 1 (got %d)" % (name, v))
    inside = [f for f in a.flags.split() if f.split("=", 1)[0] in PIPELINE_FLAGS]
    if inside:
        fail("%s in --flags: give a pipeline's shape as --pp, --microbatches and --pp-schedule "
             "(make simulate PP=P MICROBATCHES=M SCHEDULE=1f1b|gpipe)" % " ".join(inside))


def stage_flags(stage, world, pipe):
    """The stage's own flags for a dry run at `world` ranks: stage.flags_at(world) without the grading
    configuration's size (--n-layers, --batch-size: the flavour's layers and the local batch stand) and with the
    pipeline `pipe` (a Pipeline, or None) in place of its grading pipeline."""
    out = [f for f in stage.flags_at(world) if f.split("=", 1)[0] not in GRADING_SIZE_FLAGS + PIPELINE_FLAGS]
    if pipe:
        out += ["--pp=%d" % pipe.stages, "--microbatches=%d" % pipe.microbatches, "--pp-schedule=%s" % pipe.schedule]
    return out


def traced_ranks(world, pipe):
    """--trace-ranks: rank 0 alone (FSDP's ranks are symmetric), or with a pipeline every stage's first rank
    (rank p x S of stage p, S = world / P: hw_pipe.h), which --trace-ranks N (ranks below N) takes."""
    if not pipe:
        return 1
    return (pipe.stages - 1) * (world // pipe.stages) + 1


EXIT_OVER_CAPACITY = 5  # train's exit status when a rank went past the profile's memory (driver/step_log.h)


def dry_run_cmd(exe, stage, flavor, world, profile, batch, seq, steps, flags, out, pipe=None):
    """The train command of one dry run into out (above 64 ranks train executes one representative rank per
    class of symmetric ranks: --dry-run-ranks). pipe: the Pipeline of a pipeline stage (None: none)."""
    cmd = [exe, "--dry-run", "--flavor", flavor, "--world", str(world), "--device-profile", profile,
           "--ranks-per-node", str(min(world, GPUS_PER_NODE)),
           "--batch-size", str(batch), "--seq-len", str(seq), "--steps", str(steps), "--warmup-steps", "0",
           "--profile-steps", str(steps), "--trace-ranks", str(traced_ranks(world, pipe)), "--quiet", "--out", out]
    return cmd + stage_flags(stage, world, pipe) + list(flags)


def dry_run(exe, stage, flavor, world, profile, batch, seq, steps, flags, out, pipe=None):
    """Run one dry run into out; its report. pipe: the Pipeline of a pipeline stage (None: none). A failed run is
    one line and exit status 2 (train's own line last); one that went past the device's memory (exit status 5) is
    reported, marked as not fitting, with its out-of-memory line."""
    cmd = dry_run_cmd(exe, stage, flavor, world, profile, batch, seq, steps, flags, out, pipe)
    os.makedirs(out, exist_ok=True)
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if p.returncode not in (0, EXIT_OVER_CAPACITY):
        last = (p.stderr.strip().splitlines() or ["exit status %d" % p.returncode])[-1]
        fail("the dry run of stage %s (%s, world %d) failed: %s" % (stage.id, flavor, world, last))
    r = report(out, stage)
    oom = [l for l in p.stderr.splitlines() if "out of device memory" in l]
    if (p.returncode == EXIT_OVER_CAPACITY) != (r["fits"] is False) or (r["fits"] is False and len(oom) != 1):
        fail("the dry run of stage %s (%s, world %d) exited %d with run.json's fits %s and %d out-of-memory lines" % (
            stage.id, flavor, world, p.returncode, r["fits"], len(oom)))
    r["over_capacity_line"] = oom[0] if oom else None
    return r


def peaks(memory_json, last_step):
    """(init peak bytes, steady peak bytes, by tag at it, where): rank 0's most bytes at init (before step 1) and
    in the last step (0-based), replaying its memory snapshot (replay_peak)."""
    steady, where, by_tag, _ = replay_peak(memory_json, last_step)
    with open(memory_json) as fh:
        init = max((e["current_bytes"] for e in json.load(fh)["events"]
                    if e.get("action") == "alloc" and e["step"] < 0), default=0)
    return init, steady, by_tag, where


def compute_by_class(events, step):
    """Rank 0's compute stream in `step` (the trace's 0-based step), ms per kind of work: each kernel class
    (args.class: matmul, attention, elementwise, the runtime's own words) and the copies and memsets."""
    out = {}
    for e in events:
        if e["pid"] != 0 or e["tid"] != tn.COMPUTE_TID or e["args"].get("step") != step:
            continue
        if e.get("cat") == tn.COMPUTE:
            what = e["args"].get(tn.KERNEL_ARGS[0])
        elif e.get("cat") in (tn.COPY, tn.MEMSET):
            what = "copies and memsets"
        else:
            continue
        if what:
            out[what] = out.get(what, 0.0) + e["dur"] / 1e3
    return out


def stage_first_ranks(rj):
    """[rank]: the first rank of each pipeline stage, in stage order (run.json "pipeline"), or [0] without one."""
    stages = rj.get("pipeline")
    if not stages:
        return [0]
    return [min(s["ranks"]) for s in sorted(stages, key=lambda s: s["stage"])]


def report(run_dir, stage):
    run = RunDir(run_dir)
    rj, metrics = run.run_json, run.metrics()
    last = metrics[-1]
    step = last["step"] - 1  # the trace's 0-based step
    events = run.events()  # every traced rank's slices read once: the clock's figures, the meta and the classes below
    clock = step_on_model_clock(run_dir, step, last["model_step_ms"], events=events)
    dims = model_dims(rj)
    T = rj["seq_len"]
    B = rj["batch_size"]
    # tokens per GPU and step: a rank's local batch; with --pp P the P ranks of a data shard (one per stage) all
    # carry its batch, so each GPU's share is batch / P (tokens/s/GPU x world = the global batch's tokens/s)
    P = rj.get("pp") or 0
    step_s = last["model_step_ms"] / 1e3
    tps = B * T / (P or 1) / step_s
    meta = run.meta
    fpt = flops_per_token(dims, T)
    # memory: rank 0's peak; with a pipeline each stage's first rank's (the stages hold different modules), the
    # highest of them reported as the peak per rank
    firsts = stage_first_ranks(rj)
    mem = {r: peaks(os.path.join(run_dir, "memory_rank%d.json" % r), step) for r in firsts}
    top = max(firsts, key=lambda r: mem[r][1])  # the first of equal peaks
    _, steady, by_tag, where = mem[top]
    init = max(m[0] for m in mem.values())
    # the caching allocator's reserved bytes in the same step, on the same rank: the init as torchtitan's (the
    # shards made in place, nothing of the full model), and as this program ran it (the full model fsdp_init
    # receives, cached after)
    snapshot = os.path.join(run_dir, "memory_rank%d.json" % top)
    cap = rj.get("hbm_capacity_bytes")
    reserved = reserved_in_step(snapshot, step, cap, init="survivors")
    reserved_full_init = reserved_in_step(snapshot, step, cap, init="all")
    by_class = compute_by_class(events, step)
    attn_ms = by_class.get(tn.COST_ATTENTION, 0.0)
    r = {
        "stage": stage.id, "flavor": rj["flavor"], "world": rj["world_size"], "mesh": rj.get("mesh"),
        "device_profile": meta["device_profile"], "batch": B, "seq_len": T, "n_layers": rj["n_layers"],
        "ac": rj.get("ac"), "param_dtype": rj.get("param_dtype"), "reduce_dtype": rj.get("reduce_dtype"),
        "reshard_after_forward": rj.get("reshard_after_forward"), "n_params": n_params(dims),
        "steps": len(metrics), "model_step_ms": last["model_step_ms"], "tokens_per_s_per_gpu": tps,
        "flops_per_token": fpt, "mfu": fpt * tps / meta["peak_flops"]["bf16"],
        "kernel_flops_over_peak": clock["kernel_flops_over_peak"], "matmul_math": clock["math"],
        "exposed_comm_ms_by_phase": clock["exposed_comm_ms_by_phase"], "exposed_comm_ms": clock["exposed_comm_ms"],
        "compute_ms": clock["compute_ms"], "collective_ms": clock["collective_ms"], "attention_ms": attn_ms,
        "compute_ms_by_class": by_class,
        "init_peak_bytes": init, "steady_peak_bytes": steady, "steady_peak_by_tag": by_tag, "steady_peak_at": where,
        "steady_peak_rank": top,
        # steady_peak_bytes is allocated (the bytes asked for); these are reserved (the caching allocator's segments)
        "steady_reserved_bytes": reserved["reserved_bytes"],
        "steady_reserved_bytes_full_init": reserved_full_init["reserved_bytes"],
        # segments a GPU could not have had (a new one past the capacity after the cache was given back): 0 if none
        "reserved_segments_over_capacity": reserved["segments_over_capacity"],
        # the profile's device memory (None: a profile with no limit, like teach) and whether the run stayed within it
        "hbm_capacity_bytes": rj.get("hbm_capacity_bytes"), "fits": rj.get("fits"),
        # a pipeline (None without --pp): P, M, the schedule, and the bubble of the last step over the stages' first
        # ranks (the grader's measure) beside (P-1)/(M+P-1)
        "pp": P or None, "microbatches": None, "pp_schedule": None, "stage_first_ranks": None,
        "steady_peak_bytes_by_stage": None, "bubble": None, "bubble_window_ms": None, "ideal_bubble": None,
        "run_dir": run_dir,
    }
    if P:
        M = rj["microbatches"]
        bubble, window = pipeline_bubble(run.traces(), step, rj["world_size"], ranks=firsts)
        if bubble is None:
            fail("the dry run in %s traced no forward or backward kernel on the stages' first ranks %s in step %d" % (
                run_dir, firsts, step + 1))
        r.update({"microbatches": M, "pp_schedule": rj["pp_schedule"], "stage_first_ranks": firsts,
                  "steady_peak_bytes_by_stage": [mem[f][1] for f in firsts], "bubble": bubble,
                  "bubble_window_ms": window / 1e3, "ideal_bubble": ideal_bubble(P, M)})
    return r


def fit_mark(r, capacity=False):
    """What the title and the tables say of a configuration that went past the device's memory ("" if it fits,
    or the profile has no capacity); capacity: with the capacity (where the line does not state it)."""
    if r["fits"] is not False:
        return ""
    return "does not fit" + (" in %.0f GiB" % (r["hbm_capacity_bytes"] / GIB) if capacity else "")


PP_SCHEDULE_WORDS = {"1f1b": "1F1B", "gpipe": "GPipe"}
AC_WORDS = {"none": "no activation checkpointing", "full": "full activation checkpointing",
            "every": "selective activation checkpointing (every N-th block)",
            "op": "selective activation checkpointing (per op)"}


def render(r):
    """The report as markdown lines."""
    cap = r["hbm_capacity_bytes"]
    P = r.get("pp")
    L = ["# Dry run: stage %s, %s, %d modelled GPUs%s (%s%s)%s" % (
        r["stage"], model_name(r["flavor"]), r["world"], " in %d pipeline stages" % P if P else "",
        r["device_profile"], ", %.0f GiB each" % (cap / GIB) if cap else "", ": " + fit_mark(r) if fit_mark(r) else ""),
        ""]
    L.append("%s %d x sequence %d, %s, params %s, reduce %s%s; %d layers, %s parameters. No math ran: every figure "
             "is the modelled clock's or the allocator's." % (
                 "A data shard's batch" if P else "Local batch", r["batch"], r["seq_len"],
                 AC_WORDS.get(r["ac"], "activation checkpointing %s" % r["ac"]),
                 r["param_dtype"], r["reduce_dtype"], "" if r["reshard_after_forward"] in (None, True)
                 else ", no reshard after forward (ZeRO-2)", r["n_layers"], "{:,}".format(r["n_params"])))
    if P:
        S = r["world"] // P
        L += ["", "Pipeline: P = %d stages of %d rank%s each, M = %d microbatches of %g sequence%s, schedule %s. "
              "The P ranks of a data shard carry its batch between them, so each GPU's share of the tokens is "
              "batch x sequence / P. The bubble is the last step's window from the first forward kernel of any "
              "stage to the last backward kernel, and the share of it a stage's compute stream runs none of its "
              "forward, backward or recompute kernels (waiting for its peers), averaged over the stages' first "
              "ranks %s (the grader's pipeline bubble); (P-1)/(M+P-1) is the textbook bubble of equal stages and "
              "free transfers. Exposed communication and the compute stream's figures are rank 0's (stage 0)." % (
                  P, S, "" if S == 1 else "s", r["microbatches"], r["batch"] / r["microbatches"],
                  "" if r["batch"] == r["microbatches"] else "s", PP_SCHEDULE_WORDS.get(r["pp_schedule"],
                                                                                         r["pp_schedule"]),
                  ", ".join(map(str, r["stage_first_ranks"])))]
    L += ["", "| figure | value |", "| --- | --- |",
          "| modelled step (step %d) | %.1f ms |" % (r["steps"], r["model_step_ms"]),
          "| tokens/s per GPU%s | %.0f |" % (" (a data shard's batch / P per GPU)" if P else "",
                                             r["tokens_per_s_per_gpu"]),
          "| MFU (torchtitan's formula: %.3g FLOPs/token against the dense BF16 peak) | %.1f%% |" % (
              r["flops_per_token"], 100 * r["mfu"]),
          "| declared kernel FLOPs / (step x the %s peak) | %.1f%% |" % (r["matmul_math"],
                                                                      100 * r["kernel_flops_over_peak"])]
    if P:
        L.append("| pipeline bubble (step %d): P = %d, M = %d, %s | %.1f%% of a %.1f ms window (textbook "
                 "(P-1)/(M+P-1) = %d/%d = %.1f%%) |" % (
                     r["steps"], P, r["microbatches"], PP_SCHEDULE_WORDS.get(r["pp_schedule"], r["pp_schedule"]),
                     100 * r["bubble"], r["bubble_window_ms"], P - 1, r["microbatches"] + P - 1,
                     100 * r["ideal_bubble"]))
        for p, (rank, b) in enumerate(zip(r["stage_first_ranks"], r["steady_peak_bytes_by_stage"])):
            L.append("| &nbsp;&nbsp;peak memory of stage %d (rank %d), step %d on | %.2f GiB |" % (
                p, rank, r["steps"], b / GIB))
    L += ["| memory per rank, step %d on | allocated %.2f GiB, reserved by a caching allocator %.2f GiB (allocated: "
          "the bytes asked for, at their peak, %s%s; reserved: the segments PyTorch's caching allocator would hold "
          "for them, what torchtitan's \"Memory\" reports) |" % (
              r["steps"], r["steady_peak_bytes"] / GIB, r["steady_reserved_bytes"] / GIB,
              "rank %d: " % r["steady_peak_rank"] if P else "", r["steady_peak_at"]),
          "| peak memory at init (the full model fsdp_init receives) | %.2f GiB%s |" % (
              r["init_peak_bytes"] / GIB, " (past the device's memory, which init is not held to: torchtitan builds "
              "the model on the meta device)" if cap and r["init_peak_bytes"] > cap else "")]
    for tag, b in sorted(r["steady_peak_by_tag"].items(), key=lambda kv: -kv[1]):
        L.append("| &nbsp;&nbsp;%s at the peak | %.2f GiB |" % (tag, b / GIB))
    if cap:  # the profile's HBM: every rank's allocations of every step held to it (init is not: step_log.h)
        L.append("| device memory per GPU (%s's HBM), every rank and step | %.2f GiB: %s |" % (
            r["device_profile"], cap / GIB, "**%s**" % fit_mark(r) if fit_mark(r) else "fits"))
    ph = r["exposed_comm_ms_by_phase"]
    L.append("| exposed communication (forward / backward / other) | %.1f / %.1f / %.1f ms (%.1f%% of the step) |" % (
        ph["forward"], ph["backward"], ph["other"], 100 * r["exposed_comm_ms"] / r["model_step_ms"]))
    L.append("| compute stream busy / collectives on any stream | %.1f / %.1f ms |" % (r["compute_ms"],
                                                                                    r["collective_ms"]))
    for what, ms in sorted(r["compute_ms_by_class"].items(), key=lambda kv: -kv[1]):
        L.append("| &nbsp;&nbsp;%s on the compute stream | %.1f ms (%.1f%% of the step) |" % (
            what, ms, 100 * ms / r["model_step_ms"]))
    L += ["", "Reserved (tools/benchlib/caching_allocator.py): rank 0's allocations replayed in call order through "
          "PyTorch's caching allocator's rules (512-byte rounding; 2 MiB segments for requests up to 1 MiB, 20 MiB "
          "under 10 MiB, larger ones rounded to 2 MiB; best fit, split and merged within a segment; a pool per "
          "stream; nothing given back unless a new segment would pass the device's memory), its most in step %d: %.2f GiB over the allocated peak. Init as torchtitan's "
          "(the shards made in place); with the full model fsdp_init receives going through the allocator first, "
          "%.2f GiB. Not counted: the CUDA context, NCCL's and cuBLAS's buffers." % (
              r["steps"], (r["steady_reserved_bytes"] - r["steady_peak_bytes"]) / GIB,
              r["steady_reserved_bytes_full_init"] / GIB)]
    if r["reserved_segments_over_capacity"]:
        L.append("Past the device's memory even after the allocator gave its cache back: %d segment(s); a GPU "
                 "would stop there." % r["reserved_segments_over_capacity"])
    if r.get("over_capacity_line"):
        L += ["", "A GPU would have stopped with its out-of-memory error; the dry run went on to price the step:", "",
              "    " + r["over_capacity_line"]]
    bf16 = r["param_dtype"] == "bf16"
    L += ["", "How it was priced (common/runtime/profile.c, where every constant has its source): each kernel as "
          "it declares itself, its FLOPs at its math's peak times an efficiency, or its bytes at the HBM's rate, "
          "whichever is longer. Matmuls (%s) at the measured GEMM ceiling of the profile, less what tile and wave "
          "quantisation cost their shape; flash attention (the causal half, no T x T tensor) in %s at "
          "FlashAttention-2's measured share of the peak at this sequence length (%.0f ms of this step, %.0f%% of "
          "compute); element-wise ops bandwidth-bound; activations %s; collectives on NCCL's ring at the bus "
          "bandwidth nccl-tests report (NVLink within a node, the nodes' NICs between them) plus NCCL's latency "
          "model; compute that overlaps a collective runs slower by the measured overlap slowdown." % (
              r["matmul_math"], "bf16" if bf16 else "float32", r["attention_ms"],
              100 * r["attention_ms"] / max(r["compute_ms"], 1e-9),
              "in bfloat16 (2 bytes; rstd, lse and the logits the loss reads in float32)" if bf16
              else "in float32")]
    return L


def plots(run_dir, step):
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plots.py"), run_dir, "--step", str(step)],
                   capture_output=True, text=True, cwd=ROOT)


def write_report(r):
    L = render(r)
    with open(os.path.join(r["run_dir"], "report.md"), "w") as fh:
        fh.write("\n".join(L) + "\n")
    with open(os.path.join(r["run_dir"], "report.json"), "w") as fh:
        json.dump(r, fh, indent=1)
    print("\n".join(L))
    print("\nrun directory: %s (report.md, plots/: timeline and memory)" % r["run_dir"])


def sweep(exe, stage, a, worlds):
    rows = []
    for w in worlds:
        out = os.path.join(a.out, "world%d" % w)
        print("dry run: stage %s, %s, world %d ..." % (stage.id, a.flavor, w), flush=True)
        batch, pipe = batch_and_pipeline(stage, a, w)
        rows.append(dry_run(exe, stage, a.flavor, w, a.profile, batch, a.seq, a.steps, a.flags.split(), out, pipe))
    pp = stage.pipeline  # a pipeline's rows say P, M and the bubble (P may differ by world: batch_and_pipeline)
    L = ["# Sweep: stage %s, %s on %s, %s %s x %d" % (
        stage.id, model_name(a.flavor), a.profile, "a data shard's batch" if pp else "local batch",
        "/".join(sorted({"%d" % r["batch"] for r in rows}, key=int)), a.seq),
         "", "| world | %smodelled step ms | tokens/s/GPU | MFU | peak GiB/rank | exposed comm ms |%s" % (
             "P x M | " if pp else "", " bubble (textbook) |" if pp else ""),
         "| ---: | %s---: | ---: | ---: | ---: | ---: |%s" % ("---: | " if pp else "", " ---: |" if pp else "")]
    for r in rows:
        L.append("| %d | %s%.1f | %.0f | %.1f%% | %.2f%s | %.1f |%s" % (
            r["world"], "%d x %d | " % (r["pp"], r["microbatches"]) if pp else "", r["model_step_ms"],
            r["tokens_per_s_per_gpu"], 100 * r["mfu"], r["steady_peak_bytes"] / GIB,
            " (%s)" % fit_mark(r, True) if fit_mark(r) else "", r["exposed_comm_ms"],
            " %.1f%% (%.1f%%) |" % (100 * r["bubble"], 100 * r["ideal_bubble"]) if pp else ""))
    print("\n".join(L))
    with open(os.path.join(a.out, "sweep.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    with open(os.path.join(a.out, "sweep.md"), "w") as fh:
        fh.write("\n".join(L) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker  # noqa: F401
    except ImportError:
        print("(matplotlib missing: no sweep.png)")
        return
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ws = [r["world"] for r in rows]
    ax[0].plot(ws, [r["tokens_per_s_per_gpu"] for r in rows], "o-")
    ax[0].set(xlabel="modelled GPUs (8 per node)", ylabel="tokens/s per GPU",
              title="throughput (modelled clock)")
    ax[1].plot(ws, [r["steady_peak_bytes"] / GIB for r in rows], "o-", color="C1")
    ax[1].set(xlabel="modelled GPUs (8 per node)", ylabel="GiB per rank",
              title="peak memory per rank (step 2)")
    for x in ax:
        x.set_xscale("log", base=2)
        x.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        x.set_xticks(ws, [str(w) for w in ws])
        x.set_ylim(bottom=0)
    fig.suptitle("stage %s, %s, %s, %s" % (stage.id, model_name(a.flavor), a.profile, a.flags or "no flags"))
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "sweep.png"), dpi=100)
    print("wrote %s" % os.path.join(a.out, "sweep.png"))


def err(pred, pub):
    return (pred - pub) / pub


def compare_row(t, r):
    """The --compare table's row of torchtitan's row t against the dry run's report r: the configuration as
    published, the figures and their errors (memory: the modelled reserved bytes against torchtitan's reserved)."""
    et = err(r["tokens_per_s_per_gpu"], t["tps"])
    reserved = r.get("steady_reserved_bytes")
    mem = reserved if reserved is not None else r["steady_peak_bytes"]
    em = err(mem / GIB, t["memory_gib"]) if t["memory_gib"] else None
    mark = lambda e, tgt: "%+.1f%%%s" % (100 * e, "" if abs(e) <= tgt else " (!)")
    return "| %s | %d (%d/node) | %s | %d x %d | %s | eager, %s RMSNorm | %d | %.0f | %s | %s | %s%s | %s |" % (
        t["model"], t["world"], min(t["world"], GPUS_PER_NODE), INTER_NODE[t["profile"]], t["batch"], t["seq"],
        t["ac"], t["norm"], t["tps"], r["tokens_per_s_per_gpu"], mark(et, TARGET_TPS),
        "%.1f GiB" % t["memory_gib"] if t["memory_gib"] else "not published",
        "%.1f GiB" % (mem / GIB), (" (allocated %.1f)" % (r["steady_peak_bytes"] / GIB) if reserved is not None
                                    else "") + (", **%s**" % fit_mark(r, True) if fit_mark(r) else ""),
        mark(em, TARGET_MEMORY) if em is not None else "-"), et, em


def compare(a):
    stage = manifest.stage(COMPARE_STAGE)
    exe = binary(stage, True)
    L = ["| model | GPUs | inter-node | local batch x seq | AC | kernels | torchtitan tokens/s/GPU | dry run | error | "
         "torchtitan memory (reserved) | dry run memory (reserved) | error |",
         "| --- | --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    rows, ets, ems = [], [], []
    for t in TORCHTITAN:
        key = "%s-w%d-%s-b%d-%s-%s" % (t["flavor"], t["world"], t["profile"], t["batch"],
                                       "-".join(f.strip("-") for f in AC_FLAG[t["ac"]]) or "noac", t["norm"])
        print("dry run: %s, %d GPUs, %s ..." % (t["model"], t["world"], t["ac"]), flush=True)
        r = dry_run(exe, stage, t["flavor"], t["world"], t["profile"], t["batch"], t["seq"], a.steps,
                    COMPARE_FLAGS + AC_FLAG[t["ac"]] + PRICE_OPS[t["norm"]], os.path.join(a.out, key))
        line, et, em = compare_row(t, r)
        rows.append({"torchtitan": t, "dry_run": r, "tps_error": et, "memory_error": em})
        ets.append(abs(et))
        ems += [abs(em)] if em is not None else []
        L.append(line)
        print(line, flush=True)
    within = sum(e <= TARGET_TPS for e in ets) + sum(e <= TARGET_MEMORY for e in ems)
    L += ["", "Mean absolute error: tokens/s/GPU %.1f%% over %d rows (largest %.1f%%), memory %s. "
          "Within the targets (tokens/s +-%d%%, memory +-%d%%): %d of %d figures%s." % (
              100 * sum(ets) / len(ets), len(ets), 100 * max(ets),
              "%.1f%% over %d rows" % (100 * sum(ems) / len(ems), len(ems)) if ems else "not published",
              100 * TARGET_TPS, 100 * TARGET_MEMORY, within, len(ets) + len(ems),
              "" if within == len(ets) + len(ems) else "; (!) marks the others"),
          "", "Published beside them, out of this model's scope (what differs is not priced):", ""]
    L += ["- %s: %d tokens/s/GPU, %.1f GiB (%s)" % o for o in TORCHTITAN_OUT_OF_SCOPE]
    L += ["", "Sources: %s; %s. Memory: torchtitan logs the caching allocator's peak reserved bytes; the dry run's "
          "is the reserved bytes a caching allocator would hold for its allocations (allocated in parentheses)." % (
              TT_A100, TT_H100)]
    print("\n".join(L))
    with open(os.path.join(a.out, "compare.json"), "w") as fh:
        json.dump({"rows": rows, "mean_tps_error": sum(ets) / len(ets),
                   "mean_memory_error": sum(ems) / len(ems) if ems else None}, fh, indent=1)
    with open(os.path.join(a.out, "compare.md"), "w") as fh:
        fh.write("\n".join(L) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", default="04", help="stage number (default 04)")
    ap.add_argument("--solutions", action="store_true", help="the solution's hw_fsdp.c instead of stages/NN's")
    ap.add_argument("--flavor", default="8B", help="train --flavor (default 8B, Llama 3's): also 70B, llama2-7B, "
                    "llama2-13B, llama2-70B, llama3.1-8B, llama3.1-70B, llama3.1-405B, and tiny, debugmodel, 1B")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--profile", default="h100-sxm", help="device profile (train --device-profile)")
    ap.add_argument("--batch", type=int, help="local batch (sequences per rank; default 1; a pipeline stage: a "
                    "data shard's batch, default --microbatches, else 2P)")
    ap.add_argument("--seq", type=int, default=8192, help="sequence length (default 8192)")
    ap.add_argument("--steps", type=int, default=2, help="steps (default 2: the report reads the last)")
    ap.add_argument("--pp", type=int, help="pipeline stages P (train --pp; stages 11 and 12 only; default the "
                    "largest divisor of the world up to %d)" % MAX_DEFAULT_PP)
    ap.add_argument("--microbatches", type=int, help="microbatches M per step (train --microbatches; stages 11 and 12 "
                    "only; default the local batch: microbatches of one sequence, torchtitan's default)")
    ap.add_argument("--pp-schedule", choices=PP_SCHEDULES, help="the pipeline's schedule (train --pp-schedule; stages "
                    "11 and 12 only; default 1f1b)")
    ap.add_argument("--flags", default="", help="more train flags, one string: --flags=\"--ac --param-dtype bf16\"")
    ap.add_argument("--sweep", help="world sizes, comma-separated (e.g. 8,16,32,64): one dry run each and sweep.png")
    ap.add_argument("--compare", action="store_true", help="torchtitan's published configurations, side by side")
    ap.add_argument("--out", help="run directory (default runs/simulate/...)")
    a = ap.parse_args(argv)
    if a.steps < 2:
        ap.error("--steps must be at least 2 (memory is read from step 2 on)")
    if a.compare:
        a.out = a.out or os.path.join(ROOT, "runs", "simulate", "compare")
        compare(a)
        return 0
    try:
        stage = manifest.stage(a.stage)
    except KeyError:
        fail("no stage %r (stages: %s)" % (a.stage, ", ".join(s.id for s in manifest.stages())))
    check_pipeline_options(stage, a)
    exe = binary(stage, a.solutions)
    if a.sweep:
        try:
            worlds = [int(w) for w in a.sweep.split(",")]
        except ValueError:
            fail("--sweep takes world sizes separated by commas (got %r)" % a.sweep)
        a.out = a.out or os.path.join(ROOT, "runs", "simulate", "sweep-%s-%s" % (stage.id, a.flavor))
        sweep(exe, stage, a, worlds)
        return 0
    a.out = a.out or os.path.join(ROOT, "runs", "simulate", "%s-%s-w%d-%s" % (stage.id, a.flavor, a.world, a.profile))
    batch, pipe = batch_and_pipeline(stage, a, a.world)
    r = dry_run(exe, stage, a.flavor, a.world, a.profile, batch, a.seq, a.steps, a.flags.split(), a.out, pipe)
    plots(a.out, a.steps)
    write_report(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
