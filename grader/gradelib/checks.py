"""The checks: one function per key of rubric.json's stages.NN.checks, declared with all the grader
knows of it: @check(key, label=..., variants=...) registers a Check in CHECKS.

A check takes the stage's Context and returns a detail line ("" or what it measured), or raises
CheckFailed with a one-line reason that says what is wrong and where to look. run_check runs one
and turns anything else it raises into a failed check that says so: grading never crashes.
The checks come in the order of the stage that first grades them (01 up); rubric.json gives the
points per stage and names checks by key, never by label.
"""
import math
import os

import manifest
from trace_names import (ALL_GATHER, ALL_REDUCE, BACKWARD_PHASES, COLLECTIVE, COMPUTE, COMPUTE_TID, COPY, D2H,
                         FORWARD_PHASES, H2D, HOOK_PHASES, HOST_SYNC, REDUCE_SCATTER, label_and_kind)
# the memory tags (MemTag)
from trace_names import (TAG_ACTIVATION, TAG_COMM_BUFFER, TAG_GRAD_SHARD, TAG_OPTIM_STATE, TAG_PARAM_SHARD,
                         TAG_UNSHARDED_GRAD, TAG_UNSHARDED_PARAM)

from .hints import grad_reduction_hint, grad_state_hint, norm_reduction_hint, norm_reduction_ok
from .util import (CheckFailed, chunk, fmt_bytes, is_finite, is_int, mesh_shape, mp_policy, one_line, padded_rows, rel,
                   relpath)

CHECKS = {}  # key -> Check, in the order defined here (a rubric naming an unknown key is told this list)


class Check:
    """One check: its function and what the rest of the grader reads of it.

    key       how rubric.json, results.json ("key") and tests/mutants/mutants.json name it
    label     the name the grader prints ("== stage 03 == <label>: OK"), results.json's "name"
    variants  True: a variant may list it: it reads one run against that run's own reference and baseline,
              or against the analytic model of the run's flags, so it holds at any world and flags (the
              others compare with the grading configuration's runs or with the stage's schedule);
              "every": a stage that grades it grades it on its main run and on every variant by itself
              (no variant lists it), the check deciding where it applies
    clock     True: it judges how long things took (the trace's ts and dur), which only the modelled clock
              makes a property of the program; grade.py --cuda leaves it out of the score (cli.GPU_CLOCK_NOT_GRADED).
              A check that reads only the order of events (ts as a sort key) is not a clock check.
    """

    def __init__(self, key, fn, label, variants, clock=False):
        self.key, self.fn, self.label, self.variants, self.clock = key, fn, label, variants, clock

    def __call__(self, ctx):
        return self.fn(ctx)


def check(key, *, label, variants=False, clock=False):
    """Register the decorated function as the check `key`, printed as `label` (students and the reference
    outputs see it: never change one lightly); clock=True if it judges durations (Check.clock)."""
    assert variants in (False, True, "every"), variants
    def register(fn):
        if key in CHECKS:
            raise ValueError("two checks named %s" % key)
        if label in (c.label for c in CHECKS.values()):
            raise ValueError("two checks labelled %s" % label)
        CHECKS[key] = Check(key, fn, label, variants, clock)
        return fn
    return register


def run_check(ctx, key):
    """(ok, reason, detail) of one check, reason and detail one printable line each."""
    try:
        return True, "", one_line(CHECKS[key](ctx) or "")
    except CheckFailed as e:
        return False, one_line(str(e)) or "failed", ""
    except Exception as e:  # a grader bug: a failed check that says so, not a crash (tests/test_grader_fuzz.py)
        return False, one_line("could not check (%s: %s)" % (type(e).__name__, e)), ""


def near(x, target, tol):
    return target > 0 and abs(x / target - 1) <= tol


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
            raise CheckFailed("step %d %s missing in the %s" % (step, label, "reference log" if r is None else "baseline run"))
        if g is None:
            if key not in got[i]:
                raise CheckFailed("step %d has no %s in metrics.jsonl" % (step, label))
            raise CheckFailed("step %d %s is not finite (null in metrics.jsonl)" % (step, label))
        if ctx.cuda:
            if rel(g, b) > tol_base:
                raise CheckFailed("step %d %s %.9g vs the non-sharded baseline on the same GPU %.9g (rel %.1e > %g): %s"
                                  % (step, label, g, b, rel(g, b), tol_base, hint(step, g, b)))
            continue
        ok_ref, ok_base, ref_vs_base = rel(g, r) <= tol_ref, rel(g, b) <= tol_base, rel(r, b) <= tol_base
        if ok_ref and ok_base:
            continue
        if not ref_vs_base:
            if ok_base:
                raise CheckFailed("step %d %s %.9g matches the non-sharded baseline (%.9g) but not the reference log "
                                  "(%.9g): the reference disagrees with the baseline, so %s is stale or corrupt "
                                  "(instructors: make reference)" % (step, label, g, b, r, ref_name))
            if ok_ref:
                raise CheckFailed("step %d %s %.9g matches the reference log but not the non-sharded baseline (%.9g, "
                                  "rel %.1e > %g): the reference disagrees with the baseline, and the baseline is the "
                                  "ground truth" % (step, label, g, b, rel(g, b), tol_base))
            raise CheckFailed("step %d %s %.9g vs non-sharded baseline %.9g (rel %.1e > %g; the reference log %.9g "
                              "disagrees with the baseline too): %s" % (step, label, g, b, rel(g, b), tol_base, r,
                                                                       hint(step, g, b)))
        if not ok_ref:
            raise CheckFailed("step %d %s %.9g vs reference %.9g (rel %.1e > %g): %s"
                              % (step, label, g, r, rel(g, r), tol_ref, hint(step, g, r)))
        raise CheckFailed("step %d %s %.9g vs non-sharded baseline %.9g (rel %.1e > %g; within the reference's "
                          "tolerance of the reference log %.9g): %s" % (step, label, g, b, rel(g, b), tol_base, r,
                                                                       hint(step, g, b)))
    return ""


@check("loss", label="loss parity", variants=True)
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


@check("grad_norm", label="grad norm parity", variants=True)
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


@check("clip", label="clip coefficient", variants=True)
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
    for i in range(ctx.steps):
        (lo, hi, n), (rlo, _, rn) = got[i], ref[i]
        want = rlo[0]
        for r in range(ctx.world):
            where = "step %d, rank %d" % (i + 1, r)
            if n[r] == -1:
                raise CheckFailed("%s: more AdamW launches than the probe records: one launch per parameter shard "
                                  "(the reference makes %d)" % (where, rn[r]))
            if n[r] != rn[r]:
                raise CheckFailed("%s: %d AdamW launches, the reference makes %d: launch_adamw once per parameter "
                                  "shard, every step" % (where, n[r], rn[r]))
            if n[r] == 0 or want is None:
                continue
            if lo[r] is None or hi[r] is None:
                raise CheckFailed("%s: no clip coefficient recorded" % where)
            if rel(hi[r], lo[r]) > tol:
                raise CheckFailed("%s: the AdamW launches applied clip coefficients from %.6g to %.6g: every launch "
                                  "of a step must read the same total_sumsq (fill it, all-reduce it, then launch)"
                                  % (where, lo[r], hi[r]))
            if rel(lo[r], want) > tol:
                # the grad norm's finding when the run's records show one (the same cause on both lines), else
                # the coefficient's own suspects
                hint = norm_cause(i) or (
                    "no clipping although the reference clips: is total_sumsq this rank's shards only, or zeroed "
                    "after the all-reduce?" if lo[r] >= 1.0 else
                    "clipped harder than the reference: is total_sumsq summed twice, or over the padding?"
                    if lo[r] < want else
                    "clipped less than the reference: total_sumsq must be the sum over every rank's shards "
                    "(all-reduce with RED_SUM) of the squared gradients")
                raise CheckFailed("%s: AdamW applied clip coefficient %.6g, the reference %.6g (max_norm %g / global "
                                  "grad norm): %s" % (where, lo[r], want, ctx.cfg.get("max_norm", 1.0), hint))
    return "coefficients %s" % ", ".join("%.3g" % got[i][0][0] for i in range(ctx.steps) if got[i][0][0] is not None)


