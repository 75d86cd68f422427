/* backend_mpi.c — the CPU's "mpi" backend: one process per rank under mpirun
 * (mpi_world.c), streams, events and storage as the local backend's
 * (runtime_cpu.c), and each stream reaches its peers through communicators of its
 * own: a dup of the world's per stream index, a split of the world's per
 * (stream, group), so collectives on different streams never meet in one
 * communicator; reductions sum in rank order (coll_cpu.c's
 * coll_reduce_ranks), bitwise as the local backend's. A build without MPI
 * has this backend answer with one line. */
#include "cpu/cpu_internal.h"
#include "runtime/mpi_world.h"
#include "runtime/util.h"

#ifdef HAVE_MPI

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* CpuStream.coll: the stream's communicators. */
typedef struct {
    MPI_Comm world;           /* a dup of MPI_COMM_WORLD per stream index */
    MPI_Comm groups[PG_MAX];  /* group id >= 1: its split of the world, per stream */
} MpiStream;

static void mpi_backend_world_init(World *w, long *cores) { w->backend = mpi_world_create(w, cores); }

static void mpi_backend_world_fini(World *w) {
    mpi_world_destroy(w->backend);
    w->backend = NULL;
}

static void mpi_host_exchange(Dev *d, double value, double *out) { mpi_world_exchange(d->world->backend, value, out); }
static void mpi_group_init(ProcessGroup *g) { mpi_world_group_init(g->dev->world->backend, g); }
static void mpi_group_fini(ProcessGroup *g) { mpi_world_group_fini(g->dev->world->backend, g); }

/* Collective: streams are created in the same order on every rank (the watchdog catches a rank that does not). */
static void mpi_coll_stream_init(Stream *s) {
    Dev *d = s->dev;
    MpiStream *ms = xcalloc(1, sizeof *ms);
    cpu_stream(s)->coll = ms;
    MPI_Request req;
    MPI_Comm_idup(MPI_COMM_WORLD, &ms->world, &req);
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

static void mpi_coll_stream_fini(Stream *s) {
    MpiStream *ms = cpu_stream(s)->coll;
    MPI_Comm_free(&ms->world);
    for (int i = 1; i < s->dev->npgs; i++) MPI_Comm_free(&ms->groups[i]);
    free(ms);
    cpu_stream(s)->coll = NULL;
}

/* MPI_Comm_split is collective: every rank makes its groups and streams in the same order. */
static void mpi_stream_join_group(Stream *s, ProcessGroup *g) {
    MpiStream *ms = cpu_stream(s)->coll;
    MPI_Comm_split(mpi_world_comm(s->dev->world->backend, 0), g->color, s->dev->rank, &ms->groups[g->id]);
}

/* s's communicator for g. */
static MPI_Comm stream_comm(const Stream *s, const ProcessGroup *g) {
    const MpiStream *ms = cpu_stream(s)->coll;
    return g->id ? ms->groups[g->id] : ms->world;
}

/* ----------------------------------------------------------- execution */

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
        if (now_us() > deadline) watchdog_timeout(s, op, NULL, op->pg->rank, NULL);
        if (polls > 1000) {
            struct timespec ts = {0, 20000}; /* past the first microseconds, poll every 20 us */
            nanosleep(&ts, NULL);
        }
    }
}

/* Chunk `me` of every rank's `in` (n chunks of `chunk` elements, an alltoall),
 * reduced in rank order into `mine`: what reduce-scatter and all-reduce share. */
static void mpi_reduce_my_chunk(Stream *s, const Op *op, MPI_Comm comm, MPI_Datatype type, const void *in,
                                size_t chunk, void *mine) {
    const int n = op->pg->size;
    const size_t esize = coll_dtype_size(op->coll.dtype);
    char *gathered = xmalloc(chunk * (size_t)n * esize);
    MPI_Request req;
    MPI_Ialltoall(in, (int)chunk, type, gathered, (int)chunk, type, comm, &req);
    mpi_wait(s, op, &req);
    const void *parts[WORLD_MAX_RANKS];
    for (int r = 0; r < n; r++) parts[r] = gathered + (size_t)r * chunk * esize;
    coll_reduce_ranks(mine, parts, n, 0, chunk, op->coll.dtype, op->coll.op);
    free(gathered);
}

/* What each rank tells its group before a collective: its call (the agreement
 * check) and when its stream could start it on the modelled clock. */
typedef struct {
    CollDesc desc;
    double ready_us;
} MpiPost;

