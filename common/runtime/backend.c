/* backend.c — where the shared runtime and its backends meet (backend.h):
 * the device API calls whose work is the backend's (the argument checks
 * every backend shares, then the world's table of operations), and what the
 * backends build on (a new Stream, the host exchange of ranks that are
 * threads). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/internal.h"
#include "runtime/util.h"

const char *backend_name(CollBackend b) {
    switch (b) {
    case BACKEND_LOCAL: return "local";
    case BACKEND_MPI: return "mpi";
    case BACKEND_NCCL: return "nccl";
    case BACKEND_NCCL_MPI: return "nccl-mpi";
    }
    return "?";
}

const struct KernelTable *stream_kernels(const Stream *s) { return dev_ops(s->dev)->kernels; }

double dev_host_time_us(const Dev *d) { return dev_ops(d)->host_time_us(d); }

const char *dev_clock_name(const Dev *d) { return dev_ops(d)->clock; }
int dev_dry_run(const Dev *d) { return d->world->cfg.dry_run != 0; }

/* ---------------------------------------------------------------- streams */

Stream *stream_new(Dev *d, const char *name) {
    if (d->nstreams >= DEV_MAX_STREAMS)
        fatal("rank %d: dev_stream_create('%s'): at most %d streams per rank", d->rank, name ? name : "", DEV_MAX_STREAMS);
    Stream *s = xcalloc(1, sizeof *s);
    s->dev = d;
    s->index = d->nstreams;
    s->name = xstrdup(name ? name : "stream");
    return s;
}

void dev_add_stream(Dev *d, Stream *s) {
    if (d->nstreams == d->streams_cap) {
        d->streams_cap = d->streams_cap ? d->streams_cap * 2 : 4;
        d->streams = xrealloc(d->streams, (size_t)d->streams_cap * sizeof *d->streams);
    }
    d->streams[d->nstreams++] = s;
}

void stream_join_groups(Stream *s) {
    for (int i = 1; i < s->dev->npgs; i++) dev_ops(s->dev)->stream_join_group(s, s->dev->pgs[i]);
}

Stream *dev_stream_create(Dev *d, const char *name) { return dev_ops(d)->stream_create(d, name); }

/* dev_launch's checks: one line each, naming the kernel */
static void check_launch(const char *name, const KernelCost *cost, void (*fn)(void *args), size_t args_size) {
    if (!fn) fatal("dev_launch('%s'): no function", name ? name : "?");
    if (args_size > DEV_ARGS_MAX)
        fatal("dev_launch('%s'): %zu bytes of arguments, at most %d allowed", name ? name : "?", args_size, DEV_ARGS_MAX);
    if (!cost)
        fatal("dev_launch('%s'): no declared cost (every kernel declares its FLOPs and bytes: a KernelCost, "
              "runtime.h)", name ? name : "?");
    if ((unsigned)cost->cls >= COST_CLASS_COUNT || !(cost->flops >= 0) || !(cost->bytes >= 0))
        fatal("dev_launch('%s'): a bad cost (class %d, %g FLOPs, %g bytes)", name ? name : "?", (int)cost->cls,
              cost->flops, cost->bytes);
}

void dev_launch(Stream *s, const char *name, const KernelCost *cost, void (*fn)(void *args), const void *args,
                size_t args_size) {
    check_launch(name, cost, fn, args_size);
    dev_ops(s->dev)->launch(s, name, cost, fn, args, args_size, NULL, 0);
}

void dev_launch_list(Stream *s, const char *name, const KernelCost *cost, void (*fn)(void *args), const void *args,
                     size_t args_size, const void *list, size_t list_bytes) {
    check_launch(name, cost, fn, args_size);
    if (args_size < sizeof(const void *))
        fatal("dev_launch_list('%s'): %zu bytes of arguments, too few to begin with the list's pointer",
              name ? name : "?", args_size);
    if (!list || !list_bytes) fatal("dev_launch_list('%s'): no list (%zu bytes)", name ? name : "?", list_bytes);
    dev_ops(s->dev)->launch(s, name, cost, fn, args, args_size, list, list_bytes);
}

