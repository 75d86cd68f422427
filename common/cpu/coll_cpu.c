/* collectives.c — the CPU backends' NCCL-shaped collectives, executed on
 * stream workers (stream.h).
 * local backend (backend_local.c): ranks are threads; one rendezvous channel
 *   per (stream, group); each rank computes its own output from the peers'
 *   buffers. How long it lasts is the modelled clock's (its link model:
 *   coll_common.c), from the time the last rank of the group was ready.
 * mpi backend (backend_mpi.c, its execution there too): one communicator per
 *   (stream, group); its reductions use coll_reduce_ranks below, in rank order,
 *   so results are bitwise identical to the local backend's.
 * Element types: float32 everywhere; all-gather and reduce-scatter also move
 * bfloat16 words (the reduce-scatter adds them in float32, rounding once). */
#include "model/ops_math.h" /* bf16_from_f32 / bf16_to_f32 */
#include "runtime/stream.h"
#include "runtime/util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Element i of rank r's send buffer (one of `parts`), widened to float32. */
static float elem_in(const void *send, int dtype, size_t i) {
    return dtype == DTYPE_BF16 ? bf16_to_f32(((const Bf16 *)send)[i]) : ((const float *)send)[i];
}

void coll_reduce_ranks(void *recv, const void *const *parts, int n, size_t off, size_t cnt, int dtype, int op) {
    for (size_t i = 0; i < cnt; i++) {
        float acc = elem_in(parts[0], dtype, off + i);
        for (int r = 1; r < n; r++) acc += elem_in(parts[r], dtype, off + i);
        if (op == RED_AVG) acc /= (float)n;
        if (dtype == DTYPE_BF16) ((Bf16 *)recv)[i] = bf16_from_f32(acc);
        else ((float *)recv)[i] = acc;
    }
}

/* --------------------------------------------------------- local backend */

/* All ranks of the channel (the group's) meet. With the watchdog on, a rank
 * that waits longer than the timeout reports the collective of the lowest
 * waiting rank (deterministic whichever timer fires first) and the ranks
 * missing. */
static void chan_barrier(Stream *s, const Op *op, int n) {
    CollChannel *c = op->chan;
    const double timeout = s->dev->world->cfg.collective_timeout_s;
    pthread_mutex_lock(&c->mu);
    uint64_t gen = c->generation;
    c->here[op->pg->rank] = 1;
    if (++c->arrived == n) {
        c->arrived = 0;
        memset(c->here, 0, sizeof c->here);
        c->generation++;
        pthread_cond_broadcast(&c->cv);
    } else if (coll_wait_generation(&c->cv, &c->mu, &c->generation, gen, timeout)) {
        int low = 0;
        while (low < n && !c->here[low]) low++;
        CollPost post = c->posts[low < n ? low : op->pg->rank];
        uint8_t here[WORLD_MAX_RANKS];
        memcpy(here, c->here, sizeof here);
        pthread_mutex_unlock(&c->mu);
        watchdog_timeout(s, op, &post, low < n ? low : op->pg->rank, here);
    }
    pthread_mutex_unlock(&c->mu);
}

