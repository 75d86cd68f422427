/* kernels_cuda.cu — the stream kernels of kernels.h on CUDA (kcuda_*).
 *
 * Each kcuda_* runs on the host thread inside dev_launch and only enqueues
 * work on cuda_current_stream(): kernels, cuBLAS calls, nothing that waits.
 * The math and the accumulate (+=) convention are those of ops.h; the
 * comments give each kernel's formula. Reductions use fixed trees or fixed
 * sequential loops, never atomics, so every run gives the same bits (they
 * differ from the CPU's bits by rounding: the order of additions differs).
 *
 * Layouts (row-major): x [N, D]; q [B, T, H, hd]; k, v [B, T, KV, hd];
 * probs [B, H, T, T]; logits [N, V]. Sizes are size_t; element indices that
 * can pass 2^31 (probs, logits) are computed in size_t. */
#include <math.h>
#include <stdint.h>

#include "cuda/cuda_check.h"
extern "C" {
#include "optim.h" /* a C header: adamw_scalars has C linkage */
}
#include "kernels.h"
#include "ops_math.h" /* the per-element formulas the CPU ops use */

namespace {

constexpr int kThreads = 256;

unsigned blocks_for(size_t n, int threads = kThreads) {
    size_t b = (n + (size_t)threads - 1) / (size_t)threads;
    if (b == 0) b = 1;
    if (b > 65535u * 32u) b = 65535u * 32u; /* kernels loop grid-stride past this */
    return (unsigned)b;
}

unsigned grid_rows(size_t rows, const char *what) {
    if (rows > 0x7fffffffu) fatal("%s: %zu rows is more than one launch can index", what, rows);
    return (unsigned)rows;
}

int blas_int(size_t v, const char *what) {
    if (v > 0x7fffffff) fatal("%s: dimension %zu does not fit cuBLAS's int", what, v);
    return (int)v;
}

#define GRID_STRIDE(i, n) for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (size_t)gridDim.x * blockDim.x)

/* Sum of one value per thread over the block, as a fixed tree (blockDim a
 * power of two <= 1024). Every thread gets the result. */
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

template <typename T> __device__ T block_max(T v, T *sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sh[threadIdx.x] = fmaxf(sh[threadIdx.x], sh[threadIdx.x + s]);
        __syncthreads();
    }
    T r = sh[0];
    __syncthreads();
    return r;
}

/* ----------------------------------------------------------------- embedding */

/* out[n, d] = wte[tok[n], d] */
__global__ void embedding_fwd(float *out, const int32_t *tok, const float *wte, size_t N, size_t D) {
    GRID_STRIDE(i, N * D) { out[i] = wte[(size_t)tok[i / D] * D + i % D]; }
}

/* dwte[tok[n], d] += dout[n, d], n = 0..N-1 in order: one thread per column d,
 * so no two threads touch one element and the order is the CPU's. */
__global__ void embedding_bwd(float *dwte, const float *dout, const int32_t *tok, size_t N, size_t D) {
    GRID_STRIDE(d, D) {
        for (size_t n = 0; n < N; n++) dwte[(size_t)tok[n] * D + d] += dout[n * D + d];
    }
}

/* ------------------------------------------------------------------- rmsnorm */

/* one block per row: r = 1/sqrt(mean(x^2) + eps) (sum in double); out = (x r) w */
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

/* one block per row: dx += r (g w) - x r^3/D sum_i(g_i w_i x_i) */
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

/* dw[i] += sum_n g[n,i] x[n,i] r[n]: one thread per column, rows in order */
__global__ void rmsnorm_bwd_dw(float *dw, const float *dout, const float *inp, const float *rstd, size_t N, size_t D) {
    GRID_STRIDE(i, D) {
        float acc = dw[i];
        for (size_t n = 0; n < N; n++) acc += dout[n * D + i] * (inp[n * D + i] * rstd[n]);
        dw[i] = acc;
    }
}

/* ---------------------------------------------------------------------- rope */

