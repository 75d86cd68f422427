/* collectives.c — NCCL-shaped collectives executed on stream workers.
 * local backend: ranks are threads; one rendezvous channel per stream index;
 *   each rank computes its own output from the peers' buffers, then a link
 *   model makes the collective last as long as ring traffic would.
 * mpi backend: one communicator per stream index; reductions are done here in
 *   rank order so results are bitwise identical to the local backend. */
#include "device_internal.h"
#include "util.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static const char *const KIND_NAMES[] = {"all_gather", "reduce_scatter", "all_reduce", "broadcast", "barrier"};

static void describe(char *buf, size_t cap, int rank, const CollDesc *c) {
    int n = snprintf(buf, cap, "rank %d %s", rank, KIND_NAMES[c->kind]);
    if (c->kind != COLL_BARRIER && n >= 0 && (size_t)n < cap)
        n += snprintf(buf + n, cap - (size_t)n, " %llu f32", (unsigned long long)c->count);
    if ((c->kind == COLL_REDUCE_SCATTER || c->kind == COLL_ALL_REDUCE) && n >= 0 && (size_t)n < cap)
        n += snprintf(buf + n, cap - (size_t)n, " %s", c->op == RED_AVG ? "avg" : "sum");
    if (c->kind == COLL_BROADCAST && n >= 0 && (size_t)n < cap) n += snprintf(buf + n, cap - (size_t)n, " root %d", c->root);
    if (n >= 0 && (size_t)n < cap) snprintf(buf + n, cap - (size_t)n, " (%s)", c->label);
}

static int same_call(const CollDesc *a, const CollDesc *b) {
    return a->kind == b->kind && a->count == b->count && a->op == b->op && a->root == b->root;
}

/* Fatal naming every rank's call if they differ (descs in rank order). */
static void check_agreement(Stream *s, uint64_t seq, const CollDesc *descs, int n) {
    int ok = 1;
    for (int r = 1; r < n; r++) ok &= same_call(&descs[0], &descs[r]);
    if (ok) return;
    size_t cap = 256 + (size_t)n * 160, len = 0;
    char *msg = xmalloc(cap);
    len = (size_t)snprintf(msg, cap, "collective mismatch on stream '%s' #%llu: ", s->name, (unsigned long long)seq);
    for (int r = 0; r < n && len < cap; r++) {
        char one[160];
        describe(one, sizeof one, r, &descs[r]);
        len += (size_t)snprintf(msg + len, cap - len, "%s%s", r ? "; " : "", one);
    }
#ifdef HAVE_MPI
    /* every process sees the mismatch: let rank 0 say it once (mpirun then
     * stops the job); the others report too if the job is still alive later */
    if (s->dev->world->cfg.backend == BACKEND_MPI && s->dev->rank != 0) sleep(5);
#endif
    fatal("%s", msg);
}

/* ------------------------------------------------------- flight recorder */

/* d->flight grows with the streams; slots are reused seq % FLIGHT_DEPTH. */
void flight_stream_created(Dev *d, Stream *s) {
    int index = s->index;
    pthread_mutex_lock(&d->flight_mu);
    if (index >= d->flight_n) {
        d->flight = xrealloc(d->flight, (size_t)(index + 1) * sizeof *d->flight);
        memset(d->flight + d->flight_n, 0, (size_t)(index + 1 - d->flight_n) * sizeof *d->flight);
        d->flight_n = index + 1;
    }
    d->flight[index].stream = s->name;
    pthread_mutex_unlock(&d->flight_mu);
}

static void flight_set(Stream *s, const Op *op, int state) {
    Dev *d = s->dev;
    pthread_mutex_lock(&d->flight_mu);
    FlightEntry *e = &d->flight[s->index].e[op->coll_seq % FLIGHT_DEPTH];
    if (state == FLIGHT_ISSUED)
        *e = (FlightEntry){op->coll_seq, op->coll.count, op->coll.kind, state, op->label};
    else if (e->seq == op->coll_seq && e->state)
        e->state = state;
    pthread_mutex_unlock(&d->flight_mu);
}

static const char *const STATE_NAMES[] = {"?", "issued", "started", "completed"};

