/* mpi_world.c — ranks as MPI processes (mpi_world.h). */
#include "runtime/mpi_world.h"
#include "runtime/util.h"

#include <stdlib.h>
#include <unistd.h>

#ifdef HAVE_MPI

struct MpiWorld {
    MPI_Comm groups[PG_MAX];  /* the host's communicator per group id ([0]: a dup of MPI_COMM_WORLD) */
    int initialized_here;     /* MPI_Init_thread was ours: so is MPI_Finalize */
    int node_rank, node_size;
};

MpiWorld *mpi_world_create(World *w, long *cores) {
    const WorldConfig *cfg = &w->cfg;
    MpiWorld *m = xcalloc(1, sizeof *m);
    int inited = 0, provided = 0;
    MPI_Initialized(&inited);
    if (!inited) {
        MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &provided);
        m->initialized_here = 1;
    } else {
        MPI_Query_thread(&provided);
    }
    if (provided < MPI_THREAD_MULTIPLE)
        fatal("MPI does not provide MPI_THREAD_MULTIPLE (got level %d); streams need it", provided);
    int size = 0, rank = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (size != cfg->world_size) {
        if (rank != 0) sleep(5); /* one message (rank 0's); mpirun then stops the job */
        fatal("--world %d but mpirun started %d processes", cfg->world_size, size);
    }
    MPI_Comm_dup(MPI_COMM_WORLD, &m->groups[0]);
    w->local_ranks = 1;
    w->first_local_rank = rank;
    /* ranks on this node share its cores */
    MPI_Comm node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
    MPI_Comm_rank(node, &m->node_rank);
    MPI_Comm_size(node, &m->node_size);
    MPI_Comm_free(&node);
    *cores = *cores / m->node_size;
    MPI_Barrier(m->groups[0]);
    return m;
}

void mpi_world_destroy(MpiWorld *m) {
    if (!m) return;
    MPI_Comm_free(&m->groups[0]);
    if (m->initialized_here) MPI_Finalize();
    free(m);
}

void mpi_world_exchange(MpiWorld *m, double value, double *out) {
    if (out) MPI_Allgather(&value, 1, MPI_DOUBLE, out, 1, MPI_DOUBLE, m->groups[0]);
    else MPI_Barrier(m->groups[0]);
}

void mpi_world_group_init(MpiWorld *m, const ProcessGroup *g) {
    if (g->id) MPI_Comm_split(m->groups[0], g->color, g->dev->rank, &m->groups[g->id]);
}

void mpi_world_group_fini(MpiWorld *m, const ProcessGroup *g) {
    if (g->id) MPI_Comm_free(&m->groups[g->id]);
}

void mpi_world_allgather_bytes(MpiWorld *m, int group_id, const void *mine, void *all, size_t bytes) {
    MPI_Allgather(mine, (int)bytes, MPI_BYTE, all, (int)bytes, MPI_BYTE, m->groups[group_id]);
}

void mpi_world_bcast_bytes(MpiWorld *m, void *buf, size_t bytes, int root) {
    MPI_Bcast(buf, (int)bytes, MPI_BYTE, root, m->groups[0]);
}

int mpi_world_node_rank(const MpiWorld *m) { return m->node_rank; }
int mpi_world_node_size(const MpiWorld *m) { return m->node_size; }
MPI_Comm mpi_world_comm(const MpiWorld *m, int group_id) { return m->groups[group_id]; }

#else /* a build without MPI: no world of processes to stand on */

MpiWorld *mpi_world_create(World *w, long *cores) {
    (void)w, (void)cores;
    fatal("this build has no MPI support (rebuild with OpenMPI installed)");
}
/* Unreachable without a world: create never returns one. */
void mpi_world_destroy(MpiWorld *m) { (void)m; }
void mpi_world_exchange(MpiWorld *m, double value, double *out) { (void)m, (void)value, (void)out; }
void mpi_world_group_init(MpiWorld *m, const ProcessGroup *g) { (void)m, (void)g; }
void mpi_world_group_fini(MpiWorld *m, const ProcessGroup *g) { (void)m, (void)g; }
void mpi_world_allgather_bytes(MpiWorld *m, int group_id, const void *mine, void *all, size_t bytes) {
    (void)m, (void)group_id, (void)mine, (void)all, (void)bytes;
}
void mpi_world_bcast_bytes(MpiWorld *m, void *buf, size_t bytes, int root) { (void)m, (void)buf, (void)bytes, (void)root; }
int mpi_world_node_rank(const MpiWorld *m) { (void)m; return 0; }
int mpi_world_node_size(const MpiWorld *m) { (void)m; return 1; }

#endif
