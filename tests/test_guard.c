/* test_guard.c — the device-memory guard (runtime/guard.h: --guard-device-memory).
 *
 *   ./test_guard               unit tests: a guarded world's copies, probes, memsets,
 *                              pinned host memory and poison work as unguarded
 *   ./test_guard --mode KIND   host code touching a device buffer of rank 1 (tests/test_guard.py
 *                              checks the one line): host_read, host_write, host_memcmp read it on
 *                              the host (the guard stops them); probe_read reads it through
 *                              dev_probe_read (passes, prints "ok"); pinned_read reads pinned host
 *                              memory (host memory: allowed, prints "ok")
 *   ./test_guard --mode KIND --dry   the same in a dry run (--dry-run: runtime/dry.h), unguarded:
 *                              every touch stops, pinned host memory's too (nothing backs it);
 *                              probe_read is the runtime's misuse (one line, exit 2)
 *
 * Without protection keys the guard says so in one line and the world runs unguarded. */
#include "check.h"
#include "local_world.h"
#include "runtime/runtime.h"
#include "runtime/util.h"

#include <stdio.h>
#include <string.h>

#define N 256

static WorldConfig guarded(int n) {
    WorldConfig c = local_config(n);
    c.guard_device = 1;
    c.poison = 1;
    return c;
}

/* ---------------------------------------------------------------- modes */

/* Host code reading device memory as the probes once did (a GPU crashes here). */
__attribute__((noinline)) static float peek_weights(const float *w) {
    const volatile float *v = w;
    return v[32]; /* byte offset 128 */
}
__attribute__((noinline)) static void poke_weights(float *w) {
    volatile float *v = w;
    v[3] = 1.0f; /* byte offset 12 */
}
__attribute__((noinline)) static int compare_weights(const float *w, const float *want) {
    return memcmp(w, want, N * sizeof(float)) != 0; /* in libc: its caller is named (no tail call) */
}

static void mode_rank(Dev *d, void *arg) {
    const char *kind = arg;
    Stream *s = dev_compute_stream(d);
    float *w = dev_alloc_f32(d, N, MEM_PARAM, "layers.0.attention.wq.weight");
    dev_memset_async(s, w, 0, N * sizeof(float));
    dev_stream_synchronize(s);
    dev_host_barrier(d);
    if (dev_rank(d) == 1) {
        float host[N], zeros[N] = {0};
        if (!strcmp(kind, "host_read")) {
            printf("read %g\n", (double)peek_weights(w));
        } else if (!strcmp(kind, "host_write")) {
            poke_weights(w);
        } else if (!strcmp(kind, "host_memcmp")) {
            printf("compare %d\n", compare_weights(w, zeros));
        } else if (!strcmp(kind, "probe_read")) {
            dev_probe_read(d, host, w, sizeof host); /* the runtime's copy: allowed */
            printf("%s\n", memcmp(host, zeros, sizeof host) ? "mismatch" : "ok");
        } else if (!strcmp(kind, "pinned_read")) {
            float *pinned = dev_alloc_host_f32(d, N, MEM_OPTIM_STATE, "exp_avg.pinned");
            printf("%s\n", peek_weights(pinned) == peek_weights(pinned) ? "mismatch" : "ok"); /* NaN-filled */
            dev_free(d, pinned);
        }
        fflush(stdout);
    }
    dev_host_barrier(d);
    dev_free(d, w);
}

static int run_mode(const char *kind, int dry) {
    if (strcmp(kind, "host_read") && strcmp(kind, "host_write") && strcmp(kind, "host_memcmp") &&
        strcmp(kind, "probe_read") && strcmp(kind, "pinned_read"))
        fatal("test_guard: unknown mode '%s'", kind);
    WorldConfig c = guarded(2);
    if (dry) {
        c.guard_device = 0;
        c.dry_run = 1;
    }
    run_world(c, mode_rank, (void *)kind);
    return 0;
}

