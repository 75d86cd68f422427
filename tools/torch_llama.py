#!/usr/bin/env python3
"""A self-contained PyTorch reference of torchtitan's Llama 3, for the parity tests
(tests/test_parity_torch.py), the bench and the FSDP2 check (tools/fsdp2_torch.py shards it).

Same model, parameter names, data order, optimizer, LR schedule and clipping
as the C runtime, written plainly. Attention is torch's fused causal
scaled_dot_product_attention where torch has it (2.0 on: a flash or
memory-efficient kernel, as the C runtime's flash attention), else the explicit
softmax(q k^T / sqrt(hd) + mask) v (torch 1.13, Debian's); ATTENTION says which:

    python3 tools/torch_llama.py --init INIT.safetensors --data TOKENS.npy \\
        --dim 64 --n-layers 2 --n-heads 4 --n-kv-heads 2 --vocab-size 259 --multiple-of 16 \\
        --seq-len 32 --batch-size 2 --world 2 --steps 10 --lr 8e-4 --warmup-steps 2 \\
        --weight-decay 0.1 --max-norm 1.0 --out metrics.jsonl [--save-final final.safetensors] [--forward-only]

writes one JSON line per step: {"step": s+1, "loss", "grad_norm", "lr", "step_ms"}
(grad_norm is the total norm before clipping, its squares summed in float64; null with
--forward-only; step_ms is the wall time of the whole step, batch to optimizer, for
tools/bench.py).

    python3 tools/torch_llama.py --make-init INIT.safetensors --dim .. [--init-std 0.02 --seed 0]

writes a random initial model (normal weights, unit norms) for tests.

Data (common/model/data.h): a .npy file (uint16/int32, 1-D) or any other file read
byte-wise. For step s the global batch is, for rank r in 0..W-1 and sample i
in 0..B-1, start = ((s*W + r)*B + i)*T mod (n - T - 1); the loss is the mean
over all W*B*T targets, which is what FSDP's averaged gradients compute.
"""
import argparse
import json
import math
import os
import struct
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# "sdpa": torch's fused causal attention (torch >= 2.0); "explicit": the softmax written out
ATTENTION = "sdpa" if hasattr(F, "scaled_dot_product_attention") else "explicit"


# ------------------------------------------------------------------ model

class ModelArgs:
    def __init__(self, dim, n_layers, n_heads, n_kv_heads, vocab_size, multiple_of=256,
                 ffn_dim_multiplier=None, norm_eps=1e-5, rope_theta=500000.0):
        self.dim = dim
        self.n_layers = n_layers
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads or n_heads
        self.vocab_size = vocab_size
        self.multiple_of = multiple_of
        self.ffn_dim_multiplier = ffn_dim_multiplier
        self.norm_eps = norm_eps
        self.rope_theta = rope_theta
        if dim % n_heads or n_heads % self.n_kv_heads or (dim // n_heads) % 2:
            raise ValueError("dim must split into n_heads even-sized heads, n_heads into n_kv_heads groups")
        self.head_dim = dim // n_heads

    @property
    def hidden_dim(self):
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def precompute_freqs_cis(head_dim, seq_len, theta):
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    t = torch.arange(seq_len, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)  # [T, head_dim/2] complex64


def apply_rotary_emb(x, freqs_cis):
    # x: [B, T, heads, head_dim]; rotate adjacent pairs (x[2j], x[2j+1]) as complex numbers
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * freqs_cis[None, :, None, :]).flatten(3)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
        self.wq = nn.Linear(a.dim, a.n_heads * a.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)

    def forward(self, x, freqs_cis):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)
        rep = self.n_heads // self.n_kv_heads
        if rep > 1:  # head h uses kv head h // rep
            k = k.repeat_interleave(rep, dim=2)
            v = v.repeat_interleave(rep, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, hd]
        if ATTENTION == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
            mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
            scores = scores.masked_fill(mask, float("-inf"))
            out = torch.softmax(scores, dim=-1) @ v
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, a):
        super().__init__()
        h = a.hidden_dim
        self.w1 = nn.Linear(a.dim, h, bias=False)
        self.w2 = nn.Linear(h, a.dim, bias=False)
        self.w3 = nn.Linear(a.dim, h, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.attention = Attention(a)
        self.feed_forward = FeedForward(a)
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.args = a
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(a) for i in range(a.n_layers)})
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)

    def forward(self, tokens):
        # A pipeline stage (tools/fsdp2_torch.py) sets the modules it does not hold to None, as torchtitan
        # does: without the embedding its input is the previous stage's activation, without the head it
        # returns its last block's output.
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        freqs_cis = precompute_freqs_cis(self.args.head_dim, h.shape[1], self.args.rope_theta)
        for layer in self.layers.values():
            h = layer(h, freqs_cis)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