@check("peak_memory", label="peak memory", variants=True)
def check_peak_memory(ctx):
    band = ctx.tol["peak_mem_band_rel"]
    got = ctx.peaks(ctx.metrics())
    ref = ctx.peaks(ctx.reference_metrics())
    for r in range(ctx.world):
        if rel(got[r], ref[r]) <= band:
            continue
        if ref[r] <= 0:
            raise CheckFailed("rank %d peak %s vs a reference peak of 0 bytes: the reference log %s is corrupt "
                              "(instructors: make reference)" % (r, fmt_bytes(got[r]),
                                                                 relpath(ctx.reference_dir())))
        where = ctx.where_peak(r)
        if got[r] > ref[r]:
            hint = ("more than the reference: something is freed late or never (unsharded params after forward or "
                    "backward, grads after the reduce-scatter, all-gather buffers, optimizer state)")
        else:
            hint = ("less than the reference: is a buffer the stage needs missing (prefetched params, "
                    "ZeRO-2's kept params) or freed while still in use?")
        raise CheckFailed("rank %d peak %s vs reference %s (%+.1f%%, band +-%g%%): %s%s"
                          % (r, fmt_bytes(got[r]), fmt_bytes(ref[r]), 100.0 * (got[r] - ref[r]) / ref[r],
                             100 * band, hint, ("; " + where) if where else ""))
    return ""


