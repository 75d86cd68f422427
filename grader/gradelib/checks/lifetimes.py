"""What the hooks free and keep (every stage): params freed after forward and backward, grads after the
reduce-scatter (the hook_check notes), and memory inside each hook against the reference's.
"""
from trace_names import (TAG_COMM_BUFFER, TAG_GRAD_SHARD, TAG_OPTIM_STATE,  # the memory tags (MemTag)
                         TAG_UNSHARDED_GRAD, TAG_UNSHARDED_PARAM)
from trace_names import (PHASE_FINISH_BACKWARD, PHASE_OPTIMIZER, PHASE_POST_BACKWARD,  # the phases (phase.h)
                         PHASE_POST_FORWARD, PHASE_PRE_BACKWARD, PHASE_PRE_FORWARD, PHASE_RECOMPUTE_POST_FORWARD,
                         PHASE_RECOMPUTE_PRE_FORWARD)
from ..util import CheckFailed, fmt_bytes
from .common import Accum, note_where, notes_check
from .registry import SAYS_WHICH_BUFFER, SAYS_WHICH_HOOK, check


@check("freed_after_forward", label="params freed after forward", variants=True, tier=SAYS_WHICH_BUFFER)
def check_freed_after_forward(ctx):
    if ctx.flat():
        return _flat_params_freed(ctx, PHASE_POST_FORWARD)
    return notes_check(ctx, PHASE_POST_FORWARD, "unsharded_param_live_bytes", True, "unsharded params",
                        "reshard: dev_free every unsharded Param.data (and set it to NULL)")


@check("freed_after_backward", label="params freed after backward", variants=True, tier=SAYS_WHICH_BUFFER)
def check_freed_after_backward(ctx):
    if ctx.flat():
        return _flat_params_freed(ctx, PHASE_POST_BACKWARD, unless="reshard_after_backward")
    return notes_check(ctx, PHASE_POST_BACKWARD, "unsharded_param_live_bytes", True, "unsharded params",
                        "post_backward reshards after the reduce-scatter is queued", unless="reshard_after_backward")


@check("grads_freed", label="grads freed after reduce-scatter", variants=True, tier=SAYS_WHICH_BUFFER)
def check_grads_freed(ctx):
    if ctx.flat():
        return _flat_grads_freed(ctx)
    return notes_check(ctx, PHASE_POST_BACKWARD, "unsharded_grad_live_bytes", True, "unsharded grads",
                        "free each Param.grad once it is copied into the reduce-scatter input",
                        unless="requires_gradient_sync")


def _flat_params_freed(ctx, hook, unless=None):
    """Flat units (stage 13): a module's unsharded params are views into its unit's all-gather output, one buffer
    for all the unit's modules. It lives on after the hook of every module of the unit but the one that runs
    last (forward: the unit's last module; backward: its first) and is freed by that one's hook."""
    seen = 0
    for rank in range(ctx.world):
        for n in ctx.notes(rank):
            if n.get("hook") != hook or "unsharded_param_live_bytes" not in n:
                continue
            if unless and n.get(unless, 1) == 0:
                continue
            seen += 1
            label, mods, size = ctx.unit_of(n["module"])
            closing = mods[-1] if hook == PHASE_POST_FORWARD else mods[0]
            live = int(n["unsharded_param_live_bytes"])
            if n["module"] == closing and live:
                raise CheckFailed("%s's unsharded params still live after its %s (%s, %s): it is the last module of "
                                  "unit %s to run this pass, so the unit's flat buffer (W x S floats, the all-gather "
                                  "output Param.data are views into) goes: reshard there (the all-gather stream "
                                  "waits for compute's reads, then dev_free)"
                                  % (n["module"], hook, fmt_bytes(live), note_where(n, rank), "+".join(mods)))
            if n["module"] != closing and not live:
                raise CheckFailed("%s's unsharded params freed by its %s (%s) although %s, of the same flat unit, "
                                  "still runs this pass on the same buffer: with --bucket-mb a unit's flat buffer is "
                                  "resharded once, by the hook of the unit's module that runs last (%s)"
                                  % (n["module"], hook, note_where(n, rank), closing, closing))
    if not seen:
        raise CheckFailed("the memory snapshots hold no %s checks (memory_rank*.json)" % hook)
    return ""


