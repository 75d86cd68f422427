/* ops.c — the Llama kernels on the CPU (the contract is in ops.h).
 *
 * Each op is a *_forward / *_backward pair in plain C on fp32, row-major.
 * Conventions used throughout:
 *   - every size and offset is a size_t (no int overflow on big tensors);
 *   - every *_backward ACCUMULATES (+=) into its gradient buffers;
 *   - deterministic: each reduction runs in a fixed order, matmuls go through
 *     OpenBLAS cblas_sgemm, nothing uses -ffast-math or OpenMP. Two runs
 *     give the same bits for the same OpenBLAS thread count; a different
 *     thread count may change sgemm's last bits (OpenBLAS 0.3.21 on this
 *     machine: dweight differs between 1 and 2 threads).
 * The comments give the math next to the code; x, w, g are one row of the
 * input, the weight and the upstream gradient dL/dout.
 */
#include "model/ops.h"
#include "model/ops_math.h"

#include <cblas.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <limits.h>
#include <stdbool.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/util.h"

/* cblas takes int dimensions: refuse sizes it cannot represent instead of
 * silently truncating them. */
static blasint blas_dim(size_t n, const char *what) {
    if (n > (size_t)INT_MAX) fatal("%s: dimension %zu is too large for cblas (max %d)", what, n, INT_MAX);
    return (blasint)n;
}

/* ------------------------------------------------------------------ embedding */

/* out[n, :] = wte[tokens[n], :] */
void embedding_forward(float *out, const int32_t *tokens, const float *wte, size_t N, size_t D) {
    for (size_t n = 0; n < N; n++) {
        if (tokens[n] < 0) fatal("embedding_forward: negative token id %d at row %zu", (int)tokens[n], n);
        memcpy(out + n * D, wte + (size_t)tokens[n] * D, D * sizeof(float));
    }
}

/* dwte[tokens[n], :] += dout[n, :], rows in order n = 0..N-1 (a repeated token
 * sums its rows in that fixed order). */
void embedding_backward(float *dwte, const float *dout, const int32_t *tokens, size_t N, size_t D) {
    for (size_t n = 0; n < N; n++) {
        if (tokens[n] < 0) fatal("embedding_backward: negative token id %d at row %zu", (int)tokens[n], n);
        float *dw = dwte + (size_t)tokens[n] * D;
        const float *g = dout + n * D;
        for (size_t i = 0; i < D; i++) dw[i] += g[i];
    }
}

/* -------------------------------------------------------------------- rmsnorm */

/* r = 1 / sqrt(mean(x^2) + eps);  out = (x * r) * w.
 * The sum of squares is accumulated in double (then the mean is rounded to
 * float, as torch computes it in fp32): this is within 1 ulp of torch's fp32
 * reduction and does not depend on D's rounding order. */
void rmsnorm_forward(float *out, float *rstd, const float *inp, const float *weight, size_t N, size_t D, float eps) {
    for (size_t n = 0; n < N; n++) {
        const float *x = inp + n * D;
        float *o = out + n * D;
        double ss = 0.0;
        for (size_t i = 0; i < D; i++) ss += (double)x[i] * (double)x[i];
        float ms = (float)(ss / (double)D);
        float r = 1.0f / sqrtf(ms + eps);
        for (size_t i = 0; i < D; i++) o[i] = (x[i] * r) * weight[i];
        rstd[n] = r;
    }
}

/* With y_i = x_i r w_i and dr/dx_j = -r^3 x_j / D:
 *   dL/dw_i += g_i x_i r
 *   dL/dx_j += r (g_j w_j) - x_j r^3 / D * sum_i(g_i w_i x_i)
 * One reduction pass over the row (sum_i g_i w_i x_i, in double), then one
 * pass that writes both gradients. */
void rmsnorm_backward(float *dinp, float *dweight, const float *dout, const float *inp, const float *weight,
                      const float *rstd, size_t N, size_t D) {
    for (size_t n = 0; n < N; n++) {
        const float *x = inp + n * D;
        const float *g = dout + n * D;
        float *dx = dinp + n * D;
        float r = rstd[n];
        double dot = 0.0;
        for (size_t i = 0; i < D; i++) dot += (double)(g[i] * weight[i]) * (double)x[i];
        float c = (float)(dot * (double)r * (double)r * (double)r / (double)D); /* r^3/D * sum(g w x) */
        for (size_t i = 0; i < D; i++) {
            dx[i] += r * (g[i] * weight[i]) - c * x[i];
            dweight[i] += g[i] * (x[i] * r);
        }
    }
}

/* --------------------------------------------------------------------- matmul */

/* out[N,OC] = inp[N,C] @ weight[OC,C]^T */
void matmul_forward(float *out, const float *inp, const float *weight, size_t N, size_t C, size_t OC) {
    if (N == 0 || OC == 0) return;
    if (C == 0) { memset(out, 0, N * OC * sizeof(float)); return; }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, blas_dim(N, "matmul"), blas_dim(OC, "matmul"),
                blas_dim(C, "matmul"), 1.0f, inp, blas_dim(C, "matmul"), weight, blas_dim(C, "matmul"), 0.0f, out,
                blas_dim(OC, "matmul"));
}

