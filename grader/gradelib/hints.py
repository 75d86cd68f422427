"""The grad norm's hints, derived from the evidence a run leaves rather than guessed from the norm's ratio:

  norm_reduction_hint  the trace: which group(s) the all-reduce of the norm's sum of squares ran in, with which
                       op, and what that makes of each rank's sum (every shard counted m times, or each rank
                       its own shard only, ranks disagreeing)
  grad_state_hint      the memory snapshots' "grad_state" notes (--grad-accum, probes.h): the gradient state
                       after each microbatch against the reference's, the first (step, microbatch, rank) that
                       differs and by what factor, and, between two microbatches that hold the same kind of
                       state, how much of it is what the earlier microbatches left and how much the new one

  grad_reduction_hint  the trace: a reduction of the grads that sums instead of averaging (the factor is its
                       group's size), or a 2-D mesh's all-reduce across the replicas missing

Each returns "" when its evidence is missing or cannot tell (an older reference, a trace that does not cover
the step, a malformed file: the loaders in context.py say CheckFailed, caught here): the check then falls
back to the ratio-based hints of checks/parity.py. A hint only decorates a failed check's message.
"""
import math
from fractions import Fraction

import manifest

from trace_names import ALL_REDUCE, BACKWARD_PHASES, COLLECTIVE, REDUCE_SCATTER, label_and_kind
from trace_names import PHASE_OPTIMIZER  # the phases (runtime/phase.h)

from .util import CheckFailed, is_finite, mesh_shape, rel


# ------------------------------------------------------------------ the norm's all-reduce (the trace)

def _mesh_groups(ctx):
    """(R, S, two_d, {group name: world ranks}) of the run's mesh: R x S from its flags, the groups as run.json
    states the runtime made them (the world; with --mesh, shard<i> and replicate<j>)."""
    R, S = mesh_shape(ctx.flags, ctx.world)
    two_d = any(f.startswith("--mesh=") for f in ctx.flags)
    try:
        groups = ctx.groups()
    except CheckFailed:  # a hint says nothing rather than fail on what run.json lacks
        groups = {}
    return R, S, two_d, groups


def _norm_all_reduces(ctx, step):
    """{rank: [(group, op)]} of the all-reduces of the norm's sum of squares in `step` (1-based), in issue
    order: those of fsdp_optimizer_step (phase optimizer) labelled grad_norm or moving one or two floats. None
    when a rank's trace holds no collective of the step (not traced), or another all-reduce in the optimizer
    that may be part of the norm."""
    out = {}
    for r in range(ctx.world):
        seen, found = False, []
        for e in ctx.trace(r):
            args = e.get("args", {})
            if e.get("cat") != COLLECTIVE or args.get("step") != step - 1:
                continue
            seen = True
            label, kind = label_and_kind(e["name"])
            if kind != ALL_REDUCE or args.get("phase") != PHASE_OPTIMIZER:
                continue
            if label != "grad_norm" and args.get("bytes", 0) > 8:
                return None
            found.append((e["ts"], args.get("group", "world"), args.get("op", "sum")))
        if not seen:
            return None
        out[r] = [(g, op) for _, g, op in sorted(found, key=lambda t: t[0])]
    return out


def _pieces(ctx, groups):
    """[the piece of the model's params rank r holds, for each r]: ranks holding the same grads share a piece (the
    replicas of a 2-D mesh: one replicate group), every other rank holds a piece of its own (a shard of its own
    pipeline stage's modules, or of the whole model's). The global norm counts every piece once."""
    piece = []
    for r in range(ctx.world):
        g = ctx.group_of(r, "replicate")
        piece.append(min(groups[g]) if g in groups else r)
    return piece


