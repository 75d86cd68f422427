"""Parity (every stage): the loss and the grad norm step by step against the reference log and the non-sharded
baseline, each within its measured tolerance, and the clip coefficient every AdamW launch applied; a wrong
value's hint reads the run's own evidence first (hints.py), then the ratio's usual suspects.
"""
import math
import os

import manifest
from trace_names import ALL_REDUCE, label_and_kind

from ..hints import grad_reduction_hint, grad_state_hint, norm_reduction_hint, norm_reduction_ok
from ..util import CheckFailed, is_finite, is_int, mesh_shape, rel, relpath
from .common import Accum, near
from .registry import SAYS_THAT_IT_DIFFERS, SAYS_WHICH_NUMBER, check


def series_check(ctx, key, label, hint):
    """Step-by-step comparison of metrics[key] with the reference log and the baseline run, each within its own
    tolerance (Context.parity_tol: from the spread measured between correct implementations)."""
    tol_ref, tol_base = ctx.parity_tol(key)
    got = ctx.metrics()
    ref = ctx.reference_metrics()
    base = ctx.baseline_metrics()
    ref_name = relpath(os.path.join(ctx.reference_dir(), "metrics.jsonl"))
    for i in range(ctx.steps):
        step = i + 1
        g, r, b = got[i].get(key), ref[i].get(key), base[i].get(key)
        if r is None or b is None:
            raise CheckFailed("step %d %s missing in the %s" % (step, label, "reference log" if r is None else
                                                                "baseline run"), step=step)
        if g is None:
            if key not in got[i]:
                raise CheckFailed("step %d has no %s in metrics.jsonl" % (step, label), step=step)
            raise CheckFailed("step %d %s is not finite (null in metrics.jsonl)" % (step, label), step=step)
        if ctx.cuda:
            if rel(g, b) > tol_base:
                raise CheckFailed("step %d %s %.9g vs the non-sharded baseline on the same GPU %.9g (rel %.1e > %g): %s"
                                  % (step, label, g, b, rel(g, b), tol_base, hint(step, g, b)), step=step)
            continue
        ok_ref, ok_base, ref_vs_base = rel(g, r) <= tol_ref, rel(g, b) <= tol_base, rel(r, b) <= tol_base
        if ok_ref and ok_base:
            continue
        if not ref_vs_base:
            if ok_base:
                raise CheckFailed("step %d %s %.9g matches the non-sharded baseline (%.9g) but not the reference log "
                                  "(%.9g): the reference disagrees with the baseline, so %s is stale or corrupt "
                                  "(instructors: make reference)" % (step, label, g, b, r, ref_name), step=step)
            if ok_ref:
                raise CheckFailed("step %d %s %.9g matches the reference log but not the non-sharded baseline (%.9g, "
                                  "rel %.1e > %g): the reference disagrees with the baseline, and the baseline is the "
                                  "ground truth" % (step, label, g, b, rel(g, b), tol_base), step=step)
            raise CheckFailed("step %d %s %.9g vs non-sharded baseline %.9g (rel %.1e > %g; the reference log %.9g "
                              "disagrees with the baseline too): %s" % (step, label, g, b, rel(g, b), tol_base, r,
                                                                       hint(step, g, b)), step=step)
        if not ok_ref:
            raise CheckFailed("step %d %s %.9g vs reference %.9g (rel %.1e > %g): %s"
                              % (step, label, g, r, rel(g, r), tol_ref, hint(step, g, r)), step=step)
        raise CheckFailed("step %d %s %.9g vs non-sharded baseline %.9g (rel %.1e > %g; within the reference's "
                          "tolerance of the reference log %.9g): %s" % (step, label, g, b, rel(g, b), tol_base, r,
                                                                       hint(step, g, b)), step=step)
    return ""


@check("loss", label="loss parity", variants=True, tier=SAYS_THAT_IT_DIFFERS)
def check_loss(ctx):
    def hint(step, g, r):
        if step == 1:
            return ("wrong already at step 1, before any update: the forward is wrong (shard row offsets, padding, "
                    "the all-gather's copy-out layout)")
        if ctx.forward_only:
            return ("right at step 1, wrong from step %d although --forward-only never changes the weights: state "
                    "carried between steps (a buffer read before it is written? a missing wait?)" % step)
        return ("right at step 1, wrong from step %d: the forward is right and the update is not (backward unshard, "
                "reduce-scatter layout or average, grad norm and clipping, AdamW on the local rows, the next "
                "all-gather reading the updated shards)" % step)
    return series_check(ctx, "loss", "loss", hint)


