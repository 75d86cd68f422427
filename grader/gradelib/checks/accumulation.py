"""Gradient accumulation (stage 07): the collectives of each microbatch and what lives between microbatches,
against the analytic model of the run's flags (Accum).
"""
from trace_names import ALL_GATHER, REDUCE_SCATTER, label_and_kind
from trace_names import PHASE_FINISH_BACKWARD, PHASE_POST_BACKWARD  # the phases (runtime/phase.h)
from trace_names import TAG_GRAD_SHARD, TAG_UNSHARDED_GRAD, TAG_UNSHARDED_PARAM  # the memory tags (MemTag)

from ..util import CheckFailed, fmt_bytes, is_int
from .common import Accum, note_where
from .registry import SAYS_WHAT_RAN, SAYS_WHICH_BUFFER, check


def _accum(ctx):
    a = Accum(ctx.flags, ctx)
    if a.K < 2:
        raise CheckFailed("this check needs a --grad-accum run (K >= 2); the stage's flags are %s"
                          % (" ".join(ctx.flags) or "none"))
    return a


@check("accum_collectives", label="collectives per microbatch", variants=True, tier=SAYS_WHAT_RAN)
def check_accum_collectives(ctx):
    """Per rank, step, microbatch and module: reduce-scatters where the module syncs, none elsewhere; all-gathers
    as the reshard flags imply (the forward's unless the params were kept from the previous backward, the
    backward's unless ZeRO-2 kept them from the forward)."""
    a = _accum(ctx)
    seen = {}  # (rank, step, microbatch, module, kind) -> [phases]
    for kind in (ALL_GATHER, REDUCE_SCATTER):
        for r, e in ctx.collectives(kind):
            args = e["args"]
            label, _ = label_and_kind(e["name"])
            if label not in a.unsharded:  # grad_norm's all-reduce, a pipeline's p2p
                continue
            if not is_int(args.get("microbatch")):
                raise CheckFailed("%s %s (step %d, rank %d) has no microbatch in the trace: were the collectives "
                                  "issued from the hooks of a --grad-accum run?" % (label, kind.replace("_", "-"),
                                                                                   args["step"] + 1, r))
            seen.setdefault((r, args["step"], args["microbatch"], label, kind), []).append(args.get("phase", "?"))
    steps = sorted({k[1] for k in seen})
    if not steps:
        raise CheckFailed("no collectives of the modules in the trace")
    for s in steps:
        for r in range(ctx.world):
            for k in range(a.K):
                for mod in a.order:
                    rs = seen.get((r, s, k, mod, REDUCE_SCATTER), [])
                    where = "step %d, microbatch %d of %d, rank %d" % (s + 1, k, a.K, r)
                    if a.flat and not any(u[0] == mod for u in a.units):  # a flat unit's later module: none
                        extra = rs + seen.get((r, s, k, mod, ALL_GATHER), [])
                        if extra:
                            unit = next(u for u in a.units if mod in u[1])
                            raise CheckFailed("%s: %d collectives labelled %s in %s (issued in %s), expected none: it "
                                              "belongs to flat unit %s, whose all-gathers and reduce-scatters are "
                                              "the unit's, one each, labelled with its first module %s"
                                              % (mod, len(extra), mod, where, ", ".join(extra), "+".join(unit[1]),
                                                 unit[0]))
                        continue
                    if a.syncs(k) and len(rs) != 1:
                        raise CheckFailed(
                            "%s: %d reduce-scatters in %s, expected 1 (requires_gradient_sync was 1): %s"
                            % (mod, len(rs), where, "a syncing microbatch reduce-scatters each module's grads once, in "
                               "its post_backward" if not rs else "reduce each module's grads once"))
                    if not a.syncs(k) and rs:
                        raise CheckFailed(
                            "%s: %d reduce-scatter%s in %s although requires_gradient_sync was 0 (%s): with "
                            "mod->requires_gradient_sync == 0 post_backward keeps Param.grad and reduces nothing; "
                            "only the last microbatch reduce-scatters the accumulated grads"
                            % (mod, len(rs), "s" if len(rs) > 1 else "", where, a.describe()))
                    ag = seen.get((r, s, k, mod, ALL_GATHER), [])
                    kept = k > 0 and not a.reshards(k - 1)
                    fwd = 0 if kept else 1
                    bwd = 1 if a.raf else 0
                    if len(ag) != fwd + bwd:
                        why = []
                        why.append("the forward's %s" % ("none: the params were kept unsharded from microbatch %d's "
                                                        "backward (reshard_after_backward 0)" % (k - 1) if kept
                                                        else "one"))
                        why.append("the backward's %s" % ("one: post_forward resharded" if a.raf else
                                                          "none: ZeRO-2 kept them from the forward"))
                        raise CheckFailed("%s: %d all-gathers in %s (issued in %s), expected %d: %s"
                                          % (mod, len(ag), where, ", ".join(ag) or "none", fwd + bwd, "; ".join(why)))
    per_step = len(a.units) * sum(1 for k in range(a.K) if a.syncs(k))
    return "%d reduce-scatters per step (%s)" % (per_step, a.describe())


def _finish_notes(ctx, rank):
    """{(step, microbatch): hook_memory note} of finish_backward: what lives between microbatches."""
    return {(s, m): n for (s, mod, hook, m), n in ctx.hook_memory(rank).items() if hook == PHASE_FINISH_BACKWARD}


