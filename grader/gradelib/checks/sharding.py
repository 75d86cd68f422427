"""DTensors (every stage): each rank's shard of every param as torch.chunk splits it over its shard group,
read from the dtensors_rank<r>.json dump written right after fsdp_init; and the grad shards' padding rows, zero
before each optimizer step as the shards' own (the "grad_padding" notes of the memory snapshots). A flat stage
(rubric "flat", stage 13): each rank's piece of every param by the flat formula of device.h (PLACEMENT_FLAT),
the units' layout (params in order, no per-param padding) and the units run.json's flat_units states.
"""
import math

from ..util import CheckFailed, chunk, mesh_shape
from .registry import SAYS_WHAT_RAN, check


@check("dtensors", label="DTensors", variants=True, tier=SAYS_WHAT_RAN)
def check_dtensors(ctx):
    if ctx.rubric["stages"][ctx.stage].get("flat"):
        check_flat_dtensors(ctx)
        if ctx.run.ok:
            check_grad_padding(ctx)
        return ""
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
    if ctx.run.ok:  # the grad shards' padding, before each optimizer step (a run that failed wrote no snapshot)
        check_grad_padding(ctx)
    return ""


def check_grad_padding(ctx):
    """FSDP2 keeps the padding rows of the grad shards zero, as the shards' own: the reduce-scatter input's padding
    rows are zeroed. The runtime notes a DTensor.grad whose padding is not zero before the optimizer (probes.h)."""
    for rank in range(ctx.world):
        notes = ctx.grad_padding(rank)
        if not notes:
            continue
        n = min(notes, key=lambda e: e["step"])
        what = ("NaN in %d of its %d padding values" % (n["nan"], n["padding_values"]) if n["nan"] else
                "nonzero values in %d of its %d padding values" % (n["nonzero"], n["padding_values"]))
        more = n["params"] - 1
        raise CheckFailed("step %d, rank %d: %s's grad shard (DTensor.grad) holds %s (padding rows %d..%d) before "
                          "the optimizer%s: zero the padding rows of the reduce-scatter input (fresh memory is "
                          "NaN-filled), so that the reduce-scatter's output, the grad shards, keeps them zero as "
                          "FSDP2's does" % (n["step"] + 1, rank, n["param"], what, n["local_rows"], n["padded_rows"],
                                            (", as %s %d more param%s" % ("do" if more > 1 else "does", more,
                                                                          "s'" if more > 1 else "'s"))
                                            if more > 0 else ""))


# A flat unit's params may sit apart by an alignment of at most this many elements (64 bytes of float32), and
# S may be ceil(flat size / W) rounded up to it: anything more is per-param padding.
FLAT_ALIGN = 16


def _round_up(n, a):
    return (n + a - 1) // a * a


