/* world.c — the World (ranks as threads or MPI processes), each rank's Dev,
 * scope, string interning and the host-side barrier/allgather. */
#include "runtime/internal.h"
#include "runtime/util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

void openblas_set_num_threads(int num_threads); /* OpenBLAS; no header needed */

/* ------------------------------------------------------------- interning */

/* ----------------------------------------------------------------- world */

World *world_create(const WorldConfig *cfg) {
    if (!cfg) fatal("world_create: no config");
    if (cfg->world_size < 1 || cfg->world_size > WORLD_MAX_RANKS)
        fatal("world size %d is out of range (1..%d ranks)", cfg->world_size, WORLD_MAX_RANKS);
    if (cfg->link_gbps < 0 || cfg->link_latency_us < 0)
        fatal("link model: --link-gbps and --link-latency-us must be >= 0");
    if (!(cfg->collective_timeout_s >= 0) || cfg->collective_timeout_s > 1e7)
        fatal("--collective-timeout-s must be between 0 (off) and 1e7 seconds (got %g)", cfg->collective_timeout_s);
    World *w = xcalloc(1, sizeof *w);
    w->cfg = *cfg;
    pthread_mutex_init(&w->report_mu, NULL);
    pthread_cond_init(&w->report_cv, NULL);
    pthread_mutex_init(&w->mu, NULL);
    pthread_mutex_init(&w->host_mu, NULL);
    pthread_cond_init(&w->host_cv, NULL);
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    if (cores < 1) cores = 1;
#ifdef HWFSDP_CUDA
    if (cfg->backend == BACKEND_MPI)
        fatal("--backend mpi is the CPU build's multi-process backend; the CUDA build uses nccl-mpi under mpirun");
#else
    if (cfg->backend == BACKEND_NCCL || cfg->backend == BACKEND_NCCL_MPI)
        fatal("--backend %s needs the CUDA build (make cuda, then build-cuda/.../train)", backend_name(cfg->backend));
#endif
    if (cfg->backend == BACKEND_LOCAL || cfg->backend == BACKEND_NCCL) {
        w->local_ranks = cfg->world_size;
        w->first_local_rank = 0;
        w->epoch_us = now_us();
    } else if (backend_is_multiprocess(cfg->backend)) {
#ifdef HAVE_MPI
        int inited = 0, provided = 0;
        MPI_Initialized(&inited);
        if (!inited) {
            MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &provided);
            w->mpi_initialized_here = 1;
        } else {
            MPI_Query_thread(&provided);
        }
        if (provided < MPI_THREAD_MULTIPLE)
            fatal("MPI does not provide MPI_THREAD_MULTIPLE (got level %d); streams need it", provided);
        int size = 0, rank = 0;
        MPI_Comm_size(MPI_COMM_WORLD, &size);
        MPI_Comm_rank(MPI_COMM_WORLD, &rank);
        if (size != cfg->world_size) {
            if (rank != 0) sleep(5); /* one message (rank 0's); mpirun then stops the job */
            fatal("--world %d but mpirun started %d processes", cfg->world_size, size);
        }
        MPI_Comm_dup(MPI_COMM_WORLD, &w->host_comm);
        w->local_ranks = 1;
        w->first_local_rank = rank;
        /* ranks on this node share its cores */
        MPI_Comm node;
        int node_size = 1;
        MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
        MPI_Comm_size(node, &node_size);
        MPI_Comm_free(&node);
        cores = cores / node_size;
        MPI_Barrier(w->host_comm);
        w->epoch_us = now_us(); /* same machine: CLOCK_MONOTONIC is shared, ranks line up */
#else
        fatal("this build has no MPI support (rebuild with OpenMPI installed)");
#endif
    } else {
        fatal("unknown collective backend %d", (int)cfg->backend);
    }
    int blas = cfg->blas_threads > 0 ? cfg->blas_threads : (int)(cores / w->local_ranks);
    if (blas < 1) blas = 1;
    openblas_set_num_threads(blas);
    backend_world_init(w);
    return w;
}