@check("accum_grads", label="unsharded grads between microbatches", variants=True, tier=SAYS_WHICH_BUFFER)
def check_accum_grads(ctx):
    """Without sync each module's post_backward keeps its whole unsharded grads (the next backward adds to them);
    with sync they are gone. Between microbatches (at finish_backward's exit) the unsharded grads are exactly
    the modules' that did not sync, and the grad shards those of the modules that did (analytic, from the
    DTensor geometry)."""
    a = _accum(ctx)
    for rank in range(ctx.world):
        seen = 0
        for n in ctx.notes(rank):
            if n.get("hook") != PHASE_POST_BACKWARD or "unsharded_grad_live_bytes" not in n or "microbatch" not in n:
                continue
            seen += 1
            live, want = int(n["unsharded_grad_live_bytes"]), a.unsharded[n["module"]]
            if n.get("requires_gradient_sync") == 0 and live != want:
                raise CheckFailed(
                    "%s's post_backward (%s, requires_gradient_sync 0) left %s of its %s of unsharded grads: %s"
                    % (n["module"], note_where(n, rank), fmt_bytes(live), fmt_bytes(want),
                       "keep every Param.grad (do not free it): the loop adds the next microbatch's grads into it; "
                       "freed, this microbatch's gradient is lost" if live < want else
                       "keep Param.grad as it is, nothing more"))
        if not seen:
            raise CheckFailed("rank %d: no post_backward notes with a microbatch in memory_rank%d.json: was the run "
                              "made with --grad-accum?" % (rank, rank))
        total_unsharded = sum(a.unsharded.values())
        total_shards = a.total_shard_bytes(rank)
        for (s, k), n in sorted(_finish_notes(ctx, rank).items()):
            if k < 0 or k == a.K - 1:
                continue
            got_g = n["exit_by_tag"].get(TAG_UNSHARDED_GRAD, 0)
            got_s = n["exit_by_tag"].get(TAG_GRAD_SHARD, 0)
            want_g = 0 if a.syncs(k) else total_unsharded
            want_s = total_shards if a.syncs(k) else 0
            where = "after microbatch %d's backward (step %d, rank %d; %s)" % (k, s + 1, rank, a.describe())
            if got_g != want_g:
                raise CheckFailed("%s %s of unsharded grads live, the model says %s (%s): %s"
                                  % (where, fmt_bytes(got_g), fmt_bytes(want_g),
                                     "every module's, kept to accumulate into" if want_g else "none: each was "
                                     "reduce-scattered", "keep Param.grad only while requires_gradient_sync is 0, "
                                     "free it once it is copied into the reduce-scatter input"))
            if got_s != want_s:
                raise CheckFailed("%s %s of grad shards live, the model says %s (%s): %s"
                                  % (where, fmt_bytes(got_s), fmt_bytes(want_s),
                                     "one set per module, accumulated into by the later microbatches" if want_s
                                     else "none until the last microbatch reduce-scatters",
                                     "a later microbatch's reduce-scatter adds into the existing grad shards "
                                     "(launch_add), it does not allocate new ones" if got_s > want_s else
                                     "keep the grad shards until the optimizer step"))
    return "between microbatches: %s unsharded grads, %s grad shards per rank" % (
        "all" if not a.sync_every else "no", "all" if a.sync_every else "no")


@check("accum_reshard", label="params between microbatches", variants=True, tier=SAYS_WHAT_RAN)
def check_accum_reshard(ctx):
    """post_backward follows mod->reshard_after_backward: frees the params (1) or keeps them (0, so the next
    microbatch's forward needs no all-gather); between microbatches the unsharded params live are all the
    modules' or none."""
    a = _accum(ctx)
    total = a.total_unsharded()
    for rank in range(ctx.world):
        for n in ctx.notes(rank):
            if n.get("hook") != PHASE_POST_BACKWARD or "unsharded_param_live_bytes" not in n or "microbatch" not in n:
                continue
            live, want = int(n["unsharded_param_live_bytes"]), a.unsharded[n["module"]]
            if a.flat:  # views into the unit's flat buffer: kept unless the unit's last backward module reshards it
                unit = next(u for u in a.units if n["module"] in u[1])
                if n.get("reshard_after_backward") == 1 and n["module"] != unit[0]:
                    continue  # the unit's other modules keep it for the unit's rest (freed_after_backward's rule)
                want = unit[2]
            if n.get("reshard_after_backward") == 0 and live != want:
                raise CheckFailed("%s's post_backward (%s) freed its params although reshard_after_backward was 0: "
                                  "keep Param.data unsharded for the next microbatch's forward"
                                  % (n["module"], note_where(n, rank)))
            if n.get("reshard_after_backward") == 1 and live:
                raise CheckFailed("%s's post_backward (%s) kept %s of unsharded params with reshard_after_backward "
                                  "1: reshard (free every Param.data) unless mod->reshard_after_backward is 0"
                                  % (n["module"], note_where(n, rank), fmt_bytes(live)))
        for (s, k), n in sorted(_finish_notes(ctx, rank).items()):
            if k < 0:
                continue
            got = n["exit_by_tag"].get(TAG_UNSHARDED_PARAM, 0)
            want = 0 if a.reshards(k) else total
            if got != want:
                raise CheckFailed("after microbatch %d's backward (step %d, rank %d; %s) %s of unsharded params live, "
                                  "the model says %s: %s" % (
                                      k, s + 1, rank, a.describe(), fmt_bytes(got), fmt_bytes(want),
                                      "with reshard_after_backward 0 every module stays unsharded until the next "
                                      "microbatch" if want else "every module reshards in its post_backward"))
    return "params %s between microbatches" % ("resharded" if a.rab else "kept unsharded")
