"""HSDP (stage 09): the collectives in their groups of the 2-D mesh, and the shards split over the shard group.
"""
import math

from trace_names import ALL_GATHER, ALL_REDUCE, COLLECTIVE, REDUCE_SCATTER, label_and_kind
from trace_names import TAG_OPTIM_STATE, TAG_PARAM_SHARD  # the memory tags (MemTag)

from ..util import CheckFailed, chunk, fmt_bytes, mesh_shape, padded_rows
from .common import two_sizes
from .registry import SAYS_WHAT_RAN, SAYS_WHICH_BUFFER, check


def _groups(ctx):
    """{rank: (shard group name, replicate group name or None)} of the run's mesh, as run.json states the runtime
    made them (the world without a mesh)."""
    ctx.groups()  # run.json states them, or one line saying it does not
    return {r: (ctx.group_of(r, "shard") or "world", ctx.group_of(r, "replicate")) for r in range(ctx.world)}


@check("hsdp_collectives", label="collectives in their groups", variants=True, tier=SAYS_WHAT_RAN)
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


@check("hsdp_memory", label="shards split over the shard group", variants=True, tier=SAYS_WHICH_BUFFER)
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
                                      (where,) + two_sizes(got, shard_bytes) + (S,) + (
                                      "--mesh %d,%d" % (R, S) if R > 1 or S != ctx.world else "the world",
                                      ctx.world, fmt_bytes(sum(4 * padded_rows(sh[0], ctx.world) * math.prod(sh[1:])
                                                               for sh in shapes)))))
            opt = n["exit_by_tag"].get(TAG_OPTIM_STATE, 0)
            if opt and opt != optim_bytes:
                raise CheckFailed("%s the optimizer state takes %s, expected %s: exp_avg and exp_avg_sq of this "
                                  "rank's rows (chunk %d of the split over %d ranks)"
                                  % ((where,) + two_sizes(opt, optim_bytes) + (k, S)))
            seen_optim += bool(opt)
        if ctx.steps > 1 and not seen_optim:
            raise CheckFailed("rank %d never held optimizer state after a hook: is it created in the first "
                              "fsdp_optimizer_step?" % r)
    return "param shards %s per rank (1/%d of the model)" % (fmt_bytes(shard_bytes), S)
