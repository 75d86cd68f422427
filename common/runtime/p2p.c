/* p2p.c — point-to-point sends and receives (device.h: dev_send, dev_recv,
 * dev_group_start, dev_group_end), NCCL's ncclSend / ncclRecv inside a group.
 *
 * The host collects a group's items (P2PItem, coll.h) and queues them as one
 * op of kind COLL_P2P on their stream: the collective-kind table's row, the
 * flight recorder, the trace and the race detector (race.c: a send reads its
 * buffer, a receive writes it) see it like any collective. Each backend runs
 * it: the thread backends through a mailbox per (sender, receiver), kept
 * here (the CPU's local: cpu/coll_cpu.c; the CUDA build's local:
 * cuda/coll_cuda.c); mpi with messages tagged by their number
 * (cpu/backend_mpi.c); nccl with ncclSend / ncclRecv between ncclGroupStart
 * and ncclGroupEnd (cuda/coll_cuda.c). Pairing, NCCL's: the k-th send from a to b, on
 * whichever stream of a, meets the k-th receive from a on b, whichever
 * stream (P2PItem.seq, counted on the host in issue order).
 *
 * On the modelled clock a group starts when this rank's stream and every
 * peer's matching group are ready, and lasts its slowest item's link time
 * (p2p_link_time_us): a transfer sits on one link, send and receive alike. */
#include "runtime/internal.h"
#include "runtime/util.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ------------------------------------------------------------ link model */

double p2p_link_time_us(const WorldConfig *cfg, int a, int b, size_t bytes) {
    if (cfg->link_gbps <= 0) return 0.0;
    int per = cfg->ranks_per_node > 0 ? cfg->ranks_per_node : cfg->world_size;
    double gbps = cfg->link_gbps, hop_us = cfg->link_latency_us;
    if (a / per != b / per && cfg->inter_link_gbps > 0) {
        gbps = cfg->inter_link_gbps < gbps ? cfg->inter_link_gbps : gbps;
        hop_us = cfg->inter_link_latency_us > hop_us ? cfg->inter_link_latency_us : hop_us;
    }
    return hop_us + (double)bytes / (gbps * 1e9 / 8.0) * 1e6;
}

/* ------------------------------------------------------------- the host */

static P2PBatch *batch_new(Stream *s) {
    P2PBatch *b = xcalloc(1, sizeof *b);
    b->stream = s;
    return b;
}

/* One op of kind COLL_P2P carrying b's items, on b's stream. */
static void enqueue_batch(Dev *d, P2PBatch *b) {
    Stream *s = b->stream;
    char human[256], wire[256];
    size_t hl = 0, wl = 0, total = 0;
    double cost = 0;
    human[0] = wire[0] = 0;
    for (int i = 0; i < b->n; i++) {
        const P2PItem *it = &b->items[i];
        if (hl < sizeof human)
            hl += (size_t)snprintf(human + hl, sizeof human - hl, "%s%s %s mb%d %s %d", i ? ", " : "",
                                   it->send ? "send" : "recv", it->label, it->microbatch, it->send ? "to" : "from",
                                   it->peer);
        if (wl < sizeof wire)
            wl += (size_t)snprintf(wire + wl, sizeof wire - wl, "%s%s %d %d %s", i ? ";" : "", it->send ? "send" : "recv",
                                   it->peer, it->microbatch, it->label);
        total += it->count;
        if (it->cost_us > cost) cost = it->cost_us;
    }
    Op o;
    op_init(s, &o, OP_COLL, human); /* the trace's name: what moves where */
    o.label = dev_intern(d, wire);  /* the flight recorder's and the trace's "p2p" arg: send|recv peer microbatch label */
    o.coll.kind = COLL_P2P; /* no process group (Op.pg NULL): its peers are its items' */
    o.coll.count = total;
    o.coll.dtype = DTYPE_F32;
    snprintf(o.coll.label, sizeof o.coll.label, "%s", b->items[0].label);
    o.bytes = total * sizeof(float);
    o.cost_us = cost;
    o.p2p = b;
    o.coll_seq = s->coll_seq++;
    flight_set(s, &o, FLIGHT_ISSUED);
    if (d->coll_watch) {
        CollIssue c = {COLL_P2P, coll_kind_name(COLL_P2P), o.label, d->scope.module, d->scope.phase, d->scope.step,
                       d->scope.micro, s->index, s->name};
        d->coll_watch(d->coll_watch_ctx, &c);
    }
    dev_ops(d)->coll_enqueue(s, &o);
}

