/* copy_kernels.cu — dev_memcpy_batch_async on the GPU: every copy of a list
 * in ONE kernel launch, as FSDP2's fused copy-in / copy-out / chunk-cat
 * (torch._foreach_copy_, split_with_sizes_copy, _chunk_cat) are.
 *
 * The list goes to the device first: a stream-ordered scratch allocation
 * (cudaMallocAsync) filled by one host-to-device copy of the descriptors,
 * read by the kernel, freed in stream order after it (cudaFreeAsync). The
 * caller's list may be reused as soon as the call returns: a copy from
 * pageable host memory has read its source by the time cudaMemcpyAsync
 * returns (it is staged, CUDA's "API synchronization behavior").
 *
 * Grid: blockIdx.y walks the copies, blockIdx.x and threadIdx.x the bytes of
 * one copy (grid-stride), in 16-byte words when the copy's two ends and its
 * length allow, else 4-byte words, else bytes. The copies never overlap
 * (backend.c checked), so their order does not matter. Copies between host
 * and device memory read or write mapped pinned memory (unified addressing),
 * as a kernel may (device.h, dev_alloc_host). */
#include <stdint.h>

#include "cuda/cuda_check.h"
#include "device.h"

namespace {

template <typename W>
__device__ void copy_words(void *dst, const void *src, size_t words) {
    W *d = (W *)dst;
    const W *s = (const W *)src;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += (size_t)gridDim.x * blockDim.x)
        d[i] = s[i];
}

__global__ void copy_batch_kernel(const DevCopy *copies, size_t n) {
    for (size_t c = blockIdx.y; c < n; c += gridDim.y) {
        DevCopy k = copies[c];
        uintptr_t align = (uintptr_t)k.dst | (uintptr_t)k.src | (uintptr_t)k.bytes;
        if (align % 16 == 0) copy_words<uint4>(k.dst, k.src, k.bytes / 16);
        else if (align % 4 == 0) copy_words<uint32_t>(k.dst, k.src, k.bytes / 4);
        else copy_words<unsigned char>(k.dst, k.src, k.bytes);
    }
}

} // namespace

extern "C" void cuda_copy_batch(const DevCopy *copies, size_t n, size_t bytes, cudaStream_t st) {
    if (!n) return;
    DevCopy *list = NULL;
    CUDA_CHECK(cudaMallocAsync((void **)&list, n * sizeof *list, st));
    CUDA_CHECK(cudaMemcpyAsync(list, copies, n * sizeof *list, cudaMemcpyHostToDevice, st));
    const int threads = 256;
    /* enough blocks per copy for its mean size in 16-byte words, at most 1024; copies at most 65535 at a time
     * along y (the grid's limit: the kernel's loop takes the rest) */
    size_t per_copy = (bytes / n + 16 * threads - 1) / (16 * threads);
    unsigned bx = (unsigned)(per_copy < 1 ? 1 : per_copy > 1024 ? 1024 : per_copy);
    unsigned by = (unsigned)(n < 65535 ? n : 65535);
    copy_batch_kernel<<<dim3(bx, by), threads, 0, st>>>(list, n);
    CUDA_CHECK_LAUNCH("copy_batch_kernel");
    CUDA_CHECK(cudaFreeAsync(list, st));
}
