/* test_race.c — the stream race detector and the collective watchdog.
 *
 *   ./test_race                  every unit test (verdicts checked in a child process)
 *   ./test_race NAME             one test
 *   ./test_race --mode KIND      run one scenario in this process (tests/test_runtime_misuse.py
 *                                checks its exit status and message)
 *
 * A race verdict ends the process (exit 2), so each unit test forks a child
 * that runs a scenario and compares its stderr with the expected line. */
#include "check.h"
#include "local_world.h"
#include "runtime/runtime.h"
#include "runtime/util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    const float *src;
    float *dst;
    size_t n;
} CopyArgs;
static void k_copy(void *p) {
    CopyArgs *a = p;
    memcpy(a->dst, a->src, a->n * sizeof(float));
}
/* Declares (dev_access) what k_copy would touch but touches nothing: the
 * detector-off case must not be a real data race (TSan runs these tests). */
static void k_pretend(void *p) { (void)p; }

/* waiter's later work waits for the work queued on s so far (through e). */
static void wait_for(Stream *waiter, Event *e, Stream *s) {
    dev_event_record(e, s);
    dev_stream_wait_event(waiter, e);
}

/* ------------------------------------------------------------ scenarios */

/* Stream "producer" writes buf (memcpy); "compute" reads it. mode selects the
 * ordering: 0 none, 1 event wait, 2 event recorded BEFORE the write, 3 host
 * stream sync, 4 host event sync, 5 none, with a kernel that only pretends; 6 none and 7 an event wait, the
 * write a batch copy. */
static void rank_write_then_read(Dev *d, void *arg) {
    int mode = *(int *)arg;
    Stream *c = dev_compute_stream(d), *p = dev_stream_create(d, "producer");
    Event *e = dev_event_create(d, "produced");
    dev_set_scope(d, 0, "block1", "pre_forward");
    float *src = dev_alloc_f32(d, 256, MEM_PARAM_SHARD, "shard");
    float *buf = dev_alloc_f32(d, 1024, MEM_COMM_BUFFER, "block1.buffer");
    float *out = dev_alloc_f32(d, 256, MEM_ACTIVATION, "block1.out");
    dev_memset_async(p, src, 0, 256 * sizeof(float));
    if (mode == 2) dev_event_record(e, p);
    if (mode >= 6) { /* a batch copy: the detector sees each of its ranges (the second one is read below) */
        DevCopy list[2] = {{buf, src, 64 * sizeof(float)}, {buf + 256, src, 256 * sizeof(float)}};
        dev_memcpy_batch_async(p, "copy_out", list, 2);
    } else {
        dev_memcpy_async(p, buf + 256, src, 256 * sizeof(float));
    }
    if (mode == 1 || mode == 7) dev_event_record(e, p);
    if (mode == 1 || mode == 2 || mode == 7) dev_stream_wait_event(c, e);
    if (mode == 3) dev_stream_synchronize(p);
    if (mode == 4) {
        dev_event_record(e, p);
        dev_event_synchronize(e);
    }
    dev_set_scope(d, 0, "block1", "forward");
    CopyArgs a = {buf + 256, out, 256};
    dev_access(c, buf + 256, 256 * sizeof(float), 0, "block1 weights");
    dev_access(c, out, 256 * sizeof(float), 1, NULL);
    dev_launch(c, "matmul", TEST_COST, mode == 5 ? k_pretend : k_copy, &a, sizeof a);
    dev_synchronize(d);
    dev_free(d, src);
    dev_free(d, buf);
    dev_free(d, out);
    dev_event_destroy(e);
}

/* compute reads buf; "writer" overwrites it without waiting (write after read). */
static void rank_write_after_read(Dev *d, void *arg) {
    int ordered = *(int *)arg;
    Stream *c = dev_compute_stream(d), *wr = dev_stream_create(d, "writer");
    Event *e = dev_event_create(d, "read_done");
    dev_set_scope(d, 2, "optimizer", "step");
    float *buf = dev_alloc_f32(d, 64, MEM_PARAM_SHARD, "layers.0.wq.weight");
    float *tmp = dev_alloc_f32(d, 64, MEM_TEMP, "tmp");
    memset(buf, 0, 64 * sizeof(float)); /* host writes are not tracked */
    dev_memcpy_async(c, tmp, buf, 64 * sizeof(float));
    if (ordered) wait_for(wr, e, c);
    dev_memset_async(wr, buf, 0, 64 * sizeof(float));
    dev_synchronize(d);
    dev_free(d, buf);
    dev_free(d, tmp);
    dev_event_destroy(e);
}

