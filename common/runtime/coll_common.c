/* coll_common.c — what both backends' collectives share: the table of kinds
 * (sizes, checks, link cost), the cross-rank agreement check, argument
 * checks, the flight recorder and the watchdog's report. */
#include "runtime/internal.h"
#include "runtime/profile.h"
#include "runtime/util.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* One row per CollKind, by its number (a row left out at the end fails the
 * static assert below; one left out in the middle has no name, which
 * test_runtime's collective_kind_table catches). */
static const CollKindInfo KINDS[] = {
    [COLL_ALL_GATHER] = {.name = "all_gather", .send = COLL_BUF_COUNT, .recv = COLL_BUF_PER_RANK,
                         .in_place = COLL_INPLACE_OWN_BLOCK, .link_share = COLL_LINK_RING, .link_passes = 1},
    [COLL_REDUCE_SCATTER] = {.name = "reduce_scatter", .send = COLL_BUF_PER_RANK, .recv = COLL_BUF_COUNT,
                             .reduces = 1, .in_place = COLL_INPLACE_OWN_BLOCK, .link_share = COLL_LINK_RING,
                             .link_passes = 1},
    [COLL_ALL_REDUCE] = {.name = "all_reduce", .send = COLL_BUF_COUNT, .recv = COLL_BUF_COUNT, .reduces = 1,
                         .in_place = COLL_INPLACE_SAME, .link_share = COLL_LINK_RING, .link_passes = 2},
    /* one buffer, passed as both send and recv: the root's is read, the others' written */
    [COLL_BROADCAST] = {.name = "broadcast", .send = COLL_BUF_NONE, .recv = COLL_BUF_COUNT, .rooted = 1,
                        .in_place = COLL_INPLACE_SAME, .link_share = COLL_LINK_WHOLE, .link_passes = 1},
    [COLL_BARRIER] = {.name = "barrier", .send = COLL_BUF_NONE, .recv = COLL_BUF_NONE,
                      .in_place = COLL_INPLACE_NONE, .link_share = COLL_LINK_LATENCY_ONLY, .link_passes = 1},
    /* sends and receives: each item's buffer, peer and link (P2PItem: p2p.c, race.c) */
    [COLL_P2P] = {.name = "p2p", .send = COLL_BUF_NONE, .recv = COLL_BUF_NONE, .in_place = COLL_INPLACE_NONE,
                  .link_share = COLL_LINK_WHOLE, .link_passes = 1, .p2p = 1},
};
_Static_assert(sizeof KINDS / sizeof *KINDS == COLL_KIND_COUNT, "one row of KINDS per CollKind");

const CollKindInfo *coll_kind(int kind) {
    return kind >= 0 && (size_t)kind < sizeof KINDS / sizeof *KINDS ? &KINDS[kind] : NULL;
}

size_t coll_buf_elems(CollBufSize b, size_t count, int group_size) {
    return b == COLL_BUF_PER_RANK ? count * (size_t)group_size : b == COLL_BUF_COUNT ? count : 0;
}

/* A kind without buffers (a barrier) has no count or dtype worth naming. */
static int has_buffers(const CollKindInfo *k) { return k && (k->send != COLL_BUF_NONE || k->recv != COLL_BUF_NONE); }

static void describe(char *buf, size_t cap, int rank, const CollDesc *c) {
    const CollKindInfo *k = coll_kind(c->kind);
    int n = snprintf(buf, cap, "rank %d %s", rank, coll_kind_name(c->kind));
    if (has_buffers(k) && n >= 0 && (size_t)n < cap)
        n += snprintf(buf + n, cap - (size_t)n, " %llu %s", (unsigned long long)c->count, coll_dtype_name(c->dtype));
    if (k && k->reduces && n >= 0 && (size_t)n < cap)
        n += snprintf(buf + n, cap - (size_t)n, " %s", c->op == RED_AVG ? "avg" : "sum");
    if (k && k->rooted && n >= 0 && (size_t)n < cap) n += snprintf(buf + n, cap - (size_t)n, " root %d", c->root);
    if (c->group && n >= 0 && (size_t)n < cap) n += snprintf(buf + n, cap - (size_t)n, " in %s", c->group_name);
    if (n >= 0 && (size_t)n < cap) snprintf(buf + n, cap - (size_t)n, " (%s)", c->label);
}

