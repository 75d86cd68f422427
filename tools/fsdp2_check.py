#!/usr/bin/env python3
"""make fsdp2-check: every stage's solution against real PyTorch FSDP2 (instructors; not in CI).

For each stage of grader/rubric.json, on its grading configuration and on every variant the
stage is graded on (the grader's own command lines, gradelib.rubric.stage_flags), and for the
debugmodel (10 steps, world 4, stage 04's solution), this tool

1. runs the stage's solution (build/solutions/NN_x/train; in a student tree without solutions/
   the student's build/stages/NN_x/train; --binary: any build): --save-init writes the initial
   weights, then the graded run starts from them (--load) and saves its final weights and AdamW
   state (--save); the run keeps its trace (every step profiled) and dtensors_rank<r>.json;
2. trains the same configuration with real FSDP2 (tools/fsdp2_torch.py: torch >= 2.6, gloo, W
   CPU processes, fully_shard per module group and on the root, the same weights, tokens, data
   order, AdamW, warmup and clipping, and FSDP2's own switches for --ac, ZeRO-2, gradient
   accumulation and mixed precision; with --mesh R,S (stage 09) fully_shard on a 2-D DeviceMesh,
   FSDP2's HSDP, see below);
3. compares:
   - loss, every step: relative difference <= loss_rel (TOLERANCES). The C run prints 9 digits
     of a float;
   - grad norm before clipping, every step: both sides sum squares in float64 (the solutions
     per tensor, then accumulate and all-reduce in float32; torch per shard and across the shard
     group in float64), so <= grad_norm_rel measures the sharded computation, not float32
     summation order. torch's own clip_grad_norm_ is up to ~1.5e-4 off on the debugmodel
     (REFERENCE.md) and is not used for the comparison: FSDP2's run clips with its formula on the
     float64 norm. It is computed, though (get_total_norm on the DTensor grads), and the float64
     norm must agree with it within dtensor_norm_rel: that holds the float64 norm to torch's
     definition (each shard once; on a 2-D mesh DTensor reduces over the shard dim only, the
     replicas' copies are not summed again, which a sum over the world would do: x sqrt(R));
   - DTensors: placement, mesh (its ranks, shape, dim names), placements per mesh dim, global
     shape, local rows, padded rows, row offset of every parameter on every rank, and each
     rank's mesh shape, shard rank and shard size, identical; both runs' local shards bitwise
     equal to the initial weights' rows after sharding, padding zero. After training the fp32
     shards are compared with the C run's --save: bitwise where they agree, else the largest
     difference in units of the learning rate (values_lr): the two sides' matmuls sum in other
     orders (OpenBLAS vs MKL, ~1e-7 relative per op), and AdamW's m / sqrt(v) turns that into up
     to ~1e-3 of one update where a gradient is near 0. A forward-only run must stay bitwise equal;
   - collectives: per rank, step, microbatch and module, the all-gathers in forward, those in
     backward (recompute included), the reduce-scatters and the all-reduces (HSDP's across the
     replicas), and the grad norm's all-reduce (module grad_norm, phase optimizer), from the C
     trace's collective events (the grader's parsing: '<module>.<kind>', args.phase, args.dtype,
     args.group, args.bytes) and from FSDP2's calls into torch.distributed and DTensor's
     functional all-reduce (the output tensor's dtype, the group's ranks): identical counts per
     element type and group, and the same bytes (an all-gather's output, a reduce-scatter's
     input, an all-reduce's tensor, as the C trace counts them). FSDP2's groups are named by
     their ranks as the C runtime names them (world; with --mesh R,S shard<i> = row i,
     replicate<j> = column j). The grad norm's all-reduce on the FSDP2 side is the one DTensor
     issues for torch's own total norm (see above), not FSDP2's: one per step, in the shard
     group, as the C runtime's; its bytes are not compared (the C runtime all-reduces one float,
     the sum of squares; DTensor the stacked per-parameter partial norms, 4 bytes per
     parameter: a choice of the norm's implementation, not of the sharding). A collective in a
     group of one rank moves nothing and is left out on both sides (counted in the record): the
     C runtime issues them (--mesh 4,1: all-gathers, reduce-scatters and the norm's all-reduce
     in its one-rank shard group; the grader wants one reduce-scatter per module), FSDP2 skips
     them (its world_size == 1 paths in FSDPParamGroup.unshard and foreach_reduce; DTensor does
     not reduce a Partial over a mesh dim of size 1).
4. prints a table and writes logs/fsdp2/ (table.txt, one <run>.json with the per-step numbers).
   A run of some stages rewrites their <run>.json only; table.txt keeps the other runs' rows
   (from their <run>.json). Exit status 1 if any comparison fails, 2 for bad input.

Reduce-scatter: FSDP2 averages fp32 grads with ReduceOp.AVG; gloo accepts it in torch 2.15 and
the results are bitwise those of set_force_sum_reduction_for_comms(True) (SUM, then divide;
checked on stage 04). --force-sum-reduction runs the latter.

HSDP (torch 2.15, _fsdp_collectives.foreach_reduce and _get_gradient_divide_factors): with a
2-D mesh FSDP2 all-gathers in the shard group, reduce-scatters the grads in the shard group with
ReduceOp.AVG, then all-reduces the reduce-scatter's output (the grad shard, in place) across the
replicate group with ReduceOp.AVG, on its all-reduce stream (a no-op stream on CPU): fp32 has no
pre/post-divide factor unless --force-sum-reduction (SUM both, then one divide by R*S). That is
what the C runtime does (average over S, then over R). gloo takes AVG for the all-reduce too.
The reduce ops FSDP2 used are in each record (collectives.fsdp2_reduce_ops). Not compared: the
order of collectives within a step (an all-reduce of the unsharded grads before the
reduce-scatter shows in its bytes, not in its order), the C run's streams and overlap (FSDP2 on
CPU runs every collective synchronously), memory.

Stage 10 (backward prefetch, CPU offload). The policies change when the backward's all-gathers
are issued, not what is computed or moved: under every policy (and --single-comm-stream, which
FSDP2 on CPU has no counterpart for: its collectives run synchronously) the loss, grad norm,
DTensors, trained values and the collectives per phase above are compared with FSDP2 on the
same weights. Under --backward-prefetch pre and none the issue point is compared too: each
backward all-gather by the hook that issued it (C trace: args.module and args.phase; FSDP2: the
param group whose pre_backward / post_backward was running), per rank and step. Pre is FSDP2's
default (module i's pre-backward prefetches module i-1); none is FSDP2 with that prefetch turned
off (tools/fsdp2_torch.py). Post (FSDP1's BACKWARD_POST) has no FSDP2 counterpart: its numbers
and collectives are compared against FSDP2's default, its issue points only by the grader.
--offload-params runs FSDP2 with CPUOffloadPolicy(pin_memory=False); on a CPU mesh the shards
are host memory already, so what is compared is the arithmetic of an optimizer step on host
shards, not the copies (the grader checks those: offload_memory).

Stages 11 and 12 (pipeline parallelism, --pp P at world W: S = W / P shards per stage, rank p*S + j
shard j of stage p; M = --microbatches). FSDP2's side is torch.distributed.pipelining: the stage's
part of the model in a PipelineStage, ScheduleGPipe or Schedule1F1B over M microbatches, with S > 1
(stage 12) each module fully_shard'ed over the stage's S ranks on a ("pp", "dp") mesh, and the
schedule driving FSDP (tools/fsdp2_torch.py says how; torch 2.15's Schedule1F1B refuses M < P and
runs with that check skipped). The C runtime refuses --save-init, --load and --save with --pp (a
stage holds only its params), so the initial weights come from the same binary and flags without
--pp / --microbatches / --pp-schedule at --world 1 (--save-init; model_init_host is seeded and the
same at any world), and the pipeline run starts from its own init. Compared:
   - loss and grad norm before clipping, every step, as above (the loss from the last stage, the
     mean over its S shards; the norm over every stage);
   - the passes, per rank and step: the C trace's compute events of phase forward / backward in
     time order (consecutive kernels of one microbatch's pass collapsed: F0 F1 B0 ..) against the
     order FSDP2's stage ran forward_one_chunk / backward_one_chunk: identical. Schedule1F1B runs
     min(M, P - p) warm-up forwards and then backward, forward; the C solution P-1-p and then
     forward, backward: the same order of passes;
   - the point to point transfers, per rank and step: each p2p event of the C trace (args.p2p: the
     items "send|recv peer microbatch act|grad" of one dev_group, or of one lone send or receive)
     is a group, in the trace's order, and so is each batch FSDP2's schedule issued (its
     _batch_p2p). Judged: for each peer, the sequence of its sends and receives (kind,
     microbatch, act | grad), in order, the items inside one group taken sends first (a group's
     transfers are concurrent: dev_group_start/end, batch_isend_irecv; the C solution lists its
     receive first where torch lists its send). Also compared: the groups themselves (which
     transfers go together), judged too, except for 1F1B with M < P: there torch, whose warm-up is
     min(M, P - p) forwards, fuses the last warm-up forward's send with the receive of microbatch
     0's grad, where the C solution (M warm-up forwards when M <= P-1-p, no steady state) sends and
     receives them in two groups: the same order, grouped differently; recorded in the run's json
     (pipeline.p2p.group_differences), shown as "same (regrouped)", not judged;
   - stage 12 (S > 1): the collectives as above, all-gathers and reduce-scatters of the modules
     only, per rank, step, microbatch, module, phase, group (the stage's ranks, named stage<p> as
     the C runtime names them) and bytes: one reduce-scatter per module after the step's last
     backward, the all-gathers FSDP2's unshard state implies. Not compared: the grad norm's
     all-reduce (the C runtime's one over the world; FSDP2 has no pipeline-wide norm, this tool's
     float64 one is uncounted, torchtitan's would reduce over dp then pp) and the pipeline
     schedule's own setup collectives and transfers (counted in each rank's json). Stage 11
     (S = 1): the C runtime's collectives run in one-rank groups and FSDP2 is not applied, so
     there is nothing to compare;
   - not compared for a pipeline: the trained values (no --save), the DTensor layouts.

torch: run by any python, the tool uses the current interpreter when it has torch >= 2.6 with
fully_shard; else build/fsdp2-venv (made once by pip, several GB of CUDA wheels, unless
--no-install), and runs itself again with that python.

    tools/fsdp2_check.py [STAGE ...] [--main-only] [--no-debugmodel] [--out logs/fsdp2]
                         [--work build/fsdp2-runs] [--venv build/fsdp2-venv] [--no-install]
                         [--install-only] [--force-sum-reduction] [--binary TRAIN (one stage)]
"""
import argparse
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time