/* freq_i = 1/theta^(2i/hd); cos/sin of (float)t * freq_i, as the CPU tables */
__global__ void rope_tab(float *cos_tab, float *sin_tab, size_t T, size_t half, float theta) {
    GRID_STRIDE(e, T * half) {
        size_t t = e / half, i = e % half;
        float freq = 1.0f / powf(theta, (float)(2 * i) / (float)(2 * half));
        float angle = (float)t * freq;
        cos_tab[e] = cosf(angle);
        sin_tab[e] = sinf(angle);
    }
}

/* pair (x0, x1) = (x[2i], x[2i+1]) of row (b, t, head): rotated by +angle[t, i]
 * (forward) or -angle (backward: the transpose) */
__global__ void rope_rot(float *x, const float *cos_tab, const float *sin_tab, size_t B, size_t T, size_t nh,
                         size_t half, float sign) {
    GRID_STRIDE(e, B * T * nh * half) {
        size_t i = e % half, t = (e / (half * nh)) % T;
        rope_pair(&x[2 * e], &x[2 * e + 1], cos_tab[t * half + i], sign * sin_tab[t * half + i]);
    }
}

/* ----------------------------------------------------------------- attention */

/* One block per query row (b, h, i); scores in shared memory [T]:
 *   s_j = q_i . k_j / sqrt(hd) for j <= i;  p = softmax(s) (0 for j > i)
 *   out_i = sum_j p_j v_j */
__global__ void attention_fwd(float *out, float *probs, const float *q, const float *k, const float *v, size_t T,
                              size_t H, size_t KV, size_t hd) {
    extern __shared__ float s[]; /* [T] scores, then [blockDim] reduction space */
    float *red = s + T;
    size_t row = blockIdx.x; /* (b * H + h) * T + i */
    size_t i = row % T, h = (row / T) % H, b = row / (T * H);
    size_t kvh = h / (H / KV);
    const float *qi = q + ((b * T + i) * H + h) * hd;
    float scale = 1.0f / sqrtf((float)hd);
    for (size_t j = threadIdx.x; j <= i; j += blockDim.x) {
        const float *kj = k + ((b * T + j) * KV + kvh) * hd;
        float dot = 0.0f;
        for (size_t d = 0; d < hd; d++) dot += qi[d] * kj[d];
        s[j] = dot * scale;
    }
    __syncthreads();
    float m = -INFINITY;
    for (size_t j = threadIdx.x; j <= i; j += blockDim.x) m = fmaxf(m, s[j]);
    m = block_max(m, red);
    float sum = 0.0f;
    for (size_t j = threadIdx.x; j <= i; j += blockDim.x) {
        s[j] = expf(s[j] - m);
        sum += s[j];
    }
    sum = block_sum(sum, red);
    float inv = 1.0f / sum;
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
        for (size_t j = 0; j <= i; j++) acc += s[j] * v[((b * T + j) * KV + kvh) * hd + d];
        oi[d] = acc;
    }
}

/* Backward, step 1, one block per query row (b, h, i):
 *   dP_j = dout_i . v_j,  D_i = sum_j P_ij dP_j  (saved to rowterm[b, h, i])
 *   dS_j = P_ij (dP_j - D_i),  dq_i += sum_j dS_j k_j / sqrt(hd) */
__global__ void attention_bwd_dq(float *dq, float *rowterm, const float *dout, const float *k, const float *v,
                                 const float *probs, size_t T, size_t H, size_t KV, size_t hd) {
    extern __shared__ float s[]; /* [T] dS, then [blockDim] reduction space */
    float *red = s + T;
    size_t row = blockIdx.x;
    size_t i = row % T, h = (row / T) % H, b = row / (T * H);
    size_t kvh = h / (H / KV);
    const float *go = dout + ((b * T + i) * H + h) * hd;
    const float *prow = probs + row * T;
    float scale = 1.0f / sqrtf((float)hd);
    float dsum = 0.0f;
    for (size_t j = threadIdx.x; j <= i; j += blockDim.x) {
        const float *vj = v + ((b * T + j) * KV + kvh) * hd;
        float dp = 0.0f;
        for (size_t d = 0; d < hd; d++) dp += go[d] * vj[d];
        s[j] = dp;
        dsum += prow[j] * dp;
    }
    float Di = block_sum(dsum, red); /* also orders the writes of s[] before the reads below */
    for (size_t j = threadIdx.x; j <= i; j += blockDim.x) s[j] = prow[j] * (s[j] - Di);
    __syncthreads();
    float *dqi = dq + ((b * T + i) * H + h) * hd;
    for (size_t d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.0f;
        for (size_t j = 0; j <= i; j++) acc += s[j] * k[((b * T + j) * KV + kvh) * hd + d];
        dqi[d] += acc * scale;
    }
    if (threadIdx.x == 0) rowterm[row] = Di;
}

