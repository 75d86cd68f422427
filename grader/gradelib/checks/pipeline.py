"""Pipeline parallelism (stages 11, 12): the schedule's order, its bubble, the activations a stage holds and frees,
and the collectives per microbatch.

Two parts: what the grader asked for (Pipeline: P, S, M, the schedule, the reshard flags) and the all-gathers
FSDP2's state implies (expected_all_gathers); then the checks, which compare the measures of the run
(gradelib.trace_model: schedule_order, passes_ran, pipeline_bubble, activation_peaks) with the schedule and the
reference.
"""
import os

import manifest
from trace_names import ALL_GATHER, REDUCE_SCATTER, label_and_kind

from ..trace_model import activation_peaks, held, ideal_bubble, passes_ran, pipeline_bubble, schedule_order
from ..util import CheckFailed, fmt_bytes, is_int, rel, relpath
from .registry import SAYS_HOW_MUCH, SAYS_WHAT_RAN, SAYS_WHICH_BUFFER, check


# ------------------------------------------------------------------ the measures (a run's trace and snapshots)

class Pipeline:
    """What the grader asked a --pp run for (hw_pipe.h): P stages of S = W / P ranks (rank = p * S + j), M
    microbatches, the schedule, the reshard flags; and the schedule's order by its definition."""

    def __init__(self, flags, world):
        self.P = int(manifest.flag_value(flags, "--pp", "0"))
        if self.P < 1:
            raise CheckFailed("this check needs a --pp run; the stage's flags are %s" % (" ".join(flags) or "none"))
        self.S = world // self.P
        self.M = int(manifest.flag_value(flags, "--microbatches", str(self.P)))
        self.schedule = manifest.flag_value(flags, "--pp-schedule", "1f1b")
        self.raf = manifest.flag_value(flags, "--reshard-after-forward", "true") == "true"
        self.rab = manifest.flag_value(flags, "--reshard-after-backward", "true") == "true"
        self.world = world

    def stage(self, rank):
        return rank // self.S

    def order(self, stage, schedule=None):
        """[('F', mb) / ('B', mb)]: stage's forwards and backwards in the order the schedule runs them."""
        return schedule_order(self.P, self.M, stage, schedule or self.schedule)

    def ideal_bubble(self):
        return ideal_bubble(self.P, self.M)


def expected_all_gathers(order, raf, M):
    """All-gathers of one module in a step whose passes ran in `order`, by FSDP2's state: a pass gathers the
    params unless they are still unsharded; a forward reshards after itself when reshard_after_forward; a
    backward only when it is the step's last (the schedule clears reshard_after_backward before the others)."""
    unsharded, n, backwards = False, 0, 0
    for what, _ in order:
        if not unsharded:
            n += 1
            unsharded = True
        if what == "F" and raf:
            unsharded = False
        if what == "B":
            backwards += 1
            if backwards == M:
                unsharded = False
    return n


# ------------------------------------------------------------------ the checks

def _spell(order, limit=24):
    text = " ".join("%s%d" % t for t in order[:limit])
    return text + (" ..." if len(order) > limit else "")


def _profiled_steps(ctx):
    """The training steps rank 0's trace holds (not the end's teardown, filed under step = steps); on a partial
    record, those of the first rank that left one."""
    r = ctx.ranks()[0] if ctx.ranks() else 0
    steps = sorted({e["args"]["step"] for e in ctx.trace(r) if is_int(e["args"].get("step"))
                    and 0 <= e["args"]["step"] < ctx.steps})
    if not steps:
        raise CheckFailed("rank %d's trace has no step: was the run profiled (--profile-steps)?" % r)
    return steps


def _cut_short(ctx, step):
    """Whether `step` is the one a partial record ends in (Context.partial): the runtime error stopped it, so
    what it holds is a beginning."""
    return ctx.partial and step == _profiled_steps(ctx)[-1]


