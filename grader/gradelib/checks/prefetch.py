"""Prefetch (stages 03, 04): the prefetch exists, runs one module ahead, and bounds the memory it costs against
the first stage that trains without one.
"""
import manifest
from trace_names import (ALL_GATHER, BACKWARD_PHASES, FORWARD_PHASES, PHASE_POST_BACKWARD, PHASE_POST_FORWARD,
                         PHASE_PRE_BACKWARD, PHASE_PRE_FORWARD, label_and_kind)

from ..util import CheckFailed, fmt_bytes
from .registry import SAYS_HOW_MUCH, SAYS_WHAT_RAN, check


def blocking_stage(rubric):
    """The stage the prefetch bound compares with: the first that trains (not --forward-only) with no
    prefetch, so that it unshards one module at a time; None if no stage does."""
    return next((s.id for s in manifest.stages(rubric) if not (s.prefetch or s.forward_only)), None)


@check("prefetch_bound", label="prefetch memory bound", tier=SAYS_HOW_MUCH)
def check_prefetch_bound(ctx):
    order, size = ctx.module_order()
    index = {m: i for i, m in enumerate(order)}
    largest = max(size.values())
    extra = ctx.tol["prefetch_extra_unsharded_modules"] * largest
    got = ctx.peaks(ctx.metrics())
    stage = blocking_stage(ctx.rubric)
    blocking = ctx.peaks(ctx.reference_metrics(stage=stage, expect=ctx.rubric["stages"][stage].get("flags", [])))
    for r in range(ctx.world):
        if got[r] > blocking[r] + extra:
            raise CheckFailed("rank %d peak %s exceeds stage %s's %s + %d x the largest module's unsharded params "
                              "(%s): is your prefetch unbounded?"
                              % (r, fmt_bytes(got[r]), stage, fmt_bytes(blocking[r]),
                                 ctx.tol["prefetch_extra_unsharded_modules"], fmt_bytes(largest)))
    # The peak can sit in a part of the step the prefetch does not touch: also check how far ahead each
    # all-gather is issued (the trace names the module gathered and the module whose hook issued it).
    most = ctx.tol["prefetch_max_modules_ahead"]
    for r, e in ctx.collectives(ALL_GATHER):
        label, _ = label_and_kind(e["name"])
        host, phase = e["args"].get("module"), e["args"].get("phase")
        if label not in index or host not in index:
            continue
        ahead = index[label] - index[host] if phase in FORWARD_PHASES else index[host] - index[label]
        if phase in FORWARD_PHASES | BACKWARD_PHASES and ahead > most:
            raise CheckFailed("step %d: %s's %s issued %s's all-gather, %d modules ahead (at most %d): is your "
                              "prefetch unbounded? Keep at most two modules unsharded"
                              % (e["args"]["step"] + 1, host, phase, label, ahead, most))
    return ""


# The hooks of each pass, and which way that pass runs through the modules (forward order: +1; backward: -1).
PASS_HOOKS = {PHASE_PRE_FORWARD: ("forward", 1), PHASE_POST_FORWARD: ("forward", 1),
              PHASE_PRE_BACKWARD: ("backward", -1), PHASE_POST_BACKWARD: ("backward", -1)}


def wrong_direction(ctx, order):
    """The first all-gather a forward or backward hook issued for a module its pass has already run (the prefetch
    turned the wrong way: in backward, module i's hooks gathering module i+1, which ran forward after i and so
    backward before it), as a sentence; None if there is none. Recompute's hooks are left out: they run a
    forward inside the backward."""
    index = {m: i for i, m in enumerate(order)}
    for r, e in ctx.collectives(ALL_GATHER):
        label, _ = label_and_kind(e["name"])
        host, phase = e["args"].get("module"), e["args"].get("phase")
        if phase not in PASS_HOOKS or label not in index or host not in index or label == host:
            continue
        when, way = PASS_HOOKS[phase]
        if (index[label] - index[host]) * way > 0:
            continue  # ahead in its pass: the bound and the one-ahead rule are the other checks'
        k = index[host] + way
        nxt = ("the module that runs %s next is %s (module i%s1): prefetch that one"
               % (when, order[k], "+" if way > 0 else "-")) if 0 <= k < len(order) else (
            "%s is the last module to run %s, so it has nothing to prefetch" % (host, when))
        ran = ("it runs forward after %s, so backward before it" % host if way < 0 else
               "it runs forward before %s" % host)
        return ("step %d, rank %d: the %s prefetch runs the wrong way: %s's %s issued %s's all-gather, but %s ran %s "
                "already (%s); %s" % (e["args"]["step"] + 1, r, when, host, phase, label, label, when, ran, nxt))
    return None


@check("schedule", label="prefetch schedule", tier=SAYS_WHAT_RAN, partial=True)
def check_schedule(ctx):
    """The stage's prefetch exists and is one module ahead (forward: module i's hooks issue module i+1's
    all-gather; backward: module i's issue module i-1's). With the host running ahead of the device, a
    missing prefetch still reads as overlap (grader/figures/overlap.json), so this check, not the overlap
    one, catches it (and host_waits a hook that blocks the host). A prefetch turned the wrong way (of a module
    the pass has run already) is named as such first: on a partial record too, where the race it causes
    stopped the run (an all-gather of shards the optimizer is about to write)."""
    stage = manifest.stage(ctx.stage, ctx.rubric)
    order, _ = ctx.module_order()
    wrong = wrong_direction(ctx, order)
    if wrong:
        raise CheckFailed(wrong)
    issued = {}  # (rank, step, gathered module, forward?) -> the module whose hook issued it
    for r, e in ctx.collectives(ALL_GATHER):
        phase = e["args"].get("phase")
        if phase in FORWARD_PHASES | BACKWARD_PHASES:
            key = (r, e["args"]["step"], label_and_kind(e["name"])[0], phase in FORWARD_PHASES)
            issued.setdefault(key, e["args"].get("module"))
    steps = sorted({k[1] for k in issued})
    checks = []
    if "forward" in stage.prefetch:
        checks += [(order[i + 1], order[i], True) for i in range(len(order) - 1)]
    if "backward" in stage.prefetch and any(not k[3] for k in issued):
        checks += [(order[i - 1], order[i], False) for i in range(len(order) - 1, 0, -1)]
    for r in ctx.ranks():
        for step in steps:
            for target, host, forward in checks:
                by = issued.get((r, step, target, forward))
                if by is None or by == host:
                    continue
                when = "forward" if forward else "backward"
                raise CheckFailed("step %d, rank %d: %s's %s all-gather was issued in %s's hooks, not %s's: in %s "
                                  "module i's hooks prefetch module %s (one ahead), so that its all-gather runs while "
                                  "module i computes" % (step + 1, r, target, when, by, host, when,
                                                         "i+1" if forward else "i-1"))
    return ""
