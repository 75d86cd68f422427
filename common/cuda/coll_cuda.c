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
 * group's ranks.
 *
 * nccl / nccl-mpi (one GPU per rank): as PyTorch's ProcessGroupNCCL, ONE
 * communicator per process group (the world's from ncclCommInitRank, every
 * other group's an ncclCommSplit of it, made when the group is, in the same
 * order on every rank) and ONE NCCL stream per communicator. A collective
 * issued on runtime stream s: an event recorded on s, which the group's NCCL
 * stream waits for; the NCCL call on the NCCL stream; an event recorded there,
 * which s waits for. So s keeps its meaning (what was queued on s before the
 * collective is ordered before it, what is queued after it after it), and
 * the memory the collective reads and writes needs no more than the
 * allocator's stream rules for s.
 * Why not a communicator per runtime stream (this backend once had one per
 * stream index): NCCL kernels block on the GPU until their peers arrive, and
 * NCCL warns ("Using multiple NCCL communicators concurrently") that
 * operations on different communicators running at once can deadlock unless
 * every rank orders them the same way; nothing would order an all-gather on
 * one stream's communicator against a reduce-scatter on another's. With one
 * communicator and one stream per group, the group's collectives run on the
 * GPU in the order the host issued them, and that order is the same on every
 * rank: before any NCCL call the ranks exchange what they are about to call
 * (threads: the blocking rendezvous; processes: MPI_Allgather on the group)
 * and agree, so the k-th NCCL call of a group is the same call on every rank,
 * and a mismatch is reported by name instead of hanging inside NCCL.
 * The price, which PyTorch FSDP2 on NCCL pays as well: the all-gathers and
 * reduce-scatters of one group serialize with each other on the GPU (each
 * still overlaps compute). Two groups (HSDP's shard and replicate) have two
 * communicators and two NCCL streams, as in PyTorch: what orders them alike on
 * every rank is the program's events (a replicate all-reduce waits for the
 * shard reduce-scatter whose output it reads). NCCL's reduction order is its
 * own: results match the CPU backend within rounding, not bitwise.
 * A GPU-side hang (a peer that never arrives, a NCCL error) is caught where
 * the host waits for the GPU (cuda_wait polls, cuda_nccl_watch): the rank's
 * communicators are aborted and one line names the rank, the wait and the
 * last collective issued on each group.
 *
 * Point to point (p2p.c's groups of dev_send / dev_recv, one op of kind
 * COLL_P2P), also at enqueue on the host thread. local: World.p2p's mailbox
 * per (sender, receiver), the CPU local backend's (p2p.c), carrying device
 * pointers and events: the sender posts its buffer and `sent` (its stream
 * after its inputs); the receiver's stream waits for `sent`, copies device to
 * device and records `done`, which the sender's stream waits for before it
 * goes on (local_p2p). nccl / nccl-mpi: ncclSend / ncclRecv between
 * ncclGroupStart and ncclGroupEnd on the world's communicator and NCCL
 * stream, between the same in / out events as a collective (nccl_p2p). */
#include "cuda/cuda_internal.h"

#include <errno.h>
#include <stddef.h>
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
 * copy all posts into `all` (group-rank order). The watchdog: coll_rendezvous. */
static void rendezvous(Stream *s, const Op *op, const CudaPost *mine, CudaPost *all) {
    const ProcessGroup *g = op->pg;
    CudaChan *c = chan_of(s, g);
    pthread_mutex_lock(&c->rv.mu);
    CudaPost *slots = c->slots[c->rv.generation & 1]; /* this round's */
    slots[g->rank] = *mine;
    coll_rendezvous(&c->rv, s, op, &slots[0].post, sizeof *slots);
    memcpy(all, slots, (size_t)g->size * sizeof *all);
    pthread_mutex_unlock(&c->rv.mu);
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
    World *w = s->dev->world;
    struct CudaStream *cs = cuda_stream(s);
    CUDA_CHECK(cudaEventCreateWithFlags(&cs->ready, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&cs->reduced, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&cs->done, cudaEventDisableTiming));
    if (!backend_is_multiprocess(w->cfg.backend)) cs->pg_chans[0] = cuda_world_channel(w, s->index, 0, 0);
    /* nccl backends: nothing per stream; the group's communicator and NCCL stream serve every stream */
}

