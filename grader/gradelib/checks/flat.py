"""Flat parameters (stage 13): FSDP1's FlatParameter. A unit's params are views into the buffer its all-gather
writes, so the unshard hooks launch no copy of the params (no copy-in, no copy-out), and each unit's shards
(DTensor.local) are views into one [S] allocation (dtensors_rank<r>.json's flat_units).
"""
from trace_names import (COMPUTE, COPY, PHASE_PRE_BACKWARD, PHASE_PRE_FORWARD, PHASE_RECOMPUTE_PRE_FORWARD,
                         label_and_kind)

from ..util import CheckFailed
from .registry import SAYS_WHAT_RAN, check

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
