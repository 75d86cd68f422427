"""The analytic memory model: rank 0's peak bytes predicted from the model's sizes and the
stage's schedule alone, and the replay of a run's memory snapshot it is compared with.

tools/bench.py (section 4) and tests/test_memory_model.py put it next to the measured peak;
the runtime's allocator counts requested bytes in host call order, so the two are equal to
the byte. A stage's schedule comes from grader/manifest.py: its Stage's forward_only, ac and
zero2 (from the flags; which blocks recompute and what they keep: --ac, --ac-every N, --ac-op) and prefetch (which all-gather runs one module ahead).
Standard library only.
"""
import json
import os
import re
from collections import defaultdict

import manifest
from gradelib.util import padded_rows
from trace_names import ALL_GATHER, REDUCE_SCATTER
# the memory tags (MemTag)
from trace_names import (TAG_ACTIVATION, TAG_COMM_BUFFER, TAG_GRAD_SHARD, TAG_OPTIM_STATE, TAG_PARAM_SHARD, TAG_TEMP,
                         TAG_UNSHARDED_GRAD, TAG_UNSHARDED_PARAM)


# ----------------------------------------------------------------- model sizes

def attention_tiles():
    """The CPU flash attention's tiles (query rows, keys), as common/model/ops.h defines them: its
    backward's scratch is D [T] and two tiles (ops.c attention_scratch_floats)."""
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "common", "model", "ops.h")) as fh:
        text = fh.read()
    return tuple(int(re.search(r"#define ATTENTION_TILE_%s (\d+)" % w, text).group(1)) for w in "QK")