/* A copy enqueued on a buffer after its dev_free. */
static void rank_use_after_free(Dev *d, void *arg) {
    (void)arg;
    Stream *c = dev_compute_stream(d);
    dev_set_scope(d, 0, "block2", "pre_forward");
    float *flat = dev_alloc_f32(d, 512, MEM_COMM_BUFFER, "block2.all_gather_buffer");
    float *param = dev_alloc_f32(d, 512, MEM_UNSHARDED_PARAM, "layers.2.attention.wq.weight");
    dev_memset_async(c, flat, 0, 512 * sizeof(float));
    dev_free(d, flat);
    dev_memcpy_async(c, param, flat, 512 * sizeof(float));
    dev_synchronize(d);
    dev_free(d, param);
}

/* A collective writes on "all_gather"; compute copies out with or without a wait. */
static void rank_collective(Dev *d, void *arg) {
    int ordered = *(int *)arg;
    int W = dev_world_size(d), me = dev_rank(d);
    Stream *c = dev_compute_stream(d), *ag = dev_stream_create(d, "all_gather");
    Event *e = dev_event_create(d, "ag_done");
    dev_set_scope(d, 0, "block1", "pre_forward");
    float *flat = dev_alloc_f32(d, 128 * (size_t)W, MEM_COMM_BUFFER, "block2.all_gather_buffer");
    dev_set_scope(d, 0, "block2", "pre_forward");
    dev_memset_async(ag, flat + (size_t)me * 128, 0, 128 * sizeof(float));
    coll_all_gather(d, flat + (size_t)me * 128, flat, 128, ag, "block2");
    dev_event_record(e, ag);
    if (ordered) dev_stream_wait_event(c, e);
    float *p = dev_alloc_f32(d, 128 * (size_t)W, MEM_UNSHARDED_PARAM, "layers.2.w");
    dev_memcpy_async(c, p, flat, 128 * (size_t)W * sizeof(float));
    dev_free(d, flat);
    dev_synchronize(d);
    dev_free(d, p);
    dev_event_destroy(e);
}

/* The caching allocator's rule at dev_free. An all-gather buffer of compute's
 * pool is filled by a collective on "all_gather" (ordered after compute's
 * work by an event), then freed right after enqueueing it; compute allocates
 * next, which may take the block while the all-gather still writes it.
 * mode 0: that bug (reported at compute's first use of the new block); 1:
 * compute waits for the all-gather before the free; 2: dev_record_stream(buf,
 * all_gather) instead; 3: the buffer is allocated on "all_gather" itself (its
 * own queued work is ordered: no verdict); 4: compute waits after the free,
 * before the next allocation (FSDP2's reduce-scatter output: freed while the
 * optimizer's read is queued, safe because the owner waits before reusing);
 * 5: compute waits after the next allocation but before its first use. */
static void rank_free_in_use(Dev *d, void *arg) {
    int mode = *(int *)arg;
    int W = dev_world_size(d), me = dev_rank(d);
    Stream *c = dev_compute_stream(d), *ag = dev_stream_create(d, "all_gather");
    Event *ready = dev_event_create(d, "ready"), *done = dev_event_create(d, "ag_done");
    dev_set_scope(d, 0, "block2", "pre_forward");
    float *flat = mode == 3 ? dev_alloc_f32_on(ag, 128 * (size_t)W, MEM_COMM_BUFFER, "block2.all_gather_buffer")
                            : dev_alloc_f32(d, 128 * (size_t)W, MEM_COMM_BUFFER, "block2.all_gather_buffer");
    wait_for(ag, ready, c);
    dev_memset_async(ag, flat + (size_t)me * 128, 0, 128 * sizeof(float));
    coll_all_gather(d, flat + (size_t)me * 128, flat, 128, ag, "block2");
    dev_event_record(done, ag);
    if (mode == 1) dev_stream_wait_event(c, done);
    if (mode == 2) dev_record_stream(flat, ag);
    dev_free(d, flat);
    if (mode == 4) dev_stream_wait_event(c, done);
    float *next = dev_alloc_f32(d, 128 * (size_t)W, MEM_UNSHARDED_PARAM, "layers.2.w");
    if (mode == 5) dev_stream_wait_event(c, done);
    dev_memset_async(c, next, 0, 128 * (size_t)W * sizeof(float));
    dev_synchronize(d);
    dev_free(d, next);
    dev_event_destroy(ready);
    dev_event_destroy(done);
}

