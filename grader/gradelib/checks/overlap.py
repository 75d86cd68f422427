"""Overlap (stages 03 on): no hook blocks the host, and the transfers of each kind (all-gathers, reduce-scatters,
the replica all-reduces of HSDP, the offload copies) run beside the compute of their phases.

Two parts: the measure (OverlapKind, OVERLAP_CHECKS, OverlapFigures, overlap_transfers, overlap_figures),
which reads only a run's trace, and the checks, which hold that figure to a bar from the solution's own
figure on the same run (grader/figures/overlap.json, through the rubric the manifest loads).
"""
import manifest
from trace_names import (ALL_GATHER, ALL_REDUCE, COLLECTIVE, COMPUTE_TID, COPY, D2H, H2D, HOOK_PHASES, HOST_SYNC,
                         REDUCE_SCATTER)
from trace_names import PHASE_BACKWARD, PHASE_FORWARD, PHASE_P2P, PHASE_RECOMPUTE  # the phases (runtime/phase.h)

from ..trace_model import overlap_shares, transfers
from ..util import CheckFailed, is_finite, is_int
from .registry import SAYS_HOW_MUCH, SAYS_WHAT_RAN, check


@check("host_waits", label="no host wait in a hook", variants="every", tier=SAYS_WHAT_RAN)
def check_host_waits(ctx):
    """No hook (and, with --pp, no pipeline schedule between its passes) blocks the host: the trace's host track
    holds a host_sync slice for every host wait (0 long where it did not stall the host on the modelled clock,
    so a wait is seen whether or not it cost time, the same on every run). No stage's contract needs one there:
    whatever a hook or a send queues, another stream can wait for with an event; the host waits only outside
    them (the optimizer step, to return the grad norm; the runtime, between steps). A host wait in a hook
    stalls the queueing of everything after it, which on a GPU leaves the device idle and on the modelled
    clock shows as lost overlap where the device is behind the host (stage 10's offload copies), or as a
    longer pipeline bubble (stages 11 and 12)."""
    for r in range(ctx.world):
        for e in ctx.trace(r):
            phase = e["args"].get("phase") if e.get("cat") == HOST_SYNC else None
            if phase in HOOK_PHASES:
                raise CheckFailed("step %d, rank %d: the host blocked inside %s.%s (%s): make the stream that needs "
                                  "the result wait for an event (dev_stream_wait_event), not the host"
                                  % (e["args"].get("step", -1) + 1, r, e["args"].get("module"), phase, e["name"]))
            if phase == PHASE_P2P:
                raise CheckFailed("step %d, rank %d: the host blocked in pipe_schedule between passes (%s): a send or "
                                  "a receive is a stream op, ordered on its stream like the passes around it, so "
                                  "the schedule never needs the host to wait; while it waits, this stage queues no "
                                  "work and the pipeline's bubble grows"
                                  % (e["args"].get("step", -1) + 1, r, e["name"]))
    return ""


# ------------------------------------------------------------------ what each check measures (gradelib.trace_model's
# overlap_shares of the run's transfers of one kind)

class OverlapKind:
    """What one overlap check measures: the transfers of one kind and the compute they should run under.

    cat, kind   the trace slices: collectives named "<label>.<kind>", or copies named "<module>.<kind>"
                (h2d / d2h: the host <-> device copies of --offload-params)
    phases      the compute kernels' phases it covers (args.phase of the compute stream's kernels)
    modules     only transfers labelled with a module's name (the replica all-reduces of HSDP, not the grad
                norm's all-reduce in the optimizer step)
    what        how the grader names the transfers ("all-gather", ...)
    advice      what to change when a run misses the bar"""

    def __init__(self, cat, kind, phases, what, advice, modules=False):
        self.cat, self.kind, self.phases, self.what, self.advice = cat, kind, frozenset(phases), what, advice
        self.whats = what[:-1] + "ies" if what.endswith("y") else what + "s"  # "copies", "all-gathers"
        self.modules = modules


