"""The FSDP1 side of `make fsdp2-check` for a flat stage (13): one C run's configuration trained by
torch.distributed.fsdp.FullyShardedDataParallel (use_orig_params=False: one FlatParameter per unit).

tools/fsdp2/runner.py starts it under build/fsdp2-venv's python when that torch still has FSDP1
(has_fsdp1); W CPU processes join a gloo group as tools/fsdp2_torch.py's do, and train
tools/torch_llama.py's Llama from the C run's initial weights, on the same tokens, data order,
AdamW, warmup and clipping. The units are the C runtime's without --bucket-mb:

- FSDP(tok_embeddings) is "embedding", FSDP(layers[i]) is "block<i>" (with --ac / --ac-every,
  FSDP around torch's checkpoint wrapper of the block, as stages 01-12's FSDP2 side wraps first);
- FSDP(the Transformer) holds what is left, norm.weight and output.weight: "head";
- an outer FSDP around that, holding no parameter, is the root. FSDP1 never frees the root's
  unsharded flat parameter after forward (_post_forward_reshard: `not state._is_root`), where the C
  runtime reshards its head like every module: with the empty root the head unit is not the root and
  reshards as the others (stages 01-12's FSDP2 root holds no parameter either).

Flag mapping: --reshard-after-forward=true is FULL_SHARD, =false SHARD_GRAD_OP; --grad-accum K with
--grad-sync last runs microbatches 0..K-2 (forward and backward) inside root.no_sync(). FSDP1 has no
per-microbatch --reshard-after-backward: after a backward without sync it frees the unsharded flat
parameter under FULL_SHARD and keeps it under SHARD_GRAD_OP (_should_free_in_backward); the
comparison (tools/fsdp2/compare.py, fsdp1_gaps) says which runs FSDP1 reproduces.

Reduce-scatter: FSDP1's default divides the unsharded flat gradient by a predivide factor f
(DefaultState._get_gradient_predivide_factor: doubled from 1 while the current f divides W and
W / f > f; 2 at W = 3, 4, 5, 4 at W = 10), reduce-scatters with SUM and divides the shard by W / f:
at W = 4 the same float32 numbers as a sum then a divide by 4 (scaling by powers of 2 is exact), at
W = 3, 5, 10 one more rounding.

Grad norm: FSDP1's own total norm, root.clip_grad_norm_(inf) (float32; its all-reduce of one float,
the sum of squares, is the grad norm's collective counted below; a factor of exactly 1.0 leaves the
grads as they are), goes into rank<r>.json as grad_norm_torch; the norm compared with the C run's
and the one clipped with is the float64 one over the flat shards (padding is zero), with torch's
clip formula, as tools/fsdp2_torch.py does for FSDP2.

Collectives: tools/fsdp2_torch.py's CollectiveLog wraps torch.distributed's entry points (FSDP1
on CPU all-gathers with the list form dist.all_gather into the W chunks of the padded flat
parameter, its W x S floats the bytes; reduce-scatters with reduce_scatter_single; the norm's
dist.all_reduce); FlatParamHandle.unshard and _runtime_utils._reduce_grad say which unit each
belongs to (the C name of the unit's module).

Writes into OUT, per rank:
  rank<r>.json               steps (loss, grad norm, grad_norm_torch, lr), collectives, reduce ops,
                             units: per unit its C module, fqns (in flat order, torchtitan names),
                             shapes, flat_numel (unpadded), shard_numel (S), padded_numel (W x S) and
                             this rank's _shard_param_infos
  shards_rank<r>.safetensors init.<module> (the flat shard after wrapping), flat.<module> (after
                             training), flat.<module>.exp_avg / .exp_avg_sq (AdamW's state)
tools/fsdp2/compare.py unflattens those by name (unflatten, flat_pieces).
"""
import json
import math
import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp2_torch as f2
import torch_llama

FSDP_PREFIX = "_fsdp_wrapped_module."


def has_fsdp1():
    """Whether this torch still ships FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel)."""
    try:
        import torch.distributed.fsdp as fsdp
    except ImportError:
        return False
    return hasattr(fsdp, "FullyShardedDataParallel")