int coll_same_call(const CollDesc *a, const CollDesc *b) {
    return a->kind == b->kind && a->count == b->count && a->op == b->op && a->root == b->root && a->dtype == b->dtype &&
           a->group == b->group;
}

void coll_check_agreement(Stream *s, uint64_t seq, const CollDesc *descs, int n, const int *members) {
    int ok = 1;
    for (int r = 1; r < n; r++) ok &= coll_same_call(&descs[0], &descs[r]);
    if (ok) return;
    size_t cap = 256 + (size_t)n * 160, len = 0;
    char *msg = xmalloc(cap);
    len = (size_t)snprintf(msg, cap, "collective mismatch on stream '%s' #%llu: ", s->name, (unsigned long long)seq);
    for (int r = 0; r < n && len < cap; r++) {
        char one[160];
        describe(one, sizeof one, members ? members[r] : r, &descs[r]);
        len += (size_t)snprintf(msg + len, cap - len, "%s%s", r ? "; " : "", one);
    }
    /* every process sees the mismatch: let rank 0 say it once (mpirun then
     * stops the job); the others report too if the job is still alive later */
    if (backend_is_multiprocess(s->dev->world->cfg.backend) && (members ? members[0] : 0) != s->dev->rank) sleep(5);
    fatal("%s", msg);
}

const char *coll_kind_name(int kind) {
    const CollKindInfo *k = coll_kind(kind);
    return k && k->name ? k->name : "?";
}
const char *coll_dtype_name(int dtype) { return dtype == DTYPE_BF16 ? "bf16" : dtype == DTYPE_F32 ? "f32" : "?"; }
const char *coll_op_name(int kind, int op) {
    const CollKindInfo *k = coll_kind(kind);
    return k && k->reduces ? (op == RED_AVG ? "avg" : "sum") : NULL;
}
size_t coll_dtype_size(int dtype) { return dtype == DTYPE_BF16 ? sizeof(Bf16) : sizeof(float); }

/* NCCL's rule for a collective's two buffers: they are disjoint, or in the kind's in-place form
 * (all-gather: send == recv + rank*count; reduce-scatter: recv == send + rank*count; all-reduce:
 * send == recv). Any other overlap is undefined there, and here a data race between the ranks'
 * copies: one line naming the in-place form instead. */
static void check_overlap(const ProcessGroup *g, const CollKindInfo *k, const void *send, const void *recv,
                          size_t count, int dtype, const char *label) {
    if (!count || !send || !recv || (send == recv && k->in_place == COLL_INPLACE_SAME)) return;
    const size_t es = coll_dtype_size(dtype), n = (size_t)g->size, me = (size_t)g->rank;
    const size_t send_len = coll_buf_elems(k->send, count, g->size) * es,
                 recv_len = coll_buf_elems(k->recv, count, g->size) * es;
    const char *sp = send, *rp = recv;
    if (sp + send_len <= rp || rp + recv_len <= sp) return; /* disjoint */
    const int send_is_block = k->recv == COLL_BUF_PER_RANK; /* else recv is the block of send */
    if (k->in_place == COLL_INPLACE_OWN_BLOCK && (send_is_block ? sp == rp + me * count * es : rp == sp + me * count * es))
        return;
    const long long at = (long long)(sp - rp) / (long long)es, block = (long long)(me * count);
    const char *lbl = label ? label : "";
    if (k->in_place == COLL_INPLACE_SAME)
        fatal("%s (%s) on rank %d: send is at recv%+lld elements, overlapping recv: pass the same buffer for "
              "both (in place) or two disjoint ones; any other overlap races with the peers' reads",
              k->name, lbl, g->dev->rank, at);
    if (k->in_place == COLL_INPLACE_NONE)
        fatal("%s (%s) on rank %d: send is at recv%+lld elements, overlapping recv: %s has no in-place form, pass two "
              "disjoint buffers; any overlap races with the peers' copies",
              k->name, lbl, g->dev->rank, at, k->name);
    fatal("%s (%s) on rank %d: send is at recv%+lld elements, overlapping recv but not in place: in place means %s, "
          "i.e. send at recv%+lld (rank %zu of %zu in %s); any other overlap races with the peers' copies",
          k->name, lbl, g->dev->rank, at,
          send_is_block ? "send = recv + group rank * send_count" : "recv = send + group rank * recv_count",
          send_is_block ? block : -block, me, n, g->name);
}

