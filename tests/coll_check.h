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
#include <stdio.h>
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

/* ---- bfloat16, checked without the runtime's conversion (runtime/bf16.h) */

static float bits_to_f32(uint32_t u) {
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* Nearest bfloat16 of a finite float by comparing the two candidates around
 * it in double (ties to the even mantissa): another route than the runtime's
 * bit trick. Exact in double: both candidates and x have at most 24 bits. */
static uint16_t ref_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    uint16_t lo = (uint16_t)(u >> 16), hi = (uint16_t)(lo + 1); /* toward zero, one step away from zero */
    double dx = x, dlo = bits_to_f32((uint32_t)lo << 16), dhi = bits_to_f32((uint32_t)hi << 16);
    double elo = dx - dlo < 0 ? dlo - dx : dx - dlo, ehi = dhi - dx < 0 ? dx - dhi : dhi - dx;
    if (elo < ehi) return lo;
    if (ehi < elo) return hi;
    return (lo & 1) ? hi : lo;
}

static float input_bf16(int rank, size_t i, int salt) { return bits_to_f32((uint32_t)ref_bf16(input(rank, i, salt)) << 16); }

/* bf16 reduce-scatter: every rank's bfloat16 widened, summed in rank order in float32, rounded once */
static uint16_t reduce_expected_bf16(int n, size_t i, int salt, RedOp op) {
    float acc = input_bf16(0, i, salt);
    for (int r = 1; r < n; r++) acc += input_bf16(r, i, salt);
    if (op == RED_AVG) acc /= (float)n;
    return ref_bf16(acc);
}

/* The bfloat16 all-gather (out of place and in place) and reduce-scatter (sum, avg) for count c. */
static void exercise_bf16(Dev *d, Stream *t, size_t c, int salt) {
    const int n = dev_world_size(d), me = dev_rank(d);
    Stream *s = dev_compute_stream(d);
    Bf16 *send = dev_alloc_bf16(d, c, MEM_COMM_BUFFER, "send16");
    Bf16 *recv = dev_alloc_bf16(d, c * (size_t)n, MEM_COMM_BUFFER, "recv16");
    Bf16 *rs_in = dev_alloc_bf16(d, c * (size_t)n, MEM_COMM_BUFFER, "rs_in16");
    Bf16 *rs_sum = dev_alloc_bf16(d, c, MEM_COMM_BUFFER, "rs_sum16");
    Bf16 *rs_avg = dev_alloc_bf16(d, c, MEM_COMM_BUFFER, "rs_avg16");
    for (size_t i = 0; i < c; i++) send[i] = ref_bf16(input(me, i, salt));
    for (size_t i = 0; i < c * (size_t)n; i++) rs_in[i] = ref_bf16(input(me, i, salt + 1));
    coll_all_gather_bf16(d, send, recv, c, t, "ag16_test");
    coll_reduce_scatter_bf16(d, rs_in, rs_sum, c, RED_SUM, s, "rs16_test");
    coll_reduce_scatter_bf16(d, rs_in, rs_avg, c, RED_AVG, s, "rs16_test");
    dev_synchronize(d);
    int ok_ag = 1, ok_sum = 1, ok_avg = 1, rounds = 0;
    for (int r = 0; r < n; r++)
        for (size_t i = 0; i < c; i++) ok_ag &= recv[(size_t)r * c + i] == ref_bf16(input(r, i, salt));
    for (size_t i = 0; i < c; i++) {
        size_t g = (size_t)me * c + i;
        ok_sum &= rs_sum[i] == reduce_expected_bf16(n, g, salt + 1, RED_SUM);
        ok_avg &= rs_avg[i] == reduce_expected_bf16(n, g, salt + 1, RED_AVG);
        /* the float32 sum was rounded once, not kept: some sums need more than bfloat16's bits */
        float acc = input_bf16(0, g, salt + 1);
        for (int r = 1; r < n; r++) acc += input_bf16(r, g, salt + 1);
        rounds += bits_to_f32((uint32_t)rs_sum[i] << 16) != acc;
    }
    COLL_CHECK(ok_ag, "all_gather_bf16 n=%d c=%zu", n, c);
    COLL_CHECK(ok_sum, "reduce_scatter_bf16 sum n=%d c=%zu", n, c);
    COLL_CHECK(ok_avg, "reduce_scatter_bf16 avg n=%d c=%zu", n, c);
    COLL_CHECK(n == 1 || c < 100 || rounds > 0, "reduce_scatter_bf16 n=%d c=%zu: no sum needed rounding (inputs too tame)", n, c);
    /* in place: send is this rank's slice of recv */
    for (size_t i = 0; i < c; i++) recv[(size_t)me * c + i] = ref_bf16(input(me, i, salt + 2));
    coll_all_gather_bf16(d, recv + (size_t)me * c, recv, c, t, "ag16_inplace");
    dev_stream_synchronize(t);
    ok_ag = 1;
    for (int r = 0; r < n; r++)
        for (size_t i = 0; i < c; i++) ok_ag &= recv[(size_t)r * c + i] == ref_bf16(input(r, i, salt + 2));
    COLL_CHECK(ok_ag, "in-place all_gather_bf16 n=%d c=%zu", n, c);
    dev_synchronize(d);
    dev_free(d, send);
    dev_free(d, recv);
    dev_free(d, rs_in);
    dev_free(d, rs_sum);
    dev_free(d, rs_avg);
}

