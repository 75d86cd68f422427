/* test_runtime.c — unit tests of the execution runtime (common/device.h).
 *
 *   ./test_runtime                 every test
 *   ./test_runtime NAME            one test
 *   ./test_runtime --write-artifacts DIR   a small 2-rank run that writes traces and snapshots
 *   ./test_runtime --misuse KIND   a deliberate misuse (tests/test_runtime_misuse.py checks the error)
 *
 * Rank functions run on several threads; TCHECK serializes the harness. White-box
 * checks (deferred frees, trace records, a CPU event's waiters) read the private
 * structs of runtime/internal.h and cpu/cpu_internal.h. */
#include "check.h"
#include "local_world.h"
#include "runtime/runtime.h"
#include "runtime/internal.h"
#include "cpu/cpu_internal.h" /* the CPU backends' CpuStream, CpuEvent */
#include "runtime/util.h"
#include "runtime/profile.h"
#include "model/kernels.h"

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>


static void sleep_ms(double ms) {
    struct timespec ts = {(time_t)(ms / 1000), (long)((ms - (double)(time_t)(ms / 1000) * 1000) * 1e6)};
    nanosleep(&ts, NULL);
}

/* ------------------------------------------------------------- kernels */

typedef struct {
    int *log;
    int *pos;
    int value;
} AppendArgs;
static void k_append(void *p) {
    AppendArgs *a = p;
    a->log[(*a->pos)++] = a->value;
}

typedef struct {
    double ms;
    int *flag; /* set after sleeping (atomic: one test reads it unordered on purpose) */
    int value;
} SleepSetArgs;
static void k_sleep_set(void *p) {
    SleepSetArgs *a = p;
    sleep_ms(a->ms);
    if (a->flag) __atomic_store_n(a->flag, a->value, __ATOMIC_RELAXED);
}

typedef struct {
    int *src;
    int *dst;
} ReadArgs;
static void k_read(void *p) {
    ReadArgs *a = p;
    *a->dst = __atomic_load_n(a->src, __ATOMIC_RELAXED);
}


/* ---------------------------------------------------------------- tests */

static void k_nothing(void *p) { (void)p; }

static void rank_fifo(Dev *d, void *arg) {
    (void)arg;
    enum { N = 2000 };
    int *log = calloc(N, sizeof *log), pos = 0;
    Stream *s = dev_compute_stream(d);
    TCHECK(stream_index(s) == 0 && strcmp(stream_name(s), "compute") == 0, "compute stream is index 0");
    Stream *t = dev_stream_create(d, "side");
    TCHECK(stream_index(t) == 1 && strcmp(stream_name(t), "side") == 0, "second stream is index 1");
    for (int i = 0; i < N; i++) {
        AppendArgs a = {log, &pos, i};
        dev_launch(s, "append", TEST_COST, k_append, &a, sizeof a);
    }
    dev_stream_synchronize(s);
    int ok = pos == N;
    for (int i = 0; i < N && ok; i++) ok = log[i] == i;
    TCHECK(ok, "ops ran in FIFO order (pos %d)", pos);
    free(log);
}
TEST(stream_fifo) { run_world(local_config(1), rank_fifo, NULL); }

static void rank_event_wait(Dev *d, void *arg) {
    (void)arg;
    Stream *a = dev_compute_stream(d), *b = dev_stream_create(d, "b"), *c = dev_stream_create(d, "c");
    Event *e = dev_event_create(d, "a_done");
    Gate gate = GATE_INIT, *gp = &gate;
    int x = 0;
    int seen_b = -1, seen_c = -1;
    SleepSetArgs set = {1, &x, 1};
    dev_launch(a, "gate", TEST_COST, k_gate_wait, &gp, sizeof gp); /* a's write waits for the host */
    dev_launch(a, "write", LONG_COST, k_sleep_set, &set, sizeof set); /* b's wait stalls on the modelled clock */
    dev_event_record(e, a);
    dev_stream_wait_event(b, e);
    ReadArgs rb = {&x, &seen_b};
    dev_launch(b, "read_after_wait", TEST_COST, k_read, &rb, sizeof rb);
    ReadArgs rc = {&x, &seen_c};
    dev_launch(c, "read_no_wait", TEST_COST, k_read, &rc, sizeof rc);
    dev_stream_synchronize(c); /* c does not wait: it finishes while a is held at the gate */
    TCHECK(seen_c == 0, "without a wait, stream c runs before a's write (saw %d)", seen_c);
    for (int blocked = 0; !blocked; sched_yield()) { /* b's worker is inside the wait before a may go on */
        pthread_mutex_lock(&cpu_event(e)->mu);
        blocked = cpu_event(e)->waiting > 0;
        pthread_mutex_unlock(&cpu_event(e)->mu);
    }
    gate_open(&gate);
    dev_stream_synchronize(b);
    TCHECK(seen_b == 1, "after the wait, stream b sees a's write (saw %d)", seen_b);
    /* the wait is traced as a "wait" slice on b */
    pthread_mutex_lock(&d->trace.mu);
    int found = 0;
    for (size_t i = 0; i < d->trace.n; i++)
        if (strcmp(d->trace.recs[i].cat, "wait") == 0 && strcmp(d->trace.recs[i].name, "wait:a_done") == 0 && d->trace.recs[i].stream == 1)
            found = 1;
    pthread_mutex_unlock(&d->trace.mu);
    TCHECK(found, "wait slice recorded on stream b");
    dev_event_destroy(e);
}
TEST(event_wait_across_streams) {
    run_world(traced(local_config(1)), rank_event_wait, NULL);
}

/* A wait refers to the record made before it, not to later ones (on the
 * modelled clock: b's work ends long before record #2, which follows a
 * kernel of 1 ms; dev_event_query answers on that clock). */
static void rank_wait_uses_earlier_record(Dev *d, void *arg) {
    (void)arg;
    Stream *a = dev_compute_stream(d), *b = dev_stream_create(d, "b");
    Event *e = dev_event_create(d, "e"), *b_done = dev_event_create(d, "b_done");
    int slow_ran = 0;
    dev_event_record(e, a); /* record #1: completes at once */
    dev_stream_wait_event(b, e);
    SleepSetArgs set = {0, &slow_ran, 1};
    dev_launch(a, "slow", LONG_COST, k_sleep_set, &set, sizeof set);
    dev_event_record(e, a); /* record #2: 1 ms later on the modelled clock; must not hold b */
    dev_event_record(b_done, b);
    TCHECK(dev_event_query(b_done) == 1, "b waited for record #1 only (its end is past already)");
    TCHECK(dev_event_query(e) == 0, "record #2 not reached by the host's modelled time");
    dev_event_synchronize(e);
    TCHECK(dev_event_query(e) == 1 && __atomic_load_n(&slow_ran, __ATOMIC_RELAXED) == 1,
           "record #2 reached after event sync, after the op before it");
    TCHECK(dev_host_time_us(d) >= 1000.0, "the event sync moved the host past the 1 ms kernel (%.1f us)",
           dev_host_time_us(d));
    dev_event_destroy(b_done);
    dev_event_destroy(e);
}
TEST(wait_uses_record_before_it) { run_world(local_config(1), rank_wait_uses_earlier_record, NULL); }

static void rank_host_sync(Dev *d, void *arg) {
    (void)arg;
    Stream *s[3] = {dev_compute_stream(d), dev_stream_create(d, "s1"), dev_stream_create(d, "s2")};
    int flags[3] = {0, 0, 0};
    for (int i = 0; i < 3; i++) {
        SleepSetArgs a = {20.0 + 10 * i, &flags[i], i + 1};
        dev_launch(s[i], "sleep_set", TEST_COST, k_sleep_set, &a, sizeof a);
    }
    dev_stream_synchronize(s[0]);
    TCHECK(flags[0] == 1, "stream sync waited for its op");
    dev_synchronize(d);
    TCHECK(flags[1] == 2 && flags[2] == 3, "dev_synchronize waited for every stream");
    /* event query / sync */
    Event *e = dev_event_create(d, "q");
    int f = 0;
    SleepSetArgs a = {40, &f, 7};
    dev_launch(s[1], "sleep_set", LONG_COST, k_sleep_set, &a, sizeof a);
    dev_event_record(e, s[1]);
    TCHECK(dev_event_query(e) == 0, "query before completion (on the modelled clock) is 0");
    dev_event_synchronize(e);
    TCHECK(f == 7 && dev_event_query(e) == 1, "event sync waited; query is 1");
    /* destroying an event with a queued record is safe */
    dev_launch(s[2], "sleep_set", TEST_COST, k_sleep_set, &a, sizeof a);
    Event *g = dev_event_create(d, "g");
    dev_event_record(g, s[2]);
    dev_stream_wait_event(s[0], g);
    dev_event_destroy(g);
    dev_synchronize(d);
    dev_event_destroy(e);
}
TEST(host_sync_and_query) { run_world(local_config(1), rank_host_sync, NULL); }

static void rank_alloc_counts(Dev *d, void *arg) {
    (void)arg;
    Stream *s = dev_compute_stream(d);
    SleepSetArgs busy = {30, NULL, 0};
    dev_launch(s, "busy", TEST_COST, k_sleep_set, &busy, sizeof busy); /* counts follow host order even while busy */
    TCHECK(dev_mem_current(d) == 0 && dev_mem_peak(d) == 0, "starts empty");
    void *a = dev_alloc(d, 1000, MEM_PARAM_SHARD, "a");
    float *b = dev_alloc_f32(d, 100, MEM_ACTIVATION, "b");
    void *c = dev_alloc(d, 24, MEM_ACTIVATION, "c");
    TCHECK(((uintptr_t)a % 64) == 0 && ((uintptr_t)b % 64) == 0 && ((uintptr_t)c % 64) == 0, "64-byte aligned");
    TCHECK(dev_mem_current(d) == 1424, "current %zu", dev_mem_current(d));
    TCHECK(dev_mem_current_by_tag(d, MEM_PARAM_SHARD) == 1000, "param_shard");
    TCHECK(dev_mem_current_by_tag(d, MEM_ACTIVATION) == 424, "activation %zu", dev_mem_current_by_tag(d, MEM_ACTIVATION));
    dev_free(d, b);
    TCHECK(dev_mem_current(d) == 1024 && dev_mem_peak(d) == 1424, "free counts at once: %zu / %zu", dev_mem_current(d),
           dev_mem_peak(d));
    TCHECK(dev_mem_current_by_tag(d, MEM_ACTIVATION) == 24, "activation after free");
    dev_mem_reset_peak(d);
    TCHECK(dev_mem_peak(d) == 1024, "peak reset to current");
    void *e = dev_alloc(d, 5000, MEM_TEMP, "e");
    dev_free(d, e);
    TCHECK(dev_mem_peak(d) == 6024 && dev_mem_current(d) == 1024, "new peak %zu", dev_mem_peak(d));
    void *z1 = dev_alloc(d, 0, MEM_TEMP, "z1"), *z2 = dev_alloc(d, 0, MEM_TEMP, "z2");
    TCHECK(z1 && z2 && z1 != z2, "0-byte allocations are unique and non-NULL");
    dev_free(d, z1);
    dev_free(d, z2);
    dev_free(d, NULL);
    dev_free(d, a);
    dev_free(d, c);
    TCHECK(dev_mem_current(d) == 0, "all freed");
    for (int t = 0; t < MEM_TAG_COUNT; t++) TCHECK(dev_mem_current_by_tag(d, (MemTag)t) == 0, "tag %d empty", t);
    TCHECK(strcmp(mem_tag_name(MEM_UNSHARDED_PARAM), "unsharded_param") == 0 && strcmp(mem_tag_name(MEM_TEMP), "temp") == 0,
           "tag names");
    /* the memory log holds every alloc/free in host order with a running total */
    size_t cur = 0;
    uint64_t last_seq = 0;
    int ok = 1;
    for (size_t i = 0; i < d->mem.n_mev; i++) {
        const MemEvent *m = &d->mem.mev[i];
        ok &= m->seq > last_seq;
        last_seq = m->seq;
        if (m->kind == MEV_ALLOC) cur += m->size;
        if (m->kind == MEV_FREE || m->kind == MEV_FREE_COMPLETED) cur -= m->size;
        ok &= m->current_bytes == cur;
    }
    TCHECK(ok, "memory log replays to the counts");
}
TEST(allocator_counts) { run_world(local_config(1), rank_alloc_counts, NULL); }