/* Backward, step 2, one block per key row (b, kv head g, j), summing over the
 * heads h of group g and the queries i >= j, in that order:
 *   dv_j += sum P_ij dout_i;   dk_j += sum dS_ij q_i / sqrt(hd)
 * Threads first compute P and dS for a tile of queries, then each thread owns
 * one component d of dk_j and dv_j. */
__global__ void attention_bwd_dkv(float *dk, float *dv, const float *dout, const float *q, const float *v,
                                  const float *probs, const float *rowterm, size_t T, size_t H, size_t KV, size_t hd) {
    __shared__ float tp[kThreads], tds[kThreads];
    size_t row = blockIdx.x; /* (b * KV + g) * T + j */
    size_t j = row % T, g = (row / T) % KV, b = row / (T * KV);
    size_t per = H / KV;
    const float *vj = v + ((b * T + j) * KV + g) * hd;
    float scale = 1.0f / sqrtf((float)hd);
    float accv[4] = {0, 0, 0, 0}, acck[4] = {0, 0, 0, 0}; /* components d = threadIdx.x + 4k... up to 4 per thread */
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
                    size_t ii = i0 + t;
                    accv[c] += tp[t] * dout[((b * T + ii) * H + h) * hd + d];
                    acck[c] += tds[t] * q[((b * T + ii) * H + h) * hd + d];
                }
            }
            __syncthreads();
        }
    }
    for (int c = 0; c < 4; c++) {
        size_t d = threadIdx.x + (size_t)c * blockDim.x;
        if (d >= hd) break;
        dv[((b * T + j) * KV + g) * hd + d] += accv[c];
        dk[((b * T + j) * KV + g) * hd + d] += acck[c] * scale;
    }
}

/* -------------------------------------------------------------- elementwise */

/* out = silu(a) b, silu(a) = a / (1 + exp(-a)) */
__global__ void swiglu_fwd(float *out, const float *a, const float *b, size_t n) {
    GRID_STRIDE(i, n) { out[i] = swiglu_elem(a[i], b[i]); }
}

/* da += g b sig (1 + a (1 - sig)),  db += g silu(a) */
__global__ void swiglu_bwd(float *da, float *db, const float *dout, const float *a, const float *b, size_t n) {
    GRID_STRIDE(i, n) { swiglu_backward_elem(dout[i], a[i], b[i], &da[i], &db[i]); }
}

__global__ void add_k(float *out, const float *a, const float *b, size_t n) {
    GRID_STRIDE(i, n) { out[i] = a[i] + b[i]; }
}

/* ------------------------------------------------------------ cross-entropy */

/* one block per row: lse = m + log(sum exp(x - m)); row_loss[n] = lse - x[target] (double) */
__global__ void ce_rows(double *row_loss, const float *logits, const int32_t *tgt, size_t V) {
    __shared__ double shd[kThreads];
    __shared__ float shf[kThreads];
    const float *x = logits + (size_t)blockIdx.x * V;
    float m = -INFINITY;
    for (size_t j = threadIdx.x; j < V; j += blockDim.x) m = fmaxf(m, x[j]);
    m = block_max(m, shf);
    double s = 0.0;
    for (size_t j = threadIdx.x; j < V; j += blockDim.x) s += (double)expf(x[j] - m);
    s = block_sum(s, shd);
    if (threadIdx.x == 0) row_loss[blockIdx.x] = (double)(float)((double)m + log(s)) - (double)x[tgt[blockIdx.x]];
}