void coll_validate(ProcessGroup *g, Stream *s, int kind, const void *send, const void *recv, size_t count, int op,
                   int root, int dtype, const char *label) {
    const CollKindInfo *k = coll_kind(kind);
    if (!k) fatal("unknown collective kind %d (%s)", kind, label ? label : "");
    if (k->p2p) fatal("%s (%s): point-to-point goes through dev_send / dev_recv", k->name, label ? label : "");
    if (!g) fatal("%s (%s): NULL process group", k->name, label ? label : "");
    Dev *d = g->dev;
    if (s->dev != d) fatal("%s: stream '%s' belongs to rank %d, not rank %d", k->name, s->name, s->dev->rank, d->rank);
    if (k->reduces && op != RED_SUM && op != RED_AVG) fatal("%s: unknown reduce op %d", k->name, op);
    if (k->rooted && (root < 0 || root >= g->size))
        fatal("%s (%s): root %d is not a rank of %s (0..%d)", k->name, label ? label : "", root, g->name, g->size - 1);
    if (count && ((k->recv != COLL_BUF_NONE && !recv) || (k->send != COLL_BUF_NONE && !send)))
        fatal("%s (%s): NULL buffer with %zu elements", k->name, label ? label : "", count);
    if (k->send != COLL_BUF_NONE && k->recv != COLL_BUF_NONE) check_overlap(g, k, send, recv, count, dtype, label);
}

const struct timespec *coll_deadline(double timeout_s, struct timespec *dl) {
    if (timeout_s <= 0) return NULL;
    clock_gettime(CLOCK_MONOTONIC, dl);
    double whole = (double)(time_t)timeout_s;
    dl->tv_sec += (time_t)timeout_s;
    dl->tv_nsec += (long)((timeout_s - whole) * 1e9);
    if (dl->tv_nsec >= 1000000000L) dl->tv_sec++, dl->tv_nsec -= 1000000000L;
    return dl;
}

/* Wait (r->mu held) until r's generation moves past gen; with timeout_s > 0,
 * return 1 (mu still held) if it has not after timeout_s seconds, else 0. */
static int wait_generation(CollRendezvous *r, uint64_t gen, double timeout_s) {
    struct timespec dl;
    const struct timespec *deadline = coll_deadline(timeout_s, &dl);
    while (r->generation == gen) {
        if (!deadline) pthread_cond_wait(&r->cv, &r->mu);
        else if (pthread_cond_timedwait(&r->cv, &r->mu, deadline) == ETIMEDOUT && r->generation == gen) return 1;
    }
    return 0;
}

/* The last rank to arrive opens the next round and wakes the others. */
void coll_rendezvous(CollRendezvous *r, Stream *s, const Op *op, const CollPost *posts, size_t stride) {
    const ProcessGroup *g = op->pg;
    const int n = g->nlive; /* the executed members meet (all of them, unless representative ranks stand in) */
    const uint64_t gen = r->generation;
    r->here[g->live] = 1;
    if (++r->arrived == n) {
        r->arrived = 0;
        memset(r->here, 0, sizeof r->here);
        r->generation++;
        pthread_cond_broadcast(&r->cv);
    } else if (wait_generation(r, gen, s->dev->world->cfg.collective_timeout_s)) {
        int low = 0;
        while (low < n && !r->here[low]) low++;
        if (low == n) low = g->live;
        CollPost post = *(const CollPost *)((const char *)posts + (size_t)low * stride);
        uint8_t here[WORLD_MAX_RANKS];
        memcpy(here, r->here, sizeof here);
        pthread_mutex_unlock(&r->mu);
        watchdog_timeout(s, op, &post, low, here);
    }
}

/* ------------------------------------------------------- flight recorder */

/* d->flight.rings grows with the streams; slots are reused seq % FLIGHT_DEPTH. */
void flight_stream_created(Dev *d, Stream *s) {
    int index = s->index;
    pthread_mutex_lock(&d->flight.mu);
    if (index >= d->flight.n) {
        d->flight.rings = xrealloc(d->flight.rings, (size_t)(index + 1) * sizeof *d->flight.rings);
        memset(d->flight.rings + d->flight.n, 0, (size_t)(index + 1 - d->flight.n) * sizeof *d->flight.rings);
        d->flight.n = index + 1;
    }
    d->flight.rings[index].stream = s->name;
    pthread_mutex_unlock(&d->flight.mu);
}