/* dinp[N,C]   += dout[N,OC] @ weight[OC,C]
 * dweight[OC,C] += dout^T[OC,N] @ inp[N,C]      (beta = 1 accumulates) */
void matmul_backward(float *dinp, float *dweight, const float *dout, const float *inp, const float *weight,
                     size_t N, size_t C, size_t OC) {
    if (N == 0 || C == 0 || OC == 0) return; /* every product is empty or zero */
    blasint n = blas_dim(N, "matmul"), c = blas_dim(C, "matmul"), oc = blas_dim(OC, "matmul");
    if (dinp) cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, c, oc, 1.0f, dout, oc, weight, c, 1.0f, dinp, c);
    if (dweight)
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, oc, c, n, 1.0f, dout, oc, inp, c, 1.0f, dweight, c);
}

/* ----------------------------------------------------------------------- rope */

/* As torch does it, all in fp32:
 *   freq[i]  = 1 / theta^((2i)/hd)        (float exponent, float pow: rope_freq),
 *              then Llama 3.1's scaling when given (rope_freq_scaled)
 *   angle    = (float)t * freq[i]         (float multiply)
 *   cos/sin of that float angle. */
void rope_tables(float *cos_tab, float *sin_tab, size_t T, size_t hd, float theta, const RopeScaling *scaling) {
    if (hd % 2 != 0) fatal("rope_tables: head dim %zu is odd", hd);
    size_t half = hd / 2;
    for (size_t i = 0; i < half; i++) {
        float freq = rope_freq_scaled(i, hd, theta, scaling); /* ops_math.h */
        for (size_t t = 0; t < T; t++) {
            float angle = (float)t * freq;
            cos_tab[t * half + i] = cosf(angle);
            sin_tab[t * half + i] = sinf(angle);
        }
    }
}

/* Rotate each ADJACENT pair (x0, x1) = (x[2i], x[2i+1]) of every head by
 * angle[t, i]; it is the complex product (x0 + i x1)(cos + i sin):
 *   out0 = x0 cos - x1 sin,   out1 = x0 sin + x1 cos.
 * sign = +1 rotates by +angle (forward), -1 by -angle (the inverse = the
 * transpose of the rotation, which is the backward). */
static void rope_rotate(float *x, const float *cos_tab, const float *sin_tab, size_t B, size_t T, size_t nh,
                        size_t hd, float sign) {
    if (hd % 2 != 0) fatal("rope: head dim %zu is odd", hd);
    size_t half = hd / 2;
    for (size_t b = 0; b < B; b++) {
        for (size_t t = 0; t < T; t++) {
            const float *c = cos_tab + t * half;
            const float *s = sin_tab + t * half;
            for (size_t h = 0; h < nh; h++) {
                float *xh = x + ((b * T + t) * nh + h) * hd;
                for (size_t i = 0; i < half; i++) rope_pair(&xh[2 * i], &xh[2 * i + 1], c[i], sign * s[i]);
            }
        }
    }
}

void rope_forward(float *x, const float *cos_tab, const float *sin_tab, size_t B, size_t T, size_t nh, size_t hd) {
    rope_rotate(x, cos_tab, sin_tab, B, T, nh, hd, 1.0f);
}

/* out = R x with R orthogonal, so dL/dx = R^T dL/dout = rotation by -angle:
 *   dx0 = g0 cos + g1 sin,   dx1 = -g0 sin + g1 cos.   (in place, not +=) */
void rope_backward(float *dx, const float *cos_tab, const float *sin_tab, size_t B, size_t T, size_t nh, size_t hd) {
    rope_rotate(dx, cos_tab, sin_tab, B, T, nh, hd, -1.0f);
}

/* ------------------------------------------------------------------ attention */

/* e^x for x <= 0 (the softmax's x - max): x = k ln2 + r with k an integer
 * and |r| <= ln2/2 (ln2 split in a short head and a tail, so k ln2_hi is
 * exact), e^r by its degree-7 Taylor polynomial (truncation below 6e-9
 * relative), 2^k written into the exponent bits. Within 2 ulp of expf
 * (tests/test_ops.c); below -87 it returns 0 where expf gives at most 1.7e-38;
 * NaN stays NaN. softmax_row runs the same operations four lanes at a time. */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO (-2.12194440e-4f)
#define EXP_ROUND 12582912.0f /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
#define EXP_MIN (-87.0f)
#define EXP_POLY(p, r)                                                                                    \
    do {                                                                                                  \
        p = 1.0f / 5040.0f;                                                                               \
        p = p * r + 1.0f / 720.0f;                                                                        \
        p = p * r + 1.0f / 120.0f;                                                                        \
        p = p * r + 1.0f / 24.0f;                                                                         \
        p = p * r + 1.0f / 6.0f;                                                                          \
        p = p * r + 0.5f;                                                                                 \
        p = p * r + 1.0f;                                                                                 \
        p = p * r + 1.0f;                                                                                 \
    } while (0)