/* A block of compute's pool, allocated after compute queued work, written by
 * "all_gather" without waiting for compute (mode 0); mode 1 allocates it on
 * "all_gather" instead; mode 2 makes all_gather wait for an event recorded on
 * compute after the allocation. */
static void rank_foreign_pool(Dev *d, void *arg) {
    int mode = *(int *)arg;
    Stream *c = dev_compute_stream(d), *ag = dev_stream_create(d, "all_gather");
    Event *e = dev_event_create(d, "allocated");
    dev_set_scope(d, 0, "block3", "pre_forward");
    float *act = dev_alloc_f32(d, 64, MEM_ACTIVATION, "block2.out");
    dev_memset_async(c, act, 0, 64 * sizeof(float)); /* compute has work queued */
    float *flat = mode == 1 ? dev_alloc_f32_on(ag, 64, MEM_COMM_BUFFER, "block3.all_gather_buffer")
                            : dev_alloc_f32(d, 64, MEM_COMM_BUFFER, "block3.all_gather_buffer");
    if (mode == 2) wait_for(ag, e, c);
    dev_memset_async(ag, flat, 0, 64 * sizeof(float));
    dev_synchronize(d);
    dev_free(d, flat);
    dev_free(d, act);
    dev_event_destroy(e);
}

/* Rank 3 (of 4) skips one all-gather: the others wait for it forever. */
static void rank_skip_all_gather(Dev *d, void *arg) {
    (void)arg;
    Stream *ag = dev_stream_create(d, "all_gather");
    float *buf = dev_alloc_f32(d, 4 * 64, MEM_COMM_BUFFER, "buf");
    for (int k = 0; k < 14; k++)
        if (!(dev_rank(d) == 3 && k == 13)) /* in place: this rank's block of the gathered buffer */
            coll_all_gather(d, buf + 64 * dev_rank(d), buf, 64, ag, k == 13 ? "block2" : "warm");
    dev_synchronize(d);
    dev_free(d, buf);
}

/* The copy stream writes a pinned host shard (d2h) that compute then reads
 * (h2d) with no event wait: the detector orders streams on host memory too. */
static void rank_host_race(Dev *d, void *arg) {
    (void)arg;
    Stream *c = dev_compute_stream(d), *copy = dev_stream_create(d, "copy");
    dev_set_scope(d, 0, "block1", "post_backward");
    float *dv = dev_alloc_f32(d, 64, MEM_GRAD_SHARD, "block1.grad_shards");
    float *h = dev_alloc_host_f32(d, 64, MEM_GRAD_SHARD, "block1.host_grads");
    float *dv2 = dev_alloc_f32(d, 64, MEM_TEMP, "scratch");
    dev_memset_async(c, dv, 0, 256);
    dev_synchronize(d);
    dev_memcpy_async(copy, h, dv, 256);
    dev_set_scope(d, 0, "optimizer", "optimizer");
    dev_memcpy_async(c, dv2, h, 256);
    dev_synchronize(d);
}

/* A 2x2 mesh: rank 1 skips its shard group's second all-gather; rank 0 waits for it. */
static void rank_skip_group_all_gather(Dev *d, void *arg) {
    (void)arg;
    DeviceMesh m;
    dev_mesh_build(d, &m, 2, 2);
    Stream *ag = dev_stream_create(d, "all_gather");
    float *buf = dev_alloc_f32(d, 2 * 64, MEM_COMM_BUFFER, "buf");
    for (int k = 0; k < 2; k++)
        if (!(dev_rank(d) == 1 && k == 1)) /* in place: this rank's block of the gathered buffer */
            pg_all_gather(m.shard_group, buf + 64 * pg_rank(m.shard_group), buf, 64, ag, k ? "block2" : "warm");
    dev_synchronize(d);
    dev_free(d, buf);
}