/* The CPU emulator's storage (the C heap, shared by every stream) goes back
 * only once every stream is past the free, even when the detector is off and
 * the program frees a buffer another stream still reads: the counts follow
 * the caching allocator (uncounted at the call), the emulator never crashes. */
static void rank_storage_waits(Dev *d, void *arg) {
    (void)arg;
    Stream *side = dev_stream_create(d, "side");
    float *buf = dev_alloc_f32(d, 1024, MEM_COMM_BUFFER, "buf");
    for (int i = 0; i < 1024; i++) buf[i] = 42.0f;
    float seen = 0;
    Gate gate = GATE_INIT, *gp = &gate;
    dev_launch(side, "gate", TEST_COST, k_gate_wait, &gp, sizeof gp);
    dev_memcpy_async(side, &seen, buf, sizeof seen);
    uint64_t deferred0 = d->mem.frees_deferred, released0 = d->mem.frees_released;
    dev_free(d, buf);
    TCHECK(dev_mem_current(d) == 0, "free counted at once");
    TCHECK(d->mem.frees_deferred == deferred0 + 1, "storage release deferred");
    TCHECK(d->mem.frees_released == released0, "storage not released while the side stream is held");
    TCHECK(dev_mem_live_size_containing(d, buf) == 0, "no longer live");
    /* new allocations (poisoned) must not take buf's storage yet */
    int reused = 0;
    void *fresh[16];
    for (int i = 0; i < 16; i++) {
        fresh[i] = dev_alloc(d, 4096, MEM_TEMP, "fresh");
        reused |= fresh[i] == (void *)buf;
    }
    TCHECK(!reused, "storage reused while a stream may still read it");
    TCHECK(d->mem.frees_released == released0, "still not released");
    gate_open(&gate);
    dev_synchronize(d);
    TCHECK(seen == 42.0f, "the op read intact data (%g)", seen);
    dev_release_pending_frees(d, 0);
    TCHECK(d->mem.frees_released == released0 + 1, "released after the stream finished");
    for (int i = 0; i < 16; i++) dev_free(d, fresh[i]);
    /* a free with idle streams is released at once */
    void *q = dev_alloc(d, 10, MEM_TEMP, "q");
    uint64_t r1 = d->mem.frees_released;
    dev_free(d, q);
    TCHECK(d->mem.frees_released == r1 + 1, "idle free released at once");
}
TEST(emulator_storage_waits_for_every_stream) {
    WorldConfig c = local_config(1);
    c.poison = 1;
    c.no_race_check = 1; /* the program is wrong on purpose (a cross-stream free) */
    run_world(c, rank_storage_waits, NULL);
}

/* The caching allocator's rules, as counted and logged: a plain free of a
 * block its own stream still reads completes at once (the block is back in
 * its stream's pool); a dev_record_stream block stays counted
 * ("free_requested") until the recorded stream got past the free. */
static int last_mev(Dev *d, MemEventKind kind, const void *p) {
    for (size_t i = d->mem.n_mev; i-- > 0;)
        if (d->mem.mev[i].kind == kind && d->mem.mev[i].addr == (uintptr_t)p) return (int)i;
    return -1;
}

static void rank_pool_rules(Dev *d, void *arg) {
    const char *dir = arg;
    Stream *c = dev_compute_stream(d), *side = dev_stream_create(d, "side");
    Gate g1 = GATE_INIT, *p1 = &g1;
    float host = 0;
    /* same stream: held by queued work on its own stream, still complete at the call */
    float *a = dev_alloc_f32(d, 256, MEM_TEMP, "a");
    dev_memset_async(c, a, 0, 256 * sizeof(float));
    dev_launch(c, "gate", TEST_COST, k_gate_wait, &p1, sizeof p1);
    dev_memcpy_async(c, &host, a, sizeof host);
    dev_free(d, a);
    TCHECK(dev_mem_current(d) == 0, "same-stream free uncounted at once");
    int fa = last_mev(d, MEV_FREE, a);
    TCHECK(fa >= 0 && last_mev(d, MEV_FREE_REQUESTED, a) < 0 && d->mem.n_held == 0,
           "a plain free completes at the call (the block is back in compute's pool)");
    TCHECK(d->mem.mev[fa].current_bytes == 0, "logged with the count after the free");
    gate_open(&g1);
    dev_synchronize(d);
    /* another stream, recorded: held and counted until that stream is past the free, on the
     * modelled clock (side's 1 ms kernel ends long after the host's next allocator call) */
    float *b = dev_alloc_f32(d, 512, MEM_COMM_BUFFER, "b");
    dev_memset_async(c, b, 0, 512 * sizeof(float));
    Event *e = dev_event_create(d, "filled");
    dev_event_record(e, c);
    dev_stream_wait_event(side, e);
    dev_launch(side, "slow", LONG_COST, k_nothing, NULL, 0);
    dev_memcpy_async(side, &host, b, sizeof host);
    dev_record_stream(b, side);
    dev_free(d, b);
    TCHECK(dev_mem_current(d) == 512 * sizeof(float), "a recorded block stays counted (%zu)", dev_mem_current(d));
    TCHECK(dev_mem_current_by_tag(d, MEM_COMM_BUFFER) == 512 * sizeof(float), "and in its tag");
    TCHECK(d->mem.n_held == 1 && last_mev(d, MEV_FREE_REQUESTED, b) >= 0 && last_mev(d, MEV_FREE, b) < 0,
           "free requested, not completed");
    float *x = dev_alloc_f32(d, 8, MEM_TEMP, "x"); /* an allocator call before side got there: still pending */
    TCHECK(d->mem.n_held == 1 && dev_mem_current(d) == (512 + 8) * sizeof(float), "pending while side is busy");
    /* the snapshot (after a sync, before any allocator call) still shows it as active_pending_free:
     * pending frees are completed by dev_alloc / dev_free, as PyTorch's allocator processes its events */
    dev_write_artifacts(d, dir);
    TCHECK(d->mem.n_held == 1, "still pending until the next allocator call");
    dev_free(d, x); /* the next allocator call completes it */
    TCHECK(d->mem.n_held == 0 && dev_mem_current(d) == 0, "completed once side got there (%zu)", dev_mem_current(d));
    int fc = last_mev(d, MEV_FREE_COMPLETED, b);
    TCHECK(fc >= 0 && fc < last_mev(d, MEV_FREE, x) && d->mem.mev[fc].current_bytes == 8 * sizeof(float),
           "free_completed logged before x's free, with b uncounted");
    /* recording the owner stream itself is a no-op: its own work is ordered */
    float *y = dev_alloc_f32(d, 4, MEM_TEMP, "y");
    dev_record_stream(y, c);
    dev_free(d, y);
    TCHECK(d->mem.n_held == 0 && dev_mem_current(d) == 0, "recording the owner holds nothing");
    dev_synchronize(d);
    dev_event_destroy(e);
}
TEST(pool_rules_and_record_stream) {
    char dir[] = "/tmp/hwfsdp_pool_XXXXXX";
    TCHECK(mkdtemp(dir) != NULL, "temp dir");
    run_world(local_config(1), rank_pool_rules, dir);
    char path[256], *text;
    size_t n = 0;
    snprintf(path, sizeof path, "%s/memory_rank0.pickle", dir);
    text = read_file_all(path, &n);
    TCHECK(memmem(text, n, "active_pending_free", 19) != NULL, "snapshot segment state active_pending_free");
    free(text);
    snprintf(path, sizeof path, "%s/memory_rank0.json", dir);
    text = read_file_all(path, &n);
    TCHECK(memmem(text, n, "\"action\":\"free_requested\"", 25) != NULL, "memory JSON: free_requested");
    TCHECK(memmem(text, n, "\"stream\":\"side\"", 15) == NULL && memmem(text, n, "\"stream\":\"compute\"", 18) != NULL,
           "memory JSON: every block here belongs to compute");
    free(text);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    TCHECK(system(cmd) == 0, "cleanup");
}

static void rank_containing(Dev *d, void *arg) {
    (void)arg;
    enum { N = 3000 };
    char **p = malloc(N * sizeof *p);
    size_t *sz = malloc(N * sizeof *sz);
    for (int i = 0; i < N; i++) {
        sz[i] = 1 + (size_t)(i * 37 % 500);
        p[i] = dev_alloc(d, sz[i], (MemTag)(i % MEM_TAG_COUNT), "x");
    }
    int ok = 1;
    for (int i = 0; i < N; i++) {
        ok &= dev_mem_live_size_containing(d, p[i]) == sz[i];
        ok &= dev_mem_live_size_containing(d, p[i] + sz[i] - 1) == sz[i];
        ok &= dev_mem_live_size_containing(d, p[i] + sz[i] / 2) == sz[i];
    }
    TCHECK(ok, "start, middle and last byte found");
    int local = 0;
    TCHECK(dev_mem_live_size_containing(d, &local) == 0, "stack address is not an allocation");
    for (int i = 0; i < N; i += 2) dev_free(d, p[i]);
    ok = 1;
    for (int i = 0; i < N; i++) ok &= dev_mem_live_size_containing(d, p[i]) == (i % 2 ? sz[i] : 0);
    TCHECK(ok, "freed allocations are not found, live ones are");
    for (int i = 1; i < N; i += 2) dev_free(d, p[i]);
    TCHECK(dev_mem_current(d) == 0 && d->mem.n_live == 0, "empty");
    /* tens of thousands of allocations with thousands live (the speed is the bench's business) */
    ok = 1;
    for (int round = 0; round < 20; round++) {
        for (int i = 0; i < N; i++) p[i] = dev_alloc(d, 256, MEM_ACTIVATION, "act");
        for (int i = 0; i < N; i++) ok &= dev_mem_live_size_containing(d, p[(i * 7) % N] + 100) == 256;
        for (int i = N - 1; i >= 0; i--) dev_free(d, p[i]);
    }
    TCHECK(ok && dev_mem_current(d) == 0 && d->mem.n_live == 0, "20 rounds of 3000 allocations found and freed");
    free(p);
    free(sz);
}
TEST(live_size_containing) { run_world(local_config(1), rank_containing, NULL); }

