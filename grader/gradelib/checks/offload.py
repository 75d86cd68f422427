"""Stage 10's knobs: the backward prefetch policy (pre, post, none; one comm stream) and the shards offloaded to
host memory.
"""
import math

import manifest
from trace_names import (ALL_GATHER, BACKWARD_PHASES, COLLECTIVE, COMPUTE_TID, COPY, D2H, H2D, REDUCE_SCATTER,
                         label_and_kind)
from trace_names import TAG_GRAD_SHARD, TAG_OPTIM_STATE, TAG_PARAM_SHARD  # the memory tags (MemTag)

from ..util import CheckFailed, chunk, fmt_bytes, padded_rows
from .common import two_sizes
from .registry import SAYS_WHAT_RAN, SAYS_WHICH_BUFFER, check


PREFETCH_ADVICE = {
    "pre": "issue module i-1's all-gather in module i's fsdp_pre_backward, right after waiting for module i's own",
    "post": "issue module i-1's all-gather in module i's fsdp_post_backward, after its reduce-scatter is issued",
    "none": "issue no all-gather ahead: each module's own fsdp_pre_backward issues (and waits for) its all-gather",
}


@check("prefetch_policy", label="backward prefetch follows the policy", variants=True, tier=SAYS_WHAT_RAN)
def check_prefetch_policy(ctx):
    """Where every backward all-gather was issued (the trace's module and phase of the hook that queued it),
    against where the policy issues it as the runtime states the rule (run.json's prefetch_schedule, written by
    common/driver/flag_check.c, which also stops a run whose hooks follow another policy): module i-1's in
    module i's pre_backward (pre), in module i's post_backward (post), or in its own pre_backward (none); the
    first module of the backward always in its own pre_backward. Without --single-comm-stream the reduce-scatters
    have a stream of their own (with it, the runtime stops a run whose collectives use two)."""
    policy = manifest.flag_value(ctx.flags, "--backward-prefetch", "pre")
    single = "--single-comm-stream" in ctx.flags
    zero2 = "--reshard-after-forward=false" in ctx.flags
    order, _ = ctx.module_order()
    rule = ctx.run_json().get("prefetch_schedule")
    issued_in = rule.get("issued_in") if isinstance(rule, dict) else None
    if not (isinstance(issued_in, dict) and all(
            isinstance(issued_in.get(m), list) and len(issued_in[m]) == 2 and all(isinstance(x, str) for x in issued_in[m])
            for m in order)):
        raise CheckFailed("run.json states no backward-prefetch schedule for the modules %s (\"prefetch_schedule\": "
                          "the runtime writes it at the end of a run without --pp)" % ", ".join(order))
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
        # with --single-comm-stream a second stream stops the run (common/driver/flag_check.c, every step): the
        # rule's one statement; without it the reduce-scatters need their own stream to overlap
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
            for mod in order:
                got = issued.get((step, mod), [])
                want = tuple(issued_in[mod])
                if got != [want]:
                    where = ", ".join("%s's %s" % g for g in got) or "none"
                    raise CheckFailed("%s's backward all-gather (step %d, rank %d) was issued in %s, expected %s's %s "
                                      "(--backward-prefetch %s): %s" % (mod, step + 1, r, where, want[0], want[1],
                                                                        policy, PREFETCH_ADVICE[policy]))
    if zero2:
        return "no backward all-gather (ZeRO-2 kept the params)%s" % (" on one comm stream" if single else "")
    return "backward all-gathers issued as --backward-prefetch %s says%s" % (
        policy, " on one comm stream" if single else "")


@check("offload_memory", label="shards offloaded to host memory", variants=True, tier=SAYS_WHICH_BUFFER)
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
                                  "rows)" % ((where,) + two_sizes(got, shard_bytes) + (W,)))
            opt = host.get(TAG_OPTIM_STATE, 0)
            if opt and opt != optim_bytes:
                raise CheckFailed("%s the host optimizer state takes %s, expected %s (exp_avg and exp_avg_sq of this "
                                  "rank's rows)" % ((where,) + two_sizes(opt, optim_bytes)))
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