def _norm_coefficients(ctx, step):
    """(all-reduces per rank, coefficients per rank): what each rank's sum of squares counts of each piece's
    squares (_pieces: a shard, the same on its replicas), after the all-reduces the trace shows, as Fractions
    {piece: count}; right is 1 for every piece on every rank. None if the trace cannot tell (a group the runtime
    does not name, ranks of a group that disagree on it)."""
    _, _, _, groups = _mesh_groups(ctx)
    ars = _norm_all_reduces(ctx, step)
    if ars is None or len({len(a) for a in ars.values()}) != 1:
        return None
    W = ctx.world
    piece = _pieces(ctx, groups)
    pieces = sorted(set(piece))
    coef = [{j: Fraction(int(j == piece[r])) for j in pieces} for r in range(W)]
    for t in range(len(ars[0])):
        new = []
        for r in range(W):
            g, op = ars[r][t]
            members = groups.get(g)
            if members is None or r not in members or op not in ("sum", "avg") or \
                    any(ars[m][t] != (g, op) for m in members):
                return None
            total = {j: sum((coef[m][j] for m in members), Fraction(0)) for j in pieces}
            new.append({j: c / len(members) for j, c in total.items()} if op == "avg" else total)
        coef = new
    return ars, coef


def _times(x):
    """A Fraction as a count: '2 times', 'once', 'only 1/2'."""
    if x == 1:
        return "once"
    return "%s times" % x if x.denominator == 1 else "only %s" % x


def _disagreement(ctx, step):
    """'the ranks disagree (their clip coefficients: 0.515 on ranks 0, 2; 0.62 on ranks 1, 3)' when the ranks
    clipped `step` with different coefficients (metrics.jsonl's clip probe), else what the sums imply."""
    coefs = None
    try:
        coefs = ctx.metrics()[step - 1].get("clip_coef_min_per_rank")
    except (CheckFailed, IndexError):
        pass
    by = {}
    if isinstance(coefs, list) and len(coefs) == ctx.world and all(is_finite(c) for c in coefs):
        for r, c in enumerate(coefs):
            by.setdefault("%.3g" % c, []).append(r)
    if len(by) < 2:
        return "the ranks' norms depend on their shard"
    return "the ranks disagree (their clip coefficients: %s)" % "; ".join(
        "%s on rank%s %s" % (c, "s" if len(rs) > 1 else "", ", ".join(map(str, rs))) for c, rs in by.items())


def norm_reduction_ok(ctx, step):
    """True when the trace shows the norm's sum of squares all-reduced right in `step` (every rank's sum counts
    every shard once), False when it shows otherwise, None when it cannot tell."""
    try:
        got = _norm_coefficients(ctx, step)
    except CheckFailed:
        return None
    return None if got is None else all(c == 1 for row in got[1] for c in row.values())