static void rank_poison(Dev *d, void *arg) {
    (void)arg;
    float *f = dev_alloc_f32(d, 1000, MEM_TEMP, "p");
    int ok = 1;
    for (int i = 0; i < 1000; i++) {
        uint32_t bits;
        memcpy(&bits, &f[i], 4);
        ok &= isnan(f[i]) && bits == 0x7fc00000u;
    }
    TCHECK(ok, "fresh memory is NaN");
    dev_free(d, f);
}
TEST(poison_nan) {
    run_world(poisoned(local_config(2)), rank_poison, NULL);
}

static void rank_host_exchange(Dev *d, void *arg) {
    (void)arg;
    int n = dev_world_size(d);
    for (int round = 0; round < 50; round++) {
        double out[WORLD_MAX_RANKS];
        dev_host_allgather_f64(d, dev_rank(d) * 1.5 + round, out);
        int ok = 1;
        for (int r = 0; r < n; r++) ok &= out[r] == r * 1.5 + round;
        TCHECK(ok, "host allgather round %d", round);
    }
    dev_host_barrier(d);
}
TEST(host_allgather) { run_world(local_config(4), rank_host_exchange, NULL); }

/* ----------------------------------------------------------- collectives */

#define COLL_CHECK TCHECK
#include "coll_check.h"

/* The table of kinds (coll_common.c): a row for every CollKind, rows that make
 * sense, and every kind running on 1..4 ranks with buffers of exactly its
 * row's sizes, out of place and in its in-place form, without a message (what
 * each computes is coll_check.h's part). A new kind meets this test with its row. */
static void rank_every_kind(Dev *d, void *arg) {
    (void)arg;
    ProcessGroup *g = dev_world_group(d);
    Stream *s = dev_compute_stream(d);
    const int n = pg_size(g), me = pg_rank(g);
    const size_t cnt = 5;
    for (int kind = 0; kind < COLL_KIND_COUNT; kind++) {
        const CollKindInfo *k = coll_kind(kind);
        if (k->p2p) continue; /* its buffers are its items' (exercise_p2p) */
        const size_t ns = coll_buf_elems(k->send, cnt, n), nr = coll_buf_elems(k->recv, cnt, n);
        const size_t nbig = ns > nr ? ns : nr;
        for (int inplace = 0; inplace < 2; inplace++) {
            if (inplace && k->in_place == COLL_INPLACE_NONE) continue;
            float *a = nbig ? dev_alloc_f32(d, nbig, MEM_COMM_BUFFER, "a") : NULL, *b = NULL;
            float *send = a, *recv = a;
            if (!inplace) {
                b = nr ? dev_alloc_f32(d, nr, MEM_COMM_BUFFER, "b") : NULL;
                recv = b;
                if (nr) memset(b, 0, nr * sizeof(float));
            } else if (k->in_place == COLL_INPLACE_OWN_BLOCK) {
                if (k->recv == COLL_BUF_PER_RANK) send = a + (size_t)me * cnt;
                else recv = a + (size_t)me * cnt;
            }
            if (!ns) send = NULL;
            if (!nr) recv = NULL;
            for (size_t i = 0; i < nbig; i++) a[i] = (float)(me + 1) + (float)i;
            coll_enqueue(g, s, (CollKind)kind, send, recv, cnt, RED_SUM, k->rooted ? n - 1 : 0, DTYPE_F32, k->name);
            dev_stream_synchronize(s);
            if (a) dev_free(d, a);
            if (b) dev_free(d, b);
        }
    }
}
TEST(collective_kind_table) {
    for (int kind = 0; kind < COLL_KIND_COUNT; kind++) {
        const CollKindInfo *k = coll_kind(kind);
        CHECK(k && k->name && *k->name, "kind %d has no row (or no name)", kind);
        if (!k || !k->name) continue;
        CHECK(!strcmp(coll_kind_name(kind), k->name), "coll_kind_name(%d) = %s", kind, coll_kind_name(kind));
        for (int other = 0; other < kind; other++)
            CHECK(strcmp(coll_kind_name(other), k->name), "kinds %d and %d are both %s", other, kind, k->name);
        CHECK(k->link_passes >= 1, "%s: %d ring passes", k->name, k->link_passes);
        if (k->in_place == COLL_INPLACE_OWN_BLOCK)
            CHECK((k->send == COLL_BUF_COUNT && k->recv == COLL_BUF_PER_RANK) ||
                      (k->send == COLL_BUF_PER_RANK && k->recv == COLL_BUF_COUNT),
                  "%s: in place as a rank's block needs a block and a per-rank buffer", k->name);
        if (k->in_place == COLL_INPLACE_SAME)
            CHECK(k->send == COLL_BUF_NONE || k->send == k->recv, "%s: in place as one buffer needs equal sizes", k->name);
        if (k->send == COLL_BUF_NONE && k->recv == COLL_BUF_NONE && !k->p2p)
            CHECK(k->link_share == COLL_LINK_LATENCY_ONLY, "%s moves no bytes but its link share is not latency only",
                  k->name);
    }
    CHECK(!coll_kind(COLL_KIND_COUNT) && !coll_kind(-1), "a kind past the table");
    CHECK(!strcmp(coll_kind_name(COLL_KIND_COUNT), "?") && !strcmp(coll_kind_name(-1), "?"), "name of a non-kind");
    for (int n = 1; n <= 4 && !check_failed_in_test; n++) { /* (a broken row would crash it) */
        run_world(poisoned(local_config(n)), rank_every_kind, NULL);
    }
}

/* Rank-order sums differ from other orders: make sure the test would notice. */
TEST(rank_order_matters) {
    int differs = 0;
    for (size_t i = 0; i < 1000 && !differs; i++) {
        float fwd = reduce_expected(5, i, 3, RED_SUM);
        float rev = input(4, i, 3);
        for (int r = 3; r >= 0; r--) rev += input(r, i, 3);
        differs = memcmp(&fwd, &rev, 4) != 0;
    }
    CHECK(differs, "inputs are too tame to detect a wrong summation order");
}

static void rank_collectives(Dev *d, void *arg) {
    (void)arg;
    Stream *t = dev_stream_create(d, "ag");
    exercise_collectives(d, t);
    exercise_groups(d, t, 7);
    exercise_groups(d, t, 1000);
    exercise_p2p(d, t);
}
TEST(collectives_world_1_to_5) {
    for (int n = 1; n <= 5; n++) {
        run_world(poisoned(local_config(n)), rank_collectives, NULL);
    }
}

/* dev_watch_collectives: each collective reported once, as issued, with its
 * kind, label, scope and stream; none once the watcher is removed. */
typedef struct {
    int n;
    CollIssue seen[4];
} Watched;
static void record_issue(void *ctx, const CollIssue *c) {
    Watched *w = ctx;
    if (w->n < 4) w->seen[w->n] = *c;
    w->n++;
}
static void rank_watch(Dev *d, void *arg) {
    (void)arg;
    Stream *ag = dev_stream_create(d, "ag"), *cs = dev_compute_stream(d);
    float *x = dev_alloc_f32(d, 8, MEM_TEMP, "x");
    dev_memset_async(cs, x, 0, 8 * sizeof(float));
    dev_stream_synchronize(cs);
    Watched w = {0};
    coll_all_reduce(d, x, x, 8, RED_SUM, cs, "before"); /* not watched yet */
    dev_stream_synchronize(cs);
    dev_watch_collectives(d, record_issue, &w);
    dev_set_scope(d, 3, "block1", "post_backward");
    dev_set_microbatch(d, 1);
    coll_all_gather(d, x + 2 * dev_rank(d), x, 2, ag, "block0");
    Event *gathered = dev_event_create(d, "gathered");
    dev_event_record(gathered, ag);
    dev_stream_wait_event(cs, gathered);
    dev_set_scope(d, 3, "head", "pre_backward");
    dev_set_microbatch(d, -1);
    coll_reduce_scatter(d, x, x + 2 * dev_rank(d), 2, RED_SUM, cs, NULL);
    dev_watch_collectives(d, NULL, NULL);
    coll_all_reduce(d, x, x, 8, RED_SUM, cs, "after"); /* not watched any more */
    dev_synchronize(d);
    dev_event_destroy(gathered);
    TCHECK(w.n == 2, "rank %d: %d collectives reported, expected the 2 issued while watched", dev_rank(d), w.n);
    if (w.n == 2) {
        const CollIssue *a = &w.seen[0], *b = &w.seen[1];
        TCHECK(a->kind == COLL_ALL_GATHER && !strcmp(a->kind_name, "all_gather") && !strcmp(a->label, "block0") && !strcmp(a->module, "block1") &&
                   !strcmp(a->phase, "post_backward") && a->step == 3 && a->micro == 1 &&
                   a->stream == stream_index(ag) && !strcmp(a->stream_name, "ag"),
               "all-gather reported as %s %s in %s.%s step %d micro %d on %s", a->kind_name, a->label, a->module, a->phase,
               a->step, a->micro, a->stream_name);
        TCHECK(b->kind == COLL_REDUCE_SCATTER && !strcmp(b->kind_name, "reduce_scatter") && !strcmp(b->label, "") && !strcmp(b->module, "head") &&
                   !strcmp(b->phase, "pre_backward") && b->micro == -1 && b->stream == 0 &&
                   !strcmp(b->stream_name, "compute"),
               "reduce-scatter reported as %s '%s' in %s.%s micro %d on %s", b->kind_name, b->label, b->module, b->phase,
               b->micro, b->stream_name);
    }
    dev_free(d, x);
}
TEST(watch_collectives) { run_world(local_config(2), rank_watch, NULL); }

typedef struct {
    size_t send_count;
    double elapsed_us;
    double trace_dur_us;
} LinkArgs;

static void rank_link(Dev *d, void *arg) {
    LinkArgs *la = arg;
    const int n = dev_world_size(d);
    float *send = dev_alloc_f32(d, la->send_count, MEM_COMM_BUFFER, "send");
    float *recv = dev_alloc_f32(d, la->send_count * (size_t)n, MEM_COMM_BUFFER, "recv");
    memset(send, 0, la->send_count * sizeof(float));
    Stream *s = dev_compute_stream(d);
    coll_barrier(d, s, "warmup");
    dev_synchronize(d);
    dev_host_barrier(d);
    double t0 = now_us();
    coll_all_gather(d, send, recv, la->send_count, s, "link");
    dev_synchronize(d);
    double el = now_us() - t0;
    if (dev_rank(d) == 0) {
        la->elapsed_us = el;
        pthread_mutex_lock(&d->trace.mu);
        for (size_t i = 0; i < d->trace.n; i++)
            if (strcmp(d->trace.recs[i].cat, "collective") == 0 && strcmp(d->trace.recs[i].prefix, "link") == 0)
                la->trace_dur_us = d->trace.recs[i].dur;
        pthread_mutex_unlock(&d->trace.mu);
    }
    dev_free(d, send);
    dev_free(d, recv);
}

/* The link model by hand: an all-gather of 10 MB over a ring of 4 at 1 Gbit/s,
 * 100 us per hop, lasts (n-1)/n of its bytes at the link's rate plus n-1 hops
 * on the modelled clock, exactly, whatever the machine does meanwhile. */
