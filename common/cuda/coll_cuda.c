/* coll_cuda.c — collectives of the CUDA backend (device.h semantics).
 *
 * local (N ranks as threads sharing one GPU): the ranks meet on the host
 * when they ENQUEUE a collective (a rendezvous per stream index), exchange
 * buffer pointers and events, and each rank enqueues its own part on its own
 * stream:
 *   A  every rank records `ready` on its stream (its inputs are written) and
 *      posts it; each stream waits for every peer's `ready`;
 *   .  all_gather: device copies of the peers' shards into recv;
 *      reduce_scatter: a kernel sums the peers' chunks in rank order;
 *      all_reduce: each rank reduces its chunk into scratch, (B) posts
 *      `reduced`, waits for the peers', copies their chunks into recv;
 *      broadcast: a copy from the root's buffer;
 *   C  every rank records `done` and posts it; each stream waits for every
 *      peer's `done`, so nobody reuses or frees a buffer a peer still reads.
 * The host never waits for the GPU here; it waits only for the other ranks'
 * host threads to reach the same collective. Sums run in rank order, so the
 * results are bitwise those of the CPU backend's collectives.
 *
 * Process groups: the same per (stream index, group): a rendezvous of the
 * group's ranks, or a communicator split from the stream's world one.
 *
 * nccl / nccl-mpi (one GPU per rank): one communicator per stream index; the
 * ranks first exchange what they are about to call (threads: the rendezvous;
 * processes: MPI_Allgather) so a mismatch is reported by name instead of
 * hanging inside NCCL. NCCL's reduction order is its own: results match the
 * CPU backend within rounding, not bitwise. */
#include "cuda/cuda_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------ rendezvous */

/* The rendezvous of op's group on s (created at the group's first collective). */
static CudaChan *chan_of(Stream *s, const ProcessGroup *g) {
    struct CudaStream *cs = cuda_stream(s);
    if (!cs->pg_chans[g->id]) cs->pg_chans[g->id] = cuda_world_channel(s->dev->world, s->index, g->id, g->color);
    return cs->pg_chans[g->id];
}

/* Post `mine`, wait for every rank of op's group (threads of this process),
 * copy all posts into `all` (group-rank order). With the watchdog on, a rank
 * that waits too long reports the lowest waiting rank's call and who is missing. */
static void rendezvous(Stream *s, const Op *op, const CudaPost *mine, CudaPost *all) {
    const ProcessGroup *g = op->pg;
    CudaChan *c = chan_of(s, g);
    const int n = g->size;
    const double timeout = s->dev->world->cfg.collective_timeout_s;
    pthread_mutex_lock(&c->mu);
    uint64_t gen = c->generation;
    c->slots[gen & 1][g->rank] = *mine;
    c->here[g->rank] = 1;
    if (++c->arrived == n) {
        c->arrived = 0;
        memset(c->here, 0, sizeof c->here);
        c->generation++;
        pthread_cond_broadcast(&c->cv);
    } else if (coll_wait_generation(&c->cv, &c->mu, &c->generation, gen, timeout)) {
        int low = 0;
        while (low < n && !c->here[low]) low++;
        CollPost post = c->slots[gen & 1][low < n ? low : g->rank].post;
        uint8_t here[WORLD_MAX_RANKS];
        memcpy(here, c->here, sizeof here);
        pthread_mutex_unlock(&c->mu);
        watchdog_timeout(s, op, &post, low < n ? low : g->rank, here);
    }
    memcpy(all, c->slots[gen & 1], (size_t)n * sizeof *all);
    pthread_mutex_unlock(&c->mu);
}

/* Every rank's call, in group-rank order, compared; group rank 0 reports a mismatch. */
static void agree(Stream *s, const Op *op, const CollDesc *descs, int n) {
    int ok = 1;
    for (int r = 1; r < n; r++) ok &= coll_same_call(&descs[0], &descs[r]);
    if (ok) return;
    if (op->pg->rank == 0 || backend_is_multiprocess(s->dev->world->cfg.backend))
        coll_check_agreement(s, op->coll_seq, descs, n, op->pg->members); /* fatal */
    for (;;) pause(); /* the other threads wait for rank 0's exit */
}