float exp_nonpositive(float x) {
    float xc = x < EXP_MIN ? EXP_MIN : x;
    float kf = (xc * EXP_LOG2E + EXP_ROUND) - EXP_ROUND;
    float r = (xc - kf * EXP_LN2_HI) - kf * EXP_LN2_LO, p;
    EXP_POLY(p, r);
    if (kf != kf) return kf; /* NaN */
    uint32_t bits = (uint32_t)((int32_t)kf + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < EXP_MIN ? 0.0f : p * scale;
}

/* The largest of p[0..n) (n >= 1): eight lanes (exact in any order). */
static float row_max(const float *p, size_t n) {
    size_t full = n / 8 * 8, j = 0;
    float mx[8];
#if defined(__SSE2__)
    __m128 m0 = _mm_set1_ps(p[0]), m1 = m0;
    for (; j < full; j += 8) { /* lane = p > lane ? p : lane, as the scalar code */
        m0 = _mm_max_ps(_mm_loadu_ps(p + j), m0);
        m1 = _mm_max_ps(_mm_loadu_ps(p + j + 4), m1);
    }
    _mm_storeu_ps(mx, m0);
    _mm_storeu_ps(mx + 4, m1);
#else
    for (int l = 0; l < 8; l++) mx[l] = p[0];
    for (; j < full; j += 8)
        for (int l = 0; l < 8; l++) mx[l] = p[j + l] > mx[l] ? p[j + l] : mx[l];
#endif
    for (j = full; j < n; j++) mx[0] = p[j] > mx[0] ? p[j] : mx[0];
    float m = mx[0];
    for (int l = 1; l < 8; l++) m = mx[l] > m ? mx[l] : m;
    return m;
}

/* p[j] := e^(p[j] - m) for j < n (p[j] <= m up to rounding), and returns
 * their sum: eight lanes (lane l takes j = l mod 8) added pairwise, a fixed
 * order. e^x by exp_nonpositive's operations; with SSE2 (every x86-64) four
 * at a time, the same bits. */
static float exp_shift_row(float *p, size_t n, float m) {
    size_t full = n / 8 * 8, j = 0;
    float acc[8];
#if defined(__SSE2__)
    const __m128 vm = _mm_set1_ps(m), lo = _mm_set1_ps(EXP_MIN), log2e = _mm_set1_ps(EXP_LOG2E);
    const __m128 rnd = _mm_set1_ps(EXP_ROUND), hi2 = _mm_set1_ps(EXP_LN2_HI), lo2 = _mm_set1_ps(EXP_LN2_LO);
    for (; j + 4 <= n; j += 4) {
        __m128 x = _mm_sub_ps(_mm_loadu_ps(p + j), vm);
        __m128 xc = _mm_max_ps(lo, x); /* x < EXP_MIN ? EXP_MIN : x (NaN stays) */
        __m128 kf = _mm_sub_ps(_mm_add_ps(_mm_mul_ps(xc, log2e), rnd), rnd);
        __m128 r = _mm_sub_ps(_mm_sub_ps(xc, _mm_mul_ps(kf, hi2)), _mm_mul_ps(kf, lo2));
        __m128 q = _mm_set1_ps(1.0f / 5040.0f); /* EXP_POLY, lane by lane */
        q = _mm_add_ps(_mm_mul_ps(q, r), _mm_set1_ps(1.0f / 720.0f));
        q = _mm_add_ps(_mm_mul_ps(q, r), _mm_set1_ps(1.0f / 120.0f));
        q = _mm_add_ps(_mm_mul_ps(q, r), _mm_set1_ps(1.0f / 24.0f));
        q = _mm_add_ps(_mm_mul_ps(q, r), _mm_set1_ps(1.0f / 6.0f));
        q = _mm_add_ps(_mm_mul_ps(q, r), _mm_set1_ps(0.5f));
        q = _mm_add_ps(_mm_mul_ps(q, r), _mm_set1_ps(1.0f));
        q = _mm_add_ps(_mm_mul_ps(q, r), _mm_set1_ps(1.0f));
        __m128i bits = _mm_slli_epi32(_mm_add_epi32(_mm_cvttps_epi32(kf), _mm_set1_epi32(127)), 23);
        __m128 y = _mm_mul_ps(q, _mm_castsi128_ps(bits));
        __m128 nan = _mm_cmpunord_ps(kf, kf);
        y = _mm_or_ps(_mm_andnot_ps(nan, y), _mm_and_ps(nan, kf));
        _mm_storeu_ps(p + j, _mm_and_ps(_mm_cmpnlt_ps(x, lo), y)); /* 0 below EXP_MIN */
    }
#endif
    for (; j < n; j++) p[j] = exp_nonpositive(p[j] - m);
    j = 0;
#if defined(__SSE2__)
    __m128 a0 = _mm_setzero_ps(), a1 = a0;
    for (; j < full; j += 8) {
        a0 = _mm_add_ps(a0, _mm_loadu_ps(p + j));
        a1 = _mm_add_ps(a1, _mm_loadu_ps(p + j + 4));
    }
    _mm_storeu_ps(acc, a0);
    _mm_storeu_ps(acc + 4, a1);
#else
    for (int l = 0; l < 8; l++) acc[l] = 0.0f;
    for (; j < full; j += 8)
        for (int l = 0; l < 8; l++) acc[l] += p[j + l];
#endif
    for (j = full; j < n; j++) acc[j - full] += p[j];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* One causal softmax row in place: p[0..n) := softmax(p[0..n)): the max,
 * e^(p - max) and its sum (exp_shift_row), each times 1 / sum. */
void softmax_row(float *p, size_t n) {
    float inv = 1.0f / exp_shift_row(p, n, row_max(p, n));
    for (size_t j = 0; j < n; j++) p[j] *= inv;
}

/* What both attention passes check and share: the head grouping, the score
 * scale and the BLAS dimensions (T, hd, and the row strides H*hd of q and
 * KV*hd of k, v). false: an empty tensor, nothing to do. */
typedef struct {
    size_t group; /* query heads per kv head, H / KV */
    float scale;  /* 1 / sqrt(hd) */
    blasint t, hd, qs, ks;
    size_t qrow0, krow0; /* set by attn_head: where head h of batch b starts in q (out, dout, dq) and in k (v, dk, dv) */
} AttnShape;

/* Head h of batch b (kv head h / group): its first element in q-shaped and in k-shaped tensors. */
static void attn_head(AttnShape *s, size_t b, size_t h, size_t T, size_t H, size_t KV, size_t hd) {
    s->qrow0 = (b * T * H + h) * hd;
    s->krow0 = (b * T * KV + h / s->group) * hd;
}

static bool attention_shape(AttnShape *s, const char *who, size_t B, size_t T, size_t H, size_t KV, size_t hd) {
    if (KV == 0 || H % KV != 0) fatal("%s: n_heads %zu is not a multiple of n_kv_heads %zu", who, H, KV);
    if (B == 0 || T == 0 || H == 0 || hd == 0) return false;
    s->group = H / KV;
    s->scale = 1.0f / sqrtf((float)hd);
    s->t = blas_dim(T, "attention");
    s->hd = blas_dim(hd, "attention");
    s->qs = blas_dim(H * hd, "attention");
    s->ks = blas_dim(KV * hd, "attention");
    return true;
}

/* For each batch b and head h (kv head kh = h / (H/KV)), with Q = q[b,:,h,:],
 * K = k[b,:,kh,:], V = v[b,:,kh,:] viewed as [T, hd] matrices whose rows are
 * H*hd (resp. KV*hd) floats apart, and P = probs[b,h] [T,T]:
 *   S = Q K^T / sqrt(hd)
 *   P[t,j] = exp(S[t,j] - m_t) / sum_{j'<=t} exp(S[t,j'] - m_t) for j <= t,
 *            0 for j > t, m_t = max_{j<=t} S[t,j]  (softmax_row)
 *   O = P V
 * Causal tiles: the rows are taken `tile` at a time, [r0, r1); their keys are
 * only 0..r1-1, so each block's sgemms skip the columns right of r1, where P
 * is 0 (at T = 256 and tile 64 that is 10 of 16 blocks of work). The terms
 * left out are exact zeros, so the tile changes at most the rounding (sgemm
 * may round a block of another shape differently in the last bit). */
void attention_materialized_forward(float *out, float *probs, const float *q, const float *k, const float *v,
                                    size_t B, size_t T, size_t H, size_t KV, size_t hd, size_t tile) {
    AttnShape s;
    if (!attention_shape(&s, "attention_forward", B, T, H, KV, hd)) return;
    if (tile == 0) tile = T;
    for (size_t b = 0; b < B; b++) {
        for (size_t h = 0; h < H; h++) {
            attn_head(&s, b, h, T, H, KV, hd);
            const float *Q = q + s.qrow0, *K = k + s.krow0, *Vm = v + s.krow0;
            float *O = out + s.qrow0;
            float *P = probs + (b * H + h) * T * T;
            for (size_t r0 = 0; r0 < T; r0 += tile) {
                size_t r1 = r0 + tile < T ? r0 + tile : T;
                blasint m_ = (blasint)(r1 - r0), n_ = (blasint)r1;
                /* S[r0:r1, 0:r1] = scale * Q[r0:r1] K[0:r1]^T */
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m_, n_, s.hd, s.scale, Q + r0 * (size_t)s.qs,
                            s.qs, K, s.ks, 0.0f, P + r0 * T, s.t);
                /* causal softmax, row by row; the whole row is written (0 right of t) */
                for (size_t t = r0; t < r1; t++) {
                    float *p = P + t * T;
                    softmax_row(p, t + 1);
                    memset(p + t + 1, 0, (T - t - 1) * sizeof(float));
                }
                /* O[r0:r1] = P[r0:r1, 0:r1] V[0:r1] */
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m_, s.hd, n_, 1.0f, P + r0 * T, s.t, Vm, s.ks,
                            0.0f, O + r0 * (size_t)s.qs, s.qs);
            }
        }
    }
}

