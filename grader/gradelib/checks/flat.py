"""Flat parameters (stage 13): FSDP1's FlatParameter. A unit's params are views into the buffer its all-gather
writes, so the unshard hooks launch no copy of the params (no copy-in, no copy-out), and each unit's shards
(DTensor.local) are views into one [S] allocation (dtensors_rank<r>.json's flat_units); the backward writes into
views of the unit's flat gradient, which the reduce-scatter reads as is, formed once per step under --grad-sync last
(flat_grads); a unit's collectives are one each, as many units as --bucket-mb implies (bucket_collectives); the
checkpoint --save writes turns the flat shards back into stage 07's per-param tensors (the non-sharded baseline's
names, shapes and values: flat_checkpoint).
"""
import math

import manifest
from trace_names import (ALL_GATHER, COMPUTE, COPY, FORWARD_PHASES, PHASE_BACKWARD, PHASE_FINISH_BACKWARD,
                         PHASE_POST_BACKWARD, PHASE_PRE_BACKWARD, PHASE_PRE_FORWARD, PHASE_RECOMPUTE_PRE_FORWARD,
                         REDUCE_SCATTER, TAG_UNSHARDED_GRAD, label_and_kind)

from ..util import CheckFailed, one_line, short
from .common import Accum
from .registry import SAYS_WHAT_RAN, SAYS_WHICH_NUMBER, check

# the hooks that unshard a unit: with flat params the all-gather output is the params' storage
UNSHARD_PHASES = frozenset({PHASE_PRE_FORWARD, PHASE_PRE_BACKWARD, PHASE_RECOMPUTE_PRE_FORWARD})
# the per-param copies of stage 03's fused unshard (FSDP2's _foreach_copy_ and split_with_sizes_copy)
PARAM_COPIES = ("copy_in", "copy_out")
# the launches an unshard hook may still make: the runtime's memsets (a zeroed buffer), and the flat gradient's
# one batched copy when it is formed at the start of the unit's backward (the flat_grads check's to judge)
ALLOWED = ("memset", "grad_cat")


@check("flat_views", label="params are views of the all-gather output", variants=True, tier=SAYS_WHAT_RAN)
def check_flat_views(ctx):
    """No copy_in / copy_out launch in any step, and no other copy launch in an unsharding hook (pre_forward,
    pre_backward, the recompute's pre_forward): Param.data must point into the flat buffer the all-gather
    wrote. Each unit's DTensor.local are views into one [S] allocation (the DTensors dump)."""
    bad = []
    for r in ctx.ranks():
        for e in ctx.trace(r):
            args = e.get("args") or {}
            if e.get("cat") not in (COPY, COMPUTE) or (args.get("step") or 0) < 0:
                continue
            label, kind = label_and_kind(e["name"])
            in_hook = args.get("phase") in UNSHARD_PHASES
            if kind in PARAM_COPIES or (in_hook and e.get("cat") == COPY and kind not in ALLOWED):
                bad.append((r, e))
    if bad:
        r, e = bad[0]
        args = e.get("args") or {}
        raise CheckFailed("%d copy launches into the params (first: %s in %s.%s, step %s, rank %d): with flat params "
                          "the all-gather writes the unsharded flat buffer and Param.data = flat + flat_offset are "
                          "views into it (no copy-in, no copy-out)"
                          % (len(bad), e["name"], args.get("module"), args.get("phase"),
                             args["step"] + 1 if isinstance(args.get("step"), int) else "?", r))
    for r in ctx.ranks():
        units = ctx.dtensors(r).get("flat_units")
        if not isinstance(units, list) or not units:
            raise CheckFailed("dtensors_rank%d.json lists no flat_units: no param is PLACEMENT_FLAT (device.h)" % r)
        for u in units:
            if not isinstance(u, dict):
                raise CheckFailed("dtensors_rank%d.json: flat_units holds %s, not objects" % (r, type(u).__name__))
            if u.get("views_in_shard") is not True or u.get("shard_in_allocation") is False:
                raise CheckFailed("rank %d: flat unit %s (%s): its params' DTensor.local are not views into one [S] "
                                  "allocation at their pieces (device.h, PLACEMENT_FLAT)"
                                  % (r, u.get("flat_unit"), u.get("module")))
    return "no copy of the params; %d units' shards are views" % len(units)


