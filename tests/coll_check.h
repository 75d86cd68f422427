/* coll_check.h — every collective at one world size, checked bit for bit
 * against a rank-order reference. Shared by tests/test_runtime.c (local
 * backend, ranks as threads) and tests/test_runtime_mpi.c (mpi backend), so
 * passing both means the two backends agree bitwise.
 *
 * Define COLL_CHECK(cond, fmt, ...) before including (thread-safe in the
 * threaded test). */
#ifndef HWFSDP_COLL_CHECK_H
#define HWFSDP_COLL_CHECK_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/runtime.h"

/* Deterministic inputs of every rank, with magnitudes that make the
 * summation order visible in the last bits. */
static float input(int rank, size_t i, int salt) {
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

/* All-gather (out of place and in place), reduce-scatter, all-reduce (sum,
 * avg, in place or not) and broadcast from every root, for counts 7, 1, 0
 * and 1000, on two streams at once. */
static void exercise_collectives(Dev *d, Stream *t /* a second stream */) {
    const int n = dev_world_size(d), me = dev_rank(d);
    Stream *s = dev_compute_stream(d);
    const size_t counts[] = {7, 1, 0, 1000};
    int salt = 0;
    for (size_t ci = 0; ci < sizeof counts / sizeof *counts; ci++) {
        const size_t c = counts[ci];
        /* all_gather, out of place, on stream t */
        salt++;
        float *send = dev_alloc_f32(d, c, MEM_COMM_BUFFER, "send");
        float *recv = dev_alloc_f32(d, c * (size_t)n, MEM_COMM_BUFFER, "recv");
        float *exp = malloc((c * (size_t)n + 1) * sizeof(float));
        for (size_t i = 0; i < c; i++) send[i] = input(me, i, salt);
        for (int r = 0; r < n; r++)
            for (size_t i = 0; i < c; i++) exp[(size_t)r * c + i] = input(r, i, salt);
        coll_all_gather(d, send, recv, c, t, "ag_test");
        /* meanwhile a reduce_scatter on the compute stream (its own rendezvous) */
        int salt_rs = ++salt;
        float *rs_in = dev_alloc_f32(d, c * (size_t)n, MEM_COMM_BUFFER, "rs_in");
        float *rs_out = dev_alloc_f32(d, c, MEM_COMM_BUFFER, "rs_out");
        float *rs_avg = dev_alloc_f32(d, c, MEM_COMM_BUFFER, "rs_avg");
        for (size_t i = 0; i < c * (size_t)n; i++) rs_in[i] = input(me, i, salt_rs);
        coll_reduce_scatter(d, rs_in, rs_out, c, RED_SUM, s, "rs_test");
        coll_reduce_scatter(d, rs_in, rs_avg, c, RED_AVG, s, "rs_test");
        dev_synchronize(d);
        COLL_CHECK(bits_equal(recv, exp, c * (size_t)n), "all_gather n=%d c=%zu", n, c);
        float *e2 = malloc((c + 1) * sizeof(float)), *e3 = malloc((c + 1) * sizeof(float));
        for (size_t i = 0; i < c; i++) {
            e2[i] = reduce_expected(n, (size_t)me * c + i, salt_rs, RED_SUM);
            e3[i] = reduce_expected(n, (size_t)me * c + i, salt_rs, RED_AVG);
        }
        COLL_CHECK(bits_equal(rs_out, e2, c), "reduce_scatter sum n=%d c=%zu", n, c);
        COLL_CHECK(bits_equal(rs_avg, e3, c), "reduce_scatter avg n=%d c=%zu", n, c);

        /* in-place all_gather: send is this rank's slice of recv */
        salt++;
        for (size_t i = 0; i < c; i++) recv[(size_t)me * c + i] = input(me, i, salt);
        coll_all_gather(d, recv + (size_t)me * c, recv, c, t, "ag_inplace");
        dev_stream_synchronize(t);
        for (int r = 0; r < n; r++)
            for (size_t i = 0; i < c; i++) exp[(size_t)r * c + i] = input(r, i, salt);
        COLL_CHECK(bits_equal(recv, exp, c * (size_t)n), "in-place all_gather n=%d c=%zu", n, c);

        /* all_reduce, out of place and in place, sum and avg */
        for (int op = 0; op < 2; op++)
            for (int inplace = 0; inplace < 2; inplace++) {
                salt++;
                float *in = dev_alloc_f32(d, c, MEM_TEMP, "ar_in");
                float *out = inplace ? in : dev_alloc_f32(d, c, MEM_TEMP, "ar_out");
                for (size_t i = 0; i < c; i++) in[i] = input(me, i, salt);
                coll_all_reduce(d, in, out, c, (RedOp)op, s, "ar_test");
                dev_stream_synchronize(s);
                for (size_t i = 0; i < c; i++) e2[i] = reduce_expected(n, i, salt, (RedOp)op);
                COLL_CHECK(bits_equal(out, e2, c), "all_reduce n=%d c=%zu op=%d inplace=%d", n, c, op, inplace);
                dev_free(d, in);
                if (!inplace) dev_free(d, out);
            }

        /* broadcast from every root */
        for (int root = 0; root < n; root++) {
            salt++;
            for (size_t i = 0; i < c; i++) send[i] = input(me, i, salt);
            coll_broadcast(d, send, c, root, t, "bc_test");
            dev_stream_synchronize(t);
            for (size_t i = 0; i < c; i++) e2[i] = input(root, i, salt);
            COLL_CHECK(bits_equal(send, e2, c), "broadcast n=%d c=%zu root=%d", n, c, root);
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
}

#endif
