/* stream.c — streams (a worker thread per stream executing a FIFO of ops),
 * events, launches, async copies and host synchronization. */
#include "runtime/internal.h"
#include "runtime/util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ----------------------------------------------------------------- trace */

static void trace_op(Stream *s, const Op *op, const char *prefix, const char *cat, double t0, double t1) {
    if (!op->traced) return;
    TraceRec r = {prefix, op->name, op->module, op->phase, cat, s->index, op->step,
                  t0 - s->dev->world->epoch_us, t1 - t0, op->bytes, op->micro,
                  op->kind == OP_COLL ? coll_dtype_name(op->coll.dtype) : NULL,
                  op->kind == OP_COLL && op->pg ? op->pg->name : NULL};
    dev_trace_add(s->dev, &r);
}

/* A host wait that began at t0 (now_us) and ends now, on the host's track. */
static void trace_host_sync(Dev *d, const char *what, const char *name, double t0) {
    if (!d->scope.tracing) return;
    double t1 = now_us();
    char full[160];
    snprintf(full, sizeof full, "sync:%s%s", what, name ? name : "");
    TraceRec r = {"", dev_intern(d, full), d->scope.module, d->scope.phase, "host_sync", TRACE_HOST_TID,
                  d->scope.step, t0 - d->world->epoch_us, t1 - t0, 0, d->scope.micro, NULL, NULL};
    dev_trace_add(d, &r);
}

/* ---------------------------------------------------------------- events */

static void event_unref(Event *e) {
    pthread_mutex_lock(&e->mu);
    int last = --e->refs == 0 && e->destroyed;
    pthread_mutex_unlock(&e->mu);
    if (last) event_free(e);
}

static void run_record(Stream *s, const Op *op) {
    Event *e = op->event;
    double t0 = now_us();
    pthread_mutex_lock(&e->mu);
    if (op->record_no > e->completed) e->completed = op->record_no;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    trace_op(s, op, op->module, "event", t0, now_us());
    event_unref(e);
}

static void run_wait(Stream *s, const Op *op) {
    Event *e = op->event;
    double t0 = now_us(), t1 = t0;
    pthread_mutex_lock(&e->mu);
    if (e->completed < op->record_no) {
        e->waiting++;
        while (e->completed < op->record_no) pthread_cond_wait(&e->cv, &e->mu);
        e->waiting--;
        t1 = now_us();
    }
    pthread_mutex_unlock(&e->mu);
    if (t1 - t0 > 1.0) trace_op(s, op, NULL, "wait", t0, t1);
    event_unref(e);
}

/* ---------------------------------------------------------------- worker */

/* The PCIe model: a host <-> device copy of `bytes` that began at t0 lasts
 * latency + bytes / bandwidth (the memcpy itself counts toward it). */
static void pcie_wait(const WorldConfig *cfg, size_t bytes, double t0) {
    if (cfg->pcie_gbps <= 0) return;
    double until = t0 + cfg->pcie_latency_us + (double)bytes / (cfg->pcie_gbps * 1e9) * 1e6;
    for (;;) {
        double left = until - now_us();
        if (left <= 0) return;
        struct timespec ts = {(time_t)(left / 1e6), (long)((left - (double)(time_t)(left / 1e6) * 1e6) * 1e3)};
        if (nanosleep(&ts, NULL) == 0) return;
    }
}

static void execute(Stream *s, Op *op) {
    double t0, t1;
    switch (op->kind) {
    case OP_LAUNCH:
        t0 = now_us();
        op->fn(op->args);
        t1 = now_us();
        trace_op(s, op, op->module, "compute", t0, t1);
        break;
    case OP_COPY:
        t0 = now_us();
        if (op->bytes && op->dst != op->src) memmove(op->dst, op->src, op->bytes);
        if (op->pcie) pcie_wait(&s->dev->world->cfg, op->bytes, t0);
        t1 = now_us();
        trace_op(s, op, op->module, "copy", t0, t1);
        break;
    case OP_MEMSET:
        t0 = now_us();
        if (op->bytes) memset(op->dst, op->fill, op->bytes);
        t1 = now_us();
        trace_op(s, op, op->module, "copy", t0, t1);
        break;
    case OP_RECORD: run_record(s, op); break;
    case OP_WAIT: run_wait(s, op); break;
    case OP_COLL:
        t0 = now_us();
        op->exec(s, op);
        t1 = now_us();
        trace_op(s, op, op->label, "collective", t0, t1);
        break;
    }
}

