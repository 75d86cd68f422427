/* ops.h — the Llama kernels on the CPU: each op a *_forward / *_backward pair.
 *
 * Plain synchronous C on fp32, row-major. The model (model.c) queues them on a
 * stream; tests call them directly. Deterministic: fixed loop and reduction
 * order, matmuls through cblas_sgemm, no -ffast-math.
 *
 * Gradient convention: every *_backward ACCUMULATES (+=) into the gradient
 * buffers it is given (dinp, dweight, ...); callers zero them first. This is
 * what lets residual branches and shared inputs add their contributions.
 * (rope_backward is the exception: it transforms its buffer in place.)
 * Bitwise determinism holds for a fixed OpenBLAS thread count.
 *
 * Shapes: N = rows (B*T tokens), D = model dim, H = heads, KV = kv heads,
 * hd = head dim, F = FFN hidden, V = vocab. Sizes are size_t throughout.
 */
#ifndef HWFSDP_OPS_H
#define HWFSDP_OPS_H

#include <stddef.h>
#include <stdint.h>

/* out[N,D] = wte[tokens[n], :] ; tokens are checked < V by the data loader */
void embedding_forward(float *out, const int32_t *tokens, const float *wte, size_t N, size_t D);
/* dwte[tokens[n], :] += dout[n, :]  (in token order n = 0..N-1) */
void embedding_backward(float *dwte, const float *dout, const int32_t *tokens, size_t N, size_t D);

/* RMSNorm as torchtitan: out = x * rsqrt(mean(x^2) + eps) * weight.
 * rstd[N] is saved for the backward. */
void rmsnorm_forward(float *out, float *rstd, const float *inp, const float *weight, size_t N, size_t D, float eps);
void rmsnorm_backward(float *dinp, float *dweight, const float *dout, const float *inp, const float *weight,
                      const float *rstd, size_t N, size_t D);

/* nn.Linear without bias: out[N,OC] = inp[N,C] @ weight[OC,C]^T (weight as [out, in]). */
void matmul_forward(float *out, const float *inp, const float *weight, size_t N, size_t C, size_t OC);
/* dinp[N,C] += dout @ weight ; dweight[OC,C] += dout^T @ inp. Either may be NULL. */
void matmul_backward(float *dinp, float *dweight, const float *dout, const float *inp, const float *weight,
                     size_t N, size_t C, size_t OC);

/* Llama 3.1's RoPE scaling (ModelConfig's rope_factor, rope_low_freq_factor,
 * rope_high_freq_factor, rope_old_context; published: 8, 1, 4, 8192). It
 * stretches the long waves of a model trained at context C = old_context so
 * that positions beyond C fall on angles it has seen. Per frequency f, with
 * wavelength w = 2 pi / f:
 *   w < C / high_freq_factor    f                              (short waves, as trained)
 *   w > C / low_freq_factor     f / factor                     (long waves, stretched)
 *   otherwise                   (1 - s) f / factor + s f,      a blend of the two, with
 *                               s = (C / w - low_freq_factor) / (high_freq_factor - low_freq_factor)
 * factor 0 (or a NULL RopeScaling *): no scaling. ops_math.h: rope_freq_scaled. */
typedef struct {
    float factor, low_freq_factor, high_freq_factor, old_context;
} RopeScaling;

/* RoPE tables for positions 0..T-1: angle[t,i] = t * f_i, i < hd/2, with
 * f_i = theta^(-2i/hd), scaled as above when scaling is given. */
void rope_tables(float *cos_tab /* [T, hd/2] */, float *sin_tab /* [T, hd/2] */, size_t T, size_t hd, float theta,
                 const RopeScaling *scaling /* NULL: none */);
/* In-place rotation of ADJACENT pairs (x[2i], x[2i+1]) by angle[t,i], as
 * Meta/torchtitan's complex-number RoPE. x is [B, T, nh, hd]. */
void rope_forward(float *x, const float *cos_tab, const float *sin_tab, size_t B, size_t T, size_t nh, size_t hd);
/* In-place: turns dL/d(rotated x) into dL/dx (rotation by -angle). */
void rope_backward(float *dx, const float *cos_tab, const float *sin_tab, size_t B, size_t T, size_t nh, size_t hd);