/* *loss = (sum_n row_loss[n], rows in order) / N: the CPU's order */
__global__ void ce_mean(float *loss, const double *row_loss, size_t N) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    double total = 0.0;
    for (size_t n = 0; n < N; n++) total += row_loss[n];
    *loss = (float)(total / (double)N);
}

/* one block per row: dlogits += (softmax(x) - onehot(target)) * scale */
__global__ void ce_bwd(float *dlogits, const float *logits, const int32_t *tgt, size_t V, float scale) {
    __shared__ double shd[kThreads];
    __shared__ float shf[kThreads];
    const float *x = logits + (size_t)blockIdx.x * V;
    float *dx = dlogits + (size_t)blockIdx.x * V;
    float m = -INFINITY;
    for (size_t j = threadIdx.x; j < V; j += blockDim.x) m = fmaxf(m, x[j]);
    m = block_max(m, shf);
    double s = 0.0;
    for (size_t j = threadIdx.x; j < V; j += blockDim.x) s += (double)expf(x[j] - m);
    s = block_sum(s, shd);
    float lse = (float)((double)m + log(s));
    size_t t = (size_t)tgt[blockIdx.x];
    for (size_t j = threadIdx.x; j < V; j += blockDim.x) {
        float p = expf(x[j] - lse);
        dx[j] += (j == t ? p - 1.0f : p) * scale;
    }
}

/* ----------------------------------------------------------- sum of squares */

constexpr int kSumsqBlocks = 256;

/* partial[block] = sum of x^2 over this block's grid-stride elements (double) */
__global__ void sumsq_partial(double *partial, const float *x, size_t n) {
    __shared__ double sh[kThreads];
    double s = 0.0;
    GRID_STRIDE(i, n) { s += (double)x[i] * (double)x[i]; }
    s = block_sum(s, sh);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

/* *acc += (float)(sum of the partials in block order) */
__global__ void sumsq_finish(float *acc, const double *partial, int nblocks) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    double s = 0.0;
    for (int b = 0; b < nblocks; b++) s += partial[b];
    *acc += (float)s;
}

/* -------------------------------------------------------------------- adamw */

/* AdamW as adamw_update (optim.c), clip coefficient min(1, max_norm / (norm + 1e-6))
 * from the global sum of squares on the device */
__global__ void adamw_k(float *param, const float *grad, float *m_, float *v_, size_t n, AdamWScalars k,
                        float max_norm, const float *total_sumsq) {
    float coef = clip_coef(max_norm, sqrtf(*total_sumsq));
    GRID_STRIDE(i, n) { adamw_elem(&param[i], grad[i], &m_[i], &v_[i], &k, coef); }
}

/* cuBLAS with this run's precision: exact fp32, or TF32 tensor cores (--tf32) */
void gemm(cublasOperation_t ta, cublasOperation_t tb, size_t m, size_t n, size_t k, const float *A, size_t lda,
          const float *B, size_t ldb, float beta, float *C, size_t ldc) {
    const float one = 1.0f;
    cublasComputeType_t ct = cuda_tf32_enabled() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    CUBLAS_CHECK(cublasGemmEx(cuda_current_cublas(), ta, tb, blas_int(m, "matmul"), blas_int(n, "matmul"),
                              blas_int(k, "matmul"), &one, A, CUDA_R_32F, blas_int(lda, "matmul"), B, CUDA_R_32F,
                              blas_int(ldb, "matmul"), &beta, C, CUDA_R_32F, blas_int(ldc, "matmul"), ct,
                              CUBLAS_GEMM_DEFAULT));
}

size_t attn_shared_bytes(size_t T, const char *what) {
    size_t bytes = (T + kThreads) * sizeof(float);
    if (bytes > 48 * 1024) fatal("%s: seq-len %zu needs %zu bytes of shared memory per block (at most 48 KiB)", what, T, bytes);
    return bytes;
}

} // namespace