/* Rank 0 issues a collective on a stream index the other ranks never create. */
static void rank_extra_stream(Dev *d, void *arg) {
    (void)arg;
    float *buf = dev_alloc_f32(d, 2 * 16, MEM_COMM_BUFFER, "buf");
    if (dev_rank(d) == 0) {
        Stream *x = dev_stream_create(d, "extra");
        coll_all_reduce(d, buf, buf, 16, RED_SUM, x, "grad_norm");
    }
    dev_synchronize(d);
    dev_free(d, buf);
}

/* compute waits on an event whose record sits behind a collective that never
 * completes (rank 1 skips it); the host waits on compute. */
static void rank_stuck_event(Dev *d, void *arg) {
    (void)arg;
    Stream *c = dev_compute_stream(d), *ag = dev_stream_create(d, "all_gather");
    Event *e = dev_event_create(d, "ag_done");
    float *buf = dev_alloc_f32(d, 2 * 32, MEM_COMM_BUFFER, "buf");
    if (dev_rank(d) == 0) coll_all_gather(d, buf, buf, 32, ag, "block0");
    wait_for(c, e, ag);
    dev_stream_synchronize(c);
    dev_free(d, buf);
    dev_event_destroy(e);
}

/* Point to point on 2 ranks. arg 0: rank 0 sends microbatch 1 where rank 1
 * receives microbatch 2 (a mismatch); 1: both ranks send first, each alone,
 * so each waits for a receive the other never reaches (NCCL deadlocks the
 * same way); 2: the same two calls in one group (clean); 3: rank 1 receives
 * on the compute stream and a second stream reads the buffer without waiting
 * (a race); 4: the same with the wait (clean). */
static void rank_p2p(Dev *d, void *arg) {
    const int mode = *(int *)arg, me = dev_rank(d), peer = 1 - me;
    Stream *c = dev_compute_stream(d), *other = dev_stream_create(d, "other");
    dev_set_scope(d, 0, "stage1", "forward");
    float *out = dev_alloc_f32(d, 64, MEM_ACTIVATION, "act_out"), *in = dev_alloc_f32(d, 64, MEM_ACTIVATION, "act_in");
    dev_memset_async(c, out, 0, 64 * sizeof(float));
    if (mode == 0) {
        if (me == 0) dev_send(c, out, 64, 1, 1, "act");
        else dev_recv(c, in, 64, 0, 2, "act");
    } else if (mode == 1 || mode == 2) {
        if (mode == 2) dev_group_start(d);
        dev_send(c, out, 64, peer, 0, me ? "grad" : "act");
        dev_recv(c, in, 64, peer, 0, me ? "act" : "grad");
        if (mode == 2) dev_group_end(d);
    } else {
        if (me == 0) dev_send(c, out, 64, 1, 0, "act");
        else {
            dev_recv(c, in, 64, 0, 0, "act");
            if (mode == 4) {
                Event *e = dev_event_create(d, "recv_done");
                dev_event_record(e, c);
                dev_stream_wait_event(other, e);
                dev_event_destroy(e);
            }
            dev_memcpy_async(other, out, in, 64 * sizeof(float));
        }
    }
    dev_synchronize(d);
    dev_free(d, out);
    dev_free(d, in);
}

/* A range that starts inside an allocation but runs past its end: arg 0 a copy
 * one float too long, 1 a memset at an offset, 2 an all-gather whose output
 * holds world - 1 segments, 3 every range exactly fits (clean). */