def norm_reduction_hint(ctx, step, ratio, lead=True):
    """What the trace shows of the norm's all-reduce in `step` when it is not one RED_SUM over the shard group
    (the world without a mesh), and what that does to the norm; "" when it is, or the trace cannot tell. lead
    False: without the ratio the sentence opens with ("2.00 times the reference"), for a line that gives it."""
    try:
        got = _norm_coefficients(ctx, step)
    except CheckFailed:
        return ""
    if got is None:
        return ""
    ars, coef = got
    R, S, two_d, groups = _mesh_groups(ctx)
    if all(c == 1 for row in coef for c in row.values()):
        return ""
    stages = int(manifest.flag_value(ctx.flags, "--pp", "1"))
    want = ("one all-reduce (RED_SUM) in the shard group %s (mesh->shard_group, its S = %d ranks: the shards "
            "of one replica)" % (ctx.group_of(0, "shard"), S) if two_d else
            "one all-reduce (RED_SUM) over all %d ranks: each of the %d pipeline stages holds its own modules' "
            "shards, and the norm is the whole model's" % (ctx.world, stages) if stages > 1 else
            "one all-reduce (RED_SUM) over the %d ranks" % ctx.world)
    if not ars[0]:
        return ("%sthe trace shows no all-reduce of the norm's sum of squares in step %d's fsdp_optimizer_step: each "
                "rank's norm is its own shard's only; the sum of squares must be all-reduced before the square "
                "root: %s" % ("%.2f times the reference, and " % ratio if lead else "", step, want))
    ran = ", then ".join("%s (%d rank%s, %s)" % (g, len(groups[g]), "s" if len(groups[g]) > 1 else "", op)
                         for g, op in ars[0])
    head = "%son rank 0 the norm's all-reduce ran in %s" % ("%.2f times the reference: " % ratio if lead else "", ran)
    flat = {c for row in coef for c in row.values()}
    if len(flat) == 1:  # every rank counts every piece alike
        m = flat.pop()
        return ("%s: every shard's squares count %s in the sum, so the norm comes out sqrt(%s) = %.2f times the "
                "reference's; expected %s" % (head, _times(m), m, math.sqrt(m), want))
    stage = ctx.group_of(0, "stage")
    mine = set(groups.get(stage, ())) if stage in groups else set()
    counted = {j for j, c in coef[0].items() if c}
    if stages > 1 and mine and counted == {_pieces(ctx, groups)[r] for r in mine} and \
            all(coef[0][j] == 1 for j in counted):
        return ("%s: rank 0's sum holds the squares of its own pipeline stage's shards (%s) and nothing of the "
                "other %d stage%s' modules, so its norm is one stage's, and %s; expected %s"
                % (head, stage, stages - 1, "s" if stages > 2 else "", _disagreement(ctx, step), want))
    own = coef[0][_pieces(ctx, groups)[0]]
    others = sorted({c for j, c in coef[0].items() if j != _pieces(ctx, groups)[0]})
    if others == [0] and own > 0:
        n = len(coef[0]) - 1
        what = ("each rank sums %s and nothing of the other %d shard%s: each rank's norm is its own shard's%s, and "
                "%s"
                % ("%s copies of its own shard's squares" % own if own.denominator == 1 and own > 1 else
                   "its own shard's squares %s" % _times(own), n, "s" if n > 1 else "",
                   "" if own == 1 else " times sqrt(%s)" % own, _disagreement(ctx, step)))
    else:
        what = ("rank 0's sum counts its own shard's squares %s%s: %s"
                % (_times(own), "".join(" and the others' %s" % ", ".join(_times(o) for o in others)
                                        for _ in others[:1]), _disagreement(ctx, step)))
    if two_d and len(ars[0]) == 1 and ctx.group_kind(ars[0][0][0]) == "replicate":
        what = "the ranks of a replicate group hold the same shard, so " + what
    return "%s: %s; expected %s" % (head, what, want)


# ------------------------------------------------------------------ the grads' reductions (the trace)

def _grad_reductions(ctx, step):
    """{rank: {module: [(kind, group, op)]}} of the reduce-scatters and all-reduces of the modules' grads in
    `step`'s backward, in issue order; None when a rank's trace holds no collective of the step."""
    order, _ = ctx.module_order()
    out = {}
    for r in range(ctx.world):
        colls = [e for e in ctx.trace(r) if e.get("cat") == COLLECTIVE and e.get("args", {}).get("step") == step - 1]
        if not colls:
            return None
        per = {}
        for e in sorted(colls, key=lambda e: e["ts"]):
            label, kind = label_and_kind(e["name"])
            args = e.get("args", {})
            if label in order and kind in (REDUCE_SCATTER, ALL_REDUCE) and args.get("phase") in BACKWARD_PHASES:
                per.setdefault(label, []).append((kind, args.get("group", "world"), args.get("op", "sum")))
        out[r] = per
    return out