static void *stream_worker(void *p) {
    Stream *s = p;
    Op op;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (s->count == 0 && !s->stop) pthread_cond_wait(&s->cv_work, &s->mu);
        if (s->count == 0) break; /* stop requested and queue drained */
        memcpy(&op, &s->ring[s->head], sizeof op);
        pthread_mutex_unlock(&s->mu);
        execute(s, &op);
        pthread_mutex_lock(&s->mu);
        s->head = (s->head + 1) % s->ring_cap;
        s->count--;
        s->completed++;
        pthread_cond_broadcast(&s->cv_done);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* Fill the scope fields of op from the host's current scope. */
static void op_init(Stream *s, Op *op, OpKind kind, const char *name) {
    Dev *d = s->dev;
    memset(op, 0, offsetof(Op, args));
    op->kind = kind;
    op->traced = d->scope.tracing;
    op->name = dev_intern(d, name ? name : "op");
    op->module = d->scope.module;
    op->phase = d->scope.phase;
    op->step = d->scope.step;
    op->micro = d->scope.micro;
}

static void enqueue(Stream *s, const Op *op, size_t args_size) {
    race_on_enqueue(s, op); /* host order: the verdict never depends on timing */
    pthread_mutex_lock(&s->mu);
    if (s->count == s->ring_cap) {
        size_t ncap = s->ring_cap ? s->ring_cap * 2 : 64;
        Op *nr = xmalloc(ncap * sizeof *nr);
        for (size_t i = 0; i < s->count; i++) memcpy(&nr[i], &s->ring[(s->head + i) % s->ring_cap], sizeof *nr);
        free(s->ring);
        s->ring = nr;
        s->ring_cap = ncap;
        s->head = 0;
    }
    Op *slot = &s->ring[(s->head + s->count) % s->ring_cap];
    memcpy(slot, op, offsetof(Op, args) + args_size);
    s->count++;
    s->enqueued++;
    pthread_cond_signal(&s->cv_work);
    pthread_mutex_unlock(&s->mu);
}

static uint64_t stream_completed(Stream *s) {
    pthread_mutex_lock(&s->mu);
    uint64_t c = s->completed;
    pthread_mutex_unlock(&s->mu);
    return c;
}

/* ------------------------------------------------- storage and fences */

/* CPU backend: storage is the C heap (one pool for every stream, so freed
 * storage waits for every stream: backend_storage_fenced); a fence is the
 * count of ops enqueued on each stream of its mask, ready when those streams'
 * workers have passed it. */
void *backend_storage_alloc(Dev *d, size_t bytes, int stream, const char *name) {
    (void)stream;
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes) != 0 || !p)
        fatal("rank %d: out of memory allocating %zu bytes for '%s' (%zu bytes allocated now)", d->rank, bytes,
              name ? name : "?", d->mem.current);
    if (d->world->cfg.poison) {
        uint32_t nan_bits = 0x7fc00000u;
        size_t nf = bytes / 4;
        uint32_t *w = p;
        for (size_t i = 0; i < nf; i++) w[i] = nan_bits;
    }
    d->mem.reserved += bytes;
    return p;
}

void backend_storage_free(Dev *d, void *p, size_t bytes, int stream) {
    (void)stream;
    free(p);
    d->mem.reserved -= bytes;
}

int backend_storage_fenced(void) { return 1; }

/* Host memory is the C heap here too: the same storage, NaN-filled alike; not device-reserved. */
void *backend_host_alloc(Dev *d, size_t bytes, const char *name) {
    void *p = backend_storage_alloc(d, bytes, 0, name);
    d->mem.reserved -= bytes;
    return p;
}

void backend_host_free(Dev *d, void *p, size_t bytes) {
    (void)d, (void)bytes;
    free(p);
}

int backend_fence_create(Dev *d, PendingFree *pf) {
    pf->snapshot = xcalloc((size_t)(d->nstreams ? d->nstreams : 1), sizeof(uint64_t));
    pf->nstreams = d->nstreams;
    int busy = 0;
    for (int i = 0; i < d->nstreams; i++) {
        if (!(pf->mask >> i & 1)) continue; /* 0: nothing to wait for (stream_new: at most 64 streams) */
        Stream *s = d->streams[i];
        pthread_mutex_lock(&s->mu);
        pf->snapshot[i] = s->enqueued;
        busy |= s->completed < s->enqueued;
        pthread_mutex_unlock(&s->mu);
    }
    return busy;
}

int backend_fence_ready(Dev *d, const PendingFree *p) {
    for (int i = 0; i < p->nstreams; i++)
        if (stream_completed(d->streams[i]) < p->snapshot[i]) return 0;
    return 1;
}

