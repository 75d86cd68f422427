"""Mixed precision (stage 08): the bytes per element each collective moves, and the unsharded params kept in
bfloat16 only.
"""
import math

from trace_names import ALL_GATHER, REDUCE_SCATTER, label_and_kind

from ..util import CheckFailed, fmt_bytes, mp_policy, padded_rows
from .common import note_where
from .registry import SAYS_WHAT_RAN, check


DTYPE_BYTES = {"fp32": 4, "bf16": 2}
TRACE_DTYPE = {"fp32": "f32", "bf16": "bf16"}  # the trace's args.dtype of a collective


MP_ADVICE = {
    (ALL_GATHER, "bf16"): "with --param-dtype bf16 cast each padded shard to bfloat16 on copy-in "
                            "(launch_cast_batch_to_bf16 into this rank's segment) and all-gather the 16-bit words "
                            "(coll_all_gather_bf16)",
    (ALL_GATHER, "fp32"): "without --param-dtype bf16 the all-gather moves the float32 shards",
    (REDUCE_SCATTER, "fp32"): "--reduce-dtype fp32 is FSDP2's reduce_dtype=torch.float32: reduce-scatter the "
                                "float32 grads (coll_reduce_scatter); rounding them to bfloat16 first drops their "
                                "low bits before the sum",
    (REDUCE_SCATTER, "bf16"): "with --reduce-dtype bf16 cast the grads into a bfloat16 reduce-scatter input "
                                "(launch_cast_batch_to_bf16), reduce-scatter the 16-bit words (coll_reduce_scatter_bf16) "
                                "and widen the result into the float32 grad shards",
}


@check("mp_bytes", label="bytes per element on the wire", variants=True, tier=SAYS_WHAT_RAN)
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


@check("mp_params", label="unsharded params in bfloat16", variants=True, tier=SAYS_WHAT_RAN)
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
            where = "after %s's %s (%s)" % (n["module"], n["hook"], note_where(n, rank))
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