/* All-gather and reduce-scatter (out of place and in place), all-reduce (sum,
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
        /* in-place reduce_scatter: recv is this rank's block of send */
        coll_reduce_scatter(d, rs_in, rs_in + (size_t)me * c, c, RED_SUM, s, "rs_inplace");
        dev_stream_synchronize(s);
        COLL_CHECK(bits_equal(rs_in + (size_t)me * c, e2, c), "in-place reduce_scatter n=%d c=%zu", n, c);

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
        exercise_bf16(d, t, c, 1000 + salt);
    }
}

/* ---- process groups: the same collectives among a subset of the ranks */

/* op over the members' inputs, in member (group-rank) order */
static float reduce_members(const int *members, int m, size_t i, int salt, RedOp op) {
    float acc = input(members[0], i, salt);
    for (int r = 1; r < m; r++) acc += input(members[r], i, salt);
    if (op == RED_AVG) acc /= (float)m;
    return acc;
}

/* Two splits of the world, interleaved on one stream: "block" (ranks r / 2:
 * {0,1}, {2,3}, ...) and "stride" (ranks r % 2: {0,2,4}, {1,3}), as a 2-D
 * mesh's rows and columns. Each group's all-gather, reduce-scatter (sum,
 * avg), all-reduce and bf16 all-gather, checked bitwise against its members'
 * inputs in world-rank order; then a mesh from dev_mesh_build. */