/* Causal self-attention with grouped KV heads (head h reads kv head h / (H/KV)).
 * q [B,T,H,hd], k and v [B,T,KV,hd] (rows of the projections, RoPE applied),
 * out [B,T,H,hd] = softmax(q k^T / sqrt(hd) + causal mask) v.
 *
 * The model runs FLASH attention (FlashAttention-2's algorithm): the scores
 * are made a tile at a time (ATTENTION_TILE_Q query rows x ATTENTION_TILE_K
 * keys) and folded into the output with an online softmax, so no [T, T]
 * matrix ever exists. Tiles right of the diagonal are skipped (the causal
 * half). The forward saves, besides out, lse [B,H,T]: each row's logsumexp
 * of its scaled scores; the backward recomputes the probabilities tile by
 * tile as exp(score - lse). */
/* CPU tiles: 32 x 128 floats (16 KiB, an L1/L2-sized block; at the
 * debugmodel's seq 256 and head dim 16 the fastest of 16..128 x 64..256
 * measured, tools/bench_notes.md) */
#define ATTENTION_TILE_Q 32
#define ATTENTION_TILE_K 128
void attention_forward(float *out, float *lse, const float *q, const float *k, const float *v, size_t B, size_t T,
                       size_t H, size_t KV, size_t hd);
/* dq, dk, dv accumulate. out and lse are the forward's; scratch holds
 * attention_scratch_floats(T) floats. */
void attention_backward(float *dq, float *dk, float *dv, const float *dout, const float *q, const float *k,
                        const float *v, const float *out, const float *lse, float *scratch, size_t B, size_t T,
                        size_t H, size_t KV, size_t hd);
size_t attention_scratch_floats(size_t T);
/* The same with explicit tiles (any tq, tk >= 1 gives the same math, equal up
 * to float32 rounding: the tests run several); scratch for tiles tq x tk. */
void attention_forward_tiles(float *out, float *lse, const float *q, const float *k, const float *v, size_t B,
                             size_t T, size_t H, size_t KV, size_t hd, size_t tq, size_t tk);
void attention_backward_tiles(float *dq, float *dk, float *dv, const float *dout, const float *q, const float *k,
                              const float *v, const float *out, const float *lse, float *scratch, size_t B, size_t T,
                              size_t H, size_t KV, size_t hd, size_t tq, size_t tk);
size_t attention_scratch_floats_tiles(size_t T, size_t tq, size_t tk);

/* The materialising attention, the tests' reference (the model never runs
 * it): probs [B,H,T,T] = the causal softmax (0 above the diagonal), written
 * by the forward and read by the backward; scratch holds T*T floats (dS of
 * one head). Causal row blocks of `tile` rows skip the zero columns. */
void attention_materialized_forward(float *out, float *probs, const float *q, const float *k, const float *v,
                                    size_t B, size_t T, size_t H, size_t KV, size_t hd, size_t tile);
void attention_materialized_backward(float *dq, float *dk, float *dv, const float *dout, const float *q,
                                     const float *k, const float *v, const float *probs, float *scratch, size_t B,
                                     size_t T, size_t H, size_t KV, size_t hd, size_t tile);

/* e^x for x <= 0, within 2 ulp of expf (the attention softmax's exp). */
float exp_nonpositive(float x);
/* p[0..n) := softmax(p[0..n)) in place, the attention's row softmax (n >= 1). */
void softmax_row(float *p, size_t n);

/* SwiGLU gate: out[n] = silu(a[n]) * b[n], silu(x) = x * sigmoid(x). */
void swiglu_forward(float *out, const float *a, const float *b, size_t n);
void swiglu_backward(float *da, float *db, const float *dout, const float *a, const float *b, size_t n);

/* out[i] = a[i] + b[i] (out may alias a or b). */
void add_forward(float *out, const float *a, const float *b, size_t n);
/* y[i] += x[i] */
void add_inplace(float *y, const float *x, size_t n);
/* out[i] = in[i] rounded to bfloat16 (runtime/bf16.h: nearest, ties to even) / widened back (exact) */
void cast_to_bf16(uint16_t *out, const float *in, size_t n);
void cast_from_bf16(float *out, const uint16_t *in, size_t n);

/* Mean cross-entropy over N rows of logits[N,V] with targets[N]:
 * returns mean_n( logsumexp(logits[n]) - logits[n, target[n]] ), summed in
 * double in row order. */
float crossentropy_forward(const float *logits, const int32_t *targets, size_t N, size_t V);
/* dlogits[n, :] += (softmax(logits[n]) - onehot(target[n])) * dloss_scale
 * (dloss_scale = 1/N for the mean over N rows). */
void crossentropy_backward(float *dlogits, const float *logits, const int32_t *targets, size_t N, size_t V,
                           float dloss_scale);

/* sum of x[i]^2 in double, in index order */
double sumsq(const float *x, size_t n);

#endif
