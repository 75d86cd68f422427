/* mpi_world.h — ranks as MPI processes, one per rank under mpirun: what both
 * multi-process backends stand on (the CPU's "mpi", cpu/backend_mpi.c; the CUDA
 * build's "nccl-mpi"). MPI's start and end, the host's communicators (the
 * world's and each process group's, by group id) and the host-side exchanges
 * over them. Built with and without MPI: without it, mpi_world_create says
 * the build has no MPI support. MPI is seen only here, in mpi_world.c and in
 * cpu/backend_mpi.c (the CPU's MPI collectives). */
#ifndef HWFSDP_MPI_WORLD_H
#define HWFSDP_MPI_WORLD_H

#include <stddef.h>

#include "runtime/internal.h"

#ifdef HAVE_MPI
#include <mpi.h>
#endif

typedef struct MpiWorld MpiWorld;

/* MPI_Init_thread (unless done already), the check that mpirun started
 * cfg.world_size processes, this process's rank as w's one local rank; *cores
 * becomes this node's share. Ends with a barrier. */
MpiWorld *mpi_world_create(World *w, long *cores);
void mpi_world_destroy(MpiWorld *m); /* MPI_Finalize if create started MPI */
/* Every rank passes value, out[r] gets rank r's; out NULL: a barrier. */
void mpi_world_exchange(MpiWorld *m, double value, double *out);
/* g's host communicator: a split of the world's by g's color (the world group: the world's). */
void mpi_world_group_init(MpiWorld *m, const ProcessGroup *g);
void mpi_world_group_fini(MpiWorld *m, const ProcessGroup *g);
/* Over group `group_id`'s host communicator: all + r * bytes gets group rank r's `mine`. */
void mpi_world_allgather_bytes(MpiWorld *m, int group_id, const void *mine, void *all, size_t bytes);
/* root's buf to every rank of the world. */
void mpi_world_bcast_bytes(MpiWorld *m, void *buf, size_t bytes, int root);
/* This process among the ranks on its node, and how many they are. */
int mpi_world_node_rank(const MpiWorld *m);
int mpi_world_node_size(const MpiWorld *m);

#ifdef HAVE_MPI
/* The host's communicator of group `group_id` (0: the world's). */
MPI_Comm mpi_world_comm(const MpiWorld *m, int group_id);
#endif

#endif
