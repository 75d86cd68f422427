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

/* All ranks of the channel meet; returns the generation that completed. */
static void chan_barrier(CollChannel *c, int n, int stamp) {
    pthread_mutex_lock(&c->mu);
    uint64_t gen = c->generation;
    if (++c->arrived == n) {
        c->arrived = 0;
        if (stamp) c->t_last_arrival = now_us();
        c->generation++;
        pthread_cond_broadcast(&c->cv);
    } else {
        while (c->generation == gen) pthread_cond_wait(&c->cv, &c->mu);
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
    c->posts[me] = (CollPost){*desc, send, recv, scratch};
    pthread_mutex_unlock(&c->mu);
    chan_barrier(c, n, 1); /* everyone posted; their earlier stream work is visible (mutex) */

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
        chan_barrier(c, n, 0);
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
    chan_barrier(c, n, 0); /* nobody reuses or frees its buffers while peers read them */
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

static void mpi_execute(Stream *s, const Op *op) {
    Dev *d = s->dev;
    const int n = d->world_size, me = d->rank;
    const CollDesc *desc = &op->coll;
    const size_t cnt = (size_t)desc->count;
    float *recv = op->dst;
    const float *send = op->src;

    CollDesc descs[WORLD_MAX_RANKS];
    MPI_Allgather((void *)desc, (int)sizeof *desc, MPI_BYTE, descs, (int)sizeof *desc, MPI_BYTE, s->comm);
    check_agreement(s, op->coll_seq, descs, n);

    switch (desc->kind) {
    case COLL_ALL_GATHER:
        if (!cnt) break;
        if (send == recv + (size_t)me * cnt)
            MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, recv, as_int(cnt, "all_gather"), MPI_FLOAT, s->comm);
        else
            MPI_Allgather(send, as_int(cnt, "all_gather"), MPI_FLOAT, recv, (int)cnt, MPI_FLOAT, s->comm);
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
        MPI_Alltoall(in, (int)chunk, MPI_FLOAT, gathered, (int)chunk, MPI_FLOAT, s->comm);
        float *mine = desc->kind == COLL_REDUCE_SCATTER ? recv : xmalloc(chunk * sizeof(float));
        for (size_t i = 0; i < chunk; i++) {
            float acc = gathered[i];
            for (int r = 1; r < n; r++) acc += gathered[(size_t)r * chunk + i];
            if (desc->op == RED_AVG) acc /= (float)n;
            mine[i] = acc;
        }
        if (desc->kind == COLL_ALL_REDUCE) {
            float *full = chunk * (size_t)n == cnt ? recv : xmalloc(chunk * (size_t)n * sizeof(float));
            MPI_Allgather(mine, (int)chunk, MPI_FLOAT, full, (int)chunk, MPI_FLOAT, s->comm);
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
        if (cnt) MPI_Bcast(recv, as_int(cnt, "broadcast"), MPI_FLOAT, desc->root, s->comm);
        break;
    default: MPI_Barrier(s->comm); break;
    }
}
#endif

void coll_execute(Stream *s, const Op *op) {
#ifdef HAVE_MPI
    if (s->dev->world->cfg.backend == BACKEND_MPI) {
        mpi_execute(s, op);
        return;
    }
#endif
    local_execute(s, op);
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
