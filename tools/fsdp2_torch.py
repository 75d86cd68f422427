"""The PyTorch side of `make fsdp2-check`: one C run's configuration trained by real FSDP2.

Needs torch >= 2.6 (torch.distributed.fsdp.fully_shard); tools/fsdp2_check.py starts it under
build/fsdp2-venv's python. W CPU processes (torch.multiprocessing) join a gloo process group
(one thread each) and train tools/torch_llama.py's Llama, sharded in the groups torchtitan
and the C runtime use: fully_shard on tok_embeddings ("embedding"), on every block
("block<i>"), on [norm, output] ("head"), then on the root, which keeps no parameter of its
own. Every group reshards after forward as the run's flag says (torchtitan's default keeps
[norm, output] unsharded; the C runtime reshards it like the others, and so does this). What
the C run did is what this run does (read from the C run's run.json and the stage's flags):

- the same initial weights (the C driver's --save-init file), the same token file and
  data-order contract (rank r takes rows r*B .. r*B+B-1 of torch_llama.global_batch),
- --ac: torch's checkpoint wrapper around every block before fully_shard (torchtitan's way),
- --reshard-after-forward=false: fully_shard(..., reshard_after_forward=False),
- --grad-accum K: each rank's batch split into K microbatches, (loss / K).backward() each;
  --grad-sync last: set_requires_gradient_sync(False) on microbatches 0..K-2;
  --reshard-after-backward=false: set_reshard_after_backward(False) on those too,
- --param-dtype / --reduce-dtype (stage 08): MixedPrecisionPolicy(param_dtype, reduce_dtype),
- AdamW (betas 0.9/0.95, eps 1e-8, the run's lr and weight decay, single-tensor), torchtitan's
  linear warmup (LambdaLR), clipping to --max-norm.

- --offload-params (stage 10): fully_shard(..., offload_policy=CPUOffloadPolicy(pin_memory=False))
  (on a CPU mesh the shards already live in host memory: the same arithmetic, no copies),
- --backward-prefetch (stage 10): pre is FSDP2's default (module i's pre-backward all-gathers
  module i-1 after its own); none turns that off on every param group (FSDPParamGroup's
  _backward_prefetch, private, replaced by a no-op: each module all-gathers in its own
  pre-backward); post has no FSDP2 counterpart (FSDP1's BACKWARD_POST) and runs FSDP2's default,

- --mesh R,S (stage 09, HSDP): fully_shard on a 2-D DeviceMesh (init_device_mesh("cpu", (R, S),
  mesh_dim_names=("replicate", "shard"))): rank i*S + j in row i (the shard group, dim 1) and
  column j (the replicate group, dim 0). Without --mesh the mesh is 1-D over the world, its dim
  named "shard" as the C run's dtensors json names it.

The grad norm is the square root of the squares of every DTensor grad's local shard, summed
in float64 and all-reduced in float64 over the shard group (the mesh dim the grads are Shard(0)
on; with a 2-D mesh the R replicas hold the same shards and are not summed again): torch's
float32 clip_grad_norm_ sums without cascading and is off by up to ~1.5e-4 relative on the
debugmodel. Torch's own total norm of the DTensor grads (torch.nn.utils.get_total_norm, float32)
is computed as well, every step: it is the norm by torch's definition, its all-reduce is the
grad norm's collective counted below, and its value goes into rank<r>.json beside the float64 one
(fsdp2_check.py checks they agree to float32 precision). The clip coefficient is torch's formula,
max_norm / (norm + 1e-6) clamped to 1 in float32, on the float64 norm, applied to the local grads.

Collectives: torch.distributed's all-gather, reduce-scatter and all-reduce entry points are
wrapped, and so is the functional all-reduce DTensor reduces a Partial placement with (the grad
norm's); FSDPParamGroup.unshard / post_backward say which module a collective belongs to (the
total norm counts as module "grad_norm", phase "optimizer"); the loop says the phase as the C
runtime's host scope does (forward: the model call and the loss; backward: loss.backward(),
recompute included), the step and the microbatch. Each collective is keyed by its group too,
as the ranks in it (fsdp2_check.py names them as the C trace does), and by its size in bytes;
its reduce op is noted. The tool's own reductions (the float64 norm, the mean loss) use the
unwrapped all_reduce and are not counted. A collective outside the loop is counted in the phase
"outside" (the C run has none: the comparison fails). Each all-gather in the backward is also
listed with the hook that issued it, (module, pre_backward | post_backward) of the param group
whose FSDPParamGroup.pre_backward / post_backward runs (FSDP2's backward prefetch issues the
previous module's from inside this module's pre_backward), as the C trace's args.module and
args.phase name the host hook.

Pipeline runs (stages 11 and 12: job["pipeline"] with --pp P, --microbatches M, --pp-schedule): rank
p*S + j (S = W / P) is shard j of stage p on a DeviceMesh ("pp", "dp") of shape (P, S). The stage's
module is the Llama cut as the C runtime cuts it (fsdp2_check.py gives the blocks of each stage): the
embedding on stage 0, the blocks of the stage (their names keep the global index), norm and output
on stage P-1; the modules it does not hold are None (torch_llama.Transformer.forward passes through,
torchtitan's way). With --ac its blocks are checkpoint-wrapped; with S > 1 each module is
fully_shard'ed over the "dp" dim (embedding, every block, [norm, output], then the stage's root), with
the run's reshard_after_forward. torch.distributed.pipelining.PipelineStage wraps it (static shapes:
the microbatch's tokens or activation in, the activation or logits out, so no metadata is exchanged;
P2P in the "pp" group), and ScheduleGPipe or Schedule1F1B runs M microbatches (torch.tensor_split of
the shard's B rows: contiguous, as the C runtime's). The loss_fn is the cross entropy's mean / M with
scale_grads=False, which is the C run's loss: each microbatch's mean / M, the M backwards accumulating
the batch's mean. PipelineStage drives FSDP itself: before every backward it clears
requires_gradient_sync and reshard_after_backward on the stage's root, and after the schedule
(perform_reduce_grad) sets both and finalizes the backward, which reduce-scatters each module once.
torch 2.15's Schedule1F1B refuses M < P (a ValueError in its __init__); for such a run (stage 11's
pp_few_microbatches) the schedule is Schedule1F1B with that check skipped (its _step_microbatches
handles M < P: min(M, P - p) warm-up forwards), said in rank<r>.json's pipeline.schedule.

Data: shard j reads rows j*B .. j*B+B-1 of torch_llama.global_batch at world S (every stage of the
shard the same rows; stage 0 uses the tokens, stage P-1 the targets). Each step: the schedule; the
loss is the sum of the last stage's M microbatch losses, averaged over its S shards (an all-reduce
over the world, uncounted); the grad norm sums the squares of every local grad (plain tensors, or
the DTensor grads' local shards) in float64 over the world: every stage and shard holds different
elements. Then torch's clip factor on that norm, AdamW on the stage's parameters, the LambdaLR.

What the run records of the schedule, per rank and step: the passes in the order they ran, ("F" |
"B", microbatch), from wrappers of the stage's forward_one_chunk / backward_one_chunk; the point to
point groups, each the ops of one call of the schedule's _batch_p2p (torch.distributed.pipelining.
schedules: every transfer of ScheduleGPipe and Schedule1F1B goes through it, as batch_isend_irecv or,
for a batch of sends only or receives only, one isend / irecv each), each op as [send | recv, peer
(global rank), microbatch, act | grad]: the microbatch and what moves from the stage's
get_fwd_recv_ops / get_fwd_send_ops (act) and get_bwd_recv_ops / get_bwd_send_ops (grad) that made
the op. torch.distributed's isend / irecv are wrapped too: those issued outside a schedule batch
(PipelineSchedule's one-off exchange that connects each pair of peers before the first step) are
counted apart (pipeline.p2p_outside_schedule), not as the schedule's. The collectives (S > 1) are
counted as above, with the phase and microbatch of the pass that issued them; the reduce-scatters of
perform_reduce_grad, after the step's last backward, are filed under that backward (its microbatch),
as the C runtime files the reduce-scatter of the step's last backward.

Writes into OUT, per rank:
  rank<r>.json                  steps (loss, grad norm, lr), collectives, reduce ops, the mesh, DTensor layout
                                after fully_shard, the backward all-gathers by issuing hook, the schedule
  shards_rank<r>.safetensors    the local shards after training: params, optim.<name>.exp_avg(_sq)
                                (not for a pipeline run: its rank<r>.json has "pipeline" instead of the layout)
"""
import datetime
import functools
import inspect
import json
import math
import os
from collections import Counter

