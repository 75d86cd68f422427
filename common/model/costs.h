/* costs.h — the declared costs (runtime.h: KernelCost) of the element-wise
 * kernels the model and the optimizer launch, each stated once: model.c and
 * launch.c declare them through these, and tools/gpu_calibrate.c prices the
 * same kernels with them (the matmuls' and attention's are kernels.h's
 * kcost_*). FLOPs as the math counts them, bytes as each tensor read or
 * written once, dt the dtype of the [a] tensors (kernels.h: 2 bytes under
 * bf16, else 4); rstd, the grads of the weights and the optimizer state stay
 * float32. */
#ifndef HWFSDP_COSTS_H
#define HWFSDP_COSTS_H

#include "model/kernels.h"

/* out[N,D], rstd[N] = RMSNorm(in[N,D]) * w[D]: in read, out written, w read; rstd (float32) written */
static inline KernelCost kcost_rmsnorm_forward(size_t N, size_t D, DType dt) {
    double e = dtype_bytes(dt);
    KernelCost c = kcost_elementwise(4.0 * N * D, e * (2 * N * D + D) + 4.0 * N);
    kcost_eager_rmsnorm(&c, e, (double)(N * D), 0);
    return c;
}
/* dinp[N,D] += ..., dw[D] += ...: dout, in read, dinp read and written, w read; dw (float32) read and written,
 * rstd read */
static inline KernelCost kcost_rmsnorm_backward(size_t N, size_t D, DType dt) {
    double e = dtype_bytes(dt);
    KernelCost c = kcost_elementwise(8.0 * N * D, e * (4 * N * D + D) + 4.0 * (2 * D + N));
    kcost_eager_rmsnorm(&c, e, (double)(N * D), 1);
    return c;
}
/* out[n] = silu(a[n]) * b[n]: a, b read, out written */
static inline KernelCost kcost_swiglu_forward(size_t n, DType dt) {
    KernelCost c = kcost_elementwise(6.0 * (double)n, 3.0 * dtype_bytes(dt) * (double)n);
    kcost_eager_swiglu(&c, dtype_bytes(dt), (double)n, 0);
    return c;
}
/* da[n], db[n] += ...: dout, a, b read, da and db read and written */
static inline KernelCost kcost_swiglu_backward(size_t n, DType dt) {
    KernelCost c = kcost_elementwise(10.0 * (double)n, 7.0 * dtype_bytes(dt) * (double)n);
    kcost_eager_swiglu(&c, dtype_bytes(dt), (double)n, 1);
    return c;
}
/* out[n] = a[n] + b[n] (the residual adds) */
static inline KernelCost kcost_add(size_t n, DType dt) {
    return kcost_elementwise((double)n, 3.0 * dtype_bytes(dt) * (double)n);
}
/* AdamW on n float32 params: param, exp_avg, exp_avg_sq read and written, grad read */
static inline KernelCost kcost_adamw(size_t n) { return kcost_elementwise(15.0 * (double)n, 28.0 * (double)n); }

#endif