def _flat_grads_freed(ctx):
    """Flat units (stage 13): the backward writes into views of the unit's flat gradient (W x S floats), which the
    reduce-scatter reads as is, so it lives on as the reduce-scatter input (stage 07's ReduceScatterState) until
    compute has waited for that reduce-scatter: freed at the latest by the next unit's reduce (its first module's
    post_backward) or by finish_backward. After a syncing post_backward the module's grads hold at most its unit's
    flat gradient; at the exit of a unit's reducing post_backward the unsharded grads are at most that flat gradient
    and the per-param grads kept (--grad-sync last) by the units whose backward has not begun; none after
    finish_backward."""
    a = Accum(ctx.flags, ctx)
    units = ctx.units()
    seen = 0
    for rank in range(ctx.world):
        for n in ctx.notes(rank):
            if n.get("hook") != PHASE_POST_BACKWARD or "unsharded_grad_live_bytes" not in n:
                continue
            if n.get("requires_gradient_sync", 1) == 0:
                continue
            seen += 1
            label, mods, size = ctx.unit_of(n["module"])
            live = int(n["unsharded_grad_live_bytes"])
            if live and live != size:
                raise CheckFailed("%s's unsharded grads hold %s after its post_backward (%s), not its flat unit %s's "
                                  "gradient of %s: the backward writes into views of the unit's flat gradient (W x S "
                                  "floats), the reduce-scatter's input as is; free each per-param Param.grad once it "
                                  "is copied into it" % (n["module"], fmt_bytes(live), note_where(n, rank), label,
                                                         fmt_bytes(size)))
        for (s, mod, hook, k), n in ctx.hook_memory(rank).items():
            if k >= 0 and not a.syncs(k):
                continue
            got = n["exit_by_tag"].get(TAG_UNSHARDED_GRAD, 0)
            where = "step %d%s, rank %d" % (s + 1, ", microbatch %d" % k if k >= 0 else "", rank)
            if hook == PHASE_FINISH_BACKWARD and got:
                raise CheckFailed("after finish_backward (%s) %s of unsharded grads still live: release the last "
                                  "reduce-scatter input (the flat gradient) once compute has waited for its "
                                  "reduce-scatter" % (where, fmt_bytes(got)))
            if hook != PHASE_POST_BACKWARD or not any(u[0] == mod for u in units):
                continue
            i = next(j for j, u in enumerate(units) if u[0] == mod)
            kept = 0 if k <= 0 or a.syncs(k - 1) else sum(a.unsharded[m] for u in units[:i] for m in u[1])
            if got > units[i][2] + kept:
                raise CheckFailed("after %s's post_backward (%s) %s of unsharded grads live, more than unit %s's flat "
                                  "gradient (%s, the reduce-scatter input)%s: the previous unit's flat gradient goes "
                                  "once compute has waited for its reduce-scatter, at the latest when the next unit "
                                  "reduces" % (mod, where, fmt_bytes(got), mod, fmt_bytes(units[i][2]),
                                               " and the per-param grads kept for the units still to run (%s)"
                                               % fmt_bytes(kept) if kept else ""))
    if not seen:
        raise CheckFailed("the memory snapshots hold no %s checks (memory_rank*.json)" % PHASE_POST_BACKWARD)
    return ""


# what usually keeps memory in a hook (by the hook's name), and the tags whose lifetimes the hooks own
HOOK_HINTS = {
    PHASE_POST_BACKWARD: ("free each Param.grad as soon as its copy into the reduce-scatter input is queued, and the "
                          "previous reduce-scatter input once compute has waited for its reduce-scatter"),
    PHASE_PRE_FORWARD: ("unshard this module and prefetch at most the next; release the all-gather state before "
                        "allocating the next all-gather output"),
    PHASE_POST_FORWARD: "reshard: free every unsharded Param.data",
    PHASE_FINISH_BACKWARD: "release the kept all-gather and reduce-scatter states",
    PHASE_OPTIMIZER: ("free each module's grad shards (zero_grad) right after its AdamW is queued, and the norm's "
                      "temporaries"),
}
HOOK_HINTS[PHASE_PRE_BACKWARD] = ("release the all-gather state the forward left at the top of fsdp_pre_backward (when "
                                  "this hook all-gathers nothing, as under ZeRO-2, nothing else drops it), unshard "
                                  "this module and prefetch at most the one before it")
HOOK_HINTS[PHASE_RECOMPUTE_PRE_FORWARD] = HOOK_HINTS[PHASE_PRE_FORWARD]
HOOK_HINTS[PHASE_RECOMPUTE_POST_FORWARD] = HOOK_HINTS[PHASE_POST_FORWARD]
LIFETIME_TAGS = (TAG_UNSHARDED_PARAM, TAG_UNSHARDED_GRAD, TAG_GRAD_SHARD, TAG_COMM_BUFFER, TAG_OPTIM_STATE)


def _live(by_tag):
    return ", ".join("%s %s" % (t, fmt_bytes(by_tag[t])) for t in LIFETIME_TAGS if by_tag.get(t)) or "none"


@check("hook_memory", label="memory inside hooks", variants=True, tier=SAYS_WHICH_HOOK)
def check_hook_memory(ctx):
    """Inside every hook and after it, memory as the reference's: the rise above the hook's entry to its
    high-water, and each lifetime tag still allocated at its exit (the step's peak may lie elsewhere)."""
    rel_slack, min_slack = ctx.tol["hook_memory_slack_rel"], ctx.tol["hook_memory_slack_min_bytes"]
    for r in range(ctx.world):
        mine, ref = ctx.hook_memory(r), ctx.hook_memory(r, reference=True)
        slack = max(rel_slack * max(n["high_water_bytes"] for n in ref.values()), min_slack)
        for key, want in ref.items():
            step, module, hook, micro = key
            where = "%s.%s (step %d%s, rank %d)" % (module, hook, step + 1,
                                                   ", microbatch %d" % micro if micro >= 0 else "", r)
            got = mine.get(key)
            if got is None:
                raise CheckFailed("no memory record of %s: did the run stop early?" % where)
            hint = HOOK_HINTS.get(hook, "free each buffer as soon as its last use is queued")
            rise, ref_rise = got["high_water_bytes"] - got["entry_bytes"], want["high_water_bytes"] - want["entry_bytes"]
            if rise - ref_rise > slack:
                raise CheckFailed("inside %s memory rose %s above the hook's entry, the reference's %s (+%s); live at "
                                  "its high-water: %s, the reference's: %s: %s" % (
                                      where, fmt_bytes(rise), fmt_bytes(ref_rise), fmt_bytes(rise - ref_rise),
                                      _live(got["high_water_by_tag"]), _live(want["high_water_by_tag"]), hint))
            for tag in LIFETIME_TAGS:
                extra = got["exit_by_tag"].get(tag, 0) - want["exit_by_tag"].get(tag, 0)
                if extra > slack:
                    raise CheckFailed("after %s %s %s is still allocated, the reference's %s: %s" % (
                        where, tag, fmt_bytes(got["exit_by_tag"].get(tag, 0)), fmt_bytes(want["exit_by_tag"].get(tag, 0)),
                        hint))
    return ""