@check("pp_schedule", label="pipeline schedule order", variants=True, tier=SAYS_WHAT_RAN, partial=True)
def check_pp_schedule(ctx):
    """Per rank and step, the forwards and backwards of the microbatches as the trace shows them ran, against
    the schedule's definition (GPipe: all forwards, then all backwards; 1F1B: P-1-p warm-up forwards on stage p,
    then one forward one backward, then the cool-down). On a partial record, the step the runtime error cut
    short is held to the beginning of that order."""
    pl = Pipeline(ctx.flags, ctx.world)
    for step in _profiled_steps(ctx):
        for r in ctx.ranks():
            p = pl.stage(r)
            ran, want = passes_ran(ctx.trace(r), step), pl.order(p)
            if ran == want or _cut_short(ctx, step) and ran == want[:len(ran)]:
                continue
            at = next((i for i, (a, b) in enumerate(zip(ran, want)) if a != b), min(len(ran), len(want)))
            other = "gpipe" if pl.schedule == "1f1b" else "1f1b"
            also = ""
            if ran == pl.order(p, other):
                also = ": that is %s's order, not %s's" % ("GPipe" if other == "gpipe" else "1F1B",
                                                            "1F1B" if other == "gpipe" else "GPipe")
            elif sorted(ran) != sorted(want):
                missing = sorted(set(want) - set(ran))
                also = ": %s" % ("%s never ran" % _spell(missing, 6) if missing else "a pass ran twice")
            raise CheckFailed(
                "step %d, rank %d (stage %d of %d): ran %s, but %s with M = %d runs %s; first difference at pass %d "
                "(%s expected, %s ran)%s (each pass is a pipe_forward / pipe_backward: F = forward, B = backward, "
                "the number the microbatch)"
                % (step + 1, r, p, pl.P, _spell(ran), "1F1B" if pl.schedule == "1f1b" else "GPipe", pl.M,
                   _spell(want), at + 1, "%s%d" % want[at] if at < len(want) else "nothing",
                   "%s%d" % ran[at] if at < len(ran) else "nothing", also))
    return "%s on %d stages, %d microbatches: every rank's order as defined" % (
        "1F1B" if pl.schedule == "1f1b" else "GPipe", pl.P, pl.M)


@check("pp_bubble", label="pipeline bubble", variants=True, clock=True, tier=SAYS_HOW_MUCH)
def check_pp_bubble(ctx):
    """The share of each step the stages' compute idles (the bubble), on the modelled clock, against the
    reference run of the same configuration: deterministic on both sides, so a schedule that waits more than
    the reference's shows."""
    pl = Pipeline(ctx.flags, ctx.world)
    slack = ctx.tol["pp_bubble_slack"]
    ref = ctx.reference_trace()
    mine = {r: ctx.trace(r) for r in range(ctx.world)}
    worst = None
    for step in _profiled_steps(ctx):
        got, window = pipeline_bubble(mine, step, ctx.world)
        want, _ = pipeline_bubble(ref, step, ctx.world)
        if want is None:
            raise CheckFailed("the reference trace %s has no forward or backward kernel in step %d (instructors: "
                              "make reference)" % (relpath(os.path.join(ctx.reference_dir(), "trace.json.gz")), step + 1))
        if got is None:
            raise CheckFailed("step %d: no forward or backward kernel in the trace" % (step + 1))
        if got > want + slack:
            raise CheckFailed(
                "step %d: the stages' compute idles %.1f%% of the step on the modelled clock (mean over the %d "
                "ranks; the window %.0f us), the reference schedule %.1f%% (slack %g points; with equal stages and "
                "free transfers a pipeline idles (P-1)/(M+P-1) = %d/%d = %.1f%%): does a stage wait for a transfer "
                "it could have received earlier, or run its passes in a worse order (see pipeline schedule order)?"
                % (step + 1, 100 * got, ctx.world, window, 100 * want, 100 * slack, pl.P - 1, pl.M + pl.P - 1,
                   100 * pl.ideal_bubble()))
        if worst is None or got > worst[0]:
            worst = (got, step)
    # the step named: plots.py's pipeline.png and the bench give the same figure for the same run and step
    return "bubble %.1f%% in step %d, the most of the profiled steps (ideal (P-1)/(M+P-1) = %.1f%%)" % (
        100 * worst[0], worst[1] + 1, 100 * pl.ideal_bubble())


@check("pp_activations", label="activations a stage holds", variants=True, tier=SAYS_WHICH_BUFFER)
def check_pp_activations(ctx):
    """How many microbatches' activations each rank holds at once (the trace's order: forwards run, backwards
    not yet) against the schedule's (GPipe: all M; 1F1B: min(P - p, M) on stage p), and its peak of live
    activation bytes against the reference's."""
    pl = Pipeline(ctx.flags, ctx.world)
    band = ctx.tol["peak_mem_band_rel"]
    steps = _profiled_steps(ctx)
    for r in range(ctx.world):
        p = pl.stage(r)
        want = held(pl.order(p))
        for step in steps:
            got = held(passes_ran(ctx.trace(r), step))
            if got != want:
                raise CheckFailed(
                    "step %d, rank %d (stage %d of %d) holds %d microbatches' activations at once, %s holds %d: %s"
                    % (step + 1, r, p, pl.P, got, "1F1B" if pl.schedule == "1f1b" else "GPipe", want,
                       "1F1B starts a backward as soon as the last stage can, so stage p never holds more than P - p "
                       "(GPipe holds every microbatch on every stage)" if pl.schedule == "1f1b" else
                       "GPipe runs every forward before any backward"))
        mine = activation_peaks(ctx.memory(r).get("events", []), ctx.steps)
        ref = activation_peaks(ctx.reference_memory(r).get("events", []), ctx.steps)
        for step in sorted(ref):
            if step not in mine:
                raise CheckFailed("rank %d's memory snapshot has no step %d" % (r, step + 1))
            g, w = mine[step][0], ref[step][0]
            if w > 0 and rel(g, w) > band:
                raise CheckFailed(
                    "step %d, rank %d (stage %d): %s of activations live at the peak, the reference %s (%+.0f%%, band "
                    "+-%g%%) with %d microbatches held: %s"
                    % (step + 1, r, p, fmt_bytes(g), fmt_bytes(w), 100.0 * (g - w) / w, 100 * band, want,
                       "more: a microbatch's activations outlive its backward, or a sent buffer is never freed"
                       if g > w else "less: is a buffer a later pass needs freed early?"))
    return "%s: stage 0 holds %d of %d microbatches at once" % (
        "1F1B" if pl.schedule == "1f1b" else "GPipe", held(pl.order(0)), pl.M)