/* ---------------------------------------------------------------- unit tests */


static void k_fill(void *p) { /* a kernel (stream worker): may touch device memory */
    float *w = *(float **)p;
    for (int i = 0; i < N; i++) w[i] = (float)i;
}

static void copies_rank(Dev *d, void *arg) {
    (void)arg;
    Stream *s = dev_compute_stream(d);
    float *w = dev_alloc_f32(d, N, MEM_PARAM, "w");
    float *g = dev_alloc_f32(d, N, MEM_GRAD_SHARD, "g");
    float *pinned = dev_alloc_host_f32(d, N, MEM_TEMP, "pinned");
    float fresh[N], host[N];
    dev_probe_read(d, fresh, w, sizeof fresh); /* the allocator's poison went through its own open */
    int nan_all = 1;
    for (int i = 0; i < N; i++) nan_all &= isnan(fresh[i]);
    TCHECK(nan_all, "rank %d: fresh device storage is not NaN-poisoned", dev_rank(d));
    dev_launch(s, "fill", TEST_COST, k_fill, &w, sizeof w);
    dev_memcpy_async(s, g, w, N * sizeof(float));     /* device -> device */
    dev_memcpy_async(s, pinned, g, N * sizeof(float)); /* device -> pinned host */
    dev_stream_synchronize(s);
    int ok = 1;
    for (int i = 0; i < N; i++) ok &= pinned[i] == (float)i; /* host code reads pinned host memory */
    TCHECK(ok, "rank %d: the d2h copy into pinned memory", dev_rank(d));
    for (int i = 0; i < N; i++) pinned[i] = (float)(2 * i); /* ... and writes it */
    dev_memcpy_async(s, w, pinned, N * sizeof(float));     /* host -> device */
    dev_memset_async(s, g, 0, N * sizeof(float));
    dev_probe_read(d, host, w, sizeof host);
    ok = 1;
    for (int i = 0; i < N; i++) ok &= host[i] == (float)(2 * i);
    TCHECK(ok, "rank %d: the h2d copy, read through dev_probe_read", dev_rank(d));
    float *slot = stream_clip_slot(s); /* probe memory: guarded too, read through the collect */
    dev_launch(s, "fill_slot", TEST_COST, k_fill, &w, sizeof w);
    dev_memcpy_async(s, slot, w + 7, sizeof(float));
    float coef[1];
    TCHECK(dev_clip_collect(d, coef, 1) == 1 && coef[0] == 7.0f, "rank %d: the clip probe", dev_rank(d));
    dev_free(d, pinned);
    dev_free(d, g);
    dev_free(d, w);
}

TEST(guarded_world_copies) { run_world(guarded(2), copies_rank, NULL); }

static void sum_rank(Dev *d, void *arg) {
    (void)arg;
    Stream *s = dev_compute_stream(d);
    float *x = dev_alloc_f32(d, N, MEM_GRAD_SHARD, "x");
    float *pinned = dev_alloc_host_f32(d, N, MEM_TEMP, "pinned");
    for (int i = 0; i < N; i++) pinned[i] = (float)(dev_rank(d) + 1);
    dev_memcpy_async(s, x, pinned, N * sizeof(float));
    coll_all_reduce(d, x, x, N, RED_SUM, s, "sum");
    float host[N];
    dev_probe_read(d, host, x, sizeof host);
    int ok = 1;
    for (int i = 0; i < N; i++) ok &= host[i] == 3.0f; /* ranks 1 + 2 */
    TCHECK(ok, "rank %d: an all_reduce on guarded storage", dev_rank(d));
    dev_free(d, pinned);
    dev_free(d, x);
}

TEST(guarded_world_collective) { run_world(guarded(2), sum_rank, NULL); }

int main(int argc, char **argv) {
    if (argc > 2 && strcmp(argv[1], "--mode") == 0) return run_mode(argv[2], argc > 3 && !strcmp(argv[3], "--dry"));
    return check_main(argc, argv);
}
