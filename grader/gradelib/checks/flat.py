"""Flat parameters (stage 13): FSDP1's FlatParameter. A unit's params are views into the buffer its all-gather
writes, so the unshard hooks launch no copy of the params (no copy-in, no copy-out), and each unit's shards
(DTensor.local) are views into one [S] allocation (dtensors_rank<r>.json's flat_units); the checkpoint --save
writes turns the flat shards back into stage 07's per-param tensors (the non-sharded baseline's names, shapes and
values).
"""
import math

from trace_names import (COMPUTE, COPY, PHASE_PRE_BACKWARD, PHASE_PRE_FORWARD, PHASE_RECOMPUTE_PRE_FORWARD,
                         label_and_kind)

from ..util import CheckFailed, one_line, short
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