/* Returns the modelled time the group could start: the latest ready_us of its ranks. */
static double local_execute(Stream *s, const Op *op, double ready_us) {
    CollChannel *c = op->chan;
    const ProcessGroup *g = op->pg;
    const int n = g->size, me = g->rank; /* group ranks */
    const CollDesc *desc = &op->coll;
    const size_t cnt = (size_t)desc->count, esize = coll_dtype_size(desc->dtype);
    float *scratch = NULL; /* a kind's buffer that peers read: freed after the last barrier */
    float *recv = op->dst;
    const float *send = op->src;

    pthread_mutex_lock(&c->mu);
    c->posts[me] = (CollPost){*desc, op->coll_seq, send, recv, NULL, ready_us};
    pthread_mutex_unlock(&c->mu);
    chan_barrier(s, op, n); /* everyone posted; their earlier stream work is visible (mutex) */

    pthread_mutex_lock(&c->mu);
    CollPost posts[WORLD_MAX_RANKS];
    memcpy(posts, c->posts, (size_t)n * sizeof *posts);
    pthread_mutex_unlock(&c->mu);
    double start_us = ready_us;
    for (int r = 0; r < n; r++)
        if (posts[r].ready_us > start_us) start_us = posts[r].ready_us;

    int agree = 1;
    for (int r = 1; r < n; r++) agree &= coll_same_call(&posts[0].desc, &posts[r].desc);
    if (!agree) {
        if (me == 0) {
            CollDesc descs[WORLD_MAX_RANKS];
            for (int r = 0; r < n; r++) descs[r] = posts[r].desc;
            coll_check_agreement(s, op->coll_seq, descs, n, g->members);
        }
        /* the other ranks wait for rank 0's fatal exit */
        pthread_mutex_lock(&c->mu);
        for (;;) pthread_cond_wait(&c->cv, &c->mu);
    }

    const void *parts[WORLD_MAX_RANKS];
    for (int r = 0; r < n; r++) parts[r] = posts[r].send;
    /* a dry run moves no data (dry.h): the group still meets, for its modelled start and the agreement check */
    switch (s->dev->world->cfg.dry_run ? COLL_KIND_COUNT : (CollKind)desc->kind) {
    case COLL_ALL_GATHER:
        for (int r = 0; r < n; r++) {
            char *dst = (char *)recv + (size_t)r * cnt * esize;
            if (cnt && (const void *)dst != posts[r].send) memcpy(dst, posts[r].send, cnt * esize);
        }
        break;
    case COLL_REDUCE_SCATTER: coll_reduce_ranks(recv, parts, n, (size_t)me * cnt, cnt, desc->dtype, desc->op); break;
    case COLL_ALL_REDUCE: {
        /* reduce my chunk into scratch and post it; peers copy it after the
         * next barrier (recv may alias send, so nobody writes recv while
         * others read send) */
        size_t chunk = (cnt + (size_t)n - 1) / (size_t)n;
        size_t lo = (size_t)me * chunk, hi = lo + chunk < cnt ? lo + chunk : cnt;
        scratch = xmalloc((chunk ? chunk : 1) * sizeof(float));
        if (lo < hi) coll_reduce_ranks(scratch, parts, n, lo, hi - lo, DTYPE_F32, desc->op);
        pthread_mutex_lock(&c->mu);
        c->posts[me].scratch = scratch;
        pthread_mutex_unlock(&c->mu);
        chan_barrier(s, op, n);
        pthread_mutex_lock(&c->mu); /* the posts stay put until everyone passed the last barrier */
        for (int r = 0; r < n; r++) posts[r].scratch = c->posts[r].scratch;
        pthread_mutex_unlock(&c->mu);
        for (int r = 0; r < n; r++) {
            size_t rlo = (size_t)r * chunk, rhi = rlo + chunk < cnt ? rlo + chunk : cnt;
            if (rlo < rhi) memcpy(recv + rlo, posts[r].scratch, (rhi - rlo) * sizeof(float));
        }
        break;
    }
    case COLL_BROADCAST:
        if (me != desc->root && cnt && (const void *)recv != posts[desc->root].recv)
            memcpy(recv, posts[desc->root].recv, cnt * sizeof(float));
        break;
    case COLL_BARRIER: break; /* the barriers around this switch are all of it */
    case COLL_P2P: break;     /* never here: p2p_local_execute */
    case COLL_KIND_COUNT: break; /* not a kind */
    }
    chan_barrier(s, op, n); /* nobody reuses or frees its buffers while peers read them */
    free(scratch);
    return start_us;
}

/* A queued collective of the local backend, run by the stream's worker (Op.exec). */
double local_coll_execute(Stream *s, const Op *op, double ready_us) {
    flight_set(s, op, FLIGHT_STARTED);
    double start_us = local_execute(s, op, ready_us);
    flight_set(s, op, FLIGHT_COMPLETED);
    return start_us;
}