@check("pp_frees", label="activations freed each step", variants=True, tier=SAYS_WHICH_BUFFER)
def check_pp_frees(ctx):
    """Every activation of a step is gone when the step ends: the live activation bytes at each step's end are
    those at its start (what the runtime keeps: the batch's tokens), on every rank."""
    for r in range(ctx.world):
        steps = activation_peaks(ctx.memory(r).get("events", []), ctx.steps)
        if not steps:
            raise CheckFailed("rank %d's memory snapshot has no step" % r)
        for step in sorted(steps):
            start, end = steps[step][1], steps[step][2]
            if end != start:
                raise CheckFailed(
                    "step %d, rank %d: %s of activations still live at the step's end (%s at its start): %s"
                    % (step + 1, r, fmt_bytes(end - start) if end > start else "-" + fmt_bytes(start - end),
                       fmt_bytes(start), "free what pipe_forward / pipe_backward return once its send is queued; "
                       "what you hand to them is the runtime's" if end > start else
                       "something freed more than it allocated"))
    return ""


@check("pp_collectives", label="collectives per microbatch in a pipeline", variants=True, tier=SAYS_WHAT_RAN, partial=True)
def check_pp_collectives(ctx):
    """Per rank, step and module: one reduce-scatter, in the stage's last backward (only it syncs); all-gathers
    as FSDP2's state implies over the order the passes ran in (expected_all_gathers): one per step with
    --reshard-after-forward=false (the params stay unsharded from the first forward to the last backward). On a
    partial record, the steps the run completed (not the one the runtime error cut short)."""
    pl = Pipeline(ctx.flags, ctx.world)
    seen = {}
    for kind in (ALL_GATHER, REDUCE_SCATTER):
        for r, e in ctx.collectives(kind):
            label, _ = label_and_kind(e["name"])
            seen.setdefault((r, e["args"].get("step"), label, kind), []).append(e["args"].get("microbatch"))
    ags = set()
    for step in _profiled_steps(ctx):
        if _cut_short(ctx, step):
            continue
        for r in ctx.ranks():
            order = passes_ran(ctx.trace(r), step)
            last_b = next((mb for what, mb in reversed(order) if what == "B"), None)
            want_ag = expected_all_gathers(order, pl.raf, pl.M)
            ags.add(want_ag)
            mods = list(dict.fromkeys(p["module"] for p in ctx.dtensors(r)["params"]))
            for mod in mods:
                where = "step %d, rank %d (stage %d)" % (step + 1, r, pl.stage(r))
                rs = seen.get((r, step, mod, REDUCE_SCATTER), [])
                if len(rs) != 1:
                    raise CheckFailed(
                        "%s: %d reduce-scatters in %s (microbatches %s), expected 1, after the step's last backward: "
                        "before every other backward set requires_gradient_sync = 0 on the stage's modules "
                        "(PipeInfo.model), as a pipeline stage sets it on an FSDP2 module, so the M microbatches' "
                        "grads accumulate unsharded and are reduced once"
                        % (mod, len(rs), where, ", ".join(str(m) for m in rs) or "none"))
                if last_b is not None and rs[0] != last_b:
                    raise CheckFailed("%s: the reduce-scatter in %s ran in microbatch %s's backward, but the last "
                                      "backward is microbatch %d's" % (mod, where, rs[0], last_b))
                ag = seen.get((r, step, mod, ALL_GATHER), [])
                if len(ag) != want_ag:
                    raise CheckFailed(
                        "%s: %d all-gathers in %s (microbatches %s), expected %d for the passes as they ran (%s)%s: "
                        "a pass gathers the params only when they were resharded since the last one; only a "
                        "forward with reshard_after_forward and the step's last backward reshard (set "
                        "reshard_after_backward = 0 before the other backwards)"
                        % (mod, len(ag), where, ", ".join(str(m) for m in ag) or "none", want_ag, _spell(order),
                           " with --reshard-after-forward=false" if not pl.raf else ""))
    return "per module and step: 1 reduce-scatter, %s all-gather%s" % (
        "/".join(str(a) for a in sorted(ags)), "" if ags == {1} else "s")