TEST(link_model_timing) {
    const int n = 4;
    WorldConfig c = local_config(n);
    c.link_gbps = 1.0;
    c.link_latency_us = 100;
    c.trace = 1;
    LinkArgs la = {625000, 0, 0}; /* output S = 10 MB */
    run_world(c, rank_link, &la);
    double S = (double)la.send_count * n * 4;
    double model = (double)(n - 1) / n * S / (1e9 / 8) * 1e6 + (n - 1) * 100.0; /* 60,300 us */
    CHECK(fabs(la.trace_dur_us - model) < 1e-6 * model, "traced duration %.3f us, the link model's %.3f us",
          la.trace_dur_us, model);
    printf("  link model: %.1f ms modelled (%.1f ms of wall time)\n", la.trace_dur_us / 1000, la.elapsed_us / 1000);
}

/* A group whose ranks span nodes runs at the inter-node link; one inside a node at the fast one. */
typedef struct {
    double dur_inside, dur_across; /* traced durations of rank 0's two all-gathers */
} NodeArgs;

static void rank_nodes(Dev *d, void *arg) {
    NodeArgs *na = arg;
    DeviceMesh m; /* 2x2, rows on nodes: shard groups inside a node, replicate groups across */
    dev_mesh_build(d, &m, 2, 2);
    const size_t cnt = 125000; /* 2 x 0.5 MB gathered */
    float *buf = dev_alloc_f32(d, 2 * cnt, MEM_COMM_BUFFER, "buf");
    memset(buf, 0, 2 * cnt * sizeof(float));
    Stream *s = dev_compute_stream(d);
    /* in place: each rank's block is already at its place in the gathered buffer */
    pg_all_gather(m.shard_group, buf + (size_t)pg_rank(m.shard_group) * cnt, buf, cnt, s, "inside");
    pg_all_gather(m.replicate_group, buf + (size_t)pg_rank(m.replicate_group) * cnt, buf, cnt, s, "across");
    dev_synchronize(d);
    if (dev_rank(d) == 0) {
        pthread_mutex_lock(&d->trace.mu);
        for (size_t i = 0; i < d->trace.n; i++) {
            const TraceRec *r = &d->trace.recs[i];
            if (strcmp(r->cat, "collective")) continue;
            if (!strcmp(r->prefix, "inside")) na->dur_inside = r->dur;
            if (!strcmp(r->prefix, "across")) na->dur_across = r->dur;
        }
        pthread_mutex_unlock(&d->trace.mu);
    }
    dev_free(d, buf);
}

TEST(inter_node_link_model) {
    WorldConfig c = local_config(4);
    c.trace = 1;
    c.link_gbps = 1000;       /* inside a node: 1 MB in 8 us */
    c.inter_link_gbps = 0.1;  /* across nodes: 1 MB in 80 ms */
    c.inter_link_latency_us = 1000;
    c.ranks_per_node = 2;
    NodeArgs na = {0, 0};
    run_world(c, rank_nodes, &na);
    double across = 0.5 * 1e6 / (0.1e9 / 8) * 1e6 + 1000; /* ring of 2: half the 1 MB, one hop */
    double inside = 0.5 * 1e6 / (1000e9 / 8) * 1e6;      /* no latency inside a node (local_config's 0) */
    CHECK(fabs(na.dur_across - across) < 1e-6 * across,
          "the replicate group's all-gather took %.3f us, the inter-node model %.3f us", na.dur_across, across);
    CHECK(fabs(na.dur_inside - inside) < 1e-6 * inside, "inside a node %.3f us, the model %.3f us", na.dur_inside,
          inside);
}

/* Pinned host memory: its own pool and counts, h2d / d2h copies (named and timed by the PCIe model), the
 * race detector on it, and a free while a stream still reads it (deferred, not a race). */
static void rank_host_memory(Dev *d, void *arg) {
    (void)arg;
    Stream *s = dev_compute_stream(d), *copy = dev_stream_create(d, "copy");
    size_t dev0 = dev_mem_current(d);
    const size_t n = 250000; /* 1 MB */
    float *h = dev_alloc_host_f32(d, n, MEM_PARAM_SHARD, "host_shard");
    TCHECK(dev_mem_current(d) == dev0, "a host allocation counted as device memory");
    TCHECK(dev_mem_host_current(d) == n * 4 && dev_mem_host_peak(d) == n * 4, "host counts %zu / %zu",
           dev_mem_host_current(d), dev_mem_host_peak(d));
    TCHECK(dev_mem_host_current_by_tag(d, MEM_PARAM_SHARD) == n * 4, "host bytes by tag");
    TCHECK(dev_mem_current_by_tag(d, MEM_PARAM_SHARD) == 0, "device bytes by tag");
    uint32_t bits;
    memcpy(&bits, &h[n / 2], 4);
    TCHECK(bits == 0x7fc00000u, "fresh host memory is not NaN-filled");
    for (size_t i = 0; i < n; i++) h[i] = (float)i;
    float *dv = dev_alloc_f32(d, n, MEM_UNSHARDED_PARAM, "device_copy");
    float *back = dev_alloc_host_f32(d, n, MEM_GRAD_SHARD, "host_back");
    dev_set_scope(d, 0, "block0", "pre_forward");
    dev_memcpy_async(copy, dv, h, n * 4);
    dev_memcpy_async(copy, back, dv, n * 4);
    dev_stream_synchronize(copy);
    int same = 1;
    for (size_t i = 0; i < n; i++) same &= back[i] == (float)i;
    TCHECK(same, "h2d then d2h changed the data");
    int h2d = 0, d2h = 0;
    double model = 200.0 + 1e6 / 1e9 * 1e6; /* latency + 1 MB at 1 GB/s */
    pthread_mutex_lock(&d->trace.mu);
    for (size_t i = 0; i < d->trace.n; i++) {
        const TraceRec *r = &d->trace.recs[i];
        if (!strcmp(r->cat, "copy") && !strcmp(r->name, "h2d") && r->bytes == n * 4) h2d = fabs(r->dur - model) < 1e-6;
        if (!strcmp(r->cat, "copy") && !strcmp(r->name, "d2h") && r->bytes == n * 4) d2h = fabs(r->dur - model) < 1e-6;
    }
    pthread_mutex_unlock(&d->trace.mu);
    TCHECK(h2d && d2h, "trace: h2d %d d2h %d (named, and lasting the PCIe model's %.0f us)", h2d, d2h, model);
    dev_free(d, back);
    dev_free(d, dv);
    /* a stream still copying out of a host block when the host frees it: no race (the pool waits) */
    float *dv2 = dev_alloc_f32_on(copy, n, MEM_TEMP, "device_copy2");
    dev_memcpy_async(copy, dv2, h, n * 4);
    dev_free(d, h);
    TCHECK(dev_mem_host_current(d) == 0, "host bytes after the frees: %zu", dev_mem_host_current(d));
    dev_stream_synchronize(copy);
    dev_free(d, dv2);
    (void)s;
}
TEST(host_memory_pool) {
    WorldConfig c = local_config(1);
    c.trace = 1;
    c.poison = 1;
    c.pcie_gbps = 1.0;
    c.pcie_latency_us = 200;
    run_world(c, rank_host_memory, NULL);
}

/* Scope and names reach the trace; tracing can be switched off. */
static void rank_trace(Dev *d, void *arg) {
    (void)arg;
    Stream *s = dev_compute_stream(d);
    dev_set_scope(d, 3, "block2", "forward");
    TCHECK(dev_scope_step(d) == 3 && strcmp(dev_scope_module(d), "block2") == 0 &&
           strcmp(dev_scope_phase(d), "forward") == 0, "scope getters");
    SleepSetArgs a = {1, NULL, 0};
    dev_launch(s, "matmul", LONG_COST, k_sleep_set, &a, sizeof a);
    float *buf = dev_alloc_f32(d, 64, MEM_TEMP, "buf");
    dev_memset_async(s, buf, 0, 256);
    coll_all_reduce(d, buf, buf, 64, RED_SUM, s, "block2");
    dev_set_tracing(d, 0);
    dev_launch(s, "hidden", TEST_COST, k_sleep_set, &a, sizeof a);
    dev_set_tracing(d, 1);
    dev_synchronize(d);
    int saw_op = 0, saw_coll = 0, saw_hidden = 0, saw_copy = 0;
    pthread_mutex_lock(&d->trace.mu);
    for (size_t i = 0; i < d->trace.n; i++) {
        TraceRec *r = &d->trace.recs[i];
        if (strcmp(r->name, "matmul") == 0 && strcmp(r->prefix, "block2") == 0 && r->step == 3 &&
            strcmp(r->phase, "forward") == 0 && strcmp(r->cat, "compute") == 0 && fabs(r->dur - 1001) < 1e-6)
            saw_op = 1;
        if (strcmp(r->name, "all_reduce") == 0 && strcmp(r->cat, "collective") == 0 && r->bytes == 256) saw_coll = 1;
        if (strcmp(r->name, "memset") == 0 && strcmp(r->cat, "copy") == 0 && r->bytes == 256) saw_copy = 1;
        if (strcmp(r->name, "hidden") == 0) saw_hidden = 1;
    }
    pthread_mutex_unlock(&d->trace.mu);
    TCHECK(saw_op && saw_coll && saw_copy && !saw_hidden, "trace records: op %d coll %d copy %d hidden %d", saw_op, saw_coll,
           saw_copy, saw_hidden);
    dev_free(d, buf);
}
TEST(trace_records) {
    run_world(traced(local_config(2)), rank_trace, NULL);
}

/* ------------------------------------------------------- the modelled clock */

/* The record of `name` (prefix.name or name) on track tid, or NULL. */
static const TraceRec *find_rec(Dev *d, int tid, const char *name) {
    const TraceRec *found = NULL;
    pthread_mutex_lock(&d->trace.mu);
    for (size_t i = 0; i < d->trace.n; i++)
        if (d->trace.recs[i].stream == tid && !strcmp(d->trace.recs[i].name, name)) found = &d->trace.recs[i];
    pthread_mutex_unlock(&d->trace.mu);
    return found;
}

/* By hand, on the A100 profile (its datasheet figures and the efficiencies profile.c
 * states: 70 % of dense peak for a float32 GEMM on CUDA cores, a bf16 GEMM at the
 * MAMF ceiling less its tile and wave quantisation, 80 % of HBM; 3 us per kernel, 4 us
 * of host time per op): a float32 matmul of 1024 x 4096 x 4096 and a bf16 one of
 * 128 x 256 x 512 (both bound by their math: the small one fills 4 of the 108 SMs'
 * 256 x 128 tiles, and only a quarter of two of them), a host wait that moves the host
 * to their end, a stream that waits for an event. */
