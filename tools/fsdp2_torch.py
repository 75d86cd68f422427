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

Writes into OUT, per rank:
  rank<r>.json                  steps (loss, grad norm, lr), collectives, reduce ops, the mesh, DTensor layout
                                after fully_shard, the backward all-gathers by issuing hook, the schedule
  shards_rank<r>.safetensors    the local shards after training: params, optim.<name>.exp_avg(_sq)
"""
import datetime
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
        from torch.distributed import _functional_collectives as funcol
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
        wrapped = 0
        for name, kind in COLLECTIVE_FUNCTIONS.items():
            if hasattr(dist, name):
                setattr(dist, name, self._counting(getattr(dist, name), kind, group_ranks))
                wrapped += 1
        if not wrapped:
            raise RuntimeError("torch.distributed has none of %s" % ", ".join(COLLECTIVE_FUNCTIONS))
        # DTensor's Partial placements reduce through funcol.all_reduce(tensor, reduceOp, group=(mesh, dim))
        funcol.all_reduce = self._counting(funcol.all_reduce, ALL_REDUCE, self._funcol_ranks(funcol))
        for method in ("unshard", "post_backward"):
            setattr(FSDPParamGroup, method, self._labelling(getattr(FSDPParamGroup, method)))
        for method in ("pre_backward", "post_backward"):
            setattr(FSDPParamGroup, method, self._hooking(getattr(FSDPParamGroup, method), method))

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
                    dtype = TRACE_DTYPES.get(getattr(out, "dtype", None), str(getattr(out, "dtype", "?")))
                    group = ",".join(str(r) for r in ranks_of(bound.get("group")))
                    # the bytes the C trace gives: an all-gather's output, a reduce-scatter's input (the
                    # group's segments), an all-reduce's tensor
                    moved = bound.get("input", bound.get("input_tensor")) if kind == REDUCE_SCATTER else out
                    nbytes = moved.numel() * moved.element_size() if hasattr(moved, "numel") else -1
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


def shard(model, job, mesh):
    """Activation checkpointing, then fully_shard per module group and on the root (torchtitan's order)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    if job["ac"]:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        for name in list(model.layers.keys()):
            model.layers[name] = checkpoint_wrapper(model.layers[name], preserve_rng_state=False)
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
    """torch's clip_grad_norm_ factor on the exact norm, applied to every grad's local shard."""
    coef = torch_llama.clip_coefficient(norm, max_norm)
    if coef is None:
        return
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.grad.to_local().mul_(coef)


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


def run_rank(rank, job):
    """One process: join the gloo group, shard, train, write rank<r>.json and shards_rank<r>.safetensors."""
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(job["threads"])
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % job["port"], rank=rank,
                            world_size=job["world"], timeout=datetime.timedelta(seconds=job["timeout_s"]))
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


def run(job):
    """Train `job` on job["world"] processes; raises if a rank fails (its message is in the exception)."""
    import torch.multiprocessing as mp
    os.makedirs(job["out"], exist_ok=True)
    mp.spawn(run_rank, args=(job,), nprocs=job["world"], join=True)
