/* kernels.h — the stream kernels: what model.c and launch_adamw enqueue.
 *
 * A kernel is `void k(void *args)` handed to dev_launch with its argument
 * struct below. Every pointer in an argument struct is DEVICE memory (a
 * dev_alloc'd buffer), except where a comment says otherwise. Each backend
 * has the same set, as a KernelTable its table of operations points to:
 *   kcpu_*   (cpu/kernels_cpu.c)   run on the stream's worker thread and call
 *                                  the plain C ops of ops.c / optim.c;
 *   kcuda_*  (cuda/kernels_cuda.cu) run on the host thread at launch time and
 *                                  enqueue CUDA kernels on the launching
 *                                  stream (cuda_current_stream()).
 * KERNEL(s, name) is the kernel of the backend that runs stream s, so
 * model.c names each kernel once. Semantics, shapes and the accumulate (+=)
 * convention are those of ops.h; the forward/backward pairs are the ops of
 * ops.h.
 */
#ifndef HWFSDP_KERNELS_H
#define HWFSDP_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "model/ops.h" /* RopeScaling */
#include "model/optim.h"
#include "runtime/runtime.h"

/* The kernel `name` (a KernelTable field) of the backend that runs stream s
 * (stream_kernels: runtime/runtime.h). */
#define KERNEL(s, name) (stream_kernels(s)->name)

/* The activations' dtype (the `bf16` field): with bf16 = 0 every tensor is
 * float32. With bf16 = 1 (--param-dtype bf16) the tensors marked [a] below,
 * the activations and the weights, are bfloat16 words (runtime/bf16.h), as a
 * bf16 GPU run holds them: a kernel reads them widened (exact), does its math
 * and sums in float32, and rounds what it writes once (nearest even); one
 * that accumulates (+=) into a bf16 tensor reads, adds in float32 and rounds.
 * The unmarked ones stay float32: parameter gradients (dw: the optimizer's
 * and the reduce-scatter's input, as FSDP2's float32 grads), rstd [N] and
 * lse [B,H,T] (one float per row, tiny, and what norms and FlashAttention-2
 * keep in float32), the attention scratch, the loss and the logits (the loss
 * reads float32 logits, as torchtitan's casts them: model.c's head). */
/* embedding forward: out[N,D] [a] = w [a] [tok[n]]; backward: out (= dwte, float32) += rows of w (= dout [a]) */
typedef struct { void *out; const int32_t *tok; const void *w; size_t N, D; int bf16; } EmbArgs;
/* out[N,D] [a], rstd[N] = RMSNorm(in [a]) * w [a] */
typedef struct { void *out; float *rstd; const void *in, *w; size_t N, D; float eps; int bf16; } NormArgs;
/* dinp [a] += ..., dw += ... (dout, in, w [a]) */
typedef struct { void *dinp; float *dw; const void *dout, *in, *w; const float *rstd; size_t N, D; int bf16; } NormBwdArgs;
/* out[N,OC] = in[N,C] @ w[OC,C]^T (all [a]) */
typedef struct { void *out; const void *in, *w; size_t N, C, OC; int bf16; } MmArgs;
/* dinp[N,C] += dout @ w ; dw[OC,C] += dout^T @ in (either may be NULL; dinp, dout, in, w [a]) */
typedef struct { void *dinp; float *dw; const void *dout, *in, *w; size_t N, C, OC; int bf16; } MmBwdArgs;
/* in-place RoPE on x[B,T,nh,hd] [a] (backward = rotate by -angle) */
typedef struct { void *x; const float *cos, *sin; size_t B, T, nh, hd; int backward; int bf16; } RopeArgs;
/* cos/sin tables [T, hd/2]; scaling: Llama 3.1's (ops.h; factor 0: none) */
typedef struct { float *cos, *sin; size_t T, hd; float theta; RopeScaling scaling; } RopeTabArgs;
/* causal flash attention (ops.h): out[B,T,H,hd] [a], lse[B,H,T] (each row's logsumexp, saved); q, k, v [a] */
typedef struct { void *out; float *lse; const void *q, *k, *v; size_t B, T, H, KV, hd; int bf16; } AttArgs;
/* dq, dk, dv [a] accumulate; out [a] and lse are the forward's; scratch holds
 * attention_scratch_floats(B,T,H) floats of this backend; dout, q, k, v [a] */
