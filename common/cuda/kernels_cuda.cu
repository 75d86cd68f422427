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
 * Layouts (row-major): x [N, D]; q, out, dout [B, T, H, hd]; k, v [B, T, KV, hd];
 * lse and the attention backward's D [B, H, T]; logits [N, V]. Sizes are
 * size_t, and so is every element index that can pass 2^31 (activations,
 * logits); only indices bounded by a tile or a head dim are int.
 *
 * Dtypes (kernels.h, the `bf16` field): the [a] tensors are float32, or
 * bfloat16 words under bf16. Every kernel that touches one is a template on
 * its storage type S (float or Bf16): it reads an element widened to float
 * (exact), does all its math in float32 as the fp32 kernel does, and rounds
 * what it writes once to nearest even; an accumulating (+=) output is read,
 * added to in float32 and rounded once, by the thread that owns it. These are
 * the CPU kernels' semantics (cpu/kernels_cpu.c), so the bf16 results differ
 * from the CPU's only where the float32 results did, by at most one bf16 step.
 * The matmuls run on cuBLAS with bf16 operands and float32 compute: the
 * products are exact, the sums float32, a bf16 output rounded once. */
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

/* --- storage types (kernels.h: the [a] tensors) --------------------------
 * widen: an element as float32 (exact for both). narrow<S>: a float32 result
 * as S, rounded once (bf16_from_f32: nearest, ties to even). as<S>: an
 * argument struct's void pointer as S's. */
__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ float widen(Bf16 x) { return bf16_to_f32(x); }
template <typename S> __device__ S narrow(float x);
template <> __device__ __forceinline__ float narrow<float>(float x) { return x; }
template <> __device__ __forceinline__ Bf16 narrow<Bf16>(float x) { return bf16_from_f32(x); }
template <typename S> S *as(void *p) { return static_cast<S *>(p); }
template <typename S> const S *as(const void *p) { return static_cast<const S *>(p); }

/* Calls f with a value of the [a] storage type the run uses: f(Bf16) under
 * bf16, f(float) otherwise. A generic lambda takes it as `auto s` and names
 * the type decltype(s): the one place a kcuda_ picks its instantiation. */