void backend_fence_release(Dev *d, PendingFree *pf) {
    (void)d;
    free(pf->snapshot);
    pf->snapshot = NULL;
}

/* --------------------------------------------------------------- streams */


Stream *dev_stream_create(Dev *d, const char *name) {
    Stream *s = stream_new(d, name);
    pthread_cond_init(&s->cv_work, NULL);
    pthread_cond_init(&s->cv_done, NULL);
#ifdef HAVE_MPI
    if (d->world->cfg.backend != BACKEND_LOCAL) { /* collective: streams are created in the same order on every rank (the watchdog catches a rank that does not) */
        MPI_Request req;
        MPI_Comm_idup(MPI_COMM_WORLD, &s->comm, &req);
        double timeout = d->world->cfg.collective_timeout_s, deadline = now_us() + timeout * 1e6;
        for (int done = 0, polls = 0; !done; polls++) {
            MPI_Test(&req, &done, MPI_STATUS_IGNORE);
            if (!done && timeout > 0 && now_us() > deadline)
                fatal("collective timeout on rank %d: dev_stream_create('%s') (stream index %d) waited %.1f s for the "
                      "other ranks (every rank must create the same streams in the same order)",
                      d->rank, s->name, s->index, timeout);
            if (!done && polls > 1000) {
                struct timespec ts = {0, 20000};
                nanosleep(&ts, NULL);
            }
        }
    }
#endif
    stream_join_groups(s);
    dev_add_stream(d, s);
    race_stream_created(d, s);
    flight_stream_created(d, s);
    if (pthread_create(&s->thread, NULL, stream_worker, s) != 0)
        fatal("cannot start the worker thread of stream '%s'", s->name);
    return s;
}

void stream_destroy(Stream *s) {
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_signal(&s->cv_work);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
#ifdef HAVE_MPI
    if (s->dev->world->cfg.backend == BACKEND_MPI) {
        MPI_Comm_free(&s->comm);
        for (int i = 1; i < s->dev->npgs; i++) MPI_Comm_free(&s->pg_comms[i]);
    }
#endif
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv_work);
    pthread_cond_destroy(&s->cv_done);
    race_stream_destroy(s);
    free(s->ring);
    free(s->name);
    free(s);
}


void dev_launch(Stream *s, const char *name, void (*fn)(void *args), const void *args, size_t args_size) {
    dev_launch_check(name, fn, args_size);
    Op op;
    op_init(s, &op, OP_LAUNCH, name);
    op.fn = fn;
    if (args_size) memcpy(op.args, args, args_size);
    enqueue(s, &op, args_size);
}

/* A copy (src != NULL) or a fill of `bytes` at dst, in stream order. */
static void enqueue_mem(Stream *s, OpKind kind, const char *name, void *dst, const void *src, int fill, size_t bytes) {
    Op op;
    op_init(s, &op, kind, name);
    op.dst = dst;
    op.src = src;
    op.fill = fill;
    op.bytes = bytes;
    enqueue(s, &op, 0);
}

void dev_memcpy_async(Stream *s, void *dst, const void *src, size_t bytes) {
    if (bytes && (!dst || !src)) fatal("dev_memcpy_async: NULL pointer with %zu bytes", bytes);
    int dir = bytes ? dev_copy_direction(s->dev, dst, src) : 0;
    Op op;
    op_init(s, &op, OP_COPY, copy_direction_name(dir));
    op.dst = dst;
    op.src = src;
    op.bytes = bytes;
    op.pcie = dir;
    enqueue(s, &op, 0);
}

void dev_memset_async(Stream *s, void *dst, int byte, size_t bytes) {
    if (bytes && !dst) fatal("dev_memset_async: NULL pointer with %zu bytes", bytes);
    enqueue_mem(s, OP_MEMSET, "memset", dst, NULL, byte, bytes);
}

/* Used by collectives.c to enqueue a collective op. */
void stream_enqueue_op(Stream *s, const Op *op) { enqueue(s, op, 0); }
void stream_op_init(Stream *s, Op *op, int kind, const char *name) { op_init(s, op, (OpKind)kind, name); }

/* Block until s has run everything enqueued so far (the host-side wait of every sync). */
static void stream_drain(Stream *s) {
    pthread_mutex_lock(&s->mu);
    uint64_t target = s->enqueued;
    while (s->completed < target) pthread_cond_wait(&s->cv_done, &s->mu);
    pthread_mutex_unlock(&s->mu);
}

void dev_stream_synchronize(Stream *s) {
    double t0 = now_us();
    stream_drain(s);
    race_host_waited_stream(s);
    dev_release_pending_frees(s->dev, 0);
    trace_host_sync(s->dev, "", s->name, t0);
}