void flight_set(Stream *s, const Op *op, int state) {
    Dev *d = s->dev;
    pthread_mutex_lock(&d->flight.mu);
    FlightEntry *e = &d->flight.rings[s->index].e[op->coll_seq % FLIGHT_DEPTH];
    if (state == FLIGHT_ISSUED)
        *e = (FlightEntry){op->coll_seq, op->coll.count, op->coll.kind, state, op->label,
                           op->pg && op->pg->id ? op->pg->name : NULL};
    else if (e->seq == op->coll_seq && e->state)
        e->state = state;
    pthread_mutex_unlock(&d->flight.mu);
}

static const char *const STATE_NAMES[] = {"?", "issued", "started", "completed"};

/* One line for a rank: every stream's last collectives, oldest first. */
static void flight_print(FILE *f, Dev *d) {
    pthread_mutex_lock(&d->flight.mu);
    fprintf(f, "  rank %d:", d->rank);
    for (int i = 0; i < d->flight.n; i++) {
        const FlightRing *r = &d->flight.rings[i];
        uint64_t newest = 0;
        int any = 0;
        for (int k = 0; k < FLIGHT_DEPTH; k++)
            if (r->e[k].state && (!any || r->e[k].seq > newest)) newest = r->e[k].seq, any = 1;
        fprintf(f, "%s %s:", i ? ";" : "", r->stream ? r->stream : "?");
        if (!any) fprintf(f, " (no collectives)");
        uint64_t first = newest + 1 >= FLIGHT_DEPTH ? newest + 1 - FLIGHT_DEPTH : 0;
        for (uint64_t q = first; any && q <= newest; q++) {
            const FlightEntry *e = &r->e[q % FLIGHT_DEPTH];
            if (!e->state || e->seq != q) continue;
            fprintf(f, " #%llu %s", (unsigned long long)e->seq, coll_kind_name(e->kind));
            if (has_buffers(coll_kind(e->kind))) fprintf(f, " %llu", (unsigned long long)e->count);
            if (e->group) fprintf(f, " in %s", e->group);
            fprintf(f, "%s%s%s %s", *e->label ? " (" : "", e->label, *e->label ? ")" : "", STATE_NAMES[e->state]);
            fprintf(f, q < newest ? "," : "");
        }
    }
    fprintf(f, "\n");
    pthread_mutex_unlock(&d->flight.mu);
}

/* The watchdog's report: once per world, then exit(2). `lowest` is the post of
 * the lowest rank waiting in the collective (so the message does not depend
 * on which waiter's timer fired first); here[r] marks the ranks that arrived. */
void watchdog_timeout(Stream *s, const Op *op, const CollPost *lowest, int lowest_grank, const uint8_t *here) {
    World *w = s->dev->world;
    const ProcessGroup *g = op->pg;
    char missing[512] = "";
    size_t len = 0;
    int nmiss = 0;
    for (int r = 0; here && r < g->nlive && len < sizeof missing - 16; r++)
        if (!here[r]) {
            len += (size_t)snprintf(missing + len, sizeof missing - len, "%s%d", nmiss ? ", " : "", g->members[r]);
            nmiss++;
        }
    int lowest_rank = g->members[lowest_grank];
    const CollDesc *c = lowest ? &lowest->desc : &op->coll;
    uint64_t seq = lowest ? lowest->seq : op->coll_seq;
    char what[200];
    describe(what, sizeof what, 0, c); /* "rank 0 <kind> <count> f32 ... (label)" */
    const char *call = strchr(what + 5, ' ');
    const char *fix = g->id ? "every rank of a group must issue its collectives in the same order, on the same stream"
                            : "every rank must issue the same collectives, in the same order, on streams created in the "
                              "same order";
    char line[1024];
    int n = snprintf(line, sizeof line, "collective timeout on rank %d: stream '%s' #%llu%s waited %.1f s", lowest_rank,
                     s->name, (unsigned long long)seq, call ? call : "", w->cfg.collective_timeout_s);
    if (nmiss && n >= 0 && (size_t)n < sizeof line)
        snprintf(line + n, sizeof line - (size_t)n, "; rank%s %s never joined it (%s)", nmiss > 1 ? "s" : "", missing,
                 fix);
    watchdog_report(s, line);
}