def grad_reduction_hint(ctx, step, ratio, lead=True):
    """What the trace shows wrong in the reductions of the grads of `step` on rank 0: one that sums (the grads
    come out its group's size times the mean), or, on a 2-D mesh, no all-reduce across the replicas; "" when
    neither, or the trace cannot tell. lead False: without the ratio the sentence opens with."""
    try:
        red = _grad_reductions(ctx, step)
        order, _ = ctx.module_order()
    except CheckFailed:
        return ""
    if red is None:
        return ""
    R, S, two_d, groups = _mesh_groups(ctx)
    mine = red[0]
    summing = {}  # (kind, group) -> modules whose grads it summed
    for mod in order:
        for kind, g, op in mine.get(mod, []):
            if op == "sum" and g in groups:
                summing.setdefault((kind, g), []).append(mod)
    big = "too large" if ratio > 1 else "the reference"
    head = ("%.2f times %s: " % (ratio, big)) if lead else ""
    if summing:
        (kind, g), mods = max(summing.items(), key=lambda kv: len(kv[1]))
        n = len(groups[g])
        if kind == ALL_REDUCE and ctx.group_kind(g) == "replicate":
            what = "the all-reduce across the %d replicas (replicate group)" % n
        elif two_d:
            what = "the %s inside the %d-rank %s group" % (kind.replace("_", "-"), n, "shard" if ctx.group_kind(g) ==
                                                            "shard" else g)
        else:
            what = "the %s over the %d ranks" % (kind.replace("_", "-"), n)
        every = len(mods) == len(order)
        return ("%s%s sums (op sum in the trace, %s in step %d, %s): the grads come out %d times the "
                "mean%s; it must average (RED_AVG), not sum%s"
                % (head, what, g, step, "every module" if every else "for " + ", ".join(mods[:3]), n,
                   ", so the norm too" if every and abs(ratio / n - 1) <= 0.05 else "",
                   "; the two averages together are the mean over all %d ranks' data" % ctx.world if R > 1 else ""))
    if two_d and R > 1:
        missing = [mod for mod in order if not any(k == ALL_REDUCE and ctx.group_kind(g) == "replicate"
                                                   for k, g, _ in mine.get(mod, []))]
        if missing:
            mods = ", ".join(missing[:2]) + (" (and %d more)" % (len(missing) - 2) if len(missing) > 2 else "")
            return ("%srank 0's trace shows no all-reduce across the %d replicas (replicate group %s) of the "
                    "grad shards of %s in step %d: they are the mean over their own row's %d ranks' data only, not "
                    "over all %d, and the replicas drift apart: all-reduce each grad shard (RED_AVG) in "
                    "mesh->replicate_group after its reduce-scatter"
                    % ("%.2f times the reference: " % ratio if lead else "", R, ctx.group_of(0, "replicate"), mods,
                       step, S, ctx.world))
    return ""


# ------------------------------------------------------------------ between microbatches (the grad_state notes)

KINDS = (("unsharded_grad_sumsq", "unsharded_grads", 0, "kept unsharded grads (Param.grad)"),
         ("grad_shard_sumsq", "grad_shards", 1, "grad shards (DTensor.grad)"))


def _factor_name(x, W, K):
    """'0.25 (1/W)' for a factor near one the run's sizes explain, else '%.3g'."""
    named = [(0.0, "nothing"), (1.0, "1"), (1.0 / W, "1/W"), (float(W), "W"), (2.0, "2"), (0.5, "1/2")]
    named += [(1.0 / K, "1/K"), (float(K), "K")] if K > 2 else []
    for v, name in named:
        if abs(x - v) <= 1e-3 * max(1.0, abs(v)):
            return name if name in ("nothing", "1") else "%.3g (%s)" % (v, name)
    return "%.3g" % x


def _state_kind(note):
    """The index (0 unsharded, 1 shards) of the one kind of state a note holds, or None for both or none."""
    has = [note[count] > 0 for _, count, _, _ in KINDS]
    return has.index(True) if sum(has) == 1 else None


def _split(g_prev, g, f_prev, f, kind):
    """(c, d) with state = c x (what the earlier microbatches left) + d x (this microbatch's gradient as the
    reference adds it), from the dot products of the two states (the student's and the reference's), when the
    split fits every module within 1e-3; None otherwise. The previous states are the same (checked by the
    caller), so the reference's gives the earlier part's norm and its overlap with the new gradient."""
    key = KINDS[kind][0]
    a, x_ref, dot_ref = f_prev[key], f[key], f["dot_previous"]
    x_s, dot_s = g[key], g["dot_previous"]
    if None in (a, x_ref, dot_ref, x_s, dot_s) or a <= 0:
        return None
    b, e = dot_ref - a, x_ref - 2 * dot_ref + a           # <new, earlier>, |new|^2 of the reference
    new_perp, got_perp = e - b * b / a, x_s - dot_s * dot_s / a
    if new_perp <= 1e-9 * e:
        return None
    for sign in (1, -1):
        d = sign * math.sqrt(max(got_perp, 0.0) / new_perp)
        c = (dot_s - d * b) / a
        if _split_fits(g_prev, g, f_prev, f, kind, c, d, x_s):
            return c, d
    return None