def mesh_grad_norm_hint(ratio, R, S, norm_group_right=False):
    """The grad norm's hint on an R x S mesh (HSDP), or "" when the ratio is none of the mesh's factors: the
    fallback when the evidence (hints.py: the norm's and the grads' reductions in the trace) says nothing;
    norm_group_right: the trace shows the norm's all-reduce in the shard group, so sqrt(R) is not its doing.

    The grads are averaged twice (reduce-scatter over the S ranks of the row, all-reduce over the R
    replicas of the column) and the norm's sum of squares is all-reduced over the row only: a SUM in
    place of either average leaves a factor S or R, a norm summed over the whole world sqrt(R)."""
    sums = [what for what, n in (("the all-reduce across the %d replicas (replicate group)" % R, R),
                                 ("the reduce-scatter inside the %d-rank shard group" % S, S)) if n > 1 and near(ratio, n, 0.1)]
    if sums:
        return ("%.2f times too large: %s must average (RED_AVG), not sum; the two averages together are the mean "
                "over all %d ranks' data" % (ratio, " or ".join(sums), R * S))
    if near(ratio, math.sqrt(R), 0.05) and not norm_group_right:
        return ("%.2f times too large, about sqrt(R) = %.2f: each shard is held by the R = %d replicas, so the norm's "
                "sum of squares must be all-reduced in the shard group only, not over the world"
                % (ratio, math.sqrt(R), R))
    return ""


def _loss_differs(ctx, step):
    """'(loss 6.12 vs 6.11)' when the run's loss of `step` already differs from the reference's (the baseline's
    on a GPU), else ''."""
    try:
        got = ctx.metrics()[step - 1].get("loss")
        want = (ctx.baseline_metrics() if ctx.cuda else ctx.reference_metrics())[step - 1].get("loss")
    except (CheckFailed, IndexError):
        return ""
    if not (is_finite(got) and is_finite(want)) or rel(got, want) <= ctx.parity_tol("loss")[1 if ctx.cuda else 0]:
        return ""
    return "loss %.6g vs %.6g" % (got, want)


def _grads_evidence(ctx, step, ratio, K, lead=True):
    """What the run's own records (hints.py) show wrong with the grad norm of `step` (1-based): the norm's
    all-reduce in the trace, (--grad-accum) the gradient state between microbatches in the snapshots, the grads'
    reductions in the trace; "" when they show nothing. lead False: without the ratio the sentence opens with."""
    return (norm_reduction_hint(ctx, step, ratio, lead) or (grad_state_hint(ctx, step, K) if K > 1 else "") or
            grad_reduction_hint(ctx, step, ratio, lead))


@check("grad_norm", label="grad norm parity", variants=True, tier=SAYS_WHICH_NUMBER)
def check_grad_norm(ctx):
    W = ctx.world
    K = Accum(ctx.flags).K
    R, S = mesh_shape(ctx.flags, W)

    def hint(step, g, r):
        ratio = g / r if r else float("inf")
        # the evidence first (hints.py): the norm's all-reduce in the trace, (--grad-accum) the gradient state
        # between microbatches in the snapshots, the grads' reductions in the trace; the ratio's suspects after
        said = _grads_evidence(ctx, step, ratio, K)
        if said:
            return said
        norm_right = norm_reduction_ok(ctx, step) is True  # the trace shows the norm's all-reduce right
        P = int(manifest.flag_value(ctx.flags, "--pp", "0"))
        if P > 1 and ratio < 1:
            groups = {e["args"].get("group", "world") for r, e in ctx.collectives(ALL_REDUCE)
                      if label_and_kind(e["name"])[0] == "grad_norm"}
            if groups and "world" not in groups:
                return ("%.2f times the reference, and the norm's all-reduce runs in %s only: a pipeline stage holds "
                        "only its own modules, so the global norm sums the squares over every rank (every stage's "
                        "shards), not over the stage's shard group" % (ratio, ", ".join(sorted(groups))))
            return ("%.2f times the reference: does the norm span every pipeline stage (the sum of squares "
                    "all-reduced over every rank, not one stage's)?" % ratio)
        if K > 1 and any(near(ratio, j / K, 0.15) for j in range(1, K)):
            return ("%.2f times the reference, about a part of the %d microbatches: does every microbatch's gradient "
                    "reach the optimizer? Without sync keep Param.grad for the next backward to add to; with sync add "
                    "each reduce-scatter into the grad shards (launch_add)" % (ratio, K))
        if R > 1:  # HSDP: the two reductions and the norm's group each leave their own factor
            hint_2d = mesh_grad_norm_hint(ratio, R, S, norm_group_right=norm_right)
            if hint_2d:
                return hint_2d
        if near(ratio, W, 0.1):
            return "%.2f times too large, about W = %d: are you averaging the reduce-scatter over %d ranks (RED_AVG, not RED_SUM)?" % (ratio, W, W)
        if near(ratio, 1.0 / W, 0.1):
            return "%.2f times the reference, about 1/W: is the average applied twice?" % ratio
        if not norm_right and near(ratio, math.sqrt(W), 0.15):
            return "%.2f times too large, about sqrt(W): is the norm's all-reduce a SUM of the squares, taken once?" % ratio
        if not norm_right and 0.5 / math.sqrt(S) < ratio < 0.85:
            return ("%.2f times the reference (about 1/sqrt(%s) = %.2f is one rank's share): is the sum of squares "
                    "all-reduced over the %s before the square root?"
                    % (ratio, "S" if R > 1 else "W", 1 / math.sqrt(S), "shard group" if R > 1 else "ranks"))
        loss = _loss_differs(ctx, step)
        if loss:
            return ("the loss of step %d differs as well (%s): the params this backward ran on, or its forward, are "
                    "already wrong (see loss parity first)" % (step, loss))
        if step == 1:
            return ("wrong at step 1 with the loss right: the backward side is wrong (chunk-cat layout of the "
                    "reduce-scatter input, the average, the norm over your local rows only, not the padding)")
        return ("right until step %d: the previous update went wrong (optimizer on the local rows, clipping, "
                "grads of the previous step freed and not reused)" % (step - 1))
    return series_check(ctx, "grad_norm", "grad_norm", hint)