/* ----------------------------------------------------------------- streams */

void cuda_coll_stream_created(Stream *s) {
    Dev *d = s->dev;
    World *w = d->world;
    struct CudaStream *cs = cuda_stream(s);
    CUDA_CHECK(cudaEventCreateWithFlags(&cs->ready, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&cs->reduced, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&cs->done, cudaEventDisableTiming));
    if (!backend_is_multiprocess(w->cfg.backend)) cs->pg_chans[0] = cuda_world_channel(w, s->index, 0, 0);
    if (w->cfg.backend != BACKEND_NCCL && w->cfg.backend != BACKEND_NCCL_MPI) return;

    /* one communicator per stream index: rank 0's unique id, then every rank joins */
    ncclUniqueId id;
    if (d->rank == 0) NCCL_CHECK(ncclGetUniqueId(&id));
    if (w->cfg.backend == BACKEND_NCCL) {
        if (d->rank == 0) {
            pthread_mutex_lock(&cs->pg_chans[0]->mu);
            cs->pg_chans[0]->nccl_id = id;
            pthread_mutex_unlock(&cs->pg_chans[0]->mu);
        }
        dev_host_barrier(d); /* rank 0 wrote the id */
        pthread_mutex_lock(&cs->pg_chans[0]->mu);
        id = cs->pg_chans[0]->nccl_id;
        pthread_mutex_unlock(&cs->pg_chans[0]->mu);
        dev_host_barrier(d); /* everyone read it before a later stream's id replaces it */
    } else {
        mpi_world_bcast_bytes(cuda_world(w)->mpi, &id, sizeof id, 0);
    }
    NCCL_CHECK(ncclCommInitRank(&cs->comm, d->world_size, id, d->rank));
    CUDA_CHECK(cudaMalloc((void **)&cs->one, sizeof(float))); /* runtime bookkeeping, not a tensor */
    CUDA_CHECK(cudaMemsetAsync(cs->one, 0, sizeof(float), cs->st)); /* the barrier's all-reduce sums it: defined */
}

void cuda_coll_stream_destroy(Stream *s) {
    struct CudaStream *cs = cuda_stream(s);
    for (int i = 1; i < PG_MAX; i++)
        if (cs->pg_comms[i]) NCCL_CHECK(ncclCommDestroy(cs->pg_comms[i]));
    if (cs->comm) NCCL_CHECK(ncclCommDestroy(cs->comm));
    if (cs->one) CUDA_CHECK(cudaFree(cs->one));
    if (cs->scratch) CUDA_CHECK(cudaFree(cs->scratch));
    for (int i = 0; i < cs->n_retired; i++) CUDA_CHECK(cudaFree(cs->retired[i]));
    free(cs->retired);
    CUDA_CHECK(cudaEventDestroy(cs->ready));
    CUDA_CHECK(cudaEventDestroy(cs->reduced));
    CUDA_CHECK(cudaEventDestroy(cs->done));
}

/* A group's communicator on s (nccl backends): split from the stream's world
 * communicator; every rank makes its groups and streams in the same order. */
void cuda_stream_join_group(Stream *s, ProcessGroup *g) {
    struct CudaStream *cs = cuda_stream(s);
    if (!cs->comm) return; /* local backend: rendezvous channels, made at the first collective */
    NCCL_CHECK(ncclCommSplit(cs->comm, g->color, s->dev->rank, &cs->pg_comms[g->id], NULL));
}

/* --------------------------------------------------------------- local */

static void wait_all(Stream *s, const Op *op, const CudaPost *all, int n) {
    for (int r = 0; r < n; r++)
        if (r != op->pg->rank) CUDA_CHECK(cudaStreamWaitEvent(cuda_stream(s)->st, all[r].ev, 0));
}

/* This rank's all_reduce chunk buffer; outgrown buffers are kept until the
 * stream dies because a peer's queued copy may still read them. */