void cuda_coll_stream_destroy(Stream *s) {
    struct CudaStream *cs = cuda_stream(s);
    if (cs->scratch) CUDA_CHECK(cudaFree(cs->scratch));
    for (int i = 0; i < cs->n_retired; i++) CUDA_CHECK(cudaFree(cs->retired[i]));
    free(cs->retired);
    CUDA_CHECK(cudaEventDestroy(cs->ready));
    CUDA_CHECK(cudaEventDestroy(cs->reduced));
    CUDA_CHECK(cudaEventDestroy(cs->done));
}

/* Nothing per (stream, group): local: the rendezvous channel is made at the
 * group's first collective on s (chan_of); nccl: the group's communicator
 * serves every stream (cuda_coll_group_init). */
void cuda_stream_join_group(Stream *s, ProcessGroup *g) { (void)s, (void)g; }

/* ------------------------------------------------------ nccl: groups */

/* The world's communicator: rank 0's unique id, then every rank joins. */
static ncclComm_t world_comm_init(Dev *d) {
    World *w = d->world;
    ncclUniqueId id;
    if (d->rank == 0) NCCL_CHECK(ncclGetUniqueId(&id));
    if (w->cfg.backend == BACKEND_NCCL) {
        CudaChan *c = cuda_world_channel(w, 0, 0, 0); /* any place the rank threads share */
        if (d->rank == 0) {
            pthread_mutex_lock(&c->rv.mu);
            c->nccl_id = id;
            pthread_mutex_unlock(&c->rv.mu);
        }
        dev_host_barrier(d); /* rank 0 wrote the id */
        pthread_mutex_lock(&c->rv.mu);
        id = c->nccl_id;
        pthread_mutex_unlock(&c->rv.mu);
    } else {
        mpi_world_bcast_bytes(cuda_world(w)->mpi, &id, sizeof id, 0);
    }
    ncclComm_t comm;
    NCCL_CHECK(ncclCommInitRank(&comm, d->world_size, id, d->rank));
    return comm;
}

/* Every rank makes the same groups in the same order (group.c), so the world
 * communicator's splits are collective calls every rank makes in turn. */
void cuda_coll_group_init(ProcessGroup *g) {
    Dev *d = g->dev;
    if (!cuda_is_nccl(d->world)) return; /* local: rendezvous channels */
    CudaGroup *cg = &cuda_dev(d)->groups[g->id];
    if (g->id == 0) cg->comm = world_comm_init(d);
    else NCCL_CHECK(ncclCommSplit(cuda_dev(d)->groups[0].comm, g->color, d->rank, &cg->comm, NULL));
    snprintf(cg->name, sizeof cg->name, "%s", g->name);
    CUDA_CHECK(cudaStreamCreateWithFlags(&cg->st, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&cg->in, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&cg->out, cudaEventDisableTiming));
    CUDA_CHECK(cudaMalloc((void **)&cg->one, sizeof(float))); /* runtime bookkeeping, not a tensor */
    CUDA_CHECK(cudaMemsetAsync(cg->one, 0, sizeof(float), cg->st)); /* the barrier's all-reduce sums it: defined */
}

/* Teardown (dev_fini, after every runtime stream is gone): the NCCL streams
 * drained, then the communicators destroyed, the splits before the world's
 * they came from. */
