/* backends_cpu.c — the backends of the CPU build (make): "local" and, built
 * with MPI, "mpi"; the CUDA build's (cuda/backends_cuda.c) replace this file. */
#include "cpu/cpu_internal.h"
#include "runtime/util.h"

const BackendOps *backend_ops(CollBackend b) {
    switch (b) {
    case BACKEND_LOCAL: return &cpu_local_backend;
    case BACKEND_MPI: return cpu_mpi_backend_ops();
    case BACKEND_NCCL:
    case BACKEND_NCCL_MPI:
        fatal("--backend %s needs the CUDA build (make cuda, then build-cuda/.../train)", backend_name(b));
    }
    fatal("unknown collective backend %d", (int)b);
}

int dev_is_cuda_build(void) { return 0; }
