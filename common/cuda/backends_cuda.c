/* backends_cuda.c — the backends of the CUDA build (make cuda): "local" (N
 * ranks share one GPU), "nccl" and "nccl-mpi", all cuda_backend; it replaces
 * cpu/backends_cpu.c, and none of the CPU backends' files (common/cpu/ but
 * the kernels) is built. */
#include "cuda/cuda_internal.h"

const BackendOps *backend_ops(CollBackend b) {
    switch (b) {
    case BACKEND_LOCAL:
    case BACKEND_NCCL:
    case BACKEND_NCCL_MPI: return &cuda_backend;
    case BACKEND_MPI:
        fatal("--backend mpi is the CPU build's multi-process backend; the CUDA build uses nccl-mpi under mpirun");
    }
    fatal("unknown collective backend %d", (int)b);
}

int dev_is_cuda_build(void) { return 1; }