/* With G = dout[b,:,h,:] and the same views as the forward:
 *   dV  += P^T G
 *   dP   = G V^T                                     (into a T x T buffer)
 *   dS[t,j] = P[t,j] (dP[t,j] - sum_j' P[t,j'] dP[t,j'])   (softmax backward)
 *   dQ  += scale * dS K
 *   dK  += scale * dS^T Q
 * Heads sharing a kv head add into dK, dV in head order h = 0..H-1.
 * Causal tiles as in the forward: row block [r0, r1) of dS and dQ needs
 * columns 0..r1-1 only; column block [c0, c1) of dK and dV needs rows c0..T-1
 * only (P and dS are 0 above the diagonal). dS is written left of r1 only.
 * The sgemm products need dS (T x T) at once: that is `scratch`, which the
 * caller allocates (so the device allocator counts it). */
void attention_materialized_backward(float *dq, float *dk, float *dv, const float *dout, const float *q,
                                     const float *k, const float *v, const float *probs, float *scratch, size_t B,
                                     size_t T, size_t H, size_t KV, size_t hd, size_t tile) {
    AttnShape s;
    if (!attention_shape(&s, "attention_backward", B, T, H, KV, hd)) return;
    if (tile == 0) tile = T;
    float *dS = scratch; /* [T, T] */
    for (size_t b = 0; b < B; b++) {
        for (size_t h = 0; h < H; h++) {
            attn_head(&s, b, h, T, H, KV, hd);
            size_t qoff = s.qrow0, koff = s.krow0;
            const float *P = probs + (b * H + h) * T * T;
            const float *G = dout + qoff;
            for (size_t c0 = 0; c0 < T; c0 += tile) {
                size_t c1 = c0 + tile < T ? c0 + tile : T;
                /* dV[c0:c1] += P[c0:T, c0:c1]^T G[c0:T] */
                cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (blasint)(c1 - c0), s.hd, (blasint)(T - c0),
                            1.0f, P + c0 * T + c0, s.t, G + c0 * (size_t)s.qs, s.qs, 1.0f,
                            dv + koff + c0 * (size_t)s.ks, s.ks);
            }
            for (size_t r0 = 0; r0 < T; r0 += tile) {
                size_t r1 = r0 + tile < T ? r0 + tile : T;
                blasint m_ = (blasint)(r1 - r0), n_ = (blasint)r1;
                /* dP[r0:r1, 0:r1] = G[r0:r1] V[0:r1]^T */
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m_, n_, s.hd, 1.0f, G + r0 * (size_t)s.qs, s.qs,
                            v + koff, s.ks, 0.0f, dS + r0 * T, s.t);
                /* dS = P * (dP - rowsum(P * dP)), 0 right of the diagonal (up to r1) */
                for (size_t t = r0; t < r1; t++) {
                    const float *p = P + t * T;
                    float *ds = dS + t * T;
                    float dot = 0.0f;
                    for (size_t j = 0; j <= t; j++) dot += p[j] * ds[j];
                    for (size_t j = 0; j <= t; j++) ds[j] = p[j] * (ds[j] - dot);
                    for (size_t j = t + 1; j < r1; j++) ds[j] = 0.0f;
                }
                /* dQ[r0:r1] += scale * dS[r0:r1, 0:r1] K[0:r1] */
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m_, s.hd, n_, s.scale, dS + r0 * T, s.t,
                            k + koff, s.ks, 1.0f, dq + qoff + r0 * (size_t)s.qs, s.qs);
            }
            for (size_t c0 = 0; c0 < T; c0 += tile) {
                size_t c1 = c0 + tile < T ? c0 + tile : T;
                /* dK[c0:c1] += scale * dS[c0:T, c0:c1]^T Q[c0:T] */
                cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (blasint)(c1 - c0), s.hd, (blasint)(T - c0),
                            s.scale, dS + c0 * T + c0, s.t, q + qoff + c0 * (size_t)s.qs, s.qs, 1.0f,
                            dk + koff + c0 * (size_t)s.ks, s.ks);
            }
        }
    }
}