static void rank_clock_by_hand(Dev *d, void *arg) {
    (void)arg;
    Stream *s = dev_compute_stream(d), *b = dev_stream_create(d, "b");
    Event *e = dev_event_create(d, "mm_done");
    const double flops = 2.0 * 1024 * 4096 * 4096, bytes_f32 = 4.0 * (1024 * 4096 + 1024 * 4096) + 4.0 * 4096 * 4096;
    const double flops_small = 2.0 * 128 * 256 * 512, bytes_bf16 = 2.0 * (128 * 256 + 128 * 512 + 512 * 256);
    const double hbm = 2039e9 * 0.8;
    double f32_us = 3 + 1e6 * flops / (19.5e12 * 0.7);   /* 2,520.2 us: its bytes take 61.7 */
    /* out [128, 512]: 1 x 4 tiles of 256 x 128 in one wave of 108 SMs, 65,536 of 108 x 32,768 elements useful */
    const double small_eff = 271.2 / 312 * (128.0 * 512) / (108 * 256.0 * 128);
    double bf16_us = 3 + 1e6 * flops_small / (312e12 * small_eff); /* 6.68 us of math: its bytes take 0.281 */
    TCHECK(1e6 * bytes_f32 / hbm < f32_us - 3 && 1e6 * bytes_bf16 / hbm < bf16_us - 3, "test's own bounds");
    KernelCost f32 = kcost_matmul_forward(1024, 4096, 4096, DTYPE_F32);
    KernelCost bf16 = kcost_matmul_forward(128, 256, 512, DTYPE_BF16);
    TCHECK(f32.flops == flops && f32.bytes == bytes_f32 && bf16.flops == flops_small && bf16.bytes == bytes_bf16,
           "matmul cost: %g FLOPs, %g bytes", f32.flops, f32.bytes);
    TCHECK(dev_host_time_us(d) == 0, "the host starts at 0 (%g)", dev_host_time_us(d));
    dev_launch(s, "mm_f32", &f32, k_nothing, NULL, 0);  /* host 4: runs 4 .. 4 + f32_us */
    dev_launch(s, "mm_bf16", &bf16, k_nothing, NULL, 0); /* host 8: starts when mm_f32 ends */
    dev_event_record(e, s);                              /* host 12 */
    dev_stream_wait_event(b, e);                         /* host 16 */
    dev_launch(b, "after", &bf16, k_nothing, NULL, 0);   /* host 20: starts at the event */
    TCHECK(fabs(dev_host_time_us(d) - 20) < 1e-9, "5 ops enqueued cost the host 20 us (%g)", dev_host_time_us(d));
    dev_stream_synchronize(s);
    double end = 4 + f32_us + bf16_us;
    TCHECK(fabs(dev_host_time_us(d) - end) < 1e-9, "the host waited until the compute stream's end %.4f (%.4f)", end,
           dev_host_time_us(d));
    dev_synchronize(d); /* b's record is in the trace once b ran it */
    const TraceRec *mm = find_rec(d, 0, "mm_f32"), *mb = find_rec(d, 0, "mm_bf16"), *af = find_rec(d, 1, "after");
    const TraceRec *sync = find_rec(d, TRACE_HOST_TID, "sync:compute");
    TCHECK(mm && fabs(mm->ts - 4) < 1e-9 && fabs(mm->dur - f32_us) < 1e-9, "mm_f32 at %g for %g us, expected 4 for %g",
           mm ? mm->ts : -1, mm ? mm->dur : -1, f32_us);
    TCHECK(mb && fabs(mb->ts - (4 + f32_us)) < 1e-9 && fabs(mb->dur - bf16_us) < 1e-9, "mm_bf16 at %g for %g us",
           mb ? mb->ts : -1, mb ? mb->dur : -1);
    TCHECK(af && fabs(af->ts - end) < 1e-9, "b's kernel starts at the event (%g), not at its enqueue (20)",
           af ? af->ts : -1);
    TCHECK(sync && fabs(sync->ts - 20) < 1e-9 && fabs(sync->dur - (end - 20)) < 1e-9,
           "the host's wait is a slice from 20 to %.4f on its track", end);
    dev_event_destroy(e);
}
TEST(modelled_clock_by_hand) {
    WorldConfig c = traced(local_config(1));
    c.profile = device_profile_find("a100-80g");
    run_world(c, rank_clock_by_hand, NULL);
}

/* dev_memcpy_batch_async on the A100 profile: three copies (and an empty one) into permuted places land,
 * as ONE launch: the host pays one launch (4 us), the stream one kernel latency (3 us) plus the bytes,
 * read and written, at 80 % of HBM; one "copy" slice "block0.copy_in" of all the bytes. The list is read
 * at the call: the host scribbles over it while a gate still holds the stream. A batch from pinned host
 * memory is priced by the PCIe model and named "<name>.h2d". */
static void rank_batch_copy(Dev *d, void *arg) {
    (void)arg;
    Stream *s = dev_compute_stream(d);
    const size_t n = 1000, bytes = n * sizeof(float);
    float *src = dev_alloc_f32(d, 3 * n, MEM_PARAM_SHARD, "shards");
    float *dst = dev_alloc_f32(d, 3 * n, MEM_COMM_BUFFER, "flat");
    for (size_t i = 0; i < 3 * n; i++) src[i] = (float)i;
    Gate gate = GATE_INIT;
    Gate *gp = &gate;
    dev_set_scope(d, 0, "block0", "pre_forward");
    dev_launch(s, "gate", TEST_COST, k_gate_wait, &gp, sizeof gp);
    DevCopy list[4] = {{dst + 2 * n, src, bytes}, {dst, src + n, bytes}, {NULL, NULL, 0}, {dst + n, src + 2 * n, bytes}};
    double t0 = dev_host_time_us(d);
    dev_memcpy_batch_async(s, "copy_in", list, 4);
    TCHECK(fabs(dev_host_time_us(d) - t0 - 4) < 1e-9, "the batch cost the host %g us, one launch is 4",
           dev_host_time_us(d) - t0);
    memset(list, 0xff, sizeof list); /* read at the call: the queued batch must not see this */
    gate_open(&gate);
    dev_stream_synchronize(s);
    int same = 1;
    for (size_t i = 0; i < n; i++)
        same &= dst[2 * n + i] == (float)i && dst[i] == (float)(n + i) && dst[n + i] == (float)(2 * n + i);
    TCHECK(same, "the batch's bytes did not land where its list said");
    const double model = 3 + 2.0 * 3 * bytes / (2039e9 * 0.8) * 1e6;
    int slices = 0, right = 0;
    pthread_mutex_lock(&d->trace.mu);
    for (size_t i = 0; i < d->trace.n; i++) {
        const TraceRec *r = &d->trace.recs[i];
        if (strcmp(r->cat, "copy")) continue;
        slices++;
        right = !strcmp(r->prefix, "block0") && !strcmp(r->name, "copy_in") && r->bytes == 3 * bytes &&
                fabs(r->dur - model) < 1e-9;
    }
    pthread_mutex_unlock(&d->trace.mu);
    TCHECK(slices == 1 && right, "%d copy slices (expected one 'block0.copy_in' of %zu bytes lasting %.4f us)", slices,
           3 * bytes, model);
    /* host -> device: the PCIe model (200 us + the bytes at 1 GB/s), once for the batch */
    float *host = dev_alloc_host_f32(d, 2 * n, MEM_PARAM_SHARD, "host_shards");
    for (size_t i = 0; i < 2 * n; i++) host[i] = -(float)i;
    DevCopy h2d[2] = {{dst + n, host, bytes}, {dst, host + n, bytes}};
    dev_memcpy_batch_async(s, "copy_in", h2d, 2);
    dev_stream_synchronize(s);
    TCHECK(dst[n] == 0.0f && dst[2 * n - 1] == -(float)(n - 1) && dst[0] == -(float)n, "the h2d batch's bytes");
    const TraceRec *pc = find_rec(d, 0, "copy_in.h2d");
    TCHECK(pc && pc->bytes == 2 * bytes && fabs(pc->dur - (200 + 2.0 * bytes / 1e9 * 1e6)) < 1e-9,
           "the h2d batch: %s, %g us", pc ? "traced" : "not traced as copy_in.h2d", pc ? pc->dur : -1);
    dev_memcpy_batch_async(s, "copy_in", NULL, 0); /* an empty batch: nothing to launch */
    TCHECK(s->enqueued == 3, "%llu ops enqueued: the gate and the two batches", (unsigned long long)s->enqueued);
    dev_free(d, host);
    dev_free(d, dst);
    dev_free(d, src);
}
TEST(batch_copy_is_one_launch) {
    WorldConfig c = traced(local_config(1));
    c.profile = device_profile_find("a100-80g");
    c.pcie_gbps = 1.0;
    c.pcie_latency_us = 200;
    run_world(c, rank_batch_copy, NULL);
}

/* launch_cast_batch_to_bf16: three casts (and an empty one) into permuted places give, bit for bit, what
 * launch_cast_to_bf16 gives each range (values of every kind: random bit patterns, so NaNs, infinities,
 * subnormals and ties to even among them), as ONE launch: the host pays one launch, the trace shows one
 * kernel slice "block0.copy_in" priced as one launch_cast_to_bf16 of all the elements. The list is read at
 * the call: the host scribbles over it while a gate still holds the stream. */
static void rank_cast_batch(Dev *d, void *arg) {
    (void)arg;
    Stream *s = dev_compute_stream(d);
    const size_t n = 1000;
    float *src = dev_alloc_f32(d, 3 * n, MEM_PARAM_SHARD, "shards");                 /* [3n] */
    Bf16 *got = dev_alloc_bf16(d, 3 * n, MEM_COMM_BUFFER, "flat");                    /* [3n] the batch's */
    Bf16 *want = dev_alloc_bf16(d, 3 * n, MEM_COMM_BUFFER, "want");                   /* [3n] one range at a time */
    Bf16 *whole = dev_alloc_bf16(d, 3 * n, MEM_COMM_BUFFER, "whole");                 /* [3n] the cost yardstick */
    uint32_t x = 12345u;
    for (size_t i = 0; i < 3 * n; i++) {
        x = x * 1664525u + 1013904223u; /* LCG: every exponent shows up, NaN and inf among them */
        uint32_t bits = i % 7 == 0 ? (x & 0xffff0000u) | 0x8000u : x; /* every 7th a tie: the half-way point */
        memcpy(&src[i], &bits, sizeof bits);
    }
    memset(got, 0x5a, 3 * n * sizeof(Bf16));
    Gate gate = GATE_INIT;
    Gate *gp = &gate;
    dev_set_scope(d, 0, "block0", "pre_forward");
    dev_launch(s, "gate", TEST_COST, k_gate_wait, &gp, sizeof gp);
    CastCopy list[4] = {{got + 2 * n, src, n}, {got, src + n, n}, {NULL, NULL, 0}, {got + n, src + 2 * n, n}};
    uint64_t before = s->enqueued;
    double t0 = dev_host_time_us(d);
    launch_cast_batch_to_bf16(s, "copy_in", list, 4);
    TCHECK(s->enqueued == before + 1, "the batch enqueued %llu ops, expected one launch",
           (unsigned long long)(s->enqueued - before));
    TCHECK(fabs(dev_host_time_us(d) - t0 - 4) < 1e-9, "the batch cost the host %g us, one launch is 4",
           dev_host_time_us(d) - t0);
    memset(list, 0xff, sizeof list); /* read at the call: the queued batch must not see this */
    gate_open(&gate);
    launch_cast_to_bf16(s, want + 2 * n, src, n);
    launch_cast_to_bf16(s, want, src + n, n);
    launch_cast_to_bf16(s, want + n, src + 2 * n, n);
    launch_cast_to_bf16(s, whole, src, 3 * n);
    dev_stream_synchronize(s);
    size_t bad = 3 * n;
    for (size_t i = 0; i < 3 * n && bad == 3 * n; i++)
        if (got[i] != want[i]) bad = i;
    TCHECK(bad == 3 * n, "element %zu: the batch gave 0x%04x, launch_cast_to_bf16 0x%04x", bad,
           bad < 3 * n ? got[bad] : 0, bad < 3 * n ? want[bad] : 0);
    const TraceRec *batch = NULL, *yard = NULL;
    int slices = 0;
    pthread_mutex_lock(&d->trace.mu);
    for (size_t i = 0; i < d->trace.n; i++) {
        const TraceRec *r = &d->trace.recs[i];
        if (!strcmp(r->name, "copy_in")) {
            slices++;
            batch = r;
        }
        if (!strcmp(r->name, "cast_to_bf16") && r->dur > (yard ? yard->dur : 0)) yard = r; /* the 3n-element one */
    }
    pthread_mutex_unlock(&d->trace.mu);
    TCHECK(slices == 1 && batch && yard && !strcmp(batch->prefix, "block0") && !strcmp(batch->cat, yard->cat) &&
               fabs(batch->dur - yard->dur) < 1e-9,
           "%d 'copy_in' slices (expected one 'block0.copy_in' kernel lasting %.4f us, one cast of all %zu "
           "elements): %s %.4f us", slices, yard ? yard->dur : -1, 3 * n, batch ? batch->cat : "-",
           batch ? batch->dur : -1);
    before = s->enqueued;
    launch_cast_batch_to_bf16(s, "copy_in", NULL, 0); /* an empty batch: nothing to launch */
    TCHECK(s->enqueued == before, "an empty batch enqueued %llu ops", (unsigned long long)(s->enqueued - before));
    dev_free(d, whole);
    dev_free(d, want);
    dev_free(d, got);
    dev_free(d, src);
}
TEST(batch_cast_is_one_launch) {
    WorldConfig c = traced(local_config(1));
    c.profile = device_profile_find("a100-80g");
    run_world(c, rank_cast_batch, NULL);
}