import torch
import torch.distributed as dist

import repo_paths  # noqa: F401  (grader/ on sys.path, for trace_names)
import torch_llama  # the PyTorch Llama the parity tests use (tools/, this file's folder)
from trace_names import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER

AC_PREFIX = "_checkpoint_wrapped_module."
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# torch.distributed functions FSDP2 issues its collectives through (the names changed over versions), each
# with the kind the C trace names it by; all_reduce: HSDP's all-reduce of the grad shards across the replicate group
COLLECTIVE_FUNCTIONS = {"all_gather_single": ALL_GATHER, "all_gather_into_tensor": ALL_GATHER,
                        "reduce_scatter_single": REDUCE_SCATTER, "reduce_scatter_tensor": REDUCE_SCATTER,
                        "all_reduce": ALL_REDUCE}
UNCOUNTED_ALL_REDUCE = dist.all_reduce  # the tool's own reductions (loss, float64 norm): never counted


def c_module(fqn):
    """The C runtime's module name for a torch module or parameter name (or FSDP2's group fqn)."""
    fqn = (fqn or "").replace(AC_PREFIX, "")
    if fqn.startswith("tok_embeddings"):
        return "embedding"
    if fqn.startswith("layers."):
        return "block" + fqn.split(".")[1]
    if fqn.startswith("norm") or fqn.startswith("output"):
        return "head"
    return fqn or "?"