typedef struct {
    void *dq, *dk, *dv;
    float *scratch;
    const void *dout, *q, *k, *v, *out;
    const float *lse;
    size_t B, T, H, KV, hd;
    int bf16;
} AttBwdArgs;
/* out[n] = silu(a[n]) * b[n] (all [a]) */
typedef struct { void *out; const void *a, *b; size_t n; int bf16; } SwiArgs;
typedef struct { void *da, *db; const void *dout, *a, *b; size_t n; int bf16; } SwiBwdArgs;
/* out = a + b (out may alias a or b; all [a]) */
typedef struct { void *out; const void *a, *b; size_t n; int bf16; } AddArgs;
/* cast_to_bf16: bf16[i] = round(f32[i]); cast_from_bf16: f32[i] = bf16[i] */
typedef struct { float *f32; uint16_t *bf16; size_t n; } CastArgs;
/* cast_batch_to_bf16: list[c].dst[i] = round(list[c].src[i]) for the n casts
 * of the list (device.h CastCopy, host memory: dev_launch_list sets `list`) */
typedef struct { const CastCopy *list; size_t n; } CastBatchArgs;
/* forward: *loss = mean CE over the N rows (loss is one device float);
 * backward: dlogits += (softmax - onehot) / mean_over, mean_over = N, or N x K
 * for one of K microbatches (the grad of the whole batch's mean: loss / K) */
typedef struct { float *loss; float *dlogits; const float *logits; const int32_t *tgt; size_t N, V, mean_over; } CeArgs;
/* *acc += sum x[i]^2 (acc is one device float) */
typedef struct { float *acc; const float *x; size_t n; } SumsqArgs;
/* AdamW on one shard; the clip coefficient comes from sqrt(*total_sumsq) (a device float) */
typedef struct {
    float *param;
    const float *grad;
    float *m, *v;
    size_t n;
    AdamWConfig c;
    float lr;
    int t;
    const float *total_sumsq;
    float *clip_out; /* the clip probe's slot (runtime.h): the coefficient applied; may be NULL */
} AdamArgs;

/* What each kernel costs (runtime.h: KernelCost), declared by whoever launches
 * it: FLOPs as its math counts them (a multiply-add is 2), bytes as each
 * tensor read or written once in device memory, at its dtype's size: the [a]
 * tensors 2 bytes under bf16, else 4 (dtype_bytes). A backward that
 * accumulates (+=) reads and writes its output. `dt` is the kernel's [a]
 * dtype, and the dtype its matmuls run in (bf16 tensor cores, float32
 * accumulation). */
static inline double dtype_bytes(DType dt) { return dt == DTYPE_BF16 ? 2.0 : 4.0; }
static inline KernelCost kcost(CostClass cls, DType math, double flops, double bytes) {
    KernelCost c = {cls, math, flops, bytes, {{0, 0, 0}, {0, 0, 0}}, 0, 0, 0, 0};
    return c;
}
static inline KernelCost kcost_elementwise(double flops, double bytes) {
    return kcost(COST_ELEMENTWISE, DTYPE_F32, flops, bytes);
}
/* out[N,OC] = in[N,C] @ w[OC,C]^T */
static inline KernelCost kcost_matmul_forward(size_t N, size_t C, size_t OC, DType dt) {
    double n = (double)N, c = (double)C, oc = (double)OC, e = dtype_bytes(dt);
    KernelCost k = kcost(COST_MATMUL, dt, 2 * n * c * oc, e * (n * c + n * oc + oc * c));
    k.gemm[0][0] = n, k.gemm[0][1] = oc, k.gemm[0][2] = c; /* out[N,OC]: K = C */
    return k;
}
/* dinp += dout @ w, dw += dout^T @ in: two GEMMs; dout read by both, dinp
 * and the float32 dw read and written */