def _params_per_module(ctx):
    """{module: its number of params} from rank 0's DTensor dump."""
    out = {}
    for p in ctx.dtensors(0)["params"]:
        out[p["module"]] = out.get(p["module"], 0) + 1
    return out


@check("flat_grads", label="one flat gradient per unit and step", variants=True, tier=SAYS_WHAT_RAN)
def check_flat_grads(ctx):
    """The reduce-scatter reads the unit's flat gradient in place: no chunk_cat and no copy launch in a
    post_backward (a copy into a separate reduce-scatter input). The backward writes into views of it: with
    --grad-sync last the microbatches before the last keep per-param grads (the runtime allocates each param's once
    per step, in the first microbatch's backward), and the last forms the flat gradient once, with at most one
    batched copy of the kept grads ("grad_cat", in the pre_backward of the unit's first module to run backward);
    with --grad-sync every or one microbatch the backward writes into the views every time: no per-param grad and
    no copy at all."""
    a = Accum(ctx.flags, ctx)
    units = ctx.units()
    unit_of = {m: u for u in units for m in u[1]}
    cat_per_step = a.K > 1 and not a.sync_every  # the kept per-param grads are copied in once, on the last microbatch
    for r in ctx.ranks():
        cats = {}  # (step, unit label) -> [(microbatch, phase)]
        for e in ctx.trace(r):
            args = e.get("args") or {}
            if e.get("cat") not in (COPY, COMPUTE) or not isinstance(args.get("step"), int) or args["step"] < 0:
                continue
            label, kind = label_and_kind(e["name"])
            where = "%s in %s.%s (step %d%s, rank %d)" % (e["name"], args.get("module"), args.get("phase"),
                                                         args["step"] + 1, ", microbatch %s" % args["microbatch"]
                                                         if "microbatch" in args else "", r)
            if kind == "chunk_cat" or (e.get("cat") == COPY and args.get("phase") == PHASE_POST_BACKWARD
                                       and kind != "memset"):
                raise CheckFailed("%s: a copy of the grads into a separate reduce-scatter input; with flat params the "
                                  "backward writes into views of the unit's flat gradient and the reduce-scatter "
                                  "reads it as is (rank r's chunk is flat[r*S, (r+1)*S): no chunk-cat)" % where)
            if kind != "grad_cat":
                continue
            if not cat_per_step:
                raise CheckFailed("%s: with %s the backward writes every microbatch's grads into views of the flat "
                                  "gradient, so nothing is ever copied into it" % (where, a.describe()))
            if args.get("phase") != PHASE_PRE_BACKWARD or args.get("microbatch") != a.K - 1:
                raise CheckFailed("%s: the kept per-param grads are copied into the flat gradient once, in the last "
                                  "microbatch's pre_backward of the unit's first module to run backward (so that "
                                  "microbatch's backward writes into its views)" % where)
            unit = unit_of.get(args.get("module"))
            if unit is None:
                raise CheckFailed("%s: not in a module's hook" % where)
            cats.setdefault((args["step"], unit[0]), []).append(where)
        for (s, label), wheres in sorted(cats.items()):
            if len(wheres) > 1:
                raise CheckFailed("%d grad_cat launches for flat unit %s in step %d (rank %d: %s): the kept grads "
                                  "of a unit go into its flat gradient in one batched copy, once per step"
                                  % (len(wheres), label, s + 1, r, ", ".join(wheres)))
        # the runtime's per-param grads: allocated in the backward (phase "backward") when Param.grad was NULL
        n_params = _params_per_module(ctx)
        allocs = {}  # (step, module) -> count
        recorded = set()  # the steps whose backward the snapshot holds to its end (finish_backward's record)
        for e in ctx.memory(r).get("events", []):
            if e.get("kind") == "hook_memory" and e.get("hook") == PHASE_FINISH_BACKWARD and isinstance(e.get("step"),
                                                                                                        int):
                recorded.add(e["step"])
            if e.get("action") == "alloc" and e.get("tag") == TAG_UNSHARDED_GRAD and e.get("phase") == PHASE_BACKWARD \
                    and isinstance(e.get("step"), int) and e["step"] >= 0:
                allocs[(e["step"], e.get("module"))] = allocs.get((e["step"], e.get("module")), 0) + 1
        steps = sorted({e["args"]["step"] for e in ctx.trace(r) if e.get("cat") == COMPUTE
                        and isinstance((e.get("args") or {}).get("step"), int) and e["args"]["step"] >= 0})
        if not steps:
            raise CheckFailed("trace_rank%d.json holds no step" % r)
        for s in steps:
            for mod in a.order if s in recorded else []:
                got = allocs.get((s, mod), 0)
                want = n_params[mod] if cat_per_step else 0
                if got != want:
                    raise CheckFailed(
                        "%s's backward ran on %d per-param grads the runtime allocated in step %d (rank %d), not %d: %s"
                        % (mod, got, s + 1, r, want, "with %s the microbatches before the last keep per-param grads "
                           "(Param.grad NULL at the first backward, then kept) and only the last forms the flat "
                           "gradient (fairscale's cat on the last microbatch)" % a.describe() if want else
                           "with %s every backward writes into views of the unit's flat gradient: set Param.grad to "
                           "them in pre_backward" % a.describe()))
            if cat_per_step:
                missing = [u[0] for u in units if (s, u[0]) not in cats]
                if missing:
                    raise CheckFailed("no grad_cat for flat unit %s in step %d (rank %d): the per-param grads kept "
                                      "from the earlier microbatches go into the flat gradient in one batched copy"
                                      % (missing[0], s + 1, r))
    return ("one grad_cat per unit and step, on the last microbatch" if cat_per_step
            else "the backward writes into the flat gradients' views: no copy")