/* One line for a rank: every stream's last collectives, oldest first. */
static void flight_print(FILE *f, Dev *d) {
    pthread_mutex_lock(&d->flight_mu);
    fprintf(f, "  rank %d:", d->rank);
    for (int i = 0; i < d->flight_n; i++) {
        const FlightRing *r = &d->flight[i];
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
            fprintf(f, " #%llu %s", (unsigned long long)e->seq, KIND_NAMES[e->kind]);
            if (e->kind != COLL_BARRIER) fprintf(f, " %llu", (unsigned long long)e->count);
            fprintf(f, "%s%s%s %s", *e->label ? " (" : "", e->label, *e->label ? ")" : "", STATE_NAMES[e->state]);
            fprintf(f, q < newest ? "," : "");
        }
    }
    fprintf(f, "\n");
    pthread_mutex_unlock(&d->flight_mu);
}

/* The watchdog's report: once per world, then exit(2). `lowest` is the post of
 * the lowest rank waiting in the collective (so the message does not depend
 * on which waiter's timer fired first); here[r] marks the ranks that arrived. */
void watchdog_timeout(Stream *s, const Op *op, const CollPost *lowest, int lowest_rank, const uint8_t *here, int n) {
    World *w = s->dev->world;
    pthread_mutex_lock(&w->report_mu);
    if (w->reporting) { /* someone else speaks (and exits) */
        for (;;) pthread_cond_wait(&w->report_cv, &w->report_mu);
    }
    w->reporting = 1;
    char missing[512] = "";
    size_t len = 0;
    int nmiss = 0;
    for (int r = 0; here && r < n && len < sizeof missing - 16; r++)
        if (!here[r]) {
            len += (size_t)snprintf(missing + len, sizeof missing - len, "%s%d", nmiss ? ", " : "", r);
            nmiss++;
        }
    const CollDesc *c = lowest ? &lowest->desc : &op->coll;
    uint64_t seq = lowest ? lowest->seq : op->coll_seq;
    char what[200];
    describe(what, sizeof what, 0, c); /* "rank 0 <kind> <count> f32 ... (label)" */
    const char *call = strchr(what + 5, ' ');
    fflush(stdout);
    fprintf(stderr, "error: collective timeout on rank %d: stream '%s' #%llu%s waited %.1f s", lowest_rank, s->name,
            (unsigned long long)seq, call ? call : "", w->cfg.collective_timeout_s);
    if (nmiss)
        fprintf(stderr, "; rank%s %s never joined it (every rank must issue the same collectives, in the same order, "
                        "on streams created in the same order)", nmiss > 1 ? "s" : "", missing);
    fprintf(stderr, "\n");
    fprintf(stderr, "flight recorder (the last %d collectives of every stream: #seq kind count (label) state):\n",
            FLIGHT_DEPTH);
    if (w->cfg.backend == BACKEND_LOCAL) {
        for (int r = 0; r < w->local_ranks; r++) {
            if (w->devs[r]) flight_print(stderr, w->devs[r]);
            else fprintf(stderr, "  rank %d: %s\n", r, w->rank_done[r] ? "finished (its program returned)" : "not started");
        }
    } else {
        flight_print(stderr, s->dev);
    }
    fflush(stderr);
    _exit(EXIT_FATAL); /* not exit: other streams may be inside kernels */
}

/* ------------------------------------------------------------ link model */

static double link_time_us(const WorldConfig *cfg, const CollDesc *c, size_t bytes) {
    int n = cfg->world_size;
    if (n <= 1 || cfg->link_gbps <= 0) return 0.0;
    double bw = cfg->link_gbps * 1e9 / 8.0; /* bytes per second */
    double lat = (n - 1) * cfg->link_latency_us;
    double ring = (double)(n - 1) / n * (double)bytes / bw * 1e6 + lat;
    switch (c->kind) {
    case COLL_ALL_GATHER:
    case COLL_REDUCE_SCATTER: return ring;
    case COLL_ALL_REDUCE: return 2.0 * ring;
    case COLL_BROADCAST: return (double)bytes / bw * 1e6 + lat;
    default: return lat;
    }
}

static void sleep_until(double target_us) {
    for (;;) {
        double left = target_us - now_us();
        if (left <= 0) return;
        struct timespec ts = {(time_t)(left / 1e6), (long)((left - (double)(time_t)(left / 1e6) * 1e6) * 1e3)};
        if (nanosleep(&ts, NULL) == 0) return;
        if (errno != EINTR) return;
    }
}

/* --------------------------------------------------------- local backend */

/* All ranks of the channel meet. With the watchdog on, a rank that waits
 * longer than the timeout reports the collective of the lowest waiting rank
 * (deterministic whichever timer fires first) and the ranks missing. */
