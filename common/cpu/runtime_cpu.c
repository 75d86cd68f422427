/* runtime_cpu.c — the CPU backends' device (cpu_internal.h; both "local" and "mpi"):
 * a worker thread per stream executing a FIFO of ops, events, launches, async
 * copies, host synchronization and storage from the C heap. An op's times
 * are the modelled clock's (modelled_clock.c), its collectives the backend's
 * (backend_local.c, backend_mpi.c). */
#include "runtime/dry.h"
#include "runtime/guard.h"
#include "cpu/cpu_internal.h"
#include "runtime/util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- events */

static void event_unref(Event *e) {
    CpuEvent *ev = cpu_event(e);
    pthread_mutex_lock(&ev->mu);
    int last = --ev->refs == 0 && ev->destroyed;
    pthread_mutex_unlock(&ev->mu);
    if (last) event_free(e);
}

/* The modelled time of e's record n (1-based), blocking until a worker ran it (ev->mu held). */
static double record_time_locked(CpuEvent *ev, uint64_t n) {
    while (n > ev->ntimes || ev->times[n - 1] < 0) pthread_cond_wait(&ev->cv, &ev->mu);
    return ev->times[n - 1];
}

static double record_time(Event *e, uint64_t n) {
    CpuEvent *ev = cpu_event(e);
    pthread_mutex_lock(&ev->mu);
    double t = record_time_locked(ev, n);
    pthread_mutex_unlock(&ev->mu);
    return t;
}

/* A record completes at the modelled time the stream got there. */
static void run_record(const Op *op, double at_us) {
    CpuEvent *ev = cpu_event(op->event);
    pthread_mutex_lock(&ev->mu);
    if (op->record_no > ev->ntimes) {
        size_t n = ev->ntimes ? ev->ntimes : 8;
        while (n < op->record_no) n *= 2;
        ev->times = xrealloc(ev->times, n * sizeof *ev->times);
        for (size_t i = ev->ntimes; i < n; i++) ev->times[i] = -1.0; /* not reached yet */
        ev->ntimes = n;
    }
    ev->times[op->record_no - 1] = at_us;
    pthread_cond_broadcast(&ev->cv);
    pthread_mutex_unlock(&ev->mu);
    event_unref(op->event);
}

/* A wait ends when the record it waits for completed, on the modelled clock;
 * the worker blocks until that record ran. */
static double run_wait(const Op *op) {
    CpuEvent *ev = cpu_event(op->event);
    pthread_mutex_lock(&ev->mu);
    ev->waiting++;
    double t = record_time_locked(ev, op->record_no);
    ev->waiting--;
    pthread_mutex_unlock(&ev->mu);
    event_unref(op->event);
    return t;
}

/* ---------------------------------------------------------------- worker */

/* Run op for real, then give it its modelled start and end (modelled_clock.c):
 * it starts when its stream is free and the host has enqueued it (and its
 * event was recorded, or its group is ready), and lasts its cost. */
static void execute(Stream *s, Op *op) {
    CpuStream *cs = cpu_stream(s);
    double ready = cs->end_us > op->host_us ? cs->end_us : op->host_us, start = ready, end = ready;
    double wall0 = now_us();
    const int run = !s->dev->world->cfg.dry_run; /* a dry run prices the op and runs none of it (dry.h) */
    switch (op->kind) {
    case OP_LAUNCH:
        if (run) op->fn(op->args);
        free(op->list); /* dev_launch_list's copy, run or priced only */
        end = start + op->cost_us;
        clock_trace_op(s, op, op->module, TRACE_CAT_COMPUTE, start, end, wall0);
        break;
    case OP_COPY:
        if (op->copies) { /* a batch: its copies never overlap (backend.c checked) */
            for (size_t i = 0; run && i < op->ncopies; i++)
                if (op->copies[i].bytes) memcpy(op->copies[i].dst, op->copies[i].src, op->copies[i].bytes);
            free(op->copies);
        } else if (run && op->bytes && op->dst != op->src) {
            memmove(op->dst, op->src, op->bytes);
        }
        end = start + op->cost_us;
        clock_trace_op(s, op, op->module, TRACE_CAT_COPY, start, end, wall0);
        break;
    case OP_MEMSET:
        if (run && op->bytes) memset(op->dst, op->fill, op->bytes);
        end = start + op->cost_us;
        clock_trace_op(s, op, op->module, TRACE_CAT_COPY, start, end, wall0);
        break;
    case OP_RECORD:
        end = start;
        clock_trace_op(s, op, op->module, TRACE_CAT_EVENT, start, end, wall0);
        run_record(op, start);
        break;
    case OP_WAIT: {
        double t = run_wait(op);
        end = t > start ? t : start;
        if (end > start) clock_trace_op(s, op, NULL, TRACE_CAT_WAIT, start, end, wall0); /* only a wait that stalled */
        break;
    }
    case OP_COLL:
        start = op->exec(s, op, ready);
        end = start + op->cost_us;
        /* a p2p group's name says what moves where; a collective's is "<label>.<kind>" */
        clock_trace_op(s, op, op->coll.kind == COLL_P2P ? NULL : op->label, TRACE_CAT_COLLECTIVE, start, end, wall0);
        break;
    case OP_MARK: *(double *)op->dst = ready; break; /* the host reads it once it saw this op completed */
    }
    cs->end_us = end; /* read by the host only once it saw this op completed (cs->mu) */
}