static void rank_overrun(Dev *d, void *arg) {
    const int mode = *(int *)arg;
    Stream *c = dev_compute_stream(d);
    dev_set_scope(d, 0, "block1", "pre_forward");
    float *src = dev_alloc_f32(d, 17, MEM_TEMP, "src");
    float *dst = dev_alloc_f32(d, 16, MEM_UNSHARDED_PARAM, "block1.w");
    dev_memset_async(c, src, 0, 17 * sizeof(float));
    dev_memcpy_async(c, dst, src, (mode == 0 ? 17 : 16) * sizeof(float));
    dev_memset_async(c, dst + 4, 0, (mode == 1 ? 13 : 12) * sizeof(float));
    const int w = dev_world_size(d);
    float *out = dev_alloc_f32(d, (size_t)(mode == 2 ? w - 1 : w) * 4, MEM_COMM_BUFFER, "block1.all_gather_buffer");
    coll_all_gather(d, src, out, 4, c, "block1");
    dev_synchronize(d);
    dev_free(d, out);
    dev_free(d, dst);
    dev_free(d, src);
}

static int run_mode(const char *kind) {
    int arg = 0;
    WorldConfig c = local_config(1);
    void (*fn)(Dev *, void *) = NULL;
    if (!strcmp(kind, "race_missing_wait")) fn = rank_write_then_read, arg = 0;
    else if (!strcmp(kind, "race_with_wait")) fn = rank_write_then_read, arg = 1;
    else if (!strcmp(kind, "race_record_before_write")) fn = rank_write_then_read, arg = 2;
    else if (!strcmp(kind, "race_stream_sync")) fn = rank_write_then_read, arg = 3;
    else if (!strcmp(kind, "race_event_sync")) fn = rank_write_then_read, arg = 4;
    else if (!strcmp(kind, "race_pretend")) fn = rank_write_then_read, arg = 5;
    else if (!strcmp(kind, "race_off")) fn = rank_write_then_read, arg = 5, c.no_race_check = 1;
    else if (!strcmp(kind, "race_batch")) fn = rank_write_then_read, arg = 6;
    else if (!strcmp(kind, "race_batch_ordered")) fn = rank_write_then_read, arg = 7;
    else if (!strcmp(kind, "race_write_after_read")) fn = rank_write_after_read, arg = 0;
    else if (!strcmp(kind, "race_write_after_read_ordered")) fn = rank_write_after_read, arg = 1;
    else if (!strcmp(kind, "race_use_after_free")) fn = rank_use_after_free;
    else if (!strcmp(kind, "race_collective")) fn = rank_collective, arg = 0, c = local_config(4);
    else if (!strcmp(kind, "free_in_use")) fn = rank_free_in_use, arg = 0, c = local_config(4);
    else if (!strcmp(kind, "free_after_wait")) fn = rank_free_in_use, arg = 1, c = local_config(4);
    else if (!strcmp(kind, "free_recorded")) fn = rank_free_in_use, arg = 2, c = local_config(4);
    else if (!strcmp(kind, "free_own_stream")) fn = rank_free_in_use, arg = 3, c = local_config(4);
    else if (!strcmp(kind, "free_then_wait")) fn = rank_free_in_use, arg = 4, c = local_config(4);
    else if (!strcmp(kind, "free_then_wait_late")) fn = rank_free_in_use, arg = 5, c = local_config(4);
    else if (!strcmp(kind, "free_in_use_unchecked")) fn = rank_free_in_use, arg = 0, c = local_config(4), c.no_race_check = 1;
    else if (!strcmp(kind, "foreign_pool")) fn = rank_foreign_pool, arg = 0;
    else if (!strcmp(kind, "foreign_pool_own")) fn = rank_foreign_pool, arg = 1;
    else if (!strcmp(kind, "foreign_pool_waited")) fn = rank_foreign_pool, arg = 2;
    else if (!strncmp(kind, "overrun_", 8)) fn = rank_overrun, arg = kind[8] - '0', c = local_config(2);
    else if (!strcmp(kind, "race_collective_ordered")) fn = rank_collective, arg = 1, c = local_config(4);
    else if (!strcmp(kind, "timeout_skip")) fn = rank_skip_all_gather, c = local_config(4);
    else if (!strcmp(kind, "timeout_stream")) fn = rank_extra_stream, c = local_config(3);
    else if (!strcmp(kind, "race_host")) fn = rank_host_race;
    else if (!strcmp(kind, "timeout_group")) fn = rank_skip_group_all_gather, c = local_config(4);
    else if (!strcmp(kind, "timeout_event")) fn = rank_stuck_event, c = local_config(2);
    else if (!strcmp(kind, "p2p_mismatch")) fn = rank_p2p, arg = 0, c = local_config(2);
    else if (!strcmp(kind, "timeout_p2p")) fn = rank_p2p, arg = 1, c = local_config(2);
    else if (!strcmp(kind, "p2p_grouped")) fn = rank_p2p, arg = 2, c = local_config(2);
    else if (!strcmp(kind, "race_p2p")) fn = rank_p2p, arg = 3, c = local_config(2);
    else if (!strcmp(kind, "race_p2p_ordered")) fn = rank_p2p, arg = 4, c = local_config(2);
    else {
        fprintf(stderr, "unknown mode %s\n", kind);
        return 1;
    }
    if (!strncmp(kind, "timeout", 7)) c.collective_timeout_s = 1.0;
    run_world(c, fn, &arg);
    return 0;
}