static void chan_barrier(Stream *s, const Op *op, int n, int stamp) {
    CollChannel *c = s->chan;
    const double timeout = s->dev->world->cfg.collective_timeout_s;
    pthread_mutex_lock(&c->mu);
    uint64_t gen = c->generation;
    c->here[s->dev->rank] = 1;
    if (++c->arrived == n) {
        c->arrived = 0;
        memset(c->here, 0, sizeof c->here);
        if (stamp) c->t_last_arrival = now_us();
        c->generation++;
        pthread_cond_broadcast(&c->cv);
    } else if (timeout <= 0) {
        while (c->generation == gen) pthread_cond_wait(&c->cv, &c->mu);
    } else {
        struct timespec dl;
        clock_gettime(CLOCK_MONOTONIC, &dl);
        double whole = (double)(time_t)timeout;
        dl.tv_sec += (time_t)timeout;
        dl.tv_nsec += (long)((timeout - whole) * 1e9);
        if (dl.tv_nsec >= 1000000000L) dl.tv_sec++, dl.tv_nsec -= 1000000000L;
        while (c->generation == gen)
            if (pthread_cond_timedwait(&c->cv, &c->mu, &dl) == ETIMEDOUT && c->generation == gen) {
                int low = 0;
                while (low < n && !c->here[low]) low++;
                CollPost post = c->posts[low < n ? low : s->dev->rank];
                uint8_t here[WORLD_MAX_RANKS];
                memcpy(here, c->here, sizeof here);
                pthread_mutex_unlock(&c->mu);
                watchdog_timeout(s, op, &post, low < n ? low : s->dev->rank, here, n);
            }
    }
    pthread_mutex_unlock(&c->mu);
}

static void local_execute(Stream *s, const Op *op) {
    Dev *d = s->dev;
    CollChannel *c = s->chan;
    const int n = d->world_size, me = d->rank;
    const CollDesc *desc = &op->coll;
    const size_t cnt = (size_t)desc->count;
    float *scratch = NULL, *recv = op->dst;
    const float *send = op->src;
    if (desc->kind == COLL_ALL_REDUCE) {
        size_t chunk = (cnt + (size_t)n - 1) / (size_t)n;
        scratch = xmalloc((chunk ? chunk : 1) * sizeof(float));
    }

    pthread_mutex_lock(&c->mu);
    c->posts[me] = (CollPost){*desc, op->coll_seq, send, recv, scratch};
    pthread_mutex_unlock(&c->mu);
    chan_barrier(s, op, n, 1); /* everyone posted; their earlier stream work is visible (mutex) */

    pthread_mutex_lock(&c->mu);
    CollPost posts[WORLD_MAX_RANKS];
    memcpy(posts, c->posts, (size_t)n * sizeof *posts);
    double t_start = c->t_last_arrival;
    pthread_mutex_unlock(&c->mu);

    int agree = 1;
    for (int r = 1; r < n; r++) agree &= same_call(&posts[0].desc, &posts[r].desc);
    if (!agree) {
        if (me == 0) {
            CollDesc descs[WORLD_MAX_RANKS];
            for (int r = 0; r < n; r++) descs[r] = posts[r].desc;
            check_agreement(s, op->coll_seq, descs, n);
        }
        /* the other ranks wait for rank 0's fatal exit */
        pthread_mutex_lock(&c->mu);
        for (;;) pthread_cond_wait(&c->cv, &c->mu);
    }

    switch (desc->kind) {
    case COLL_ALL_GATHER:
        for (int r = 0; r < n; r++) {
            float *dst = recv + (size_t)r * cnt;
            if (cnt && dst != posts[r].send) memcpy(dst, posts[r].send, cnt * sizeof(float));
        }
        break;
    case COLL_REDUCE_SCATTER: {
        size_t off = (size_t)me * cnt;
        for (size_t i = 0; i < cnt; i++) {
            float acc = posts[0].send[off + i];
            for (int r = 1; r < n; r++) acc += posts[r].send[off + i];
            if (desc->op == RED_AVG) acc /= (float)n;
            recv[i] = acc;
        }
        break;
    }
    case COLL_ALL_REDUCE: {
        /* reduce my chunk into scratch; peers copy it after the next barrier
         * (recv may alias send, so nobody writes recv while others read send) */
        size_t chunk = (cnt + (size_t)n - 1) / (size_t)n;
        size_t lo = (size_t)me * chunk, hi = lo + chunk < cnt ? lo + chunk : cnt;
        for (size_t i = lo; i < hi; i++) {
            float acc = posts[0].send[i];
            for (int r = 1; r < n; r++) acc += posts[r].send[i];
            if (desc->op == RED_AVG) acc /= (float)n;
            scratch[i - lo] = acc;
        }
        chan_barrier(s, op, n, 0);
        for (int r = 0; r < n; r++) {
            size_t rlo = (size_t)r * chunk, rhi = rlo + chunk < cnt ? rlo + chunk : cnt;
            if (rlo < rhi) memcpy(recv + rlo, posts[r].scratch, (rhi - rlo) * sizeof(float));
        }
        break;
    }
    case COLL_BROADCAST:
        if (me != desc->root && cnt && recv != posts[desc->root].recv)
            memcpy(recv, posts[desc->root].recv, cnt * sizeof(float));
        break;
    default: break;
    }
    chan_barrier(s, op, n, 0); /* nobody reuses or frees its buffers while peers read them */
    free(scratch);
    double t = link_time_us(&d->world->cfg, desc, op->bytes);
    if (t > 0) sleep_until(t_start + t);
}