/* Returns the modelled time the group could start: the latest ready_us of its ranks. */
static double mpi_execute(Stream *s, const Op *op, double ready_us) {
    const ProcessGroup *g = op->pg;
    const int n = g->size, me = g->rank; /* group ranks */
    MPI_Comm comm = stream_comm(s, g);
    const CollDesc *desc = &op->coll;
    const size_t cnt = (size_t)desc->count, esize = coll_dtype_size(desc->dtype);
    const char *name = coll_kind_name(desc->kind);
    MPI_Datatype type = desc->dtype == DTYPE_BF16 ? MPI_UINT16_T : MPI_FLOAT;
    float *recv = op->dst;
    const float *send = op->src;

    MpiPost mine = {*desc, ready_us}, posts[WORLD_MAX_RANKS];
    MPI_Request req;
    MPI_Iallgather(&mine, (int)sizeof mine, MPI_BYTE, posts, (int)sizeof mine, MPI_BYTE, comm, &req);
    mpi_wait(s, op, &req);
    CollDesc descs[WORLD_MAX_RANKS];
    double start_us = ready_us;
    for (int r = 0; r < n; r++) {
        descs[r] = posts[r].desc;
        if (posts[r].ready_us > start_us) start_us = posts[r].ready_us;
    }
    coll_check_agreement(s, op->coll_seq, descs, n, g->members);

    /* a dry run moves no data (dry.h): the exchange above gave the modelled start and the agreement */
    switch (s->dev->world->cfg.dry_run ? COLL_KIND_COUNT : (CollKind)desc->kind) {
    case COLL_ALL_GATHER:
        if (!cnt) break;
        if ((const char *)send == (const char *)recv + (size_t)me * cnt * esize)
            MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, recv, as_int(cnt, name), type, comm, &req);
        else
            MPI_Iallgather(send, as_int(cnt, name), type, recv, (int)cnt, type, comm, &req);
        mpi_wait(s, op, &req);
        break;
    case COLL_REDUCE_SCATTER:
        if (!cnt) break;
        as_int(cnt * (size_t)n, name);
        mpi_reduce_my_chunk(s, op, comm, type, send, cnt, recv);
        break;
    case COLL_ALL_REDUCE: {
        /* reduce chunk `me` of the buffer (zero-padded to n equal chunks), then all-gather the chunks */
        size_t chunk = (cnt + (size_t)n - 1) / (size_t)n;
        if (!chunk) break;
        as_int(chunk * (size_t)n, name);
        const float *in = send;
        float *padded = NULL;
        if (chunk * (size_t)n != cnt) {
            padded = xcalloc(chunk * (size_t)n, sizeof(float));
            memcpy(padded, send, cnt * sizeof(float));
            in = padded;
        }
        float *mine = xmalloc(chunk * sizeof(float));
        mpi_reduce_my_chunk(s, op, comm, type, in, chunk, mine);
        float *full = chunk * (size_t)n == cnt ? recv : xmalloc(chunk * (size_t)n * sizeof(float));
        MPI_Iallgather(mine, (int)chunk, MPI_FLOAT, full, (int)chunk, MPI_FLOAT, comm, &req);
        mpi_wait(s, op, &req);
        if (full != recv) {
            memcpy(recv, full, cnt * sizeof(float));
            free(full);
        }
        free(mine);
        free(padded);
        break;
    }
    case COLL_BROADCAST:
        if (cnt) {
            MPI_Ibcast(recv, as_int(cnt, name), MPI_FLOAT, desc->root, comm, &req);
            mpi_wait(s, op, &req);
        }
        break;
    case COLL_BARRIER:
        MPI_Ibarrier(comm, &req);
        mpi_wait(s, op, &req);
        break;
    case COLL_P2P: break;        /* never here: mpi_p2p_execute */
    case COLL_KIND_COUNT: break; /* not a kind */
    }
    return start_us;
}

/* ------------------------------------------------------- point to point */

/* What a send tells its receiver first: the agreement check's fields and its modelled readiness. */
typedef struct {
    int32_t microbatch;
    uint64_t count;
    char label[32];
    double ready_us;
} MpiP2PHeader;

/* An item's three messages are tagged by its number (P2PItem.seq): streams post them in their own order, and
 * the tag, not the order, pairs a send with its receive (MPI's tags reach 32767 at least; numbers 8000 apart
 * share a tag, and those are ordered by MPI's non-overtaking rule long before they could meet). */
enum { P2P_TAG_HEADER = 0, P2P_TAG_DATA, P2P_TAG_ACK };
static int p2p_tag(const P2PItem *it, int which) { return (int)(it->seq % 8000) * 4 + which; }

/* Complete req before the watchdog's deadline, or report item it as waiting. */
static void p2p_wait(Stream *s, const Op *op, const P2PItem *it, MPI_Request *req, double deadline_us) {
    for (int polls = 0;; polls++) {
        int done = 0;
        MPI_Test(req, &done, MPI_STATUS_IGNORE);
        if (done) return;
        if (deadline_us > 0 && now_us() > deadline_us)
            p2p_timeout(s, op, it, s->dev->world->cfg.collective_timeout_s);
        if (polls > 1000) {
            struct timespec ts = {0, 20000};
            nanosleep(&ts, NULL);
        }
    }
}

/* A p2p group on the compute stream's world communicator (every stream's
 * sends and receives: the k-th send from a to b meets b's k-th receive from
 * a whatever their streams, as the local backend's mailboxes pair them).
 * Every receive's header is posted and every send started before any wait
 * (a group progresses as one). */