@check("bucket_collectives", label="collectives per flat unit", variants=True, tier=SAYS_WHAT_RAN)
def check_bucket_collectives(ctx):
    """Per rank and step, the all-gathers and reduce-scatters of the model are those of the units the driver derives
    from --bucket-mb (run.json's flat_units: consecutive modules until they hold at least B MiB; one unit per module
    without it), each labelled with its unit's first module, as many as the flags imply: a reduce-scatter per unit and
    syncing microbatch; an all-gather per unit in each microbatch's forward (none when the previous microbatch kept
    the params: --reshard-after-backward=false) and one in its backward (none under --reshard-after-forward=false;
    the recompute of --ac reads the backward's)."""
    want_units = ctx.run_json().get("flat_units")
    if not (isinstance(want_units, list) and want_units and all(
            isinstance(u, list) and u and all(isinstance(m, str) for m in u) for u in want_units)):
        raise CheckFailed("run.json states no flat_units (%s): the driver writes them when a param is Flat after "
                          "fsdp_init (device.h, PLACEMENT_FLAT)" % short(want_units))
    a = Accum(ctx.flags, ctx)
    labels = [u[0] for u in want_units]
    fwd = sum(0 if k > 0 and not a.reshards(k - 1) else 1 for k in range(a.K))
    want = {(REDUCE_SCATTER, "the backward"): sum(1 for k in range(a.K) if a.syncs(k)),
            (ALL_GATHER, "the forward"): fwd, (ALL_GATHER, "the backward"): a.K if a.raf else 0}
    counts = {}  # (rank, step, kind, pass) -> {label: n}
    for kind in (ALL_GATHER, REDUCE_SCATTER):
        for r, e in ctx.collectives(kind):
            label, _ = label_and_kind(e["name"])
            if label not in a.unsharded:  # the grad norm's all-reduce and the like
                continue
            when = "the forward" if e["args"].get("phase") in FORWARD_PHASES else "the backward"
            c = counts.setdefault((r, e["args"]["step"], kind, when), {})
            c[label] = c.get(label, 0) + 1
    steps = sorted({k[1] for k in counts if k[1] >= 0})
    if not steps:
        raise CheckFailed("no collectives of the modules in the trace")
    bucket = manifest.flag_value(ctx.flags, "--bucket-mb")
    for s in steps:
        for r in ctx.ranks():
            for (kind, when), n in want.items():
                got = counts.get((r, s, kind, when), {})
                what = kind.replace("_", "-") + "s"
                if sum(got.values()) != n * len(labels) or any(got.get(l, 0) != n for l in labels):
                    raise CheckFailed(
                        "%s in %s of step %d (rank %d): %s; %s gives the units %s, so %d per unit (%s), labelled with "
                        "the unit's first module%s"
                        % (what, when, s + 1, r, ", ".join("%s x%d" % kv for kv in sorted(got.items())) or "none",
                           "--bucket-mb %s" % bucket if bucket else "no --bucket-mb (a unit per module)",
                           " ".join("[%s]" % ", ".join(u) for u in want_units), n, a.describe(),
                           "" if kind == REDUCE_SCATTER else ": a unit's flat buffer is gathered once and serves "
                           "all its modules until the last of them reshards it"))
    per = {k: n * len(labels) for (k, _), n in want.items()}
    return "%d units: %d all-gathers and %d reduce-scatters per step" % (
        len(labels), sum(n for (k, _), n in want.items() if k == ALL_GATHER) * len(labels),
        per[REDUCE_SCATTER])