/* ================================================================ kcuda_* */

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
    embedding_bwd<<<blocks_for(x->D), kThreads, 0, cuda_current_stream()>>>(x->out, x->w, x->tok, x->N, x->D);
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
    rmsnorm_bwd_dw<<<blocks_for(x->D), kThreads, 0, cuda_current_stream()>>>(x->dw, x->dout, x->in, x->rstd, x->N,
                                                                               x->D);
    CUDA_CHECK_LAUNCH("rmsnorm_bwd_dw");
}

/* Row-major nn.Linear through column-major cuBLAS: a row-major [R, C] matrix
 * is a column-major [C, R] one, so every product is computed transposed.
 *   out^T [OC, N] = W [OC, C] (= op T of W's col-major [C, OC]) x in^T [C, N] */
void kcuda_matmul_forward(void *a) {
    MmArgs *x = (MmArgs *)a;
    if (!x->N || !x->OC) return;
    if (!x->C) {
        CUDA_CHECK(cudaMemsetAsync(x->out, 0, x->N * x->OC * sizeof(float), cuda_current_stream()));
        return;
    }
    gemm(CUBLAS_OP_T, CUBLAS_OP_N, x->OC, x->N, x->C, x->w, x->C, x->in, x->C, 0.0f, x->out, x->OC);
}

/* dinp^T [C, N] += W^T [C, OC] x dout^T [OC, N];  dW^T [C, OC] += in^T [C, N] x dout [N, OC] */
void kcuda_matmul_backward(void *a) {
    MmBwdArgs *x = (MmBwdArgs *)a;
    if (!x->N || !x->C || !x->OC) return;
    if (x->dinp) gemm(CUBLAS_OP_N, CUBLAS_OP_N, x->C, x->N, x->OC, x->w, x->C, x->dout, x->OC, 1.0f, x->dinp, x->C);
    if (x->dw) gemm(CUBLAS_OP_N, CUBLAS_OP_T, x->C, x->OC, x->N, x->in, x->C, x->dout, x->OC, 1.0f, x->dw, x->C);
}

void kcuda_rope(void *a) {
    RopeArgs *r = (RopeArgs *)a;
    size_t half = r->hd / 2, n = r->B * r->T * r->nh * half;
    if (!n) return;
    rope_rot<<<blocks_for(n), kThreads, 0, cuda_current_stream()>>>(r->x, r->cos, r->sin, r->B, r->T, r->nh, half,
                                                                     r->backward ? -1.0f : 1.0f);
    CUDA_CHECK_LAUNCH("rope_rot");
}

void kcuda_rope_tables(void *a) {
    RopeTabArgs *r = (RopeTabArgs *)a;
    if (r->hd % 2 != 0) fatal("rope_tables: head dim %zu is odd", r->hd);
    size_t half = r->hd / 2;
    if (!r->T || !half) return;
    rope_tab<<<blocks_for(r->T * half), kThreads, 0, cuda_current_stream()>>>(r->cos, r->sin, r->T, half, r->theta);
    CUDA_CHECK_LAUNCH("rope_tab");
}

void kcuda_attention_forward(void *a) {
    AttArgs *x = (AttArgs *)a;
    size_t rows = x->B * x->H * x->T;
    if (!rows) return;
    attention_fwd<<<grid_rows(rows, "attention"), kThreads, attn_shared_bytes(x->T, "attention"),
                    cuda_current_stream()>>>(x->out, x->probs, x->q, x->k, x->v, x->T, x->H, x->KV, x->hd);
    CUDA_CHECK_LAUNCH("attention_fwd");
}

size_t kcuda_attention_scratch_floats(size_t B, size_t T, size_t H) {
    size_t n = B * T * H; /* D_i = sum_j P_ij dP_ij per query row */
    return n ? n : 1;
}