static void add_item(Stream *s, int send, void *buf, size_t count, int peer, int microbatch, const char *label) {
    if (!s) fatal("dev_%s: NULL stream", send ? "send" : "recv");
    Dev *d = s->dev;
    const char *what = send ? "dev_send" : "dev_recv", *lbl = label && *label ? label : "";
    if (peer < 0 || peer >= d->world_size)
        fatal("%s('%s') on rank %d: peer %d is not a rank (0..%d)", what, lbl, d->rank, peer, d->world_size - 1);
    if (peer == d->rank)
        fatal("%s('%s') on rank %d: the peer is this rank itself (a stage passes data to itself without a send)", what,
              lbl, d->rank);
    if (!world_executes(d->world, peer))
        fatal("%s('%s') on rank %d: peer rank %d does not execute: this dry run executes one representative rank per "
              "class of symmetric ranks (every %d-th rank), and a representative's peers must be representatives "
              "too (--dry-run-ranks all runs every rank, up to %d)", what, lbl, d->rank, peer,
              d->world->cfg.rep_stride, WORLD_MAX_RANKS);
    if (count && !buf) fatal("%s('%s') on rank %d: NULL buffer with %zu elements", what, lbl, d->rank, count);
    if (microbatch < 0) fatal("%s('%s') on rank %d: microbatch %d is negative", what, lbl, d->rank, microbatch);
    if (d->p2p_group && !d->p2p_group->stream) d->p2p_group->stream = s; /* the group's first item picks its stream */
    if (d->p2p_group && d->p2p_group->stream != s)
        fatal("%s('%s') on rank %d: a group's sends and receives go on one stream, but this one is on '%s' and the "
              "group's on '%s'",
              what, lbl, d->rank, s->name, d->p2p_group->stream->name);
    if (!d->p2p_sent) {
        d->p2p_sent = xcalloc((size_t)d->world_size, sizeof *d->p2p_sent);
        d->p2p_recvd = xcalloc((size_t)d->world_size, sizeof *d->p2p_recvd);
    }
    P2PBatch *b = d->p2p_group ? d->p2p_group : batch_new(s);
    if (b->n == b->cap) {
        b->cap = b->cap ? 2 * b->cap : 4;
        b->items = xrealloc(b->items, (size_t)b->cap * sizeof *b->items);
    }
    b->items[b->n++] = (P2PItem){.send = send,
                                 .peer = peer,
                                 .microbatch = microbatch,
                                 .buf = buf,
                                 .count = count,
                                 .seq = send ? d->p2p_sent[peer]++ : d->p2p_recvd[peer]++,
                                 .label = dev_intern(d, lbl),
                                 .cost_us = p2p_link_time_us(&d->world->cfg, d->rank, peer, count * sizeof(float))};
    if (!d->p2p_group) enqueue_batch(d, b);
}

void dev_send(Stream *s, const float *buf, size_t count, int peer, int microbatch, const char *label) {
    add_item(s, 1, (void *)buf, count, peer, microbatch, label);
}

void dev_recv(Stream *s, float *buf, size_t count, int peer, int microbatch, const char *label) {
    add_item(s, 0, buf, count, peer, microbatch, label);
}

void dev_group_start(Dev *d) {
    if (d->p2p_group)
        fatal("dev_group_start on rank %d: a group is already open (end it with dev_group_end first)", d->rank);
    d->p2p_group = batch_new(NULL);
}

void dev_group_end(Dev *d) {
    P2PBatch *b = d->p2p_group;
    if (!b) fatal("dev_group_end on rank %d: no group is open (dev_group_start first)", d->rank);
    d->p2p_group = NULL;
    if (!b->n) {
        free(b);
        return;
    }
    enqueue_batch(d, b);
}

/* ------------------------------------------------------- the reports */

static const char *const FIX = "sends and receives between two ranks pair up in the order each side issues them, "
                               "whatever the stream; a send and a receive on one stream that wait on each other go in "
                               "one dev_group_start / dev_group_end";

void p2p_timeout(Stream *s, const Op *op, const P2PItem *it, double waited_s) {
    (void)op;
    char line[768];
    int me = s->dev->rank;
    if (it->send)
        snprintf(line, sizeof line,
                 "point-to-point timeout on rank %d: stream '%s' waited %.1f s for rank %d to receive '%s' "
                 "(microbatch %d, %zu floats), rank %d's send #%llu to it; rank %d never posted the matching receive "
                 "(%s)",
                 me, s->name, waited_s, it->peer, it->label, it->microbatch, it->count, me,
                 (unsigned long long)it->seq, it->peer, FIX);
    else
        snprintf(line, sizeof line,
                 "point-to-point timeout on rank %d: stream '%s' waited %.1f s to receive '%s' (microbatch %d, %zu "
                 "floats) from rank %d, rank %d's receive #%llu from it; rank %d never sent it (%s)",
                 me, s->name, waited_s, it->label, it->microbatch, it->count, it->peer, me,
                 (unsigned long long)it->seq, it->peer, FIX);
    watchdog_report(s, line);
}

void p2p_mismatch(Stream *s, const P2PItem *it, int sender_microbatch, size_t sender_count, const char *sender_label) {
    fatal("point-to-point mismatch on stream '%s': rank %d's send #%llu to rank %d is '%s' of microbatch %d (%zu "
          "floats), but rank %d's receive #%llu from rank %d is '%s' of microbatch %d (%zu floats) (%s)",
          s->name, it->peer, (unsigned long long)it->seq, s->dev->rank, sender_label, sender_microbatch, sender_count,
          s->dev->rank, (unsigned long long)it->seq, it->peer, it->label, it->microbatch, it->count, FIX);
}