/* A collective starts when the last rank of its group is ready: rank 1 reaches
 * it 1 ms later (a kernel before it), so rank 0's all-gather starts then too. */
static void rank_clock_collective(Dev *d, void *arg) {
    (void)arg;
    Stream *s = dev_compute_stream(d);
    float *x = dev_alloc_f32(d, 2, MEM_COMM_BUFFER, "x");
    memset(x, 0, 2 * sizeof(float));
    if (dev_rank(d) == 1) dev_launch(s, "late", LONG_COST, k_nothing, NULL, 0); /* 1 .. 1002 */
    coll_all_gather(d, x + dev_rank(d), x, 1, s, "meet"); /* in place: rank r's element at x[r] */
    dev_synchronize(d);
    const TraceRec *ag = find_rec(d, 0, "all_gather");
    /* rank 0 enqueued at host 1, rank 1 at host 2 after its 1001-us kernel (1 .. 1002) */
    TCHECK(ag && fabs(ag->ts - 1002) < 1e-9, "rank %d: the all-gather starts at %g, expected 1002 (rank 1 ready)",
           dev_rank(d), ag ? ag->ts : -1);
    TCHECK(ag && ag->dur == 0, "no link: it takes no time (%g)", ag ? ag->dur : -1);
    dev_free(d, x);
}
TEST(modelled_collective_waits_for_the_group) { run_world(traced(local_config(2)), rank_clock_collective, NULL); }

/* The GPU profiles' cost model, each figure worked out by hand from the sourced inputs (profile.c):
 * a GEMM's share of the peak after tile and wave quantisation, attention's share by sequence length,
 * a kernel with two GEMMs, and NCCL's ring within a node, across nodes and one rank per node. */
TEST(profile_costs_by_hand) {
    const DeviceProfile *h = device_profile_find("h100-sxm"), *a = device_profile_find("a100-80g");
    const DeviceProfile *t = device_profile_find("teach");
    /* 16384 x 4096 out of 256 x 128 tiles: 64 x 32 = 2048 tiles, 16 waves of 132 SMs = 2112 slots, 97 % used,
     * above the 85 % a model's shapes reach of the best */
    TCHECK(fabs(gemm_efficiency(h, 16384, 4096) - 794.5 / 989.4 * 0.85) < 1e-12, "16384 x 4096: %.6f",
           gemm_efficiency(h, 16384, 4096));
    /* 1280 x 4096: 5 x 32 = 160 tiles, 2 waves of 132 = 264 slots: 60.6 % used, below 85 % */
    TCHECK(fabs(gemm_efficiency(h, 1280, 4096) - 794.5 / 989.4 * 160.0 / 264.0) < 1e-12, "1280 x 4096: %.6f",
           gemm_efficiency(h, 1280, 4096));
    /* 100 x 100 is one partial tile in one wave: 10,000 useful elements of 132 x 32,768 paid */
    TCHECK(fabs(gemm_efficiency(h, 100, 100) - 794.5 / 989.4 * 1e4 / (132.0 * 32768)) < 1e-12, "100 x 100");
    /* A100, 4096 x 1024: 16 x 8 = 128 tiles, more than 108 SMs: two waves (216 slots) */
    TCHECK(fabs(gemm_efficiency(a, 4096, 1024) - 271.2 / 312 * 128.0 / 216.0) < 1e-12, "A100 4096 x 1024: %.6f",
           gemm_efficiency(a, 4096, 1024));
    TCHECK(gemm_efficiency(t, 16384, 4096) == 1.0, "teach: one figure for every shape");
    /* FlashAttention-2 on the H100: 308 TFLOP/s at 8k; halfway (in log2) between 4k and 8k, the mean of 294
     * and 308; held below 2k and above 16k */
    TCHECK(fabs(attention_efficiency(h, 8192) - 308 / 989.4) < 1e-12, "8k");
    TCHECK(fabs(attention_efficiency(h, 4096 * sqrt(2.0)) - (294 + 308) / 2.0 / 989.4) < 1e-9, "between 4k and 8k");
    TCHECK(fabs(attention_efficiency(h, 512) - 265 / 989.4) < 1e-12, "below 2k");
    TCHECK(fabs(attention_efficiency(h, 65536) - 328 / 989.4) < 1e-12, "above 16k");
    /* the matmul backward at 8192 tokens, 4096 -> 14336: dinp [8192, 4096] (K 14336) and dw [14336, 4096] (K 8192),
     * each at its own shape's share of the bf16 peak (both above the bytes' time) */
    KernelCost mb = kcost_matmul_backward(8192, 4096, 14336, DTYPE_BF16);
    double flop1 = 2.0 * 8192 * 4096 * 14336, flop2 = 2.0 * 14336 * 4096 * 8192;
    double e1 = 794.5 / 989.4 * (8192.0 * 4096) / (8 * 132 * 256.0 * 128); /* 1024 tiles, 8 waves: 96.97 % */
    double e2 = 794.5 / 989.4 * (14336.0 * 4096) / (14 * 132 * 256.0 * 128); /* 1792, 14 waves: 96.97 % */
    e1 = e1 > 794.5 / 989.4 * 0.85 ? 794.5 / 989.4 * 0.85 : e1, e2 = e2 > 794.5 / 989.4 * 0.85 ? 794.5 / 989.4 * 0.85 : e2;
    double want = 3 + 1e6 * (flop1 / (989.4e12 * e1) + flop2 / (989.4e12 * e2));
    TCHECK(fabs(kernel_time_us(h, &mb, 0, PRICE_FUSED) - want) < 1e-6, "matmul backward: %.3f us, by hand %.3f",
           kernel_time_us(h, &mb, 0, PRICE_FUSED), want);
    /* --price-ops: an RMSNorm over 16384 x 4096 bf16 elements priced as eager PyTorch's kernels (torchtitan's
     * RMSNorm: 8 kernels moving 36 bytes per element forward: a cast up 2 + 4, pow 4 + 4, mean 4, x * rsqrt 4 + 4,
     * a cast down 4 + 2, * weight 2 + 2), as itself under fused and under eager-fused-norm */
    const double n = 16384.0 * 4096;
    KernelCost nf = kcost_elementwise(4.0 * n, 2.0 * (2 * n + 4096) + 4.0 * 16384);
    kcost_eager_rmsnorm(&nf, 2.0, n, 0);
    double hbm = 3350e9 * 0.8;
    TCHECK(fabs(kernel_time_us(h, &nf, 0, PRICE_EAGER) - (8 * 3 + 1e6 * 36 * n / hbm)) < 1e-6, "eager RMSNorm: %.3f us",
           kernel_time_us(h, &nf, 0, PRICE_EAGER));
    TCHECK(kernel_time_us(h, &nf, 0, PRICE_EAGER_FUSED_NORM) == kernel_time_us(h, &nf, 0, PRICE_FUSED) &&
               fabs(kernel_time_us(h, &nf, 0, PRICE_FUSED) - (3 + 1e6 * nf.bytes / hbm)) < 1e-6,
           "a fused RMSNorm is priced as itself");
    /* its backward: 92 bytes per element in 15 kernels (* weight's grads 4 + 6 + 2, a cast 6, x * rsqrt's 8 + 12 + 4,
     * mean's 4, pow's 8 + 8 + 12, the two paths added 12, a cast 6) */
    KernelCost nb = kcost_elementwise(8.0 * n, 0);
    kcost_eager_rmsnorm(&nb, 2.0, n, 1);
    TCHECK(fabs(kernel_time_us(h, &nb, 0, PRICE_EAGER) - (15 * 3 + 1e6 * 92 * n / hbm)) < 1e-6, "eager RMSNorm backward");
    /* attention, 8B's heads (32, 8 KV, hd 128) on 16384 tokens: beside the fused kernel, repeat_kv's two copies
     * (read 8 heads, write 32, each) and the output's transposed copy (32 heads read and written), 3 kernels */
    KernelCost at = kcost_attention_forward(2, 8192, 32, 8, 128, DTYPE_BF16);
    kcost_eager_attention(&at, 2.0, 16384, 32, 8, 128);
    double extra = 3 * 3 + 1e6 * 16384 * 128 * 2.0 * (2 * (32 + 8) + 2 * 32) / hbm;
    TCHECK(fabs(kernel_time_us(h, &at, 0, PRICE_EAGER) - kernel_time_us(h, &at, 0, PRICE_FUSED) - extra) < 1e-6,
           "eager attention's copies: %.3f us more, by hand %.3f",
           kernel_time_us(h, &at, 0, PRICE_EAGER) - kernel_time_us(h, &at, 0, PRICE_FUSED), extra);
    /* an all-gather of 1 GiB (the gathered buffer) on the H100 profile (NCCL's ring: 8.4 us per collective,
     * 3.4 us per NVLink step, 14 us per network step) */
    WorldConfig c = local_config(16);
    c.profile = h;
    c.link_gbps = h->link_gbps, c.link_latency_us = h->link_latency_us;
    c.inter_link_gbps = h->inter_link_gbps, c.inter_link_latency_us = h->inter_link_latency_us;
    const CollKindInfo *ag = coll_kind(COLL_ALL_GATHER);
    const double S = (double)(1 << 30);
    ProcessGroup g = {.size = 8, .nodes = 1}; /* one node: NVLink's 370 GB/s, 7 steps */
    double one = 8.4 + 7.0 / 8 * S / 370e9 * 1e6 + 7 * 3.4;
    TCHECK(fabs(coll_link_time_us(&c, ag, (size_t)S, &g) - one) < 1e-6, "8 ranks, one node: %.3f, by hand %.3f",
           coll_link_time_us(&c, ag, (size_t)S, &g), one);
    /* 16 ranks on 2 nodes: 8 NICs per node at 48 GB/s (384) leave NVLink's 370 the bottleneck; 14 NVLink steps, 1
     * network step */
    ProcessGroup g2 = {.size = 16, .nodes = 2, .spans_nodes = 1};
    double two = 8.4 + 15.0 / 16 * S / 370e9 * 1e6 + 14 * 3.4 + 14;
    TCHECK(fabs(coll_link_time_us(&c, ag, (size_t)S, &g2) - two) < 1e-6, "16 ranks, 2 nodes: %.3f, by hand %.3f",
           coll_link_time_us(&c, ag, (size_t)S, &g2), two);
    /* HSDP's replicate group: 4 ranks, one per node: each on its own NIC (48 GB/s), every step crosses nodes */
    ProcessGroup g3 = {.size = 4, .nodes = 4, .spans_nodes = 1};
    double rep = 8.4 + 3.0 / 4 * S / 48e9 * 1e6 + 3 * 14;
    TCHECK(fabs(coll_link_time_us(&c, ag, (size_t)S, &g3) - rep) < 1e-6, "4 ranks, 4 nodes: %.3f, by hand %.3f",
           coll_link_time_us(&c, ag, (size_t)S, &g3), rep);
    /* 16 ranks, 4 per node on 4 nodes: 4 NICs (192 GB/s) are slower than NVLink */
    ProcessGroup g4 = {.size = 16, .nodes = 4, .spans_nodes = 1};
    double four = 8.4 + 15.0 / 16 * S / 192e9 * 1e6 + 12 * 3.4 + 3 * 14;
    TCHECK(fabs(coll_link_time_us(&c, ag, (size_t)S, &g4) - four) < 1e-6, "16 ranks, 4 per node: %.3f, by hand %.3f",
           coll_link_time_us(&c, ag, (size_t)S, &g4), four);
}