static float *scratch_for(Stream *s, size_t floats) {
    struct CudaStream *cs = cuda_stream(s);
    if (cs->scratch_floats >= floats && cs->scratch) return cs->scratch;
    if (cs->scratch) {
        cs->retired = xrealloc(cs->retired, (size_t)(cs->n_retired + 1) * sizeof *cs->retired);
        cs->retired[cs->n_retired++] = cs->scratch;
    }
    CUDA_CHECK(cudaMalloc((void **)&cs->scratch, (floats ? floats : 1) * sizeof(float)));
    cs->scratch_floats = floats;
    return cs->scratch;
}

static void local_collective(Stream *s, const Op *op, const void *send, void *recv) {
    Dev *d = s->dev;
    struct CudaStream *cs = cuda_stream(s);
    const int n = op->pg->size, me = op->pg->rank; /* group ranks */
    const CollDesc *desc = &op->coll;
    const size_t cnt = (size_t)desc->count, esize = coll_dtype_size(desc->dtype);
    const int bf16 = desc->dtype == DTYPE_BF16;
    cudaStream_t st = cs->st;
    CudaPost mine = {{*desc, op->coll_seq, send, recv, NULL, 0}, cs->ready}, all[WORLD_MAX_RANKS];

    /* A: inputs ready everywhere */
    CUDA_CHECK(cudaEventRecord(cs->ready, st));
    rendezvous(s, op, &mine, all);
    CollDesc descs[WORLD_MAX_RANKS];
    for (int r = 0; r < n; r++) descs[r] = all[r].post.desc;
    agree(s, op, descs, n);
    wait_all(s, op, all, n);

    OpSpan span;
    if (d->scope.tracing) cuda_span_begin(d, s, &span);
    switch ((CollKind)desc->kind) {
    case COLL_ALL_GATHER:
        for (int r = 0; r < n; r++) {
            char *dst = (char *)recv + (size_t)r * cnt * esize;
            if (cnt && (const void *)dst != all[r].post.send)
                CUDA_CHECK(cudaMemcpyAsync(dst, all[r].post.send, cnt * esize, cudaMemcpyDeviceToDevice, st));
        }
        break;
    case COLL_REDUCE_SCATTER: {
        const void *in[WORLD_MAX_RANKS];
        for (int r = 0; r < n; r++) in[r] = all[r].post.send;
        cuda_reduce_ranks(recv, in, n, (size_t)me * cnt, cnt, desc->op == RED_AVG, bf16, st);
        break;
    }
    case COLL_ALL_REDUCE: {
        /* recv may alias send: reduce my chunk into scratch first, post it (B), then copy everyone's chunks */
        const void *in[WORLD_MAX_RANKS];
        for (int r = 0; r < n; r++) in[r] = all[r].post.send;
        size_t chunk = (cnt + (size_t)n - 1) / (size_t)n;
        size_t lo = (size_t)me * chunk, hi = lo + chunk < cnt ? lo + chunk : cnt;
        CudaPost red = mine, reds[WORLD_MAX_RANKS];
        red.post.scratch = scratch_for(s, chunk);
        if (lo < hi) cuda_reduce_ranks(red.post.scratch, in, n, lo, hi - lo, desc->op == RED_AVG, 0, st);
        red.ev = cs->reduced;
        CUDA_CHECK(cudaEventRecord(cs->reduced, st));
        rendezvous(s, op, &red, reds); /* B */
        wait_all(s, op, reds, n);
        for (int r = 0; r < n; r++) {
            size_t rlo = (size_t)r * chunk, rhi = rlo + chunk < cnt ? rlo + chunk : cnt;
            if (rlo < rhi)
                CUDA_CHECK(cudaMemcpyAsync((float *)recv + rlo, reds[r].post.scratch, (rhi - rlo) * sizeof(float),
                                           cudaMemcpyDeviceToDevice, st));
        }
        break;
    }
    case COLL_BROADCAST: {
        const void *src = all[desc->root].post.recv;
        if (me != desc->root && cnt && recv != src)
            CUDA_CHECK(cudaMemcpyAsync(recv, src, cnt * sizeof(float), cudaMemcpyDeviceToDevice, st));
        break;
    }
    case COLL_BARRIER: break; /* the rendezvous around this switch are all of it */
    case COLL_KIND_COUNT: break; /* not a kind */
    }
    if (d->scope.tracing) {
        TraceRec rec = cuda_trace_rec(s, op->label, op->name, TRACE_CAT_COLLECTIVE, op->bytes, coll_dtype_name(desc->dtype),
                                      op->pg->name);
        rec.op = coll_op_name(desc->kind, desc->op);
        cuda_span_end(d, s, &span, &rec, SPAN_ANY_LENGTH);
    }

    /* C: nobody moves on until every peer finished reading this rank's buffers */
    CudaPost fin = mine;
    fin.ev = cs->done;
    CUDA_CHECK(cudaEventRecord(cs->done, st));
    rendezvous(s, op, &fin, all);
    wait_all(s, op, all, n);
}