OPTIM = "optim."  # checkpoint.c: the AdamW state of param <name> is optim.<name>.exp_avg and optim.<name>.exp_avg_sq
# where the checkpoint's values come from (checkpoint.c gathers each rank's piece of every param): what to look at
# when a weight, or its AdamW state, is off
WEIGHT_HINT = ("--save gathers each rank's piece from DTensor.local: [row_offset, row_offset + local_rows) of the "
               "param, at flat_offset + row_offset - r*S in the unit's [S] shard (device.h, PLACEMENT_FLAT); a "
               "DTensor.local pointing elsewhere in the shard, or a shard the optimizer does not update, saves other "
               "values")
STATE_HINT = ("--save gathers each rank's AdamW state from DTensor.exp_avg / exp_avg_sq, which must be views into the "
              "unit's [S] state buffers at the same place as DTensor.local in the [S] shard (flat_offset + row_offset "
              "- r*S): the optimizer updates the [S] buffers, so a view at another place, or into the other buffer, "
              "saves another element's state")


def _param_of(name):
    """(param name, what) of a checkpoint entry: the weight itself, or its exp_avg / exp_avg_sq."""
    if name.startswith(OPTIM):
        for kind in (".exp_avg_sq", ".exp_avg"):
            if name.endswith(kind):
                return name[len(OPTIM):-len(kind)], kind[1:]
    return name, "weight"


def _off_elements(got, want, lim):
    """Indices where got differs from want by more than lim (a NaN in got always does)."""
    return [i for i, (g, w) in enumerate(zip(got, want)) if not abs(g - w) <= lim]


def _where(ctx, name, i, shape, off):
    """Where element i of param `name` lives: its row and column, and the rank whose flat piece holds it (from the
    DTensors dumps) when every wrong element lies in that piece; '' when the dumps say nothing."""
    at = "element %d" % i + (" (row %d, column %d)" % divmod(i, shape[1]) if len(shape) == 2 and shape[1] else "")
    for r in ctx.ranks():
        try:
            params = ctx.dtensors(r)["params"]
        except CheckFailed:
            return at
        p = next((p for p in params if p["name"] == name), None)
        if p is None:
            continue
        lo, hi = p["row_offset"], p["row_offset"] + p["local_rows"]
        if lo <= i < hi:
            inside = all(lo <= j < hi for j in off)
            return "%s, in rank %d's piece [%d, %d) of the %d elements%s" % (
                at, r, lo, hi, math.prod(shape), " (every wrong element lies in it)" if inside else "")
    return at


