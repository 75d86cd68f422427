"""What the hooks free and keep (every stage): params freed after forward and backward, grads after the
reduce-scatter (the hook_check notes), and memory inside each hook against the reference's.
"""
from trace_names import (TAG_COMM_BUFFER, TAG_GRAD_SHARD, TAG_OPTIM_STATE,  # the memory tags (MemTag)
                         TAG_UNSHARDED_GRAD, TAG_UNSHARDED_PARAM)
from trace_names import (PHASE_FINISH_BACKWARD, PHASE_OPTIMIZER, PHASE_POST_BACKWARD,  # the phases (phase.h)
                         PHASE_POST_FORWARD, PHASE_PRE_BACKWARD, PHASE_PRE_FORWARD, PHASE_RECOMPUTE_POST_FORWARD,
                         PHASE_RECOMPUTE_PRE_FORWARD)
from ..util import CheckFailed, fmt_bytes
from .common import notes_check
from .registry import SAYS_WHICH_BUFFER, SAYS_WHICH_HOOK, check


@check("freed_after_forward", label="params freed after forward", variants=True, tier=SAYS_WHICH_BUFFER)
def check_freed_after_forward(ctx):
    return notes_check(ctx, PHASE_POST_FORWARD, "unsharded_param_live_bytes", True, "unsharded params",
                        "reshard: dev_free every unsharded Param.data (and set it to NULL)")


@check("freed_after_backward", label="params freed after backward", variants=True, tier=SAYS_WHICH_BUFFER)
def check_freed_after_backward(ctx):
    return notes_check(ctx, PHASE_POST_BACKWARD, "unsharded_param_live_bytes", True, "unsharded params",
                        "post_backward reshards after the reduce-scatter is queued", unless="reshard_after_backward")


@check("grads_freed", label="grads freed after reduce-scatter", variants=True, tier=SAYS_WHICH_BUFFER)
def check_grads_freed(ctx):
    return notes_check(ctx, PHASE_POST_BACKWARD, "unsharded_grad_live_bytes", True, "unsharded grads",
                        "free each Param.grad once it is copied into the reduce-scatter input",
                        unless="requires_gradient_sync")


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