void dev_memcpy_async(Stream *s, void *dst, const void *src, size_t bytes) {
    if (bytes && (!dst || !src)) fatal("dev_memcpy_async: NULL pointer with %zu bytes", bytes);
    dev_ops(s->dev)->copy(s, dst, src, bytes);
}

static int by_lo(const void *a, const void *b) {
    const BatchRange *x = a, *y = b;
    return x->lo < y->lo ? -1 : x->lo > y->lo;
}

/* Sorted by start, each range overlaps an earlier one iff it starts below the
 * furthest end of those: O(n log n), a copy-out at world 64 is hundreds of
 * copies. Which overlap the sweep meets first depends on where the buffers
 * lie, which changes from run to run; so once it finds one, the pair named is
 * the first in the list's own order (the lowest item, then the next lowest,
 * a destination before a source): the same sentence on every run. */
static int overlap(const BatchRange *x, const BatchRange *y) {
    return (x->dst || y->dst) && x != y && x->lo < y->hi && y->lo < x->hi;
}
static int named_before(const BatchRange *x1, const BatchRange *y1, const BatchRange *x2, const BatchRange *y2) {
    size_t a1 = x1->i < y1->i ? x1->i : y1->i, b1 = x1->i < y1->i ? y1->i : x1->i;
    size_t a2 = x2->i < y2->i ? x2->i : y2->i, b2 = x2->i < y2->i ? y2->i : x2->i;
    if (a1 != a2) return a1 < a2;
    if (b1 != b2) return b1 < b2;
    return x1->dst + y1->dst > x2->dst + y2->dst; /* two destinations first */
}
void check_batch_disjoint(const char *who, const char *item, const char *items, BatchRange *r, size_t m) {
    qsort(r, m, sizeof *r, by_lo);
    const BatchRange *far[2] = {NULL, NULL}; /* the source [0] / destination [1] seen so far that ends furthest */
    int found = 0;
    for (size_t k = 0; k < m && !found; k++) {
        const BatchRange *e = &r[k];
        for (int other = 0; other < 2; other++) {
            const BatchRange *o = far[other];
            if (o && (e->dst || other) && e->lo < o->hi) found = 1; /* two sources may overlap */
        }
        if (!far[e->dst] || e->hi > far[e->dst]->hi) far[e->dst] = e;
    }
    if (!found) return;
    const BatchRange *x = NULL, *y = NULL; /* the pair to name: every pair looked at, an error's cost only */
    for (size_t p = 0; p < m; p++)
        for (size_t q = p + 1; q < m; q++)
            if (overlap(&r[p], &r[q]) && (!x || named_before(&r[p], &r[q], x, y))) x = &r[p], y = &r[q];
    if (y->i < x->i || (y->i == x->i && y->dst > x->dst)) {
        const BatchRange *t = x;
        x = y, y = t;
    }
    fatal("%s: %s %zu's %s overlaps %s %zu's %s (the %s of a batch run in no set order: no destination may "
          "overlap another %s's source or destination)", who, item, x->i, x->dst ? "destination" : "source", item,
          y->i, y->dst ? "destination" : "source", items, item);
}

/* Fatal if two destinations overlap, or a destination overlaps a source (a
 * fused kernel runs its copies in no set order); sources may share bytes. */
static void check_no_overlap(const char *name, const DevCopy *c, size_t n) {
    BatchRange *ends = xmalloc(2 * n * sizeof *ends);
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        if (!c[i].bytes) continue;
        ends[m++] = (BatchRange){(uintptr_t)c[i].dst, (uintptr_t)c[i].dst + c[i].bytes, i, 1};
        ends[m++] = (BatchRange){(uintptr_t)c[i].src, (uintptr_t)c[i].src + c[i].bytes, i, 0};
    }
    char who[96];
    snprintf(who, sizeof who, "dev_memcpy_batch_async('%s')", name);
    check_batch_disjoint(who, "copy", "copies", ends, m);
    free(ends);
}

static const char *direction_words(CopyDir d) {
    return d == COPY_H2D ? "host to device" : d == COPY_D2H ? "device to host" : "device to device";
}

