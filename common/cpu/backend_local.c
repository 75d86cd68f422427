/* backend_local.c — the CPU's "local" backend: ranks are threads of this
 * process; a stream reaches a group's peers through a rendezvous channel per
 * (stream index, group), shared by the group's ranks and made at the stream's
 * first collective in that group; coll_cpu.c runs them (memcpy, sums in
 * rank order, the link model). Streams, events and storage: runtime_cpu.c. */
#include "cpu/cpu_internal.h"
#include "runtime/util.h"

#include <stddef.h>
#include <stdlib.h>

/* CpuStream.coll: the stream's channel per group id, filled by its host thread. */
typedef struct {
    CollChannel *chans[PG_MAX];
} LocalStream;

/* World.backend: every channel of the world. */
static void local_world_init(World *w, long *cores) {
    (void)cores;
    ChanRegistry *chans = xmalloc(sizeof *chans);
    chan_registry_init(chans, sizeof(CollChannel), offsetof(CollChannel, rv.mu), offsetof(CollChannel, rv.cv));
    w->backend = chans;
}

static void local_world_fini(World *w) {
    chan_registry_fini(w->backend);
    free(w->backend);
    w->backend = NULL;
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
    if (op->coll.kind == COLL_P2P) { /* through the world's mailboxes (runtime/p2p.c) */
        op->exec = p2p_local_execute;
        cpu_enqueue_op(s, op);
        return;
    }
    LocalStream *ls = cpu_stream(s)->coll;
    const ProcessGroup *g = op->pg;
    if (!ls->chans[g->id]) ls->chans[g->id] = chan_registry_get(s->dev->world->backend, s->index, g->id, g->color);
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