from repo_paths import ROOT  # first: it puts grader/ on sys.path
import manifest
from gradelib.rubric import load_rubric, parse_stage, stage_flags, stage_variants
from gradelib.util import UsageError, rel
from trace_names import (ALL_GATHER, ALL_REDUCE, BACKWARD_PHASES, COLLECTIVE, COMPUTE, FORWARD_PHASES,
                         REDUCE_SCATTER, label_and_kind)

BUILD = os.path.join(ROOT, os.environ.get("HWFSDP_BUILD", "build"))
MIN_TORCH = (2, 6)
READY = ".fsdp2-ready"  # written into the venv once torch imports with fully_shard
PIP_PACKAGES = ["torch", "numpy", "safetensors"]

# Per-stage tolerances (stage id -> overrides of "default"). values_lr: the largest difference of a
# trained fp32 shard element from the C run's, in learning rates; None reports it without judging.
# Measured over stages 01-07, their variants and the debugmodel (2026-11-23, torch 2.15): loss
# <= 5.9e-8, grad norm <= 1.2e-7, trained values <= 1.6e-3 lr. A sharding bug moves them by
# orders of magnitude more (a sum instead of an average: the grad norm x W).
TOLERANCES = {
    "default": {"loss_rel": 1e-6, "grad_norm_rel": 1e-6, "values_lr": 1e-2, "dtensor_norm_rel": 1e-3},
    # Stage 08 (mixed precision): FSDP2 with param_dtype bf16 computes the activations and the
    # unsharded grads in bf16; the C runtime computes in fp32 on the same bf16-rounded weights and
    # keeps fp32 grads, so the two agree only to bf16's precision reaching the loss. Measured
    # 2026-11-23 (torch 2.15) on the grading configuration and its variants: loss <= 2.2e-4, grad
    # norm <= 2.1e-3 (FSDP2 in bf16 against the fp32 stage 04 run: 5.4e-4 and 2.7e-3). Tolerances
    # about 5x that; the DTensors and the collectives (with their element types) stay exact, and
    # the fp32 master shards are reported, not judged (about one learning rate apart after 6 steps:
    # AdamW normalizes a gradient that differs in its low bits).
    "08": {"loss_rel": 1e-3, "grad_norm_rel": 1e-2, "values_lr": None},
}

# The debugmodel (torchtitan's flavour) for 10 steps, besides the grading configurations.
DEBUGMODEL = {"name": "debugmodel", "stage": "04",
              "flags": ["--flavor", "debugmodel", "--world", "4", "--seq-len", "128", "--batch-size", "2",
                        "--steps", "10", "--warmup-steps", "2", "--lr", "8e-4", "--max-norm", "1.0",
                        "--profile-steps", "10"]}
C_TIMEOUT_S = 900
TORCH_TIMEOUT_S = 900


class Failure(Exception):
    """A run could not be compared: one line."""


def usage_error(msg):
    sys.stderr.write("fsdp2-check: error: %s\n" % msg)
    sys.exit(2)


def tolerances(stage):
    tol = dict(TOLERANCES["default"])
    tol.update(TOLERANCES.get(stage, {}))
    return tol


# ---------------------------------------------------------------------------- torch and its venv

