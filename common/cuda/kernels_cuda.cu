/* kernels_cuda.cu — the stream kernels of kernels.h on CUDA (kcuda_*).
 *
 * Each kcuda_* runs on the host thread inside dev_launch and only ENQUEUES
 * work on cuda_current_stream() (kernels, cuBLAS calls through
 * cuda_current_cublas(), already bound to that stream): it never waits and
 * never allocates; the one workspace is AttBwdArgs.scratch, which the model
 * allocates (kcuda_attention_scratch_floats). The math and the accumulate
 * (+=) convention are those of ops.h; the comments give each formula.
 *
 * Determinism: no atomics. Every reduction is a fixed sequential loop or a
 * fixed tree over a fixed number of threads, so two runs give the same bits.
 * They differ from the CPU's bits by rounding where the order of additions
 * differs; embedding, add, RoPE and AdamW do the CPU's float operations in
 * the CPU's order and are expected to match it bitwise.
 *
 * Layouts (row-major): x [N, D]; q [B, T, H, hd]; k, v [B, T, KV, hd];
 * probs [B, H, T, T]; logits [N, V]. Sizes are size_t, and so is every
 * element index that can pass 2^31 (probs, logits). */
#include <math.h>
#include <stdint.h>

#include "cuda/cuda_check.h"
extern "C" {
#include "model/optim.h" /* a C header: adamw_scalars has C linkage */
}
#include "model/kernels.h"
#include "model/ops_math.h" /* the per-element formulas the CPU ops use */

namespace {

constexpr int kThreads = 256;  /* block size of the row and elementwise kernels (a power of two) */
constexpr int kOneBlock = 1024; /* the single-block reductions: sum of squares, cross-entropy loss */
constexpr int kWarp = 32;
constexpr int kTile = 32;       /* rmsnorm dweight: 32 columns x 32 row lanes per block */
constexpr int kMaxHalf = 256;   /* RoPE frequencies passed by value: head dim <= 512 */

/* blocks for a grid-stride loop over n elements (>= 1, capped: the loop covers the rest) */
unsigned blocks_for(size_t n, int threads = kThreads) {
    size_t b = (n + (size_t)threads - 1) / (size_t)threads;
    if (b == 0) b = 1;
    if (b > 65535u * 32u) b = 65535u * 32u;
    return (unsigned)b;
}

/* one block per row: gridDim.x is at most 2^31 - 1 */
unsigned grid_rows(size_t rows, const char *what) {
    if (rows > 0x7fffffffu) fatal("%s: %zu rows is more than one launch can index", what, rows);
    return (unsigned)rows;
}

int blas_int(size_t v, const char *what) {
    if (v > 0x7fffffff) fatal("%s: dimension %zu does not fit cuBLAS's int", what, v);
    return (int)v;
}

#define GRID_STRIDE(i, n)                                                                                              \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (size_t)gridDim.x * blockDim.x)

/* Sum of one value per thread over the block as a fixed tree (blockDim a power
 * of two, sh has blockDim entries). Every thread gets the result. */
template <typename T> __device__ T block_sum(T v, T *sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
        __syncthreads();
    }
    T r = sh[0];
    __syncthreads();
    return r;
}

__device__ float block_max(float v, float *sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sh[threadIdx.x] = fmaxf(sh[threadIdx.x], sh[threadIdx.x + s]);
        __syncthreads();
    }
    float r = sh[0];
    __syncthreads();
    return r;
}

/* The same over the 32 lanes of a warp (all lanes active): a fixed shuffle
 * tree into lane 0, then lane 0's value to every lane. */
template <typename T> __device__ T warp_sum(T v) {
    for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    return __shfl_sync(0xffffffffu, v, 0);
}