void dev_synchronize(Dev *d) {
    double t0 = now_us();
    for (int i = 0; i < d->nstreams; i++) stream_drain(d->streams[i]);
    race_host_waited_all(d);
    dev_release_pending_frees(d, 0);
    trace_host_sync(d, "all streams", NULL, t0);
}

/* ---------------------------------------------------------------- events */

Event *dev_event_create(Dev *d, const char *name) { return event_register_new(d, name); }

void dev_event_destroy(Event *e) {
    if (!e) return;
    event_unregister(e);
    /* queued records/waits may still point at it: the last one frees it */
    pthread_mutex_lock(&e->mu);
    e->destroyed = 1;
    int last = e->refs == 0;
    pthread_mutex_unlock(&e->mu);
    if (last) event_free(e);
}

void dev_event_record(Event *e, Stream *s) {
    if (e->dev != s->dev) fatal("event '%s' of rank %d recorded on a stream of rank %d", e->name, e->dev->rank, s->dev->rank);
    Op op;
    char name[300];
    snprintf(name, sizeof name, "record:%s", e->name);
    op_init(s, &op, OP_RECORD, name);
    pthread_mutex_lock(&e->mu);
    op.record_no = ++e->recorded;
    e->refs++;
    pthread_mutex_unlock(&e->mu);
    op.event = e;
    enqueue(s, &op, 0);
}

/* The record number a wait/sync/query refers to; fatal if never recorded. */
static uint64_t last_record(Event *e) {
    pthread_mutex_lock(&e->mu);
    uint64_t n = e->recorded;
    pthread_mutex_unlock(&e->mu);
    if (n == 0) fatal("event '%s' waited on but never recorded", e->name);
    return n;
}

void dev_stream_wait_event(Stream *s, Event *e) {
    if (e->dev != s->dev) fatal("event '%s' of rank %d waited on by a stream of rank %d", e->name, e->dev->rank, s->dev->rank);
    uint64_t n = last_record(e);
    Op op;
    char name[300];
    snprintf(name, sizeof name, "wait:%s", e->name);
    op_init(s, &op, OP_WAIT, name);
    op.event = e;
    op.record_no = n;
    pthread_mutex_lock(&e->mu);
    e->refs++;
    pthread_mutex_unlock(&e->mu);
    enqueue(s, &op, 0);
}

void dev_event_synchronize(Event *e) {
    double t0 = now_us();
    uint64_t n = last_record(e);
    pthread_mutex_lock(&e->mu);
    while (e->completed < n) pthread_cond_wait(&e->cv, &e->mu);
    pthread_mutex_unlock(&e->mu);
    race_host_waited_event(e);
    dev_release_pending_frees(e->dev, 0);
    trace_host_sync(e->dev, "event ", e->name, t0);
}

int dev_event_query(Event *e) {
    uint64_t n = last_record(e);
    pthread_mutex_lock(&e->mu);
    int done = e->completed >= n;
    pthread_mutex_unlock(&e->mu);
    if (done) race_host_waited_event(e); /* the host saw it complete: later enqueues are ordered after it */
    return done;
}

/* ------------------------------------------------- backend hooks (CPU) */

/* The CPU backend keeps no state beyond the shared structures. */
void backend_world_init(World *w) { (void)w; }
void backend_world_fini(World *w) { (void)w; }
void *backend_probe_alloc(Dev *d, size_t bytes) {
    (void)d;
    return xcalloc(1, bytes);
}
void backend_probe_free(Dev *d, void *p) {
    (void)d;
    free(p);
}
void backend_probe_read(Dev *d, void *host, const void *probe, size_t bytes) {
    for (int i = 0; i < d->nstreams; i++) stream_drain(d->streams[i]); /* no happens-before: a probe */
    memcpy(host, probe, bytes);
}

void backend_dev_init(Dev *d) { (void)d; }
void backend_dev_fini(Dev *d) { (void)d; }
void backend_event_fini(Event *e) { (void)e; }

/* mpi: the stream's own communicator for g, split from the host's (MPI_Comm_split
 * is collective: every rank makes its groups and streams in the same order) */
void backend_stream_join_group(Stream *s, ProcessGroup *g) {
#ifdef HAVE_MPI
    if (s->dev->world->cfg.backend == BACKEND_MPI)
        MPI_Comm_split(s->dev->world->host_comm, g->color, s->dev->rank, &s->pg_comms[g->id]);
#else
    (void)s, (void)g;
#endif
}
