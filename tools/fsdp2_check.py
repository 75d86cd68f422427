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

Stage 13 (flat units, rubric "flat") is FSDP1's design, so its reference is FSDP1 when the venv's
torch still has torch.distributed.fsdp.FullyShardedDataParallel (detected, fsdp2/runner.py
choose_references): tools/fsdp1_torch.py wraps each module in FSDP with use_orig_params=False
(one FlatParameter per unit), and tools/fsdp2/flat.py compares the loss, the grad norm, S and the
flat size per unit, the flat shards by parameter name (FSDP1's _fqns / _shard_param_infos: its
registration order is not the C module order) and the collectives with their bytes; a run FSDP1
cannot express (--bucket-mb units, --reshard-after-backward unlike FSDP1's rule) on its numbers
only, saying why. Without FSDP1 one line says so and stage 13 is compared with FSDP2 (stage 07's
per-parameter sharding): loss, grad norm, trained values by name, collective counts.

torch: run by any python, the tool uses the current interpreter when it has torch >= 2.6 with
fully_shard; else build/fsdp2-venv (made once by pip, several GB of CUDA wheels, unless
--no-install), and runs itself again with that python.

    tools/fsdp2_check.py [STAGE ...] [--main-only] [--no-debugmodel] [--out logs/fsdp2]
                         [--work build/fsdp2-runs] [--venv build/fsdp2-venv] [--no-install]
                         [--install-only] [--force-sum-reduction] [--binary TRAIN (one stage)]
"""
import argparse
import os
import sys
import time

from repo_paths import ROOT  # first: it puts grader/ on sys.path
from gradelib.rubric import load_rubric, parse_stage
from gradelib.util import UsageError
from fsdp2.compare import (compare_collectives, compare_issue_points, compare_layouts, compare_mesh,
                           compare_norm_definition, compare_p2p, compare_pass_orders, compare_run, compare_sizes,
                           compare_steps, compare_values, counts_and_sizes, groups_judged, issue_points_compared,
                           spell_passes, TOLERANCES, tolerances)
from fsdp2.read import (c_backward_gathers, c_p2p_groups, c_pass_orders, group_name, group_size, parse_p2p,
                        torch_backward_gathers, torch_collectives, torch_pipeline, without_single_rank_groups)
from fsdp2.report import table, write_logs
from fsdp2.flat import (c_flat_dump_failures, compare_flat_init, compare_flat_run, compare_units, coverage_failures,
                        flat_pieces, flattened, fsdp1_gaps, unflatten)
from fsdp2.runner import (BUILD, choose_references, DEBUGMODEL, ensure_torch, Failure, MIN_TORCH, pipeline_job,
                          pipeline_of, plan, READY, shown, suitable, torch_job, usage_error, venv_python,
                          without_pipeline_flags)

# The tool is three modules of tools/fsdp2/ (runner.py: the venv and the runs; read.py and compare.py: what is
# read of both runs and how it is compared, one run's record; report.py: the table and logs/fsdp2/); this file
# is its command line. The names above are the ones the tests (tests/test_fsdp2_check.py) reach through it.
__all__ = ["compare_collectives", "compare_issue_points", "compare_layouts", "compare_mesh",
           "compare_norm_definition", "compare_p2p", "compare_pass_orders", "compare_run", "compare_sizes",
           "compare_steps", "compare_values", "counts_and_sizes", "groups_judged", "issue_points_compared",
           "spell_passes", "TOLERANCES", "tolerances", "c_backward_gathers", "c_p2p_groups", "c_pass_orders",
           "group_name", "group_size", "parse_p2p", "torch_backward_gathers", "torch_collectives", "torch_pipeline",
           "without_single_rank_groups", "table", "write_logs", "BUILD", "DEBUGMODEL", "choose_references",
           "c_flat_dump_failures", "torch_job", "compare_flat_init", "compare_flat_run", "compare_units",
           "coverage_failures", "flat_pieces", "flattened", "fsdp1_gaps", "unflatten", "ensure_torch", "Failure",
           "MIN_TORCH", "pipeline_job", "pipeline_of", "plan", "READY", "shown", "suitable",
           "usage_error", "venv_python", "without_pipeline_flags", "load_rubric"]


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
    note = choose_references(runs)  # a flat stage (13) against FSDP1, or FSDP2 when this torch has no FSDP1
    if note:
        print(note, flush=True)

    records = []
    for run in runs:
        print("fsdp2-check: %s: %s %s%s" % (run.name, run.solution, " ".join(run.flags),
                                             " (against FSDP1)" if run.reference == "fsdp1" else ""), flush=True)
        try:
            rec = compare_run(run, args, flat_run=compare_flat_run)
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
        "tolerances: loss rel %g, grad norm rel %g, trained values %g lr (per stage: tools/fsdp2/compare.py)" % (
            TOLERANCES["default"]["loss_rel"], TOLERANCES["default"]["grad_norm_rel"],
            TOLERANCES["default"]["values_lr"]))
    if any(r.reference == "fsdp1" for r in runs):
        meta += ("; the flat stage (13) against FSDP1 (FullyShardedDataParallel, use_orig_params=False; its "
                 "reduce-scatter SUM between its pre- and post-divide)")
    elif note:
        meta += "; " + note[len("fsdp2-check: "):]
    print("\n" + meta + "\n\n" + text)
    every = sorted(rubric["stages"])
    order = [r.name for r in plan(rubric, every, False, DEBUGMODEL["stage"] in every)]
    write_logs(os.path.abspath(args.out), records, text, meta, every_run=not args.stages and not args.main_only,
               order=order)
    print("\nwrote %s/ (table.txt, one json per run)" % shown(args.out))
    return 0 if all(r["pass"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
