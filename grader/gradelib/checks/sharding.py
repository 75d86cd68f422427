"""DTensors (every stage): each rank's shard of every param as torch.chunk splits it over its shard group,
read from the dtensors_rank<r>.json dump written right after fsdp_init; and the grad shards' padding rows, zero
before each optimizer step as the shards' own (the "grad_padding" notes of the memory snapshots).
"""
import math

from ..util import CheckFailed, chunk, mesh_shape
from .registry import SAYS_WHAT_RAN, check


@check("dtensors", label="DTensors", variants=True, tier=SAYS_WHAT_RAN)
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