/* ----------------------------------------------------------- unit tests */


#define EXPECT_CLEAN(kind)                                                        \
    do {                                                                          \
        char err_[4096];                                                          \
        int rc_ = check_child(kind, err_, sizeof err_);                                 \
        CHECK(rc_ == 0 && err_[0] == 0, "%s: exit %d, stderr: %s", kind, rc_, err_); \
    } while (0)
#define EXPECT_LINE(kind, line)                                                   \
    do {                                                                          \
        char err_[4096];                                                          \
        int rc_ = check_child(kind, err_, sizeof err_);                                 \
        CHECK(rc_ == 2 && strcmp(err_, line "\n") == 0, "%s: exit %d, stderr:\n%s\nwanted:\n%s", kind, rc_, err_, line); \
    } while (0)

#define MISSING_WAIT                                                                                                   \
    "error: race on rank 0: compute stream's 'block1.matmul' reads 'block1.buffer' (comm_buffer, allocated in "        \
    "block1.pre_forward) at byte offset 1024 as block1 weights written by producer stream's 'block1.copy' with no "    \
    "event wait ordering it (record an event on producer after the write and make compute wait for it)"

TEST(missing_wait_is_reported) { EXPECT_LINE("race_missing_wait", MISSING_WAIT); }
TEST(event_wait_orders) { EXPECT_CLEAN("race_with_wait"); }
TEST(batch_copy_ranges_are_raced) {
    EXPECT_LINE("race_batch",
                "error: race on rank 0: compute stream's 'block1.matmul' reads 'block1.buffer' (comm_buffer, allocated "
                "in block1.pre_forward) at byte offset 1024 as block1 weights written by producer stream's "
                "'block1.copy_out' with no event wait ordering it (record an event on producer after the write and "
                "make compute wait for it)");
    EXPECT_CLEAN("race_batch_ordered");
}
TEST(record_before_write_does_not_order) { EXPECT_LINE("race_record_before_write", MISSING_WAIT); }
TEST(host_syncs_order) {
    EXPECT_CLEAN("race_stream_sync");
    EXPECT_CLEAN("race_event_sync");
}
TEST(off_switch) {
    EXPECT_LINE("race_pretend", MISSING_WAIT); /* the same program, detector on */
    EXPECT_CLEAN("race_off");
}
TEST(write_after_read) {
    EXPECT_LINE("race_write_after_read",
                "error: race on rank 0: writer stream's 'optimizer.memset' writes 'layers.0.wq.weight' (param_shard, "
                "allocated in optimizer.step) while compute stream's 'optimizer.copy' may still read it: no event wait "
                "orders the read before the write (record an event on compute after the read and make writer wait for it)");
    EXPECT_CLEAN("race_write_after_read_ordered");
}
TEST(use_after_free) {
    EXPECT_LINE("race_use_after_free",
                "error: use after free on rank 0: compute stream's 'block2.copy' reads 'block2.all_gather_buffer' "
                "(comm_buffer, allocated in block2.pre_forward, freed in block2.pre_forward) after its dev_free (free "
                "a buffer only after enqueuing the last op that uses it)");
}
#define COLLECTIVE_RACE                                                                                                \
    "error: race on rank 0: compute stream's 'block2.copy' reads 'block2.all_gather_buffer' (comm_buffer, allocated " \
    "in block1.pre_forward) written by all_gather stream's 'block2.all_gather' with no event wait ordering it "       \
    "(record an event on all_gather after the write and make compute wait for it)"