static inline KernelCost kcost_matmul_backward(size_t N, size_t C, size_t OC, DType dt) {
    double n = (double)N, c = (double)C, oc = (double)OC, e = dtype_bytes(dt);
    KernelCost k = kcost(COST_MATMUL, dt, 4 * n * c * oc, e * (2 * n * oc + 3 * n * c + oc * c) + 4 * 2 * oc * c);
    k.gemm[0][0] = n, k.gemm[0][1] = c, k.gemm[0][2] = oc;  /* dinp[N,C]: K = OC */
    k.gemm[1][0] = oc, k.gemm[1][1] = c, k.gemm[1][2] = n;  /* dw[OC,C]: K = N, the tokens */
    return k;
}
/* FLOPs as FlashAttention-2 counts them (T. Dao, "FlashAttention-2", 2023, section 4.1: the forward
 * 4 hd per score pair of the causal half, the backward 2.5 times the forward); the few FLOPs of the
 * softmax per pair are this project's count of the operations below.
 * Flash attention (ops.h): each of the B*H heads scores the T(T+1)/2 pairs of
 * the causal half (the masked tiles are skipped): 2 hd FLOPs each in Q K^T,
 * 2 hd in P V, about 5 for the online softmax (a max, an exp, a rescale).
 * Bytes: q, k, v read and out written once, lse (float32) written; no [T, T]
 * matrix. Under bf16 its two matmuls run on bf16 tensor cores, as
 * FlashAttention-2's bf16 kernels do. */
static inline KernelCost kcost_attention_forward(size_t B, size_t T, size_t H, size_t KV, size_t hd, DType dt) {
    double bh = (double)(B * H), pairs = (double)T * ((double)T + 1) / 2, n = (double)(B * T);
    KernelCost k = kcost(COST_ATTENTION, dt, bh * pairs * (4.0 * (double)hd + 5.0),
                         dtype_bytes(dt) * n * (double)hd * (double)(2 * H + 2 * KV) + 4 * bh * (double)T);
    k.seq = (double)T;
    return k;
}
/* FlashAttention-2's backward: per causal pair the scores again (2 hd), dV,
 * dP, dQ, dK (2 hd each) and about 6 for exp(s - lse) and dS; plus the row
 * term D = rowsum(dout * out) (2 hd per row). Reads q, k, v, out, dout, lse;
 * dq, dk, dv accumulate (read and written); lse and D are float32. */
static inline KernelCost kcost_attention_backward(size_t B, size_t T, size_t H, size_t KV, size_t hd, DType dt) {
    double bh = (double)(B * H), pairs = (double)T * ((double)T + 1) / 2, n = (double)(B * T);
    KernelCost k = kcost(COST_ATTENTION, dt, bh * pairs * (10.0 * (double)hd + 6.0) + 2.0 * n * (double)(H * hd),
                         dtype_bytes(dt) * n * (double)hd * (double)(5 * H + 6 * KV) + 4 * 2 * bh * (double)T);
    k.seq = (double)T;
    return k;
}

/* Eager PyTorch's kernels for the same math (priced instead under --price-ops eager: profile.c), as
 * torchtitan's Llama launches them without torch.compile (torchtitan/models/llama/model.py and
 * models/norms.py at commit 9dec370a) and as autograd differentiates them (PyTorch's
 * tools/autograd/derivatives.yaml): each kernel reads and writes its tensors once, at a = the activation's
 * bytes, or 4 for the float32 its .float() calls make; a cast from a to 4 bytes and back is a kernel each
 * way, and none when a is 4 already. Per element: */
static inline double eager_cast(double a) { return a < 4 ? a + 4 : 0; }
static inline int eager_casts(double a) { return a < 4 ? 1 : 0; }
static inline void kcost_eager(KernelCost *c, double bytes, int kernels) {
    c->eager_bytes = bytes;
    c->eager_kernels = kernels;
}
/* RMSNorm, x * rsqrt(mean(x.float()^2) + eps), .type_as(x), * weight, over n elements:
 *   forward: .float(), pow, mean (4 read), x * rsqrt (8), .type_as, * weight (2a); and two kernels on the
 *   rows (+ eps, rsqrt) whose bytes are negligible;
 *   backward: * weight's two grads (g w: 2a; g * out: 3a, summed over rows: a), .type_as's (a cast),
 *   x * r's two (g r: 8; g x: 12, summed over the row: 4), mean's (an expand: 4 written), pow's
 *   (g * 2 * x^1: 8 + 8 + 12), the two paths into x.float() added (12), .float()'s (a cast). */