/* The overlap slowdown on the A100 profile: an all-gather on its own stream leaves a debt of c s / (1 + s)
 * (c its time, s the profile's slowdown); a kernel then queued on the compute stream runs 1 + s times as long
 * (the debt is larger than s times its time); once the compute stream waits for the all-gather's event the rest
 * of the debt is gone, and the next kernel takes its plain time. A kernel on the all-gather's own stream never
 * pays. */
static void rank_overlap(Dev *d, void *arg) {
    (void)arg;
    Stream *s = dev_compute_stream(d), *ags = dev_stream_create(d, "all_gather");
    Event *done = dev_event_create(d, "ag_done");
    const size_t n = (size_t)1 << 26; /* 256 MiB gathered: about 1.2 ms on 230 GB/s, far above the kernels */
    float *x = dev_alloc_f32(d, n, MEM_COMM_BUFFER, "x");
    const DeviceProfile *p = d->world->cfg.profile;
    const double slow = p->overlap_slowdown, plain = 3 + 100e6 / (2039e9 * 0.8) * 1e6; /* LONG_COST on the A100 */
    TCHECK(slow > 0, "the A100 profile has an overlap slowdown");
    coll_all_gather(d, x + dev_rank(d) * (n / 2), x, n / 2, ags, "gather");
    dev_event_record(done, ags);
    dev_launch(ags, "same_stream", LONG_COST, k_nothing, NULL, 0);
    dev_launch(s, "overlapped", LONG_COST, k_nothing, NULL, 0);
    dev_stream_wait_event(s, done);
    dev_launch(s, "after", LONG_COST, k_nothing, NULL, 0);
    dev_synchronize(d);
    const TraceRec *same = find_rec(d, 1, "same_stream"), *ov = find_rec(d, 0, "overlapped");
    const TraceRec *af = find_rec(d, 0, "after");
    TCHECK(same && fabs(same->dur - plain) < 1e-9, "the collective's own stream: %g us, plain %g", same ? same->dur : -1,
           plain);
    TCHECK(ov && fabs(ov->dur - plain * (1 + slow)) < 1e-9, "overlapped: %g us, expected %g", ov ? ov->dur : -1,
           plain * (1 + slow));
    TCHECK(af && fabs(af->dur - plain) < 1e-9, "after the wait: %g us, plain %g", af ? af->dur : -1, plain);
    dev_event_destroy(done);
    dev_free(d, x);
}
TEST(overlap_slowdown_by_hand) {
    WorldConfig c = traced(local_config(2));
    const DeviceProfile *a = device_profile_find("a100-80g");
    c.profile = a;
    c.link_gbps = a->link_gbps, c.link_latency_us = a->link_latency_us;
    run_world(c, rank_overlap, NULL);
}

/* ------------------------------------------------- representative ranks */

/* A dry run of 4096 ranks on 512 nodes of 8 (WorldConfig.rep_stride 4096: rank 0 alone executes), HSDP's mesh
 * of 512 replicas x 8 shards: rank 0's groups are the full ones (sizes, group ranks, node span), each
 * all-gather lasts the ring model's time on all of its members (inside a node: 7/8 of its bytes at the fast
 * link; across nodes: 511/512 of them at the slow link, 511 hops), and nobody waits for the 4095 others. */
typedef struct {
    double inside_us, across_us;
    int shard_size, replicate_size, shard_rank, replicate_rank, executed, first_executed;
    double gathered;
} RepArgs;

static void rank_representative(Dev *d, void *arg) {
    RepArgs *ra = arg;
    DeviceMesh m;
    dev_mesh_build(d, &m, 512, 8);
    ra->shard_size = pg_size(m.shard_group), ra->replicate_size = pg_size(m.replicate_group);
    ra->shard_rank = pg_rank(m.shard_group), ra->replicate_rank = pg_rank(m.replicate_group);
    ra->executed = dev_executed_count(d), ra->first_executed = dev_executed_rank(d, 0);
    double mine[1];
    dev_host_allgather_f64(d, 7.5, mine); /* out[dev_executed_count]: one value */
    ra->gathered = mine[0];
    const size_t cnt = 1000; /* 4 kB per rank */
    float *in = dev_alloc_f32(d, 8 * cnt, MEM_COMM_BUFFER, "in"), *across = dev_alloc_f32(d, 512 * cnt, MEM_COMM_BUFFER,
                                                                                                "across");
    Stream *s = dev_compute_stream(d);
    pg_all_gather(m.shard_group, in, in, cnt, s, "inside"); /* in place: group rank 0's block is the first */
    pg_all_gather(m.replicate_group, across, across, cnt, s, "across");
    dev_synchronize(d);
    pthread_mutex_lock(&d->trace.mu);
    for (size_t i = 0; i < d->trace.n; i++) {
        const TraceRec *r = &d->trace.recs[i];
        if (strcmp(r->cat, "collective")) continue;
        if (!strcmp(r->prefix, "inside")) ra->inside_us = r->dur;
        if (!strcmp(r->prefix, "across")) ra->across_us = r->dur;
    }
    pthread_mutex_unlock(&d->trace.mu);
    dev_free(d, in);
    dev_free(d, across);
}

TEST(representative_ranks_price_the_full_groups) {
    WorldConfig c = traced(local_config(4096));
    c.dry_run = 1;
    c.rep_stride = 4096;
    c.link_gbps = 1000;       /* inside a node: 1 MB in 8 us */
    c.inter_link_gbps = 0.1;  /* across nodes: 1 MB in 80 ms */
    c.inter_link_latency_us = 1000;
    c.ranks_per_node = 8;
    RepArgs ra = {0};
    run_world(c, rank_representative, &ra);
    CHECK(ra.executed == 1 && ra.first_executed == 0 && ra.gathered == 7.5, "executed %d ranks from %d; gathered %g",
          ra.executed, ra.first_executed, ra.gathered);
    CHECK(ra.shard_size == 8 && ra.replicate_size == 512 && ra.shard_rank == 0 && ra.replicate_rank == 0,
          "shard group %d ranks (rank %d), replicate group %d (rank %d)", ra.shard_size, ra.shard_rank,
          ra.replicate_size, ra.replicate_rank);
    const double inside = 7.0 / 8 * 8 * 4000 / (1000e9 / 8) * 1e6;                  /* no latency in a node */
    const double across = 511.0 / 512 * 512 * 4000 / (0.1e9 / 8) * 1e6 + 511 * 1000.0; /* 511 hops between nodes */
    CHECK(fabs(ra.inside_us - inside) < 1e-6 * inside, "inside a node: %.4f us, the ring of 8: %.4f", ra.inside_us,
          inside);
    CHECK(fabs(ra.across_us - across) < 1e-6 * across, "across nodes: %.1f us, the ring of 512: %.1f", ra.across_us,
          across);
}

/* A pipeline's classes (WorldConfig.rep_stride 4 of 8: ranks 0 and 4 execute, each stage's first): each
 * stage's group is whole (4 ranks), and the two representatives' sends and receives meet each other. */
static void rank_representative_stages(Dev *d, void *arg) {
    int *ok = arg;
    const int stage = dev_rank(d) / 4;
    ProcessGroup *g = dev_group_new_of(d, stage, "stage", stage * 4, 1, 4);
    float *buf = dev_alloc_f32(d, 64, MEM_COMM_BUFFER, "act");
    Stream *s = dev_compute_stream(d);
    pg_all_gather(g, buf, buf, 16, s, "block0");
    if (stage == 0) dev_send(s, buf, 16, 4, 0, "act");
    else dev_recv(s, buf, 16, 0, 0, "act");
    dev_synchronize(d);
    if (pg_size(g) == 4 && pg_rank(g) == 0 && dev_executed_count(d) == 2 && dev_executed_rank(d, 1) == 4)
        __atomic_add_fetch(ok, 1, __ATOMIC_SEQ_CST);
    dev_free(d, buf);
}

TEST(representative_stages_meet_their_peers) {
    WorldConfig c = local_config(8);
    c.dry_run = 1;
    c.rep_stride = 4;
    int ok = 0;
    run_world(c, rank_representative_stages, &ok);
    CHECK(ok == 2, "%d of the 2 executed ranks saw their stage's whole group and each other", ok);
}

/* ------------------------------------------------------ artifacts mode */

static void k_noop(void *p) { (void)p; }

