/* test_runtime_mpi.c — the mpi backend, run under mpirun (tests/test_mpi.py):
 *
 *   mpirun -np 4 build/tests/test_runtime_mpi              every collective at world 4
 *   mpirun -np 2 build/tests/test_runtime_mpi --world 4    must stop: "--world 4 but mpirun started 2 processes"
 *   mpirun -np 3 build/tests/test_runtime_mpi --mismatch   must stop with the collective mismatch message
 *
 * Expected results use the same rank-order formula as tests/test_runtime.c's
 * local-backend test, so passing both means the backends agree bitwise.
 * Each process prints its own summary; rank 0's last line is "N passed, N failed". */
#include "check.h"
#include "runtime/runtime.h"
#include "runtime/util.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifndef HAVE_MPI
int main(void) {
    printf("this build has no MPI support\n");
    return check_summary(); /* "0 passed, 0 failed", status 1 */
}
#else
#include <mpi.h>

#define COLL_CHECK CHECK
#include "coll_check.h"

static int mismatch_mode, skip_mode;

static void rank_collectives(Dev *d, void *arg) {
    (void)arg;
    const int n = dev_world_size(d), me = dev_rank(d);
    Stream *t = dev_stream_create(d, "ag");
    if (skip_mode) { /* the last rank skips one all-gather: the watchdog stops the others */
        float *buf = dev_alloc_f32(d, 4096, MEM_COMM_BUFFER, "buf");
        for (int k = 0; k < 4; k++)
            if (!(me == n - 1 && k == 3)) coll_all_gather(d, buf, buf + 1024, 16, t, k == 3 ? "block2" : "warm");
        dev_synchronize(d);
        if (me == n - 1) sleep(30); /* stay alive: the others must time out, not see a dead peer */
        return;
    }
    if (mismatch_mode) {
        float *buf = dev_alloc_f32(d, 4096, MEM_COMM_BUFFER, "buf");
        for (int k = 0; k < 3; k++) coll_all_gather(d, buf, buf + 1024, 16, t, "warm");
        if (me == n - 1) coll_reduce_scatter(d, buf, buf + 2048, 64, RED_SUM, t, "block3");
        else coll_all_gather(d, buf, buf + 1024, 128, t, "block2");
        dev_synchronize(d);
        return;
    }
    exercise_collectives(d, t);
    exercise_groups(d, t, 7);
    exercise_groups(d, t, 1000);
    exercise_p2p(d, t);
    /* host exchange */
    double out[WORLD_MAX_RANKS];
    dev_host_allgather_f64(d, me * 2.5, out);
    int ok = 1;
    for (int r = 0; r < n; r++) ok &= out[r] == r * 2.5;
    CHECK(ok, "host allgather");
    dev_host_barrier(d);
}

int main(int argc, char **argv) {
    int world = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--world") == 0 && i + 1 < argc) world = atoi(argv[++i]);
        else if (strcmp(argv[i], "--mismatch") == 0) mismatch_mode = 1;
        else if (strcmp(argv[i], "--skip") == 0) skip_mode = 1;
    }
    if (world == 0) {
        const char *np = getenv("OMPI_COMM_WORLD_SIZE");
        world = np ? atoi(np) : 1;
    }
    WorldConfig c = {0};
    c.world_size = world;
    c.backend = BACKEND_MPI;
    c.blas_threads = 1;
    c.collective_timeout_s = skip_mode ? 1.0 : 0.0;
    World *w = world_create(&c);
    world_run(w, rank_collectives, NULL);
    int rank = world_first_local_rank(w);
    /* every process must pass: reduce the failure flag before finalizing */
    int failed = check_failed_in_test, any_failed = 0;
    MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    world_destroy(w);
    if (rank == 0) {
        printf("== mpi_collectives (world %d) == %s\n", world, any_failed ? "FAIL" : "OK");
        printf("%d passed, %d failed\n", any_failed ? 0 : 1, any_failed ? 1 : 0);
    }
    return any_failed ? 1 : 0;
}
#endif
