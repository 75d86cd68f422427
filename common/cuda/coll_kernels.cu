/* coll_kernels.cu — the reduction behind the local CUDA collectives: ranks
 * sharing one GPU read each other's buffers directly. */
#include "cuda/cuda_check.h"
#include "device.h"

namespace {

struct RankPtrs {
    const float *p[WORLD_MAX_RANKS];
};

/* out[i] = in[0][off+i] + in[1][off+i] + ... + in[n-1][off+i], added in rank
 * order (the CPU backend's order, so the sums are bitwise the same), then
 * divided by n for an average. */
__global__ void reduce_ranks_kernel(float *out, RankPtrs in, int n, size_t off, size_t count, int avg) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (size_t)gridDim.x * blockDim.x) {
        float acc = in.p[0][off + i];
        for (int r = 1; r < n; r++) acc += in.p[r][off + i];
        if (avg) acc /= (float)n;
        out[i] = acc;
    }
}

} // namespace

extern "C" void cuda_reduce_ranks(float *out, const float *const *in, int n, size_t offset, size_t count, int avg,
                                  cudaStream_t st) {
    if (!count) return;
    RankPtrs ptrs = {};
    for (int r = 0; r < n; r++) ptrs.p[r] = in[r];
    const int threads = 256;
    size_t blocks = (count + threads - 1) / threads;
    if (blocks > 4096) blocks = 4096; /* grid-stride loop covers the rest */
    reduce_ranks_kernel<<<(unsigned)blocks, threads, 0, st>>>(out, ptrs, n, offset, count, avg);
    CUDA_CHECK_LAUNCH("reduce_ranks_kernel");
}
