/* group.c — process groups (device.h): the world group every rank has, the
 * groups the driver makes for a --mesh, and the order in which streams join
 * them. How a stream reaches a group's peers is the backend's
 * (stream_join_group; local: a rendezvous channel per (stream, group), made
 * at its first collective; mpi: a split of the world per (stream, group);
 * nccl: none, the group's one communicator, a split of the world's made at
 * group_init, serves every stream). */
#include "runtime/facts.h"
#include "runtime/internal.h"
#include "runtime/util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int node_of(const World *w, int rank) {
    int per = w->cfg.ranks_per_node > 0 ? w->cfg.ranks_per_node : w->cfg.world_size;
    return rank / per;
}

static ProcessGroup *group_add(Dev *d, int color, const int *colors, const char *kind, const char *name) {
    if (d->npgs >= PG_MAX) fatal("rank %d: dev_group_new('%s'): at most %d process groups per rank", d->rank, name, PG_MAX);
    ProcessGroup *g = xcalloc(1, sizeof *g);
    g->dev = d;
    g->id = d->npgs;
    g->color = color;
    for (int r = 0; r < d->world_size; r++) {
        if (colors && colors[r] != color) continue;
        if (r == d->rank) g->rank = g->size;
        /* members come in rank order, so a node's members are consecutive */
        if (!g->size || node_of(d->world, r) != node_of(d->world, g->members[g->size - 1])) g->nodes++;
        g->members[g->size++] = r;
    }
    g->spans_nodes = g->nodes > 1;
    snprintf(g->name, sizeof g->name, "%s", name);
    facts_group(d->world, g->id, g->color, kind, g->name, g->members, g->size);
    dev_ops(d)->group_init(g);
    d->pgs[d->npgs++] = g;
    return g;
}

void dev_groups_init(Dev *d) { group_add(d, 0, NULL, "world", "world"); }

void dev_groups_fini(Dev *d) {
    for (int i = 0; i < d->npgs; i++) {
        dev_ops(d)->group_fini(d->pgs[i]);
        free(d->pgs[i]);
    }
    d->npgs = 0;
}

/* The group of the ranks of this rank's color, of kind `kind`, named `name`. */
static ProcessGroup *group_new(Dev *d, int color, const char *kind, const char *name) {
    if (color < 0) fatal("rank %d: dev_group_new('%s'): color %d is negative", d->rank, name ? name : "", color);
    double all[WORLD_MAX_RANKS];
    dev_ops(d)->host_exchange(d, (double)color, all); /* every rank's color: the members */
    int colors[WORLD_MAX_RANKS];
    for (int r = 0; r < d->world_size; r++) colors[r] = (int)all[r];
    ProcessGroup *g = group_add(d, color, colors, kind, name && *name ? name : "group");
    for (int i = 0; i < d->nstreams; i++) dev_ops(d)->stream_join_group(d->streams[i], g);
    return g;
}

ProcessGroup *dev_group_new(Dev *d, int color, const char *name) { return group_new(d, color, "group", name); }

ProcessGroup *dev_group_new_of(Dev *d, int color, const char *kind) {
    char name[PG_NAME_MAX]; /* the one place a group's name is made from its kind: "shard0", "replicate1", "stage2" */
    snprintf(name, sizeof name, "%s%d", kind, color);
    return group_new(d, color, kind, name);
}

void dev_mesh_build(Dev *d, DeviceMesh *m, int replicas, int shards) {
    memset(m, 0, sizeof *m);
    m->size = d->world_size;
    for (int r = 0; r < m->size; r++) m->ranks[r] = r;
    if (replicas <= 0) { /* 1-D: the world */
        m->ndim = 1;
        m->shape[0] = m->size;
        m->shape[1] = 1;
        m->shard_group = dev_world_group(d);
        dev_fact_mesh(d, 1, &m->size, (const char *const[]){"shard"});
        return;
    }
    if (replicas * shards != d->world_size)
        fatal("--mesh %d,%d has %d ranks but the world has %d", replicas, shards, replicas * shards, d->world_size);
    m->ndim = 2;
    m->shape[0] = replicas;
    m->shape[1] = shards;
    int row = d->rank / shards, col = d->rank % shards;
    m->shard_group = dev_group_new_of(d, row, "shard");
    m->replicate_group = dev_group_new_of(d, col, "replicate");
    dev_fact_mesh(d, 2, m->shape, (const char *const[]){"replicate", "shard"});
}

ProcessGroup *dev_world_group(Dev *d) { return d->pgs[0]; }
int pg_rank(const ProcessGroup *g) { return g->rank; }
int pg_size(const ProcessGroup *g) { return g->size; }
const char *pg_name(const ProcessGroup *g) { return g->name; }