void kcuda_attention_backward(void *a) {
    AttBwdArgs *x = (AttBwdArgs *)a;
    size_t rows = x->B * x->H * x->T;
    if (!rows) return;
    if (x->hd > 4 * (size_t)kThreads) fatal("attention_bwd: head dim %zu is more than %d", x->hd, 4 * kThreads);
    attention_bwd_dq<<<grid_rows(rows, "attention_bwd"), kThreads, attn_shared_bytes(x->T, "attention_bwd"),
                       cuda_current_stream()>>>(x->dq, x->scratch, x->dout, x->k, x->v, x->probs, x->T, x->H, x->KV,
                                                x->hd);
    CUDA_CHECK_LAUNCH("attention_bwd_dq");
    attention_bwd_dkv<<<grid_rows(x->B * x->KV * x->T, "attention_bwd"), kThreads, 0, cuda_current_stream()>>>(
        x->dk, x->dv, x->dout, x->q, x->v, x->probs, x->scratch, x->T, x->H, x->KV, x->hd);
    CUDA_CHECK_LAUNCH("attention_bwd_dkv");
}

void kcuda_swiglu_forward(void *a) {
    SwiArgs *x = (SwiArgs *)a;
    if (!x->n) return;
    swiglu_fwd<<<blocks_for(x->n), kThreads, 0, cuda_current_stream()>>>(x->out, x->a, x->b, x->n);
    CUDA_CHECK_LAUNCH("swiglu_fwd");
}

void kcuda_swiglu_backward(void *a) {
    SwiBwdArgs *x = (SwiBwdArgs *)a;
    if (!x->n) return;
    swiglu_bwd<<<blocks_for(x->n), kThreads, 0, cuda_current_stream()>>>(x->da, x->db, x->dout, x->a, x->b, x->n);
    CUDA_CHECK_LAUNCH("swiglu_bwd");
}

void kcuda_add(void *a) {
    AddArgs *x = (AddArgs *)a;
    if (!x->n) return;
    add_k<<<blocks_for(x->n), kThreads, 0, cuda_current_stream()>>>(x->out, x->a, x->b, x->n);
    CUDA_CHECK_LAUNCH("add");
}

void kcuda_crossentropy_forward(void *a) {
    CeArgs *x = (CeArgs *)a;
    if (!x->N) fatal("cross_entropy: no rows");
    double *rows = (double *)cuda_stream_workspace(x->N * sizeof(double));
    ce_rows<<<grid_rows(x->N, "cross_entropy"), kThreads, 0, cuda_current_stream()>>>(rows, x->logits, x->tgt, x->V);
    CUDA_CHECK_LAUNCH("ce_rows");
    ce_mean<<<1, 1, 0, cuda_current_stream()>>>(x->loss, rows, x->N);
    CUDA_CHECK_LAUNCH("ce_mean");
}

void kcuda_crossentropy_backward(void *a) {
    CeArgs *x = (CeArgs *)a;
    if (!x->N) return;
    ce_bwd<<<grid_rows(x->N, "cross_entropy_bwd"), kThreads, 0, cuda_current_stream()>>>(
        x->dlogits, x->logits, x->tgt, x->V, 1.0f / (float)x->N);
    CUDA_CHECK_LAUNCH("ce_bwd");
}

void kcuda_sumsq_accumulate(void *a) {
    SumsqArgs *x = (SumsqArgs *)a;
    double *partial = (double *)cuda_stream_workspace(kSumsqBlocks * sizeof(double));
    sumsq_partial<<<kSumsqBlocks, kThreads, 0, cuda_current_stream()>>>(partial, x->x, x->n);
    CUDA_CHECK_LAUNCH("sumsq_partial");
    sumsq_finish<<<1, 1, 0, cuda_current_stream()>>>(x->acc, partial, kSumsqBlocks);
    CUDA_CHECK_LAUNCH("sumsq_finish");
}

void kcuda_adamw(void *a) {
    AdamArgs *x = (AdamArgs *)a;
    if (!x->n) return;
    AdamWScalars k = adamw_scalars(&x->c, x->lr, x->t);
    adamw_k<<<blocks_for(x->n), kThreads, 0, cuda_current_stream()>>>(x->param, x->grad, x->m, x->v, x->n, k,
                                                                       x->c.max_norm, x->total_sumsq);
    CUDA_CHECK_LAUNCH("adamw");
}

} // extern "C"