void check_batch_call(const char *who, const Stream *s, const char *name, const void *list, size_t n,
                      const char *items) {
    if (!s) fatal("%s('%s'): NULL stream", who, name ? name : "?");
    if (!name || !*name || strchr(name, '.'))
        fatal("%s: name it what it is, without a dot (e.g. \"copy_in\"), not '%s' (the trace shows "
              "\"<module>.<name>\")", who, name ? name : "(null)");
    if (n && !list) fatal("%s('%s'): NULL list of %zu %s", who, name, n, items);
}

void dev_memcpy_batch_async(Stream *s, const char *name, const DevCopy *copies, size_t n) {
    check_batch_call("dev_memcpy_batch_async", s, name, copies, n, "copies");
    size_t bytes = 0;
    CopyDir dir = COPY_SAME_SIDE;
    size_t first = n; /* the first copy with bytes: every other goes its way */
    for (size_t i = 0; i < n; i++) {
        const DevCopy *c = &copies[i];
        if (!c->bytes) continue;
        if (!c->dst || !c->src)
            fatal("dev_memcpy_batch_async('%s'): copy %zu has a NULL %s with %zu bytes", name, i,
                  c->dst ? "source" : "destination", c->bytes);
        if (c->bytes > SIZE_MAX - bytes) fatal("dev_memcpy_batch_async('%s'): the copies' bytes overflow", name);
        bytes += c->bytes;
        CopyDir d = dev_copy_direction(s->dev, c->dst, c->src);
        if (first == n) {
            first = i;
            dir = d;
        } else if (d != dir) {
            fatal("dev_memcpy_batch_async('%s'): copy %zu goes %s but copy %zu goes %s (one batch, one direction: "
                  "split it)", name, first, direction_words(dir), i, direction_words(d));
        }
    }
    if (!n) return; /* nothing to launch, as an empty foreach */
    check_no_overlap(name, copies, n);
    /* the race detector sees every range the launch reads and writes (dev_access: the next op is the batch) */
    for (size_t i = 0; i < n; i++) dev_access(s, copies[i].src, copies[i].bytes, 0, NULL);
    for (size_t i = 0; i < n; i++) dev_access(s, copies[i].dst, copies[i].bytes, 1, NULL);
    char full[96];
    if (dir == COPY_SAME_SIDE) snprintf(full, sizeof full, "%s", name);
    else snprintf(full, sizeof full, "%s.%s", name, copy_direction_name(dir)); /* "copy_in.h2d": the PCIe model prices it */
    dev_ops(s->dev)->copy_batch(s, full, copies, n, bytes, dir);
}

void dev_memset_async(Stream *s, void *dst, int byte, size_t bytes) {
    if (bytes && !dst) fatal("dev_memset_async: NULL pointer with %zu bytes", bytes);
    dev_ops(s->dev)->fill(s, dst, byte, bytes);
}

void dev_stream_synchronize(Stream *s) { dev_ops(s->dev)->stream_synchronize(s); }

void dev_synchronize(Dev *d) { dev_ops(d)->synchronize(d); }

/* ----------------------------------------------------------------- events */

Event *dev_event_create(Dev *d, const char *name) {
    Event *e = event_register_new(d, name);
    dev_ops(d)->event_init(e);
    return e;
}

void dev_event_destroy(Event *e) {
    if (!e) return;
    event_unregister(e);
    dev_ops(e->dev)->event_destroy(e);
}

void dev_event_record(Event *e, Stream *s) {
    if (e->dev != s->dev) fatal("event '%s' of rank %d recorded on a stream of rank %d", e->name, e->dev->rank, s->dev->rank);
    dev_ops(s->dev)->event_record(e, s);
}

/* A wait, sync or query refers to the latest record. `who`: the stream that waits, or NULL for the host
 * (dev_event_synchronize / dev_event_query); the message names the rank, the waiter and the hook it ran in. */
static void check_recorded(const Event *e, const Stream *who) {
    if (e->recorded) return;
    const Dev *d = e->dev;
    const char *module = d->scope.module, *phase = d->scope.phase;
    char waiter[160], where[200];
    if (who) snprintf(waiter, sizeof waiter, "%s stream", who->name);
    else snprintf(waiter, sizeof waiter, "the host");
    if (module && *module && phase && *phase) snprintf(where, sizeof where, " in %s's %s", module, phase);
    else if (module && *module) snprintf(where, sizeof where, " in %s", module);
    else if (phase && *phase) snprintf(where, sizeof where, " in %s", phase);
    else where[0] = 0;
    char msg[800];
    snprintf(msg, sizeof msg,
             "event '%s' waited on but never recorded (rank %d: %s waits on it%s; a wait refers to the latest "
             "dev_event_record of the event, so record it after the work it marks, before anything waits on it)",
             e->name, d->rank, waiter, where);
    /* decided in host order like a race: when every rank makes the same mistake, the lowest one says it */
    world_report_race(d->world, d->rank, msg);
}