static void rank_artifacts(Dev *d, void *arg) {
    const char *dir = arg;
    Stream *c = dev_compute_stream(d), *ag = dev_stream_create(d, "all_gather"), *rs = dev_stream_create(d, "reduce_scatter");
    Event *ev = dev_event_create(d, "ag_done"), *used = dev_event_create(d, "used");
    const int n = dev_world_size(d);
    float *shard = dev_alloc_f32(d, 1024, MEM_PARAM_SHARD, "layers.0.wq.weight");
    float *opt = dev_alloc_f32(d, 2048, MEM_OPTIM_STATE, "exp_avg");
    memset(shard, 0, 4096);
    for (int step = 0; step < 2; step++) {
        dev_set_scope(d, step, "block0", "pre_forward");
        float *full = dev_alloc_f32_on(ag, 1024 * (size_t)n, MEM_UNSHARDED_PARAM, "block0.flat");
        coll_all_gather(d, shard, full, 1024, ag, "block0");
        dev_event_record(ev, ag);
        dev_stream_wait_event(c, ev);
        dev_set_scope(d, step, "block0", "forward");
        float *act = dev_alloc_f32(d, 4096, MEM_ACTIVATION, "block0.out");
        dev_launch(c, "matmul", LONG_COST, k_noop, NULL, 0); /* 1 ms: the host's syncs wait for it */
        dev_memcpy_async(c, act, full, 1024 * sizeof(float));
        dev_set_scope(d, step, "block0", "post_forward");
        dev_event_record(used, c);
        dev_stream_wait_event(ag, used); /* full is a block of ag's pool: ag waits for compute's read */
        dev_free(d, full);
        char f[128];
        snprintf(f, sizeof f, "\"step\":%d,\"module\":\"block0\",\"hook\":\"post_forward\",\"live_unsharded_param_bytes\":0", step);
        dev_mem_note(d, "hook_check", f);
        dev_set_scope(d, step, "block0", "post_backward");
        float *g = dev_alloc_f32(d, 1024 * (size_t)n, MEM_UNSHARDED_GRAD, "block0.grad");
        float *gs = dev_alloc_f32(d, 1024, MEM_GRAD_SHARD, "block0.grad_shard");
        dev_memset_async(c, g, 0, 1024 * (size_t)n * sizeof(float));
        dev_event_record(ev, c);
        dev_stream_wait_event(rs, ev);
        coll_reduce_scatter(d, g, gs, 1024, RED_AVG, rs, "block0");
        dev_event_record(ev, rs);
        if (step == 0) { /* keep g until compute waited for the reduce-scatter (FSDP2's way) */
            dev_stream_wait_event(c, ev);
            dev_free(d, g);
        } else { /* or record_stream: g stays counted until rs is past the free */
            dev_record_stream(g, rs);
            dev_free(d, g);
            dev_stream_wait_event(c, ev);
            dev_stream_synchronize(rs); /* the next allocator call completes it, deterministically */
        }
        dev_free(d, act);
        dev_free(d, gs);
    }
    dev_set_scope(d, 2, "optimizer", "step");
    for (int i = 0; i < 300; i++) dev_free(d, dev_alloc(d, 100 + (size_t)i, MEM_TEMP, "scratch")); /* > 1000 trace entries */
    dev_synchronize(d);
    dev_write_artifacts(d, dir);
    dev_event_destroy(ev);
    dev_event_destroy(used);
    dev_free(d, shard);
    (void)opt; /* stays live: shows in live_at_end and the pickle's segments */
}

/* ---------------------------------------------------------- misuse mode */

static void rank_misuse_event(Dev *d, void *arg) {
    Event *e = dev_event_create(d, "ag_done");
    dev_stream_wait_event(dev_compute_stream(d), e);
}
static void rank_misuse_event_sync(Dev *d, void *arg) { dev_event_synchronize(dev_event_create(d, "rs_done")); }
static void rank_misuse_double_free(Dev *d, void *arg) {
    void *p = dev_alloc(d, 100, MEM_TEMP, "x");
    dev_free(d, p);
    dev_free(d, p);
}
static void rank_misuse_foreign(Dev *d, void *arg) {
    char *p = dev_alloc(d, 100, MEM_TEMP, "x");
    dev_free(d, p + 8);
}
static void rank_misuse_mismatch(Dev *d, void *arg) {
    int me = dev_rank(d);
    Stream *ag = dev_stream_create(d, "ag");
    float *buf = dev_alloc_f32(d, 200000, MEM_COMM_BUFFER, "buf");
    for (int k = 0; k < 14; k++) coll_all_gather(d, buf, buf + 65536, 16, ag, "warm");
    if (me == 2) coll_reduce_scatter(d, buf, buf + 100000, 16384, RED_SUM, ag, "block3");
    else coll_all_gather(d, buf, buf + 65536, 32768 / 4, ag, "block2");
    dev_synchronize(d);
}

/* A 2x2 mesh: row 1's ranks disagree inside their shard group (row 0 is fine). */
static void rank_misuse_group_mismatch(Dev *d, void *arg) {
    int me = dev_rank(d);
    DeviceMesh m;
    dev_mesh_build(d, &m, 2, 2);
    Stream *ag = dev_stream_create(d, "ag");
    float *buf = dev_alloc_f32(d, 4096, MEM_COMM_BUFFER, "buf");
    pg_all_reduce(m.replicate_group, buf, buf, 16, RED_SUM, ag, "warm");
    if (me == 3) pg_reduce_scatter(m.shard_group, buf, buf + 1024, 8, RED_AVG, ag, "block3");
    else pg_all_gather(m.shard_group, buf, buf + 1024, 16, ag, "block2");
    dev_synchronize(d);
}

/* Every rank passes its gathered buffer as the send buffer too: in place only for rank 0 (NCCL's in-place
 * all-gather sends from recv + rank * count), a race between the ranks' copies for rank 1. */
static void rank_misuse_inplace_offset(Dev *d, void *arg) {
    float *buf = dev_alloc_f32(d, 64, MEM_COMM_BUFFER, "buf");
    coll_all_gather(d, buf, buf, 32, dev_compute_stream(d), "block0");
    dev_synchronize(d);
}
/* An all-reduce whose output starts 4 elements into its input. */
static void rank_misuse_overlap_all_reduce(Dev *d, void *arg) {
    float *buf = dev_alloc_f32(d, 64, MEM_COMM_BUFFER, "buf");
    coll_all_reduce(d, buf, buf + 4, 16, RED_SUM, dev_compute_stream(d), "grad_norm");
    dev_synchronize(d);
}

/* dev_memcpy_batch_async's bad input, one line each: destinations that overlap, a NULL source, copies that go
 * two ways (device to device, host to device), a name with a dot; and launch_cast_batch_to_bf16's. */
static void rank_misuse_batch(Dev *d, void *arg) {
    const char *kind = arg;
    Stream *s = dev_compute_stream(d);
    float *a = dev_alloc_f32(d, 64, MEM_COMM_BUFFER, "a"), *b = dev_alloc_f32(d, 64, MEM_COMM_BUFFER, "b");
    float *h = dev_alloc_host_f32(d, 16, MEM_PARAM_SHARD, "h");
    DevCopy overlap[3] = {{a, b, 64}, {a + 32, b + 16, 64}, {a + 8, b + 32, 64}}; /* a[8..24) meets a[0..16) */
    DevCopy null_src[2] = {{a, b, 64}, {a + 16, NULL, 64}};
    DevCopy mixed[2] = {{a, b, 64}, {a + 16, h, 64}};
    if (!strcmp(kind, "batch_overlap")) dev_memcpy_batch_async(s, "copy_out", overlap, 3);
    if (!strcmp(kind, "batch_null")) dev_memcpy_batch_async(s, "chunk_cat", null_src, 2);
    if (!strcmp(kind, "batch_mixed")) dev_memcpy_batch_async(s, "copy_in", mixed, 2);
    if (!strcmp(kind, "batch_name")) dev_memcpy_batch_async(s, "block0.copy_in", overlap, 1);
    /* launch_cast_batch_to_bf16: a destination that meets another cast's source, a NULL destination, a dot */
    Bf16 *o = dev_alloc_bf16(d, 64, MEM_COMM_BUFFER, "o");
    CastCopy cast_overlap[2] = {{o, b, 16}, {(Bf16 *)(b + 4), a, 16}}; /* cast 1 writes b[4..12), cast 0 reads b */
    CastCopy cast_null[2] = {{o, a, 16}, {NULL, b, 16}};
    if (!strcmp(kind, "batch_cast_overlap")) launch_cast_batch_to_bf16(s, "copy_in", cast_overlap, 2);
    if (!strcmp(kind, "batch_cast_null")) launch_cast_batch_to_bf16(s, "chunk_cat", cast_null, 2);
    if (!strcmp(kind, "batch_cast_name")) launch_cast_batch_to_bf16(s, "block0.copy_in", cast_null, 1);
    dev_synchronize(d);
}

/* With representative ranks: rank 0 sends to rank 1, which does not execute; a group made from colors alone. */
static void rank_misuse_rep_p2p(Dev *d, void *arg) {
    float *buf = dev_alloc_f32(d, 16, MEM_COMM_BUFFER, "act");
    if (dev_rank(d) == 0) dev_send(dev_compute_stream(d), buf, 16, 1, 0, "act");
    dev_synchronize(d);
}
static void rank_misuse_rep_group(Dev *d, void *arg) { dev_group_new(d, dev_rank(d) / 4, "mine"); }

static int misuse(const char *kind) {
    void (*fn)(Dev *, void *) = NULL;
    WorldConfig c = local_config(1);
    if (strcmp(kind, "event") == 0) fn = rank_misuse_event;
    else if (strcmp(kind, "event_sync") == 0) fn = rank_misuse_event_sync;
    else if (strcmp(kind, "double_free") == 0) fn = rank_misuse_double_free;
    else if (strcmp(kind, "foreign_free") == 0) fn = rank_misuse_foreign;
    else if (strcmp(kind, "mismatch") == 0) {
        fn = rank_misuse_mismatch;
        c = local_config(3);
    } else if (strcmp(kind, "group_mismatch") == 0) {
        fn = rank_misuse_group_mismatch;
        c = local_config(4);
    } else if (strcmp(kind, "inplace_offset") == 0) {
        fn = rank_misuse_inplace_offset;
        c = local_config(2);
    } else if (strcmp(kind, "overlap_all_reduce") == 0) {
        fn = rank_misuse_overlap_all_reduce;
    } else if (strncmp(kind, "batch_", 6) == 0) {
        World *w = world_create(&c);
        world_run(w, rank_misuse_batch, (void *)kind);
        world_destroy(w);
        return 0;
    } else if (strcmp(kind, "rep_p2p") == 0 || strcmp(kind, "rep_group") == 0) {
        c = local_config(8); /* a dry run executing ranks 0 and 4 */
        c.dry_run = 1;
        c.rep_stride = 4;
        fn = strcmp(kind, "rep_p2p") == 0 ? rank_misuse_rep_p2p : rank_misuse_rep_group;
    } else if (strcmp(kind, "rep_computing") == 0) {
        c = local_config(8);
        c.rep_stride = 4;
    } else if (strcmp(kind, "rep_world_big") == 0) {
        c = local_config(WORLD_MAX_DRY_RANKS + 1);
        c.dry_run = 1;
        c.rep_stride = WORLD_MAX_DRY_RANKS + 1;
    } else if (strcmp(kind, "world0") == 0) c = local_config(0);
    else if (strcmp(kind, "world_big") == 0) c = local_config(WORLD_MAX_RANKS + 1);
    else if (strcmp(kind, "mpi_no_support") == 0) {
        c.backend = BACKEND_MPI;
#ifdef HAVE_MPI
        printf("mpi supported\n");
        return 0;
#endif
    } else {
        fprintf(stderr, "unknown misuse kind %s\n", kind);
        return 1;
    }
    World *w = world_create(&c);
    if (fn) world_run(w, fn, NULL);
    world_destroy(w);
    return 0;
}

int main(int argc, char **argv) {
    if (argc > 2 && strcmp(argv[1], "--write-artifacts") == 0) {
        run_world(traced(local_config(2)), rank_artifacts, argv[2]);
        return 0;
    }
    if (argc > 2 && strcmp(argv[1], "--misuse") == 0) return misuse(argv[2]);
    return check_main(argc, argv);
}
