/* world.c — the World (ranks as threads, or processes: the backend's
 * world_init), each rank's Dev and its scope. */
#include "runtime/guard.h"
#include "runtime/internal.h"
#include "runtime/profile.h"
#include "runtime/util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

void openblas_set_num_threads(int num_threads); /* OpenBLAS; no header needed */

/* ----------------------------------------------------------------- world */

World *world_create(const WorldConfig *cfg) {
    if (!cfg) fatal("world_create: no config");
    const int rep = cfg->rep_stride, max = rep ? WORLD_MAX_DRY_RANKS : WORLD_MAX_RANKS;
    if (cfg->world_size < 1 || cfg->world_size > max)
        fatal("world size %d is out of range (1..%d ranks%s)", cfg->world_size, max,
              rep ? " with representative ranks" : "");
    if (rep < 0 || (rep && cfg->world_size % rep))
        fatal("representative ranks every %d ranks: the classes of symmetric ranks must split the world of %d", rep,
              cfg->world_size);
    if (rep && (!cfg->dry_run || cfg->backend != BACKEND_LOCAL))
        fatal("representative ranks stand for ranks that never execute: a dry run's (--dry-run) of the local "
              "backend only, not a run that computes or one with a process per rank");
    if (rep && cfg->world_size / rep > WORLD_MAX_RANKS)
        fatal("representative ranks every %d ranks of %d: %d of them execute, at most %d", rep, cfg->world_size,
              cfg->world_size / rep, WORLD_MAX_RANKS);
    if (cfg->link_gbps < 0 || cfg->link_latency_us < 0)
        fatal("link model: --link-gbps and --link-latency-us must be >= 0");
    if (!(cfg->collective_timeout_s >= 0) || cfg->collective_timeout_s > 1e7)
        fatal("--collective-timeout-s must be between 0 (off) and 1e7 seconds (got %g)", cfg->collective_timeout_s);
    const BackendOps *ops = backend_ops(cfg->backend); /* one line if this build lacks it */
    if (cfg->dry_run && dev_is_cuda_build())
        fatal("--dry-run is a mode of the CPU build (make), which prices every op on a device profile; the CUDA "
              "build (make cuda) runs on the GPU and its own clock");
    World *w = xcalloc(1, sizeof *w);
    w->cfg = *cfg;
    if (cfg->dry_run) w->cfg.poison = 0; /* nothing backs the memory to poison (dry.h) */
    if (!w->cfg.profile) w->cfg.profile = device_profile_find(DEVICE_PROFILE_DEFAULT);
    w->ops = ops;
    const char *guard_env = getenv("HWFSDP_GUARD_DEVICE"); /* any binary, e.g. a test's, can turn it on */
    if (guard_env && *guard_env && strcmp(guard_env, "0") != 0) w->cfg.guard_device = 1;
    w->guarded = guard_install(w); /* before any thread of the world: the main thread loses access here */
    fatal_set_last_words(runtime_last_words); /* a rank stopped by a runtime error leaves its partial record */
    pthread_mutex_init(&w->report_mu, NULL);
    w->facts = world_facts_create();
    pthread_cond_init(&w->report_cv, NULL);
    pthread_mutex_init(&w->host_mu, NULL);
    pthread_cond_init(&w->host_cv, NULL);
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    if (cores < 1) cores = 1;
    w->local_ranks = cfg->world_size / world_stride(w); /* the executed ranks as threads, unless the backend makes
                                                             them processes */
    w->first_local_rank = 0;
    ops->world_init(w, &cores);
    p2p_world_init(w);
    w->epoch_us = now_us(); /* multi-process: after a barrier; one machine's CLOCK_MONOTONIC lines ranks up */
    int blas = cfg->blas_threads > 0 ? cfg->blas_threads : (int)(cores / w->local_ranks);
    if (blas < 1) blas = 1;
    /* guarded: OpenBLAS's pool threads started before the key existed, without access to
     * device memory, so every BLAS call runs on the stream worker that makes it */
    if (w->guarded) blas = 1;
    openblas_set_num_threads(blas);
    return w;
}


int world_first_local_rank(const World *w) { return w->first_local_rank; }

void world_destroy(World *w) {
    if (!w) return;
    w->ops->world_fini(w);
    p2p_world_fini(w);
    guard_world_gone(w);
    pthread_mutex_destroy(&w->host_mu);
    pthread_cond_destroy(&w->host_cv);
    pthread_mutex_destroy(&w->report_mu);
    world_facts_free(w->facts);
    pthread_cond_destroy(&w->report_cv);
    for (int r = 0; r < WORLD_MAX_RANKS; r++) free(w->race_msg[r]);
    free(w);
}

/* ------------------------------------------------------------------ Dev */