# ----------------------------------------------------------- safetensors

def read_safetensors_arrays(path):
    """{name: float32 numpy array} of a safetensors file (F32 tensors only; ValueError otherwise)."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise ValueError(f"{path}: too short for a safetensors file")
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    header.pop("__metadata__", None)
    base, out = 8 + n, {}
    for name, e in header.items():
        if e["dtype"] != "F32":
            raise ValueError(f"{path}: tensor '{name}' has dtype {e['dtype']}, only F32 is supported")
        b, en = e["data_offsets"]
        out[name] = np.frombuffer(raw, dtype="<f4", count=(en - b) // 4, offset=base + b).reshape(e["shape"])
    return out


def read_safetensors(path):
    """{name: float32 torch tensor} of a safetensors file."""
    return {k: torch.from_numpy(v.astype(np.float32)) for k, v in read_safetensors_arrays(path).items()}


def write_safetensors(path, tensors, metadata=None):
    header, blobs, off = {}, [], 0
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    for name, t in tensors.items():
        b = t.detach().cpu().contiguous().numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    os.replace(tmp, path)


# ------------------------------------------------------------------- data

def load_tokens(path):
    with open(path, "rb") as f:
        head = f.read(6)
    if head == b"\x93NUMPY":
        arr = np.load(path)
        if arr.ndim != 1 or arr.dtype not in (np.dtype("<u2"), np.dtype("<i4")):
            raise ValueError(f"{path}: want a 1-D uint16 or int32 array, got {arr.dtype} {arr.shape}")
        return arr.astype(np.int64)
    with open(path, "rb") as f:
        return np.frombuffer(f.read(), dtype=np.uint8).astype(np.int64)


def global_batch(tokens, step, world, B, T):
    n = len(tokens)
    inputs, targets = [], []
    for r in range(world):
        for i in range(B):
            start = ((step * world + r) * B + i) * T % (n - T - 1)
            inputs.append(tokens[start:start + T])
            targets.append(tokens[start + 1:start + T + 1])
    return torch.from_numpy(np.stack(inputs)), torch.from_numpy(np.stack(targets))


# ---------------------------------------------------------------- driver

def lr_lambda(warmup_steps):
    # torchtitan's linear warmup (common/model/optim.h): (s+1)/(warmup+1) for s < warmup
    return lambda s: (s + 1) / (warmup_steps + 1) if s < warmup_steps else 1.0


def grad_norm_f64(params):
    """The total grad norm with the squares summed in float64. torch's float32 clip_grad_norm_ sums
    without cascading: ~1e-4 relative off on the debugmodel's 524k-element output weight."""
    return math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params if p.grad is not None))


def clip_coefficient(norm, max_norm):
    """clip_grad_norm_'s factor, min(1, max_norm / (norm + 1e-6)) in float32; None when clipping is off."""
    if max_norm <= 0:
        return None
    coef = torch.tensor(max_norm, dtype=torch.float32) / (torch.tensor(norm, dtype=torch.float32) + 1e-6)
    return coef.clamp(max=1.0)


