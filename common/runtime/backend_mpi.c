/* backend_mpi.c — the CPU's "mpi" backend: one process per rank under mpirun
 * (mpi_world.c), streams, events and storage as the local backend's
 * (stream.c), and each stream reaches its peers through communicators of its
 * own: a dup of the world's per stream index, a split of the world's per
 * (stream, group), so collectives on different streams never meet in one
 * communicator. collectives.c runs them (mpi_execute). A build without MPI
 * has this backend answer with one line. */
#include "runtime/mpi_world.h"
#include "runtime/stream.h"
#include "runtime/util.h"

#ifdef HAVE_MPI

#include <stdlib.h>
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

MPI_Comm mpi_stream_comm(const Stream *s, const ProcessGroup *g) {
    const MpiStream *ms = cpu_stream(s)->coll;
    return g->id ? ms->groups[g->id] : ms->world;
}

static void mpi_coll_enqueue(Stream *s, Op *op) {
    op->exec = coll_execute;
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