/* ----------------------------------------------------------- mpi backend */

#ifdef HAVE_MPI
static int as_int(size_t v, const char *what) {
    if (v > INT_MAX) fatal("mpi backend: %s of %zu elements exceeds INT_MAX", what, v);
    return (int)v;
}

/* Complete an MPI request, polling against the watchdog's deadline (a peer
 * that never joins would otherwise block this stream forever). */
static void mpi_wait(Stream *s, const Op *op, MPI_Request *req) {
    double timeout = s->dev->world->cfg.collective_timeout_s;
    if (timeout <= 0) {
        MPI_Wait(req, MPI_STATUS_IGNORE);
        return;
    }
    double deadline = now_us() + timeout * 1e6;
    for (int polls = 0;; polls++) {
        int done = 0;
        MPI_Test(req, &done, MPI_STATUS_IGNORE);
        if (done) return;
        if (now_us() > deadline) watchdog_timeout(s, op, NULL, s->dev->rank, NULL, 0);
        if (polls > 1000) {
            struct timespec ts = {0, 20000}; /* past the first microseconds, poll every 20 us */
            nanosleep(&ts, NULL);
        }
    }
}

static void mpi_execute(Stream *s, const Op *op) {
    Dev *d = s->dev;
    const int n = d->world_size, me = d->rank;
    const CollDesc *desc = &op->coll;
    const size_t cnt = (size_t)desc->count;
    float *recv = op->dst;
    const float *send = op->src;

    CollDesc descs[WORLD_MAX_RANKS];
    MPI_Request req;
    MPI_Iallgather((void *)desc, (int)sizeof *desc, MPI_BYTE, descs, (int)sizeof *desc, MPI_BYTE, s->comm, &req);
    mpi_wait(s, op, &req);
    check_agreement(s, op->coll_seq, descs, n);

    switch (desc->kind) {
    case COLL_ALL_GATHER:
        if (!cnt) break;
        if (send == recv + (size_t)me * cnt)
            MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, recv, as_int(cnt, "all_gather"), MPI_FLOAT, s->comm, &req);
        else
            MPI_Iallgather(send, as_int(cnt, "all_gather"), MPI_FLOAT, recv, (int)cnt, MPI_FLOAT, s->comm, &req);
        mpi_wait(s, op, &req);
        break;
    case COLL_REDUCE_SCATTER:
    case COLL_ALL_REDUCE: {
        /* every rank gets chunk `me` of every peer (alltoall), sums in rank order */
        size_t chunk = desc->kind == COLL_REDUCE_SCATTER ? cnt : (cnt + (size_t)n - 1) / (size_t)n;
        if (!chunk) break;
        as_int(chunk * (size_t)n, desc->kind == COLL_REDUCE_SCATTER ? "reduce_scatter" : "all_reduce");
        const float *in = send;
        float *padded = NULL;
        if (desc->kind == COLL_ALL_REDUCE && chunk * (size_t)n != cnt) {
            padded = xcalloc(chunk * (size_t)n, sizeof(float));
            memcpy(padded, send, cnt * sizeof(float));
            in = padded;
        }
        float *gathered = xmalloc(chunk * (size_t)n * sizeof(float));
        MPI_Ialltoall(in, (int)chunk, MPI_FLOAT, gathered, (int)chunk, MPI_FLOAT, s->comm, &req);
        mpi_wait(s, op, &req);
        float *mine = desc->kind == COLL_REDUCE_SCATTER ? recv : xmalloc(chunk * sizeof(float));
        for (size_t i = 0; i < chunk; i++) {
            float acc = gathered[i];
            for (int r = 1; r < n; r++) acc += gathered[(size_t)r * chunk + i];
            if (desc->op == RED_AVG) acc /= (float)n;
            mine[i] = acc;
        }
        if (desc->kind == COLL_ALL_REDUCE) {
            float *full = chunk * (size_t)n == cnt ? recv : xmalloc(chunk * (size_t)n * sizeof(float));
            MPI_Iallgather(mine, (int)chunk, MPI_FLOAT, full, (int)chunk, MPI_FLOAT, s->comm, &req);
            mpi_wait(s, op, &req);
            if (full != recv) {
                memcpy(recv, full, cnt * sizeof(float));
                free(full);
            }
            free(mine);
        }
        free(gathered);
        free(padded);
        break;
    }
    case COLL_BROADCAST:
        if (cnt) {
            MPI_Ibcast(recv, as_int(cnt, "broadcast"), MPI_FLOAT, desc->root, s->comm, &req);
            mpi_wait(s, op, &req);
        }
        break;
    default:
        MPI_Ibarrier(s->comm, &req);
        mpi_wait(s, op, &req);
        break;
    }
}
#endif