static void exercise_groups(Dev *d, Stream *t, int c) {
    const int n = dev_world_size(d), me = dev_rank(d);
    int color[2] = {me / 2, me % 2};
    char name[2][24];
    snprintf(name[0], sizeof name[0], "block%d", color[0]);
    snprintf(name[1], sizeof name[1], "stride%d", color[1]);
    ProcessGroup *g[2];
    int members[2][WORLD_MAX_RANKS], m[2] = {0, 0};
    for (int k = 0; k < 2; k++) {
        g[k] = dev_group_new(d, color[k], name[k]);
        for (int r = 0; r < n; r++)
            if ((k == 0 ? r / 2 : r % 2) == color[k]) members[k][m[k]++] = r;
        COLL_CHECK(pg_size(g[k]) == m[k], "%s: size %d, expected %d", name[k], pg_size(g[k]), m[k]);
        int want_rank = 0;
        while (members[k][want_rank] != me) want_rank++;
        COLL_CHECK(pg_rank(g[k]) == want_rank, "%s: rank %d, expected %d", name[k], pg_rank(g[k]), want_rank);
        COLL_CHECK(strcmp(pg_name(g[k]), name[k]) == 0, "group name %s, expected %s", pg_name(g[k]), name[k]);
    }
    size_t cn = (size_t)c;
    float *ag[2], *rs_in[2], *rs_sum[2], *rs_avg[2], *ar[2];
    Bf16 *ag16[2], *mine16[2];
    for (int k = 0; k < 2; k++) { /* queue both groups' collectives first: they share stream t */
        int salt = 7000 + 10 * k, mk = m[k];
        ag[k] = dev_alloc_f32(d, cn * (size_t)mk, MEM_COMM_BUFFER, "pg_ag");
        float *mine = ag[k] + (size_t)pg_rank(g[k]) * cn;
        for (size_t i = 0; i < cn; i++) mine[i] = input(me, i, salt);
        rs_in[k] = dev_alloc_f32(d, cn * (size_t)mk, MEM_COMM_BUFFER, "pg_rs_in");
        for (size_t i = 0; i < cn * (size_t)mk; i++) rs_in[k][i] = input(me, i, salt + 1);
        rs_sum[k] = dev_alloc_f32(d, cn, MEM_COMM_BUFFER, "pg_rs_sum");
        rs_avg[k] = dev_alloc_f32(d, cn, MEM_COMM_BUFFER, "pg_rs_avg");
        ar[k] = dev_alloc_f32(d, cn, MEM_COMM_BUFFER, "pg_ar");
        for (size_t i = 0; i < cn; i++) ar[k][i] = input(me, i, salt + 2);
        ag16[k] = dev_alloc_bf16(d, cn * (size_t)mk, MEM_COMM_BUFFER, "pg_ag16");
        mine16[k] = dev_alloc_bf16(d, cn, MEM_COMM_BUFFER, "pg_mine16");
        for (size_t i = 0; i < cn; i++) mine16[k][i] = ref_bf16(input(me, i, salt + 3));
    }
    for (int k = 0; k < 2; k++) {
        pg_all_gather(g[k], ag[k] + (size_t)pg_rank(g[k]) * cn, ag[k], cn, t, "pg_ag");
        pg_reduce_scatter(g[k], rs_in[k], rs_sum[k], cn, RED_SUM, t, "pg_rs");
    }
    for (int k = 0; k < 2; k++) {
        pg_reduce_scatter(g[k], rs_in[k], rs_avg[k], cn, RED_AVG, t, "pg_rs");
        pg_all_reduce(g[k], ar[k], ar[k], cn, RED_AVG, t, "pg_ar");
        pg_all_gather_bf16(g[k], mine16[k], ag16[k], cn, t, "pg_ag16");
    }
    dev_synchronize(d);
    for (int k = 0; k < 2; k++) {
        int salt = 7000 + 10 * k, mk = m[k], me_g = pg_rank(g[k]), ok_ag = 1, ok_sum = 1, ok_avg = 1, ok_ar = 1, ok16 = 1;
        for (int r = 0; r < mk; r++)
            for (size_t i = 0; i < cn; i++) {
                float want = input(members[k][r], i, salt);
                ok_ag &= memcmp(&ag[k][(size_t)r * cn + i], &want, sizeof want) == 0;
                ok16 &= ag16[k][(size_t)r * cn + i] == ref_bf16(input(members[k][r], i, salt + 3));
            }
        for (size_t i = 0; i < cn; i++) {
            float s1 = reduce_members(members[k], mk, (size_t)me_g * cn + i, salt + 1, RED_SUM);
            float s2 = reduce_members(members[k], mk, (size_t)me_g * cn + i, salt + 1, RED_AVG);
            float s3 = reduce_members(members[k], mk, i, salt + 2, RED_AVG);
            ok_sum &= memcmp(&rs_sum[k][i], &s1, sizeof s1) == 0;
            ok_avg &= memcmp(&rs_avg[k][i], &s2, sizeof s2) == 0;
            ok_ar &= memcmp(&ar[k][i], &s3, sizeof s3) == 0;
        }
        COLL_CHECK(ok_ag, "pg_all_gather in %s (n=%d c=%d)", name[k], n, c);
        COLL_CHECK(ok_sum, "pg_reduce_scatter sum in %s (n=%d c=%d)", name[k], n, c);
        COLL_CHECK(ok_avg, "pg_reduce_scatter avg in %s (n=%d c=%d)", name[k], n, c);
        COLL_CHECK(ok_ar, "pg_all_reduce avg in %s (n=%d c=%d)", name[k], n, c);
        COLL_CHECK(ok16, "pg_all_gather_bf16 in %s (n=%d c=%d)", name[k], n, c);
        dev_free(d, ag[k]);
        dev_free(d, rs_in[k]);
        dev_free(d, rs_sum[k]);
        dev_free(d, rs_avg[k]);
        dev_free(d, ar[k]);
        dev_free(d, ag16[k]);
        dev_free(d, mine16[k]);
    }
    /* a mesh: rows of 2 (or of the world when it is odd) */
    DeviceMesh mesh;
    int S = n % 2 ? n : 2, R = n / S;
    dev_mesh_build(d, &mesh, R, S);
    COLL_CHECK(mesh.ndim == 2 && mesh.shape[0] == R && mesh.shape[1] == S, "mesh %d,%d: shape %d x %d", R, S,
               mesh.shape[0], mesh.shape[1]);
    COLL_CHECK(pg_size(mesh.shard_group) == S && pg_rank(mesh.shard_group) == me % S, "mesh %d,%d: shard group", R, S);
    COLL_CHECK(pg_size(mesh.replicate_group) == R && pg_rank(mesh.replicate_group) == me / S,
               "mesh %d,%d: replicate group", R, S);
    char want[24];
    snprintf(want, sizeof want, "shard%d", me / S);
    COLL_CHECK(strcmp(pg_name(mesh.shard_group), want) == 0, "shard group named %s", pg_name(mesh.shard_group));
    DeviceMesh flat;
    dev_mesh_build(d, &flat, 0, 0);
    COLL_CHECK(flat.ndim == 1 && flat.shard_group == dev_world_group(d) && !flat.replicate_group, "1-D mesh");
}

