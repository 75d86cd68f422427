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
#include "device.h"
#include "util.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifndef HAVE_MPI
int main(int argc, char **argv) {
    CHECK_MAIN_ARGS(argc, argv);
    (void)check_failed_in_test;
    printf("this build has no MPI support\n");
    return check_summary(); /* "0 passed, 0 failed", status 1 */
}
#else
#include <mpi.h>

static float input(int rank, size_t i, int salt) { /* same as tests/test_runtime.c */
    uint64_t h = (uint64_t)(rank + 1) * 0x9E3779B97F4A7C15ull ^ (uint64_t)(i + 1) * 0xBF58476D1CE4E5B9ull ^ (uint64_t)salt * 0x94D049BB133111EBull;
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 32;
    float u = (float)(h & 0xffffff) / 16777216.0f - 0.5f;
    float scale = (h >> 24) & 1 ? 1e4f : 1e-3f;
    return u * scale;
}

static float reduce_expected(int n, size_t i, int salt, RedOp op) {
    float acc = input(0, i, salt);
    for (int r = 1; r < n; r++) acc += input(r, i, salt);
    if (op == RED_AVG) acc /= (float)n;
    return acc;
}

static int bits_equal(const float *a, const float *b, size_t n) { return n == 0 || memcmp(a, b, n * sizeof(float)) == 0; }

static int mismatch_mode, skip_mode;

static void rank_collectives(Dev *d, void *arg) {
    (void)arg;
    const int n = dev_world_size(d), me = dev_rank(d);
    Stream *s = dev_compute_stream(d), *t = dev_stream_create(d, "ag");
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
    const size_t counts[] = {7, 1, 0, 1000};
    int salt = 0;
    for (size_t ci = 0; ci < sizeof counts / sizeof *counts; ci++) {
        const size_t c = counts[ci];
        salt++;
        float *send = dev_alloc_f32(d, c, MEM_COMM_BUFFER, "send");
        float *recv = dev_alloc_f32(d, c * (size_t)n, MEM_COMM_BUFFER, "recv");
        float *exp = malloc((c * (size_t)n + 1) * sizeof(float));
        float *e2 = malloc((c + 1) * sizeof(float)), *e3 = malloc((c + 1) * sizeof(float));
        for (size_t i = 0; i < c; i++) send[i] = input(me, i, salt);
        for (int r = 0; r < n; r++)
            for (size_t i = 0; i < c; i++) exp[(size_t)r * c + i] = input(r, i, salt);
        coll_all_gather(d, send, recv, c, t, "ag_test");
        int salt_rs = ++salt;
        float *rs_in = dev_alloc_f32(d, c * (size_t)n, MEM_COMM_BUFFER, "rs_in");
        float *rs_out = dev_alloc_f32(d, c, MEM_COMM_BUFFER, "rs_out");
        float *rs_avg = dev_alloc_f32(d, c, MEM_COMM_BUFFER, "rs_avg");
        for (size_t i = 0; i < c * (size_t)n; i++) rs_in[i] = input(me, i, salt_rs);
        coll_reduce_scatter(d, rs_in, rs_out, c, RED_SUM, s, "rs_test");
        coll_reduce_scatter(d, rs_in, rs_avg, c, RED_AVG, s, "rs_test");
        dev_synchronize(d);
        CHECK(bits_equal(recv, exp, c * (size_t)n), "all_gather n=%d c=%zu", n, c);
        for (size_t i = 0; i < c; i++) {
            e2[i] = reduce_expected(n, (size_t)me * c + i, salt_rs, RED_SUM);
            e3[i] = reduce_expected(n, (size_t)me * c + i, salt_rs, RED_AVG);
        }
        CHECK(bits_equal(rs_out, e2, c), "reduce_scatter sum n=%d c=%zu", n, c);
        CHECK(bits_equal(rs_avg, e3, c), "reduce_scatter avg n=%d c=%zu", n, c);

        salt++;
        for (size_t i = 0; i < c; i++) recv[(size_t)me * c + i] = input(me, i, salt);
        coll_all_gather(d, recv + (size_t)me * c, recv, c, t, "ag_inplace");
        dev_stream_synchronize(t);
        for (int r = 0; r < n; r++)
            for (size_t i = 0; i < c; i++) exp[(size_t)r * c + i] = input(r, i, salt);
        CHECK(bits_equal(recv, exp, c * (size_t)n), "in-place all_gather n=%d c=%zu", n, c);

        for (int op = 0; op < 2; op++)
            for (int inplace = 0; inplace < 2; inplace++) {
                salt++;
                float *in = dev_alloc_f32(d, c, MEM_TEMP, "ar_in");
                float *out = inplace ? in : dev_alloc_f32(d, c, MEM_TEMP, "ar_out");
                for (size_t i = 0; i < c; i++) in[i] = input(me, i, salt);
                coll_all_reduce(d, in, out, c, (RedOp)op, s, "ar_test");
                dev_stream_synchronize(s);
                for (size_t i = 0; i < c; i++) e2[i] = reduce_expected(n, i, salt, (RedOp)op);
                CHECK(bits_equal(out, e2, c), "all_reduce n=%d c=%zu op=%d inplace=%d", n, c, op, inplace);
                dev_free(d, in);
                if (!inplace) dev_free(d, out);
            }

        for (int root = 0; root < n; root++) {
            salt++;
            for (size_t i = 0; i < c; i++) send[i] = input(me, i, salt);
            coll_broadcast(d, send, c, root, t, "bc_test");
            dev_stream_synchronize(t);
            for (size_t i = 0; i < c; i++) e2[i] = input(root, i, salt);
            CHECK(bits_equal(send, e2, c), "broadcast n=%d c=%zu root=%d", n, c, root);
        }
        coll_barrier(d, s, "barrier_test");
        coll_barrier(d, t, "barrier_test");
        dev_synchronize(d);
        free(exp);
        free(e2);
        free(e3);
        dev_free(d, send);
        dev_free(d, recv);
        dev_free(d, rs_in);
        dev_free(d, rs_out);
        dev_free(d, rs_avg);
    }
    /* host exchange */
    double out[WORLD_MAX_RANKS];
    dev_host_allgather_f64(d, me * 2.5, out);
    int ok = 1;
    for (int r = 0; r < n; r++) ok &= out[r] == r * 2.5;
    CHECK(ok, "host allgather");
    dev_host_barrier(d);
}

int main(int argc, char **argv) {
    CHECK_MAIN_ARGS(argc, argv); /* (no RUN here; keeps the harness happy) */
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
