/* coll_cpu.c — the CPU backends' NCCL-shaped collectives, executed on
 * stream workers (cpu_internal.h).
 * local backend (backend_local.c): ranks are threads; one rendezvous channel
 *   per (stream, group); each rank computes its own output from the peers'
 *   buffers. How long it lasts is the modelled clock's (its link model:
 *   runtime/coll_common.c), from the time the last rank of the group was ready.
 *   Point to point: through the world's mailboxes (runtime/p2p.c).
 * mpi backend (backend_mpi.c, its execution there too): one communicator per
 *   (stream, group); its reductions use coll_reduce_ranks below, in rank order,
 *   so results are bitwise identical to the local backend's.
 * Element types: float32 everywhere; all-gather and reduce-scatter also move
 * bfloat16 words (the reduce-scatter adds them in float32, rounding once). */
#include "cpu/cpu_internal.h"
#include "runtime/bf16.h"
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

/* All ranks of the channel (the group's) meet (the watchdog: coll_rendezvous). */
static void chan_barrier(Stream *s, const Op *op) {
    CollChannel *c = op->chan;
    pthread_mutex_lock(&c->rv.mu);
    coll_rendezvous(&c->rv, s, op, c->posts, sizeof *c->posts);
    pthread_mutex_unlock(&c->rv.mu);
}

/* Returns the modelled time the group could start: the latest ready_us of its executed ranks (with
 * representative ranks, the full group's by symmetry). The channel holds the executed members alone; the
 * data moves only when every member executes (a dry run, which representative ranks need, moves none), so
 * there n and me are the group's size and this rank's group rank. */
static double local_execute(Stream *s, const Op *op, double ready_us) {
    CollChannel *c = op->chan;
    const ProcessGroup *g = op->pg;
    const int n = g->nlive, me = g->live; /* executed members */
    const CollDesc *desc = &op->coll;
    const size_t cnt = (size_t)desc->count, esize = coll_dtype_size(desc->dtype);
    float *scratch = NULL; /* a kind's buffer that peers read: freed after the last barrier */
    float *recv = op->dst;
    const float *send = op->src;

    pthread_mutex_lock(&c->rv.mu);
    c->posts[me] = (CollPost){*desc, op->coll_seq, send, recv, NULL, ready_us};
    pthread_mutex_unlock(&c->rv.mu);
    chan_barrier(s, op); /* everyone posted; their earlier stream work is visible (mutex) */

    pthread_mutex_lock(&c->rv.mu);
    CollPost posts[WORLD_MAX_RANKS];
    memcpy(posts, c->posts, (size_t)n * sizeof *posts);
    pthread_mutex_unlock(&c->rv.mu);
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
        pthread_mutex_lock(&c->rv.mu);
        for (;;) pthread_cond_wait(&c->rv.cv, &c->rv.mu);
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
        pthread_mutex_lock(&c->rv.mu);
        c->posts[me].scratch = scratch;
        pthread_mutex_unlock(&c->rv.mu);
        chan_barrier(s, op);
        pthread_mutex_lock(&c->rv.mu); /* the posts stay put until everyone passed the last barrier */
        for (int r = 0; r < n; r++) posts[r].scratch = c->posts[r].scratch;
        pthread_mutex_unlock(&c->rv.mu);
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
    chan_barrier(s, op); /* nobody reuses or frees its buffers while peers read them */
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

/* The local backend's point to point (Op.exec of a COLL_P2P op) through the
 * world's mailboxes (runtime/p2p.c): every send of the group posted first (a
 * receive below may wait for a peer that waits for one of these), then each
 * receive copies the sender's buffer, then each send waits until it was
 * received (the sender's stream may reuse its buffer only then). */
double p2p_local_execute(Stream *s, const Op *op, double ready_us) {
    flight_set(s, op, FLIGHT_STARTED);
    P2PBatch *b = op->p2p;
    World *w = s->dev->world;
    const int me = s->dev->rank, run = !w->cfg.dry_run;
    struct timespec dl;
    const struct timespec *deadline = coll_deadline(w->cfg.collective_timeout_s, &dl);
    double start_us = ready_us;
    P2PChan *chans[P2P_STACK_ITEMS];
    P2PChan **ch = b->n <= P2P_STACK_ITEMS ? chans : xmalloc((size_t)b->n * sizeof *ch);
    for (int i = 0; i < b->n; i++) {
        const P2PItem *it = &b->items[i];
        ch[i] = p2p_mailbox(w, it->send ? me : it->peer, it->send ? it->peer : me);
        if (it->send) p2p_post(ch[i], it, ready_us, NULL);
    }
    for (int i = 0; i < b->n; i++) {
        const P2PItem *it = &b->items[i];
        if (it->send) continue;
        P2PSlot got = p2p_await_send(s, op, ch[i], it, deadline);
        if (run && it->count) memcpy(it->buf, got.buf, it->count * sizeof(float));
        if (got.ready_us > start_us) start_us = got.ready_us;
        p2p_mark_received(ch[i], it, ready_us, NULL);
    }
    for (int i = 0; i < b->n; i++) {
        const P2PItem *it = &b->items[i];
        if (!it->send) continue;
        P2PSlot got = p2p_await_received(s, op, ch[i], it, deadline);
        if (got.peer_ready_us > start_us) start_us = got.peer_ready_us;
    }
    if (ch != chans) free(ch);
    flight_set(s, op, FLIGHT_COMPLETED);
    free(b->items);
    free(b);
    return start_us;
}