int world_local_ranks(const World *w) { return w->local_ranks; }

const char *backend_name(CollBackend b) {
    switch (b) {
    case BACKEND_LOCAL: return "local";
    case BACKEND_MPI: return "mpi";
    case BACKEND_NCCL: return "nccl";
    case BACKEND_NCCL_MPI: return "nccl-mpi";
    }
    return "?";
}

int dev_is_cuda_build(void) {
#ifdef HWFSDP_CUDA
    return 1;
#else
    return 0;
#endif
}
int world_first_local_rank(const World *w) { return w->first_local_rank; }

CollChannel *world_channel(World *w, int stream_index, int pg_id, int color) {
    pthread_mutex_lock(&w->mu);
    CollChannel *c = NULL;
    for (int i = 0; i < w->nchans && !c; i++) {
        CollChannel *k = w->chans[i];
        if (k->stream_index == stream_index && k->pg_id == pg_id && k->color == color) c = k;
    }
    if (!c) {
        if (w->nchans == w->chans_cap) {
            w->chans_cap = w->chans_cap ? w->chans_cap * 2 : 8;
            w->chans = xrealloc(w->chans, (size_t)w->chans_cap * sizeof *w->chans);
        }
        c = xcalloc(1, sizeof *c);
        c->stream_index = stream_index;
        c->pg_id = pg_id;
        c->color = color;
        pthread_mutex_init(&c->mu, NULL);
        cond_init_monotonic(&c->cv);
        w->chans[w->nchans++] = c;
    }
    pthread_mutex_unlock(&w->mu);
    return c;
}

void world_destroy(World *w) {
    if (!w) return;
    backend_world_fini(w);
    for (int i = 0; i < w->nchans; i++) {
        pthread_mutex_destroy(&w->chans[i]->mu);
        pthread_cond_destroy(&w->chans[i]->cv);
        free(w->chans[i]);
    }
    free(w->chans);
#ifdef HAVE_MPI
    if (backend_is_multiprocess(w->cfg.backend)) {
        MPI_Comm_free(&w->host_comm);
        if (w->mpi_initialized_here) MPI_Finalize();
    }
#endif
    pthread_mutex_destroy(&w->mu);
    pthread_mutex_destroy(&w->host_mu);
    pthread_cond_destroy(&w->host_cv);
    pthread_mutex_destroy(&w->report_mu);
    pthread_cond_destroy(&w->report_cv);
    for (int r = 0; r < WORLD_MAX_RANKS; r++) free(w->race_msg[r]);
    free(w);
}

/* ------------------------------------------------------------------ Dev */

Stream *stream_new(Dev *d, const char *name) {
    if (d->nstreams >= 64) fatal("rank %d: dev_stream_create('%s'): at most 64 streams per rank", d->rank, name ? name : "");
    Stream *s = xcalloc(1, sizeof *s);
    s->dev = d;
    s->index = d->nstreams;
    s->name = xstrdup(name ? name : "stream");
    pthread_mutex_init(&s->mu, NULL);
    return s;
}

void dev_add_stream(Dev *d, Stream *s) {
    if (d->nstreams == d->streams_cap) {
        d->streams_cap = d->streams_cap ? d->streams_cap * 2 : 4;
        d->streams = xrealloc(d->streams, (size_t)d->streams_cap * sizeof *d->streams);
    }
    d->streams[d->nstreams++] = s;
}

static Dev *dev_create(World *w, int rank) {
    Dev *d = xcalloc(1, sizeof *d);
    d->world = w;
    d->rank = rank;
    d->world_size = w->cfg.world_size;
    d->scope.step = -1;
    d->scope.micro = -1;
    d->scope.module = dev_intern(d, "");
    d->scope.phase = dev_intern(d, "");
    d->scope.tracing = w->cfg.trace != 0;
    d->mem.prio_state = 0x9E3779B97F4A7C15ull ^ (uint64_t)(rank + 1);
    pthread_mutex_init(&d->trace.mu, NULL);
    pthread_mutex_init(&d->flight.mu, NULL);
    d->race.on = !w->cfg.no_race_check && !dev_is_cuda_build(); /* the detector models the CPU streams */
    backend_dev_init(d);
    dev_groups_init(d);
    dev_stream_create(d, "compute");
    return d;
}