@check("dtensors", label="DTensors", variants=True)
def check_dtensors(ctx):
    W = ctx.world
    R, S = mesh_shape(ctx.flags, W)
    two_d = any(f.startswith("--mesh=") for f in ctx.flags)
    for rank in range(W):
        d = ctx.dtensors(rank)
        params = d.get("params", [])
        if not params:
            raise CheckFailed("dtensors_rank%d.json lists no params" % rank)
        k = rank % S  # this rank's place in its row (the shard group)
        for p in params:
            name, shape = p["name"], p["global_shape"]
            rows = shape[0]
            padded, start, local = chunk(rows, S, k)
            row_numel = math.prod(shape[1:]) if len(shape) > 1 else 1
            who = "rank %d: %s" % (rank, name)
            over = ("the %d ranks of its shard group (--mesh %d,%d: rank %d is shard %d of row %d)"
                    % (S, R, S, rank, k, rank // S) if two_d else
                    "the %d ranks of its pipeline stage (--pp %d: rank %d is shard %d of stage %d)"
                    % (S, W // S, rank, k, rank // S) if S != W else "the %d ranks" % W)
            if p["placement"] != "Shard(0)":
                raise CheckFailed("%s has placement %s, expected Shard(0): every param is sharded on dim 0"
                                  % (who, p["placement"]))
            if not p["mesh_is_world"] or p["mesh"] != list(range(W)):
                raise CheckFailed("%s's mesh is %s, expected the world %s: use FsdpConfig.mesh"
                                  % (who, p["mesh"], list(range(W))))
            if two_d and (p.get("mesh_shape") != [R, S] or p.get("placements") != ["Replicate()", "Shard(0)"]):
                raise CheckFailed("%s lies on a mesh of shape %s with placements %s, expected [%d, %d] with "
                                  "(Replicate(), Shard(0)): point DTensor.mesh at FsdpConfig.mesh"
                                  % (who, p.get("mesh_shape"), p.get("placements"), R, S))
            if p["global_rows"] != rows or p["row_numel"] != row_numel:
                raise CheckFailed("%s says global_rows %s x row_numel %s, the param is %s"
                                  % (who, p["global_rows"], p["row_numel"], "x".join(map(str, shape))))
            if p["padded_rows"] != padded:
                raise CheckFailed("%s padded_rows %s, expected ceil(%d / %d) = %d: the param is split over %s, every "
                                  "shard padded to the first chunk's size, as torch.chunk splits"
                                  % (who, p["padded_rows"], rows, S, padded, over))
            if p["local_rows"] != local:
                raise CheckFailed("%s local_rows %s, expected %d: torch.chunk gives chunk %d rows [%d*%d, min(%d, "
                                  "%d*%d)) of a split over %s" % (who, p["local_rows"], local, k, k, padded, rows,
                                                                   k + 1, padded, over))
            if local and p["row_offset"] != start:
                raise CheckFailed("%s row_offset %s, expected %d = chunk %d x %d padded rows: shard offsets follow "
                                  "torch.chunk over %s" % (who, p["row_offset"], start, k, padded, over))
            if not local and p["row_offset"] != rows:
                raise CheckFailed("%s row_offset %s, expected %d: this rank owns no rows (torch.chunk splits %d rows "
                                  "into chunks of %d over %s, and chunk %d is empty), so its empty range starts at "
                                  "the end, row_offset = global_rows (device.h, DTensor)"
                                  % (who, p["row_offset"], rows, rows, padded, over, k))
            start = min(start, rows)
            if not p["has_local"]:
                raise CheckFailed("%s has no local storage (DTensor.local is NULL)" % who)
            if p["local_in_allocation"] is False:
                raise CheckFailed("%s's local shard (DTensor.local, %d padded rows) is not inside one live allocation "
                                  "from dev_alloc: the runtime's kernels and copies cannot use malloc'd memory (on a "
                                  "GPU it is not device memory), nor one that runs past its buffer's end"
                                  % (who, p["padded_rows"]))
            if p["local_matches_init"] is not True:
                raise CheckFailed("%s's local shard does not hold rows [%d, %d) of the initial value: copy from "
                                  "row_offset x row_numel elements into Param.data, before freeing it"
                                  % (who, start, start + local))
            if p["padding_is_zero"] is not True:
                raise CheckFailed("%s's padding rows (%d..%d) are not zero: zero them (fresh memory is NaN-filled)"
                                  % (who, local, padded))
    return ""


def _where(n, rank):
    """'step 2, rank 1' of a hook_check note, with its microbatch when the run accumulates."""
    micro = n.get("microbatch")
    return "step %d%s, rank %d" % (n["step"] + 1, ", microbatch %d" % micro if is_int(micro) else "", rank)


def _notes_check(ctx, hook, field, want_zero, what, advice, unless=None):
    """Every hook_check note of `hook` has `field` zero (or nonzero); notes whose flag `unless` (set by the
    loop on the module, --grad-accum) is 0 are left to the accumulation checks."""
    seen = 0
    for rank in range(ctx.world):
        for n in ctx.notes(rank):
            if n.get("hook") != hook or field not in n:
                continue
            if unless and n.get(unless, 1) == 0:
                continue
            seen += 1
            live = int(n[field])
            if want_zero and live:
                raise CheckFailed("%s's %s still live after its %s (%s, %s): %s"
                                  % (n["module"], what, hook, fmt_bytes(live), _where(n, rank), advice))
            if not want_zero and not live:
                raise CheckFailed("%s's %s freed by its %s (%s): %s"
                                  % (n["module"], what, hook, _where(n, rank), advice))
    if not seen:
        raise CheckFailed("the memory snapshots hold no %s checks (memory_rank*.json)" % hook)
    return ""


@check("freed_after_forward", label="params freed after forward", variants=True)
def check_freed_after_forward(ctx):
    return _notes_check(ctx, "post_forward", "unsharded_param_live_bytes", True, "unsharded params",
                        "reshard: dev_free every unsharded Param.data (and set it to NULL)")


@check("freed_after_backward", label="params freed after backward", variants=True)
def check_freed_after_backward(ctx):
    return _notes_check(ctx, "post_backward", "unsharded_param_live_bytes", True, "unsharded params",
                        "post_backward reshards after the reduce-scatter is queued", unless="reshard_after_backward")


@check("grads_freed", label="grads freed after reduce-scatter", variants=True)
def check_grads_freed(ctx):
    return _notes_check(ctx, "post_backward", "unsharded_grad_live_bytes", True, "unsharded grads",
                        "free each Param.grad once it is copied into the reduce-scatter input",
                        unless="requires_gradient_sync")


# what usually keeps memory in a hook (by the hook's name), and the tags whose lifetimes the hooks own
HOOK_HINTS = {
    "post_backward": "free each Param.grad as soon as its copy into the reduce-scatter input is queued, and the "
                     "previous reduce-scatter input once compute has waited for its reduce-scatter",
    "pre_forward": "unshard this module and prefetch at most the next; release the all-gather state before "
                   "allocating the next all-gather output",
    "post_forward": "reshard: free every unsharded Param.data",
    "finish_backward": "release the kept all-gather and reduce-scatter states",
    "optimizer": "free each module's grad shards (zero_grad) right after its AdamW is queued, and the norm's "
                 "temporaries",
}
HOOK_HINTS["pre_backward"] = ("release the all-gather state the forward left at the top of fsdp_pre_backward (when this "
                              "hook all-gathers nothing, as under ZeRO-2, nothing else drops it), unshard this module "
                              "and prefetch at most the one before it")
HOOK_HINTS["recompute.pre_forward"] = HOOK_HINTS["pre_forward"]
HOOK_HINTS["recompute.post_forward"] = HOOK_HINTS["post_forward"]
LIFETIME_TAGS = (TAG_UNSHARDED_PARAM, TAG_UNSHARDED_GRAD, TAG_GRAD_SHARD, TAG_COMM_BUFFER, TAG_OPTIM_STATE)


def _live(by_tag):
    return ", ".join("%s %s" % (t, fmt_bytes(by_tag[t])) for t in LIFETIME_TAGS if by_tag.get(t)) or "none"


@check("hook_memory", label="memory inside hooks", variants=True)
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


@check("host_waits", label="no host wait in a hook", variants="every")
def check_host_waits(ctx):
    """No hook blocks the host: the trace's host track holds a host_sync slice for every host wait (0 long
    where it did not stall the host on the modelled clock, so a wait is seen whether or not it cost time,
    the same on every run). No stage's contract needs one inside a hook: whatever a hook queues, another
    stream can wait for with an event; the host waits only outside them (the optimizer step, to return the
    grad norm; the runtime, between steps). A host wait in a hook stalls the queueing of everything after
    it, which on a GPU leaves the device idle and on the modelled clock shows as lost overlap where the
    device is behind the host (stage 10's offload copies)."""
    for r in range(ctx.world):
        for e in ctx.trace(r):
            if e.get("cat") == HOST_SYNC and e["args"].get("phase") in HOOK_PHASES:
                raise CheckFailed("step %d, rank %d: the host blocked inside %s.%s (%s): make the stream that needs "
                                  "the result wait for an event (dev_stream_wait_event), not the host"
                                  % (e["args"].get("step", -1) + 1, r, e["args"].get("module"), e["args"]["phase"],
                                     e["name"]))
    return ""


def union_intervals(intervals):
    merged = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def covered(a, b, merged):
    """Length of [a, b) covered by the sorted disjoint intervals `merged`."""
    total = 0.0
    for x, y in merged:
        if y <= a:
            continue
        if x >= b:
            break
        total += min(y, b) - max(x, a)
    return total


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
        COLLECTIVE, ALL_GATHER, {"forward"}, "all-gather",
        "are the all-gathers on their own stream, the next module's issued (prefetched) before this one computes, "
        "with compute waiting on an event rather than the host?"),
    "rs_overlap": OverlapKind(
        COLLECTIVE, REDUCE_SCATTER, {"backward", "recompute"}, "reduce-scatter",
        "are the reduce-scatters on their own stream, so that module i's reduce-scatter runs while module i-1's "
        "backward computes?"),
    "ar_overlap": OverlapKind(
        COLLECTIVE, ALL_REDUCE, {"backward", "recompute"}, "replica all-reduce",
        "issue each module's all-reduce across the replicas in its post_backward, on the reduce-scatter's stream "
        "right after its reduce-scatter, so that it runs while the next module's backward computes (not all at "
        "the end of the backward, not on the compute stream)", modules=True),
    "h2d_overlap": OverlapKind(
        COPY, H2D, {"forward", "backward", "recompute"}, "host-to-device copy",
        "queue each host shard's copy to the device on the all-gather stream, before its all-gather, with no host "
        "wait in between, so that it runs while the previous module computes"),
    "d2h_overlap": OverlapKind(
        COPY, D2H, {"backward", "recompute"}, "device-to-host copy",
        "queue each reduce-scatter output's copy back to the host grad shards on the reduce-scatter stream and "
        "let the host go on (no dev_stream_synchronize / dev_event_synchronize in the hook)"),
}


class OverlapFigures:
    """What an overlap check reads of a run, at full precision (rubric.json's overlap_figures quotes them).

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
    order = set(ctx.module_order()[0]) if k.modules else None
    out = []
    for r in range(ctx.world):
        for e in ctx.trace(r):
            if e.get("cat") != k.cat or e.get("args", {}).get("step", -1) < 0:
                continue
            label, kind = label_and_kind(e["name"])
            if kind == k.kind and (order is None or label in order):
                out.append((r, e))
    return out


def overlap_figures(ctx, key):
    """OverlapFigures of the overlap check `key` (OVERLAP_CHECKS) on ctx's run, from the trace's ts and dur.

    On the CPU backends those are the modelled clock's (program order priced on the device profile), so
    the same program gives the same figures on every run, loaded machine or not; on the CUDA backend they
    are the GPU's."""
    k = OVERLAP_CHECKS[key]
    events = overlap_transfers(ctx, key)
    if not events:
        raise CheckFailed("no %s in the trace (trace_rank*.json)" % k.what)
    compute_total = compute_covered = comm_total = comm_covered = 0.0
    for r in range(ctx.world):
        trace = ctx.trace(r)
        kernels = [e for e in trace if e.get("cat") == COMPUTE and e.get("tid") == COMPUTE_TID]
        mine = [e for rr, e in events if rr == r]
        in_flight = union_intervals([(e["ts"], e["ts"] + e["dur"]) for e in mine])
        # a transfer on the compute stream runs between that stream's kernels, never beside them: left out of
        # what can cover them (the trace rounds ts and dur to the nanosecond each, so back-to-back slices of one
        # stream may touch by 1 ns)
        beside = union_intervals([(e["ts"], e["ts"] + e["dur"]) for e in mine if e.get("tid") != COMPUTE_TID])
        busy = union_intervals([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
        for e in kernels:
            if e.get("args", {}).get("phase") in k.phases:
                compute_total += e["dur"]
                compute_covered += covered(e["ts"], e["ts"] + e["dur"], beside)
        comm_total += sum(b - a for a, b in in_flight)
        comm_covered += sum(covered(a, b, busy) for a, b in beside)
    if compute_total <= 0:
        raise CheckFailed("no %s compute kernels in the trace" % "/".join(sorted(k.phases)))
    serial = [(r, e) for r, e in events if e.get("tid") == COMPUTE_TID]
    return OverlapFigures(compute_covered / compute_total, comm_covered / comm_total if comm_total > 0 else 0.0,
                          serial, len(serial) == len(events))


def solution_overlap(rubric, stage, variant, key):
    """The solution's graded figure of overlap check `key` on a run (rubric.json overlap_figures, at full
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
    from .rubric import stage_variants
    return [v for v in [None] + stage_variants(rubric, stage) if overlap_applies(rubric, stage, v, key)]


def overlap_bar(ctx, key):
    """(bar, what it is) of overlap check `key` on ctx's run: overlap_share_min of the solution's own figure on
    the same run (rubric.json overlap_figures), on the modelled clock. grade.py --cuda does not grade these
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
    schedule leaves beside compute (rubric.json's overlap_note gives every solution's figure and the
    serialized ones'). The clock is the modelled one, so the figure is one fixed number per program and a
    miss is the schedule's, never the machine's.

    The transfer side, the share of transfer time under compute, is printed but not graded: it says how much
    communication is hidden, which depends on the configuration as much as on the schedule, and it cannot
    separate more than the compute side does: a serialized schedule reads 0 on both.

    A run the check does not apply to (overlap_applies) passes with a line that says where it is graded."""
    k = OVERLAP_CHECKS[key]
    if not overlap_applies(ctx.rubric, ctx.stage, ctx.variant, key):
        from .rubric import variant_label  # rubric.py imports this module
        runs = [variant_label(ctx.rubric, v) for v in overlap_runs(ctx.rubric, ctx.stage, key)]
        if not runs:
            raise CheckFailed("grader/rubric.json's overlap_figures gives stage %s's solution no %s figure on any "
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
    where = "/".join(p for p in ("forward", "backward", "recompute") if p in k.phases)
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
        check(key, label=k.what + " overlap", variants="every", clock=True)(fn)


_register_overlap_checks()


def blocking_stage(rubric):
    """The stage the prefetch bound compares with: the first that trains (not --forward-only) with no
    prefetch, so that it unshards one module at a time; None if no stage does."""
    return next((s.id for s in manifest.stages(rubric) if not (s.prefetch or s.forward_only)), None)


@check("prefetch_bound", label="prefetch memory bound")
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


@check("schedule", label="prefetch schedule")
def check_schedule(ctx):
    """The stage's prefetch exists and is one module ahead (forward: module i's hooks issue module i+1's
    all-gather; backward: module i's issue module i-1's). With the host running ahead of the device, a
    missing prefetch still reads as overlap (rubric.json overlap_figures), so this check, not the overlap
    one, catches it (and host_waits a hook that blocks the host)."""
    stage = manifest.stage(ctx.stage, ctx.rubric)
    order, _ = ctx.module_order()
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
    for r in range(ctx.world):
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


@check("recompute", label="recompute all-gathers")
def check_recompute(ctx):
    order, _ = ctx.module_order()
    want = ctx.tol["recompute_all_gathers_per_module_step"]
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
                if len(phases) > want:
                    advice = ("does the recompute all-gather again? In PRE_BACKWARD the forward hooks "
                              "(called again by the recompute) must return at once")
                else:
                    advice = "every module is unsharded once for the forward and once for the backward"
                raise CheckFailed("%s: %d all-gathers in step %d on rank %d (expected %d: forward and backward; "
                                  "issued in %s): %s" % (mod, len(phases), s + 1, r, want,
                                                         ", ".join(phases) or "none", advice))
    return ""


@check("activation_memory", label="activation memory")
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


@check("zero2_no_backward_all_gather", label="no all-gather in backward", variants=True)
def check_zero2_no_backward_all_gather(ctx):
    bad = [(r, e) for r, e in ctx.collectives(ALL_GATHER) if e["args"].get("phase") in BACKWARD_PHASES]
    if bad:
        r, e = bad[0]
        raise CheckFailed("%d all-gathers in backward (first: %s in %s.%s, step %d, rank %d): with "
                          "reshard_after_forward = 0 post_forward keeps the params, so the backward needs none"
                          % (len(bad), e["name"], e["args"].get("module"), e["args"].get("phase"),
                             e["args"]["step"] + 1, r))
    return ""


@check("zero2_params_kept", label="reshard after forward follows the flag", variants=True)
def check_zero2_params_kept(ctx):
    """post_forward follows --reshard-after-forward: keeps the params with false, frees them with true."""
    if "--reshard-after-forward=false" in ctx.flags:
        return _notes_check(ctx, "post_forward", "unsharded_param_live_bytes", False, "unsharded params were",
                            "with --reshard-after-forward=false post_forward keeps the params for the backward")
    return _notes_check(ctx, "post_forward", "unsharded_param_live_bytes", True, "unsharded params",
                        "with --reshard-after-forward=true (FsdpConfig.reshard_after_forward = 1) post_forward "
                        "reshards, as in stage 05: is the flag read?")


# ------------------------------------------------------------------ gradient accumulation (stage 07)

class Accum:
    """What the grader asked a --grad-accum run for (the stage's flags), and the analytic model of what
    lives between microbatches: per module its unsharded bytes (params = grads) and its padded shard
    bytes on a rank, from the DTensor dumps."""

    def __init__(self, flags, ctx=None):
        flags = dict(f[2:].split("=", 1) if "=" in f else (f[2:], "true") for f in flags)
        self.K = int(flags.get("grad-accum", "1"))
        self.sync_every = flags.get("grad-sync", "every") == "every"
        self.rab = flags.get("reshard-after-backward", "true") == "true"
        self.raf = flags.get("reshard-after-forward", "true") == "true"
        self.ctx = ctx
        if ctx is not None:
            self.order, self.unsharded = ctx.module_order()

    def syncs(self, k):
        return self.sync_every or k == self.K - 1

    def reshards(self, k):
        return self.rab or k == self.K - 1

    def shard_bytes(self, rank, module):
        return sum(4 * p["padded_rows"] * p["row_numel"] for p in self.ctx.dtensors(rank)["params"]
                   if p["module"] == module)

    def describe(self):
        return "--grad-accum %d --grad-sync %s%s%s" % (self.K, "every" if self.sync_every else "last",
                                                       "" if self.rab else " --reshard-after-backward=false",
                                                       "" if self.raf else " --reshard-after-forward=false")


def _accum(ctx):
    a = Accum(ctx.flags, ctx)
    if a.K < 2:
        raise CheckFailed("this check needs a --grad-accum run (K >= 2); the stage's flags are %s"
                          % (" ".join(ctx.flags) or "none"))
    return a


@check("accum_collectives", label="collectives per microbatch", variants=True)
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
            if label not in a.unsharded:
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
    per_step = len(a.order) * sum(1 for k in range(a.K) if a.syncs(k))
    return "%d reduce-scatters per step (%s)" % (per_step, a.describe())


def _finish_notes(ctx, rank):
    """{(step, microbatch): hook_memory note} of finish_backward: what lives between microbatches."""
    return {(s, m): n for (s, mod, hook, m), n in ctx.hook_memory(rank).items() if hook == "finish_backward"}


@check("accum_grads", label="unsharded grads between microbatches", variants=True)
def check_accum_grads(ctx):
    """Without sync each module's post_backward keeps its whole unsharded grads (the next backward adds to them);
    with sync they are gone. Between microbatches (at finish_backward's exit) the unsharded grads are exactly
    the modules' that did not sync, and the grad shards those of the modules that did (analytic, from the
    DTensor geometry)."""
    a = _accum(ctx)
    for rank in range(ctx.world):
        seen = 0
        for n in ctx.notes(rank):
            if n.get("hook") != "post_backward" or "unsharded_grad_live_bytes" not in n or "microbatch" not in n:
                continue
            seen += 1
            live, want = int(n["unsharded_grad_live_bytes"]), a.unsharded[n["module"]]
            if n.get("requires_gradient_sync") == 0 and live != want:
                raise CheckFailed(
                    "%s's post_backward (%s, requires_gradient_sync 0) left %s of its %s of unsharded grads: %s"
                    % (n["module"], _where(n, rank), fmt_bytes(live), fmt_bytes(want),
                       "keep every Param.grad (do not free it): the loop adds the next microbatch's grads into it; "
                       "freed, this microbatch's gradient is lost" if live < want else
                       "keep Param.grad as it is, nothing more"))
        if not seen:
            raise CheckFailed("rank %d: no post_backward notes with a microbatch in memory_rank%d.json: was the run "
                              "made with --grad-accum?" % (rank, rank))
        total_unsharded = sum(a.unsharded.values())
        total_shards = sum(a.shard_bytes(rank, m) for m in a.order)
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


@check("accum_reshard", label="params between microbatches", variants=True)
def check_accum_reshard(ctx):
    """post_backward follows mod->reshard_after_backward: frees the params (1) or keeps them (0, so the next
    microbatch's forward needs no all-gather); between microbatches the unsharded params live are all the
    modules' or none."""
    a = _accum(ctx)
    total = sum(a.unsharded.values())
    for rank in range(ctx.world):
        for n in ctx.notes(rank):
            if n.get("hook") != "post_backward" or "unsharded_param_live_bytes" not in n or "microbatch" not in n:
                continue
            live, want = int(n["unsharded_param_live_bytes"]), a.unsharded[n["module"]]
            if n.get("reshard_after_backward") == 0 and live != want:
                raise CheckFailed("%s's post_backward (%s) freed its params although reshard_after_backward was 0: "
                                  "keep Param.data unsharded for the next microbatch's forward"
                                  % (n["module"], _where(n, rank)))
            if n.get("reshard_after_backward") == 1 and live:
                raise CheckFailed("%s's post_backward (%s) kept %s of unsharded params with reshard_after_backward "
                                  "1: reshard (free every Param.data) unless mod->reshard_after_backward is 0"
                                  % (n["module"], _where(n, rank), fmt_bytes(live)))
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


# ------------------------------------------------------------------ mixed precision (stage 08)

DTYPE_BYTES = {"fp32": 4, "bf16": 2}
TRACE_DTYPE = {"fp32": "f32", "bf16": "bf16"}  # the trace's args.dtype of a collective


MP_ADVICE = {
    (ALL_GATHER, "bf16"): "with --param-dtype bf16 cast each padded shard to bfloat16 on copy-in "
                            "(launch_cast_to_bf16 into this rank's segment) and all-gather the 16-bit words "
                            "(coll_all_gather_bf16)",
    (ALL_GATHER, "fp32"): "without --param-dtype bf16 the all-gather moves the float32 shards",
    (REDUCE_SCATTER, "fp32"): "--reduce-dtype fp32 is FSDP2's reduce_dtype=torch.float32: reduce-scatter the "
                                "float32 grads (coll_reduce_scatter); rounding them to bfloat16 first drops their "
                                "low bits before the sum",
    (REDUCE_SCATTER, "bf16"): "with --reduce-dtype bf16 cast the grads into a bfloat16 reduce-scatter input "
                                "(launch_cast_to_bf16), reduce-scatter the 16-bit words (coll_reduce_scatter_bf16) "
                                "and widen the result into the float32 grad shards",
}


@check("mp_bytes", label="bytes per element on the wire", variants=True)
def check_mp_bytes(ctx):
    """Every all-gather moves the param dtype's bytes per element, every reduce-scatter the reduce dtype's, over
    the module's padded flat size (analytic: its params' ceil(rows / W) x row_numel, times W), from the trace's
    bytes and dtype of each collective."""
    param_dtype, reduce_dtype = mp_policy(ctx.flags)
    W = ctx.world
    elems = {}
    for p in ctx.dtensors(0)["params"]:
        shape = p["global_shape"]
        elems[p["module"]] = elems.get(p["module"], 0) + padded_rows(shape[0], W) * math.prod(shape[1:]) * W
    for kind, dtype in ((ALL_GATHER, param_dtype), (REDUCE_SCATTER, reduce_dtype)):
        seen = set()
        for rank, e in ctx.collectives(kind):
            module, _ = label_and_kind(e["name"])
            if module not in elems:
                continue
            seen.add(module)
            n, got, got_dtype = elems[module], e["args"].get("bytes", 0), e["args"].get("dtype")
            if got == DTYPE_BYTES[dtype] * n and got_dtype in (None, TRACE_DTYPE[dtype]):
                continue
            raise CheckFailed("%s's %s (step %d, rank %d) moved %s for its %d padded elements: %.3g bytes each (%s), "
                              "the policy says %s, %d bytes each: %s" % (
                                  module, kind.replace("_", "-"), e["args"]["step"] + 1, rank, fmt_bytes(got), n,
                                  got / n, got_dtype or "?", dtype, DTYPE_BYTES[dtype], MP_ADVICE[(kind, dtype)]))
        missing = [m for m in elems if m not in seen]
        if missing:
            raise CheckFailed("the traces show no %s labelled %s: issue one per module per unshard / backward, "
                              "labelled with the module's name" % (kind.replace("_", "-"), ", ".join(missing[:3])))
    return "all-gathers %s (%d bytes/element), reduce-scatters %s (%d)" % (
        param_dtype, DTYPE_BYTES[param_dtype], reduce_dtype, DTYPE_BYTES[reduce_dtype])


@check("mp_params", label="unsharded params in bfloat16", variants=True)
def check_mp_params(ctx):
    """After every pre_forward / pre_backward the module's Param.data_bf16 live in allocations of exactly 2 bytes
    per element of its params (bfloat16, nothing more), and no float32 Param.data is kept beside them: the
    unsharded params take half the float32 memory (the hook_check notes of the params' allocations)."""
    if mp_policy(ctx.flags)[0] != "bf16":
        raise CheckFailed("this check needs a --param-dtype bf16 run; the stage's flags are %s"
                          % (" ".join(ctx.flags) or "none"))
    seen = 0
    for rank in range(ctx.world):
        for n in ctx.notes(rank):
            if "unsharded_param_bytes" not in n or "unsharded_param_elems" not in n:
                continue
            seen += 1
            got, elems, f32 = int(n["unsharded_param_bytes"]), int(n["unsharded_param_elems"]), int(n.get("unsharded_f32_bytes", 0))
            where = "after %s's %s (%s)" % (n["module"], n["hook"], _where(n, rank))
            if got != 2 * elems:
                raise CheckFailed("%s its Param.data_bf16 live in %s of allocations for %d elements (%.3g bytes each), "
                                  "expected 2 each: allocate each with dev_alloc_bf16(numel) (or one bfloat16 buffer "
                                  "holding exactly the module's params) and copy the rows out of the all-gather output"
                                  % (where, fmt_bytes(got), elems, got / max(elems, 1)))
            if f32:
                raise CheckFailed("%s a float32 Param.data (%s) is kept beside Param.data_bf16: with --param-dtype "
                                  "bf16 compute reads only the bfloat16 copy, so gather and keep nothing else"
                                  % (where, fmt_bytes(f32)))
    if not seen:
        raise CheckFailed("the memory snapshots hold no unsharded-param records (memory_rank*.json): did the run "
                          "stop before its first module?")
    return "unsharded params in bfloat16 (2 bytes/element) at every unshard"


def _groups(ctx):
    """{rank: (shard group name, replicate group name or None)} of the run's mesh, as the runtime names them."""
    R, S = mesh_shape(ctx.flags, ctx.world)
    if not any(f.startswith("--mesh=") for f in ctx.flags):
        return {r: ("world", None) for r in range(ctx.world)}
    return {r: ("shard%d" % (r // S), "replicate%d" % (r % S)) for r in range(ctx.world)}


@check("hsdp_collectives", label="collectives in their groups", variants=True)
def check_hsdp_collectives(ctx):
    """Per rank, step and module: the all-gathers and reduce-scatters run in the rank's shard group (its row of
    S ranks) and move the module's padded size split S ways; each reduce-scatter is followed by exactly one
    all-reduce of the module's grad shard in the rank's replicate group (its column), none without a mesh; the
    grad norm's all-reduce runs in the shard group. From the trace's group, bytes and order of every collective."""
    R, S = mesh_shape(ctx.flags, ctx.world)
    groups = _groups(ctx)
    order, _ = ctx.module_order()
    seg = {}  # module -> elements of one rank's padded segment
    for p in ctx.dtensors(0)["params"]:
        shape = p["global_shape"]
        seg[p["module"]] = seg.get(p["module"], 0) + padded_rows(shape[0], S) * math.prod(shape[1:])
    need_ar = groups[0][1] is not None
    for r in range(ctx.world):
        shard_g, rep_g = groups[r]
        colls = [e for e in ctx.trace(r) if e.get("cat") == COLLECTIVE]
        colls.sort(key=lambda e: e["ts"])
        pending = {}  # (step, module) -> reduce-scatters not yet all-reduced
        counts = {}
        for e in colls:
            label, kind = label_and_kind(e["name"])
            args = e["args"]
            group = args.get("group", "world")
            where = "%s's %s (step %d, rank %d)" % (label, kind.replace("_", "-"), args["step"] + 1, r)
            if label == "grad_norm":
                if group != shard_g:
                    raise CheckFailed("%s ran in %s, expected the shard group %s: the replicas hold the same grad "
                                      "shards, so summing the squares over %s counts %s"
                                      % (where, group, shard_g, group,
                                         "each shard %d times" % R if group == "world" else
                                         "this rank's own shard %d times and no other shard" % R
                                         if group == rep_g else "other ranks' squares than the %d shards of "
                                         "one replica" % S))
                continue
            if label not in seg:
                continue
            counts[(args["step"], label, kind)] = counts.get((args["step"], label, kind), 0) + 1
            if kind in (ALL_GATHER, REDUCE_SCATTER):
                if group != shard_g:
                    raise CheckFailed("%s ran in %s, expected this rank's shard group %s (the %d ranks its params "
                                      "are split over): issue it with pg_%s(mesh->shard_group, ...)"
                                      % (where, group, shard_g, S, kind))
                want = 4 * seg[label] * S
                if args.get("bytes") != want:
                    raise CheckFailed("%s moved %s, expected %s: %d ranks' segments of %d padded elements (each "
                                      "param's ceil(rows / %d) rows)" % (where, fmt_bytes(args.get("bytes", 0)),
                                                                          fmt_bytes(want), S, seg[label], S))
                if kind == REDUCE_SCATTER:
                    pending[(args["step"], label)] = pending.get((args["step"], label), 0) + 1
            elif kind == ALL_REDUCE:
                if not need_ar:
                    raise CheckFailed("%s: without --mesh there is no replicate group and no all-reduce of the "
                                      "grads (the reduce-scatter over the world already averaged them)" % where)
                if group != rep_g:
                    raise CheckFailed("%s ran in %s, expected this rank's replicate group %s (the %d ranks holding "
                                      "the same shard)" % (where, group, rep_g, R))
                if not pending.get((args["step"], label)):
                    raise CheckFailed("%s came before the module's reduce-scatter: all-reduce the reduce-scatter's "
                                      "output (the grad shard) across the replicas, after it" % where)
                pending[(args["step"], label)] -= 1
                if args.get("bytes") != 4 * seg[label]:
                    raise CheckFailed("%s moved %s, expected the grad shard's %s (%d elements): all-reduce the "
                                      "shard, not the unsharded grads" % (where, fmt_bytes(args.get("bytes", 0)),
                                                                          fmt_bytes(4 * seg[label]), seg[label]))
        steps = sorted({k[0] for k in counts})
        if not steps:
            raise CheckFailed("rank %d's trace holds no collectives of the modules" % r)
        for step in steps:
            for mod in order:
                rs, ar = counts.get((step, mod, REDUCE_SCATTER), 0), counts.get((step, mod, ALL_REDUCE), 0)
                if rs != 1:
                    raise CheckFailed("%s: %d reduce-scatters in step %d on rank %d, expected 1" % (mod, rs, step + 1, r))
                if need_ar and ar != 1:
                    raise CheckFailed("%s: %d all-reduces across replicas in step %d on rank %d, expected 1 after its "
                                      "reduce-scatter: without it each row trains on its own grads and the replicas "
                                      "drift apart" % (mod, ar, step + 1, r))
    return ("all-gathers and reduce-scatters in shard groups of %d%s" %
            (S, ", one all-reduce per module in replicate groups of %d" % R if need_ar else ", no all-reduce"))


def _two_sizes(a, b):
    """fmt_bytes of a and b, in exact bytes when they would print the same."""
    fa, fb = fmt_bytes(a), fmt_bytes(b)
    return ("%d bytes" % a, "%d bytes" % b) if fa == fb else (fa, fb)


@check("hsdp_memory", label="shards split over the shard group", variants=True)
def check_hsdp_memory(ctx):
    """After every hook the rank's param shards (tag param_shard) take exactly the model split S ways
    (sum over params of ceil(rows / S) x row_numel floats), and its optimizer state (tag optim_state), once
    created, two floats per element of its chunk of that split: 1/S of the model, not 1/W. The sizes come from
    the params' global shapes; the bytes from the hook_memory records of the snapshots."""
    R, S = mesh_shape(ctx.flags, ctx.world)
    shapes = [p["global_shape"] for p in ctx.dtensors(0)["params"]]
    shard_bytes = sum(4 * padded_rows(sh[0], S) * math.prod(sh[1:]) for sh in shapes)
    for r in range(ctx.world):
        k = r % S
        optim_bytes = sum(8 * chunk(sh[0], S, k)[2] * math.prod(sh[1:]) for sh in shapes)
        seen_optim = 0
        for (step, module, hook, micro), n in sorted(ctx.hook_memory(r).items(), key=lambda kv: kv[0][:3]):
            got = n["exit_by_tag"].get(TAG_PARAM_SHARD, 0)
            where = "after %s.%s (step %d, rank %d)" % (module, hook, step + 1, r)
            if got != shard_bytes:
                raise CheckFailed("%s the param shards take %s, expected %s: the model split over the %d ranks of the "
                                  "shard group (%s); split over %d ranks it would take %s" % (
                                      (where,) + _two_sizes(got, shard_bytes) + (S,) + (
                                      "--mesh %d,%d" % (R, S) if R > 1 or S != ctx.world else "the world",
                                      ctx.world, fmt_bytes(sum(4 * padded_rows(sh[0], ctx.world) * math.prod(sh[1:])
                                                               for sh in shapes)))))
            opt = n["exit_by_tag"].get(TAG_OPTIM_STATE, 0)
            if opt and opt != optim_bytes:
                raise CheckFailed("%s the optimizer state takes %s, expected %s: exp_avg and exp_avg_sq of this "
                                  "rank's rows (chunk %d of the split over %d ranks)"
                                  % ((where,) + _two_sizes(opt, optim_bytes) + (k, S)))
            seen_optim += bool(opt)
        if ctx.steps > 1 and not seen_optim:
            raise CheckFailed("rank %d never held optimizer state after a hook: is it created in the first "
                              "fsdp_optimizer_step?" % r)
    return "param shards %s per rank (1/%d of the model)" % (fmt_bytes(shard_bytes), S)


PREFETCH_ADVICE = {
    "pre": "issue module i-1's all-gather in module i's fsdp_pre_backward, right after waiting for module i's own",
    "post": "issue module i-1's all-gather in module i's fsdp_post_backward, after its reduce-scatter is issued",
    "none": "issue no all-gather ahead: each module's own fsdp_pre_backward issues (and waits for) its all-gather",
}


@check("prefetch_policy", label="backward prefetch follows the policy", variants=True)
def check_prefetch_policy(ctx):
    """Where every backward all-gather was issued (the trace's module and phase of the hook that queued it):
    module i-1's in module i's pre_backward (pre), in module i's post_backward (post), or in its own
    pre_backward (none); the first module of the backward always in its own pre_backward. With
    --single-comm-stream every all-gather and reduce-scatter of a rank runs on one stream."""
    policy = manifest.flag_value(ctx.flags, "--backward-prefetch", "pre")
    single = "--single-comm-stream" in ctx.flags
    zero2 = "--reshard-after-forward=false" in ctx.flags
    order, _ = ctx.module_order()
    last = len(order) - 1
    for r in range(ctx.world):
        issued = {}  # (step, module) -> [(issuing module, phase)]
        streams = set()
        for e in ctx.trace(r):
            if e.get("cat") != COLLECTIVE:
                continue
            label, kind = label_and_kind(e["name"])
            if kind in (ALL_GATHER, REDUCE_SCATTER):
                streams.add(e["tid"])
            args = e["args"]
            if kind != ALL_GATHER or label not in order or args.get("phase") not in BACKWARD_PHASES:
                continue
            issued.setdefault((args["step"], label), []).append((args.get("module", "?"), args.get("phase", "?")))
        if single and len(streams) > 1:
            raise CheckFailed("rank %d ran its all-gathers and reduce-scatters on %d streams: with "
                              "--single-comm-stream every collective goes on one (create one stream and use it for "
                              "both)" % (r, len(streams)))
        if not single and len(streams) < 2:
            raise CheckFailed("rank %d ran its all-gathers and reduce-scatters on one stream without "
                              "--single-comm-stream: give the reduce-scatters their own stream" % r)
        if zero2:  # the params kept from the forward: nothing to all-gather, under any policy
            if issued:
                (step, mod), got = sorted(issued.items())[0]
                raise CheckFailed("%s's backward all-gather (step %d, rank %d) was issued in %s's %s although "
                                  "--reshard-after-forward=false kept its params from the forward: with ZeRO-2 no "
                                  "policy all-gathers (or prefetches) in the backward; check that the module is "
                                  "resharded before issuing its all-gather" % (mod, step + 1, r, got[0][0], got[0][1]))
            continue
        steps = sorted({s for s, _ in issued})
        if not steps:
            raise CheckFailed("rank %d's trace holds no all-gather issued in a backward hook" % r)
        for step in steps:
            for i, mod in enumerate(order):
                got = issued.get((step, mod), [])
                if i == last or policy == "none":
                    want = (mod, "pre_backward")
                else:
                    want = (order[i + 1], "pre_backward" if policy == "pre" else "post_backward")
                if got != [want]:
                    where = ", ".join("%s's %s" % g for g in got) or "none"
                    raise CheckFailed("%s's backward all-gather (step %d, rank %d) was issued in %s, expected %s's %s "
                                      "(--backward-prefetch %s): %s" % (mod, step + 1, r, where, want[0], want[1],
                                                                        policy, PREFETCH_ADVICE[policy]))
    if zero2:
        return "no backward all-gather (ZeRO-2 kept the params)%s" % (" on one comm stream" if single else "")
    return "backward all-gathers issued as --backward-prefetch %s says%s" % (
        policy, " on one comm stream" if single else "")


@check("offload_memory", label="shards offloaded to host memory", variants=True)
def check_offload_memory(ctx):
    """After every hook: with --offload-params no param shard, grad shard or optimizer state is in device memory
    and the host pool holds the param shards at their analytic size (sum of ceil(rows / W) x row_numel floats)
    and the optimizer state, once created, at two floats per element of the rank's rows; without it nothing is
    in the host pool and the shards are on the device. From the snapshots' hook_memory records. With offload,
    the training steps' host-to-device and device-to-host copies run off the compute stream (the trace)."""
    offload = "--offload-params" in ctx.flags
    W = ctx.world
    shapes = [p["global_shape"] for p in ctx.dtensors(0)["params"]]
    shard_bytes = sum(4 * padded_rows(sh[0], W) * math.prod(sh[1:]) for sh in shapes)
    kept = (TAG_PARAM_SHARD, TAG_GRAD_SHARD, TAG_OPTIM_STATE)
    for r in range(W):
        optim_bytes = sum(8 * chunk(sh[0], W, r)[2] * math.prod(sh[1:]) for sh in shapes)
        seen_optim = 0
        for (step, module, hook, micro), n in sorted(ctx.hook_memory(r).items(), key=lambda kv: kv[0][:3]):
            where = "after %s.%s (step %d, rank %d)" % (module, hook, step + 1, r)
            dev, host = n["exit_by_tag"], n.get("host_exit_by_tag", {})
            if not isinstance(host, dict):
                raise CheckFailed("%s host_exit_by_tag is not an object" % where)
            if not offload:
                if any(host.values()):
                    raise CheckFailed("%s the host pool holds %s without --offload-params: keep everything on the "
                                      "device unless FsdpConfig.offload_params" % (
                                          where, ", ".join("%s %s" % (t, fmt_bytes(v)) for t, v in host.items() if v)))
                continue
            on_dev = [t for t in kept if dev.get(t, 0)]
            if on_dev:
                raise CheckFailed("%s %s still in device memory with --offload-params: %s; allocate the shards, grad "
                                  "shards and AdamW state with dev_alloc_host" % (
                                      where, ", ".join("%s %s" % (t, fmt_bytes(dev[t])) for t in on_dev),
                                      "the reduce-scatter's device output must go back to the host grad shards" if
                                      TAG_GRAD_SHARD in on_dev else "the host pool holds them"))
            got = host.get(TAG_PARAM_SHARD, 0)
            if got != shard_bytes:
                raise CheckFailed("%s the host param shards take %s, expected %s (every param's ceil(rows / %d) padded "
                                  "rows)" % ((where,) + _two_sizes(got, shard_bytes) + (W,)))
            opt = host.get(TAG_OPTIM_STATE, 0)
            if opt and opt != optim_bytes:
                raise CheckFailed("%s the host optimizer state takes %s, expected %s (exp_avg and exp_avg_sq of this "
                                  "rank's rows)" % ((where,) + _two_sizes(opt, optim_bytes)))
            seen_optim += bool(opt)
        if offload and ctx.steps > 1 and not seen_optim:
            raise CheckFailed("rank %d never held optimizer state in host memory after a hook: with --offload-params "
                              "create exp_avg / exp_avg_sq with dev_alloc_host" % r)
        if offload:  # the copies off the compute stream, so they overlap compute (structure, not a clock)
            names = {}
            copies = {H2D: 0, D2H: 0}
            for e in ctx.trace(r):
                if e.get("ph") == "X" and e.get("cat") == COPY and e["args"].get("step", -1) >= 0:
                    _, kind = label_and_kind(e["name"])
                    if kind in copies:
                        copies[kind] += 1
                        if e["tid"] == COMPUTE_TID:
                            names.setdefault(kind, e)
            for kind, what in ((H2D, "the copy-in of a host shard (host to device) goes on the all-gather stream, "
                                       "before the all-gather"),
                               (D2H, "the reduce-scatter's output goes back to the host on the reduce-scatter "
                                       "stream")):
                if not copies[kind]:
                    raise CheckFailed("rank %d's trace shows no %s copy during training with --offload-params: %s"
                                      % (r, kind, what))
                if kind in names:
                    e = names[kind]
                    raise CheckFailed("%s (step %d, rank %d) ran on the compute stream, where it delays compute "
                                      "instead of overlapping it: %s" % (e["name"], e["args"]["step"] + 1, r, what))
    return ("shards %s per rank in host memory, none on the device" % fmt_bytes(shard_bytes) if offload
            else "nothing in host memory without --offload-params")


# ------------------------------------------------------------------ pipeline parallelism (stages 11, 12)

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
        M = self.M
        if (schedule or self.schedule) == "gpipe":
            return [("F", m) for m in range(M)] + [("B", m) for m in range(M)]
        w = min(self.P - 1 - stage, M)
        out = [("F", m) for m in range(w)]
        for k in range(M - w):
            out += [("F", w + k), ("B", k)]
        return out + [("B", m) for m in range(M - w, M)]

    def held(self, order):
        """The most microbatches whose forward ran and backward not yet, along `order`."""
        n = best = 0
        for what, _ in order:
            n += 1 if what == "F" else -1
            best = max(best, n)
        return best

    def ideal_bubble(self):
        return (self.P - 1) / (self.M + self.P - 1)


PASS_PHASES = {"forward": "F", "backward": "B"}


def _ran(trace, step):
    """[('F', mb) / ('B', mb)]: the forwards and backwards whose compute ran in `step`, in modelled-time order
    (consecutive kernels of one microbatch's pass collapsed)."""
    out = []
    for e in sorted((e for e in trace if e.get("cat") == COMPUTE and e["args"].get("step") == step
                     and e["args"].get("phase") in PASS_PHASES and is_int(e["args"].get("microbatch"))),
                    key=lambda e: e["ts"]):
        token = (PASS_PHASES[e["args"]["phase"]], e["args"]["microbatch"])
        if not out or out[-1] != token:
            out.append(token)
    return out


def _spell(order, limit=24):
    text = " ".join("%s%d" % t for t in order[:limit])
    return text + (" ..." if len(order) > limit else "")


def _profiled_steps(ctx):
    """The training steps rank 0's trace holds (not the end's teardown, filed under step = steps)."""
    steps = sorted({e["args"]["step"] for e in ctx.trace(0) if is_int(e["args"].get("step"))
                    and 0 <= e["args"]["step"] < ctx.steps})
    if not steps:
        raise CheckFailed("rank 0's trace has no step: was the run profiled (--profile-steps)?")
    return steps


@check("pp_schedule", label="pipeline schedule order", variants=True)
def check_pp_schedule(ctx):
    """Per rank and step, the forwards and backwards of the microbatches as the trace shows them ran, against
    the schedule's definition (GPipe: all forwards, then all backwards; 1F1B: P-1-p warm-up forwards on stage p,
    then one forward one backward, then the cool-down)."""
    pl = Pipeline(ctx.flags, ctx.world)
    for step in _profiled_steps(ctx):
        for r in range(ctx.world):
            p = pl.stage(r)
            ran, want = _ran(ctx.trace(r), step), pl.order(p)
            if ran == want:
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


def pipeline_bubble(traces, step, world):
    """(mean idle share of the ranks' compute, the window) over one step on the modelled clock: the window runs
    from the step's first forward kernel on any rank to its last backward kernel; each rank's busy time is the
    union of its forward, backward and recompute kernels inside it."""
    spans = {}
    lo, hi = None, None
    for r in range(world):
        iv = [(e["ts"], e["ts"] + e["dur"]) for e in traces.get(r, []) if e.get("cat") == COMPUTE
              and e["args"].get("step") == step and e["args"].get("phase") in ("forward", "backward", "recompute")]
        spans[r] = union_intervals(iv)
        for a, b in spans[r]:
            lo = a if lo is None or a < lo else lo
            hi = b if hi is None or b > hi else hi
    if lo is None or hi <= lo:
        return None, 0.0
    idle = [1.0 - sum(b - a for a, b in spans[r]) / (hi - lo) for r in range(world)]
    return sum(idle) / world, hi - lo


@check("pp_bubble", label="pipeline bubble", variants=True, clock=True)
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
        worst = got if worst is None or got > worst else worst
    return "bubble %.1f%% (ideal (P-1)/(M+P-1) = %.1f%%)" % (100 * worst, 100 * pl.ideal_bubble())


def activation_peaks(events, steps):
    """{step: (peak live bytes tagged activation, live at the step's start, live at its end)} of the training
    steps 0 .. steps-1, from a snapshot."""
    live, cur, out = {}, 0, {}
    for e in events:
        addr, step = e.get("addr"), e.get("step")
        if not is_int(addr) or not is_int(step) or not 0 <= step < steps:
            if e.get("action") == "alloc" and e.get("tag") == TAG_ACTIVATION and is_int(addr) and is_int(e.get("size")):
                live[addr] = e["size"]
                cur += e["size"]
            elif e.get("action") in ("free", "free_completed") and addr in live:
                cur -= live.pop(addr)
            continue
        if step not in out:
            out[step] = [cur, cur, cur]
        if e.get("action") == "alloc" and e.get("tag") == TAG_ACTIVATION and is_int(e.get("size")):
            live[addr] = e["size"]
            cur += e["size"]
        elif e.get("action") in ("free", "free_completed") and addr in live:
            cur -= live.pop(addr)
        else:
            continue
        out[step][0] = max(out[step][0], cur)
        out[step][2] = cur
    return out


@check("pp_activations", label="activations a stage holds", variants=True)
def check_pp_activations(ctx):
    """How many microbatches' activations each rank holds at once (the trace's order: forwards run, backwards
    not yet) against the schedule's (GPipe: all M; 1F1B: min(P - p, M) on stage p), and its peak of live
    activation bytes against the reference's."""
    pl = Pipeline(ctx.flags, ctx.world)
    band = ctx.tol["peak_mem_band_rel"]
    steps = _profiled_steps(ctx)
    for r in range(ctx.world):
        p = pl.stage(r)
        want = pl.held(pl.order(p))
        for step in steps:
            got = pl.held(_ran(ctx.trace(r), step))
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
        "1F1B" if pl.schedule == "1f1b" else "GPipe", pl.held(pl.order(0)), pl.M)


@check("pp_frees", label="activations freed each step", variants=True)
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


@check("pp_collectives", label="collectives per microbatch in a pipeline", variants=True)
def check_pp_collectives(ctx):
    """Per rank, step and module: one reduce-scatter, in the stage's last backward (only it syncs); all-gathers
    as FSDP2's state implies over the order the passes ran in (expected_all_gathers): one per step with
    --reshard-after-forward=false (the params stay unsharded from the first forward to the last backward)."""
    pl = Pipeline(ctx.flags, ctx.world)
    seen = {}
    for kind in (ALL_GATHER, REDUCE_SCATTER):
        for r, e in ctx.collectives(kind):
            label, _ = label_and_kind(e["name"])
            seen.setdefault((r, e["args"].get("step"), label, kind), []).append(e["args"].get("microbatch"))
    ags = set()
    for step in _profiled_steps(ctx):
        for r in range(ctx.world):
            order = _ran(ctx.trace(r), step)
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