void coll_execute(Stream *s, const Op *op) {
    flight_set(s, op, FLIGHT_STARTED);
#ifdef HAVE_MPI
    if (s->dev->world->cfg.backend == BACKEND_MPI) mpi_execute(s, op);
    else
#endif
        local_execute(s, op);
    flight_set(s, op, FLIGHT_COMPLETED);
}

/* ------------------------------------------------------------- enqueue */

static void enqueue_coll(Dev *d, Stream *s, CollKind kind, const float *send, float *recv, size_t count, RedOp op,
                         int root, size_t bytes, const char *label) {
    if (s->dev != d) fatal("%s: stream '%s' belongs to rank %d, not rank %d", KIND_NAMES[kind], s->name, s->dev->rank, d->rank);
    if (kind == COLL_REDUCE_SCATTER || kind == COLL_ALL_REDUCE)
        if (op != RED_SUM && op != RED_AVG) fatal("%s: unknown reduce op %d", KIND_NAMES[kind], (int)op);
    if (count && kind != COLL_BARRIER && (!recv || (kind != COLL_BROADCAST && !send)))
        fatal("%s (%s): NULL buffer with %zu elements", KIND_NAMES[kind], label ? label : "", count);
    Op o;
    stream_op_init(s, &o, OP_COLL, KIND_NAMES[kind]);
    o.label = dev_intern(d, label && *label ? label : "");
    o.coll.kind = kind;
    o.coll.op = (kind == COLL_REDUCE_SCATTER || kind == COLL_ALL_REDUCE) ? (int)op : 0;
    o.coll.root = root;
    o.coll.count = count;
    snprintf(o.coll.label, sizeof o.coll.label, "%s", label ? label : "");
    o.src = send;
    o.dst = recv;
    o.bytes = bytes;
    o.coll_seq = s->coll_seq++;
    flight_set(s, &o, FLIGHT_ISSUED);
    stream_enqueue_op(s, &o);
}

void coll_all_gather(Dev *d, const float *send, float *recv, size_t send_count, Stream *s, const char *label) {
    enqueue_coll(d, s, COLL_ALL_GATHER, send, recv, send_count, RED_SUM, 0,
                 send_count * (size_t)d->world_size * sizeof(float), label);
}
void coll_reduce_scatter(Dev *d, const float *send, float *recv, size_t recv_count, RedOp op, Stream *s,
                         const char *label) {
    enqueue_coll(d, s, COLL_REDUCE_SCATTER, send, recv, recv_count, op, 0,
                 recv_count * (size_t)d->world_size * sizeof(float), label);
}
void coll_all_reduce(Dev *d, const float *send, float *recv, size_t count, RedOp op, Stream *s, const char *label) {
    enqueue_coll(d, s, COLL_ALL_REDUCE, send, recv, count, op, 0, count * sizeof(float), label);
}
void coll_broadcast(Dev *d, float *buf, size_t count, int root, Stream *s, const char *label) {
    if (root < 0 || root >= d->world_size) fatal("broadcast (%s): root %d is not a rank (0..%d)", label ? label : "", root, d->world_size - 1);
    enqueue_coll(d, s, COLL_BROADCAST, buf, buf, count, RED_SUM, root, count * sizeof(float), label);
}
void coll_barrier(Dev *d, Stream *s, const char *label) {
    enqueue_coll(d, s, COLL_BARRIER, NULL, NULL, 0, RED_SUM, 0, 0, label);
}