def _split_fits(g_prev, g, f_prev, f, kind, c, d, total):
    mods = [m for m in f["by_module"] if f["by_module"][m][kind] is not None]
    if not mods or any(m not in g["by_module"] or m not in f_prev["by_module"] for m in mods):
        return False
    for m in mods:
        am, xm, dm = f_prev["by_module"][m][kind], f["by_module"][m][kind], f["by_module"][m][2]
        gx, gd = g["by_module"][m][kind], g["by_module"][m][2]
        if None in (am, xm, dm, gx, gd):
            return False
        bm, em = dm - am, xm - 2 * dm + am
        want_x, want_d = c * c * am + 2 * c * d * bm + d * d * em, c * am + d * bm
        slack = 1e-3 * max(abs(gx), 1e-6 * total)
        if abs(want_x - gx) > slack or abs(want_d - gd) > slack:
            return False
    return True


def _split_advice(c, d, k, kind, W):
    near = lambda x, v: abs(x - v) <= 1e-3 * max(1.0, abs(v))  # noqa: E731
    store = "the grad shards" if kind else "Param.grad"
    if near(d, 1) and near(c, 1.0 / W):
        return ("the earlier microbatches' grads are divided by W = %d: they went through an average over the %d "
                "ranks that only this rank contributed them to (added into the reduce-scatter input?): reduce-scatter "
                "microbatch %d's grads alone (RED_AVG) into a buffer of their own, then add it into %s (launch_add)"
                % (W, W, k, store))
    if near(d, 1) and near(c, 0):
        return ("what the earlier microbatches left is gone: microbatch %d replaced %s instead of adding into them "
                "(launch_add)" % (k, store))
    if near(c, 1) and near(d, W):
        return ("microbatch %d's gradient is W = %d times too large: its reduce-scatter must average (RED_AVG), not "
                "sum" % (k, W))
    if near(c, 1) and near(d, 0):
        return "microbatch %d's gradient never reached %s" % (k, store)
    if near(d, 1):
        return "the earlier microbatches' part must stay as it was (1): add microbatch %d's into it, nothing else" % k
    if near(c, 1):
        return "microbatch %d's own part must be its gradient as the reference adds it (1)" % k
    return "both parts must be 1: %s += microbatch %d's gradient, averaged over the ranks" % (store, k)


def _uniform(g, f, kind, q):
    """Do all modules' sums of squares differ from the reference's by the same ratio q (within 1e-3)?"""
    pairs = [(g["by_module"].get(m, [None] * 3)[kind], v[kind]) for m, v in f["by_module"].items()]
    pairs = [(x, y) for x, y in pairs if y]
    return bool(pairs) and all(x is not None and abs(x / y - q) <= 1e-3 * max(q, 1e-12) for x, y in pairs)