@check("flat_checkpoint", label="the checkpoint is stage 07's", tier=SAYS_WHICH_NUMBER)
def check_flat_checkpoint(ctx):
    """The checkpoint --save writes at the last step (the grading configuration run once more with --save:
    Runner.run_saving) against the non-sharded baseline's at the same step: the same names (each param's
    torchtitan name and its optim.<name>.exp_avg / exp_avg_sq), shapes, dtype and step exactly, every value
    within tolerances.checkpoint_rel of its tensor's largest |value| (cuda_checkpoint_rel at least with --cuda)."""
    got_meta, got = ctx.checkpoint()
    want_meta, want = ctx.baseline_checkpoint()
    if got_meta.get("step") != want_meta.get("step"):
        def step(meta):  # the metadata's values are strings (read_checkpoint)
            return one_line(meta["step"], 40) if "step" in meta else "none (no \"step\" in its metadata)"
        raise CheckFailed("the checkpoint says step %s, the baseline's (saved at the same step) %s"
                          % (step(got_meta), step(want_meta)))
    missing = [n for n in want if n not in got]
    if missing:
        state = [n for n in missing if n.startswith(OPTIM)]
        if state and len(state) == len(missing) and not any(n.startswith(OPTIM) for n in got):
            raise CheckFailed("the checkpoint holds no AdamW state (%d entries such as %s): --save writes it only "
                              "when every param's DTensor.exp_avg and exp_avg_sq are set at the last step; set the "
                              "views for every param of a unit, those with an empty piece too"
                              % (len(state), state[0]))
        raise CheckFailed("the checkpoint has no %s (%d of the baseline's %d entries missing): stage 07's checkpoint "
                          "names each param by its torchtitan name and its AdamW state optim.<name>.exp_avg / "
                          "exp_avg_sq" % (missing[0], len(missing), len(want)))
    extra = [n for n in got if n not in want]
    if extra:
        raise CheckFailed("the checkpoint holds %s, which the baseline's does not (%d such entries)"
                          % (short(extra[0], 80), len(extra)))
    for name, w in want.items():
        g = got[name]
        if g.dtype != w.dtype:
            raise CheckFailed("%s is %s in the checkpoint, %s in the baseline's" % (name, g.dtype, w.dtype))
        if g.shape != w.shape:
            raise CheckFailed("%s has shape %s in the checkpoint, %s in the baseline's (stage 07's shapes: the "
                              "param's own, not its flat piece)" % (name, g.shape, w.shape))
    tol = ctx.tol["checkpoint_rel"]
    if ctx.cuda:
        tol = max(tol, ctx.tol["cuda_checkpoint_rel"])
    worst, worst_name = 0.0, None
    for name, w in want.items():
        g = got[name]
        if w.values is None:  # not float32: equal bytes only (the driver writes F32)
            continue
        top = max(map(abs, w.values), default=0.0)
        off = _off_elements(g.values, w.values, tol * top)
        if not off:
            gap = max((abs(a - b) for a, b in zip(g.values, w.values)), default=0.0) / top if top else 0.0
            if gap > worst:
                worst, worst_name = gap, name
            continue
        i = off[0]
        param, what = _param_of(name)
        same_as = next((other for other, o in want.items() if other != name and o.values is not None and
                        o.numel == w.numel and not _off_elements(g.values, o.values,
                                                                 tol * max(map(abs, o.values), default=0.0))), None)
        raise CheckFailed("%s: %d of its %d values differ from the baseline's by more than %.0e of its largest "
                          "|value| %.3g, the first at %s: %.9g, the baseline's %.9g%s: %s"
                          % (name, len(off), w.numel, tol, top, _where(ctx, param, i, w.shape, off), g.values[i],
                             w.values[i], "; its values are the baseline's %s" % same_as if same_as else "",
                             STATE_HINT if what != "weight" else WEIGHT_HINT))
    return "%d tensors at step %s: the baseline's names, shapes and dtype, every value within %.0e of its tensor's " \
           "largest (at most %.1e%s)" % (len(want), got_meta.get("step"), tol, worst,
                                         ", " + worst_name if worst_name else "")