TRACE_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}


def group_ranks(group):
    """The global ranks of a process group (None: the default group, the world), as a list."""
    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def op_name(op):
    """A reduce op as text: AVG, SUM, PREMUL_SUM, or a functional collective's string (upper-cased)."""
    if isinstance(op, str):
        return op.upper()
    return str(getattr(op, "name", op)).rsplit(".", 1)[-1].upper()


class CollectiveLog:
    """Counts FSDP2's collectives by (step, microbatch, module, kind, phase, group, dtype, bytes); group is the
    ranks of the process group as a comma-separated string, dtype the element type of the collective's output
    tensor (of its in-place tensor for an all-reduce), named as the C trace names it (f32, bf16), bytes what the
    C trace's args.bytes counts. The reduce ops seen are kept per kind (the grad norm's as
    grad_norm.all_reduce)."""

    def __init__(self):
        self.where = None   # (step, microbatch, phase) while the loop trains; None outside
        self.module = None  # the FSDP group whose unshard / post_backward runs now
        self.depth = 0      # a wrapped function calling another counts once
        self.counts = Counter()
        self.ops = {}       # kind -> set of reduce op names
        self.hook = None    # (module, pre_backward | post_backward) of the backward hook running now
        self.backward_gathers = Counter()  # (step, microbatch, module gathered, hook module, hook phase)

    def install(self):
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
        self.install_collectives()
        for method in ("unshard", "post_backward"):
            setattr(FSDPParamGroup, method, self._labelling(getattr(FSDPParamGroup, method)))
        for method in ("pre_backward", "post_backward"):
            setattr(FSDPParamGroup, method, self._hooking(getattr(FSDPParamGroup, method), method))

    def install_collectives(self):
        """Wrap torch.distributed's collectives and DTensor's functional all-reduce (FSDP1's and FSDP2's alike;
        the module each one belongs to comes from the caller's labelling: install, or tools/fsdp1_torch.py)."""
        from torch.distributed import _functional_collectives as funcol
        wrapped = 0
        for name, kind in COLLECTIVE_FUNCTIONS.items():
            if hasattr(dist, name):
                setattr(dist, name, self._counting(getattr(dist, name), kind, group_ranks))
                wrapped += 1
        if not wrapped:
            raise RuntimeError("torch.distributed has none of %s" % ", ".join(COLLECTIVE_FUNCTIONS))
        # DTensor's Partial placements reduce through funcol.all_reduce(tensor, reduceOp, group=(mesh, dim))
        funcol.all_reduce = self._counting(funcol.all_reduce, ALL_REDUCE, self._funcol_ranks(funcol))

    @staticmethod
    def _funcol_ranks(funcol):
        from torch.distributed.distributed_c10d import _resolve_process_group

        def ranks(group):
            g = funcol._resolve_group(group, "")
            return group_ranks(_resolve_process_group(g) if isinstance(g, str) else g)
        return ranks

    def _counting(self, fn, kind, ranks_of):
        sig = inspect.signature(fn)

        def wrapper(*args, **kwargs):
            outer = self.depth == 0
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                if outer:
                    bound = sig.bind_partial(*args, **kwargs).arguments
                    step, micro, phase = self.where or (-1, -1, "outside")
                    out = args[0] if args else next(iter(bound.values()), None)
                    # the list form (dist.all_gather, FSDP1's on CPU): its chunks, their dtype, the bytes of all
                    parts = out if isinstance(out, (list, tuple)) else None
                    if parts:
                        out = parts[0]
                    dtype = TRACE_DTYPES.get(getattr(out, "dtype", None), str(getattr(out, "dtype", "?")))
                    group = ",".join(str(r) for r in ranks_of(bound.get("group")))
                    # the bytes the C trace gives: an all-gather's output, a reduce-scatter's input (the
                    # group's segments), an all-reduce's tensor
                    moved = bound.get("input", bound.get("input_tensor")) if kind == REDUCE_SCATTER else out
                    nbytes = moved.numel() * moved.element_size() if hasattr(moved, "numel") else -1
                    if parts and kind != REDUCE_SCATTER:
                        nbytes = sum(t.numel() * t.element_size() for t in parts)
                    self.counts[(step, micro, self.module or "?", kind, phase, group, dtype, nbytes)] += 1
                    if kind == ALL_GATHER and phase == "backward":
                        hook = self.hook or ("?", "?")
                        self.backward_gathers[(step, micro, self.module or "?") + hook] += 1
                    op = bound.get("op", bound.get("reduceOp"))
                    if kind != ALL_GATHER:
                        what = kind if self.module != "grad_norm" else "grad_norm." + kind
                        self.ops.setdefault(what, set()).add(op_name(op) if op is not None else "SUM")
        return wrapper

    def _labelling(self, method):
        def wrapper(group, *args, **kwargs):
            before, self.module = self.module, c_module(getattr(group, "_module_fqn", None))
            try:
                return method(group, *args, **kwargs)
            finally:
                self.module = before
        return wrapper

    def _hooking(self, method, phase):
        def wrapper(group, *args, **kwargs):
            before, self.hook = self.hook, (c_module(getattr(group, "_module_fqn", None)), phase)
            try:
                return method(group, *args, **kwargs)
            finally:
                self.hook = before
        return wrapper

    def issue_points(self):
        return [{"step": k[0], "microbatch": k[1], "module": k[2], "hook_module": k[3], "hook_phase": k[4],
                 "count": n} for k, n in sorted(self.backward_gathers.items())]

    def rows(self):
        return [{"step": k[0], "microbatch": k[1], "module": k[2], "kind": k[3], "phase": k[4], "group": k[5],
                 "dtype": k[6], "bytes": k[7], "count": n} for k, n in sorted(self.counts.items())]