/* ------------------------------------------------------- flash attention */

/* FlashAttention-2's forward, for each batch b and head h (kv head kh), with
 * Q, K, V, O the [T, hd] views of the materialising version above. Query
 * rows are taken tq at a time, [r0, r1); for each, the keys tk at a time,
 * [c0, c1), only up to the diagonal (c0 < r1: the tiles right of it are all
 * masked and never made). With S = scale Q[r0:r1] K[c0:c1]^T (a tq x tk tile)
 * each row t keeps a running max m_t, a running sum l_t and its unnormalised
 * output O_t:
 *   m'  = max(m_t, max_{j <= t} S[t,j])          (the causal part of the tile)
 *   P[t,j] = e^(S[t,j] - m')  for j <= t, 0 past the diagonal
 *   l_t = l_t e^(m_t - m') + sum_j P[t,j]
 *   O_t = O_t e^(m_t - m') + P[t,:] V[c0:c1]      (one sgemm for the tile)
 * and at the end O_t /= l_t, lse_t = m_t + log(l_t), the row's logsumexp:
 * softmax(S[t,:]) = e^(S[t,:] - lse_t), which the backward recomputes from it.
 * The first key tile (c0 = 0) starts every row (key 0 is never masked), so O
 * is written, not scaled, there. Tile buffers: S [tq, tk], m and l [tq], the
 * analogue of a GPU kernel's shared memory and registers (host memory here,
 * not device memory: no allocator counts them). */
