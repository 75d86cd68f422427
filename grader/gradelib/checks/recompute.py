"""Activation checkpointing (stage 05): two all-gathers per module and step (the recompute gathers nothing
again), and a peak below the same stage without --ac. Which blocks recompute (all with --ac and --ac-op, every
N-th with --ac-every N) is the runtime's rule: the check reads it from run.json's recompute_blocks.
"""
from trace_names import ALL_GATHER, label_and_kind

from ..util import CheckFailed, fmt_bytes, relpath
from .registry import SAYS_WHAT_RAN, SAYS_WHICH_BUFFER, check


def recompute_blocks(ctx):
    """The blocks that re-ran their forward, and its hooks, in backward: the runtime states them in run.json
    (model.h ac_block_recomputes, the rule the training loop follows)."""
    blocks = ctx.run_json().get("recompute_blocks")
    if not isinstance(blocks, list):
        raise CheckFailed("run.json states no recompute_blocks (a runtime older than the grader: make)")
    return blocks


@check("recompute", label="recompute all-gathers", variants=True, tier=SAYS_WHAT_RAN)
def check_recompute(ctx):
    order, _ = ctx.module_order()
    want = ctx.tol["recompute_all_gathers_per_module_step"]
    recomputing = recompute_blocks(ctx)
    said = ", ".join(recomputing) or "none"
    per = {}
    for r, e in ctx.collectives(ALL_GATHER):
        label, _ = label_and_kind(e["name"])
        per.setdefault((r, e["args"]["step"], label), []).append(e["args"].get("phase", "?"))
    if not per:
        raise CheckFailed("no all-gather in the trace")
    steps = sorted({s for (_, s, _) in per})
    unknown = sorted({l for (_, _, l) in per} - set(order))
    if unknown:
        raise CheckFailed("all-gathers labelled %s: label each with its module's name (coll_all_gather(..., mod->name))"
                          % ", ".join(unknown))
    for s in steps:
        for r in range(ctx.world):
            for mod in order:
                phases = per.get((r, s, mod), [])
                if len(phases) == want:
                    continue
                if mod in recomputing and len(phases) > want:
                    advice = ("does the recompute all-gather again? In PRE_BACKWARD the forward hooks "
                              "(called again by the recompute) must return at once")
                elif mod.startswith("block") and mod not in recomputing and ctx.run_json().get("ac") != "none":
                    advice = ("%s does not recompute (run.json recompute_blocks: %s): no forward hook runs in its "
                              "backward, so its fsdp_pre_backward alone unshards it, once" % (mod, said))
                else:
                    advice = "every module is unsharded once for the forward and once for the backward"
                raise CheckFailed("%s: %d all-gathers in step %d on rank %d (expected %d: forward and backward; "
                                  "issued in %s): %s" % (mod, len(phases), s + 1, r, want,
                                                         ", ".join(phases) or "none", advice))
    return ""


@check("activation_memory", label="activation memory", tier=SAYS_WHICH_BUFFER)
def check_activation_memory(ctx):
    spec = ctx.rubric["stages"][ctx.stage]["no_ac_reference"]
    flags = [f for f in ctx.flags if f not in spec["drop_flags"]]
    no_ac = ctx.peaks(ctx.reference_metrics(sub=spec["dir"], expect=flags))
    got = ctx.peaks(ctx.metrics())
    ratio = ctx.tol["activation_memory_max_ratio"]
    for r in range(ctx.world):
        if got[r] > ratio * no_ac[r]:
            raise CheckFailed("rank %d peak %s is not below %g x the peak without --ac (%s, %s): recompute should "
                              "save activation memory; is something kept alive through the recompute (a second "
                              "all-gather, params never resharded)?" % (r, fmt_bytes(got[r]), ratio,
                                                                       fmt_bytes(no_ac[r]),
                                                                       relpath(ctx.reference_dir(sub=spec["dir"]))))
    return "%.0f%% of the peak without --ac" % (100.0 * max(g / max(n, 1) for g, n in zip(got, no_ac)))