void dev_stream_wait_event(Stream *s, Event *e) {
    if (e->dev != s->dev) fatal("event '%s' of rank %d waited on by a stream of rank %d", e->name, e->dev->rank, s->dev->rank);
    check_recorded(e, s);
    dev_ops(s->dev)->event_wait(s, e);
}

void dev_event_synchronize(Event *e) {
    check_recorded(e, NULL);
    dev_ops(e->dev)->event_synchronize(e);
}

int dev_event_query(Event *e) {
    check_recorded(e, NULL);
    return dev_ops(e->dev)->event_query(e);
}

/* ---------------------------------------------------------- host exchange */

/* Ranks as threads: a generation barrier; values are double-buffered by
 * generation parity so a fast rank's next call cannot overwrite values a
 * slow rank has not read yet. */
void threads_host_exchange(Dev *d, double value, double *out) {
    World *w = d->world;
    pthread_mutex_lock(&w->host_mu);
    uint64_t gen = w->host_gen;
    w->host_vals[gen & 1][world_rank_slot(w, d->rank)] = value; /* the executed ranks, by slot */
    if (++w->host_arrived == w->local_ranks) {
        w->host_arrived = 0;
        w->host_gen++;
        pthread_cond_broadcast(&w->host_cv);
    } else {
        while (w->host_gen == gen) pthread_cond_wait(&w->host_cv, &w->host_mu);
    }
    if (out) memcpy(out, w->host_vals[gen & 1], (size_t)w->local_ranks * sizeof *out);
    pthread_mutex_unlock(&w->host_mu);
}

void dev_host_allgather_f64(Dev *d, double value, double *out) { dev_ops(d)->host_exchange(d, value, out); }

void dev_host_barrier(Dev *d) { dev_ops(d)->host_exchange(d, 0.0, NULL); }

/* ------------------------------------------------ rendezvous channels */

struct ChanSlot {
    int stream_index, pg_id, color; /* the key */
    void *chan;
};

void chan_registry_init(ChanRegistry *r, size_t size, size_t mu_at, size_t cv_at) {
    *r = (ChanRegistry){.size = size, .mu_at = mu_at, .cv_at = cv_at};
    pthread_mutex_init(&r->lock, NULL);
}

void *chan_registry_get(ChanRegistry *r, int stream_index, int pg_id, int color) {
    pthread_mutex_lock(&r->lock);
    void *c = NULL;
    for (int i = 0; i < r->n && !c; i++) {
        const struct ChanSlot *k = &r->slots[i];
        if (k->stream_index == stream_index && k->pg_id == pg_id && k->color == color) c = k->chan;
    }
    if (!c) {
        if (r->n == r->cap) {
            r->cap = r->cap ? r->cap * 2 : 8;
            r->slots = xrealloc(r->slots, (size_t)r->cap * sizeof *r->slots);
        }
        c = xcalloc(1, r->size);
        pthread_mutex_init((pthread_mutex_t *)((char *)c + r->mu_at), NULL);
        cond_init_monotonic((pthread_cond_t *)((char *)c + r->cv_at));
        r->slots[r->n++] = (struct ChanSlot){stream_index, pg_id, color, c};
    }
    pthread_mutex_unlock(&r->lock);
    return c;
}

void *chan_registry_slot(ChanRegistry *r, int i) { return r->slots[i].chan; }

void chan_registry_fini(ChanRegistry *r) {
    for (int i = 0; i < r->n; i++) {
        char *c = r->slots[i].chan;
        pthread_mutex_destroy((pthread_mutex_t *)(c + r->mu_at));
        pthread_cond_destroy((pthread_cond_t *)(c + r->cv_at));
        free(c);
    }
    free(r->slots);
    pthread_mutex_destroy(&r->lock);
}
