/* stream.c — the CPU backends' streams (stream.h; both "local" and "mpi"):
 * a worker thread per stream executing a FIFO of ops, events, launches, async
 * copies, host synchronization and storage from the C heap. An op's times
 * come from the world's clock (span_begin/span_end: wall_clock.c), its
 * collectives from the backend (backend_local.c, backend_mpi.c). */
#include "runtime/stream.h"
#include "runtime/util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ----------------------------------------------------------------- trace */

/* op's trace record in *r (ts and dur are the clock's), or NULL when it is not traced. */
static const TraceRec *op_rec(Stream *s, const Op *op, const char *prefix, const char *cat, TraceRec *r) {
    if (!op->traced) return NULL;
    *r = (TraceRec){prefix, op->name, op->module, op->phase, cat, s->index, op->step, 0, 0, op->bytes, op->micro,
                    op->kind == OP_COLL ? coll_dtype_name(op->coll.dtype) : NULL,
                    op->kind == OP_COLL && op->pg ? op->pg->name : NULL};
    return r;
}

/* op ended: the clock gets its end and, when traced, its record. */
static void op_done(Stream *s, const Op *op, OpSpan *span, const char *prefix, const char *cat) {
    TraceRec r;
    dev_ops(s->dev)->span_end(s->dev, s, span, op_rec(s, op, prefix, cat, &r), SPAN_ANY_LENGTH);
}

/* A host wait that began at span ends now, on the host's track. */
static void host_sync_done(Dev *d, const char *what, const char *name, OpSpan *span) {
    TraceRec r, *rec = NULL;
    if (d->scope.tracing) {
        char full[160];
        snprintf(full, sizeof full, "sync:%s%s", what, name ? name : "");
        r = (TraceRec){"", dev_intern(d, full), d->scope.module, d->scope.phase, "host_sync", TRACE_HOST_TID,
                       d->scope.step, 0, 0, 0, d->scope.micro, NULL, NULL};
        rec = &r;
    }
    dev_ops(d)->span_end(d, NULL, span, rec, SPAN_ANY_LENGTH);
}

/* ---------------------------------------------------------------- events */

static void event_unref(Event *e) {
    CpuEvent *ev = cpu_event(e);
    pthread_mutex_lock(&ev->mu);
    int last = --ev->refs == 0 && ev->destroyed;
    pthread_mutex_unlock(&ev->mu);
    if (last) event_free(e);
}

static void run_record(Stream *s, const Op *op) {
    Event *e = op->event;
    CpuEvent *ev = cpu_event(e);
    OpSpan span;
    dev_ops(s->dev)->span_begin(s->dev, s, &span);
    pthread_mutex_lock(&ev->mu);
    if (op->record_no > ev->completed) ev->completed = op->record_no;
    pthread_cond_broadcast(&ev->cv);
    pthread_mutex_unlock(&ev->mu);
    op_done(s, op, &span, op->module, "event");
    event_unref(e);
}

/* Traced only when the stream stalled for more than 1 µs. */
static void run_wait(Stream *s, const Op *op) {
    Event *e = op->event;
    CpuEvent *ev = cpu_event(e);
    OpSpan span;
    dev_ops(s->dev)->span_begin(s->dev, s, &span);
    int stalled = 0;
    pthread_mutex_lock(&ev->mu);
    if (ev->completed < op->record_no) {
        ev->waiting++;
        while (ev->completed < op->record_no) pthread_cond_wait(&ev->cv, &ev->mu);
        ev->waiting--;
        stalled = 1;
    }
    pthread_mutex_unlock(&ev->mu);
    TraceRec r;
    dev_ops(s->dev)->span_end(s->dev, s, &span, stalled ? op_rec(s, op, NULL, "wait", &r) : NULL, 1.0);
    event_unref(e);
}

/* ---------------------------------------------------------------- worker */

/* The PCIe model: a host <-> device copy of `bytes` that began at t0 lasts
 * latency + bytes / bandwidth (the memcpy itself counts toward it). */
static void pcie_wait(const WorldConfig *cfg, size_t bytes, double t0) {
    if (cfg->pcie_gbps <= 0) return;
    sleep_until_us(t0 + cfg->pcie_latency_us + (double)bytes / (cfg->pcie_gbps * 1e9) * 1e6);
}