OVERLAP_CHECKS = {
    "ag_overlap": OverlapKind(
        COLLECTIVE, ALL_GATHER, {PHASE_FORWARD}, "all-gather",
        "are the all-gathers on their own stream, the next module's issued (prefetched) before this one computes, "
        "with compute waiting on an event rather than the host?"),
    "rs_overlap": OverlapKind(
        COLLECTIVE, REDUCE_SCATTER, {PHASE_BACKWARD, PHASE_RECOMPUTE}, "reduce-scatter",
        "are the reduce-scatters on their own stream, so that module i's reduce-scatter runs while module i-1's "
        "backward computes?"),
    "ar_overlap": OverlapKind(
        COLLECTIVE, ALL_REDUCE, {PHASE_BACKWARD, PHASE_RECOMPUTE}, "replica all-reduce",
        "issue each module's all-reduce across the replicas in its post_backward, on the reduce-scatter's stream "
        "right after its reduce-scatter, so that it runs while the next module's backward computes (not all at "
        "the end of the backward, not on the compute stream)", modules=True),
    "h2d_overlap": OverlapKind(
        COPY, H2D, {PHASE_FORWARD, PHASE_BACKWARD, PHASE_RECOMPUTE}, "host-to-device copy",
        "queue each host shard's copy to the device on the all-gather stream, before its all-gather, with no host "
        "wait in between, so that it runs while the previous module computes"),
    "d2h_overlap": OverlapKind(
        COPY, D2H, {PHASE_BACKWARD, PHASE_RECOMPUTE}, "device-to-host copy",
        "queue each reduce-scatter output's copy back to the host grad shards on the reduce-scatter stream and "
        "let the host go on (no dev_stream_synchronize / dev_event_synchronize in the hook)"),
}


class OverlapFigures:
    """What an overlap check reads of a run, at full precision (grader/figures/overlap.json quotes them).

    compute_share     of the rank's compute-stream kernels in the check's phases (their durations summed
                      over every rank), the share that ran while one of the rank's transfers of the kind
                      was in flight (the union of their slices): graded
    collective_share  of that union of transfer slices, the share during which the rank's compute stream
                      ran a kernel (any phase): printed, not graded
    serial            [(rank, event)] of the transfers that ran on the compute stream
    on_compute        every transfer of the kind did"""

    def __init__(self, compute_share, collective_share, serial, on_compute):
        self.compute_share, self.collective_share, self.serial, self.on_compute = (compute_share, collective_share,
                                                                                   serial, on_compute)


def overlap_transfers(ctx, key):
    """[(rank, event)] of the transfers overlap check `key` measures, every rank, training steps only."""
    k = OVERLAP_CHECKS[key]
    labels = set(ctx.module_order()[0]) if k.modules else None
    by = transfers({r: ctx.trace(r) for r in range(ctx.world)}, k.cat, k.kind, labels)
    return [(r, e) for r in range(ctx.world) for e in by.get(r, [])]


def overlap_figures(ctx, key):
    """OverlapFigures of the overlap check `key` (OVERLAP_CHECKS) on ctx's run: trace_model.overlap_shares of its
    transfers against the compute of the check's phases, from the trace's ts and dur.

    On the CPU backends those are the modelled clock's (program order priced on the device profile), so
    the same program gives the same figures on every run, loaded machine or not; on the CUDA backend they
    are the GPU's."""
    k = OVERLAP_CHECKS[key]
    events = overlap_transfers(ctx, key)
    if not events:
        raise CheckFailed("no %s in the trace (trace_rank*.json)" % k.what)
    by = {}
    for r, e in events:
        by.setdefault(r, []).append(e)
    compute_share, collective_share, compute_total = overlap_shares({r: ctx.trace(r) for r in range(ctx.world)},
                                                                    by, k.phases)
    if compute_total <= 0:
        raise CheckFailed("no %s compute kernels in the trace" % "/".join(sorted(k.phases)))
    serial = [(r, e) for r, e in events if e.get("tid") == COMPUTE_TID]
    return OverlapFigures(compute_share, collective_share, serial, len(serial) == len(events))


# ------------------------------------------------------------------ the checks (the measure against the solution's)

def solution_overlap(rubric, stage, variant, key):
    """The solution's graded figure of overlap check `key` on a run (grader/figures/overlap.json, at full
    precision), or None where the rubric lists none (the check does not apply to that run)."""
    def member(d, k):
        return d.get(k) if isinstance(d, dict) else None
    figs = member(rubric, "overlap_figures")
    runs = (member(member(member(figs, "variants"), stage), variant) if variant
            else member(member(figs, "solutions"), stage))
    got = member(runs, key)
    return got[0] if isinstance(got, list) and got and is_finite(got[0]) else None


def overlap_applies(rubric, stage, variant, key):
    """Overlap check `key` grades this run: the solution's figure there is positive (a run whose solution has
    nothing of the kind to overlap, e.g. --mesh 4,1's all-gathers in shard groups of one rank, is not graded
    on it)."""
    fig = solution_overlap(rubric, stage, variant, key)
    return fig is not None and fig > 0