static void *stream_worker(void *p) {
    Stream *s = p;
    CpuStream *cs = cpu_stream(s);
    Op op;
    guard_thread_device(); /* the device's side: kernels, copies, collectives touch device memory */
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
        cs->colls_done += op.kind == OP_COLL;
        pthread_cond_broadcast(&cs->cv_done);
    }
    pthread_mutex_unlock(&cs->mu);
    return NULL;
}

/* Append op to s's queue (the worker runs it). */
static void push(Stream *s, const Op *op, size_t args_size) {
    CpuStream *cs = cpu_stream(s);
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

/* Queue op (its cost_us set) on s: the host's modelled time moves on by a
 * launch unless the op is not the program's (charged 0: the driver's probes). */
static void enqueue(Stream *s, Op *op, size_t args_size, int charged) {
    race_on_enqueue(s, op); /* host order: the verdict never depends on timing */
    clock_enqueue(s->dev, op, charged);
    clock_log_enqueued(s, op);
    push(s, op, args_size);
}

/* A dry run's host keeps at most this many collectives of a stream ahead of
 * its worker. Its workers run nothing, so the hosts (race detector, allocator)
 * are the slow side and would queue a whole step: at 64 ranks, thousands of
 * copies per module per rank, gigabytes of queued ops. Waiting for its own
 * earlier collectives cannot deadlock a program whose ranks issue the same
 * calls in the same order (the host furthest behind waits only for
 * collectives every rank has queued), and it is wall time only: the modelled
 * clock never sees it. */
#define DRY_COLLECTIVES_AHEAD 4

void cpu_enqueue_op(Stream *s, Op *op) {
    if (op->kind == OP_COLL && op->coll.kind != COLL_P2P) clock_coll_queued(s, op->cost_us);
    enqueue(s, op, 0, 1);
    if (!s->dev->world->cfg.dry_run || op->kind != OP_COLL) return;
    CpuStream *cs = cpu_stream(s);
    pthread_mutex_lock(&cs->mu);
    while (cs->colls_done + DRY_COLLECTIVES_AHEAD < s->coll_seq) pthread_cond_wait(&cs->cv_done, &cs->mu);
    pthread_mutex_unlock(&cs->mu);
}

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
 * each stream of its mask, ready when those streams' workers have passed it.
 * Under --guard-device-memory (guard.h) device storage is pages tagged with
 * the guard's key instead, which only the stream workers may touch. */
static void *heap_storage(Dev *d, size_t bytes, const char *name) {
    void *p = NULL;
    if (posix_memalign(&p, DEV_ALLOC_ALIGN, bytes) != 0 || !p)
        fatal("rank %d: out of memory allocating %zu bytes for '%s' (%zu bytes allocated now)", d->rank, bytes,
              name ? name : "?", d->mem.current);
    return p;
}

static void poison(Dev *d, void *p, size_t bytes) {
    if (!d->world->cfg.poison) return;
    unsigned open = guard_open(); /* the allocator's own fill of fresh storage, by design on the host */
    uint32_t nan_bits = 0x7fc00000u;
    size_t nf = bytes / 4;
    uint32_t *w = p;
    for (size_t i = 0; i < nf; i++) w[i] = nan_bits;
    guard_close(open);
}

/* A dry run's storage: address space from the rank's arena (dry.h), never poisoned (nothing backs it). */
static void *dry_storage(Dev *d, size_t bytes, const char *name) {
    if (!d->dry) d->dry = dry_arena_new(d->rank);
    void *p = dry_arena_alloc(d->dry, bytes);
    if (!p)
        fatal("rank %d: dry run: no address space left for %zu bytes for '%s' (%zu bytes allocated now)", d->rank,
              bytes, name ? name : "?", d->mem.current);
    return p;
}

void *cpu_storage_alloc(Dev *d, size_t bytes, int stream, const char *name) {
    (void)stream;
    void *p;
    if (d->world->cfg.dry_run) {
        p = dry_storage(d, bytes, name);
    } else if (guard_active(d->world)) {
        p = guard_storage_alloc(bytes);
        if (!p)
            fatal("rank %d: out of memory allocating %zu bytes for '%s' (%zu bytes allocated now)", d->rank, bytes,
                  name ? name : "?", d->mem.current);
    } else {
        p = heap_storage(d, bytes, name);
    }
    poison(d, p, bytes);
    d->mem.reserved += bytes;
    return p;
}

void cpu_storage_free(Dev *d, void *p, size_t bytes, int stream) {
    (void)stream;
    if (d->world->cfg.dry_run) dry_arena_free(d->dry, p, bytes);
    else if (guard_active(d->world)) guard_storage_free(p, bytes);
    else free(p);
    d->mem.reserved -= bytes;
}

/* Host memory is the C heap, NaN-filled alike (never guarded: host code may touch it); not device-reserved. */
void *cpu_host_alloc(Dev *d, size_t bytes, const char *name) {
    if (d->world->cfg.dry_run) return dry_storage(d, bytes, name); /* pinned host memory is as unbacked */
    void *p = heap_storage(d, bytes, name);
    poison(d, p, bytes);
    return p;
}

void cpu_host_free(Dev *d, void *p, size_t bytes) {
    if (d->world->cfg.dry_run) dry_arena_free(d->dry, p, bytes);
    else free(p);
}

/* A fence: per stream index, the ops enqueued at the free. A timed fence
 * (dev_record_stream's hold) also queues a marker on each of its streams,
 * which writes the modelled time its stream got there. */
typedef struct {
    int nstreams, timed;
    uint64_t *enqueued;   /* [nstreams] */
    double *marks;        /* [nstreams] timed: each marker's modelled time */
} CpuFence;

/* Block until s's worker finished its first n ops. */
static void wait_completed(Stream *s, uint64_t n) {
    CpuStream *cs = cpu_stream(s);
    pthread_mutex_lock(&cs->mu);
    while (cs->completed < n) pthread_cond_wait(&cs->cv_done, &cs->mu);
    pthread_mutex_unlock(&cs->mu);
}

int cpu_fence_create(Dev *d, PendingFree *pf) {
    int n = d->nstreams ? d->nstreams : 1;
    CpuFence *f = xcalloc(1, sizeof *f);
    f->enqueued = xcalloc((size_t)n, sizeof *f->enqueued);
    f->marks = pf->timed ? xcalloc((size_t)n, sizeof *f->marks) : NULL;
    f->nstreams = d->nstreams;
    f->timed = pf->timed;
    int busy = 0;
    for (int i = 0; i < d->nstreams; i++) {
        if (!(pf->mask >> i & 1)) continue; /* 0: nothing to wait for (at most DEV_MAX_STREAMS streams) */
        Stream *s = d->streams[i];
        if (f->timed) {
            Op mark;
            op_init(s, &mark, OP_MARK, "mark");
            mark.traced = 0;
            mark.dst = &f->marks[i];
            push(s, &mark, 0);
        }
        CpuStream *cs = cpu_stream(s);
        pthread_mutex_lock(&cs->mu);
        f->enqueued[i] = s->enqueued;
        busy |= cs->completed < s->enqueued;
        pthread_mutex_unlock(&cs->mu);
    }
    pf->fence = f;
    return busy;
}

/* Untimed: the streams ran the work. Timed: the host's modelled time is past
 * the markers' (the host waits in wall time until the markers ran, so the
 * answer is the same on every run). */
int cpu_fence_ready(Dev *d, const PendingFree *pf) {
    const CpuFence *f = pf->fence;
    if (!f->timed) {
        for (int i = 0; i < f->nstreams; i++)
            if (stream_completed(d->streams[i]) < f->enqueued[i]) return 0;
        return 1;
    }
    double t = 0;
    for (int i = 0; i < f->nstreams; i++) {
        if (!(pf->mask >> i & 1)) continue;
        wait_completed(d->streams[i], f->enqueued[i]);
        if (f->marks[i] > t) t = f->marks[i];
    }
    return t <= d->host_us;
}

void cpu_fence_release(Dev *d, PendingFree *pf) {
    CpuFence *f = pf->fence;
    if (f->timed) /* a marker still queued writes into f */
        for (int i = 0; i < f->nstreams; i++)
            if (pf->mask >> i & 1) wait_completed(d->streams[i], f->enqueued[i]);
    free(f->enqueued);
    free(f->marks);
    free(f);
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

void cpu_launch(Stream *s, const char *name, const KernelCost *cost, void (*fn)(void *args), const void *args,
                size_t args_size, const void *list, size_t list_bytes) {
    Op op;
    op_init(s, &op, OP_LAUNCH, name);
    op.fn = fn;
    if (args_size) memcpy(op.args, args, args_size);
    if (list_bytes) { /* the kernel reads its own copy: the caller's list may change before the worker runs it */
        op.list = xmalloc(list_bytes);
        memcpy(op.list, list, list_bytes);
        memcpy(op.args, &op.list, sizeof op.list);
    }
    op.cost_us = cost->cls == COST_FREE ? 0.0 : clock_overlap(s, clock_kernel_cost(s->dev, cost));
    op.flops = cost->cls == COST_FREE ? 0 : cost->flops;
    op.cls = cost->cls;
    op.math = cost->math;
    enqueue(s, &op, args_size, cost->cls != COST_FREE);
}

void cpu_copy(Stream *s, void *dst, const void *src, size_t bytes) {
    CopyDir dir = bytes ? dev_copy_direction(s->dev, dst, src) : COPY_SAME_SIDE;
    Op op;
    op_init(s, &op, OP_COPY, copy_direction_name(dir));
    op.dst = dst;
    op.src = src;
    op.bytes = bytes;
    op.pcie = dir;
    op.cost_us = clock_copy_cost(s->dev, bytes, dir);
    enqueue(s, &op, 0, 1);
}

/* One copy op carrying its own copy of the list: one launch on the host's clock, one copy of all the bytes on
 * the stream's (a device copy, or over the PCIe model when dir says so). */
void cpu_copy_batch(Stream *s, const char *name, const DevCopy *copies, size_t n, size_t bytes, CopyDir dir) {
    Op op;
    op_init(s, &op, OP_COPY, name);
    op.copies = xmalloc(n * sizeof *op.copies);
    memcpy(op.copies, copies, n * sizeof *op.copies);
    op.ncopies = n;
    op.bytes = bytes;
    op.pcie = dir;
    op.cost_us = clock_copy_cost(s->dev, bytes, dir);
    enqueue(s, &op, 0, 1);
}

void cpu_fill(Stream *s, void *dst, int byte, size_t bytes) {
    Op op;
    op_init(s, &op, OP_MEMSET, "memset");
    op.dst = dst;
    op.fill = byte;
    op.bytes = bytes;
    op.cost_us = clock_fill_cost(s->dev, bytes);
    enqueue(s, &op, 0, 1);
}

/* Block until s has run everything enqueued so far (the host-side wait of
 * every sync); returns the modelled end of that work. */
static double stream_drain(Stream *s) {
    CpuStream *cs = cpu_stream(s);
    pthread_mutex_lock(&cs->mu);
    uint64_t target = s->enqueued;
    while (cs->completed < target) pthread_cond_wait(&cs->cv_done, &cs->mu);
    double end = cs->end_us;
    pthread_mutex_unlock(&cs->mu);
    return end;
}

void cpu_stream_synchronize(Stream *s) {
    double end = stream_drain(s);
    race_host_waited_stream(s);
    dev_release_pending_frees(s->dev, 0);
    clock_host_wait(s->dev, end, "", s->name);
    cpu_stream(s)->sm_debt_us = 0; /* its collectives are over */
}

void cpu_synchronize(Dev *d) {
    double end = 0;
    for (int i = 0; i < d->nstreams; i++) {
        double e = stream_drain(d->streams[i]);
        if (e > end) end = e;
    }
    race_host_waited_all(d);
    dev_release_pending_frees(d, 0);
    clock_host_wait(d, end, "all streams", NULL);
    for (int i = 0; i < d->nstreams; i++) cpu_stream(d->streams[i])->sm_debt_us = 0;
}

/* ---------------------------------------------------------------- events */

void cpu_event_init(Event *e) {
    CpuEvent *ev = xcalloc(1, sizeof *ev);
    ev->rec_stream = -1;
    pthread_mutex_init(&ev->mu, NULL);
    pthread_cond_init(&ev->cv, NULL);
    e->backend = ev;
}

void cpu_event_fini(Event *e) {
    CpuEvent *ev = cpu_event(e);
    pthread_mutex_destroy(&ev->mu);
    pthread_cond_destroy(&ev->cv);
    free(ev->times);
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
    if (kind == OP_RECORD) ev->rec_stream = s->index;
    int rec = ev->rec_stream;
    pthread_mutex_unlock(&ev->mu);
    if (kind == OP_WAIT) clock_overlap_ends(s, rec);
    enqueue(s, &op, 0, 1); /* records and waits cost nothing on the stream itself */
}

void cpu_event_record(Event *e, Stream *s) { enqueue_event_op(s, e, OP_RECORD, "record"); }

void cpu_event_wait(Stream *s, Event *e) { enqueue_event_op(s, e, OP_WAIT, "wait"); }

void cpu_event_synchronize(Event *e) {
    double t = record_time(e, e->recorded);
    race_host_waited_event(e);
    dev_release_pending_frees(e->dev, 0);
    clock_host_wait(e->dev, t, "event ", e->name);
    int rec = cpu_event(e)->rec_stream;
    if (rec >= 0 && rec < e->dev->nstreams) cpu_stream(e->dev->streams[rec])->sm_debt_us = 0;
}

/* On the modelled clock: has the latest record completed by the host's time
 * (after this call's own launch time)? The host waits in wall time until the
 * record ran, so the answer is the same on every run. */
int cpu_event_query(Event *e) {
    Dev *d = e->dev;
    clock_host_call(d);
    int done = record_time(e, e->recorded) <= d->host_us;
    if (done) race_host_waited_event(e); /* the host saw it complete: later enqueues are ordered after it */
    return done;
}

/* ---------------------------------------------------- dev, probe memory */

/* The CPU backends keep no state per rank but a dry run's arena (made at its first allocation). */
void cpu_dev_init(Dev *d) { (void)d; }
void cpu_dev_fini(Dev *d) {
    dry_arena_destroy(d->dry);
    d->dry = NULL;
}

/* Probe memory is device memory too (the clip probe's slots, which kernels write): guarded alike,
 * behind a 64-byte header holding the mapping's size for the free. */
#define PROBE_HEADER 64
void *cpu_probe_alloc(Dev *d, size_t bytes) {
    if (d->world->cfg.dry_run) return dry_storage(d, bytes, "probe memory");
    if (!guard_active(d->world)) return xcalloc(1, bytes);
    char *p = guard_storage_alloc(PROBE_HEADER + bytes); /* fresh pages are zero, as calloc's */
    if (!p) fatal("rank %d: out of memory allocating %zu bytes of probe memory", d->rank, bytes);
    unsigned open = guard_open(); /* the runtime's own bookkeeping in the mapping */
    *(size_t *)p = PROBE_HEADER + bytes;
    guard_close(open);
    return p + PROBE_HEADER;
}
void cpu_probe_free(Dev *d, void *p) {
    if (d->world->cfg.dry_run) return; /* the arena goes with the rank (cpu_dev_fini) */
    if (!guard_active(d->world) || !p) {
        free(p);
        return;
    }
    char *base = (char *)p - PROBE_HEADER;
    unsigned open = guard_open();
    size_t bytes = *(size_t *)base;
    guard_close(open);
    guard_storage_free(base, bytes);
}
void cpu_probe_read(Dev *d, void *host, const void *probe, size_t bytes) {
    if (d->world->cfg.dry_run) /* the driver turns its value probes off in a dry run: this is the runtime's bug */
        fatal("rank %d: dev_probe_read of %zu bytes in a dry run, which has no values to read", d->rank, bytes);
    for (int i = 0; i < d->nstreams; i++) stream_drain(d->streams[i]); /* no happens-before: a probe */
    unsigned open = guard_open(); /* the runtime's copy of device memory for the driver's probes */
    memcpy(host, probe, bytes);
    guard_close(open);
}