def _clip_lists(rows, world, where):
    """Per step: the lists (min, max, launches) of the clip probe, checked."""
    out = []
    for i, row in enumerate(rows):
        lists = [row.get(k) for k in ("clip_coef_min_per_rank", "clip_coef_max_per_rank", "adamw_launches_per_rank")]
        ok = all(isinstance(v, list) and len(v) == world for v in lists)
        ok = ok and all(v is None or is_finite(v) for v in lists[0] + lists[1])
        ok = ok and all(is_int(v) and -1 <= v < 2 ** 31 for v in lists[2])
        if not ok:
            raise CheckFailed("%s line %d has no clip probe lists for %d ranks (clip_coef_min_per_rank, "
                              "clip_coef_max_per_rank, adamw_launches_per_rank)" % (where, i + 1, world))
        out.append(lists)
    return out


@check("clip", label="clip coefficient", variants=True, tier=SAYS_WHICH_NUMBER)
def check_clip(ctx):
    """Every AdamW launch of a step applied the reference's clip coefficient, on every rank, within the grad norm's
    tolerance against the reference (the coefficient is max_norm over the norm: it moves as much as the norm)."""
    tol = ctx.parity_tol("grad_norm")[0]
    got = _clip_lists(ctx.metrics(), ctx.world, "metrics.jsonl")
    ref = _clip_lists(ctx.reference_metrics(), ctx.world, relpath(os.path.join(ctx.reference_dir(), "metrics.jsonl")))

    def norm_cause(i):
        """The grad norm check's finding at step i + 1, when the logged norm is off too and the run's records say
        why (one cause for both lines): 'it divided by a grad norm 4.00 times the reference's, ...'; else ""."""
        g, r = ctx.metrics()[i].get("grad_norm"), ctx.reference_metrics()[i].get("grad_norm")
        if not (is_finite(g) and is_finite(r)) or r <= 0 or rel(g, r) <= tol:
            return ""
        said = _grads_evidence(ctx, i + 1, g / r, Accum(ctx.flags).K, lead=False)
        return ("it divided by a grad norm %.2f times the reference's, for the cause grad norm parity names: %s"
                % (g / r, said)) if said else ""
    stages = int(manifest.flag_value(ctx.flags, "--pp", "1"))
    stage_note = " (with --pp %d: every pipeline stage's, each holding other modules)" % stages if stages > 1 else ""
    for i in range(ctx.steps):
        (lo, hi, n), (rlo, _, rn) = got[i], ref[i]
        want = rlo[0]
        for r in range(ctx.world):
            where = "step %d, rank %d" % (i + 1, r)
            if n[r] == -1:
                raise CheckFailed("%s: more AdamW launches than the probe records: one launch per parameter shard "
                                  "(the reference makes %d)" % (where, rn[r]), step=i + 1)
            if n[r] != rn[r]:
                raise CheckFailed("%s: %d AdamW launches, the reference makes %d: launch_adamw once per parameter "
                                  "shard, every step" % (where, n[r], rn[r]), step=i + 1)
            if n[r] == 0 or want is None:
                continue
            if lo[r] is None or hi[r] is None:
                raise CheckFailed("%s: no clip coefficient recorded" % where, step=i + 1)
            if rel(hi[r], lo[r]) > tol:
                raise CheckFailed("%s: the AdamW launches applied clip coefficients from %.6g to %.6g: every launch "
                                  "of a step must read the same total_sumsq (fill it, all-reduce it, then launch)"
                                  % (where, lo[r], hi[r]), step=i + 1)
            if rel(lo[r], want) > tol:
                # the grad norm's finding when the run's records show one (the same cause on both lines), else
                # the coefficient's own suspects
                hint = norm_cause(i) or (
                    "no clipping although the reference clips: is total_sumsq this rank's shards only%s, or zeroed "
                    "after the all-reduce?" % stage_note if lo[r] >= 1.0 else
                    "clipped harder than the reference: is total_sumsq summed twice, or over the padding?"
                    if lo[r] < want else
                    "clipped less than the reference: total_sumsq must be the sum over every rank's shards%s "
                    "(all-reduce with RED_SUM) of the squared gradients" % stage_note)
                raise CheckFailed("%s: AdamW applied clip coefficient %.6g, the reference %.6g (max_norm %g / global "
                                  "grad norm): %s" % (where, lo[r], want, ctx.cfg.get("max_norm", 1.0), hint),
                                  step=i + 1)
    return "coefficients %s" % ", ".join("%.3g" % got[i][0][0] for i in range(ctx.steps) if got[i][0][0] is not None)