void attention_forward_tiles(float *out, float *lse, const float *q, const float *k, const float *v, size_t B,
                             size_t T, size_t H, size_t KV, size_t hd, size_t tq, size_t tk) {
    AttnShape s;
    if (!attention_shape(&s, "attention_forward", B, T, H, KV, hd)) return;
    if (tq == 0 || tk == 0) fatal("attention_forward: tiles must be at least 1 (%zu x %zu)", tq, tk);
    float *S = xmalloc(tq * tk * sizeof(float)); /* [tq, tk] scores, then probabilities */
    float *m = xmalloc(2 * tq * sizeof(float)), *l = m + tq; /* [tq] running max and sum */
    blasint ldS = blas_dim(tk, "attention");
    for (size_t b = 0; b < B; b++) {
        for (size_t h = 0; h < H; h++) {
            attn_head(&s, b, h, T, H, KV, hd);
            const float *Q = q + s.qrow0, *K = k + s.krow0, *Vm = v + s.krow0;
            float *O = out + s.qrow0;
            float *L = lse + (b * H + h) * T;
            for (size_t r0 = 0; r0 < T; r0 += tq) {
                size_t r1 = r0 + tq < T ? r0 + tq : T;
                blasint m_ = (blasint)(r1 - r0);
                for (size_t c0 = 0; c0 < r1; c0 += tk) {
                    size_t c1 = c0 + tk < r1 ? c0 + tk : r1;
                    blasint n_ = (blasint)(c1 - c0);
                    /* S = scale Q[r0:r1] K[c0:c1]^T */
                    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m_, n_, s.hd, s.scale, Q + r0 * (size_t)s.qs,
                                s.qs, K + c0 * (size_t)s.ks, s.ks, 0.0f, S, ldS);
                    for (size_t t = r0; t < r1; t++) {
                        size_t i = t - r0;
                        float *p = S + i * tk, *o = O + t * (size_t)s.qs;
                        size_t n = t + 1 < c1 ? (t + 1 > c0 ? t + 1 - c0 : 0) : c1 - c0; /* keys <= t here */
                        if (n == 0) { /* the whole row is past the diagonal: nothing to add */
                            memset(p, 0, (c1 - c0) * sizeof(float));
                            continue;
                        }
                        float mx = row_max(p, n);
                        if (c0 > 0 && m[i] > mx) mx = m[i];
                        float rowsum = exp_shift_row(p, n, mx);
                        memset(p + n, 0, (c1 - c0 - n) * sizeof(float));
                        if (c0 == 0) {
                            l[i] = rowsum;
                        } else {
                            float alpha = exp_nonpositive(m[i] - mx); /* rescales what the row holds */
                            l[i] = l[i] * alpha + rowsum;
                            for (size_t e = 0; e < hd; e++) o[e] *= alpha;
                        }
                        m[i] = mx;
                    }
                    /* O[r0:r1] (+)= P V[c0:c1] */
                    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m_, s.hd, n_, 1.0f, S, ldS,
                                Vm + c0 * (size_t)s.ks, s.ks, c0 == 0 ? 0.0f : 1.0f, O + r0 * (size_t)s.qs, s.qs);
                }
                for (size_t t = r0; t < r1; t++) {
                    size_t i = t - r0;
                    float inv = 1.0f / l[i], *o = O + t * (size_t)s.qs;
                    for (size_t e = 0; e < hd; e++) o[e] *= inv;
                    L[t] = m[i] + logf(l[i]);
                }
            }
        }
    }
    free(S);
    free(m);
}

void attention_forward(float *out, float *lse, const float *q, const float *k, const float *v, size_t B, size_t T,
                       size_t H, size_t KV, size_t hd) {
    attention_forward_tiles(out, lse, q, k, v, B, T, H, KV, hd, ATTENTION_TILE_Q, ATTENTION_TILE_K);
}