static void execute(Stream *s, Op *op) {
    const BackendOps *ops = dev_ops(s->dev);
    OpSpan span;
    switch (op->kind) {
    case OP_LAUNCH:
        ops->span_begin(s->dev, s, &span);
        op->fn(op->args);
        op_done(s, op, &span, op->module, "compute");
        break;
    case OP_COPY: {
        ops->span_begin(s->dev, s, &span);
        double t0 = op->pcie ? now_us() : 0.0; /* the PCIe model stretches the copy in wall time from here */
        if (op->bytes && op->dst != op->src) memmove(op->dst, op->src, op->bytes);
        if (op->pcie) pcie_wait(&s->dev->world->cfg, op->bytes, t0);
        op_done(s, op, &span, op->module, "copy");
        break;
    }
    case OP_MEMSET:
        ops->span_begin(s->dev, s, &span);
        if (op->bytes) memset(op->dst, op->fill, op->bytes);
        op_done(s, op, &span, op->module, "copy");
        break;
    case OP_RECORD: run_record(s, op); break;
    case OP_WAIT: run_wait(s, op); break;
    case OP_COLL:
        ops->span_begin(s->dev, s, &span);
        op->exec(s, op);
        op_done(s, op, &span, op->label, "collective");
        break;
    }
}

static void *stream_worker(void *p) {
    Stream *s = p;
    CpuStream *cs = cpu_stream(s);
    Op op;
    pthread_mutex_lock(&cs->mu);
    for (;;) {
        while (cs->count == 0 && !cs->stop) pthread_cond_wait(&cs->cv_work, &cs->mu);
        if (cs->count == 0) break; /* stop requested and queue drained */
        memcpy(&op, &cs->ring[cs->head], sizeof op);
        pthread_mutex_unlock(&cs->mu);
        execute(s, &op);
        pthread_mutex_lock(&cs->mu);
        cs->head = (cs->head + 1) % cs->ring_cap;
        cs->count--;
        cs->completed++;
        pthread_cond_broadcast(&cs->cv_done);
    }
    pthread_mutex_unlock(&cs->mu);
    return NULL;
}

static void enqueue(Stream *s, const Op *op, size_t args_size) {
    CpuStream *cs = cpu_stream(s);
    race_on_enqueue(s, op); /* host order: the verdict never depends on timing */
    pthread_mutex_lock(&cs->mu);
    if (cs->count == cs->ring_cap) {
        size_t ncap = cs->ring_cap ? cs->ring_cap * 2 : 64;
        Op *nr = xmalloc(ncap * sizeof *nr);
        for (size_t i = 0; i < cs->count; i++) memcpy(&nr[i], &cs->ring[(cs->head + i) % cs->ring_cap], sizeof *nr);
        free(cs->ring);
        cs->ring = nr;
        cs->ring_cap = ncap;
        cs->head = 0;
    }
    Op *slot = &cs->ring[(cs->head + cs->count) % cs->ring_cap];
    memcpy(slot, op, offsetof(Op, args) + args_size);
    cs->count++;
    s->enqueued++;
    pthread_cond_signal(&cs->cv_work);
    pthread_mutex_unlock(&cs->mu);
}

void cpu_enqueue_op(Stream *s, const Op *op) { enqueue(s, op, 0); }

static uint64_t stream_completed(Stream *s) {
    CpuStream *cs = cpu_stream(s);
    pthread_mutex_lock(&cs->mu);
    uint64_t c = cs->completed;
    pthread_mutex_unlock(&cs->mu);
    return c;
}

/* ------------------------------------------------- storage and fences */

/* Storage is the C heap (one pool for every stream, so freed storage waits
 * for every stream: storage_fenced); a fence is the count of ops enqueued on
 * each stream of its mask, ready when those streams' workers have passed it. */