def overlap_runs(rubric, stage, key):
    """The runs of a stage (None: the grading configuration, else a variant's name) overlap check `key` grades."""
    return [v for v in [None] + manifest.stage_variants(rubric, stage) if overlap_applies(rubric, stage, v, key)]


def overlap_bar(ctx, key):
    """(bar, what it is) of overlap check `key` on ctx's run: overlap_share_min of the solution's own figure on
    the same run (grader/figures/overlap.json), on the modelled clock. grade.py --cuda does not grade these
    (cli.GPU_OVERLAP_NOT_GRADED)."""
    fig = solution_overlap(ctx.rubric, ctx.stage, ctx.variant, key)
    share = ctx.tol["overlap_share_min"]
    return share * fig, "%g of the solution's %.1f%%" % (share, 100 * fig)


def _overlap(ctx, key):
    """The overlap check `key` on one run: the share of the rank's compute in the check's phases that ran while
    one of its transfers of the check's kind was in flight (OverlapFigures.compute_share) must reach the bar,
    a fixed share of what the solution reads on the same run.

    Measured from the compute side: a transfer on the compute stream cannot run during that stream's kernels,
    so a serialized schedule reads exactly 0, while one whose transfers have their own stream reads what its
    schedule leaves beside compute (INSTRUCTORS.md, "The overlap bar", gives every solution's figure and the
    serialized ones'). The clock is the modelled one, so the figure is one fixed number per program and a
    miss is the schedule's, never the machine's.

    The transfer side, the share of transfer time under compute, is printed but not graded: it says how much
    communication is hidden, which depends on the configuration as much as on the schedule, and it cannot
    separate more than the compute side does: a serialized schedule reads 0 on both.

    A run the check does not apply to (overlap_applies) passes with a line that says where it is graded."""
    k = OVERLAP_CHECKS[key]
    if not overlap_applies(ctx.rubric, ctx.stage, ctx.variant, key):
        runs = [manifest.variant_label(ctx.rubric, v, ctx.stage) for v in overlap_runs(ctx.rubric, ctx.stage, key)]
        if not runs:
            raise CheckFailed("grader/figures/overlap.json gives stage %s's solution no %s figure on any "
                              "run, so there is no bar to grade against (instructors: tools/overlap_figures.py "
                              "--write)" % (ctx.stage, key))
        if ctx.variant is None:
            return "graded on %s (the grading configuration has no %s to overlap)" % ("; ".join(runs), k.whats)
        return ""
    need, how = overlap_bar(ctx, key)
    f = overlap_figures(ctx, key)
    if f.serial and not f.on_compute:  # some of them: the share of the step may still clear the bar
        r, e = f.serial[0]
        micro = e["args"].get("microbatch")
        raise CheckFailed("%d of your %s ran on the compute stream, where nothing can run beside them (first: %s in "
                          "%s.%s, step %d%s, rank %d) while the others have a stream of their own: %s"
                          % (len(f.serial), k.whats, e["name"], e["args"].get("module"), e["args"].get("phase"),
                             e["args"].get("step", -1) + 1, ", microbatch %d" % micro if is_int(micro) else "", r,
                             k.advice))
    where = "/".join(p for p in (PHASE_FORWARD, PHASE_BACKWARD, PHASE_RECOMPUTE) if p in k.phases)
    if f.compute_share >= need:
        return "%.1f%% of %s compute ran during %s (%.1f%% of %s time under compute, not graded)" % (
            100 * f.compute_share, where, k.whats, 100 * f.collective_share, k.what)
    raise CheckFailed("%.1f%% of %s compute ran while a%s %s was in flight (need >= %.2g%%, %s)%s: %s"
                      % (100 * f.compute_share, where, "n" if k.what[0] in "aeiou" else "", k.what, 100 * need, how,
                         " (your %s run on the compute stream)" % k.whats if f.on_compute else "", k.advice))


def _register_overlap_checks():
    """One check per OVERLAP_CHECKS entry, labelled "<what> overlap" ("all-gather overlap", ...), graded on every
    run of a stage that grades it."""
    for key, k in OVERLAP_CHECKS.items():
        def fn(ctx, key=key):
            return _overlap(ctx, key)
        fn.__name__ = "check_" + key
        check(key, label=k.what + " overlap", variants="every", tier=SAYS_HOW_MUCH, clock=True)(fn)


_register_overlap_checks()
