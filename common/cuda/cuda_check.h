/* cuda_check.h — error checking and the launch context of the CUDA backend.
 *
 * Every CUDA, cuBLAS and NCCL call goes through a CHECK macro: a failure is
 * one line "error: <file>:<line>: <call> failed: <reason>" and exit status 2
 * (fatal in util.h). Kernel launches are followed by CUDA_CHECK_LAUNCH(),
 * which reads cudaGetLastError so a bad launch configuration is reported at
 * its launch site, not at some later synchronisation. */
#ifndef HWFSDP_CUDA_CHECK_H
#define HWFSDP_CUDA_CHECK_H

#include <cublas_v2.h>
#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "runtime/util.h"

const char *cublas_status_name(cublasStatus_t s);

#define CUDA_CHECK(call)                                                                                               \
    do {                                                                                                               \
        cudaError_t e_ = (call);                                                                                       \
        if (e_ != cudaSuccess)                                                                                         \
            fatal("%s:%d: %s failed: %s (%s)", __FILE__, __LINE__, #call, cudaGetErrorString(e_), cudaGetErrorName(e_)); \
    } while (0)

#define CUDA_CHECK_LAUNCH(what)                                                                                        \
    do {                                                                                                               \
        cudaError_t e_ = cudaGetLastError();                                                                           \
        if (e_ != cudaSuccess) fatal("%s:%d: launch of %s failed: %s", __FILE__, __LINE__, (what), cudaGetErrorString(e_)); \
    } while (0)

#define CUBLAS_CHECK(call)                                                                                             \
    do {                                                                                                               \
        cublasStatus_t s_ = (call);                                                                                    \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                                                               \
            fatal("%s:%d: %s failed: %s", __FILE__, __LINE__, #call, cublas_status_name(s_));                          \
    } while (0)

/* The stream and cuBLAS handle of the dev_launch being executed on this host
 * thread (set by the runtime around the kernel function; NULL outside one). */
cudaStream_t cuda_current_stream(void);
cublasHandle_t cuda_current_cublas(void);
/* 1 if matmuls may use TF32 tensor cores (--tf32), else exact fp32. */
int cuda_tf32_enabled(void);

#ifdef __cplusplus
}
#endif

#endif