static void dev_destroy(Dev *d) {
    dev_synchronize(d);
    for (int i = 0; i < d->nstreams; i++) stream_destroy(d->streams[i]);
    free(d->streams);
    for (int i = 0; i < d->nevents; i++) event_free(d->events[i]);
    free(d->events);
    dev_alloc_destroy(d);
    dev_clip_probe_free(d);
    backend_dev_fini(d);
    dev_groups_fini(d);
    free(d->race.host_vc);
    free(d->flight.rings);
    pthread_mutex_destroy(&d->flight.mu);
    free(d->trace.recs);
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

static void *rank_thread(void *p) {
    RankStart *rs = p;
    World *w = rs->w;
    Dev *d = dev_create(w, rs->rank);
    pthread_mutex_lock(&w->report_mu); /* the watchdog may be reading the flight recorders */
    w->devs[rs->rank - w->first_local_rank] = d;
    pthread_mutex_unlock(&w->report_mu);
    rs->fn(d, rs->arg);
    /* nobody may still be reading this rank's trace (dev_write_artifacts ends with a barrier) */
    pthread_mutex_lock(&w->report_mu);
    w->devs[rs->rank - w->first_local_rank] = NULL;
    w->rank_done[rs->rank - w->first_local_rank] = 1;
    pthread_cond_broadcast(&w->report_cv);
    pthread_mutex_unlock(&w->report_mu);
    dev_destroy(d);
    return NULL;
}

void world_run(World *w, void (*rank_main)(Dev *dev, void *arg), void *arg) {
    int n = w->local_ranks;
    RankStart *rs = xcalloc((size_t)n, sizeof *rs);
    for (int i = 0; i < n; i++) rs[i] = (RankStart){w, w->first_local_rank + i, rank_main, arg};
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
void dev_set_tracing(Dev *d, int on) { d->scope.tracing = on != 0; }
int dev_tracing(const Dev *d) { return d->scope.tracing; }

/* ------------------------------------------------- host barrier / gather */

/* Local backend: a generation barrier; values are double-buffered by
 * generation parity so a fast rank's next call cannot overwrite values a
 * slow rank has not read yet. */
static void local_host_exchange(Dev *d, double value, double *out) {
    World *w = d->world;
    pthread_mutex_lock(&w->host_mu);
    uint64_t gen = w->host_gen;
    w->host_vals[gen & 1][d->rank] = value;
    if (++w->host_arrived == w->cfg.world_size) {
        w->host_arrived = 0;
        w->host_gen++;
        pthread_cond_broadcast(&w->host_cv);
    } else {
        while (w->host_gen == gen) pthread_cond_wait(&w->host_cv, &w->host_mu);
    }
    if (out) memcpy(out, w->host_vals[gen & 1], (size_t)w->cfg.world_size * sizeof *out);
    pthread_mutex_unlock(&w->host_mu);
}

void dev_host_allgather_f64(Dev *d, double value, double *out) {
#ifdef HAVE_MPI
    if (backend_is_multiprocess(d->world->cfg.backend)) {
        MPI_Allgather(&value, 1, MPI_DOUBLE, out, 1, MPI_DOUBLE, d->world->host_comm);
        return;
    }
#endif
    local_host_exchange(d, value, out);
}

void dev_host_barrier(Dev *d) {
#ifdef HAVE_MPI
    if (backend_is_multiprocess(d->world->cfg.backend)) {
        MPI_Barrier(d->world->host_comm);
        return;
    }
#endif
    local_host_exchange(d, 0.0, NULL);
}

/* ------------------------------------------------------- one race report */