static Dev *dev_create(World *w, int rank) {
    Dev *d = xcalloc(1, sizeof *d);
    d->world = w;
    d->rank = rank;
    d->world_size = w->cfg.world_size;
    d->scope.step = -1;
    d->scope.micro = -1;
    d->scope.module = dev_intern(d, "");
    d->scope.phase = dev_intern(d, "");
    d->scope.tracing = 0;
    dev_set_tracing(d, w->cfg.trace);
    d->mem.prio_state = 0x9E3779B97F4A7C15ull ^ (uint64_t)(rank + 1);
    /* the profile's memory holds where its clock prices the ops; a GPU has its own */
    d->mem.capacity = strcmp(w->ops->clock, "model") == 0 ? w->cfg.profile->hbm_capacity_bytes : 0;
    pthread_mutex_init(&d->trace.mu, NULL);
    pthread_mutex_init(&d->flight.mu, NULL);
    d->race.on = !w->cfg.no_race_check && w->ops->race_checked; /* the detector models the CPU streams */
    w->ops->dev_init(d);
    dev_groups_init(d);
    dev_stream_create(d, "compute");
    return d;
}

static void dev_destroy(Dev *d) {
    dev_synchronize(d);
    for (int i = 0; i < d->nstreams; i++) dev_ops(d)->stream_destroy(d->streams[i]);
    free(d->streams);
    for (int i = 0; i < d->nevents; i++) event_free(d->events[i]);
    free(d->events);
    dev_alloc_destroy(d);
    dev_clip_probe_free(d);
    dev_ops(d)->dev_fini(d);
    dev_groups_fini(d);
    free(d->race.host_vc);
    free(d->flight.rings);
    pthread_mutex_destroy(&d->flight.mu);
    free(d->p2p_sent);
    free(d->p2p_recvd);
    free(d->p2p_group ? d->p2p_group->items : NULL);
    free(d->p2p_group);
    free(d->trace.recs);
    free(d->enqueued.recs);
    free(d->partial_dir);
    pthread_mutex_destroy(&d->trace.mu);
    intern_free(&d->strings);
    free(d);
}

typedef struct {
    World *w;
    int rank;
    void (*fn)(Dev *, void *);
    void *arg;
} RankStart;

/* The rank whose host thread this is (world_thread_dev). */
static __thread Dev *t_rank_dev;

Dev *world_thread_dev(void) { return t_rank_dev; }

static void *rank_thread(void *p) {
    RankStart *rs = p;
    World *w = rs->w;
    guard_thread_host(NULL); /* host code: no access to device memory (--guard-device-memory) */
    Dev *d = dev_create(w, rs->rank);
    guard_thread_host(d);
    t_rank_dev = d;
    pthread_mutex_lock(&w->report_mu); /* the watchdog may be reading the flight recorders */
    const int slot = world_rank_slot(w, rs->rank);
    w->devs[slot] = d;
    pthread_mutex_unlock(&w->report_mu);
    rs->fn(d, rs->arg);
    /* nobody may still be reading this rank's trace (dev_write_artifacts ends with a barrier) */
    pthread_mutex_lock(&w->report_mu);
    w->devs[slot] = NULL;
    w->rank_done[slot] = 1;
    pthread_cond_broadcast(&w->report_cv);
    pthread_mutex_unlock(&w->report_mu);
    t_rank_dev = NULL;
    dev_destroy(d);
    return NULL;
}

void world_run(World *w, void (*rank_main)(Dev *dev, void *arg), void *arg) {
    int n = w->local_ranks;
    RankStart *rs = xcalloc((size_t)n, sizeof *rs);
    for (int i = 0; i < n; i++) rs[i] = (RankStart){w, world_slot_rank(w, i), rank_main, arg};
    if (backend_is_multiprocess(w->cfg.backend)) {
        rank_thread(&rs[0]);
    } else {
        pthread_t *th = xcalloc((size_t)n, sizeof *th);
        for (int i = 0; i < n; i++)
            if (pthread_create(&th[i], NULL, rank_thread, &rs[i]) != 0) fatal("cannot start the thread of rank %d", i);
        for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
        free(th);
    }
    free(rs);
}

int dev_rank(const Dev *d) { return d->rank; }
Stream *dev_compute_stream(Dev *d) { return d->streams[0]; }
int stream_index(const Stream *s) { return s->index; }
const char *stream_name(const Stream *s) { return s->name; }

int dev_world_size(const Dev *d) { return d->world_size; }
int dev_executed_count(const Dev *d) { return d->world_size / world_stride(d->world); }
int dev_executed_rank(const Dev *d, int i) { return i * world_stride(d->world); }

/* ---------------------------------------------------------------- scope */

void dev_set_scope(Dev *d, int step, const char *module, const char *phase) {
    d->scope.step = step;
    d->scope.module = dev_intern(d, module ? module : "");
    d->scope.phase = dev_intern(d, phase ? phase : "");
}
const char *dev_scope_module(const Dev *d) { return d->scope.module; }
const char *dev_scope_phase(const Dev *d) { return d->scope.phase; }
int dev_scope_step(const Dev *d) { return d->scope.step; }
void dev_set_microbatch(Dev *d, int micro) { d->scope.micro = micro < 0 ? -1 : micro; }
int dev_scope_microbatch(const Dev *d) { return d->scope.micro; }
/* WorldConfig.trace_ranks keeps the other ranks' traces empty (a 64-rank dry run's would be gigabytes). */
void dev_set_tracing(Dev *d, int on) {
    int traced = !d->world->cfg.trace_ranks || d->rank < d->world->cfg.trace_ranks;
    d->scope.tracing = on != 0 && traced;
}
int dev_tracing(const Dev *d) { return d->scope.tracing; }