TEST(collective_race_deterministic) {
    /* 4 ranks find the same race at nearly the same time: rank 0 always speaks */
    for (int i = 0; i < 20; i++) EXPECT_LINE("race_collective", COLLECTIVE_RACE);
    EXPECT_CLEAN("race_collective_ordered");
}
#define FREE_IN_USE                                                                                                    \
    "error: free while in use on rank 0: dev_free of 'block2.all_gather_buffer' (comm_buffer, allocated in "          \
    "block2.pre_forward) in block2.pre_forward gave it back to the compute stream's pool while all_gather stream's "  \
    "'block2.all_gather' still writes it; now compute stream's 'block2.memset' writes 'layers.2.w' (unsharded_param, " \
    "allocated in block2.pre_forward), allocated from that pool after the free (so possibly the same memory), with "  \
    "nothing ordering that write before it. Make compute wait for an event recorded on all_gather after that write "  \
    "before it touches blocks of the compute stream's pool again (as FSDP2 makes compute wait for the all-gather's "  \
    "event before the copy-out), keep 'block2.all_gather_buffer' alive until then (as FSDP2's AllGatherState does "   \
    "for an all-gather output), or call dev_record_stream(buf, all_gather stream) before dev_free"
TEST(free_while_in_use_deterministic) {
    /* 4 ranks, decided in host order: the same line on every run */
    for (int i = 0; i < 20; i++) EXPECT_LINE("free_in_use", FREE_IN_USE);
    EXPECT_CLEAN("free_after_wait");
    EXPECT_CLEAN("free_recorded");
    EXPECT_CLEAN("free_own_stream");
    EXPECT_CLEAN("free_then_wait");
    EXPECT_CLEAN("free_then_wait_late");
    EXPECT_CLEAN("free_in_use_unchecked"); /* detector off: the emulator still never crashes */
}
TEST(foreign_pool) {
    EXPECT_LINE("foreign_pool",
                "error: race on rank 0: all_gather stream's 'block3.memset' writes 'block3.all_gather_buffer' "
                "(comm_buffer, allocated in block3.pre_forward), a block of the compute stream's pool, with no event "
                "wait ordering it after the compute work queued before the allocation, which may still use that "
                "memory (a freed block goes to the next allocation on its stream at once). The all_gather stream "
                "fills it: allocate it on that stream (dev_alloc_on(all_gather stream, ...)), or make all_gather "
                "wait for an event recorded on compute after the allocation");
    EXPECT_CLEAN("foreign_pool_own");
    EXPECT_CLEAN("foreign_pool_waited");
}
TEST(overrun_is_named) {
    EXPECT_LINE("overrun_0",
                "error: out of bounds on rank 0: compute stream's 'block1.copy' writes bytes [0, 68) of 'block1.w' "
                "(unsharded_param, allocated in block1.pre_forward), which has 64 bytes: 4 bytes past its end (check "
                "the count or the offset of this op)");
    EXPECT_LINE("overrun_1",
                "error: out of bounds on rank 0: compute stream's 'block1.memset' writes bytes [16, 68) of 'block1.w' "
                "(unsharded_param, allocated in block1.pre_forward), which has 64 bytes: 4 bytes past its end (check "
                "the count or the offset of this op)");
    EXPECT_LINE("overrun_2",
                "error: out of bounds on rank 0: compute stream's 'block1.all_gather' writes bytes [0, 32) of "
                "'block1.all_gather_buffer' (comm_buffer, allocated in block1.pre_forward), which has 16 bytes: 16 "
                "bytes past its end (check the count or the offset of this op)");
    EXPECT_CLEAN("overrun_3");
}
TEST(verdict_is_deterministic) {
    for (int i = 0; i < 20; i++) EXPECT_LINE("race_missing_wait", MISSING_WAIT);
}

int main(int argc, char **argv) {
    if (argc > 2 && strcmp(argv[1], "--mode") == 0) return run_mode(argv[2]);
    check_child_init(argv[0]);
    return check_main(argc, argv);
}