/* ---------------------------------------------- thread backends: mailboxes */

/* Sends from one rank to another: slot k is its k-th (P2PItem.seq). Streams
 * post them in their own order, so a slot may fill before an earlier one. */
struct P2PChan {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    P2PSlot *slots; /* [cap] zeroed beyond what was posted (never reused: a run has a few thousand) */
    size_t cap;
};

void p2p_world_init(World *w) {
    ChanRegistry *r = xmalloc(sizeof *r);
    chan_registry_init(r, sizeof(P2PChan), offsetof(P2PChan, mu), offsetof(P2PChan, cv));
    w->p2p = r;
}

void p2p_drop_tokens(World *w, void (*drop)(void *token)) {
    ChanRegistry *r = w->p2p;
    for (int i = 0; r && i < r->n; i++) {
        P2PChan *c = chan_registry_slot(r, i);
        for (size_t k = 0; k < c->cap; k++) {
            if (c->slots[k].sent) drop(c->slots[k].sent);
            if (c->slots[k].done) drop(c->slots[k].done);
            c->slots[k].sent = c->slots[k].done = NULL;
        }
    }
}

void p2p_world_fini(World *w) {
    ChanRegistry *r = w->p2p;
    if (!r) return;
    for (int i = 0; i < r->n; i++) {
        P2PChan *c = chan_registry_slot(r, i);
        free(c->slots);
    }
    chan_registry_fini(r);
    free(r);
    w->p2p = NULL;
}

P2PChan *p2p_mailbox(World *w, int src, int dst) { return chan_registry_get(w->p2p, 0, src, dst); }

/* Wait on c (mu held) until `done` holds; 1 if the deadline (NULL: none) passed first. */
static int wait_until(P2PChan *c, const struct timespec *deadline, int (*done)(const P2PChan *, uint64_t), uint64_t k) {
    while (!done(c, k)) {
        if (!deadline) pthread_cond_wait(&c->cv, &c->mu);
        else if (pthread_cond_timedwait(&c->cv, &c->mu, deadline) == ETIMEDOUT && !done(c, k)) return 1;
    }
    return 0;
}
static int is_posted(const P2PChan *c, uint64_t k) { return c->cap > k && c->slots[k].posted; }
static int is_received(const P2PChan *c, uint64_t k) { return c->cap > k && c->slots[k].received; }

void p2p_post(P2PChan *c, const P2PItem *it, double ready_us, void *sent) {
    pthread_mutex_lock(&c->mu);
    if (it->seq >= c->cap) {
        size_t ncap = c->cap ? 2 * c->cap : 16;
        while (ncap <= it->seq) ncap *= 2;
        c->slots = xrealloc(c->slots, ncap * sizeof *c->slots);
        memset(c->slots + c->cap, 0, (ncap - c->cap) * sizeof *c->slots);
        c->cap = ncap;
    }
    c->slots[it->seq] = (P2PSlot){.buf = it->buf, .count = it->count, .microbatch = it->microbatch,
                                  .label = it->label, .ready_us = ready_us, .sent = sent, .posted = 1};
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

P2PSlot p2p_await_send(Stream *s, const Op *op, P2PChan *c, const P2PItem *it, const struct timespec *deadline) {
    pthread_mutex_lock(&c->mu);
    if (wait_until(c, deadline, is_posted, it->seq)) {
        pthread_mutex_unlock(&c->mu);
        p2p_timeout(s, op, it, s->dev->world->cfg.collective_timeout_s);
    }
    P2PSlot got = c->slots[it->seq];
    pthread_mutex_unlock(&c->mu);
    if (got.count != it->count || got.microbatch != it->microbatch)
        p2p_mismatch(s, it, got.microbatch, got.count, got.label);
    return got;
}

void p2p_mark_received(P2PChan *c, const P2PItem *it, double ready_us, void *done) {
    pthread_mutex_lock(&c->mu);
    c->slots[it->seq].peer_ready_us = ready_us;
    c->slots[it->seq].done = done;
    c->slots[it->seq].received = 1;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

P2PSlot p2p_await_received(Stream *s, const Op *op, P2PChan *c, const P2PItem *it, const struct timespec *deadline) {
    pthread_mutex_lock(&c->mu);
    if (wait_until(c, deadline, is_received, it->seq)) {
        pthread_mutex_unlock(&c->mu);
        p2p_timeout(s, op, it, s->dev->world->cfg.collective_timeout_s);
    }
    P2PSlot got = c->slots[it->seq];
    c->slots[it->seq].sent = c->slots[it->seq].done = NULL; /* the sender's now */
    pthread_mutex_unlock(&c->mu);
    return got;
}
