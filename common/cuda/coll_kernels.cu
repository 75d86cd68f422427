/* coll_kernels.cu — the reduction behind the local CUDA collectives: ranks
 * sharing one GPU read each other's buffers directly. */
#include <stdint.h>

#include "cuda/cuda_check.h"
#include "device.h"
#include "runtime/bf16.h" /* bf16_from_f32 / bf16_to_f32: the CPU backend's conversions */

namespace {

struct RankPtrs {
    const void *p[WORLD_MAX_RANKS];
};

__device__ float load_elem(const float *p, size_t i) { return p[i]; }
__device__ float load_elem(const uint16_t *p, size_t i) { return bf16_to_f32(p[i]); }
__device__ void store_elem(float *p, size_t i, float v) { p[i] = v; }
__device__ void store_elem(uint16_t *p, size_t i, float v) { p[i] = bf16_from_f32(v); }

/* out[i] = in[0][off+i] + in[1][off+i] + ... + in[n-1][off+i], added in float32
 * in rank order (the CPU backend's order, so the sums are bitwise the same),
 * then divided by n for an average, and stored as T (bfloat16: rounded once). */
template <typename T>
__global__ void reduce_ranks_kernel(T *out, RankPtrs in, int n, size_t off, size_t count, int avg) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (size_t)gridDim.x * blockDim.x) {
        float acc = load_elem((const T *)in.p[0], off + i);
        for (int r = 1; r < n; r++) acc += load_elem((const T *)in.p[r], off + i);
        if (avg) acc /= (float)n;
        store_elem(out, i, acc);
    }
}

} // namespace

extern "C" void cuda_reduce_ranks(void *out, const void *const *in, int n, size_t offset, size_t count, int avg,
                                  int bf16, cudaStream_t st) {
    if (!count) return;
    RankPtrs ptrs = {};
    for (int r = 0; r < n; r++) ptrs.p[r] = in[r];
    const int threads = 256;
    size_t blocks = (count + threads - 1) / threads;
    if (blocks > 4096) blocks = 4096; /* grid-stride loop covers the rest */
    if (bf16)
        reduce_ranks_kernel<uint16_t><<<(unsigned)blocks, threads, 0, st>>>((uint16_t *)out, ptrs, n, offset, count, avg);
    else
        reduce_ranks_kernel<float><<<(unsigned)blocks, threads, 0, st>>>((float *)out, ptrs, n, offset, count, avg);
    CUDA_CHECK_LAUNCH("reduce_ranks_kernel");
}