static inline void kcost_eager_rmsnorm(KernelCost *c, double a, double n, int backward) {
    double cast = eager_cast(a);
    int casts = 2 * eager_casts(a);
    if (!backward) kcost_eager(c, n * (2 * cast + 8 + 4 + 8 + 2 * a), casts + 6);
    else kcost_eager(c, n * (6 * a + 2 * cast + 24 + 4 + 28 + 12), casts + 13);
    c->eager_norm = 1;
}
/* RoPE on n elements, view_as_complex(x.float()) * freqs_cis, view_as_real, .type_as(x): a cast up, a
 * complex multiply (8), a cast down; its backward the same three (the multiply by the conjugate). */
static inline void kcost_eager_rope(KernelCost *c, double a, double n) {
    kcost_eager(c, n * (2 * eager_cast(a) + 8), 2 * eager_casts(a) + 1);
}
/* SwiGLU on n = N x F elements, silu(a) * b: forward silu (2a) and the product (3a); backward the
 * product's two grads (g b, g silu(a): 3a each) and silu's (3a). */
static inline void kcost_eager_swiglu(KernelCost *c, double a, double n, int backward) {
    if (!backward) kcost_eager(c, n * 5 * a, 2);
    else kcost_eager(c, n * 9 * a, 3);
}
/* What eager attention adds around the fused kernel, for N tokens: repeat_kv's copies of k and v from KV
 * to H heads (expand + reshape: KV hd read, H hd written, each; none when KV == H) and the output's
 * transpose(1, 2).contiguous() (H hd read and written); backward: the gradient's copy back through the
 * transpose and repeat_kv's sums from H heads to KV (H hd read, KV hd written, each). */
static inline void kcost_eager_attention(KernelCost *c, double a, double N, double H, double KV, double hd) {
    int rep = KV < H;
    kcost_eager(c, N * hd * a * ((rep ? 2 * (H + KV) : 0) + 2 * H), rep ? 3 : 1);
}

#define HWFSDP_KERNEL_LIST(X)                                                                                          \
    X(embedding_forward) X(embedding_backward) X(rmsnorm_forward) X(rmsnorm_backward) X(matmul_forward)                \
    X(matmul_backward) X(rope) X(rope_tables) X(attention_forward) X(attention_backward) X(swiglu_forward)             \
    X(swiglu_backward) X(add) X(crossentropy_forward) X(crossentropy_backward) X(sumsq_accumulate) X(adamw)            \
    X(cast_to_bf16) X(cast_from_bf16) X(cast_batch_to_bf16)

/* One backend's kernels. */
#define HWFSDP_KERNEL_FIELD(name) void (*name)(void *args);
typedef struct KernelTable {
    HWFSDP_KERNEL_LIST(HWFSDP_KERNEL_FIELD)
    /* Workspace (floats) attention_backward needs for this shape. */
    size_t (*attention_scratch_floats)(size_t B, size_t T, size_t H);
} KernelTable;
#undef HWFSDP_KERNEL_FIELD

#define HWFSDP_DECLARE_KERNEL(name) void kcpu_##name(void *args); void kcuda_##name(void *args);
#ifdef __cplusplus
extern "C" {
#endif
HWFSDP_KERNEL_LIST(HWFSDP_DECLARE_KERNEL)
/* Workspace (floats) attention_backward needs for this shape on each backend. */
size_t kcpu_attention_scratch_floats(size_t B, size_t T, size_t H);
size_t kcuda_attention_scratch_floats(size_t B, size_t T, size_t H);
extern const KernelTable kcpu_kernels;  /* cpu/kernels_cpu.c */
extern const KernelTable kcuda_kernels; /* cuda/runtime_cuda.c */
#ifdef __cplusplus
}
#endif
#undef HWFSDP_DECLARE_KERNEL

#endif