def _state_difference(g, f, g_prev, f_prev, k, W, K, tol):
    """How the student's state g differs from the reference's f after microbatch k (None: it does not)."""
    counts = [(g[c], f[c]) for _, c, _, _ in KINDS]
    if counts[0][0] != counts[0][1] or counts[1][0] != counts[1][1]:
        (gu, fu), (gs, fs) = counts
        advice = []
        if gu < fu:
            advice.append("the reference keeps Param.grad of %d params for the next backward to add to (post_backward "
                          "with requires_gradient_sync 0 leaves it as it is)" % fu)
        elif gu > fu:
            advice.append("Param.grad outlives its reduce-scatter: free it once it is copied into the input")
        if gs > fs:
            advice.append("grad shards exist where the reference has none (a reduce-scatter with "
                          "requires_gradient_sync 0?)")
        elif gs < fs:
            advice.append("set each param's DTensor.grad to its rows of the grad shards after the reduce-scatter, "
                          "until the optimizer step")
        return ("Param.grad is kept for %d params and DTensor.grad set for %d, the reference's %d and %d: %s"
                % (gu, gs, fu, fs, "; ".join(advice)))
    if g["grad_shards_unreadable"]:
        return ("the DTensor.grad of %d params points outside every live allocation: the grad shards were freed "
                "(or never allocated) while DTensor.grad still points at them" % g["grad_shards_unreadable"])
    for key, count, kind, name in KINDS:
        if not f[count]:
            continue
        got, want = g[key], f[key]
        if got is None or want is None:
            if got is None and want is not None:
                return "the %s hold NaN or infinity (fresh memory is NaN-filled: read before written?)" % name
            continue
        if rel(got, want) <= tol:
            continue
        q = got / want if want else float("inf")
        said = ("the %s hold %.4g x the reference's sum of squares (%s x its norm%s)"
                % (name, q, _factor_name(math.sqrt(q), W, K) if math.isfinite(q) else "inf",
                   ", in every module alike" if math.isfinite(q) and _uniform(g, f, kind, q) else ""))
        same_kind = k > 0 and g_prev and f_prev and all(_state_kind(n) == kind for n in (g, g_prev, f, f_prev))
        if same_kind and g["dot_params"] == g_prev[count] == g[count] and f["dot_params"] == f[count]:
            split = _split(g_prev, g, f_prev, f, kind)
            if split:
                c, d = split
                return ("%s; after microbatch %d they matched, and the dot product of the two states splits them "
                        "(in every module alike) into %s x what the earlier microbatches left + %s x microbatch %d's "
                        "gradient, where the reference has 1 and 1: %s"
                        % (said, k - 1, _factor_name(c, W, K), _factor_name(d, W, K), k,
                           _split_advice(c, d, k, kind, W)))
        return said
    return None


def grad_state_hint(ctx, step, K):
    """The first (step, microbatch, rank) up to `step` (1-based) whose gradient state differs from the reference's,
    and how; a sentence that every state matched; "" without grad_state notes on both sides."""
    try:
        return _grad_state_hint(ctx, step, K)
    except CheckFailed:
        return ""


def _grad_state_hint(ctx, step, K):
    W = ctx.world
    tol = 2 * ctx.parity_tol("grad_norm")[0]  # sums of squares: twice the norm's relative tolerance
    got = [ctx.grad_states(r) for r in range(W)]
    ref = [ctx.grad_states(r, reference=True) for r in range(W)]
    if not all(ref):
        return ""  # a reference from before the probe (instructors: make reference)
    if not all(got):
        return ""
    keys = sorted(key for key in ref[0] if key[0] < step)
    for s, k in keys:
        for r in range(W):
            g, f = got[r].get((s, k)), ref[r].get((s, k))
            if f is None:
                return ""
            where = ("after microbatch %d of step %d on rank %d (memory_rank%d.json's grad_state notes)"
                     % (k, s + 1, r, r))
            if g is None:
                return "%s your run recorded no gradient state: did microbatch %d's backward finish?" % (where, k)
            prev = (got[r].get((s, k - 1)), ref[r].get((s, k - 1))) if k else (None, None)
            diff = _state_difference(g, f, prev[0], prev[1], k, W, K, tol)
            if diff is None:
                continue
            if k == 0 and s > 0:
                diff += ("; every state of step %d matched, so the params this backward ran on already differ: the "
                         "update of step %d went wrong (the optimizer, clipping)" % (s, s))
            return "%s %s" % (where, diff)
    return ("the gradient state after every microbatch matches the reference's up to step %d (kept Param.grad and "
            "grad shards, every rank): the grads reaching the optimizer are right, so the norm itself is wrong: the "
            "sum of squares over each grad shard's local rows (not the padding), its all-reduce, the square root"
            % step)