void *cpu_storage_alloc(Dev *d, size_t bytes, int stream, const char *name) {
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

void cpu_storage_free(Dev *d, void *p, size_t bytes, int stream) {
    (void)stream;
    free(p);
    d->mem.reserved -= bytes;
}

/* Host memory is the C heap here too: the same storage, NaN-filled alike; not device-reserved. */
void *cpu_host_alloc(Dev *d, size_t bytes, const char *name) {
    void *p = cpu_storage_alloc(d, bytes, 0, name);
    d->mem.reserved -= bytes;
    return p;
}

void cpu_host_free(Dev *d, void *p, size_t bytes) {
    (void)d, (void)bytes;
    free(p);
}

/* A fence: per stream index, the ops enqueued at the free. */
typedef struct {
    int nstreams;
    uint64_t enqueued[];
} CpuFence;

int cpu_fence_create(Dev *d, PendingFree *pf) {
    CpuFence *f = xcalloc(1, sizeof *f + (size_t)(d->nstreams ? d->nstreams : 1) * sizeof(uint64_t));
    f->nstreams = d->nstreams;
    int busy = 0;
    for (int i = 0; i < d->nstreams; i++) {
        if (!(pf->mask >> i & 1)) continue; /* 0: nothing to wait for (stream_new: at most 64 streams) */
        Stream *s = d->streams[i];
        CpuStream *cs = cpu_stream(s);
        pthread_mutex_lock(&cs->mu);
        f->enqueued[i] = s->enqueued;
        busy |= cs->completed < s->enqueued;
        pthread_mutex_unlock(&cs->mu);
    }
    pf->fence = f;
    return busy;
}

int cpu_fence_ready(Dev *d, const PendingFree *pf) {
    const CpuFence *f = pf->fence;
    for (int i = 0; i < f->nstreams; i++)
        if (stream_completed(d->streams[i]) < f->enqueued[i]) return 0;
    return 1;
}

void cpu_fence_release(Dev *d, PendingFree *pf) {
    (void)d;
    free(pf->fence);
    pf->fence = NULL;
}

/* --------------------------------------------------------------- streams */

Stream *cpu_stream_create(Dev *d, const char *name) {
    Stream *s = stream_new(d, name);
    CpuStream *cs = xcalloc(1, sizeof *cs);
    s->backend = cs;
    pthread_mutex_init(&cs->mu, NULL);
    pthread_cond_init(&cs->cv_work, NULL);
    pthread_cond_init(&cs->cv_done, NULL);
    dev_ops(d)->coll_stream_init(s);
    stream_join_groups(s);
    dev_add_stream(d, s);
    race_stream_created(d, s);
    flight_stream_created(d, s);
    if (pthread_create(&cs->thread, NULL, stream_worker, s) != 0)
        fatal("cannot start the worker thread of stream '%s'", s->name);
    return s;
}

void cpu_stream_destroy(Stream *s) {
    CpuStream *cs = cpu_stream(s);
    pthread_mutex_lock(&cs->mu);
    cs->stop = 1;
    pthread_cond_signal(&cs->cv_work);
    pthread_mutex_unlock(&cs->mu);
    pthread_join(cs->thread, NULL);
    dev_ops(s->dev)->coll_stream_fini(s);
    pthread_mutex_destroy(&cs->mu);
    pthread_cond_destroy(&cs->cv_work);
    pthread_cond_destroy(&cs->cv_done);
    race_stream_destroy(s);
    free(cs->ring);
    free(cs);
    free(s->name);
    free(s);
}

void cpu_launch(Stream *s, const char *name, void (*fn)(void *args), const void *args, size_t args_size) {
    Op op;
    op_init(s, &op, OP_LAUNCH, name);
    op.fn = fn;
    if (args_size) memcpy(op.args, args, args_size);
    enqueue(s, &op, args_size);
}

void cpu_copy(Stream *s, void *dst, const void *src, size_t bytes) {
    int dir = bytes ? dev_copy_direction(s->dev, dst, src) : 0;
    Op op;
    op_init(s, &op, OP_COPY, copy_direction_name(dir));
    op.dst = dst;
    op.src = src;
    op.bytes = bytes;
    op.pcie = dir;
    enqueue(s, &op, 0);
}

void cpu_fill(Stream *s, void *dst, int byte, size_t bytes) {
    Op op;
    op_init(s, &op, OP_MEMSET, "memset");
    op.dst = dst;
    op.fill = byte;
    op.bytes = bytes;
    enqueue(s, &op, 0);
}

/* Block until s has run everything enqueued so far (the host-side wait of every sync). */
static void stream_drain(Stream *s) {
    CpuStream *cs = cpu_stream(s);
    pthread_mutex_lock(&cs->mu);
    uint64_t target = s->enqueued;
    while (cs->completed < target) pthread_cond_wait(&cs->cv_done, &cs->mu);
    pthread_mutex_unlock(&cs->mu);
}

void cpu_stream_synchronize(Stream *s) {
    OpSpan span;
    dev_ops(s->dev)->span_begin(s->dev, NULL, &span);
    stream_drain(s);
    race_host_waited_stream(s);
    dev_release_pending_frees(s->dev, 0);
    host_sync_done(s->dev, "", s->name, &span);
}

void cpu_synchronize(Dev *d) {
    OpSpan span;
    dev_ops(d)->span_begin(d, NULL, &span);
    for (int i = 0; i < d->nstreams; i++) stream_drain(d->streams[i]);
    race_host_waited_all(d);
    dev_release_pending_frees(d, 0);
    host_sync_done(d, "all streams", NULL, &span);
}

/* ---------------------------------------------------------------- events */

void cpu_event_init(Event *e) {
    CpuEvent *ev = xcalloc(1, sizeof *ev);
    pthread_mutex_init(&ev->mu, NULL);
    pthread_cond_init(&ev->cv, NULL);
    e->backend = ev;
}

void cpu_event_fini(Event *e) {
    CpuEvent *ev = cpu_event(e);
    pthread_mutex_destroy(&ev->mu);
    pthread_cond_destroy(&ev->cv);
    free(ev);
    e->backend = NULL;
}

/* Queued records/waits may still point at it: the last one frees it. */
void cpu_event_destroy(Event *e) {
    CpuEvent *ev = cpu_event(e);
    pthread_mutex_lock(&ev->mu);
    ev->destroyed = 1;
    int last = ev->refs == 0;
    pthread_mutex_unlock(&ev->mu);
    if (last) event_free(e);
}

/* A record (kind OP_RECORD: the event's next record number) or a wait
 * (OP_WAIT: for its latest record) of e on s; the queued op holds a reference
 * to e until it ran. */
static void enqueue_event_op(Stream *s, Event *e, OpKind kind, const char *verb) {
    CpuEvent *ev = cpu_event(e);
    Op op;
    char name[300];
    snprintf(name, sizeof name, "%s:%s", verb, e->name);
    op_init(s, &op, kind, name);
    op.event = e;
    pthread_mutex_lock(&ev->mu);
    op.record_no = kind == OP_RECORD ? ++e->recorded : e->recorded;
    ev->refs++;
    pthread_mutex_unlock(&ev->mu);
    enqueue(s, &op, 0);
}

void cpu_event_record(Event *e, Stream *s) { enqueue_event_op(s, e, OP_RECORD, "record"); }

void cpu_event_wait(Stream *s, Event *e) { enqueue_event_op(s, e, OP_WAIT, "wait"); }

void cpu_event_synchronize(Event *e) {
    CpuEvent *ev = cpu_event(e);
    OpSpan span;
    dev_ops(e->dev)->span_begin(e->dev, NULL, &span);
    uint64_t n = e->recorded;
    pthread_mutex_lock(&ev->mu);
    while (ev->completed < n) pthread_cond_wait(&ev->cv, &ev->mu);
    pthread_mutex_unlock(&ev->mu);
    race_host_waited_event(e);
    dev_release_pending_frees(e->dev, 0);
    host_sync_done(e->dev, "event ", e->name, &span);
}

int cpu_event_query(Event *e) {
    CpuEvent *ev = cpu_event(e);
    pthread_mutex_lock(&ev->mu);
    int done = ev->completed >= e->recorded;
    pthread_mutex_unlock(&ev->mu);
    if (done) race_host_waited_event(e); /* the host saw it complete: later enqueues are ordered after it */
    return done;
}

/* ---------------------------------------------------- dev, probe memory */

/* The CPU backends keep no state per rank. */
void cpu_dev_init(Dev *d) { (void)d; }
void cpu_dev_fini(Dev *d) { (void)d; }

void *cpu_probe_alloc(Dev *d, size_t bytes) {
    (void)d;
    return xcalloc(1, bytes);
}
void cpu_probe_free(Dev *d, void *p) {
    (void)d;
    free(p);
}
void cpu_probe_read(Dev *d, void *host, const void *probe, size_t bytes) {
    for (int i = 0; i < d->nstreams; i++) stream_drain(d->streams[i]); /* no happens-before: a probe */
    memcpy(host, probe, bytes);
}