void cuda_coll_groups_fini(Dev *d) {
    struct CudaDev *c = cuda_dev(d);
    for (int i = 0; i < PG_MAX; i++)
        if (c->groups[i].comm)
            cuda_wait(d, NULL, c->groups[i].st, "the teardown of the NCCL stream of group", c->groups[i].name);
    for (int i = PG_MAX; i-- > 0;) {
        CudaGroup *cg = &c->groups[i];
        if (!cg->comm) continue;
        NCCL_CHECK(ncclCommDestroy(cg->comm));
        cg->comm = NULL;
        CUDA_CHECK(cudaFree(cg->one));
        CUDA_CHECK(cudaEventDestroy(cg->in));
        CUDA_CHECK(cudaEventDestroy(cg->out));
        CUDA_CHECK(cudaStreamDestroy(cg->st));
    }
}

/* ------------------------------------------------------ nccl: hangs */

void cuda_nccl_watch(Dev *d, const char *what, const char *name, double waited_s) {
    struct CudaDev *c = cuda_dev(d);
    if (!c) return;
    ncclResult_t err = ncclSuccess;
    int bad = -1;
    for (int i = 0; i < PG_MAX && bad < 0; i++) {
        if (!c->groups[i].comm) continue;
        ncclResult_t r = ncclSuccess;
        NCCL_CHECK(ncclCommGetAsyncError(c->groups[i].comm, &r));
        if (r != ncclSuccess && r != ncclInProgress) err = r, bad = i;
    }
    /* A long wait is a hang only while a collective is unfinished: its out event
     * follows the last collective on the group's NCCL stream (in order), so once
     * every group's completed, nothing this rank gave NCCL is blocked. As
     * PyTorch's watchdog, a collective queued behind long compute counts. */
    const double timeout = d->world->cfg.collective_timeout_s;
    int unfinished = 0;
    if (bad < 0 && timeout > 0 && waited_s > timeout)
        for (int i = 0; i < PG_MAX; i++)
            if (c->groups[i].comm && c->groups[i].issued && !cuda_event_done(c->groups[i].out)) unfinished = 1;
    if (bad < 0 && !unfinished) return;

    char last[1024] = "";
    size_t len = 0;
    for (int i = 0; i < PG_MAX && len < sizeof last - 1; i++) {
        const CudaGroup *cg = &c->groups[i];
        if (!cg->comm) continue;
        int n;
        if (!cg->issued) n = snprintf(last + len, sizeof last - len, "%s%s: none", len ? "; " : "", cg->name);
        else
            n = snprintf(last + len, sizeof last - len, "%s%s: %s '%s' #%llu on stream '%s' (%s)", len ? "; " : "",
                         cg->name, coll_kind_name(cg->last_kind), cg->last_label ? cg->last_label : "",
                         (unsigned long long)cg->last_seq, cg->last_stream,
                         cuda_event_done(cg->out) ? "finished" : "unfinished");
        if (n < 0) break;
        len += (size_t)n < sizeof last - len ? (size_t)n : sizeof last - len - 1;
    }
    char nccl[320];
    if (bad >= 0) {
        const char *detail = ncclGetLastError(c->groups[bad].comm);
        snprintf(nccl, sizeof nccl, "NCCL error on group '%s': %s%s%s", c->groups[bad].name, ncclGetErrorString(err),
                 detail && *detail ? ": " : "", detail && *detail ? detail : "");
    } else {
        snprintf(nccl, sizeof nccl, "no NCCL error reported, past --collective-timeout-s %g", timeout);
    }
    for (int i = PG_MAX; i-- > 0;) /* splits first; NCCL's kernels see the abort flag and return */
        if (c->groups[i].comm) {
            (void)ncclCommAbort(c->groups[i].comm);
            c->groups[i].comm = NULL;
        }
    fatal("rank %d: %s after waiting %.1f s for %s%s%s%s (%s); the last collective issued on each group: %s; "
          "this rank's NCCL communicators aborted", d->rank, bad >= 0 ? "NCCL failed" : "GPU hang", waited_s, what,
          name ? " '" : "", name ? name : "", name ? "'" : "", nccl, last);
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
    case COLL_P2P: break;        /* never here: local_p2p */
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

/* On the group's NCCL stream, between two events (the header says why). */
static void nccl_collective(Stream *s, const Op *op, const void *send, void *recv) {
    Dev *d = s->dev;
    struct CudaStream *cs = cuda_stream(s);
    const CollDesc *desc = &op->coll;
    const ProcessGroup *g = op->pg;
    const int n = g->size;
    CudaGroup *cg = &cuda_dev(d)->groups[g->id];
    ncclComm_t comm = cg->comm;
    cudaStream_t st = cg->st;
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

    /* the NCCL stream follows s up to here */
    CUDA_CHECK(cudaEventRecord(cg->in, cs->st));
    CUDA_CHECK(cudaStreamWaitEvent(st, cg->in, 0));
    OpSpan span; /* timed on the NCCL stream: the call itself, not its wait for earlier ones */
    if (d->scope.tracing) cuda_span_begin_on(d, st, &span);
    const size_t esize = coll_dtype_size(desc->dtype);
    if (n == 1) {
        /* A group of one: every collective is the identity (a copy when out of place), done here
         * rather than by NCCL. Measured on an H100 (NCCL 2.28.3, make gpu-check's check_colls):
         * a one-rank ncclAvg out of place left the last elements of 262147 unwritten. */
        if (desc->kind != COLL_BARRIER && desc->kind != COLL_BROADCAST && cnt && send != recv)
            CUDA_CHECK(cudaMemcpyAsync(recv, send, cnt * esize, cudaMemcpyDeviceToDevice, st));
    } else switch ((CollKind)desc->kind) {
    case COLL_ALL_GATHER: NCCL_CHECK(ncclAllGather(send, recv, cnt, type, comm, st)); break;
    case COLL_REDUCE_SCATTER: NCCL_CHECK(ncclReduceScatter(send, recv, cnt, type, red, comm, st)); break;
    case COLL_ALL_REDUCE: NCCL_CHECK(ncclAllReduce(send, recv, cnt, ncclFloat32, red, comm, st)); break;
    case COLL_BROADCAST: NCCL_CHECK(ncclBroadcast(recv, recv, cnt, ncclFloat32, desc->root, comm, st)); break;
    case COLL_BARRIER: NCCL_CHECK(ncclAllReduce(cg->one, cg->one, 1, ncclFloat32, ncclSum, comm, st)); break;
    case COLL_P2P: break;        /* never here: nccl_p2p */
    case COLL_KIND_COUNT: break; /* not a kind */
    }
    if (d->scope.tracing) { /* filed under s, the stream it was issued on */
        TraceRec rec = cuda_trace_rec(s, op->label, op->name, TRACE_CAT_COLLECTIVE, op->bytes, coll_dtype_name(desc->dtype),
                                      op->pg->name);
        rec.op = coll_op_name(desc->kind, desc->op);
        cuda_span_end_on(d, st, &span, &rec, SPAN_ANY_LENGTH);
    }
    /* s follows the collective: what is queued on s next (frees of its buffers included) comes after it */
    CUDA_CHECK(cudaEventRecord(cg->out, st));
    CUDA_CHECK(cudaStreamWaitEvent(cs->st, cg->out, 0));

    cg->issued++;
    cg->last_seq = op->coll_seq;
    cg->last_kind = desc->kind;
    cg->last_label = op->label;
    snprintf(cg->last_stream, sizeof cg->last_stream, "%s", s->name);
}

/* ------------------------------------------------------ point to point */

void cuda_p2p_world_init(World *w) { pthread_mutex_init(&cuda_world(w)->p2p_mu, NULL); }

static void destroy_event(void *e) { CUDA_CHECK(cudaEventDestroy((cudaEvent_t)e)); }

/* After every rank's streams were drained and destroyed: the pooled events,
 * and those of sends whose sender never got to give them back. */
void cuda_p2p_world_fini(World *w) {
    struct CudaWorld *cw = cuda_world(w);
    p2p_drop_tokens(w, destroy_event);
    for (size_t k = 0; k < cw->n_pool; k++) destroy_event(cw->p2p_pool[k]);
    free(cw->p2p_pool);
    pthread_mutex_destroy(&cw->p2p_mu);
}

/* An event of the pool, or a new one. */
static cudaEvent_t p2p_event_get(struct CudaWorld *cw) {
    cudaEvent_t e = NULL;
    pthread_mutex_lock(&cw->p2p_mu);
    if (cw->n_pool) e = cw->p2p_pool[--cw->n_pool];
    pthread_mutex_unlock(&cw->p2p_mu);
    if (!e) CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
}

/* Back to the pool: every stream wait on e was issued, and a later record
 * does not change what an issued wait waits for. */
static void p2p_event_put(struct CudaWorld *cw, cudaEvent_t e) {
    pthread_mutex_lock(&cw->p2p_mu);
    if (cw->n_pool == cw->pool_cap) {
        cw->pool_cap = cw->pool_cap ? 2 * cw->pool_cap : 8;
        cw->p2p_pool = xrealloc(cw->p2p_pool, cw->pool_cap * sizeof *cw->p2p_pool);
    }
    cw->p2p_pool[cw->n_pool++] = e;
    pthread_mutex_unlock(&cw->p2p_mu);
}

/* The trace record of a p2p group: named by what moves where (op->name), its
 * items in the "p2p" arg, as the CPU backends file it. */
static TraceRec p2p_trace_rec(Stream *s, const Op *op) {
    TraceRec rec = cuda_trace_rec(s, NULL, op->name, TRACE_CAT_COLLECTIVE, op->bytes, coll_dtype_name(op->coll.dtype),
                                  NULL);
    rec.p2p = op->label;
    return rec;
}

/* local: the ranks are threads sharing one GPU; the mailboxes of p2p.c's
 * thread backends (the k-th send from a to b meets b's k-th receive from a,
 * whatever their streams; here posted at enqueue, in that order), carrying
 * device pointers and events:
 * every send of the group posted first (a receive below may wait for a peer
 * that waits for one of these), then each receive (the receiving stream waits
 * for the sender's `sent`, copies, records `done`), then each send waits for
 * its receiver's `done`, so the sending stream never reuses its buffer early.
 * The host waits only for the peers' host threads, never for the GPU. */
static void local_p2p(Stream *s, const Op *op) {
    Dev *d = s->dev;
    World *w = d->world;
    struct CudaWorld *cw = cuda_world(w);
    cudaStream_t st = cuda_stream(s)->st;
    const P2PBatch *b = op->p2p;
    const int me = d->rank;
    struct timespec dl;
    const struct timespec *deadline = coll_deadline(w->cfg.collective_timeout_s, &dl);
    P2PChan *chans[P2P_STACK_ITEMS];
    P2PChan **ch = b->n <= P2P_STACK_ITEMS ? chans : xmalloc((size_t)b->n * sizeof *ch);
    OpSpan span;
    if (d->scope.tracing) cuda_span_begin(d, s, &span);
    for (int i = 0; i < b->n; i++) { /* sends: the buffer and the point of s after its inputs */
        const P2PItem *it = &b->items[i];
        ch[i] = p2p_mailbox(w, it->send ? me : it->peer, it->send ? it->peer : me);
        if (!it->send) continue;
        cudaEvent_t sent = p2p_event_get(cw);
        CUDA_CHECK(cudaEventRecord(sent, st));
        p2p_post(ch[i], it, 0.0, sent);
    }
    for (int i = 0; i < b->n; i++) { /* receives: after the sender's point, a device copy */
        const P2PItem *it = &b->items[i];
        if (it->send) continue;
        P2PSlot got = p2p_await_send(s, op, ch[i], it, deadline);
        CUDA_CHECK(cudaStreamWaitEvent(st, (cudaEvent_t)got.sent, 0));
        if (it->count && it->buf != got.buf)
            CUDA_CHECK(cudaMemcpyAsync(it->buf, got.buf, it->count * sizeof(float), cudaMemcpyDeviceToDevice, st));
        cudaEvent_t done = p2p_event_get(cw);
        CUDA_CHECK(cudaEventRecord(done, st));
        p2p_mark_received(ch[i], it, 0.0, done);
    }
    for (int i = 0; i < b->n; i++) { /* sends: s goes on once the receiver's copy is done */
        const P2PItem *it = &b->items[i];
        if (!it->send) continue;
        P2PSlot got = p2p_await_received(s, op, ch[i], it, deadline);
        CUDA_CHECK(cudaStreamWaitEvent(st, (cudaEvent_t)got.done, 0));
        /* the receiver waited on `sent` before it posted `done`; this was the last wait on either */
        p2p_event_put(cw, (cudaEvent_t)got.sent);
        p2p_event_put(cw, (cudaEvent_t)got.done);
    }
    if (ch != chans) free(ch);
    if (d->scope.tracing) {
        TraceRec rec = p2p_trace_rec(s, op);
        cuda_span_end(d, s, &span, &rec, SPAN_ANY_LENGTH);
    }
}

/* nccl backends: ncclSend / ncclRecv in one NCCL group on the world's
 * communicator (its ranks are the world ranks) and NCCL stream, between the
 * same two events as a collective (nccl_collective). NCCL pairs the k-th send
 * from a to b with b's k-th receive from a on the communicator: in the order
 * each rank issues them, as the CPU backends' mailboxes do. */
static void nccl_p2p(Stream *s, const Op *op) {
    Dev *d = s->dev;
    struct CudaStream *cs = cuda_stream(s);
    const P2PBatch *b = op->p2p;
    CudaGroup *cg = &cuda_dev(d)->groups[0];
    ncclComm_t comm = cg->comm;
    cudaStream_t st = cg->st;

    CUDA_CHECK(cudaEventRecord(cg->in, cs->st));
    CUDA_CHECK(cudaStreamWaitEvent(st, cg->in, 0));
    OpSpan span;
    if (d->scope.tracing) cuda_span_begin_on(d, st, &span);
    NCCL_CHECK(ncclGroupStart());
    for (int i = 0; i < b->n; i++) {
        const P2PItem *it = &b->items[i];
        if (it->send) NCCL_CHECK(ncclSend(it->buf, it->count, ncclFloat32, it->peer, comm, st));
        else NCCL_CHECK(ncclRecv(it->buf, it->count, ncclFloat32, it->peer, comm, st));
    }
    NCCL_CHECK(ncclGroupEnd());
    if (d->scope.tracing) { /* filed under s, the stream it was issued on */
        TraceRec rec = p2p_trace_rec(s, op);
        cuda_span_end_on(d, st, &span, &rec, SPAN_ANY_LENGTH);
    }
    CUDA_CHECK(cudaEventRecord(cg->out, st));
    CUDA_CHECK(cudaStreamWaitEvent(cs->st, cg->out, 0));

    cg->issued++;
    cg->last_seq = op->coll_seq;
    cg->last_kind = COLL_P2P;
    cg->last_label = op->label;
    snprintf(cg->last_stream, sizeof cg->last_stream, "%s", s->name);
}

/* ------------------------------------------------------------- enqueue */

/* A collective coll_enqueue (runtime/backend.c) checked and described, or a
 * p2p group (runtime/p2p.c): each rank enqueues its part on its stream now,
 * on the host thread. */
void cuda_coll_enqueue(Stream *s, Op *o) {
    const int local = s->dev->world->cfg.backend == BACKEND_LOCAL;
    if (o->coll.kind == COLL_P2P) {
        if (local) local_p2p(s, o);
        else nccl_p2p(s, o);
    } else if (local) {
        local_collective(s, o, o->src, o->dst);
    } else {
        nccl_collective(s, o, o->src, o->dst);
    }
    /* the GPU runs it later: "started" means handed to the stream */
    flight_set(s, o, FLIGHT_STARTED);
    s->enqueued++;
    if (o->coll.kind == COLL_P2P) { /* its items are queued: the batch is the backend's to free */
        P2PBatch *b = o->p2p;
        o->p2p = NULL;
        free(b->items);
        free(b);
    }
}