# ---------------------------------------------------------------------------- the model

def build_model(job):
    """tools/torch_llama.py's Llama with the C run's dimensions and initial weights."""
    d = job["model"]
    args = torch_llama.ModelArgs(d["dim"], d["n_layers"], d["n_heads"], d["n_kv_heads"], d["vocab_size"],
                                 d["multiple_of"], d.get("ffn_dim_multiplier") or None)
    if args.hidden_dim != d["hidden_dim"]:
        raise ValueError("torch_llama's FFN width %d is not the C run's %d" % (args.hidden_dim, d["hidden_dim"]))
    model = torch_llama.Transformer(args)
    weights = torch_llama.read_safetensors(job["init"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name not in weights or tuple(weights[name].shape) != tuple(p.shape):
                raise ValueError("%s: no tensor %s of shape %s" % (job["init"], name, list(p.shape)))
            p.copy_(weights[name])
    return model, weights


def checkpoint_blocks(model, job):
    """Activation checkpointing as the C run did it (run.json): torch's checkpoint wrapper around each block the
    runtime recomputed (recompute_blocks: every block with --ac, every N-th with --ac-every N; torchtitan's way).
    --ac-op (torchtitan's per-op policy) has no mapping here yet: said, not run as something else."""
    mode = job["ac"]
    if mode in (False, None, "none"):
        return
    if mode == "op":
        raise SystemExit("fsdp2-check: --ac-op (per-op selective checkpointing) is not mapped onto torch here")
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    blocks = job.get("recompute_blocks")
    for name in list(model.layers.keys()):
        if blocks is None or "block%s" % name in blocks:  # an older run.json: "ac": true, every block
            model.layers[name] = checkpoint_wrapper(model.layers[name], preserve_rng_state=False)


def shard(model, job, mesh):
    """Activation checkpointing, then fully_shard per module group and on the root (torchtitan's order)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    checkpoint_blocks(model, job)
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[job["param_dtype"]] if job["param_dtype"] else None,
                              reduce_dtype=DTYPES[job["reduce_dtype"]] if job["reduce_dtype"] else None)
    kw = {"mesh": mesh, "reshard_after_forward": job["reshard_after_forward"], "mp_policy": mp}
    if job.get("offload"):
        from torch.distributed.fsdp import CPUOffloadPolicy
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)  # pinning needs CUDA
    fully_shard(model.tok_embeddings, **kw)
    for block in model.layers.values():
        fully_shard(block, **kw)
    fully_shard([model.norm, model.output], **kw)
    fully_shard(model, **kw)
    if job["force_sum_reduction"]:
        model.set_force_sum_reduction_for_comms(True)
    if job.get("backward_prefetch") == "none":
        for m in model.modules():
            if isinstance(m, FSDPModule):
                group = m._get_fsdp_state()._fsdp_param_group
                if group is not None:
                    group._backward_prefetch = lambda: None  # each module all-gathers in its own pre-backward
    return model


def schedule(job):
    """What FSDP2's run did for --backward-prefetch and --offload-params, in words (rank<r>.json)."""
    bp = job.get("backward_prefetch") or "pre"
    return {"backward_prefetch": {"pre": "FSDP2's default: the previous module, in this module's pre-backward",
                                  "none": "off: FSDPParamGroup._backward_prefetch replaced by a no-op",
                                  "post": "FSDP2's default (pre): FSDP2 has no post policy"}.get(bp, bp),
            "offload": "CPUOffloadPolicy(pin_memory=False)" if job.get("offload") else None}


def fsdp_params(model):
    """{id(sharded param): FSDPParam}: FSDP2's own record of each shard (padding included)."""
    from torch.distributed.fsdp import FSDPModule
    out = {}
    for m in model.modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            for fp in (group.fsdp_params if group else []):
                out[id(fp.sharded_param)] = fp
    return out


def placement_name(p):
    from torch.distributed.tensor import Replicate, Shard
    if isinstance(p, Shard):
        return "Shard(%d)" % p.dim
    if isinstance(p, Replicate):
        return "Replicate()"
    return str(p)


def mesh_record(mesh):
    """The mesh's shape and this rank's place on its shard dim, as the top of dtensors_rank<r>.json has them."""
    names = list(mesh.mesh_dim_names or [])
    dim = names.index("shard") if "shard" in names else mesh.ndim - 1
    return {"mesh_shape": list(mesh.shape), "mesh_dim_names": names, "shard_rank": mesh.get_local_rank(dim),
            "shard_size": mesh.size(dim)}


def dtensor_layout(model, weights):
    """Each parameter's DTensor as FSDP2 made it, in the fields of the C run's dtensors_rank<r>.json: the mesh's
    ranks (flattened), shape, dim names and placements; placement is the one on the shard dim (the last)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    records = fsdp_params(model)
    out = []
    for name, p in model.named_parameters():
        name = name.replace(AC_PREFIX, "")
        local = p.to_local()
        shape = list(p.shape)
        row_numel = math.prod(shape[1:])
        _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        rows = local.shape[0] if local.dim() else 1
        fp = records.get(id(p))
        padded = int(fp.padded_sharded_param_size[0]) if fp is not None else None
        pad_zero = None
        if fp is not None and hasattr(fp, "_sharded_param_data"):
            pad_zero = bool((fp._sharded_param_data[local.numel():] == 0).all())
        want = weights[name][offset[0]:offset[0] + rows]
        placements = [placement_name(x) for x in p.placements]
        out.append({"name": name, "module": c_module(name), "global_shape": shape,
                    "mesh": p.device_mesh.mesh.flatten().tolist(), "mesh_shape": list(p.device_mesh.shape),
                    "mesh_dim_names": list(p.device_mesh.mesh_dim_names or []), "placements": placements,
                    "placement": placements[-1],
                    "local_rows": rows, "padded_rows": padded, "row_offset": int(offset[0]), "row_numel": row_numel,
                    "global_rows": shape[0], "local_matches_init": bool(torch.equal(local, want)),
                    "padding_is_zero": pad_zero})
    return out


# ---------------------------------------------------------------------------- training

def rank_batch(tokens, step, rank, job):
    """This rank's B sequences of step s (the data-order contract, common/model/data.h)."""
    W, B, T = job["world"], job["batch_size"], job["seq_len"]
    inputs, targets = torch_llama.global_batch(tokens, step, W, B, T)
    return inputs[rank * B:(rank + 1) * B], targets[rank * B:(rank + 1) * B]


def grad_norm_f64(model, shard_group):
    """sqrt of the sum of squares of every grad, in float64 on each shard and across the shard group (each
    shard once: the replicas of an HSDP mesh hold the same shards)."""
    total = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if p.grad is not None:
            total += p.grad.to_local().double().pow(2).sum()
    UNCOUNTED_ALL_REDUCE(total, group=shard_group)
    return math.sqrt(total.item())


def grad_norm_dtensor(model):
    """torch's total norm of the DTensor grads (float32, as clip_grad_norm_ computes it): DTensor reduces the
    Partial norm over the mesh dims the grads are sharded on; full_tensor() is a no-op when that already ran."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None], 2.0,
                                         foreach=False)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def clip(model, norm, max_norm):
    """torch's clip_grad_norm_ factor on the exact norm, applied to every grad's local shard (a DTensor's under
    FSDP2; FSDP1's flat parameter's grad is its shard already)."""
    coef = torch_llama.clip_coefficient(norm, max_norm)
    if coef is None:
        return
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).mul_(coef)


def mean_over_ranks(value):
    t = torch.tensor([value], dtype=torch.float64)
    UNCOUNTED_ALL_REDUCE(t)
    return t.item() / dist.get_world_size()


def set_microbatch(model, job, k):
    """FSDP2's user-side switches for microbatch k of K, as the C loop sets them on every module."""
    K = job["grad_accum"]
    if K == 1:
        return
    last = k == K - 1
    model.set_requires_gradient_sync(last or job["grad_sync_every"])
    model.set_reshard_after_backward(last or job["reshard_after_backward"])


def train(model, job, log, rank, shard_group):
    tokens = torch_llama.load_tokens(job["data"])
    opt = sched = None
    if not job["forward_only"]:
        opt = torch.optim.AdamW(model.parameters(), lr=job["lr"], betas=(0.9, 0.95), eps=1e-8,
                                weight_decay=job["weight_decay"], foreach=False)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, torch_llama.lr_lambda(job["warmup_steps"]))
    K = job["grad_accum"]
    Bm = job["batch_size"] // K
    steps = []
    for s in range(job["steps"]):
        inputs, targets = rank_batch(tokens, s, rank, job)
        losses = []
        for k in range(K):
            micro = k if K > 1 else -1
            set_microbatch(model, job, k)
            x, y = inputs[k * Bm:(k + 1) * Bm], targets[k * Bm:(k + 1) * Bm]
            log.where = (s, micro, "forward")
            with torch.set_grad_enabled(not job["forward_only"]):
                loss = torch_llama.loss_fn(model(x), y)
            losses.append(loss.item())
            if not job["forward_only"]:
                log.where = (s, micro, "backward")
                (loss / K).backward()
        log.where = None
        row = {"step": s + 1, "loss": mean_over_ranks(sum(losses) / K), "grad_norm": None, "lr": None,
               "grad_norm_dtensor": None}
        if opt is not None:
            row["lr"] = opt.param_groups[0]["lr"]
            log.where, log.module = (s, -1, "optimizer"), "grad_norm"
            row["grad_norm_dtensor"] = grad_norm_dtensor(model)
            log.where, log.module = None, None
            row["grad_norm"] = grad_norm_f64(model, shard_group)
            clip(model, row["grad_norm"], job["max_norm"])
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        steps.append(row)
    return steps, opt


def local_shards(model, opt):
    """The fp32 local shards after training (and the AdamW state), by parameter name."""
    out = {}
    for name, p in model.named_parameters():
        name = name.replace(AC_PREFIX, "")
        out[name] = p.to_local().detach().float()
        state = opt.state.get(p, {}) if opt is not None else {}
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                out["optim.%s.%s" % (name, key)] = state[key].to_local().detach().float()
    return out


def join_gloo(rank, job):
    """This process's threads and its place in the job's gloo process group."""
    torch.set_num_threads(job["threads"])
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % job["port"], rank=rank,
                            world_size=job["world"], timeout=datetime.timedelta(seconds=job["timeout_s"]))