/* ----------------------------------------------------------------- nccl */

static void nccl_collective(Stream *s, const Op *op, const void *send, void *recv) {
    Dev *d = s->dev;
    struct CudaStream *cs = cuda_stream(s);
    const CollDesc *desc = &op->coll;
    const ProcessGroup *g = op->pg;
    const int n = g->size;
    ncclComm_t comm = g->id ? cs->pg_comms[g->id] : cs->comm;
    CollDesc descs[WORLD_MAX_RANKS];
    if (d->world->cfg.backend == BACKEND_NCCL) {
        CudaPost mine = {{*desc, op->coll_seq, send, recv, NULL, 0}, NULL}, all[WORLD_MAX_RANKS];
        rendezvous(s, op, &mine, all);
        for (int r = 0; r < n; r++) descs[r] = all[r].post.desc;
    } else {
        mpi_world_allgather_bytes(cuda_world(d->world)->mpi, g->id, desc, descs, sizeof *desc);
    }
    agree(s, op, descs, n);

    size_t cnt = (size_t)desc->count;
    ncclRedOp_t red = desc->op == RED_AVG ? ncclAvg : ncclSum;
    /* bfloat16: NCCL adds in float32 but rounds to bfloat16 at every hop of
     * its ring, so its sums may differ from the CPU backend's (one rounding)
     * by a few units in the last place. */
    ncclDataType_t type = desc->dtype == DTYPE_BF16 ? ncclBfloat16 : ncclFloat32;
    OpSpan span;
    if (d->scope.tracing) cuda_span_begin(d, s, &span);
    switch ((CollKind)desc->kind) {
    case COLL_ALL_GATHER: NCCL_CHECK(ncclAllGather(send, recv, cnt, type, comm, cs->st)); break;
    case COLL_REDUCE_SCATTER: NCCL_CHECK(ncclReduceScatter(send, recv, cnt, type, red, comm, cs->st)); break;
    case COLL_ALL_REDUCE: NCCL_CHECK(ncclAllReduce(send, recv, cnt, ncclFloat32, red, comm, cs->st)); break;
    case COLL_BROADCAST: NCCL_CHECK(ncclBroadcast(recv, recv, cnt, ncclFloat32, desc->root, comm, cs->st)); break;
    case COLL_BARRIER: NCCL_CHECK(ncclAllReduce(cs->one, cs->one, 1, ncclFloat32, ncclSum, comm, cs->st)); break;
    case COLL_KIND_COUNT: break; /* not a kind */
    }
    if (d->scope.tracing) {
        TraceRec rec = cuda_trace_rec(s, op->label, op->name, TRACE_CAT_COLLECTIVE, op->bytes, coll_dtype_name(desc->dtype),
                                      op->pg->name);
        rec.op = coll_op_name(desc->kind, desc->op);
        cuda_span_end(d, s, &span, &rec, SPAN_ANY_LENGTH);
    }
}

/* ------------------------------------------------------------- enqueue */

/* A collective coll_enqueue (runtime/backend.c) checked and described: each
 * rank enqueues its part on its stream now, on the host thread. */
void cuda_coll_enqueue(Stream *s, Op *o) {
    if (s->dev->world->cfg.backend == BACKEND_LOCAL) local_collective(s, o, o->src, o->dst);
    else nccl_collective(s, o, o->src, o->dst);
    /* the GPU runs it later: "started" means handed to the stream */
    flight_set(s, o, FLIGHT_STARTED);
    s->enqueued++;
}