__device__ float warp_max(float v) {
    for (int o = kWarp / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v; /* max is exact: every lane holds the same value */
}

/* ----------------------------------------------------------------- embedding */

/* out[n, d] = wte[tok[n], d]. The data loader checks ids < V; a negative id
 * (the CPU op stops on it) gives a NaN row rather than a wild read. */
__global__ void embedding_fwd(float *out, const int32_t *tok, const float *wte, size_t N, size_t D) {
    GRID_STRIDE(e, N * D) {
        int32_t t = tok[e / D];
        out[e] = t < 0 ? NAN : wte[(size_t)t * D + e % D];
    }
}

/* dwte[tok[n], d] += dout[n, d], n = 0..N-1 IN ORDER, as the CPU op. With P
 * a power of two, thread (p, d) owns column d of the vocab rows v with
 * v % P == p: it walks every token in order and adds those of its class. So
 * no two threads write one element, each element adds its rows in token order
 * (the CPU's bits), and P only spreads the work. A warp reads one tok[n]. */
__global__ void embedding_bwd(float *dwte, const float *dout, const int32_t *tok, size_t N, size_t D, unsigned P) {
    GRID_STRIDE(e, D * P) {
        size_t d = e % D;
        unsigned p = (unsigned)(e / D);
        for (size_t n = 0; n < N; n++) {
            int32_t t = tok[n];
            if (t >= 0 && ((unsigned)t & (P - 1)) == p) dwte[(size_t)t * D + d] += dout[n * D + d];
        }
    }
}

/* ------------------------------------------------------------------- rmsnorm */

/* one block per row: r = 1 / sqrt(mean(x^2) + eps) (sum in double, as the
 * CPU); out = (x r) w; rstd[row] = r */
__global__ void rmsnorm_fwd(float *out, float *rstd, const float *inp, const float *w, size_t D, float eps) {
    __shared__ double sh[kThreads];
    const float *x = inp + (size_t)blockIdx.x * D;
    float *o = out + (size_t)blockIdx.x * D;
    double ss = 0.0;
    for (size_t i = threadIdx.x; i < D; i += blockDim.x) ss += (double)x[i] * (double)x[i];
    ss = block_sum(ss, sh);
    float r = 1.0f / sqrtf((float)(ss / (double)D) + eps);
    for (size_t i = threadIdx.x; i < D; i += blockDim.x) o[i] = (x[i] * r) * w[i];
    if (threadIdx.x == 0) rstd[blockIdx.x] = r;
}

/* one block per row: dx += r (g w) - x r^3/D sum_i(g_i w_i x_i)  (the sum in double) */
__global__ void rmsnorm_bwd_dx(float *dinp, const float *dout, const float *inp, const float *w, const float *rstd,
                               size_t D) {
    __shared__ double sh[kThreads];
    size_t row = blockIdx.x;
    const float *x = inp + row * D, *g = dout + row * D;
    float *dx = dinp + row * D;
    float r = rstd[row];
    double dot = 0.0;
    for (size_t i = threadIdx.x; i < D; i += blockDim.x) dot += (double)(g[i] * w[i]) * (double)x[i];
    dot = block_sum(dot, sh);
    float c = (float)(dot * (double)r * (double)r * (double)r / (double)D);
    for (size_t i = threadIdx.x; i < D; i += blockDim.x) dx[i] += r * (g[i] * w[i]) - c * x[i];
}

/* dw[i] += sum_n g[n,i] (x[n,i] r[n]), a reduction over the N rows. Block =
 * 32 columns x 32 row lanes: lane y sums rows y, y+32, y+64, ... in order
 * (coalesced: a warp reads 32 adjacent columns of one row), then the 32 lane
 * sums of a column meet in a fixed tree. */
__global__ void __launch_bounds__(kTile * kTile)
    rmsnorm_bwd_dw(float *dw, const float *dout, const float *inp, const float *rstd, size_t N, size_t D) {
    __shared__ float sh[kTile][kTile + 1];
    size_t i = (size_t)blockIdx.x * kTile + threadIdx.x;
    float acc = 0.0f;
    if (i < D)
        for (size_t n = threadIdx.y; n < N; n += kTile) acc += dout[n * D + i] * (inp[n * D + i] * rstd[n]);
    sh[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    for (unsigned s = kTile / 2; s > 0; s >>= 1) {
        if (threadIdx.y < s) sh[threadIdx.y][threadIdx.x] += sh[threadIdx.y + s][threadIdx.x];
        __syncthreads();
    }
    if (threadIdx.y == 0 && i < D) dw[i] += sh[0][threadIdx.x];
}

/* ---------------------------------------------------------------------- rope */

struct RopeFreqs { float f[kMaxHalf]; }; /* freq_i = rope_freq(i), formed on the host as the CPU forms it */

/* cos/sin[t, i] of angle = (float)t * freq_i: the CPU's float angle bit for
 * bit; cos and sin in double, then rounded, agree with glibc's cosf/sinf
 * (< 1 ulp) except in rare near-ties */
__global__ void rope_tab(float *cos_tab, float *sin_tab, size_t T, size_t half, RopeFreqs fr) {
    GRID_STRIDE(e, T * half) {
        float angle = (float)(e / half) * fr.f[e % half];
        double s, c;
        sincos((double)angle, &s, &c);
        cos_tab[e] = (float)c;
        sin_tab[e] = (float)s;
    }
}

/* pair e = ((b*T + t)*nh + h)*half + i is (x[2e], x[2e+1]) (hd = 2 half):
 * rotated by +angle[t, i] (forward) or -angle (backward: the transpose) */
__global__ void rope_rot(float *x, const float *cos_tab, const float *sin_tab, size_t B, size_t T, size_t nh,
                         size_t half, float sign) {
    GRID_STRIDE(e, B * T * nh * half) {
        size_t i = e % half, t = (e / (half * nh)) % T;
        rope_pair(&x[2 * e], &x[2 * e + 1], cos_tab[t * half + i], sign * sin_tab[t * half + i]);
    }
}

/* ----------------------------------------------------------------- attention */

/* Forward, one block per query row (b, h, i), kv head g = h / (H/KV); the
 * scores of the row in shared memory [T]:
 *   s_j = (q_i . k_j) / sqrt(hd) for j <= i;  p = softmax(s), 0 for j > i
 *   probs[b, h, i, :] = p;  out_i = sum_{j <= i} p_j v_j  (j in order) */
__global__ void attention_fwd(float *out, float *probs, const float *q, const float *k, const float *v, size_t T,
                              size_t H, size_t KV, size_t hd) {
    extern __shared__ float s[]; /* [T] scores, then [blockDim] reduction space */
    float *red = s + T;
    size_t row = blockIdx.x; /* (b * H + h) * T + i */
    size_t i = row % T, h = (row / T) % H, b = row / (T * H);
    size_t g = h / (H / KV);
    const float *qi = q + ((b * T + i) * H + h) * hd;
    float scale = 1.0f / sqrtf((float)hd);
    for (size_t j = threadIdx.x; j <= i; j += blockDim.x) {
        const float *kj = k + ((b * T + j) * KV + g) * hd;
        float dot = 0.0f;
        for (size_t d = 0; d < hd; d++) dot += qi[d] * kj[d];
        s[j] = dot * scale;
    }
    float m = -INFINITY;
    for (size_t j = threadIdx.x; j <= i; j += blockDim.x) m = fmaxf(m, s[j]); /* each thread reads its own s[j] */
    m = block_max(m, red);
    float sum = 0.0f;
    for (size_t j = threadIdx.x; j <= i; j += blockDim.x) {
        s[j] = expf(s[j] - m);
        sum += s[j];
    }
    float inv = 1.0f / block_sum(sum, red);
    float *prow = probs + row * T;
    for (size_t j = threadIdx.x; j < T; j += blockDim.x) {
        float p = j <= i ? s[j] * inv : 0.0f;
        if (j <= i) s[j] = p;
        prow[j] = p;
    }
    __syncthreads();
    float *oi = out + ((b * T + i) * H + h) * hd;
    for (size_t d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.0f;
        for (size_t j = 0; j <= i; j++) acc += s[j] * v[((b * T + j) * KV + g) * hd + d];
        oi[d] = acc;
    }
}

/* Backward, step 1, one block per query row (b, h, i):
 *   dP_j = dout_i . v_j,  D_i = sum_j P_ij dP_j   (saved: rowterm[(b*H + h)*T + i])
 *   dS_j = P_ij (dP_j - D_i),  dq_i += (sum_{j <= i} dS_j k_j) / sqrt(hd)  (j in order) */
__global__ void attention_bwd_dq(float *dq, float *rowterm, const float *dout, const float *k, const float *v,
                                 const float *probs, size_t T, size_t H, size_t KV, size_t hd) {
    extern __shared__ float s[]; /* [T] dP then dS, then [blockDim] reduction space */
    float *red = s + T;
    size_t row = blockIdx.x;
    size_t i = row % T, h = (row / T) % H, b = row / (T * H);
    size_t g = h / (H / KV);
    const float *go = dout + ((b * T + i) * H + h) * hd;
    const float *prow = probs + row * T;
    float scale = 1.0f / sqrtf((float)hd);
    float part = 0.0f;
    for (size_t j = threadIdx.x; j <= i; j += blockDim.x) {
        const float *vj = v + ((b * T + j) * KV + g) * hd;
        float dp = 0.0f;
        for (size_t d = 0; d < hd; d++) dp += go[d] * vj[d];
        s[j] = dp;
        part += prow[j] * dp;
    }
    float Di = block_sum(part, red);
    for (size_t j = threadIdx.x; j <= i; j += blockDim.x) s[j] = prow[j] * (s[j] - Di);
    __syncthreads();
    float *dqi = dq + ((b * T + i) * H + h) * hd;
    for (size_t d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.0f;
        for (size_t j = 0; j <= i; j++) acc += s[j] * k[((b * T + j) * KV + g) * hd + d];
        dqi[d] += acc * scale;
    }
    if (threadIdx.x == 0) rowterm[row] = Di;
}

/* Backward, step 2, one block per key row (b, g, j) of kv head g, summing over
 * the heads h of group g in order and, within each, the queries i >= j in order:
 *   dv_j += sum P_ij dout_i;   dk_j += (sum dS_ij q_i) / sqrt(hd)
 * The block takes the queries blockDim at a time: thread t computes P and dS
 * of query i0 + t into shared memory, then thread d (up to 4 per thread)
 * folds the tile into its components of dk_j and dv_j. */
__global__ void attention_bwd_dkv(float *dk, float *dv, const float *dout, const float *q, const float *v,
                                  const float *probs, const float *rowterm, size_t T, size_t H, size_t KV, size_t hd) {
    __shared__ float tp[kThreads], tds[kThreads];
    size_t row = blockIdx.x; /* (b * KV + g) * T + j */
    size_t j = row % T, g = (row / T) % KV, b = row / (T * KV);
    size_t per = H / KV;
    const float *vj = v + ((b * T + j) * KV + g) * hd;
    float accv[4] = {0, 0, 0, 0}, acck[4] = {0, 0, 0, 0}; /* components d = threadIdx.x + c blockDim, c < 4 */
    for (size_t h = g * per; h < (g + 1) * per; h++) {
        for (size_t i0 = j; i0 < T; i0 += blockDim.x) {
            size_t i = i0 + threadIdx.x;
            if (i < T) {
                size_t prow = (b * H + h) * T + i;
                const float *go = dout + ((b * T + i) * H + h) * hd;
                float dp = 0.0f;
                for (size_t d = 0; d < hd; d++) dp += go[d] * vj[d];
                float p = probs[prow * T + j];
                tp[threadIdx.x] = p;
                tds[threadIdx.x] = p * (dp - rowterm[prow]);
            }
            __syncthreads();
            size_t n = T - i0 < blockDim.x ? T - i0 : blockDim.x;
            for (int c = 0; c < 4; c++) {
                size_t d = threadIdx.x + (size_t)c * blockDim.x;
                if (d >= hd) break;
                for (size_t t = 0; t < n; t++) {
                    size_t qi = ((b * T + i0 + t) * H + h) * hd + d;
                    accv[c] += tp[t] * dout[qi];
                    acck[c] += tds[t] * q[qi];
                }
            }
            __syncthreads();
        }
    }
    float scale = 1.0f / sqrtf((float)hd);
    for (int c = 0; c < 4; c++) {
        size_t d = threadIdx.x + (size_t)c * blockDim.x;
        if (d >= hd) break;
        dv[((b * T + j) * KV + g) * hd + d] += accv[c];
        dk[((b * T + j) * KV + g) * hd + d] += acck[c] * scale;
    }
}

/* --------------------------------------------------------------- elementwise */

/* out = silu(a) b, silu(a) = a / (1 + exp(-a)) */
__global__ void swiglu_fwd(float *out, const float *a, const float *b, size_t n) {
    GRID_STRIDE(i, n) { out[i] = swiglu_elem(a[i], b[i]); }
}

/* da += g b sig (1 + a (1 - sig)),  db += g silu(a) */
__global__ void swiglu_bwd(float *da, float *db, const float *dout, const float *a, const float *b, size_t n) {
    GRID_STRIDE(i, n) { swiglu_backward_elem(dout[i], a[i], b[i], &da[i], &db[i]); }
}

/* out = a + b (out may alias a or b: each thread reads its element before writing it) */
__global__ void add_k(float *out, const float *a, const float *b, size_t n) {
    GRID_STRIDE(i, n) { out[i] = a[i] + b[i]; }
}

/* bfloat16 casts: the conversions of ops_math.h, element by element */
__global__ void cast_to_bf16_k(uint16_t *out, const float *in, size_t n) {
    GRID_STRIDE(i, n) { out[i] = bf16_from_f32(in[i]); }
}
__global__ void cast_from_bf16_k(float *out, const uint16_t *in, size_t n) {
    GRID_STRIDE(i, n) { out[i] = bf16_to_f32(in[i]); }
}

/* ------------------------------------------------------------- cross-entropy */

/* logsumexp of one row x[V] by one warp: m = max_j x_j, then
 * lse = m + log(sum_j exp(x_j - m)) with the sum in double (lanes stride the
 * row, then the fixed warp tree); every lane returns it */
__device__ float warp_row_lse(const float *x, size_t V, unsigned lane) {
    float m = -INFINITY;
    for (size_t j = lane; j < V; j += kWarp) m = fmaxf(m, x[j]);
    m = warp_max(m);
    double s = 0.0;
    for (size_t j = lane; j < V; j += kWarp) s += (double)expf(x[j] - m);
    s = warp_sum(s);
    return (float)((double)m + log(s));
}

/* *loss = (1/N) sum_n (lse_n - x[n, target_n]), in ONE block of kOneBlock
 * threads: warp w takes rows w, w + 32, ... and sums their terms in row
 * order (double), then thread 0 adds the 32 warp sums in warp order. One
 * block because the per-row terms have nowhere else to go (CeArgs has no
 * workspace). A target outside [0, V) (the CPU op stops on it) gives NaN. */
__global__ void __launch_bounds__(kOneBlock)
    ce_fwd(float *loss, const float *logits, const int32_t *tgt, size_t N, size_t V) {
    __shared__ double warp_total[kOneBlock / kWarp];
    unsigned lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, nwarps = blockDim.x / kWarp;
    double total = 0.0;
    for (size_t n = warp; n < N; n += nwarps) {
        const float *x = logits + n * V;
        float lse = warp_row_lse(x, V, lane);
        int32_t t = tgt[n];
        total += (t < 0 || (size_t)t >= V) ? (double)NAN : (double)lse - (double)x[t];
    }
    if (lane == 0) warp_total[warp] = total;
    __syncthreads();
    if (threadIdx.x == 0) {
        double sum = 0.0;
        for (unsigned w = 0; w < nwarps; w++) sum += warp_total[w];
        *loss = (float)(sum / (double)N);
    }
}

/* one warp per row n: dlogits[n, j] += (exp(x_j - lse) - [j == target]) * scale
 * (a bad target makes the row NaN) */
__global__ void ce_bwd(float *dlogits, const float *logits, const int32_t *tgt, size_t N, size_t V, float scale) {
    size_t n = (size_t)blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp;
    unsigned lane = threadIdx.x % kWarp;
    if (n >= N) return; /* the whole warp: the shuffles below stay full-warp */
    const float *x = logits + n * V;
    float *dx = dlogits + n * V;
    float lse = warp_row_lse(x, V, lane);
    int32_t t = tgt[n];
    bool bad = t < 0 || (size_t)t >= V;
    for (size_t j = lane; j < V; j += kWarp) {
        float p = expf(x[j] - lse);
        dx[j] += bad ? NAN : (j == (size_t)t ? p - 1.0f : p) * scale;
    }
}

/* ------------------------------------------------------------ sum of squares */

/* *acc += (float) sum_i x_i^2 in ONE block of kOneBlock threads: thread k sums
 * x[k], x[k + 1024], ... in double, then a fixed tree over the block */
__global__ void __launch_bounds__(kOneBlock) sumsq_k(float *acc, const float *x, size_t n) {
    __shared__ double sh[kOneBlock];
    double s = 0.0;
#pragma unroll 4
    for (size_t i = threadIdx.x; i < n; i += blockDim.x) s += (double)x[i] * (double)x[i];
    s = block_sum(s, sh);
    if (threadIdx.x == 0) *acc += (float)s;
}

/* --------------------------------------------------------------------- adamw */

/* AdamW as adamw_update (optim.c), with the clip coefficient
 * min(1, max_norm / (sqrt(total_sumsq) + 1e-6)) formed on the device */
__global__ void adamw_k(float *param, const float *grad, float *m_, float *v_, size_t n, AdamWScalars k,
                        float max_norm, const float *total_sumsq, float *clip_out) {
    float coef = clip_coef(max_norm, sqrtf(*total_sumsq));
    if (clip_out && blockIdx.x == 0 && threadIdx.x == 0) *clip_out = coef;
    GRID_STRIDE(i, n) { adamw_elem(&param[i], grad[i], &m_[i], &v_[i], &k, coef); }
}

/* ----------------------------------------------------------------- host side */

/* C = op(A) op(B) (+ C if beta = 1), column-major, on this launch's stream:
 * exact fp32, or TF32 tensor cores when the run asked for them (--tf32) */
void gemm(cublasOperation_t ta, cublasOperation_t tb, size_t m, size_t n, size_t k, const float *A, size_t lda,
          const float *B, size_t ldb, float beta, float *C, size_t ldc) {
    const float one = 1.0f;
    cublasComputeType_t ct = cuda_tf32_enabled() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    CUBLAS_CHECK(cublasGemmEx(cuda_current_cublas(), ta, tb, blas_int(m, "matmul"), blas_int(n, "matmul"),
                              blas_int(k, "matmul"), &one, A, CUDA_R_32F, blas_int(lda, "matmul"), B, CUDA_R_32F,
                              blas_int(ldb, "matmul"), &beta, C, CUDA_R_32F, blas_int(ldc, "matmul"), ct,
                              CUBLAS_GEMM_DEFAULT));
}

/* dynamic shared memory of the attention row kernels: T scores + the reduction space */
size_t attn_shared_bytes(size_t T, const char *what) {
    size_t bytes = (T + kThreads) * sizeof(float);
    if (bytes > 48 * 1024)
        fatal("%s: seq-len %zu needs %zu bytes of shared memory per block (at most 48 KiB: seq-len <= %d)", what, T,
              bytes, 48 * 1024 / (int)sizeof(float) - kThreads);
    return bytes;
}

void attn_check(size_t H, size_t KV, size_t hd, const char *what) {
    if (KV == 0 || H % KV != 0) fatal("%s: n_heads %zu is not a multiple of n_kv_heads %zu", what, H, KV);
    if (hd > 4 * (size_t)kThreads) fatal("%s: head dim %zu is more than %d", what, hd, 4 * kThreads);
}

/* A kernel with a grid-stride loop over n elements, launched on the current
 * stream (args convert to its parameters); for n == 0 there is nothing to do. */
template <typename... Params, typename... Args>
void launch_per_element(void (*kernel)(Params...), size_t n, const char *what, Args... args) {
    if (!n) return;
    kernel<<<blocks_for(n), kThreads, 0, cuda_current_stream()>>>(args...);
    CUDA_CHECK_LAUNCH(what);
}

} // namespace

/* ================================================================== kcuda_* */

extern "C" {

const char *cublas_status_name(cublasStatus_t s) {
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
    default: return "unknown cuBLAS status";
    }
}

void kcuda_embedding_forward(void *a) {
    EmbArgs *x = (EmbArgs *)a;
    if (!x->N || !x->D) return;
    embedding_fwd<<<blocks_for(x->N * x->D), kThreads, 0, cuda_current_stream()>>>(x->out, x->tok, x->w, x->N, x->D);
    CUDA_CHECK_LAUNCH("embedding_fwd");
}

void kcuda_embedding_backward(void *a) { /* out = dwte, w = dout */
    EmbArgs *x = (EmbArgs *)a;
    if (!x->N || !x->D) return;
    unsigned P = 1; /* a power of two, for about 64k threads however wide the rows */
    while (P < 1024 && (size_t)P * x->D < 65536) P *= 2;
    embedding_bwd<<<blocks_for(x->D * P), kThreads, 0, cuda_current_stream()>>>(x->out, x->w, x->tok, x->N, x->D, P);
    CUDA_CHECK_LAUNCH("embedding_bwd");
}

void kcuda_rmsnorm_forward(void *a) {
    NormArgs *x = (NormArgs *)a;
    if (!x->N) return;
    rmsnorm_fwd<<<grid_rows(x->N, "rmsnorm"), kThreads, 0, cuda_current_stream()>>>(x->out, x->rstd, x->in, x->w,
                                                                                      x->D, x->eps);
    CUDA_CHECK_LAUNCH("rmsnorm_fwd");
}

void kcuda_rmsnorm_backward(void *a) {
    NormBwdArgs *x = (NormBwdArgs *)a;
    if (!x->N || !x->D) return;
    rmsnorm_bwd_dx<<<grid_rows(x->N, "rmsnorm_bwd"), kThreads, 0, cuda_current_stream()>>>(x->dinp, x->dout, x->in,
                                                                                             x->w, x->rstd, x->D);
    CUDA_CHECK_LAUNCH("rmsnorm_bwd_dx");
    dim3 tile(kTile, kTile);
    rmsnorm_bwd_dw<<<grid_rows((x->D + kTile - 1) / kTile, "rmsnorm_bwd"), tile, 0, cuda_current_stream()>>>(
        x->dw, x->dout, x->in, x->rstd, x->N, x->D);
    CUDA_CHECK_LAUNCH("rmsnorm_bwd_dw");
}

/* Row-major nn.Linear through column-major cuBLAS: a row-major [R, C] matrix
 * is the column-major [C, R] matrix (its transpose) with ld = C, so each
 * product is computed transposed:
 *   out^T [OC, N] = op_T(W: col-major [C, OC]) x in^T [C, N] */
void kcuda_matmul_forward(void *a) {
    MmArgs *x = (MmArgs *)a;
    if (!x->N || !x->OC) return;
    if (!x->C) {
        CUDA_CHECK(cudaMemsetAsync(x->out, 0, x->N * x->OC * sizeof(float), cuda_current_stream()));
        return;
    }
    gemm(CUBLAS_OP_T, CUBLAS_OP_N, x->OC, x->N, x->C, x->w, x->C, x->in, x->C, 0.0f, x->out, x->OC);
}

/* dinp^T [C, N]  += W^T [C, OC] x dout^T [OC, N]     (W's col-major view as is)
 * dW^T   [C, OC] += in^T [C, N] x op_T(dout^T [OC, N])   (beta = 1 accumulates) */
void kcuda_matmul_backward(void *a) {
    MmBwdArgs *x = (MmBwdArgs *)a;
    if (!x->N || !x->C || !x->OC) return;
    if (x->dinp) gemm(CUBLAS_OP_N, CUBLAS_OP_N, x->C, x->N, x->OC, x->w, x->C, x->dout, x->OC, 1.0f, x->dinp, x->C);
    if (x->dw) gemm(CUBLAS_OP_N, CUBLAS_OP_T, x->C, x->OC, x->N, x->in, x->C, x->dout, x->OC, 1.0f, x->dw, x->C);
}

void kcuda_rope(void *a) {
    RopeArgs *r = (RopeArgs *)a;
    if (r->hd % 2 != 0) fatal("rope: head dim %zu is odd", r->hd);
    size_t half = r->hd / 2, n = r->B * r->T * r->nh * half;
    launch_per_element(rope_rot, n, "rope_rot", r->x, r->cos, r->sin, r->B, r->T, r->nh, half,
                       r->backward ? -1.0f : 1.0f);
}

void kcuda_rope_tables(void *a) {
    RopeTabArgs *r = (RopeTabArgs *)a;
    if (r->hd % 2 != 0) fatal("rope_tables: head dim %zu is odd", r->hd);
    size_t half = r->hd / 2;
    if (half > (size_t)kMaxHalf) fatal("rope_tables: head dim %zu is more than %d", r->hd, 2 * kMaxHalf);
    if (!r->T || !half) return;
    RopeFreqs fr;
    for (size_t i = 0; i < half; i++) fr.f[i] = rope_freq(i, r->hd, r->theta); /* host libm, as the CPU */
    rope_tab<<<blocks_for(r->T * half), kThreads, 0, cuda_current_stream()>>>(r->cos, r->sin, r->T, half, fr);
    CUDA_CHECK_LAUNCH("rope_tab");
}

void kcuda_attention_forward(void *a) {
    AttArgs *x = (AttArgs *)a;
    attn_check(x->H, x->KV, x->hd, "attention_forward");
    if (!x->B || !x->T || !x->H || !x->hd) return;
    attention_fwd<<<grid_rows(x->B * x->H * x->T, "attention"), kThreads, attn_shared_bytes(x->T, "attention"),
                    cuda_current_stream()>>>(x->out, x->probs, x->q, x->k, x->v, x->T, x->H, x->KV, x->hd);
    CUDA_CHECK_LAUNCH("attention_fwd");
}

size_t kcuda_attention_scratch_floats(size_t B, size_t T, size_t H) {
    size_t n = B * T * H; /* D_i = sum_j P_ij dP_ij of every query row */
    return n ? n : 1;
}

void kcuda_attention_backward(void *a) {
    AttBwdArgs *x = (AttBwdArgs *)a;
    attn_check(x->H, x->KV, x->hd, "attention_backward");
    if (!x->B || !x->T || !x->H || !x->hd) return;
    attention_bwd_dq<<<grid_rows(x->B * x->H * x->T, "attention_bwd"), kThreads,
                       attn_shared_bytes(x->T, "attention_bwd"), cuda_current_stream()>>>(
        x->dq, x->scratch, x->dout, x->k, x->v, x->probs, x->T, x->H, x->KV, x->hd);
    CUDA_CHECK_LAUNCH("attention_bwd_dq");
    attention_bwd_dkv<<<grid_rows(x->B * x->KV * x->T, "attention_bwd"), kThreads, 0, cuda_current_stream()>>>(
        x->dk, x->dv, x->dout, x->q, x->v, x->probs, x->scratch, x->T, x->H, x->KV, x->hd);
    CUDA_CHECK_LAUNCH("attention_bwd_dkv");
}

void kcuda_swiglu_forward(void *a) {
    SwiArgs *x = (SwiArgs *)a;
    launch_per_element(swiglu_fwd, x->n, "swiglu_fwd", x->out, x->a, x->b, x->n);
}

void kcuda_swiglu_backward(void *a) {
    SwiBwdArgs *x = (SwiBwdArgs *)a;
    launch_per_element(swiglu_bwd, x->n, "swiglu_bwd", x->da, x->db, x->dout, x->a, x->b, x->n);
}

void kcuda_add(void *a) {
    AddArgs *x = (AddArgs *)a;
    launch_per_element(add_k, x->n, "add", x->out, x->a, x->b, x->n);
}

void kcuda_cast_to_bf16(void *a) {
    CastArgs *x = (CastArgs *)a;
    launch_per_element(cast_to_bf16_k, x->n, "cast_to_bf16", x->bf16, x->f32, x->n);
}

void kcuda_cast_from_bf16(void *a) {
    CastArgs *x = (CastArgs *)a;
    launch_per_element(cast_from_bf16_k, x->n, "cast_from_bf16", x->f32, x->bf16, x->n);
}

void kcuda_crossentropy_forward(void *a) {
    CeArgs *x = (CeArgs *)a;
    if (!x->N) { /* the CPU op's mean over no rows is 0 */
        CUDA_CHECK(cudaMemsetAsync(x->loss, 0, sizeof(float), cuda_current_stream()));
        return;
    }
    ce_fwd<<<1, kOneBlock, 0, cuda_current_stream()>>>(x->loss, x->logits, x->tgt, x->N, x->V);
    CUDA_CHECK_LAUNCH("ce_fwd");
}

void kcuda_crossentropy_backward(void *a) {
    CeArgs *x = (CeArgs *)a;
    if (!x->N || !x->V) return;
    size_t rows_per_block = kThreads / kWarp;
    ce_bwd<<<grid_rows((x->N + rows_per_block - 1) / rows_per_block, "cross_entropy_bwd"), kThreads, 0,
             cuda_current_stream()>>>(x->dlogits, x->logits, x->tgt, x->N, x->V, 1.0f / (float)x->mean_over);
    CUDA_CHECK_LAUNCH("ce_bwd");
}

void kcuda_sumsq_accumulate(void *a) {
    SumsqArgs *x = (SumsqArgs *)a;
    if (!x->n) return; /* += 0 */
    sumsq_k<<<1, kOneBlock, 0, cuda_current_stream()>>>(x->acc, x->x, x->n);
    CUDA_CHECK_LAUNCH("sumsq");
}

void kcuda_adamw(void *a) {
    AdamArgs *x = (AdamArgs *)a;
    if (!x->n) {
        if (x->clip_out) { /* no rows here, but the probe still wants the coefficient */
            adamw_k<<<1, 1, 0, cuda_current_stream()>>>(x->param, x->grad, x->m, x->v, 0, adamw_scalars(&x->c, x->lr, x->t),
                                                       x->c.max_norm, x->total_sumsq, x->clip_out);
            CUDA_CHECK_LAUNCH("adamw");
        }
        return;
    }
    AdamWScalars k = adamw_scalars(&x->c, x->lr, x->t); /* on the host, as the CPU update forms them */
    adamw_k<<<blocks_for(x->n), kThreads, 0, cuda_current_stream()>>>(x->param, x->grad, x->m, x->v, x->n, k,
                                                                       x->c.max_norm, x->total_sumsq, x->clip_out);
    CUDA_CHECK_LAUNCH("adamw");
}

} // extern "C"