class Root(nn.Module):
    """The outer FSDP unit's module: holds the Transformer (the head unit) and no parameter of its own."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens):
        return self.model(tokens)


def clean(fqn):
    return fqn.replace(FSDP_PREFIX, "").replace(f2.AC_PREFIX, "")


def wrap(model, job):
    """--ac, then FSDP per unit: (the root, [(C module, fqn prefix, FSDP instance)] in the C order)."""
    from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel as FSDP, ShardingStrategy
    f2.checkpoint_blocks(model, job)
    kw = {"sharding_strategy": ShardingStrategy.FULL_SHARD if job["reshard_after_forward"]
          else ShardingStrategy.SHARD_GRAD_OP,
          "device_id": torch.device("cpu"), "use_orig_params": False,
          "backward_prefetch": BackwardPrefetch.BACKWARD_PRE, "forward_prefetch": False}
    units = []
    model.tok_embeddings = FSDP(model.tok_embeddings, **kw)
    units.append(("embedding", "tok_embeddings.", model.tok_embeddings))
    for name in list(model.layers.keys()):
        model.layers[name] = FSDP(model.layers[name], **kw)
        units.append(("block" + name, "layers.%s." % name, model.layers[name]))
    head = FSDP(model, **kw)
    units.append(("head", "", head))
    return FSDP(Root(head), **kw), units


def unit_record(cname, prefix, unit, world):
    """What compare.py needs to read a unit's flat shard by name (FSDP1's own metadata)."""
    fp = unit._handle.flat_param
    return {"module": cname, "fqns": [prefix + clean(f) for f in fp._fqns],
            "shapes": [list(s) for s in fp._shapes], "numels": [int(n) for n in fp._numels],
            "flat_numel": int(fp._unpadded_unsharded_size.numel()), "shard_numel": int(fp.numel()),
            "padded_numel": int(fp._padded_unsharded_size.numel()), "world": world,
            "shard_param_infos": [[bool(i.in_shard), i.offset_in_shard, i.numel_in_shard,
                                   i.intra_param_start_idx, i.intra_param_end_idx] for i in fp._shard_param_infos]}


class UnitLog(f2.CollectiveLog):
    """CollectiveLog labelled by FSDP1's handles: the unit whose unshard / gradient reduction runs."""

    def install_fsdp1(self, names):
        from torch.distributed.fsdp import _runtime_utils
        from torch.distributed.fsdp._flat_param import FlatParamHandle
        self.install_collectives()
        # on CPU FSDP1 all-gathers a flat parameter with the list form, dist.all_gather into the W chunks of the
        # padded unsharded flat parameter (FlatParamHandle._all_gather_flat_param): counted as one all-gather
        dist.all_gather = self._counting(dist.all_gather, f2.ALL_GATHER, f2.group_ranks)
        log = self

        def labelled(fn, handle_of):
            def wrapper(*args, **kwargs):
                before, log.module = log.module, names.get(id(handle_of(args)), "?")
                try:
                    return fn(*args, **kwargs)
                finally:
                    log.module = before
            return wrapper
        FlatParamHandle.unshard = labelled(FlatParamHandle.unshard, lambda a: a[0])
        _runtime_utils._reduce_grad = labelled(_runtime_utils._reduce_grad, lambda a: a[1])


def grad_norm_f64(units):
    total = torch.zeros((), dtype=torch.float64)
    for _, _, u in units:
        g = u._handle.flat_param.grad
        if g is not None:
            total += g.double().pow(2).sum()
    f2.UNCOUNTED_ALL_REDUCE(total)
    return math.sqrt(total.item())


def train(root, units, job, log, rank):
    tokens = torch_llama.load_tokens(job["data"])
    opt = torch.optim.AdamW(root.parameters(), lr=job["lr"], betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=job["weight_decay"], foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, torch_llama.lr_lambda(job["warmup_steps"]))
    K = job["grad_accum"]
    Bm = job["batch_size"] // K
    steps = []
    for s in range(job["steps"]):
        inputs, targets = f2.rank_batch(tokens, s, rank, job)
        losses = []
        for k in range(K):
            micro = k if K > 1 else -1
            sync = k == K - 1 or job["grad_sync_every"]
            with (nullcontext() if sync else root.no_sync()):
                x, y = inputs[k * Bm:(k + 1) * Bm], targets[k * Bm:(k + 1) * Bm]
                log.where = (s, micro, "forward")
                loss = torch_llama.loss_fn(root(x), y)
                losses.append(loss.item())
                log.where = (s, micro, "backward")
                (loss / K).backward()
        log.where, log.module = (s, -1, "optimizer"), "grad_norm"
        torch_norm = float(root.clip_grad_norm_(math.inf))  # FSDP1's norm; a factor of 1.0
        log.where, log.module = None, None
        norm = grad_norm_f64(units)
        f2.clip(root, norm, job["max_norm"])
        row = {"step": s + 1, "loss": f2.mean_over_ranks(sum(losses) / K), "grad_norm": norm,
               "grad_norm_torch": torch_norm, "lr": opt.param_groups[0]["lr"]}
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        steps.append(row)
    return steps, opt


def run_rank(rank, job):
    f2.join_gloo(rank, job)
    try:
        model, _ = f2.build_model(job)
        root, units = wrap(model, job)
        W = job["world"]
        tensors = {"init." + c: u._handle.flat_param.detach().clone() for c, _, u in units}
        names = {id(u._handle): c for c, _, u in units}
        log = UnitLog()
        log.install_fsdp1(names)
        steps, opt = train(root, units, job, log, rank)
        records = [unit_record(c, prefix, u, W) for c, prefix, u in units]  # after the lazy init (padded size)
        for c, _, u in units:
            fp = u._handle.flat_param
            tensors["flat." + c] = fp.detach()
            for key in ("exp_avg", "exp_avg_sq"):
                tensors["flat.%s.%s" % (c, key)] = opt.state[fp][key]
        torch_llama.write_safetensors(os.path.join(job["out"], "shards_rank%d.safetensors" % rank), tensors)
        strategy = "FULL_SHARD" if job["reshard_after_forward"] else "SHARD_GRAD_OP"
        result = {"rank": rank, "torch": torch.__version__, "steps": steps, "collectives": log.rows(),
                  "reduce_ops": {k: sorted(v) for k, v in log.ops.items()}, "units": records,
                  "schedule": {"reference": "FSDP1 (FullyShardedDataParallel, use_orig_params=False)",
                               "sharding_strategy": strategy,
                               "no_sync": None if job["grad_accum"] == 1 or job["grad_sync_every"]
                               else "microbatches 0..K-2 of K = %d" % job["grad_accum"],
                               "gradient_predivide_factor": root._gradient_predivide_factor,
                               "gradient_postdivide_factor": root._gradient_postdivide_factor}}
        with open(os.path.join(job["out"], "rank%d.json" % rank), "w") as fh:
            json.dump(result, fh)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(job):
    """Train `job` against FSDP1 on job["world"] processes (fsdp2_torch's launcher, this module's ranks)."""
    f2.run(job, run_rank)