static double mpi_p2p_execute(Stream *s, const Op *op, double ready_us) {
    flight_set(s, op, FLIGHT_STARTED);
    P2PBatch *b = op->p2p;
    MPI_Comm comm = ((MpiStream *)cpu_stream(s->dev->streams[0])->coll)->world;
    const int run = !s->dev->world->cfg.dry_run, n = b->n;
    const double timeout = s->dev->world->cfg.collective_timeout_s;
    const double deadline = timeout > 0 ? now_us() + timeout * 1e6 : 0;
    MpiP2PHeader *hdr = xcalloc((size_t)n, sizeof *hdr);
    double *acks = xcalloc((size_t)n, sizeof *acks);
    MPI_Request *rq = xmalloc((size_t)n * 3 * sizeof *rq); /* per item: header, data, ack */
    for (int i = 0; i < 3 * n; i++) rq[i] = MPI_REQUEST_NULL;
    for (int i = 0; i < n; i++) {
        const P2PItem *it = &b->items[i];
        if (it->send) continue;
        MPI_Irecv(&hdr[i], (int)sizeof hdr[i], MPI_BYTE, it->peer, p2p_tag(it, P2P_TAG_HEADER), comm, &rq[3 * i]);
    }
    for (int i = 0; i < n; i++) {
        const P2PItem *it = &b->items[i];
        if (!it->send) continue;
        hdr[i] = (MpiP2PHeader){it->microbatch, it->count, "", ready_us};
        snprintf(hdr[i].label, sizeof hdr[i].label, "%s", it->label);
        MPI_Isend(&hdr[i], (int)sizeof hdr[i], MPI_BYTE, it->peer, p2p_tag(it, P2P_TAG_HEADER), comm, &rq[3 * i]);
        if (run && it->count)
            MPI_Isend(it->buf, as_int(it->count, "send"), MPI_FLOAT, it->peer, p2p_tag(it, P2P_TAG_DATA), comm, &rq[3 * i + 1]);
        MPI_Irecv(&acks[i], 1, MPI_DOUBLE, it->peer, p2p_tag(it, P2P_TAG_ACK), comm, &rq[3 * i + 2]);
    }
    double start_us = ready_us;
    for (int i = 0; i < n; i++) {
        const P2PItem *it = &b->items[i];
        if (it->send) continue;
        p2p_wait(s, op, it, &rq[3 * i], deadline);
        if (hdr[i].count != it->count || hdr[i].microbatch != it->microbatch)
            p2p_mismatch(s, it, hdr[i].microbatch, (size_t)hdr[i].count, hdr[i].label);
        if (hdr[i].ready_us > start_us) start_us = hdr[i].ready_us;
        if (run && it->count) {
            MPI_Irecv(it->buf, as_int(it->count, "recv"), MPI_FLOAT, it->peer, p2p_tag(it, P2P_TAG_DATA), comm, &rq[3 * i + 1]);
            p2p_wait(s, op, it, &rq[3 * i + 1], deadline);
        }
        acks[i] = ready_us;
        MPI_Isend(&acks[i], 1, MPI_DOUBLE, it->peer, p2p_tag(it, P2P_TAG_ACK), comm, &rq[3 * i + 2]);
    }
    for (int i = 0; i < n; i++) {
        const P2PItem *it = &b->items[i];
        for (int k = 0; k < 3; k++)
            if (rq[3 * i + k] != MPI_REQUEST_NULL) p2p_wait(s, op, it, &rq[3 * i + k], deadline);
        if (it->send && acks[i] > start_us) start_us = acks[i];
    }
    free(rq);
    free(acks);
    free(hdr);
    flight_set(s, op, FLIGHT_COMPLETED);
    free(b->items);
    free(b);
    return start_us;
}

/* A queued collective, run by the stream's worker (Op.exec). */
static double mpi_coll_execute(Stream *s, const Op *op, double ready_us) {
    flight_set(s, op, FLIGHT_STARTED);
    double start_us = mpi_execute(s, op, ready_us);
    flight_set(s, op, FLIGHT_COMPLETED);
    return start_us;
}

static void mpi_coll_enqueue(Stream *s, Op *op) {
    op->exec = op->coll.kind == COLL_P2P ? mpi_p2p_execute : mpi_coll_execute;
    cpu_enqueue_op(s, op);
}

static const BackendOps cpu_mpi_backend = {
    CPU_BACKEND_OPS,
    .world_init = mpi_backend_world_init,
    .world_fini = mpi_backend_world_fini,
    .host_exchange = mpi_host_exchange,
    .group_init = mpi_group_init,
    .group_fini = mpi_group_fini,
    .coll_stream_init = mpi_coll_stream_init,
    .coll_stream_fini = mpi_coll_stream_fini,
    .stream_join_group = mpi_stream_join_group,
    .coll_enqueue = mpi_coll_enqueue,
};

const BackendOps *cpu_mpi_backend_ops(void) { return &cpu_mpi_backend; }

#else

const BackendOps *cpu_mpi_backend_ops(void) { fatal("this build has no MPI support (rebuild with OpenMPI installed)"); }

#endif