void watchdog_report(Stream *s, const char *line) {
    World *w = s->dev->world;
    pthread_mutex_lock(&w->report_mu);
    if (w->reporting) { /* someone else speaks (and exits) */
        for (;;) pthread_cond_wait(&w->report_cv, &w->report_mu);
    }
    w->reporting = 1;
    report_lock(); /* a plain fatal() of another thread may be speaking */
    fflush(stdout);
    fprintf(stderr, "error: %s\n", line);
    fprintf(stderr, "flight recorder (the last %d collectives of every stream: #seq kind count [in group] (label) state):\n",
            FLIGHT_DEPTH);
    if (!backend_is_multiprocess(w->cfg.backend)) {
        for (int r = 0; r < w->local_ranks; r++) {
            if (w->devs[r]) flight_print(stderr, w->devs[r]);
            else fprintf(stderr, "  rank %d: %s\n", world_slot_rank(w, r),
                         w->rank_done[r] ? "finished (its program returned)" : "not started");
        }
    } else {
        flight_print(stderr, s->dev);
    }
    fflush(stderr);
    _exit(EXIT_FATAL); /* not exit: other streams may be inside kernels */
}

/* ------------------------------------------------- the public collectives */

void coll_all_gather(Dev *d, const float *send, float *recv, size_t send_count, Stream *s, const char *label) {
    pg_all_gather(dev_world_group(d), send, recv, send_count, s, label);
}
void coll_reduce_scatter(Dev *d, const float *send, float *recv, size_t recv_count, RedOp op, Stream *s,
                         const char *label) {
    pg_reduce_scatter(dev_world_group(d), send, recv, recv_count, op, s, label);
}
void coll_all_reduce(Dev *d, const float *send, float *recv, size_t count, RedOp op, Stream *s, const char *label) {
    pg_all_reduce(dev_world_group(d), send, recv, count, op, s, label);
}
void coll_broadcast(Dev *d, float *buf, size_t count, int root, Stream *s, const char *label) {
    coll_enqueue(dev_world_group(d), s, COLL_BROADCAST, buf, buf, count, RED_SUM, root, DTYPE_F32, label);
}
void coll_barrier(Dev *d, Stream *s, const char *label) {
    coll_enqueue(dev_world_group(d), s, COLL_BARRIER, NULL, NULL, 0, RED_SUM, 0, DTYPE_F32, label);
}
void coll_all_gather_bf16(Dev *d, const Bf16 *send, Bf16 *recv, size_t send_count, Stream *s, const char *label) {
    pg_all_gather_bf16(dev_world_group(d), send, recv, send_count, s, label);
}
void coll_reduce_scatter_bf16(Dev *d, const Bf16 *send, Bf16 *recv, size_t recv_count, RedOp op, Stream *s,
                              const char *label) {
    pg_reduce_scatter_bf16(dev_world_group(d), send, recv, recv_count, op, s, label);
}
void pg_all_gather(ProcessGroup *g, const float *send, float *recv, size_t send_count, Stream *s, const char *label) {
    coll_enqueue(g, s, COLL_ALL_GATHER, send, recv, send_count, RED_SUM, 0, DTYPE_F32, label);
}
void pg_reduce_scatter(ProcessGroup *g, const float *send, float *recv, size_t recv_count, RedOp op, Stream *s,
                       const char *label) {
    coll_enqueue(g, s, COLL_REDUCE_SCATTER, send, recv, recv_count, op, 0, DTYPE_F32, label);
}
void pg_all_reduce(ProcessGroup *g, const float *send, float *recv, size_t count, RedOp op, Stream *s,
                   const char *label) {
    coll_enqueue(g, s, COLL_ALL_REDUCE, send, recv, count, op, 0, DTYPE_F32, label);
}
void pg_all_gather_bf16(ProcessGroup *g, const Bf16 *send, Bf16 *recv, size_t send_count, Stream *s,
                        const char *label) {
    coll_enqueue(g, s, COLL_ALL_GATHER, send, recv, send_count, RED_SUM, 0, DTYPE_BF16, label);
}
void pg_reduce_scatter_bf16(ProcessGroup *g, const Bf16 *send, Bf16 *recv, size_t recv_count, RedOp op, Stream *s,
                            const char *label) {
    coll_enqueue(g, s, COLL_REDUCE_SCATTER, send, recv, recv_count, op, 0, DTYPE_BF16, label);
}

/* What a collective moves (the trace, the link model): its larger buffer, e.g.
 * the whole gathered / scattered one. */