/* Point to point (dev_send / dev_recv): a ring in one group (every rank sends
 * to the next and receives from the previous: without the group each would
 * wait for the other's receive), a pipeline's two directions in one group
 * (activations forward, grads back, as 1F1B's steady state), three sends in
 * a row to one peer outside any group, and a second stream. Every received
 * buffer is compared bit for bit with what its sender holds. */
static void exercise_p2p(Dev *d, Stream *t) {
    const int n = dev_world_size(d), me = dev_rank(d);
    if (n < 2) return;
    Stream *c = dev_compute_stream(d);
    const size_t cnt = 1000;
    const int next = (me + 1) % n, prev = (me + n - 1) % n;
    float *out = dev_alloc_f32(d, cnt, MEM_COMM_BUFFER, "out"), *in = dev_alloc_f32(d, cnt, MEM_COMM_BUFFER, "in");
    for (size_t i = 0; i < cnt; i++) out[i] = input(me, i, 41);
    dev_group_start(d);
    dev_send(c, out, cnt, next, 0, "ring");
    dev_recv(c, in, cnt, prev, 0, "ring");
    dev_group_end(d);
    dev_synchronize(d);
    int ok = 1;
    for (size_t i = 0; i < cnt; i++) ok &= bits_equal(&in[i], &(float){input(prev, i, 41)}, 1);
    COLL_CHECK(ok, "rank %d: the ring's receive from rank %d", me, prev);

    /* a chain 0 -> 1 -> ... -> n-1: forward activations, grads back, both at once in the middle */
    float *act = dev_alloc_f32(d, cnt, MEM_ACTIVATION, "act"), *grad = dev_alloc_f32(d, cnt, MEM_ACTIVATION, "grad");
    float *act_in = dev_alloc_f32(d, cnt, MEM_ACTIVATION, "act_in"), *grad_in = dev_alloc_f32(d, cnt, MEM_ACTIVATION, "grad_in");
    for (size_t i = 0; i < cnt; i++) act[i] = input(me, i, 42), grad[i] = input(me, i, 43);
    for (int mb = 0; mb < 3; mb++) {
        dev_group_start(d);
        if (me + 1 < n) dev_send(t, act, cnt, me + 1, mb, "act");
        if (me + 1 < n) dev_recv(t, grad_in, cnt, me + 1, mb, "grad");
        if (me > 0) dev_recv(t, act_in, cnt, me - 1, mb, "act");
        if (me > 0) dev_send(t, grad, cnt, me - 1, mb, "grad");
        dev_group_end(d);
        dev_stream_synchronize(t);
        int a = 1, g = 1;
        for (size_t i = 0; i < cnt && me > 0; i++) a &= bits_equal(&act_in[i], &(float){input(me - 1, i, 42)}, 1);
        for (size_t i = 0; i < cnt && me + 1 < n; i++) g &= bits_equal(&grad_in[i], &(float){input(me + 1, i, 43)}, 1);
        COLL_CHECK(a && g, "rank %d microbatch %d: activations %s, grads %s", me, mb, a ? "ok" : "wrong", g ? "ok" : "wrong");
    }

    /* three sends in a row from rank 0 to rank n-1, each its own group: they pair up in order */
    float *three = dev_alloc_f32(d, 3 * cnt, MEM_COMM_BUFFER, "three");
    for (size_t i = 0; i < 3 * cnt; i++) three[i] = me == 0 ? input(0, i, 44) : 0.0f;
    for (int k = 0; k < 3; k++) {
        if (me == 0) dev_send(c, three + (size_t)k * cnt, cnt, n - 1, k, "seq");
        if (me == n - 1) dev_recv(c, three + (size_t)k * cnt, cnt, 0, k, "seq");
    }
    dev_synchronize(d);
    if (me == n - 1) {
        int s3 = 1;
        for (size_t i = 0; i < 3 * cnt; i++) s3 &= bits_equal(&three[i], &(float){input(0, i, 44)}, 1);
        COLL_CHECK(s3, "rank %d: three sends in a row arrive in order", me);
    }
    dev_group_start(d); /* an empty group is nothing */
    dev_group_end(d);
    dev_free(d, three);
    dev_free(d, act);
    dev_free(d, grad);
    dev_free(d, act_in);
    dev_free(d, grad_in);
    dev_free(d, out);
    dev_free(d, in);
}

#endif