/* FlashAttention-2's backward, per batch b and head h, with G = dout[b,:,h,:]:
 *   D_t = sum_e G[t,e] O[t,e]                     (= sum_j P[t,j] dP[t,j])
 * then for each key tile [c0, c1) and each query tile [r0, r1) that reaches
 * it (r1 > c0: tiles wholly above the diagonal are skipped), keys [c0, e1),
 * e1 = min(c1, r1) (the keys past r1 are masked for every row of the tile):
 *   P  = e^(scale Q[r0:r1] K[c0:c1]^T - lse)     (recomputed; 0 past the diagonal)
 *   dV[c0:c1] += P^T G[r0:r1]
 *   dP = G[r0:r1] V[c0:c1]^T
 *   dS = P * (dP - D)                             (the softmax backward)
 *   dQ[r0:r1] += scale dS K[c0:c1]
 *   dK[c0:c1] += scale dS^T Q[r0:r1]
 * Every sum runs in a fixed order (key tiles, then query tiles, then heads
 * h = 0..H-1 into a shared kv head), so the result does not depend on
 * anything but the inputs and the tiles. scratch: D [T], P and dS [tq, tk]. */
void attention_backward_tiles(float *dq, float *dk, float *dv, const float *dout, const float *q, const float *k,
                              const float *v, const float *out, const float *lse, float *scratch, size_t B, size_t T,
                              size_t H, size_t KV, size_t hd, size_t tq, size_t tk) {
    AttnShape s;
    if (!attention_shape(&s, "attention_backward", B, T, H, KV, hd)) return;
    if (tq == 0 || tk == 0) fatal("attention_backward: tiles must be at least 1 (%zu x %zu)", tq, tk);
    float *D = scratch, *P = scratch + T, *dS = P + tq * tk; /* [T], [tq, tk], [tq, tk] */
    blasint ldS = blas_dim(tk, "attention");
    for (size_t b = 0; b < B; b++) {
        for (size_t h = 0; h < H; h++) {
            attn_head(&s, b, h, T, H, KV, hd);
            size_t qoff = s.qrow0, koff = s.krow0;
            const float *Q = q + qoff, *G = dout + qoff, *O = out + qoff, *L = lse + (b * H + h) * T;
            const float *K = k + koff, *Vm = v + koff;
            for (size_t t = 0; t < T; t++) {
                const float *g = G + t * (size_t)s.qs, *o = O + t * (size_t)s.qs;
                float d = 0.0f;
                for (size_t e = 0; e < hd; e++) d += g[e] * o[e];
                D[t] = d;
            }
            for (size_t c0 = 0; c0 < T; c0 += tk) {
                size_t c1 = c0 + tk < T ? c0 + tk : T;
                for (size_t r0 = c0 / tq * tq; r0 < T; r0 += tq) {
                    size_t r1 = r0 + tq < T ? r0 + tq : T, e1 = c1 < r1 ? c1 : r1; /* keys past r1: masked */
                    blasint m_ = (blasint)(r1 - r0), n_ = (blasint)(e1 - c0);
                    /* P = e^(scale Q K^T - lse), 0 past the diagonal */
                    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m_, n_, s.hd, s.scale, Q + r0 * (size_t)s.qs,
                                s.qs, K + c0 * (size_t)s.ks, s.ks, 0.0f, P, ldS);
                    for (size_t t = r0; t < r1; t++) {
                        float *p = P + (t - r0) * tk;
                        size_t n = t + 1 < e1 ? (t + 1 > c0 ? t + 1 - c0 : 0) : e1 - c0;
                        exp_shift_row(p, n, L[t]);
                        memset(p + n, 0, (e1 - c0 - n) * sizeof(float));
                    }
                    /* dV[c0:c1] += P^T G[r0:r1] */
                    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n_, s.hd, m_, 1.0f, P, ldS,
                                G + r0 * (size_t)s.qs, s.qs, 1.0f, dv + koff + c0 * (size_t)s.ks, s.ks);
                    /* dP = G[r0:r1] V[c0:c1]^T, then dS = P (dP - D) in place */
                    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m_, n_, s.hd, 1.0f, G + r0 * (size_t)s.qs,
                                s.qs, Vm + c0 * (size_t)s.ks, s.ks, 0.0f, dS, ldS);
                    for (size_t t = r0; t < r1; t++) {
                        const float *p = P + (t - r0) * tk;
                        float *ds = dS + (t - r0) * tk;
                        for (size_t j = 0; j < e1 - c0; j++) ds[j] = p[j] * (ds[j] - D[t]);
                    }
                    /* dQ[r0:r1] += scale dS K[c0:c1] */
                    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m_, s.hd, n_, s.scale, dS, ldS,
                                K + c0 * (size_t)s.ks, s.ks, 1.0f, dq + qoff + r0 * (size_t)s.qs, s.qs);
                    /* dK[c0:c1] += scale dS^T Q[r0:r1] */
                    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n_, s.hd, m_, s.scale, dS, ldS,
                                Q + r0 * (size_t)s.qs, s.qs, 1.0f, dk + koff + c0 * (size_t)s.ks, s.ks);
                }
            }
        }
    }
}