def torch_version(python):
    """torch's version tuple in `python` if it has torch.distributed.fsdp.fully_shard, else None."""
    code = ("import torch, torch.distributed.fsdp as f; f.fully_shard; "
            "print(torch.__version__.split('+')[0])")
    try:
        p = subprocess.run([python, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if p.returncode != 0:
        return None
    try:
        return tuple(int(x) for x in p.stdout.decode().strip().split(".")[:2])
    except ValueError:
        return None


def suitable(python):
    v = torch_version(python)
    return v is not None and v >= MIN_TORCH


def shown(path):
    """A path as the user reads it: relative to the checkout when inside it."""
    path = os.path.abspath(path)
    return os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else path


def venv_python(venv):
    return os.path.join(venv, "bin", "python")


def install_venv(venv):
    """python -m venv + pip install torch; READY marks a venv whose torch has fully_shard."""
    print("fsdp2-check: warning: installing torch from the Python package index into %s: it pulls the CUDA "
          "wheels (~5 GB, a few minutes); once" % shown(venv), flush=True)
    if not os.path.exists(venv_python(venv)):
        if subprocess.run([sys.executable, "-m", "venv", venv]).returncode != 0:
            usage_error("python -m venv %s failed (Debian: apt-get install python3-venv)" % venv)
    if subprocess.run([venv_python(venv), "-m", "pip", "install", "--quiet"] + PIP_PACKAGES).returncode != 0:
        usage_error("pip install %s into %s failed (output above)" % (" ".join(PIP_PACKAGES), venv))
    if not suitable(venv_python(venv)):
        usage_error("%s has no torch >= %d.%d with torch.distributed.fsdp.fully_shard after pip install"
                    % (venv, MIN_TORCH[0], MIN_TORCH[1]))
    open(os.path.join(venv, READY), "w").close()


def ensure_torch(args, argv):
    """Return when this interpreter can run FSDP2; else re-run the tool under the venv's python."""
    venv = os.path.abspath(args.venv)
    if args.install_only:
        if not os.path.exists(os.path.join(venv, READY)):
            install_venv(venv)
        print("fsdp2-check: %s is ready" % shown(venv))
        sys.exit(0)
    if suitable(sys.executable):
        return
    if not os.path.exists(os.path.join(venv, READY)):
        if args.no_install:
            usage_error("no torch >= %d.%d with fully_shard in %s and no venv at %s (--no-install): run make "
                        "fsdp2-check, or this tool without --no-install" % (MIN_TORCH + (sys.executable, shown(venv))))
        install_venv(venv)
    python = venv_python(venv)
    os.execv(python, [python, os.path.abspath(__file__)] + argv)


# ---------------------------------------------------------------------------- the runs

class Run:
    """One comparison: a stage's binary on one command line, and FSDP2 on the same configuration.
    The binary is the stage's solution; in a student tree (no solutions/) the student's stage."""

    def __init__(self, name, stage, variant, stage_dir, flags):
        self.name, self.stage, self.variant, self.flags = name, stage, variant, flags
        tree = "solutions" if os.path.exists(os.path.join(ROOT, "solutions", stage_dir, "hw_fsdp.c")) else "stages"
        self.binary = os.path.join(BUILD, tree, stage_dir, "train")
        self.solution = "%s/%s/hw_fsdp.c" % (tree, stage_dir)


def plan(rubric, stages, main_only, debugmodel):
    runs = []
    for stage in stages:
        sdir = rubric["stages"][stage]["dir"]
        runs.append(Run("stage" + stage, stage, None, sdir, stage_flags(rubric, stage)))
        for v in ([] if main_only else stage_variants(rubric, stage)):
            runs.append(Run("stage%s-%s" % (stage, v), stage, v, sdir, stage_flags(rubric, stage, v)))
    if debugmodel:
        s = DEBUGMODEL["stage"]
        runs.append(Run(DEBUGMODEL["name"], s, None, rubric["stages"][s]["dir"],
                        list(DEBUGMODEL["flags"]) + list(rubric["stages"][s].get("flags", []))))
    return runs


def run_c(run, work):
    """--save-init, then the run from those weights; (run dir, init file, final checkpoint or None, the run's
    command). A pipeline run (--pp): the initial weights from the command line without the pipeline's flags at
    --world 1 (without_pipeline_flags), then the pipeline run from its own init, no checkpoint."""
    init = os.path.join(work, "init.safetensors")
    final = os.path.join(work, "c_final.safetensors")
    cdir = os.path.join(work, "c")
    if pipeline_of(run.flags):
        final = None
        steps = [[run.binary] + without_pipeline_flags(run.flags) + ["--save-init", init],
                 [run.binary] + run.flags + ["--out", cdir, "--quiet"]]
    else:
        steps = [[run.binary] + run.flags + ["--save-init", init],
                 [run.binary] + run.flags + ["--load", init, "--save", final, "--out", cdir, "--quiet"]]
    with open(os.path.join(work, "c_log.txt"), "w") as log:
        for cmd in steps:
            log.write("$ %s\n" % " ".join(cmd))
            log.flush()
            try:
                p = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=C_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise Failure("%s timed out after %d s" % (run.solution, C_TIMEOUT_S))
            if p.returncode != 0:
                raise Failure("%s exited with %d (see %s)" % (run.solution, p.returncode, shown(log.name)))
    return cdir, init, final, steps[1]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torch_job(run, cdir, init, out, args):
    """What FSDP2 trains: the C run's configuration (its run.json) and the stage's flags."""
    with open(os.path.join(cdir, "run.json")) as fh:
        r = json.load(fh)
    param_dtype = manifest.flag_value(run.flags, "--param-dtype")
    reduce_dtype = manifest.flag_value(run.flags, "--reduce-dtype") or ("fp32" if param_dtype else None)
    for what, v in (("--param-dtype", param_dtype), ("--reduce-dtype", reduce_dtype)):
        if v not in (None, "fp32", "bf16"):
            raise Failure("%s %s: only fp32 and bf16 map to a MixedPrecisionPolicy" % (what, v))
    return {"model": {k: r[k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of",
                                        "hidden_dim")},
            "init": init, "data": os.path.join(ROOT, r["data"]), "world": r["world_size"],
            "batch_size": r["batch_size"], "seq_len": r["seq_len"], "steps": r["steps"], "lr": r["lr"],
            "warmup_steps": r["warmup_steps"], "weight_decay": r["weight_decay"], "max_norm": r["max_norm"],
            "forward_only": r["forward_only"], "ac": r["ac"], "reshard_after_forward": r["reshard_after_forward"],
            "grad_accum": r.get("grad_accum", 1), "grad_sync_every": r.get("grad_sync", "every") == "every",
            "reshard_after_backward": r.get("reshard_after_backward", True),
            "param_dtype": param_dtype, "reduce_dtype": reduce_dtype,
            "mesh": r.get("mesh"), "backward_prefetch": r.get("backward_prefetch", "pre"),
            "offload": bool(r.get("offload_params", False)), "force_sum_reduction": args.force_sum_reduction, "threads": 1, "port": free_port(),
            "timeout_s": TORCH_TIMEOUT_S, "out": out, "pipeline": pipeline_job(r)}


def run_torch(job):
    import fsdp2_torch  # torch: only in the venv's python
    shutil.rmtree(job["out"], ignore_errors=True)
    try:
        fsdp2_torch.run(job)
    except Exception as e:  # a rank's traceback is in the exception's text: keep its last line
        lines = [l for l in str(e).strip().splitlines() if l.strip()]
        raise Failure("the FSDP2 run failed: %s" % (lines[-1] if lines else type(e).__name__))
    out = []
    for r in range(job["world"]):
        with open(os.path.join(job["out"], "rank%d.json" % r)) as fh:
            out.append(json.load(fh))
    return out


# ---------------------------------------------------------------------------- reading the C run

def read_jsonl(path):
    with open(path) as fh:
        return [json.loads(l) for l in fh if l.strip()]


def read_safetensors(path):
    """{name: float32 numpy array} of a safetensors file: tools/torch_llama.py's reader (the tool runs
    under a python with torch, see ensure_torch)."""
    import torch_llama
    try:
        return torch_llama.read_safetensors_arrays(path)
    except ValueError as e:
        raise Failure(str(e))


GRAD_NORM = "grad_norm"  # the label of the grad norm's all-reduce in the C trace, its module name in FSDP2's


def group_name(ranks, mesh, world, pp=None):
    """The C trace's name of the process group of these global ranks: without a mesh (mesh None) "world";
    with --mesh R,S "shard<i>" (row i: ranks i*S .. i*S+S-1) or "replicate<j>" (column j: j, S+j, ..);
    with --pp P "stage<p>" (stage p's S = W / P ranks p*S .. p*S+S-1).
    Any other set: "ranks a,b,..", which no C trace names (the comparison then differs)."""
    ranks = sorted(int(r) for r in ranks)
    if pp:
        S = world // pp
        for p in range(pp):
            if ranks == list(range(p * S, p * S + S)):
                return "stage%d" % p
    if mesh:
        R, S = mesh
        for i in range(R):
            if ranks == [i * S + j for j in range(S)]:
                return "shard%d" % i
        for j in range(S):
            if ranks == [i * S + j for i in range(R)]:
                return "replicate%d" % j
    elif ranks == list(range(world)):
        return "world"
    return "ranks " + ",".join(str(r) for r in ranks)


def group_size(name, mesh, world, pp=None):
    """How many ranks the group of a C trace name holds (shard<i>: S, replicate<j>: R, stage<p>: W / P, world: W)."""
    if pp and name.startswith("stage"):
        return world // pp
    if name.startswith("ranks "):
        return len(name.split(" ", 1)[1].split(","))
    if mesh and name.startswith("shard"):
        return mesh[1]
    if mesh and name.startswith("replicate"):
        return mesh[0]
    return world


def c_collective_events(cdir, rank):
    """The collective events of the C run's trace_rank<r>.json, each with its label and kind ('<label>.<kind>')."""
    with open(os.path.join(cdir, "trace_rank%d.json" % rank)) as fh:
        events = json.load(fh).get("traceEvents", [])
    return [(e, *label_and_kind(e["name"])) for e in events
            if e.get("ph") == "X" and e.get("cat") == COLLECTIVE and "name" in e]


def c_collectives(cdir, world, modules):
    """Per rank {(step, microbatch, module, kind, phase, group, dtype, bytes): count} of the C trace (the grader's
    parsing): the modules' all-gathers, reduce-scatters and all-reduces, and the grad norm's all-reduce."""
    per_rank = []
    for r in range(world):
        counts = {}
        for e, label, kind in c_collective_events(cdir, r):
            if kind not in (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE):
                continue
            if label not in modules and (label, kind) != (GRAD_NORM, ALL_REDUCE):
                continue  # the checkpoint's gathers
            a = e.get("args", {})
            phase = a.get("phase")
            phase = "forward" if phase in FORWARD_PHASES else "backward" if phase in BACKWARD_PHASES else phase
            key = (a["step"], a.get("microbatch", -1), label, kind, phase, a.get("group", "world"),
                   a.get("dtype", "f32"), a.get("bytes", -1))
            counts[key] = counts.get(key, 0) + 1
        per_rank.append(counts)
    return per_rank


def torch_collectives(ranks, profiled_steps, mesh, pp=None):
    """FSDP2's counts per rank, keyed as c_collectives' (the groups' ranks named by group_name)."""
    out = []
    for rk in ranks:
        counts = {}
        for c in rk["collectives"]:
            if c["step"] < profiled_steps or c["step"] < 0:
                group = group_name(c["group"].split(","), mesh, len(ranks), pp)
                key = (c["step"], c["microbatch"], c["module"], c["kind"], c["phase"], group, c["dtype"],
                       c.get("bytes", -1))
                counts[key] = counts.get(key, 0) + c["count"]
        out.append(counts)
    return out


def without_single_rank_groups(per_rank, mesh, world, pp=None):
    """(counts without the collectives in a group of one rank, how many were left out); any key whose element
    5 is the group."""
    kept, left_out = [], 0
    for counts in per_rank:
        k = {}
        for key, n in counts.items():
            if group_size(key[5], mesh, world, pp) == 1:
                left_out += n
            else:
                k[key] = n
        kept.append(k)
    return kept, left_out


def c_backward_gathers(cdir, world, modules):
    """Per rank {(step, microbatch, module gathered, hook module, hook phase): count} of the all-gathers the C
    trace has in the backward: args.module and args.phase name the host hook that issued each."""
    per_rank = []
    for r in range(world):
        counts = {}
        for e, label, kind in c_collective_events(cdir, r):
            a = e.get("args", {})
            if kind != ALL_GATHER or label not in modules or a.get("phase") not in BACKWARD_PHASES:
                continue
            key = (a["step"], a.get("microbatch", -1), label, a.get("module", "?"), a["phase"])
            counts[key] = counts.get(key, 0) + 1
        per_rank.append(counts)
    return per_rank


def torch_backward_gathers(ranks, profiled_steps):
    return [{(g["step"], g["microbatch"], g["module"], g["hook_module"], g["hook_phase"]): g["count"]
             for g in rk.get("backward_all_gathers", []) if g["step"] < profiled_steps} for rk in ranks]


def issue_points_compared(flags):
    """Why the backward all-gathers' issuing hooks are compared for this command line, or None: only where the
    stage implements --backward-prefetch (stage 10) and FSDP2 has the policy (pre: its default; none: turned
    off). Earlier stages ignore the flag; FSDP2 has no post."""
    policy = manifest.flag_value(flags, "--backward-prefetch")
    return policy if policy in ("pre", "none") else None


def compare_issue_points(c_points, t_points):
    diffs = []
    for r, (c, t) in enumerate(zip(c_points, t_points)):
        for key in sorted(set(c) | set(t), key=str):
            if c.get(key, 0) != t.get(key, 0):
                step, micro, mod, hook, phase = key
                diffs.append("rank %d step %d%s: %s's all-gather issued in %s's %s: %d in the C run, %d in FSDP2's"
                             % (r, step + 1, " microbatch %d" % micro if micro >= 0 else "", mod, hook, phase,
                                c.get(key, 0), t.get(key, 0)))
    if c_points and not c_points[0]:
        diffs.append("no all-gather in the C run's backward")
    return diffs


# ---------------------------------------------------------------------------- the comparisons

def compare_steps(c_rows, t_rows, tol):
    """Per step loss and grad norm; (rows, max loss rel, max grad-norm rel, failures)."""
    fails, rows = [], []
    if len(c_rows) != len(t_rows):
        fails.append("%d steps in the C run, %d in the FSDP2 run" % (len(c_rows), len(t_rows)))
    max_l = max_g = 0.0
    for c, t in zip(c_rows, t_rows):
        row = {"step": c["step"], "loss_c": c["loss"], "loss_fsdp2": t["loss"], "loss_rel": None,
               "grad_norm_c": c.get("grad_norm"), "grad_norm_fsdp2": t["grad_norm"], "grad_norm_rel": None}
        for key, limit in (("loss", tol["loss_rel"]), ("grad_norm", tol["grad_norm_rel"])):
            a, b = c.get(key), t[key]
            if a is None and b is None:
                continue
            if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
                fails.append("step %d: %s is %s in the C run, %s in FSDP2's" % (c["step"], key, a, b))
                continue
            d = rel(a, b)
            row[key + "_rel"] = d
            if key == "loss":
                max_l = max(max_l, d)
            else:
                max_g = max(max_g, d)
            if limit is not None and d > limit:
                fails.append("step %d: %s %.9g (C) vs %.9g (FSDP2), relative %.2e > %.0e"
                             % (c["step"], key, a, b, d, limit))
        rows.append(row)
    return rows, max_l, (max_g if any(r["grad_norm_rel"] is not None for r in rows) else None), fails


def counts_and_sizes(per_rank):
    """Per rank counts keyed by (.., group, dtype, bytes) -> ({key without bytes: count}, {key without bytes:
    sorted bytes of each collective})."""
    counts, sizes = [], []
    for per in per_rank:
        c, z = {}, {}
        for key, n in per.items():
            c[key[:-1]] = c.get(key[:-1], 0) + n
            z.setdefault(key[:-1], []).extend([key[-1]] * n)
        counts.append(c)
        sizes.append({k: sorted(v) for k, v in z.items()})
    return counts, sizes


def compare_sizes(c_sizes, t_sizes):
    """Differences in the bytes of the collectives that both runs issue as often (per rank and key), but the grad
    norm's: the C runtime all-reduces one float (the sum of squares), DTensor the per-parameter partial norms."""
    diffs = []
    for r, (c, t) in enumerate(zip(c_sizes, t_sizes)):
        for key in sorted(set(c) & set(t), key=str):
            if key[2] != GRAD_NORM and len(c[key]) == len(t[key]) and c[key] != t[key]:
                step, micro, mod, kind, phase, group, dtype = key
                diffs.append("rank %d step %d%s: %s %s (%s) in %s%s moved %s bytes in the C run, %s in FSDP2's"
                             % (r, step + 1, " microbatch %d" % micro if micro >= 0 else "", mod,
                                kind.replace("_", "-"), dtype, phase, "" if group == "world" else " in " + group,
                                "/".join(str(b) for b in c[key]), "/".join(str(b) for b in t[key])))
    return diffs


def compare_collectives(c_counts, t_counts):
    """(equal, differences, summary): per rank the counts by (step, microbatch, module, kind, phase, group,
    dtype); the summary is rank 0's step 1 in FSDP2's run (the group named when it is not the world)."""
    diffs = []
    for r, (c, t) in enumerate(zip(c_counts, t_counts)):
        for key in sorted(set(c) | set(t), key=str):
            if c.get(key, 0) != t.get(key, 0):
                step, micro, mod, kind, phase, group, dtype = key
                diffs.append("rank %d step %d%s: %s %s (%s) in %s%s: %d in the C run, %d in FSDP2's"
                             % (r, step + 1, " microbatch %d" % micro if micro >= 0 else "", mod,
                                kind.replace("_", "-"), dtype, phase, "" if group == "world" else " in " + group,
                                c.get(key, 0), t.get(key, 0)))
    if len(c_counts) != len(t_counts):
        diffs.append("%d ranks traced in the C run, %d in FSDP2's" % (len(c_counts), len(t_counts)))
    if c_counts and not c_counts[0]:
        diffs.append("no collective of a module in the C trace")
    summary = {}
    for (step, micro, mod, kind, phase, group, dtype), n in (t_counts[0] if t_counts else {}).items():
        if step == 0:
            k = "%s %s %s" % (mod, kind, phase) + ("" if group == "world" else " " + group) + (
                " mb%d" % micro if micro >= 0 else "") + ("" if dtype == "f32" else " " + dtype)
            summary[k] = n
    return not diffs, diffs, dict(sorted(summary.items()))


LAYOUT_FIELDS = ["module", "global_shape", "mesh", "mesh_shape", "mesh_dim_names", "placements", "placement",
                 "local_rows", "padded_rows", "row_offset", "row_numel", "global_rows", "local_matches_init",
                 "padding_is_zero"]
MESH_FIELDS = ["mesh_shape", "shard_rank", "shard_size"]  # the top of dtensors_rank<r>.json, per rank


def compare_mesh(c_top, t_mesh, rank):
    """Differences between the top of the C run's dtensors_rank<r>.json and FSDP2's mesh on that rank."""
    return ["rank %d: %s is %s in the C run, %s in FSDP2's" % (rank, f, json.dumps(c_top.get(f)),
                                                                 json.dumps(t_mesh.get(f)))
            for f in MESH_FIELDS if c_top.get(f) != t_mesh.get(f)]


def compare_layouts(c_params, t_params, rank):
    """Differences between the C run's dtensors_rank<r>.json and FSDP2's DTensors, by parameter."""
    diffs = []
    c_by, t_by = {p["name"]: p for p in c_params}, {p["name"]: p for p in t_params}
    for name in sorted(set(c_by) ^ set(t_by)):
        diffs.append("rank %d: %s only in the %s run" % (rank, name, "C" if name in c_by else "FSDP2"))
    for name in [p["name"] for p in t_params if p["name"] in c_by]:
        c, t = c_by[name], t_by[name]
        if not c.get("mesh_is_world", False):
            diffs.append("rank %d: %s's mesh is not the world in the C run" % (rank, name))
        for f in LAYOUT_FIELDS:
            if c.get(f) != t.get(f):
                diffs.append("rank %d: %s %s is %s in the C run, %s in FSDP2's"
                             % (rank, name, f, json.dumps(c.get(f)), json.dumps(t.get(f))))
        for side, p in (("C", c), ("FSDP2", t)):
            if p.get("local_matches_init") is not True or p.get("padding_is_zero") is not True:
                diffs.append("rank %d: %s: the %s shard is not the initial weights' rows with zero padding"
                             % (rank, name, side))
    return diffs


def compare_norm_definition(t_rows, limit):
    """torch's own float32 total norm of the DTensor grads against the float64 norm FSDP2's run is compared by,
    every step: (largest relative difference or None, failures)."""
    worst, fails = None, []
    for t in t_rows:
        a, b = t["grad_norm"], t.get("grad_norm_dtensor")
        if a is None or b is None:
            continue
        d = rel(a, b)
        worst = d if worst is None else max(worst, d)
        if limit is not None and not d <= limit:
            fails.append("step %d: torch's total norm of the DTensor grads %.9g is %.2e from the float64 norm "
                         "%.9g over the shard group (> %.0e): the float64 norm is not torch's definition"
                         % (t["step"], b, d, a, limit))
    return worst, fails


def compare_values(c_final, t_shards, t_layout, lr, limit, exact):
    """The trained fp32 shards against the C run's final weights (rows row_offset..+local_rows).
    Returns (summary, failures); exact: any difference fails (a run without an optimizer step)."""
    import numpy as np
    n = bitwise = 0
    max_abs = 0.0
    worst = ""
    state_max = {}
    fails = []
    for rank, (shards, layout) in enumerate(zip(t_shards, t_layout)):
        rows = {p["name"]: (p["row_offset"], p["local_rows"]) for p in layout}
        for name, t in shards.items():
            base = name[len("optim."):].rsplit(".", 1)[0] if name.startswith("optim.") else name
            if base not in rows or name not in c_final:
                fails.append("rank %d: %s has no counterpart in the C checkpoint" % (rank, name))
                continue
            off, k = rows[base]
            c = c_final[name][off:off + k]
            if c.shape != t.shape:
                fails.append("rank %d: %s: shard %s vs C rows %s" % (rank, name, list(t.shape), list(c.shape)))
                continue
            d = float(np.abs(c.astype(np.float64) - t).max()) if t.size else 0.0
            if name.startswith("optim."):
                kind = name.rsplit(".", 1)[1]
                scale = float(np.abs(c).max()) if c.size else 0.0
                state_max[kind] = max(state_max.get(kind, 0.0), d / scale if scale else d)
                continue
            n += 1
            same = np.array_equal(c.view(np.uint32), np.ascontiguousarray(t).view(np.uint32))
            bitwise += int(same)
            if d > max_abs:
                max_abs, worst = d, "%s (rank %d)" % (name, rank)
    if exact and bitwise != n:
        fails.append("%d of %d shards differ from the C run's (largest %.3g in %s) without an optimizer step"
                     % (n - bitwise, n, max_abs, worst))
    over_lr = max_abs / lr if lr else None
    if not exact and limit is not None and over_lr is not None and over_lr > limit:
        fails.append("trained shard values differ by up to %.3g = %.2e lr (> %.0e lr) in %s"
                     % (max_abs, over_lr, limit, worst))
    summary = {"exact": exact, "shards": n, "bitwise_identical": bitwise, "max_abs": max_abs,
               "max_abs_over_lr": over_lr, "worst": worst, "optimizer_state_max_rel": state_max}
    return summary, fails


# ---------------------------------------------------------------------------- pipeline runs (stages 11, 12)

PIPELINE_FLAGS = ("--pp", "--microbatches", "--pp-schedule")
PASS_LETTERS = {"forward": "F", "backward": "B"}  # a compute event's args.phase -> the pass it belongs to


def pipeline_of(flags):
    """{"pp": P, "microbatches": M, "schedule": gpipe | 1f1b} of a command line with --pp P >= 1 (the runtime's
    defaults: M = P, 1f1b), else None."""
    try:
        P = int(manifest.flag_value(flags, "--pp", "0") or 0)
    except ValueError:
        return None
    if P < 1:
        return None
    return {"pp": P, "microbatches": int(manifest.flag_value(flags, "--microbatches", str(P))),
            "schedule": manifest.flag_value(flags, "--pp-schedule", "1f1b")}


def without_pipeline_flags(flags):
    """The command line without --pp, --microbatches, --pp-schedule (--name V or --name=V), at --world 1 (the
    runtime's parser: the last --world wins): the run that writes a pipeline run's initial weights."""
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
        elif f in PIPELINE_FLAGS:
            skip = True
        elif not any(f.startswith(name + "=") for name in PIPELINE_FLAGS):
            out.append(f)
    return out + ["--world", "1"]


def pipeline_split(n_layers, P):
    """The blocks of each stage (hw_pipe.h): contiguous, stage p gets L / P, one more when p < L % P."""
    blocks, b = [], 0
    for p in range(P):
        n = n_layers // P + (1 if p < n_layers % P else 0)
        blocks.append(list(range(b, b + n)))
        b += n
    return blocks


def pipeline_job(r):
    """The job's "pipeline" of a C run's run.json: None without --pp."""
    P = r.get("pp") or 0
    if P < 1:
        return None
    if r["world_size"] % P or r["batch_size"] % r["microbatches"]:
        raise Failure("--pp %d at world %d with batch %d in %d microbatches: not a split the runtime makes"
                      % (P, r["world_size"], r["batch_size"], r["microbatches"]))
    return {"pp": P, "microbatches": r["microbatches"], "schedule": r["pp_schedule"],
            "blocks": pipeline_split(r["n_layers"], P)}


def read_trace_events(cdir, rank):
    with open(os.path.join(cdir, "trace_rank%d.json" % rank)) as fh:
        return json.load(fh).get("traceEvents", [])


def _int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def c_pass_orders(events):
    """{step: [(F | B, microbatch), ..]}: the forwards and backwards whose kernels ran, in time order (the compute
    events of phase forward / backward with a microbatch; consecutive kernels of one pass collapsed; a
    recompute's kernels, phase recompute, are not a pass)."""
    out = {}
    passes = [e for e in events if e.get("ph") == "X" and e.get("cat") == COMPUTE
              and e.get("args", {}).get("phase") in PASS_LETTERS and _int(e["args"].get("microbatch"))
              and _int(e["args"].get("step"))]
    for e in sorted(passes, key=lambda e: e["ts"]):
        a = e["args"]
        order = out.setdefault(a["step"], [])
        token = (PASS_LETTERS[a["phase"]], a["microbatch"])
        if not order or order[-1] != token:
            order.append(token)
    return out


def parse_p2p(text):
    """A p2p event's args.p2p, "send 2 0 act;recv 2 1 grad", as [(send | recv, peer, microbatch, label), ..]."""
    items = []
    for item in text.split(";"):
        f = item.split()
        if len(f) != 4 or f[0] not in ("send", "recv"):
            raise Failure("a p2p item %r: not 'send|recv peer microbatch label'" % item)
        try:
            items.append((f[0], int(f[1]), int(f[2]), f[3]))
        except ValueError:
            raise Failure("a p2p item %r: peer and microbatch are not numbers" % item)
    return items


def c_p2p_groups(events):
    """{step: [group, ..]}: each p2p event of a rank's trace (a dev_group, or a lone send or receive) as its
    items (parse_p2p), in the trace's order."""
    out = {}
    for e in events:
        a = e.get("args", {})
        if e.get("ph") == "X" and e.get("cat") == COLLECTIVE and a.get("p2p") and _int(a.get("step")):
            out.setdefault(a["step"], []).append(parse_p2p(a["p2p"]))
    return out


def torch_pipeline(ranks, what):
    """Per rank {step: [..]} of rank<r>.json's pipeline.passes or pipeline.p2p, items as tuples."""
    out = []
    for rk in ranks:
        per = {}
        for step, xs in enumerate(rk["pipeline"][what]):
            if what == "passes":
                per[step] = [tuple(x) for x in xs]
            else:
                per[step] = [[tuple(i) for i in g] for g in xs]
        out.append(per)
    return out


def spell_passes(order, limit=40):
    text = " ".join("%s%d" % (what, mb) for what, mb in order[:limit])
    return (text + (" .." if len(order) > limit else "")) or "nothing"


def spell_item(item):
    kind, peer, mb, label = item
    return "%s %s%d %s %d" % (kind, label, mb, "to" if kind == "send" else "from", peer)


def spell_group(group):
    return "{" + ", ".join(spell_item(i) for i in group) + "}"


def canonical_group(group):
    """A group's items in a fixed order, sends first: the transfers of one group are concurrent."""
    return tuple(sorted((tuple(i) for i in group), key=lambda i: (i[0] != "send", i[1], i[2], i[3])))


def peer_sequences(groups):
    """{peer: [(send | recv, microbatch, label), ..]}: the groups' items per peer, in order (canonical_group)."""
    out = {}
    for g in groups:
        for kind, peer, mb, label in canonical_group(g):
            out.setdefault(peer, []).append((kind, mb, label))
    return out


def _first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare_pass_orders(c_orders, t_orders, steps):
    """Per rank and step the passes in the order they ran, C trace against FSDP2's stage: differences."""
    diffs = []
    if len(c_orders) != len(t_orders):
        diffs.append("%d ranks traced in the C run, %d in FSDP2's" % (len(c_orders), len(t_orders)))
    for r, (c, t) in enumerate(zip(c_orders, t_orders)):
        for s in range(steps):
            a, b = list(c.get(s, [])), list(t.get(s, []))
            if a != b:
                i = _first_difference(a, b)
                diffs.append("rank %d step %d: the C run ran %s, FSDP2's %s: pass %d is %s in the C run, %s in "
                             "FSDP2's" % (r, s + 1, spell_passes(a), spell_passes(b), i + 1,
                                          "%s%d" % a[i] if i < len(a) else "nothing",
                                          "%s%d" % b[i] if i < len(b) else "nothing"))
    if c_orders and not any(c_orders[0].values()):
        diffs.append("no forward or backward pass with a microbatch in the C run's trace of rank 0")
    return diffs


def compare_p2p(c_groups, t_groups, steps):
    """Per rank and step the point to point transfers, C trace against FSDP2's schedule. (order differences: per
    peer its sends and receives in order, the judged comparison; group differences: which transfers went
    together)."""
    order, grouping = [], []
    for r, (c, t) in enumerate(zip(c_groups, t_groups)):
        for s in range(steps):
            cg, tg = c.get(s, []), t.get(s, [])
            cp, tp = peer_sequences(cg), peer_sequences(tg)
            for peer in sorted(set(cp) | set(tp)):
                a, b = cp.get(peer, []), tp.get(peer, [])
                if a != b:
                    i = _first_difference(a, b)

                    def one(x):
                        return spell_item((x[0], peer, x[1], x[2])) if x is not None else "nothing"
                    order.append("rank %d step %d, peer %d: transfer %d of %d is %s in the C run, %s in FSDP2's (of %d)"
                                 % (r, s + 1, peer, i + 1, len(a), one(a[i] if i < len(a) else None),
                                    one(b[i] if i < len(b) else None), len(b)))
            ca, ta = [canonical_group(g) for g in cg], [canonical_group(g) for g in tg]
            if ca != ta:
                i = _first_difference(ca, ta)
                grouping.append("rank %d step %d: %d groups in the C run, %d in FSDP2's; group %d is %s in the C run, "
                                "%s in FSDP2's" % (r, s + 1, len(ca), len(ta), i + 1,
                                                   spell_group(ca[i]) if i < len(ca) else "nothing",
                                                   spell_group(ta[i]) if i < len(ta) else "nothing"))
    if len(c_groups) != len(t_groups):
        order.append("%d ranks traced in the C run, %d in FSDP2's" % (len(c_groups), len(t_groups)))
    return order, grouping


def groups_judged(pl):
    """(whether the p2p groups are judged, why not): not for 1F1B with M < P, where torch's Schedule1F1B (which
    refuses it; run with the check skipped) fuses the last warm-up send with the first grad's receive."""
    if pl["schedule"] == "1f1b" and pl["microbatches"] < pl["pp"]:
        return False, ("1F1B with M = %d < P = %d: torch's Schedule1F1B runs min(M, P - p) warm-up forwards and "
                       "sends the last one's activation in one batch with the receive of microbatch 0's grad; the "
                       "C solution runs min(P-1-p, M) and, on stages p <= P-1-M (no steady state), sends it and "
                       "receives that grad in two groups. Same order, grouped differently; torch refuses M < P "
                       "for Schedule1F1B" % (pl["microbatches"], pl["pp"]))
    return True, None


def compare_pipeline(rec, cdir, job, ranks, profiled):
    """The pipeline's passes, transfers and (S > 1) collectives into rec; the failures."""
    pl, world = job["pipeline"], job["world"]
    P, M = pl["pp"], pl["microbatches"]
    S = world // P
    fails = []
    events = [read_trace_events(cdir, r) for r in range(world)]
    c_orders = [c_pass_orders(e) for e in events]
    t_orders = torch_pipeline(ranks, "passes")
    pass_diffs = compare_pass_orders(c_orders, t_orders, profiled)
    c_groups = [c_p2p_groups(e) for e in events]
    t_groups = torch_pipeline(ranks, "p2p")
    order_diffs, group_diffs = compare_p2p(c_groups, t_groups, profiled)
    judged, why = groups_judged(pl)
    fails += pass_diffs[:5] + order_diffs[:5] + (group_diffs[:5] if judged else [])
    rec["pipeline"] = {
        "pp": P, "shards": S, "microbatches": M, "schedule": pl["schedule"], "blocks": pl["blocks"],
        "fsdp2_schedule": ranks[0]["pipeline"]["schedule"],
        "pass_order": {"identical": not pass_diffs, "differences": pass_diffs[:20],
                       "step1": {str(r): spell_passes(t.get(0, []), 1000) for r, t in enumerate(t_orders)}},
        "p2p": {"identical": not order_diffs, "differences": order_diffs[:20],
                "groups_identical": not group_diffs, "groups_judged": judged, "why_groups_not_judged": why,
                "group_differences": group_diffs[:20],
                "step1": {str(r): " ".join(spell_group(g) for g in t.get(0, [])) for r, t in enumerate(t_groups)},
                "fsdp2_outside_schedule": {str(r): rk["pipeline"].get("p2p_outside_schedule", [])
                                           for r, rk in enumerate(ranks)}}}
    if S == 1:
        rec["collectives"] = {"identical": None, "why_not": "one rank per stage (S = 1): the C runtime's collectives "
                                                            "run in one-rank groups, FSDP2 is not applied"}
        return fails
    modules = set()
    for r in range(world):
        with open(os.path.join(cdir, "dtensors_rank%d.json" % r)) as fh:
            modules |= {p["module"] for p in json.load(fh)["params"]}

    def modules_only(per_rank):
        return [{k: n for k, n in counts.items() if k[3] in (ALL_GATHER, REDUCE_SCATTER) and k[2] in modules}
                for counts in per_rank]
    c_counts, c_single = without_single_rank_groups(modules_only(c_collectives(cdir, world, modules)), None, world, P)
    t_counts, t_single = without_single_rank_groups(modules_only(torch_collectives(ranks, profiled, None, P)), None,
                                                    world, P)
    (c_counts, c_sizes), (t_counts, t_sizes) = counts_and_sizes(c_counts), counts_and_sizes(t_counts)
    equal, diffs, summary = compare_collectives(c_counts, t_counts)
    size_diffs = compare_sizes(c_sizes, t_sizes)
    diffs += size_diffs
    rec["collectives"] = {"identical": equal and not size_diffs, "steps_compared": profiled,
                          "differences": diffs[:20], "step1_rank0": summary,
                          "compared": "all-gathers and reduce-scatters of the modules (not the grad norm's "
                                      "all-reduce, not the pipeline schedule's setup)",
                          "fsdp2_reduce_ops": ranks[0].get("reduce_ops", {}),
                          "left_out_single_rank_groups": {"c": c_single, "fsdp2": t_single}}
    return fails + diffs[:5]


def compare_pipeline_run(rec, cdir, job, ranks, tol):
    """A pipeline run's comparisons (loss, grad norm, the schedule, stage 12's collectives) into rec: the failures."""
    fails = []
    rows, max_l, max_g, f = compare_steps(read_jsonl(os.path.join(cdir, "metrics.jsonl")), ranks[0]["steps"], tol)
    rec.update({"per_step": rows, "max_loss_rel": max_l, "max_grad_norm_rel": max_g})
    fails += f
    with open(os.path.join(cdir, "run.json")) as fh:
        profiled = min(json.load(fh)["profile_steps"], job["steps"])
    fails += compare_pipeline(rec, cdir, job, ranks, profiled)
    rec["dtensors"] = None
    rec["why_no_dtensors"] = ("a pipeline run: the C runtime refuses --save with --pp (each stage holds only its "
                              "params), so no trained values; DTensor layouts not compared")
    rec["backward_issue_points"] = None
    rec["fsdp2_schedule"] = rec["pipeline"]["fsdp2_schedule"]
    if profiled < job["steps"]:
        fails.append("only %d of %d steps profiled in the C run: the schedule of the rest not compared"
                     % (profiled, job["steps"]))
    return fails


# ---------------------------------------------------------------------------- one run

def compare_run(run, args):
    """Run both sides and compare; the run's record (what logs/fsdp2/<run>.json holds)."""
    work = os.path.join(os.path.abspath(args.work), run.name)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    tol = tolerances(run.stage)
    rec = {"run": run.name, "stage": run.stage, "variant": run.variant, "solution": run.solution,
           "tolerances": tol, "reduction": "SUM then divide" if args.force_sum_reduction else "AVG"}
    t0 = time.time()
    cdir, init, final, cmd = run_c(run, work)
    rec["c_command"] = " ".join(shown(c) if os.path.isabs(c) else c for c in cmd)
    job = torch_job(run, cdir, init, os.path.join(work, "fsdp2"), args)
    ranks = run_torch(job)
    rec.update({"world": job["world"], "steps": job["steps"], "torch": ranks[0]["torch"],
                "mixed_precision": {"param_dtype": job["param_dtype"], "reduce_dtype": job["reduce_dtype"]}})
    if job["pipeline"]:
        rec["c_init_command"] = " ".join(shown(c) if os.path.isabs(c) else c for c in
                                         [run.binary] + without_pipeline_flags(run.flags) + ["--save-init", init])
        fails = compare_pipeline_run(rec, cdir, job, ranks, tol)
        rec["failures"] = fails
        rec["pass"] = not fails
        rec["seconds"] = round(time.time() - t0, 1)
        return rec
    fails = []

    rows, max_l, max_g, f = compare_steps(read_jsonl(os.path.join(cdir, "metrics.jsonl")), ranks[0]["steps"], tol)
    rec.update({"per_step": rows, "max_loss_rel": max_l, "max_grad_norm_rel": max_g})
    fails += f
    rec["max_dtensor_norm_rel"], f = compare_norm_definition(ranks[0]["steps"], tol["dtensor_norm_rel"])
    fails += f

    layout_diffs = []
    c_layouts = []
    for r in range(job["world"]):
        with open(os.path.join(cdir, "dtensors_rank%d.json" % r)) as fh:
            top = json.load(fh)
        c_layouts.append(top["params"])
        layout_diffs += compare_mesh(top, ranks[r]["mesh"], r) + compare_layouts(c_layouts[r], ranks[r]["dtensors"], r)
    shards = [read_safetensors(os.path.join(job["out"], "shards_rank%d.safetensors" % r)) for r in range(job["world"])]
    values, f = compare_values(read_safetensors(final), shards, [rk["dtensors"] for rk in ranks], job["lr"],
                               tol["values_lr"], exact=job["forward_only"])
    rec["dtensors"] = {"layout_identical": not layout_diffs, "layout_differences": layout_diffs[:20],
                       "values": values}
    fails += layout_diffs[:5] + f

    with open(os.path.join(cdir, "run.json")) as fh:
        profiled = min(json.load(fh)["profile_steps"], job["steps"])
    modules = {p["module"] for p in c_layouts[0]}
    mesh, world = job["mesh"], job["world"]
    c_counts, c_single = without_single_rank_groups(c_collectives(cdir, world, modules), mesh, world)
    t_counts, t_single = without_single_rank_groups(torch_collectives(ranks, profiled, mesh), mesh, world)
    (c_counts, c_sizes), (t_counts, t_sizes) = counts_and_sizes(c_counts), counts_and_sizes(t_counts)
    equal, diffs, summary = compare_collectives(c_counts, t_counts)
    size_diffs = compare_sizes(c_sizes, t_sizes)
    diffs += size_diffs
    equal = equal and not size_diffs
    rec["collectives"] = {"identical": equal, "steps_compared": profiled, "differences": diffs[:20],
                          "step1_rank0": summary, "mesh": mesh, "fsdp2_reduce_ops": ranks[0].get("reduce_ops", {}),
                          "left_out_single_rank_groups": {"c": c_single, "fsdp2": t_single}}
    fails += diffs[:5]
    policy = issue_points_compared(run.flags)
    if policy:
        points = compare_issue_points(c_backward_gathers(cdir, world, modules), torch_backward_gathers(ranks, profiled))
        rec["backward_issue_points"] = {"policy": policy, "identical": not points, "differences": points[:20]}
        fails += points[:5]
    else:
        rec["backward_issue_points"] = {"policy": manifest.flag_value(run.flags, "--backward-prefetch"),
                                        "identical": None,
                                        "why_not": "compared under --backward-prefetch pre and none only (stage 10; "
                                                   "FSDP2 has no post policy)"}
    rec["fsdp2_schedule"] = ranks[0].get("schedule")
    if profiled < job["steps"]:
        fails.append("only %d of %d steps profiled in the C run: collectives of the rest not compared"
                     % (profiled, job["steps"]))
    rec["failures"] = fails
    rec["pass"] = not fails
    rec["seconds"] = round(time.time() - t0, 1)
    return rec


# ---------------------------------------------------------------------------- the report

def fmt(x):
    return "-" if x is None else "%.1e" % x


def table(records):
    head = ["run", "world", "steps", "loss rel", "gnorm rel", "DTensors", "values |d|/lr", "pp order", "p2p",
            "collectives", "bwd issue", "result"]
    lines = []
    for r in records:
        if "error" in r:
            lines.append([r["run"], "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "FAIL: " + r["error"]])
            continue
        dt = r.get("dtensors")
        if dt:
            v = dt["values"]
            vals = ("bitwise" if v["bitwise_identical"] == v["shards"] else "NOT bitwise" if v.get("exact")
                    else fmt(v["max_abs_over_lr"]))
            layout = "identical" if dt["layout_identical"] else "DIFFER"
        else:
            vals = layout = "-"
        pl = r.get("pipeline")
        order = p2p = "-"
        if pl:
            order = "same" if pl["pass_order"]["identical"] else "DIFFER"
            q = pl["p2p"]
            p2p = ("DIFFER" if not q["identical"] or (q["groups_judged"] and not q["groups_identical"])
                   else "same" if q["groups_identical"] else "same (regrouped)")
        same = {True: "same", False: "DIFFER"}
        lines.append([r["run"], str(r["world"]), str(r["steps"]), fmt(r["max_loss_rel"]), fmt(r["max_grad_norm_rel"]),
                      layout, vals, order, p2p,
                      {True: "equal", False: "DIFFER"}.get((r.get("collectives") or {}).get("identical"), "-"),
                      same.get((r.get("backward_issue_points") or {}).get("identical"), "-"),
                      "PASS" if r["pass"] else "FAIL"])
    widths = [max(len(x[i]) for x in [head] + lines) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [head] + lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def earlier_records(out, records, order):
    """The records in out/<run>.json of runs not in `records` (an earlier invocation's), and all of them
    ordered as `order` names the runs (others after, by name)."""
    now = {r["run"] for r in records}
    earlier = []
    if os.path.isdir(out):
        for name in sorted(os.listdir(out)):
            if name.endswith(".json") and name[:-len(".json")] not in now:
                try:
                    with open(os.path.join(out, name)) as fh:
                        rec = json.load(fh)
                except (OSError, ValueError):
                    continue
                if isinstance(rec, dict) and rec.get("run") == name[:-len(".json")] and "pass" in rec:
                    earlier.append(rec)
    rank = {name: i for i, name in enumerate(order)}

    def key(r):
        return rank.get(r["run"], len(order)), r["run"]
    return sorted(earlier, key=key), sorted(records + earlier, key=key)


def write_logs(out, records, text, meta, every_run, order=()):
    """table.txt and <run>.json; a run of everything first removes the json of runs that no longer exist. A run of
    some stages keeps the other runs' json, and their rows in table.txt (from that json)."""
    os.makedirs(out, exist_ok=True)
    if every_run:
        for name in os.listdir(out):
            if name.endswith(".json"):
                os.remove(os.path.join(out, name))
    else:
        earlier, merged = earlier_records(out, records, order)
        if earlier:
            text = table(merged)
            meta += ("\nrows of %d runs not run now (%s) come from their <run>.json, written by an earlier "
                     "make fsdp2-check" % (len(earlier), ", ".join(r["run"] for r in earlier[:3])
                                           + (", ..." if len(earlier) > 3 else "")))
    for r in records:
        with open(os.path.join(out, r["run"] + ".json"), "w") as fh:
            json.dump(r, fh, indent=1)
            fh.write("\n")
    with open(os.path.join(out, "table.txt"), "w") as fh:
        fh.write(meta + "\n\n" + text + "\n")


def main(argv):
    ap = argparse.ArgumentParser(description="The stage solutions against real PyTorch FSDP2 (instructors).")
    ap.add_argument("stages", nargs="*", help="stage numbers or folders (default: every stage of the rubric)")
    ap.add_argument("--main-only", action="store_true", help="the grading configuration only, not the variants")
    ap.add_argument("--no-debugmodel", action="store_true", help="leave out the 10-step debugmodel run")
    ap.add_argument("--out", default=os.path.join(ROOT, "logs", "fsdp2"))
    ap.add_argument("--work", default=os.path.join(BUILD, "fsdp2-runs"))
    ap.add_argument("--venv", default=os.path.join(BUILD, "fsdp2-venv"))
    ap.add_argument("--no-install", action="store_true", help="fail instead of installing torch into --venv")
    ap.add_argument("--install-only", action="store_true", help="make the venv (once) and stop")
    ap.add_argument("--binary", help="compare this training binary instead of the stage's solution (one stage; "
                                     "e.g. a student's hw_fsdp.c built with make impl SRC=... OUT=...)")
    ap.add_argument("--force-sum-reduction", action="store_true",
                    help="FSDP2 reduce-scatters with SUM and divides (set_force_sum_reduction_for_comms)")
    args = ap.parse_args(argv)

    try:
        rubric = load_rubric()
        stages = sorted({parse_stage(rubric, s) for s in args.stages} if args.stages else rubric["stages"])
        if args.binary and len(stages) != 1:
            raise UsageError("--binary needs exactly one stage, got %d" % len(stages))
        if args.binary and not os.access(args.binary, os.X_OK):
            raise UsageError("--binary %s is not an executable file" % args.binary)
    except UsageError as e:
        usage_error(str(e))
    runs = plan(rubric, stages, args.main_only, not args.no_debugmodel and DEBUGMODEL["stage"] in stages)
    for run in runs:
        if args.binary:
            run.binary, run.solution = os.path.abspath(args.binary), shown(args.binary)
        if not args.install_only and not os.access(run.binary, os.X_OK):
            usage_error("%s is not built (run make)" % shown(run.binary))
    ensure_torch(args, argv)

    records = []
    for run in runs:
        print("fsdp2-check: %s: %s %s" % (run.name, run.solution, " ".join(run.flags)), flush=True)
        try:
            rec = compare_run(run, args)
        except Failure as e:
            rec = {"run": run.name, "stage": run.stage, "variant": run.variant, "error": str(e), "pass": False}
        for f in rec.get("failures", [rec.get("error")])[:3]:
            if f:
                print("  %s" % f, flush=True)
        records.append(rec)
    text = table(records)
    torch_v = next((r["torch"] for r in records if "torch" in r), "?")
    meta = "make fsdp2-check: %s, stages %s (%d runs), torch %s, gloo, reduce-scatter %s; %s" % (
        time.strftime("%Y-%m-%d"), " ".join(stages), len(runs), torch_v,
        "SUM then divide" if args.force_sum_reduction else "AVG",
        "tolerances: loss rel %g, grad norm rel %g, trained values %g lr (per stage: tools/fsdp2_check.py)" % (
            TOLERANCES["default"]["loss_rel"], TOLERANCES["default"]["grad_norm_rel"],
            TOLERANCES["default"]["values_lr"]))
    print("\n" + meta + "\n\n" + text)
    every = sorted(rubric["stages"])
    order = [r.name for r in plan(rubric, every, False, DEBUGMODEL["stage"] in every)]
    write_logs(os.path.abspath(args.out), records, text, meta, every_run=not args.stages and not args.main_only,
               order=order)
    print("\nwrote %s/ (table.txt, one json per run)" % shown(args.out))
    return 0 if all(r["pass"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