def hidden_dim(dim, multiple_of, ffn_dim_multiplier=0.0):
    """The SwiGLU width F: Llama's 2/3 of 4 x dim, scaled, rounded up to multiple_of, as model_config_finalize
    derives it: 11008 / 13824 / 28672 for Llama 2 7B / 13B / 70B (dim 4096 / 5120 / 8192, multiple_of 256 / 256 /
    4096, multiplier none / none / 1.3), 14336 / 28672 / 53248 for Llama 3 and 3.1's 8B / 70B / 405B (dim 4096 /
    8192 / 16384, multiple_of 1024 / 4096 / 4096, multiplier 1.3 / 1.3 / 1.2)."""
    h = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier:
        h = int(ffn_dim_multiplier * h)
    return multiple_of * ((h + multiple_of - 1) // multiple_of)


def model_dims(run_json):
    """Dims from a run's run.json (the config, not a measurement)."""
    c = dict(run_json)
    kv = c.get("n_kv_heads") or c["n_heads"]
    d = {"D": c["dim"], "L": c["n_layers"], "H": c["n_heads"], "KV": kv, "V": c["vocab_size"],
         "hd": c["dim"] // c["n_heads"], "F": hidden_dim(c["dim"], c["multiple_of"], c.get("ffn_dim_multiplier", 0.0))}
    if "hidden_dim" in c and c["hidden_dim"] != d["F"]:
        # run.json states F but not the multiplier: a flavour with one (8B, 70B, llama2-70B, llama3.1-*) or
        # --ffn-dim-multiplier takes the runtime's F (hidden_dim above derives the same from the multiplier)
        d["F"] = c["hidden_dim"]
    return d


def module_shapes(m):
    """[(module name, [(dim0, row_numel), ...])] in forward order, as common/model/model.c builds them."""
    D, H, KV, hd, F, V = m["D"], m["H"], m["KV"], m["hd"], m["F"], m["V"]
    block = [(D, 1), (H * hd, D), (KV * hd, D), (KV * hd, D), (D, H * hd), (D, 1), (F, D), (D, F), (F, D)]
    return [("embedding", [(V, D)])] + [("block%d" % i, block) for i in range(m["L"])] + [("head", [(D, 1), (V, D)])]


def n_params(m):
    """Parameters of every module, the embedding included."""
    return sum(a * b for _, ps in module_shapes(m) for a, b in ps)


def flops_per_token(m, T):
    """Training FLOPs per token: 6 x non-embedding params (forward 2N, backward 4N; the output
    projection counts, the embedding lookup does not) + the attention matmuls QK^T and PV:
    forward 2 x 2 x T x (H*hd) per layer per token, x3 for forward+backward = 12 L T (H*hd).
    (Full T x T scores, PaLM's convention; the causal half the kernel could skip is counted.)"""
    non_emb = n_params(m) - m["V"] * m["D"]
    return 6 * non_emb + 12 * m["L"] * T * m["H"] * m["hd"]


# ----------------------------------------------------------- analytic memory model

def mesh_shape(flags, world):
    """(R, S) of the --mesh R,S (or RxS; one argument or two) in a stage's flags; (1, world) without one."""
    for i, f in enumerate(flags):
        value = f[len("--mesh="):] if f.startswith("--mesh=") else flags[i + 1] if f == "--mesh" else None
        if value is not None:
            r, s = str(value).replace("x", ",").split(",")
            return int(r), int(s)
    return 1, world


def recomputes(flags, layer):
    """Does block `layer` (0-based) recompute under these flags? The runtime's rule is model.h's
    ac_block_recomputes (stated per run in run.json's recompute_blocks); this model has no run to read, so it
    restates it, and tests/test_memory_model.py holds the two equal on every case it runs."""
    mode, every = manifest.ac_mode(flags)
    return mode in ("full", "op") or (mode == "every" and (layer + 1) % every == 0)


def memory_model(m, B, T, W, stage):
    """Peak bytes of rank 0 predicted from the sizes alone, with the live set by tag.

    Fixed: sharded params (sum over params of ceil(d0/W) * row, rank 0 holds the padded
    chunk; W is the ranks a param is split over: the world, or S of HSDP's --mesh R,S)
    + AdamW exp_avg and exp_avg_sq (2x the shard; none with --forward-only); with
    --offload-params these and the grad shards live in host memory, not counted here.
    Per point of the step (end of every module's forward; every module's backward at its
    last scratch allocation) add: saved activations alive there, backward scratch,
    unsharded params (one module; with ZeRO-2 every module from its forward to its
    backward), unsharded grads of the module in backward, the all-gather buffers (W x a
    module's padded shard: the prefetched one, or the AllGatherState kept until the next
    all-gather's stream waits for its copy-out), the ReduceScatterState (the previous
    module's reduce-scatter input, W x its padded shard, kept until compute waits for its
    reduce-scatter) and the grad shards already reduce-scattered (modules after it). The
    model's peak is the largest point."""
    # m: model_dims(); B: batch per rank; T: sequence length; W: world size; stage: a
    # grader/manifest.py Stage. Returns (bytes, "module phase", {tag: bytes}) of the largest
    # point. (The docstring above is printed in the report as the model's description.)
    fwd_prefetch = "forward" in stage.prefetch    # module i+1's all-gather buffer alive in module i's forward
    # module i-1's all-gather buffer alive in module i's backward: prefetched at its start (the pre policy; post
    # issues it once module i's backward is done, none not at all)
    bwd_prefetch = "backward" in stage.prefetch and stage.backward_prefetch == "pre"
    offload = stage.offload                       # shards, grad shards and optimizer state in host memory
    ag_state = ALL_GATHER in stage.streams        # all-gather output kept (AllGatherState) until its stream waited
    rs_state = REDUCE_SCATTER in stage.streams    # reduce-scatter input kept (ReduceScatterState) until compute waited
    f4 = 4
    D, L, H, KV, hd, V, F = m["D"], m["L"], m["H"], m["KV"], m["hd"], m["V"], m["F"]
    N = B * T
    mods = module_shapes(m)
    M = len(mods)
    shard = [sum(padded_rows(a, W) * b for a, b in ps) for _, ps in mods]  # rank 0's padded chunk
    full = [sum(a * b for a, b in ps) for _, ps in mods]
    agbuf = [W * s for s in shard]
    fixed = {TAG_PARAM_SHARD: 0 if offload else sum(shard) * f4,
             TAG_OPTIM_STATE: 0 if stage.forward_only or offload else 2 * sum(shard) * f4}
    # activations (floats); every module's output is owned by the next module as its input x
    const = 2 * N + 2 * (T * hd // 2) + 1            # inputs, targets (int32), rope cos/sin, loss
    x_in = N * D                                       # embedding out / a block's out
    blk_saved = (N * D + N + N * H * hd + 2 * N * KV * hd + B * H * T + N * H * hd
                 + N * D + N * D + N + 3 * N * F)      # xn rstd1 q k v lse att h hn rstd2 w1_out w3_out swiglu
    head_saved = N * D + N + N * V                     # xn rstd logits
    tq, tk = attention_tiles()
    blk_tmp = (3 * N * F + N * D + N * H * hd + N * H * hd + 2 * N * KV * hd + T + 2 * tq * tk + N * D
               + N * D)  # dswiglu dw1_out dw3_out dhn datt dq dk dv att_scratch dxn + dh (the incoming grad)
    head_tmp = N * V + N * D + N * D                   # dlogits dxn dx
    # what block j keeps from its forward to its backward besides its input x: everything, nothing (it
    # recomputes: --ac, --ac-every's blocks), or with --ac-op torchtitan's saved outputs q v lse att w1_out
    op_kept = N * H * hd + N * KV * hd + B * H * T + N * H * hd + N * F
    op = manifest.ac_mode(stage.flags)[0] == "op"
    held = [(op_kept if op else 0) if recomputes(stage.flags, j) else blk_saved for j in range(L)]
    points = []

    def point(where, act, tmp=0, uparam=0, ugrad=0, comm=0, gshard=0):
        tags = dict(fixed)
        tags.update({TAG_ACTIVATION: (const + act) * f4, TAG_TEMP: tmp * f4, TAG_UNSHARDED_PARAM: uparam * f4,
                     TAG_UNSHARDED_GRAD: ugrad * f4, TAG_COMM_BUFFER: comm * f4, TAG_GRAD_SHARD: gshard * f4})
        points.append((sum(tags.values()), where, {k: v for k, v in tags.items() if v}))

    # forward, at the end of module i's forward (all its allocations made)
    for i in range(M):
        if i == 0:
            act = x_in
        elif i < M - 1:
            j = i - 1  # block j: inputs of blocks 0..j, its output, what blocks 0..j-1 kept, its whole set
            act = (j + 2) * x_in + sum(held[:j]) + blk_saved
        else:
            act = (L + 1) * x_in + sum(held) + head_saved
        uparam = sum(full[:i + 1]) if stage.zero2 else full[i]
        # the prefetched all-gather of i+1 (which dropped i's AllGatherState); the last module's state
        # lives on through its forward
        comm = (agbuf[i + 1] if fwd_prefetch and i + 1 < M else agbuf[i] if ag_state else 0)
        point("%s forward" % mods[i][0], act, uparam=uparam, comm=comm)
    if stage.forward_only:
        return max(points)
    # backward, module i at its last scratch allocation
    for i in range(M - 1, -1, -1):
        gshard = 0 if offload else sum(shard[i + 1:])
        uparam = sum(full[:i + 1]) if stage.zero2 else full[i]
        if stage.zero2 or not ag_state:
            comm = 0                                # no all-gather in backward / all-gathers on compute
        elif bwd_prefetch:
            comm = agbuf[i - 1] if i >= 1 else agbuf[0]  # the prefetch; module 0's state until finish_backward
        else:
            comm = agbuf[i]                         # i's AllGatherState, dropped by the next pre_backward
        if rs_state and i + 1 < M:
            comm += agbuf[i + 1]                    # ReduceScatterState: module i+1's reduce-scatter input
        if i == M - 1:
            act = (L + 1) * x_in + sum(held) + head_saved
            tmp = head_tmp
        elif i >= 1:
            j = i - 1  # block j's whole set again (kept, or rebuilt by its recompute)
            act = (j + 1) * x_in + sum(held[:j]) + blk_saved
            tmp = blk_tmp
        else:
            act, tmp = 0, x_in
        point("%s backward" % mods[i][0], act, tmp=tmp, uparam=uparam, ugrad=full[i], comm=comm, gshard=gshard)
    return max(points)


def replay_peak(memory_json, step=None):
    """Replay alloc/free events of memory_rank<r>.json up to the highest current_bytes of a
    training step (or of `step`, 0-based); return (peak bytes, where, live bytes by tag, live
    names by tag)."""
    with open(memory_json) as fh:
        d = json.load(fh)
    live, best, best_at, best_live = {}, -1, None, None
    for e in d["events"]:
        a = e.get("action")
        if a == "alloc":
            live[e["addr"]] = e
        elif a in ("free", "free_completed"):  # free_requested (dev_record_stream): still counted
            live.pop(e["addr"], None)
        else:
            continue
        if e["step"] >= 0 and (step is None or e["step"] == step) and e["current_bytes"] > best:
            best, best_at, best_live = e["current_bytes"], e, list(live.values())
    by_tag, names = defaultdict(int), defaultdict(lambda: defaultdict(int))
    for e in best_live or []:
        by_tag[e["tag"]] += e["size"]
        short = e["name"].split(".")[-1] if e["tag"] == TAG_ACTIVATION else e["name"]
        names[e["tag"]][short] += 1
    where = "step %d %s %s (%s)" % (best_at["step"] + 1, best_at["module"], best_at["phase"], best_at["name"]) \
        if best_at else "?"
    return best, where, dict(by_tag), {t: dict(v) for t, v in names.items()}
