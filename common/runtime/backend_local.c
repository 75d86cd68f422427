/* backend_local.c — the CPU's "local" backend: ranks are threads of this
 * process; a stream reaches a group's peers through a rendezvous channel per
 * (stream index, group), shared by the group's ranks and made at the stream's
 * first collective in that group; collectives.c runs them (memcpy, sums in
 * rank order, the link model). Streams, events and storage: stream.c. */
#include "runtime/stream.h"
#include "runtime/util.h"

#include <stdlib.h>

/* World.backend: every channel of the world. */
typedef struct {
    pthread_mutex_t mu; /* guards chans */
    CollChannel **chans;
    int nchans, chans_cap;
} LocalWorld;

/* CpuStream.coll: the stream's channel per group id, filled by its host thread. */
typedef struct {
    CollChannel *chans[PG_MAX];
} LocalStream;

static void local_world_init(World *w, long *cores) {
    (void)cores;
    LocalWorld *lw = xcalloc(1, sizeof *lw);
    pthread_mutex_init(&lw->mu, NULL);
    w->backend = lw;
}

static void local_world_fini(World *w) {
    LocalWorld *lw = w->backend;
    for (int i = 0; i < lw->nchans; i++) {
        pthread_mutex_destroy(&lw->chans[i]->mu);
        pthread_cond_destroy(&lw->chans[i]->cv);
        free(lw->chans[i]);
    }
    free(lw->chans);
    pthread_mutex_destroy(&lw->mu);
    free(lw);
    w->backend = NULL;
}

/* The rendezvous of (stream index, group id, color): the first rank to ask makes it. */
static CollChannel *world_channel(World *w, int stream_index, int pg_id, int color) {
    LocalWorld *lw = w->backend;
    pthread_mutex_lock(&lw->mu);
    CollChannel *c = NULL;
    for (int i = 0; i < lw->nchans && !c; i++) {
        CollChannel *k = lw->chans[i];
        if (k->stream_index == stream_index && k->pg_id == pg_id && k->color == color) c = k;
    }
    if (!c) {
        if (lw->nchans == lw->chans_cap) {
            lw->chans_cap = lw->chans_cap ? lw->chans_cap * 2 : 8;
            lw->chans = xrealloc(lw->chans, (size_t)lw->chans_cap * sizeof *lw->chans);
        }
        c = xcalloc(1, sizeof *c);
        c->stream_index = stream_index;
        c->pg_id = pg_id;
        c->color = color;
        pthread_mutex_init(&c->mu, NULL);
        cond_init_monotonic(&c->cv);
        lw->chans[lw->nchans++] = c;
    }
    pthread_mutex_unlock(&lw->mu);
    return c;
}

/* Groups and streams need nothing until a stream's first collective in a group. */
static void local_group_init(ProcessGroup *g) { (void)g; }
static void local_group_fini(ProcessGroup *g) { (void)g; }
static void local_stream_join_group(Stream *s, ProcessGroup *g) { (void)s, (void)g; }

static void local_coll_stream_init(Stream *s) { cpu_stream(s)->coll = xcalloc(1, sizeof(LocalStream)); }

static void local_coll_stream_fini(Stream *s) {
    free(cpu_stream(s)->coll);
    cpu_stream(s)->coll = NULL;
}

static void local_coll_enqueue(Stream *s, Op *op) {
    LocalStream *ls = cpu_stream(s)->coll;
    const ProcessGroup *g = op->pg;
    if (!ls->chans[g->id]) ls->chans[g->id] = world_channel(s->dev->world, s->index, g->id, g->color);
    op->chan = ls->chans[g->id];
    op->exec = local_coll_execute;
    cpu_enqueue_op(s, op);
}

const BackendOps cpu_local_backend = {
    CPU_BACKEND_OPS,
    .world_init = local_world_init,
    .world_fini = local_world_fini,
    .host_exchange = threads_host_exchange,
    .group_init = local_group_init,
    .group_fini = local_group_fini,
    .coll_stream_init = local_coll_stream_init,
    .coll_stream_fini = local_coll_stream_fini,
    .stream_join_group = local_stream_join_group,
    .coll_enqueue = local_coll_enqueue,
};