def run_rank(rank, job):
    """One process: join the gloo group, shard, train, write rank<r>.json and shards_rank<r>.safetensors."""
    from torch.distributed.device_mesh import init_device_mesh
    join_gloo(rank, job)
    try:
        if job.get("mesh"):  # HSDP: R replicas x S shards, rank i*S + j
            mesh = init_device_mesh("cpu", tuple(job["mesh"]), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh("cpu", (job["world"],), mesh_dim_names=("shard",))
        model, weights = build_model(job)
        model = shard(model, job, mesh)
        layout = dtensor_layout(model, weights)
        log = CollectiveLog()
        log.install()
        steps, opt = train(model, job, log, rank, mesh.get_group("shard"))
        torch_llama.write_safetensors(os.path.join(job["out"], "shards_rank%d.safetensors" % rank),
                                      local_shards(model, opt))
        result = {"rank": rank, "torch": torch.__version__, "steps": steps, "collectives": log.rows(),
                  "reduce_ops": {k: sorted(v) for k, v in log.ops.items()}, "mesh": mesh_record(mesh),
                  "backward_all_gathers": log.issue_points(), "schedule": schedule(job),
                  "dtensors": layout}
        with open(os.path.join(job["out"], "rank%d.json" % rank), "w") as fh:
            json.dump(result, fh)
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------- pipeline (stages 11, 12)

PASS_LETTERS = {"forward": "F", "backward": "B"}


class PipelineLog:
    """What this rank's pipeline stage did, per step: the passes in order ([F | B, microbatch]) and the point to
    point groups the schedule issued ([[send | recv, peer, microbatch, act | grad], ...] per group). While a pass
    runs, the CollectiveLog's `where` is (step, its microbatch, forward | backward)."""

    def __init__(self, collectives):
        self.coll = collectives
        self.step = -1
        self.passes = []        # per step
        self.p2p = []           # per step
        self.tags = {}          # id(P2POp) -> (microbatch, act | grad), from the stage method that made it
        self.in_batch = 0       # inside the schedule's _batch_p2p
        self.outside = Counter()  # (step or -1, send | recv): raw isend / irecv outside a schedule batch
        self.last_backward = -1

    def begin_step(self, step):
        self.step = step
        self.passes.append([])
        self.p2p.append([])
        self.last_backward = -1

    def install(self, stage):
        from torch.distributed import distributed_c10d as c10d
        from torch.distributed.pipelining import schedules
        for method, phase in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward")):
            setattr(stage, method, self._pass(getattr(stage, method), phase))
        for method, label in (("get_fwd_recv_ops", "act"), ("get_fwd_send_ops", "act"),
                              ("get_bwd_recv_ops", "grad"), ("get_bwd_send_ops", "grad")):
            setattr(stage, method, self._tagging(getattr(stage, method), label))
        stage.perform_reduce_grad = self._finalizing(stage.perform_reduce_grad)
        if not hasattr(schedules, "_batch_p2p"):
            raise RuntimeError("torch.distributed.pipelining.schedules has no _batch_p2p: the schedule's point to "
                               "point batches cannot be logged in this torch")
        schedules._batch_p2p = self._batching(schedules._batch_p2p)
        # P2POp checks its op against distributed_c10d's isend / irecv, the schedules build it with
        # torch.distributed's: the same wrapper in both
        for name in ("isend", "irecv"):
            wrapped = self._raw(getattr(c10d, name), "send" if name == "isend" else "recv")
            setattr(c10d, name, wrapped)
            setattr(dist, name, wrapped)

    def _pass(self, fn, phase):
        @functools.wraps(fn)
        def wrapper(mb, *args, **kwargs):
            self.passes[-1].append([PASS_LETTERS[phase], int(mb)])
            before, self.coll.where = self.coll.where, (self.step, int(mb), phase)
            try:
                return fn(mb, *args, **kwargs)
            finally:
                self.coll.where = before
                if phase == "backward":
                    self.last_backward = int(mb)
        return wrapper

    def _finalizing(self, fn):
        """perform_reduce_grad: FSDP's reduce-scatters after the step's last backward, filed under that backward."""
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            before, self.coll.where = self.coll.where, (self.step, self.last_backward, "backward")
            try:
                return fn(*args, **kwargs)
            finally:
                self.coll.where = before
        return wrapper

    def _tagging(self, fn, label):
        @functools.wraps(fn)
        def wrapper(mb, *args, **kwargs):
            ops = fn(mb, *args, **kwargs)
            for op in ops:
                self.tags[id(op)] = (int(mb), label)
            return ops
        return wrapper

    @staticmethod
    def op_kind(op):
        name = getattr(op.op, "__name__", "")
        return "send" if "send" in name else "recv" if "recv" in name else name

    def _batching(self, fn):
        @functools.wraps(fn)
        def wrapper(p2p_ops, *args, **kwargs):
            if p2p_ops and not self.in_batch:
                group = []
                for op in p2p_ops:
                    mb, label = self.tags.pop(id(op), (-1, "?"))
                    group.append([self.op_kind(op), int(op.peer), mb, label])
                (self.p2p[-1] if self.p2p else []).append(group)
            self.in_batch += 1
            try:
                return fn(p2p_ops, *args, **kwargs)
            finally:
                self.in_batch -= 1
        return wrapper

    def _raw(self, fn, kind):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not self.in_batch:
                self.outside[(self.step, kind)] += 1
            return fn(*args, **kwargs)
        return wrapper

    def record(self):
        return {"passes": self.passes, "p2p": self.p2p,
                "p2p_outside_schedule": [{"step": k[0], "kind": k[1], "count": n}
                                         for k, n in sorted(self.outside.items())]}


def pipeline_stage_module(model, blocks, first, last):
    """The stage's part of the Llama: the blocks `blocks` (global indices, their names kept), the embedding on the
    first stage, norm and output on the last; the rest set to None (torchtitan's way)."""
    keep = {str(i) for i in blocks}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm = None
        model.output = None
    return model


def shard_stage(model, job, dp_mesh):
    """--ac, then (S > 1) fully_shard per module over the stage's "dp" mesh and on the stage's root."""
    checkpoint_blocks(model, job)
    if dp_mesh is None:
        return model
    from torch.distributed.fsdp import fully_shard
    kw = {"mesh": dp_mesh, "reshard_after_forward": job["reshard_after_forward"]}
    if model.tok_embeddings is not None:
        fully_shard(model.tok_embeddings, **kw)
    for block in model.layers.values():
        fully_shard(block, **kw)
    if model.output is not None:
        fully_shard([model.norm, model.output], **kw)
    fully_shard(model, **kw)
    return model


def pipeline_schedule(stage, pl, loss_fn):
    """(the schedule object, what it is in words)."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle
    M, P = pl["microbatches"], pl["pp"]
    if pl["schedule"] == "gpipe":
        return ScheduleGPipe(stage, M, loss_fn=loss_fn, scale_grads=False), "ScheduleGPipe"
    if pl["schedule"] != "1f1b":
        raise ValueError("--pp-schedule %s: no torch schedule for it" % pl["schedule"])
    if M >= P:
        return Schedule1F1B(stage, M, loss_fn=loss_fn, scale_grads=False), "Schedule1F1B"
    sched = Schedule1F1B.__new__(Schedule1F1B)
    PipelineScheduleSingle.__init__(sched, stage, M, loss_fn=loss_fn, scale_grads=False)
    return sched, ("Schedule1F1B with its M >= P check skipped (torch refuses M = %d < P = %d; its "
                   "_step_microbatches runs min(M, P - p) warm-up forwards)" % (M, P))


def local_grad(p):
    g = p.grad
    return g.to_local() if hasattr(g, "to_local") else g


def train_pipeline(model, stage, schedule, job, plog, p, j, S, world_group):
    pl = job["pipeline"]
    P, M = pl["pp"], pl["microbatches"]
    first, last = p == 0, p == P - 1
    B, T = job["batch_size"], job["seq_len"]
    tokens = torch_llama.load_tokens(job["data"])
    opt = torch.optim.AdamW(model.parameters(), lr=job["lr"], betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=job["weight_decay"], foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, torch_llama.lr_lambda(job["warmup_steps"]))
    steps = []
    for s in range(job["steps"]):
        plog.begin_step(s)
        inputs, targets = torch_llama.global_batch(tokens, s, S, B, T)
        x, y = inputs[j * B:(j + 1) * B], targets[j * B:(j + 1) * B]
        losses = [] if last else None
        schedule.step(*((x,) if first else ()), target=y if last else None, losses=losses, return_outputs=False)
        t = torch.tensor([sum(l.detach().item() for l in losses) if last else 0.0], dtype=torch.float64)
        UNCOUNTED_ALL_REDUCE(t, group=world_group)
        row = {"step": s + 1, "loss": t.item() / S, "grad_norm": None, "lr": opt.param_groups[0]["lr"],
               "grad_norm_dtensor": None}
        total = torch.zeros((), dtype=torch.float64)
        for prm in model.parameters():
            if prm.grad is not None:
                total += local_grad(prm).double().pow(2).sum()
        UNCOUNTED_ALL_REDUCE(total, group=world_group)
        row["grad_norm"] = math.sqrt(total.item())
        coef = torch_llama.clip_coefficient(row["grad_norm"], job["max_norm"])
        if coef is not None:
            with torch.no_grad():
                for prm in model.parameters():
                    if prm.grad is not None:
                        local_grad(prm).mul_(coef)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        steps.append(row)
    return steps


def run_pipeline_rank(rank, job):
    """One process of a pipeline run: its stage's module, PipelineStage, the schedule; writes rank<r>.json."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage
    join_gloo(rank, job)
    try:
        pl = job["pipeline"]
        P, M, W = pl["pp"], pl["microbatches"], job["world"]
        if job["forward_only"]:
            raise ValueError("a forward-only pipeline run has no FSDP2 counterpart here")
        S = W // P
        p, j = divmod(rank, S)
        first, last = p == 0, p == P - 1
        mesh = init_device_mesh("cpu", (P, S), mesh_dim_names=("pp", "dp"))
        model, _ = build_model(job)
        model = pipeline_stage_module(model, pl["blocks"][p], first, last)
        model = shard_stage(model, job, mesh["dp"] if S > 1 else None)
        d = job["model"]
        Bm, T = job["batch_size"] // M, job["seq_len"]
        # the shapes PipelineStage would otherwise exchange at the first step; requires_grad: the activations
        # take a grad (the static metadata derives the grads' receives and sends from it), the tokens not
        example_in = (torch.zeros(Bm, T, dtype=torch.long) if first
                      else torch.zeros(Bm, T, d["dim"], requires_grad=True))
        example_out = torch.zeros(Bm, T, d["vocab_size"] if last else d["dim"], requires_grad=True)
        stage = PipelineStage(model, p, P, torch.device("cpu"), input_args=(example_in,),
                              output_args=(example_out,), group=mesh.get_group("pp"))

        def loss_fn(logits, targets):
            return torch_llama.loss_fn(logits, targets) / M
        schedule, what = pipeline_schedule(stage, pl, loss_fn)
        log = CollectiveLog()
        log.install()
        plog = PipelineLog(log)
        plog.install(stage)
        steps = train_pipeline(model, stage, schedule, job, plog, p, j, S, dist.group.WORLD)
        record = plog.record()
        record.update({"stage": p, "shard": j, "stages": P, "shards": S, "microbatches": M,
                       "blocks": list(pl["blocks"][p]), "schedule": what, "fsdp": S > 1,
                       "modules": sorted({c_module(n) for n, _ in model.named_parameters()})})
        result = {"rank": rank, "torch": torch.__version__, "steps": steps, "collectives": log.rows(),
                  "reduce_ops": {k: sorted(v) for k, v in log.ops.items()}, "pipeline": record}
        with open(os.path.join(job["out"], "rank%d.json" % rank), "w") as fh:
            json.dump(result, fh)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(job, rank_fn=None):
    """Train `job` on job["world"] processes, each running rank_fn(rank, job) (by default this module's FSDP2 or
    pipeline rank); raises if a rank fails (its message is in the exception)."""
    import torch.multiprocessing as mp
    os.makedirs(job["out"], exist_ok=True)
    fn = rank_fn or (run_pipeline_rank if job.get("pipeline") else run_rank)
    mp.spawn(fn, args=(job,), nprocs=job["world"], join=True)