size_t attention_scratch_floats_tiles(size_t T, size_t tq, size_t tk) { return T + 2 * tq * tk; }
size_t attention_scratch_floats(size_t T) { return attention_scratch_floats_tiles(T, ATTENTION_TILE_Q, ATTENTION_TILE_K); }

void attention_backward(float *dq, float *dk, float *dv, const float *dout, const float *q, const float *k,
                        const float *v, const float *out, const float *lse, float *scratch, size_t B, size_t T,
                        size_t H, size_t KV, size_t hd) {
    attention_backward_tiles(dq, dk, dv, dout, q, k, v, out, lse, scratch, B, T, H, KV, hd, ATTENTION_TILE_Q,
                             ATTENTION_TILE_K);
}

/* --------------------------------------------------------------------- swiglu */

/* sig(a) = 1 / (1 + exp(-a)), silu(a) = a * sig(a) = a / (1 + exp(-a));
 * out = silu(a) * b. For a -> -inf, exp(-a) = inf and silu = -0 (no NaN). */
void swiglu_forward(float *out, const float *a, const float *b, size_t n) {
    for (size_t i = 0; i < n; i++) out[i] = swiglu_elem(a[i], b[i]);
}

/* d silu/da = sig + a sig (1 - sig) = sig (1 + a (1 - sig))
 *   da += g * b * sig (1 + a (1 - sig)),   db += g * silu(a) */
void swiglu_backward(float *da, float *db, const float *dout, const float *a, const float *b, size_t n) {
    for (size_t i = 0; i < n; i++) swiglu_backward_elem(dout[i], a[i], b[i], &da[i], &db[i]);
}

/* ------------------------------------------------------------------------ add */

void add_forward(float *out, const float *a, const float *b, size_t n) {
    for (size_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

void add_inplace(float *y, const float *x, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] += x[i];
}

/* ------------------------------------------------------------------ bfloat16 */

void cast_to_bf16(uint16_t *out, const float *in, size_t n) {
    for (size_t i = 0; i < n; i++) out[i] = bf16_from_f32(in[i]);
}

void cast_from_bf16(float *out, const uint16_t *in, size_t n) {
    for (size_t i = 0; i < n; i++) out[i] = bf16_to_f32(in[i]);
}

/* -------------------------------------------------------------- cross-entropy */

/* logsumexp of one row in ONE pass (online): keep the running max m and
 * s = sum_j exp(x_j - m) (in double); when a new max arrives, rescale s by
 * exp(m_old - m_new). lse = m + log(s). */
static float row_logsumexp(const float *x, size_t V) {
    float m = -INFINITY;
    double s = 0.0;
    for (size_t j = 0; j < V; j++) {
        if (x[j] > m) {
            s = s * exp((double)m - (double)x[j]) + 1.0; /* exp(-inf) = 0 on the first element */
            m = x[j];
        } else {
            s += (double)expf(x[j] - m);
        }
    }
    return (float)((double)m + log(s));
}

static void check_target(int32_t tgt, size_t n, size_t V, const char *who) {
    if (tgt < 0 || (size_t)tgt >= V) fatal("%s: target %d at row %zu is outside the vocab [0, %zu)", who, (int)tgt, n, V);
}

/* loss = mean_n( lse(logits[n]) - logits[n, target[n]] ), rows summed in double. */
float crossentropy_forward(const float *logits, const int32_t *targets, size_t N, size_t V) {
    if (N == 0) return 0.0f;
    double total = 0.0;
    for (size_t n = 0; n < N; n++) {
        const float *x = logits + n * V;
        check_target(targets[n], n, V, "crossentropy_forward");
        total += (double)row_logsumexp(x, V) - (double)x[targets[n]];
    }
    return (float)(total / (double)N);
}

/* d loss_n / d x_j = softmax(x)_j - [j == target] = exp(x_j - lse) - onehot;
 * scaled by dloss_scale (1/N for the mean) and accumulated. */
void crossentropy_backward(float *dlogits, const float *logits, const int32_t *targets, size_t N, size_t V,
                           float dloss_scale) {
    for (size_t n = 0; n < N; n++) {
        const float *x = logits + n * V;
        float *dx = dlogits + n * V;
        check_target(targets[n], n, V, "crossentropy_backward");
        float lse = row_logsumexp(x, V);
        size_t tgt = (size_t)targets[n];
        for (size_t j = 0; j < V; j++) {
            float p = expf(x[j] - lse);
            dx[j] += (j == tgt ? p - 1.0f : p) * dloss_scale;
        }
    }
}

/* ---------------------------------------------------------------------- sumsq */

double sumsq(const float *x, size_t n) {
    double s = 0.0;
    for (size_t i = 0; i < n; i++) s += (double)x[i] * (double)x[i];
    return s;
}