def clip_grads(params, norm, max_norm):
    """clip_grad_norm_'s scaling, applied with the exact (float64-summed) norm."""
    coef = clip_coefficient(norm, max_norm)
    if coef is None:
        return
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)


def build_model(args):
    a = ModelArgs(args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.vocab_size, args.multiple_of,
                  args.ffn_dim_multiplier or None, args.norm_eps, args.rope_theta)
    return Transformer(a)


def make_init(model, std, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def main(argv=None):
    ap = argparse.ArgumentParser(description="PyTorch reference Llama 3 (torchtitan) for the parity tests")
    ap.add_argument("--init", help="initial weights (.safetensors)")
    ap.add_argument("--make-init", help="write random initial weights here and exit")
    # (flag, default) as the C driver has them: a number's type is its default's; int alone: required; None: a path
    for flag, default in [("--init-std", 0.02), ("--seed", 0), ("--data", None), ("--dim", int), ("--n-layers", int),
                          ("--n-heads", int), ("--n-kv-heads", 0), ("--vocab-size", int), ("--multiple-of", 256),
                          ("--ffn-dim-multiplier", 0.0), ("--norm-eps", 1e-5), ("--rope-theta", 500000.0),
                          ("--seq-len", 64), ("--batch-size", 2), ("--world", 1), ("--steps", 10), ("--lr", 8e-4),
                          ("--warmup-steps", 2), ("--weight-decay", 0.1), ("--max-norm", 1.0)]:
        if default is None:
            ap.add_argument(flag)
        elif default is int:
            ap.add_argument(flag, type=int, required=True)
        else:
            ap.add_argument(flag, type=type(default), default=default)
    ap.add_argument("--out", help="metrics JSONL")
    ap.add_argument("--save-final")
    ap.add_argument("--forward-only", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    model = build_model(args)
    if args.make_init:
        make_init(model, args.init_std, args.seed)
        write_safetensors(args.make_init, dict(model.named_parameters()), {"format": "pt"})
        return 0
    if not args.init or not args.data or not args.out:
        ap.error("--init, --data and --out are required (or --make-init)")

    weights = read_safetensors(args.init)
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(weights))
    if missing:
        raise SystemExit(f"error: {args.init}: missing {missing[0]}")
    with torch.no_grad():
        for name, p in params.items():
            if tuple(weights[name].shape) != tuple(p.shape):
                raise SystemExit(f"error: {args.init}: {name} has shape {list(weights[name].shape)}, "
                                 f"expected {list(p.shape)}")
            p.copy_(weights[name])

    tokens = load_tokens(args.data)
    T, B, W = args.seq_len, args.batch_size, args.world
    if len(tokens) < T + 2:
        raise SystemExit(f"error: seq-len {T} needs at least {T + 2} tokens but {args.data} has {len(tokens)}")
    if tokens.max() >= args.vocab_size:
        raise SystemExit(f"error: {args.data}: token {tokens.max()} is outside the vocabulary")

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=args.weight_decay, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.warmup_steps))

    with open(args.out, "w") as out:
        for s in range(args.steps):
            t0 = time.perf_counter()
            inputs, targets = global_batch(tokens, s, W, B, T)
            lr = opt.param_groups[0]["lr"]
            if args.forward_only:
                with torch.no_grad():
                    loss = loss_fn(model(inputs), targets)
                rec = {"step": s + 1, "loss": loss.item(), "grad_norm": None, "lr": lr}
            else:
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(model(inputs), targets)
                loss.backward()
                norm = grad_norm_f64(model.parameters())
                clip_grads(model.parameters(), norm, args.max_norm)
                opt.step()
                sched.step()
                rec = {"step": s + 1, "loss": loss.item(), "grad_norm": norm, "lr": lr}
            rec["step_ms"] = (time.perf_counter() - t0) * 1e3
            out.write(json.dumps(rec) + "\n")
            out.flush()

    if args.save_final:
        write_safetensors(args.save_final, params, {"format": "pt", "step": str(args.steps)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