template <typename F> void with_storage(int bf16, F f) {
    if (bf16) f(Bf16{});
    else f(0.0f);
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

/* out[n, d] = wte[tok[n], d]: a copy of S words (bf16 rows stay bitwise). The
 * data loader checks ids < V; a negative id (the CPU op stops on it) gives a
 * NaN row rather than a wild read. */
template <typename S> __global__ void embedding_fwd(S *out, const int32_t *tok, const S *wte, size_t N, size_t D) {
    GRID_STRIDE(e, N * D) {
        int32_t t = tok[e / D];
        out[e] = t < 0 ? narrow<S>(NAN) : wte[(size_t)t * D + e % D];
    }
}

/* dwte[tok[n], d] += dout[n, d], n = 0..N-1 IN ORDER, as the CPU op (dwte
 * float32 under bf16 too, dout widened: the same adds). With P
 * a power of two, thread (p, d) owns column d of the vocab rows v with
 * v % P == p: it walks every token in order and adds those of its class. So
 * no two threads write one element, each element adds its rows in token order
 * (the CPU's bits), and P only spreads the work. A warp reads one tok[n]. */
template <typename S>
__global__ void embedding_bwd(float *dwte, const S *dout, const int32_t *tok, size_t N, size_t D, unsigned P) {
    GRID_STRIDE(e, D * P) {
        size_t d = e % D;
        unsigned p = (unsigned)(e / D);
        for (size_t n = 0; n < N; n++) {
            int32_t t = tok[n];
            if (t >= 0 && ((unsigned)t & (P - 1)) == p) dwte[(size_t)t * D + d] += widen(dout[n * D + d]);
        }
    }
}

/* ------------------------------------------------------------------- rmsnorm */

/* one block per row: r = 1 / sqrt(mean(x^2) + eps) (sum in double, as the
 * CPU); out = (x r) w; rstd[row] = r */
template <typename S>
__global__ void rmsnorm_fwd(S *out, float *rstd, const S *inp, const S *w, size_t D, float eps) {
    __shared__ double sh[kThreads];
    const S *x = inp + (size_t)blockIdx.x * D;
    S *o = out + (size_t)blockIdx.x * D;
    double ss = 0.0;
    for (size_t i = threadIdx.x; i < D; i += blockDim.x) ss += (double)widen(x[i]) * (double)widen(x[i]);
    ss = block_sum(ss, sh);
    float r = 1.0f / sqrtf((float)(ss / (double)D) + eps);
    for (size_t i = threadIdx.x; i < D; i += blockDim.x) o[i] = narrow<S>((widen(x[i]) * r) * widen(w[i]));
    if (threadIdx.x == 0) rstd[blockIdx.x] = r;
}

/* one block per row: dx += r (g w) - x r^3/D sum_i(g_i w_i x_i)  (the sum in double) */
template <typename S>
__global__ void rmsnorm_bwd_dx(S *dinp, const S *dout, const S *inp, const S *w, const float *rstd, size_t D) {
    __shared__ double sh[kThreads];
    size_t row = blockIdx.x;
    const S *x = inp + row * D, *g = dout + row * D;
    S *dx = dinp + row * D;
    float r = rstd[row];
    double dot = 0.0;
    for (size_t i = threadIdx.x; i < D; i += blockDim.x)
        dot += (double)(widen(g[i]) * widen(w[i])) * (double)widen(x[i]);
    dot = block_sum(dot, sh);
    float c = (float)(dot * (double)r * (double)r * (double)r / (double)D);
    for (size_t i = threadIdx.x; i < D; i += blockDim.x)
        dx[i] = narrow<S>(widen(dx[i]) + (r * (widen(g[i]) * widen(w[i])) - c * widen(x[i])));
}

/* dw[i] += sum_n g[n,i] (x[n,i] r[n]), a reduction over the N rows. Block =
 * 32 columns x 32 row lanes: lane y sums rows y, y+32, y+64, ... in order
 * (coalesced: a warp reads 32 adjacent columns of one row), then the 32 lane
 * sums of a column meet in a fixed tree. */
template <typename S>
__global__ void __launch_bounds__(kTile * kTile)
    rmsnorm_bwd_dw(float *dw, const S *dout, const S *inp, const float *rstd, size_t N, size_t D) {
    __shared__ float sh[kTile][kTile + 1];
    size_t i = (size_t)blockIdx.x * kTile + threadIdx.x;
    float acc = 0.0f;
    if (i < D)
        for (size_t n = threadIdx.y; n < N; n += kTile)
            acc += widen(dout[n * D + i]) * (widen(inp[n * D + i]) * rstd[n]);
    sh[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    for (unsigned s = kTile / 2; s > 0; s >>= 1) {
        if (threadIdx.y < s) sh[threadIdx.y][threadIdx.x] += sh[threadIdx.y + s][threadIdx.x];
        __syncthreads();
    }
    if (threadIdx.y == 0 && i < D) dw[i] += sh[0][threadIdx.x];
}

/* ---------------------------------------------------------------------- rope */

struct RopeFreqs { float f[kMaxHalf]; }; /* freq_i = rope_freq_scaled(i), formed on the host as the CPU forms it */

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
 * rotated by +angle[t, i] (forward) or -angle (backward: the transpose), in
 * float32, each rounded once back into x */
template <typename S>
__global__ void rope_rot(S *x, const float *cos_tab, const float *sin_tab, size_t B, size_t T, size_t nh, size_t half,
                         float sign) {
    GRID_STRIDE(e, B * T * nh * half) {
        size_t i = e % half, t = (e / (half * nh)) % T;
        float x0 = widen(x[2 * e]), x1 = widen(x[2 * e + 1]);
        rope_pair(&x0, &x1, cos_tab[t * half + i], sign * sin_tab[t * half + i]);
        x[2 * e] = narrow<S>(x0);
        x[2 * e + 1] = narrow<S>(x1);
    }
}

/* ----------------------------------------------------------------- attention */

/* Causal flash attention (ops.h; FlashAttention-2's algorithm) in fp32 on the
 * CUDA cores, on q, k, v, out, dout, dq, dk, dv of storage type S (widened
 * into the float tiles and registers as they are loaded; out rounded once;
 * dq, dk, dv read, added to and rounded once per element at the end of the
 * kernel that owns it); lse and D float32. For batch b, query head h, its kv
 * head g = h / (H/KV), query row i and key row j <= i (scale = 1/sqrt(hd)):
 *   s_ij  = scale (q_i . k_j)
 *   lse_i = log sum_{j<=i} exp(s_ij)            (saved: lse[b, h, i])
 *   p_ij  = exp(s_ij - lse_i),   out_i = sum_{j<=i} p_ij v_j
 * and the backward, with g_i = dout_i:
 *   D_i   = g_i . out_i                          (= sum_j p_ij (g_i . v_j))
 *   dp_ij = g_i . v_j,   ds_ij = p_ij (dp_ij - D_i)
 *   dq_i += scale sum_j ds_ij k_j,  dk_j += scale sum_i ds_ij q_i,  dv_j += sum_i p_ij g_i
 *
 * The three tile kernels share one geometry. A block OWNS kAttRows = 32 rows
 * of one head (query rows in the forward and the dq kernel, key rows in the
 * dk/dv kernel): kAttWarps = 8 warps of kAttRowsPerWarp = 4 rows. It STREAMS
 * tiles of 32 rows of the other side through shared memory and never holds
 * a [T, T] matrix:
 *   - an owned row lives in registers, spread over its warp by dimension:
 *     lane l holds dims l, l+32, l+64, l+96 (so hd <= kAttMaxHd = 128), and
 *     so do the row's accumulators;
 *   - a streamed tile is [32][hd + 1] floats of shared memory: lane j works
 *     with row j (the +1 puts the 32 rows' same dim in 32 different banks);
 *   - so lane j of a warp makes the scores of the warp's 4 owned rows with
 *     streamed row j (att_dots: the owned dims come one at a time from their
 *     lane by __shfl_sync), and a warp makes a 4 x 32 tile of the scores,
 *     the block a 32 x 32 one;
 *   - the owned accumulators take sum_j w_j x_j over the streamed rows x_j,
 *     with lane j's weight w_j shuffled to every lane (att_accumulate).
 * Only the tiles at or left of the diagonal are visited; inside the diagonal
 * tile the causal mask (att_keep) zeroes p. Streamed rows past T are zeros;
 * owned rows past T compute on zeros and write nothing.
 *
 * Shared memory: two streamed tiles, 2 x 32 x (hd + 1) floats (33,024 bytes
 * at hd = 128), plus 64 floats of lse and D in the dk/dv kernel: within the
 * default 48 KiB for every hd <= 128 (attn_shared_bytes).
 *
 * Determinism: every output element has one owner thread, which adds its
 * terms in a fixed order (tiles in order, keys or queries in order inside a
 * tile, heads of a group in order); the warp reductions are fixed trees. */
constexpr int kAttRows = kWarp;                       /* rows a block owns = rows of a streamed tile */
constexpr int kAttRowsPerWarp = 4;                    /* owned rows per warp */
constexpr int kAttWarps = kAttRows / kAttRowsPerWarp; /* 8 */
constexpr int kAttThreads = kAttWarps * kWarp;        /* 256 */
constexpr int kAttChunks = 4;                         /* dims per lane of an owned row */
constexpr int kAttMaxHd = kAttChunks * kWarp;         /* 128 */

/* the causal mask: query i sees key j iff j <= i and key j exists (j < T).
 * An owned query row past T (never written) so still sees key 0 and stays
 * finite; a streamed query row past T is never read (att_accumulate's n). */
__device__ bool att_keep(size_t i, size_t j, size_t T) { return j <= i && j < T; }

/* tile[r][d] = x[t0 + r, d] widened, for r < 32, d < hd (tile rows hd + 1
 * floats apart); 0 for t0 + r >= T. x is one head of q, k, v or dout: row t
 * at x + t * stride. All threads of the block take part; coalesced along d. */
template <typename S>
__device__ void att_load_tile(float *tile, const S *x, size_t stride, size_t t0, size_t T, int hd) {
    for (int e = threadIdx.x; e < kAttRows * hd; e += blockDim.x) {
        int r = e / hd, d = e % hd;
        size_t t = t0 + (size_t)r;
        tile[r * (hd + 1) + d] = t < T ? widen(x[t * stride + (size_t)d]) : 0.0f;
    }
}

/* An owned row into registers, widened: row[c] = x[t, c*32 + lane] (0 past
 * hd, and the whole row 0 for t >= T). */
template <typename S>
__device__ void att_load_row(float row[kAttChunks], const S *x, size_t stride, size_t t, size_t T, int hd, int lane) {
#pragma unroll
    for (int c = 0; c < kAttChunks; c++) {
        int d = c * kWarp + lane;
        row[c] = t < T && d < hd ? widen(x[t * stride + (size_t)d]) : 0.0f;
    }
}

/* dots[r] = sum_{d < hd} own[r][d] x[d] for the warp's 4 owned rows r, with x
 * this lane's streamed row (in shared memory). Owned dim d = c*32 + src is
 * register own[r][c] of lane src: the whole warp walks d in order, so every
 * lane receives it in the same shuffle. */
__device__ void att_dots(float dots[kAttRowsPerWarp], const float own[kAttRowsPerWarp][kAttChunks], const float *x,
                         int hd) {
#pragma unroll
    for (int r = 0; r < kAttRowsPerWarp; r++) dots[r] = 0.0f;
#pragma unroll
    for (int c = 0; c < kAttChunks; c++) {
        int n = hd - c * kWarp < kWarp ? hd - c * kWarp : kWarp; /* dims of chunk c (<= 0: none) */
        for (int src = 0; src < n; src++) {
            float xd = x[c * kWarp + src];
#pragma unroll
            for (int r = 0; r < kAttRowsPerWarp; r++) dots[r] += __shfl_sync(0xffffffffu, own[r][c], src) * xd;
        }
    }
}

/* acc[r][d] += sum_{j < n} w_j[r] tile[j][d] for the warp's 4 owned rows r
 * (this lane's dims d = c*32 + lane), w_j = lane j's w: j in order. */
__device__ void att_accumulate(float acc[kAttRowsPerWarp][kAttChunks], const float w[kAttRowsPerWarp],
                               const float *tile, int n, int hd, int lane) {
    for (int j = 0; j < n; j++) {
        float wj[kAttRowsPerWarp];
#pragma unroll
        for (int r = 0; r < kAttRowsPerWarp; r++) wj[r] = __shfl_sync(0xffffffffu, w[r], j);
#pragma unroll
        for (int c = 0; c < kAttChunks; c++) {
            int d = c * kWarp + lane;
            if (c * kWarp >= hd) break; /* the same for the whole warp */
            float x = d < hd ? tile[j * (hd + 1) + d] : 0.0f;
#pragma unroll
            for (int r = 0; r < kAttRowsPerWarp; r++) acc[r][c] += wj[r] * x;
        }
    }
}

/* Forward. Block (b, h, query tile qt) over B*H*ntiles, its warp w owning
 * query rows i = qt*32 + 4w + r. For each key tile kt = 0..qt (keys
 * j = kt*32 + lane), the online softmax of each owned row:
 *   m' = max(m, max_j s_ij),   corr = exp(m - m')   (0 on the first tile: m = -inf)
 *   p_ij = exp(s_ij - m')      (0 where masked: s = -inf)
 *   l' = l corr + sum_j p_ij,  acc' = acc corr + sum_j p_ij v_j
 * then out_i = acc / l and lse_i = m + log(l). m is finite from the first
 * tile on: att_keep keeps key 0 for every row (rows past T included). */
template <typename S>
__global__ void __launch_bounds__(kAttThreads)
    attention_fwd(S *out, float *lse, const S *q, const S *k, const S *v, size_t T, size_t H, size_t KV, int hd) {
    extern __shared__ float att_sh[];
    float *ks = att_sh;                        /* [32][hd + 1] keys kt*32 .. of kv head g */
    float *vs = att_sh + kAttRows * (hd + 1); /* [32][hd + 1] their values */
    size_t ntiles = (T + kAttRows - 1) / kAttRows;
    size_t qt = blockIdx.x % ntiles, h = (blockIdx.x / ntiles) % H, b = blockIdx.x / (ntiles * H);
    size_t g = h / (H / KV);
    int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
    size_t qs = H * (size_t)hd, kvs = KV * (size_t)hd; /* row strides of q/out and of k/v */
    const S *qh = q + (b * T * H + h) * hd;   /* q[b, 0, h, :] */
    const S *kg = k + (b * T * KV + g) * hd;  /* k[b, 0, g, :] */
    const S *vg = v + (b * T * KV + g) * hd;  /* v[b, 0, g, :] */
    size_t i0 = qt * kAttRows + (size_t)warp * kAttRowsPerWarp; /* this warp's first query row */
    float scale = 1.0f / sqrtf((float)hd);

    float qr[kAttRowsPerWarp][kAttChunks];  /* q_i, this lane's dims */
    float acc[kAttRowsPerWarp][kAttChunks]; /* sum_j exp(s_ij - m_i) v_j, this lane's dims */
    float m[kAttRowsPerWarp], l[kAttRowsPerWarp]; /* running max and sum of exp(s - m) */
#pragma unroll
    for (int r = 0; r < kAttRowsPerWarp; r++) {
        att_load_row(qr[r], qh, qs, i0 + r, T, hd, lane);
#pragma unroll
        for (int c = 0; c < kAttChunks; c++) acc[r][c] = 0.0f;
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    for (size_t kt = 0; kt <= qt; kt++) { /* tiles right of the diagonal: all masked, skipped */
        size_t j0 = kt * kAttRows, j = j0 + (size_t)lane;
        __syncthreads(); /* every warp is done with the previous tile */
        att_load_tile(ks, kg, kvs, j0, T, hd);
        att_load_tile(vs, vg, kvs, j0, T, hd);
        __syncthreads();
        float s[kAttRowsPerWarp], p[kAttRowsPerWarp];
        att_dots(s, qr, ks + lane * (hd + 1), hd); /* q_i . k_j */
#pragma unroll
        for (int r = 0; r < kAttRowsPerWarp; r++) {
            float sij = att_keep(i0 + r, j, T) ? s[r] * scale : -INFINITY;
            float mnew = fmaxf(m[r], warp_max(sij));
            float corr = expf(m[r] - mnew);
            p[r] = expf(sij - mnew);
            l[r] = l[r] * corr + warp_sum(p[r]);
            m[r] = mnew;
#pragma unroll
            for (int c = 0; c < kAttChunks; c++) acc[r][c] *= corr;
        }
        int nk = T - j0 < (size_t)kAttRows ? (int)(T - j0) : kAttRows; /* keys of this tile below T */
        att_accumulate(acc, p, vs, nk, hd, lane);                       /* += p_ij v_j */
    }
#pragma unroll
    for (int r = 0; r < kAttRowsPerWarp; r++) {
        size_t i = i0 + r;
        if (i >= T) continue;
        S *oi = out + (b * T + i) * qs + h * hd; /* out[b, i, h, :] */
#pragma unroll
        for (int c = 0; c < kAttChunks; c++) {
            int d = c * kWarp + lane;
            if (d < hd) oi[d] = narrow<S>(acc[r][c] / l[r]);
        }
        if (lane == 0) lse[(b * H + h) * T + i] = m[r] + logf(l[r]);
    }
}

/* Backward, step 1: D[b, h, i] = dout_i . out_i (D is [B, H, T], the
 * scratch), one warp per row (b, h, i): lanes stride the dims, a fixed tree. */
template <typename S>
__global__ void attention_bwd_rowdot(float *D, const S *dout, const S *out, size_t B, size_t T, size_t H, int hd) {
    size_t row = (size_t)blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp; /* (b*H + h)*T + i */
    int lane = threadIdx.x % kWarp;
    if (row >= B * H * T) return; /* the whole warp */
    size_t i = row % T, h = (row / T) % H, b = row / (T * H);
    size_t off = ((b * T + i) * H + h) * hd; /* [b, i, h, :] of dout and out */
    float acc = 0.0f;
    for (int d = lane; d < hd; d += kWarp) acc += widen(dout[off + d]) * widen(out[off + d]);
    acc = warp_sum(acc);
    if (lane == 0) D[row] = acc;
}

/* Backward, step 2: dq. Block (b, h, query tile qt) as the forward, owning
 * q_i, g_i = dout_i and the dq_i accumulator of its 32 query rows; for each
 * key tile kt = 0..qt (keys j = kt*32 + lane), per owned row:
 *   p_ij = exp(scale q_i.k_j - lse_i),  ds_ij = p_ij (g_i.v_j - D_i)
 *   acc_i += sum_j ds_ij k_j;   at the end dq_i += scale acc_i */
template <typename S>
__global__ void __launch_bounds__(kAttThreads)
    attention_bwd_dq(S *dq, const S *dout, const S *q, const S *k, const S *v, const float *lse, const float *D,
                     size_t T, size_t H, size_t KV, int hd) {
    extern __shared__ float att_sh[];
    float *ks = att_sh;                        /* [32][hd + 1] keys kt*32 .. of kv head g */
    float *vs = att_sh + kAttRows * (hd + 1); /* [32][hd + 1] their values */
    size_t ntiles = (T + kAttRows - 1) / kAttRows;
    size_t qt = blockIdx.x % ntiles, h = (blockIdx.x / ntiles) % H, b = blockIdx.x / (ntiles * H);
    size_t g = h / (H / KV);
    int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
    size_t qs = H * (size_t)hd, kvs = KV * (size_t)hd;
    const S *qh = q + (b * T * H + h) * hd;     /* q[b, 0, h, :] */
    const S *gh = dout + (b * T * H + h) * hd;  /* dout[b, 0, h, :] */
    const S *kg = k + (b * T * KV + g) * hd;    /* k[b, 0, g, :] */
    const S *vg = v + (b * T * KV + g) * hd;    /* v[b, 0, g, :] */
    const float *lse_h = lse + (b * H + h) * T, *D_h = D + (b * H + h) * T; /* [T] of head (b, h) */
    size_t i0 = qt * kAttRows + (size_t)warp * kAttRowsPerWarp;
    float scale = 1.0f / sqrtf((float)hd);

    float qr[kAttRowsPerWarp][kAttChunks], gr[kAttRowsPerWarp][kAttChunks]; /* q_i, g_i: this lane's dims */
    float acc[kAttRowsPerWarp][kAttChunks];                                  /* sum_j ds_ij k_j */
    float lse_i[kAttRowsPerWarp], D_i[kAttRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kAttRowsPerWarp; r++) {
        size_t i = i0 + r;
        att_load_row(qr[r], qh, qs, i, T, hd, lane);
        att_load_row(gr[r], gh, qs, i, T, hd, lane);
#pragma unroll
        for (int c = 0; c < kAttChunks; c++) acc[r][c] = 0.0f;
        lse_i[r] = i < T ? lse_h[i] : 0.0f;
        D_i[r] = i < T ? D_h[i] : 0.0f;
    }
    for (size_t kt = 0; kt <= qt; kt++) {
        size_t j0 = kt * kAttRows, j = j0 + (size_t)lane;
        __syncthreads();
        att_load_tile(ks, kg, kvs, j0, T, hd);
        att_load_tile(vs, vg, kvs, j0, T, hd);
        __syncthreads();
        float s[kAttRowsPerWarp], dp[kAttRowsPerWarp], ds[kAttRowsPerWarp];
        att_dots(s, qr, ks + lane * (hd + 1), hd);  /* q_i . k_j */
        att_dots(dp, gr, vs + lane * (hd + 1), hd); /* g_i . v_j */
#pragma unroll
        for (int r = 0; r < kAttRowsPerWarp; r++) {
            float p = att_keep(i0 + r, j, T) ? expf(s[r] * scale - lse_i[r]) : 0.0f;
            ds[r] = p * (dp[r] - D_i[r]);
        }
        int nk = T - j0 < (size_t)kAttRows ? (int)(T - j0) : kAttRows;
        att_accumulate(acc, ds, ks, nk, hd, lane); /* += ds_ij k_j */
    }
#pragma unroll
    for (int r = 0; r < kAttRowsPerWarp; r++) {
        size_t i = i0 + r;
        if (i >= T) continue;
        S *dqi = dq + (b * T + i) * qs + h * hd; /* dq[b, i, h, :] */
#pragma unroll
        for (int c = 0; c < kAttChunks; c++) {
            int d = c * kWarp + lane;
            if (d < hd) dqi[d] = narrow<S>(widen(dqi[d]) + scale * acc[r][c]);
        }
    }
}

/* Backward, step 3: dk and dv. Block (b, kv head g, key tile kt) over
 * B*KV*ntiles, its warp w owning key rows j = kt*32 + 4w + r: k_j, v_j and
 * the dk_j, dv_j accumulators. For each query head h of group g in order,
 * and each query tile qt = kt..ntiles-1 (the tiles at or below the
 * diagonal; queries i = qt*32 + lane), per owned row:
 *   p_ij = exp(scale q_i.k_j - lse_i),  ds_ij = p_ij (g_i.v_j - D_i)
 *   dv_j += sum_i p_ij g_i;   acc_j += sum_i ds_ij q_i;   at the end dk_j += scale acc_j */
template <typename S>
__global__ void __launch_bounds__(kAttThreads)
    attention_bwd_dkv(S *dk, S *dv, const S *dout, const S *q, const S *k, const S *v, const float *lse,
                      const float *D, size_t T, size_t H, size_t KV, int hd) {
    extern __shared__ float att_sh[];
    float *qs_t = att_sh;                        /* [32][hd + 1] queries qt*32 .. of head h */
    float *gs_t = att_sh + kAttRows * (hd + 1); /* [32][hd + 1] their dout rows */
    float *lse_t = gs_t + kAttRows * (hd + 1);   /* [32] their lse */
    float *D_t = lse_t + kAttRows;               /* [32] their D */
    size_t ntiles = (T + kAttRows - 1) / kAttRows;
    size_t kt = blockIdx.x % ntiles, g = (blockIdx.x / ntiles) % KV, b = blockIdx.x / (ntiles * KV);
    size_t per = H / KV; /* query heads per kv head */
    int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
    size_t qs = H * (size_t)hd, kvs = KV * (size_t)hd;
    const S *kg = k + (b * T * KV + g) * hd; /* k[b, 0, g, :] */
    const S *vg = v + (b * T * KV + g) * hd; /* v[b, 0, g, :] */
    size_t j0 = kt * kAttRows + (size_t)warp * kAttRowsPerWarp; /* this warp's first key row */
    float scale = 1.0f / sqrtf((float)hd);

    float kr[kAttRowsPerWarp][kAttChunks], vr[kAttRowsPerWarp][kAttChunks]; /* k_j, v_j: this lane's dims */
    float dka[kAttRowsPerWarp][kAttChunks], dva[kAttRowsPerWarp][kAttChunks]; /* sum_i ds_ij q_i, sum_i p_ij g_i */
#pragma unroll
    for (int r = 0; r < kAttRowsPerWarp; r++) {
        att_load_row(kr[r], kg, kvs, j0 + r, T, hd, lane);
        att_load_row(vr[r], vg, kvs, j0 + r, T, hd, lane);
#pragma unroll
        for (int c = 0; c < kAttChunks; c++) dka[r][c] = dva[r][c] = 0.0f;
    }
    for (size_t h = g * per; h < (g + 1) * per; h++) {
        const S *qh = q + (b * T * H + h) * hd;    /* q[b, 0, h, :] */
        const S *gh = dout + (b * T * H + h) * hd; /* dout[b, 0, h, :] */
        const float *lse_h = lse + (b * H + h) * T, *D_h = D + (b * H + h) * T;
        for (size_t qt = kt; qt < ntiles; qt++) { /* tiles above the diagonal: all masked, skipped */
            size_t q0 = qt * kAttRows, i = q0 + (size_t)lane;
            __syncthreads();
            att_load_tile(qs_t, qh, qs, q0, T, hd);
            att_load_tile(gs_t, gh, qs, q0, T, hd);
            if (threadIdx.x < kAttRows) {
                size_t t = q0 + threadIdx.x;
                lse_t[threadIdx.x] = t < T ? lse_h[t] : 0.0f;
                D_t[threadIdx.x] = t < T ? D_h[t] : 0.0f;
            }
            __syncthreads();
            float s[kAttRowsPerWarp], dp[kAttRowsPerWarp], p[kAttRowsPerWarp], ds[kAttRowsPerWarp];
            att_dots(s, kr, qs_t + lane * (hd + 1), hd);  /* k_j . q_i */
            att_dots(dp, vr, gs_t + lane * (hd + 1), hd); /* v_j . g_i */
#pragma unroll
            for (int r = 0; r < kAttRowsPerWarp; r++) {
                p[r] = att_keep(i, j0 + r, T) ? expf(s[r] * scale - lse_t[lane]) : 0.0f;
                ds[r] = p[r] * (dp[r] - D_t[lane]);
            }
            int nq = T - q0 < (size_t)kAttRows ? (int)(T - q0) : kAttRows; /* queries of this tile below T */
            att_accumulate(dva, p, gs_t, nq, hd, lane);  /* += p_ij g_i */
            att_accumulate(dka, ds, qs_t, nq, hd, lane); /* += ds_ij q_i */
        }
    }
#pragma unroll
    for (int r = 0; r < kAttRowsPerWarp; r++) {
        size_t j = j0 + r;
        if (j >= T) continue;
        size_t off = (b * T + j) * kvs + g * hd; /* [b, j, g, :] of dk and dv */
#pragma unroll
        for (int c = 0; c < kAttChunks; c++) {
            int d = c * kWarp + lane;
            if (d < hd) {
                dk[off + d] = narrow<S>(widen(dk[off + d]) + scale * dka[r][c]);
                dv[off + d] = narrow<S>(widen(dv[off + d]) + dva[r][c]);
            }
        }
    }
}

/* --------------------------------------------------------------- elementwise */

/* out = silu(a) b, silu(a) = a / (1 + exp(-a)) */
template <typename S> __global__ void swiglu_fwd(S *out, const S *a, const S *b, size_t n) {
    GRID_STRIDE(i, n) { out[i] = narrow<S>(swiglu_elem(widen(a[i]), widen(b[i]))); }
}

/* da += g b sig (1 + a (1 - sig)),  db += g silu(a)  (each read, added to in float32, rounded once) */
template <typename S> __global__ void swiglu_bwd(S *da, S *db, const S *dout, const S *a, const S *b, size_t n) {
    GRID_STRIDE(i, n) {
        float dai = widen(da[i]), dbi = widen(db[i]);
        swiglu_backward_elem(widen(dout[i]), widen(a[i]), widen(b[i]), &dai, &dbi);
        da[i] = narrow<S>(dai);
        db[i] = narrow<S>(dbi);
    }
}

/* out = a + b (out may alias a or b: each thread reads its element before writing it) */
template <typename S> __global__ void add_k(S *out, const S *a, const S *b, size_t n) {
    GRID_STRIDE(i, n) { out[i] = narrow<S>(widen(a[i]) + widen(b[i])); }
}

/* bfloat16 casts: the conversions of ops_math.h, element by element */
__global__ void cast_to_bf16_k(uint16_t *out, const float *in, size_t n) {
    GRID_STRIDE(i, n) { out[i] = bf16_from_f32(in[i]); }
}
__global__ void cast_from_bf16_k(float *out, const uint16_t *in, size_t n) {
    GRID_STRIDE(i, n) { out[i] = bf16_to_f32(in[i]); }
}

/* the fused cast: blockIdx.y walks the casts, blockIdx.x and threadIdx.x the
 * elements of one (grid-stride); the casts never overlap (launch.c checked) */
__global__ void cast_batch_to_bf16_k(const CastCopy *list, size_t n) {
    for (size_t c = blockIdx.y; c < n; c += gridDim.y) {
        CastCopy k = list[c];
        for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < k.n; i += (size_t)gridDim.x * blockDim.x)
            k.dst[i] = bf16_from_f32(k.src[i]);
    }
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

/* C = op(A) op(B) (+ C if beta = 1), column-major, on this launch's stream,
 * A and B of type ab, C of type c (cudaDataType_t). float32 A, B: exact
 * fp32, or TF32 tensor cores when the run asked for them (--tf32). bf16 A,
 * B: tensor cores with float32 compute (CUBLAS_COMPUTE_32F; --tf32 has no
 * say): the products are exact, the sums float32, and a bf16 C (beta = 1
 * included) is read widened and rounded once; a float32 C (dw) stays float32. */
void gemm(cublasOperation_t ta, cublasOperation_t tb, size_t m, size_t n, size_t k, const void *A, size_t lda,
          const void *B, size_t ldb, cudaDataType_t ab, float beta, void *C, size_t ldc, cudaDataType_t c) {
    const float one = 1.0f;
    cublasComputeType_t ct =
        ab == CUDA_R_32F && cuda_tf32_enabled() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    CUBLAS_CHECK(cublasGemmEx(cuda_current_cublas(), ta, tb, blas_int(m, "matmul"), blas_int(n, "matmul"),
                              blas_int(k, "matmul"), &one, A, ab, blas_int(lda, "matmul"), B, ab,
                              blas_int(ldb, "matmul"), &beta, C, c, blas_int(ldc, "matmul"), ct,
                              CUBLAS_GEMM_DEFAULT));
}

/* The flash kernels' limits, one fatal line each: GQA needs H a multiple of
 * KV; an owned row is kAttChunks registers per lane, so hd <= 128 (every
 * flavour fits: tiny and debugmodel have 16, 1B, 8B and 70B 128). */
void attn_check(size_t H, size_t KV, size_t hd, const char *what) {
    if (KV == 0 || H % KV != 0) fatal("%s: n_heads %zu is not a multiple of n_kv_heads %zu", what, H, KV);
    if (hd > (size_t)kAttMaxHd)
        fatal("%s: head dim %zu is more than %d, the most the CUDA flash attention holds per row", what, hd,
              kAttMaxHd);
}

/* dynamic shared memory of a flash kernel: two streamed tiles [32][hd + 1]
 * and `extra` floats; at most 33,280 bytes (hd = 128), under the default
 * 48 KiB a block may use without opting in */
size_t attn_shared_bytes(size_t hd, size_t extra) {
    return (2 * (size_t)kAttRows * (hd + 1) + extra) * sizeof(float);
}

/* blocks of a flash kernel: one per (batch, head, tile of 32 rows) */
unsigned attn_blocks(size_t B, size_t heads, size_t T, const char *what) {
    return grid_rows(B * heads * ((T + kAttRows - 1) / kAttRows), what);
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
    with_storage(x->bf16, [&](auto s) {
        using S = decltype(s);
        embedding_fwd<<<blocks_for(x->N * x->D), kThreads, 0, cuda_current_stream()>>>(
            as<S>(x->out), x->tok, as<S>(x->w), x->N, x->D);
    });
    CUDA_CHECK_LAUNCH("embedding_fwd");
}

void kcuda_embedding_backward(void *a) { /* out = dwte (float32), w = dout [a] */
    EmbArgs *x = (EmbArgs *)a;
    if (!x->N || !x->D) return;
    unsigned P = 1; /* a power of two, for about 64k threads however wide the rows */
    while (P < 1024 && (size_t)P * x->D < 65536) P *= 2;
    with_storage(x->bf16, [&](auto s) {
        using S = decltype(s);
        embedding_bwd<<<blocks_for(x->D * P), kThreads, 0, cuda_current_stream()>>>(
            static_cast<float *>(x->out), as<S>(x->w), x->tok, x->N, x->D, P);
    });
    CUDA_CHECK_LAUNCH("embedding_bwd");
}

void kcuda_rmsnorm_forward(void *a) {
    NormArgs *x = (NormArgs *)a;
    if (!x->N) return;
    with_storage(x->bf16, [&](auto s) {
        using S = decltype(s);
        rmsnorm_fwd<<<grid_rows(x->N, "rmsnorm"), kThreads, 0, cuda_current_stream()>>>(
            as<S>(x->out), x->rstd, as<S>(x->in), as<S>(x->w), x->D, x->eps);
    });
    CUDA_CHECK_LAUNCH("rmsnorm_fwd");
}

void kcuda_rmsnorm_backward(void *a) {
    NormBwdArgs *x = (NormBwdArgs *)a;
    if (!x->N || !x->D) return;
    with_storage(x->bf16, [&](auto s) {
        using S = decltype(s);
        rmsnorm_bwd_dx<<<grid_rows(x->N, "rmsnorm_bwd"), kThreads, 0, cuda_current_stream()>>>(
            as<S>(x->dinp), as<S>(x->dout), as<S>(x->in), as<S>(x->w), x->rstd, x->D);
        CUDA_CHECK_LAUNCH("rmsnorm_bwd_dx");
        dim3 tile(kTile, kTile);
        rmsnorm_bwd_dw<<<grid_rows((x->D + kTile - 1) / kTile, "rmsnorm_bwd"), tile, 0, cuda_current_stream()>>>(
            x->dw, as<S>(x->dout), as<S>(x->in), x->rstd, x->N, x->D);
        CUDA_CHECK_LAUNCH("rmsnorm_bwd_dw");
    });
}

/* Row-major nn.Linear through column-major cuBLAS: a row-major [R, C] matrix
 * is the column-major [C, R] matrix (its transpose) with ld = C, so each
 * product is computed transposed:
 *   out^T [OC, N] = op_T(W: col-major [C, OC]) x in^T [C, N] */
void kcuda_matmul_forward(void *a) {
    MmArgs *x = (MmArgs *)a;
    if (!x->N || !x->OC) return;
    if (!x->C) { /* a sum of no terms; bf16 zero is the word 0 too */
        size_t elem = x->bf16 ? sizeof(Bf16) : sizeof(float);
        CUDA_CHECK(cudaMemsetAsync(x->out, 0, x->N * x->OC * elem, cuda_current_stream()));
        return;
    }
    cudaDataType_t t = x->bf16 ? CUDA_R_16BF : CUDA_R_32F; /* in, w, out */
    gemm(CUBLAS_OP_T, CUBLAS_OP_N, x->OC, x->N, x->C, x->w, x->C, x->in, x->C, t, 0.0f, x->out, x->OC, t);
}

/* dinp^T [C, N]  += W^T [C, OC] x dout^T [OC, N]     (W's col-major view as is)
 * dW^T   [C, OC] += in^T [C, N] x op_T(dout^T [OC, N])   (beta = 1 accumulates)
 * dout, in, w and dinp are [a] (bf16 under bf16); dw is float32 always. */
void kcuda_matmul_backward(void *a) {
    MmBwdArgs *x = (MmBwdArgs *)a;
    if (!x->N || !x->C || !x->OC) return;
    cudaDataType_t t = x->bf16 ? CUDA_R_16BF : CUDA_R_32F;
    if (x->dinp)
        gemm(CUBLAS_OP_N, CUBLAS_OP_N, x->C, x->N, x->OC, x->w, x->C, x->dout, x->OC, t, 1.0f, x->dinp, x->C, t);
    if (x->dw)
        gemm(CUBLAS_OP_N, CUBLAS_OP_T, x->C, x->OC, x->N, x->in, x->C, x->dout, x->OC, t, 1.0f, x->dw, x->C,
             CUDA_R_32F);
}

void kcuda_rope(void *a) {
    RopeArgs *r = (RopeArgs *)a;
    if (r->hd % 2 != 0) fatal("rope: head dim %zu is odd", r->hd);
    size_t half = r->hd / 2, n = r->B * r->T * r->nh * half;
    with_storage(r->bf16, [&](auto s) {
        using S = decltype(s);
        launch_per_element(rope_rot<S>, n, "rope_rot", as<S>(r->x), r->cos, r->sin, r->B, r->T, r->nh, half,
                           r->backward ? -1.0f : 1.0f);
    });
}

void kcuda_rope_tables(void *a) {
    RopeTabArgs *r = (RopeTabArgs *)a;
    if (r->hd % 2 != 0) fatal("rope_tables: head dim %zu is odd", r->hd);
    size_t half = r->hd / 2;
    if (half > (size_t)kMaxHalf) fatal("rope_tables: head dim %zu is more than %d", r->hd, 2 * kMaxHalf);
    if (!r->T || !half) return;
    RopeFreqs fr;
    /* host libm, as the CPU; Llama 3.1's scaling (r->scaling, ops.h) there too */
    for (size_t i = 0; i < half; i++) fr.f[i] = rope_freq_scaled(i, r->hd, r->theta, &r->scaling);
    rope_tab<<<blocks_for(r->T * half), kThreads, 0, cuda_current_stream()>>>(r->cos, r->sin, r->T, half, fr);
    CUDA_CHECK_LAUNCH("rope_tab");
}

void kcuda_attention_forward(void *a) {
    AttArgs *x = (AttArgs *)a;
    attn_check(x->H, x->KV, x->hd, "attention_forward");
    if (!x->B || !x->T || !x->H || !x->hd) return;
    with_storage(x->bf16, [&](auto s) {
        using S = decltype(s);
        attention_fwd<<<attn_blocks(x->B, x->H, x->T, "attention"), kAttThreads, attn_shared_bytes(x->hd, 0),
                        cuda_current_stream()>>>(as<S>(x->out), x->lse, as<S>(x->q), as<S>(x->k), as<S>(x->v), x->T,
                                                 x->H, x->KV, (int)x->hd);
    });
    CUDA_CHECK_LAUNCH("attention_fwd");
}

size_t kcuda_attention_scratch_floats(size_t B, size_t T, size_t H) {
    size_t n = B * H * T; /* D [B, H, T]: D_i = dout_i . out_i of every query row */
    return n ? n : 1;
}

/* D first (scratch), then dq and dk/dv, which both read it: stream order. */
void kcuda_attention_backward(void *a) {
    AttBwdArgs *x = (AttBwdArgs *)a;
    attn_check(x->H, x->KV, x->hd, "attention_backward");
    if (!x->B || !x->T || !x->H || !x->hd) return;
    int hd = (int)x->hd;
    size_t rows = x->B * x->H * x->T, rows_per_block = kThreads / kWarp;
    cudaStream_t st = cuda_current_stream();
    with_storage(x->bf16, [&](auto s) {
        using S = decltype(s);
        const S *dout = as<S>(x->dout), *q = as<S>(x->q), *k = as<S>(x->k), *v = as<S>(x->v);
        attention_bwd_rowdot<<<grid_rows((rows + rows_per_block - 1) / rows_per_block, "attention_bwd"), kThreads, 0,
                               st>>>(x->scratch, dout, as<S>(x->out), x->B, x->T, x->H, hd);
        CUDA_CHECK_LAUNCH("attention_bwd_rowdot");
        attention_bwd_dq<<<attn_blocks(x->B, x->H, x->T, "attention_bwd"), kAttThreads, attn_shared_bytes(x->hd, 0),
                           st>>>(as<S>(x->dq), dout, q, k, v, x->lse, x->scratch, x->T, x->H, x->KV, hd);
        CUDA_CHECK_LAUNCH("attention_bwd_dq");
        attention_bwd_dkv<<<attn_blocks(x->B, x->KV, x->T, "attention_bwd"), kAttThreads,
                            attn_shared_bytes(x->hd, 2 * kAttRows), st>>>(
            as<S>(x->dk), as<S>(x->dv), dout, q, k, v, x->lse, x->scratch, x->T, x->H, x->KV, hd);
        CUDA_CHECK_LAUNCH("attention_bwd_dkv");
    });
}

void kcuda_swiglu_forward(void *a) {
    SwiArgs *x = (SwiArgs *)a;
    with_storage(x->bf16, [&](auto s) {
        using S = decltype(s);
        launch_per_element(swiglu_fwd<S>, x->n, "swiglu_fwd", as<S>(x->out), as<S>(x->a), as<S>(x->b), x->n);
    });
}

void kcuda_swiglu_backward(void *a) {
    SwiBwdArgs *x = (SwiBwdArgs *)a;
    with_storage(x->bf16, [&](auto s) {
        using S = decltype(s);
        launch_per_element(swiglu_bwd<S>, x->n, "swiglu_bwd", as<S>(x->da), as<S>(x->db), as<S>(x->dout),
                           as<S>(x->a), as<S>(x->b), x->n);
    });
}

void kcuda_add(void *a) {
    AddArgs *x = (AddArgs *)a;
    with_storage(x->bf16, [&](auto s) {
        using S = decltype(s);
        launch_per_element(add_k<S>, x->n, "add", as<S>(x->out), as<S>(x->a), as<S>(x->b), x->n);
    });
}

void kcuda_cast_to_bf16(void *a) {
    CastArgs *x = (CastArgs *)a;
    launch_per_element(cast_to_bf16_k, x->n, "cast_to_bf16", x->bf16, x->f32, x->n);
}

/* The list (host memory, the caller's: dev_launch_list) goes to the device
 * first, as copy_kernels.cu's: a stream-ordered scratch allocation filled by
 * one host-to-device copy (staged: it has read the list when it returns),
 * read by ONE kernel, freed in stream order after it. */
void kcuda_cast_batch_to_bf16(void *a) {
    CastBatchArgs *x = (CastBatchArgs *)a;
    if (!x->n) return;
    cudaStream_t st = cuda_current_stream();
    size_t total = 0;
    for (size_t c = 0; c < x->n; c++) total += x->list[c].n;
    CastCopy *list = NULL;
    CUDA_CHECK(cudaMallocAsync((void **)&list, x->n * sizeof *list, st));
    CUDA_CHECK(cudaMemcpyAsync(list, x->list, x->n * sizeof *list, cudaMemcpyHostToDevice, st));
    /* enough blocks per cast for its mean length, at most 1024; casts at most 65535 at a time along y (the
     * grid's limit: the kernel's loop takes the rest) */
    size_t per_cast = (total / x->n + kThreads - 1) / kThreads;
    unsigned bx = (unsigned)(per_cast < 1 ? 1 : per_cast > 1024 ? 1024 : per_cast);
    unsigned by = (unsigned)(x->n < 65535 ? x->n : 65535);
    cast_batch_to_bf16_k<<<dim3(bx, by), kThreads, 0, st>>>(list, x->n);
    CUDA_CHECK_LAUNCH("cast_batch_to_bf16");
    CUDA_CHECK(cudaFreeAsync(list, st));
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