def check_flat_dtensors(ctx):
    """FSDP1's FlatParameter (device.h, PLACEMENT_FLAT): each unit's params one after another in one 1-D buffer
    (gaps of at most FLAT_ALIGN - 1 elements), split into W chunks of S elements, S at most ceil(end / W)
    rounded up to FLAT_ALIGN; rank r's piece of a param at flat_offset fo is its elements
    [clamp(r*S - fo, 0, numel), clamp((r+1)*S - fo, 0, numel)); the units are the ones run.json states."""
    W = ctx.world
    want_units = ctx.run_json().get("flat_units")
    for rank in range(W):
        d = ctx.dtensors(rank)
        params = d.get("params", [])
        if not params:
            raise CheckFailed("dtensors_rank%d.json lists no params" % rank)
        modules = []  # forward order: Module.index is the position
        for p in params:
            if p["module"] not in modules:
                modules.append(p["module"])
        units = {}  # flat_unit -> [params in dump order]
        for p in params:
            who = "rank %d: %s" % (rank, p["name"])
            numel = math.prod(p["global_shape"])
            if p["placement"] != "Flat":
                raise CheckFailed("%s has placement %s, expected Flat: this stage lays every param out in its unit's "
                                  "flat buffer (PLACEMENT_FLAT, device.h)" % (who, p["placement"]))
            if not p["mesh_is_world"] or p["mesh"] != list(range(W)):
                raise CheckFailed("%s's mesh is %s, expected the world %s: use FsdpConfig.mesh"
                                  % (who, p["mesh"], list(range(W))))
            for key in ("flat_offset", "flat_shard_numel", "flat_unit"):
                if not isinstance(p.get(key), int) or p[key] < 0:
                    raise CheckFailed("%s has no %s (a Flat DTensor states it: device.h)" % (who, key))
            if p["global_rows"] != numel or p["row_numel"] != 1:
                raise CheckFailed("%s says global_rows %s x row_numel %s: a Flat param is seen as 1-D, %d x 1 "
                                  "(device.h, PLACEMENT_FLAT)" % (who, p["global_rows"], p["row_numel"], numel))
            units.setdefault(p["flat_unit"], []).append(p)
        # the units: consecutive modules, flat_unit = the first one's index, as run.json states them
        got_units = []
        for unit, ps in sorted(units.items()):
            mods = []
            for p in ps:
                if p["module"] not in mods:
                    mods.append(p["module"])
            idx = [modules.index(m) for m in mods]
            if idx != list(range(idx[0], idx[0] + len(idx))) or unit != idx[0]:
                raise CheckFailed("rank %d: the flat unit %d holds the modules %s: a unit is a run of consecutive "
                                  "modules and flat_unit is its first module's index (Module.index)"
                                  % (rank, unit, ", ".join(mods)))
            got_units.append(mods)
        for mod in modules:
            owners = sorted({p["flat_unit"] for p in params if p["module"] == mod})
            if len(owners) > 1:
                raise CheckFailed("rank %d: %s's params lie in the flat units %s: a module's params all lie in one "
                                  "unit" % (rank, mod, owners))
        if want_units is not None and got_units != want_units:
            raise CheckFailed("rank %d: the flat units are %s, run.json states %s for --bucket-mb %s (consecutive "
                              "modules until a unit holds at least MB x 2^20 bytes of float32 params; no "
                              "--bucket-mb: a unit per module)"
                              % (rank, got_units, want_units, ctx.run_json().get("bucket_mb", 0)))
        for unit, ps in sorted(units.items()):
            S = ps[0]["flat_shard_numel"]
            end = 0
            for p in ps:
                who = "rank %d: %s" % (rank, p["name"])
                numel = math.prod(p["global_shape"])
                fo = p["flat_offset"]
                if p["flat_shard_numel"] != S:
                    raise CheckFailed("%s has flat_shard_numel %d, the first param of its unit %d: a unit has one S"
                                      % (who, p["flat_shard_numel"], S))
                if fo < end or fo - end >= FLAT_ALIGN:
                    raise CheckFailed("%s has flat_offset %d, the previous param of its unit ends at %d: the params "
                                      "lie one after another in their order in the module (an alignment gap of at "
                                      "most %d elements; no per-param padding)" % (who, fo, end, FLAT_ALIGN - 1))
                end = fo + numel
                lo = min(max(rank * S - fo, 0), numel)
                hi = min(max((rank + 1) * S - fo, 0), numel)
                if (p["row_offset"], p["local_rows"], p["padded_rows"]) != (lo, hi - lo, hi - lo):
                    raise CheckFailed("%s row_offset %d, local_rows %d, padded_rows %d; expected %d, %d, %d: rank %d "
                                      "holds flat[%d*%d, %d*%d), the param's elements [clamp(r*S - %d, 0, %d), "
                                      "clamp((r+1)*S - %d, 0, %d)) (device.h, PLACEMENT_FLAT; an empty piece sits "
                                      "at 0 or at numel)"
                                      % (who, p["row_offset"], p["local_rows"], p["padded_rows"], lo, hi - lo,
                                         hi - lo, rank, rank, S, rank + 1, S, fo, numel, fo, numel))
                if not p["has_local"]:
                    raise CheckFailed("%s has no local storage (DTensor.local is NULL; an empty piece too points "
                                      "into the unit's [S] shard)" % who)
                if p["local_in_allocation"] is False:
                    raise CheckFailed("%s's piece (DTensor.local) is not inside one live allocation from dev_alloc"
                                      % who)
                if p["local_matches_init"] is not True:
                    raise CheckFailed("%s's piece does not hold elements [%d, %d) of the initial value: copy them "
                                      "into the unit's shard before freeing Param.data" % (who, lo, hi))
            need = -(-end // W)
            if S < need or S > _round_up(need, FLAT_ALIGN):
                raise CheckFailed("rank %d: flat unit %d (%s) has S = %d for %d elements on %d ranks: S is ceil(%d / "
                                  "%d) = %d (rounded up to at most %d): more is padding"
                                  % (rank, unit, ps[0]["module"], S, end, W, end, W, need,
                                     _round_up(need, FLAT_ALIGN)))
        for u in d.get("flat_units") or []:
            what = "rank %d: flat unit %s (%s)" % (rank, u.get("flat_unit"), u.get("module"))
            if u.get("views_in_shard") is False or u.get("shard_in_allocation") is False:
                raise CheckFailed("%s: its params' DTensor.local are not views into one [S] allocation (device.h, "
                                  "PLACEMENT_FLAT)" % what)
            if u.get("padding_is_zero") is False:
                raise CheckFailed("%s: the shard's elements outside every param's piece are not zero: zero the "
                                  "unit's shard (fresh memory is NaN-filled)" % what)