static size_t coll_bytes(const CollKindInfo *k, size_t count, int group_size, DType dtype) {
    size_t send = coll_buf_elems(k->send, count, group_size), recv = coll_buf_elems(k->recv, count, group_size);
    return (send > recv ? send : recv) * coll_dtype_size(dtype);
}

/* NCCL's ring over the group's n ranks, on k nodes with m = n / k of them on
 * each (profile.c: where each figure comes from):
 *   time = base + steps x step latency + bytes x share x passes / bus bandwidth
 * Every byte crosses n - 1 ring steps per pass (the kind says what share of
 * its bytes each pass puts on a link and how many passes it makes); k - 1 of
 * each pass's steps cross the network. The bus bandwidth is the NVLink ring's
 * within a node; a ring across nodes leaves each node through the m NICs of
 * its m ranks at once (NCCL's channels), so it runs at the smaller of the
 * NVLink rate (when m > 1) and m NICs' rate. A link of 0 Gbit/s is off:
 * collectives take no time. */
double coll_link_time_us(const WorldConfig *cfg, const CollKindInfo *k, size_t bytes, const ProcessGroup *g) {
    int n = g->size;
    if (n <= 1 || cfg->link_gbps <= 0) return 0.0;
    int nodes = cfg->inter_link_gbps > 0 && g->nodes > 1 ? g->nodes : 1; /* g->spans_nodes is nodes > 1 */
    double gbps = cfg->link_gbps;
    if (nodes > 1) {
        int m = n / nodes; /* the group's ranks per node */
        double nics = (double)m * cfg->inter_link_gbps;
        gbps = m > 1 && gbps < nics ? gbps : nics;
    }
    double bw = gbps * 1e9 / 8.0; /* bytes per second */
    double inter_steps = nodes - 1, intra_steps = (n - 1) - inter_steps;
    double lat = intra_steps * cfg->link_latency_us + inter_steps * cfg->inter_link_latency_us;
    double base = cfg->profile ? cfg->profile->coll_latency_us : 0.0;
    double share = k->link_share == COLL_LINK_RING ? (double)(n - 1) / n : k->link_share == COLL_LINK_WHOLE ? 1.0 : 0.0;
    return base + k->link_passes * (share * (double)bytes / bw * 1e6 + lat);
}

void coll_op_describe(Dev *d, Stream *s, Op *o, ProcessGroup *g, CollKind kind, RedOp op, int root, size_t count,
                      DType dtype, const char *label) {
    o->label = dev_intern(d, label && *label ? label : "");
    o->pg = g;
    o->coll.kind = kind;
    const CollKindInfo *k = coll_kind((int)kind);
    o->coll.op = k->reduces ? (int)op : 0;
    o->coll.root = root;
    o->coll.count = count;
    o->coll.dtype = dtype;
    o->coll.group = g->id;
    snprintf(o->coll.label, sizeof o->coll.label, "%s", label ? label : "");
    snprintf(o->coll.group_name, sizeof o->coll.group_name, "%s", g->name);
    o->bytes = coll_bytes(k, count, g->size, dtype);
    o->cost_us = coll_link_time_us(&d->world->cfg, k, o->bytes, g);
    o->coll_seq = s->coll_seq++;
    flight_set(s, o, FLIGHT_ISSUED);
    if (d->coll_watch) {
        CollIssue c = {kind, k->name, o->label, d->scope.module, d->scope.phase, d->scope.step,
                       d->scope.micro, s->index, s->name};
        d->coll_watch(d->coll_watch_ctx, &c);
    }
}

/* The public collectives lead here: checked and described, then the backend queues it (backend.h). */
void coll_enqueue(ProcessGroup *g, Stream *s, CollKind kind, const void *send, void *recv, size_t count, RedOp op,
                  int root, DType dtype, const char *label) {
    coll_validate(g, s, (int)kind, send, recv, count, (int)op, root, (int)dtype, label);
    Op o;
    op_init(s, &o, OP_COLL, coll_kind_name((int)kind));
    coll_op_describe(g->dev, s, &o, g, kind, op, root, count, dtype, label);
    o.src = send;
    o.dst = recv;
    dev_ops(g->dev)->coll_enqueue(s, &o);
}

void dev_watch_collectives(Dev *d, void (*fn)(void *ctx, const CollIssue *c), void *ctx) {
    d->coll_watch = fn;
    d->coll_watch_ctx = fn ? ctx : NULL;
}
