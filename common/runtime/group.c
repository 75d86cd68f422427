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
#include <unistd.h>

static int node_of(const World *w, int rank) {
    int per = w->cfg.ranks_per_node > 0 ? w->cfg.ranks_per_node : w->cfg.world_size;
    return rank / per;
}

/* A group's members known from their structure: the `size` world ranks first, first + stride, ... */
typedef struct {
    int first, stride, size; /* stride 0: none (dev_group_new: the colors alone) */
} Members;

static int members_hold(Members m, int rank) {
    return m.stride > 0 && rank >= m.first && (rank - m.first) % m.stride == 0 && (rank - m.first) / m.stride < m.size;
}

/* The group of this rank's color: with `colors` (colors[i]: executed rank i's), its executed members are the
 * executed ranks of that color, which must be those of m when m has a structure; without (the world), m's. */
static ProcessGroup *group_add(Dev *d, int color, const double *colors, Members m, const char *kind,
                               const char *name) {
    if (d->npgs >= PG_MAX) fatal("rank %d: dev_group_new('%s'): at most %d process groups per rank", d->rank, name, PG_MAX);
    ProcessGroup *g = xcalloc(1, sizeof *g);
    g->dev = d;
    g->id = d->npgs;
    g->color = color;
    const int n = dev_executed_count(d);
    for (int i = 0; i < n; i++) {
        const int r = dev_executed_rank(d, i), by_color = colors && (int)colors[i] == color;
        if (colors && m.stride && by_color != members_hold(m, r))
            fatal("rank %d: dev_group_new_of('%s'): rank %d %s color %d but %s the group's %d ranks from %d every %d "
                  "(its color and its structure must say the same)", d->rank, name, r, by_color ? "passed" : "did not pass",
                  color, by_color ? "is not one of" : "is one of", m.size, m.first, m.stride);
        if (!(colors ? by_color : members_hold(m, r))) continue;
        if (r == d->rank) g->live = g->nlive;
        g->members[g->nlive++] = r;
    }
    if (m.stride) {
        if (!members_hold(m, d->rank))
            fatal("rank %d: dev_group_new_of('%s'): this rank is not one of the group's %d ranks from %d every %d",
                  d->rank, name, m.size, m.first, m.stride);
        g->first = m.first;
        g->stride = m.stride;
        g->size = m.size;
        g->rank = (d->rank - m.first) / m.stride;
        /* members in rank order, so a node's members are consecutive: count the nodes they sit on (once per
         * group, not per op) */
        for (int i = 0; i < m.size; i++)
            if (!i || node_of(d->world, m.first + i * m.stride) != node_of(d->world, m.first + (i - 1) * m.stride))
                g->nodes++;
    } else { /* every rank executes (dev_group_new refused otherwise): members[] holds them all */
        g->first = g->members[0];
        g->size = g->nlive;
        g->rank = g->live;
        for (int i = 0; i < g->size; i++)
            if (!i || node_of(d->world, g->members[i]) != node_of(d->world, g->members[i - 1])) g->nodes++;
    }
    g->spans_nodes = g->nodes > 1;
    snprintf(g->name, sizeof g->name, "%s", name);
    facts_group(d->world, g, kind);
    dev_ops(d)->group_init(g);
    d->pgs[d->npgs++] = g;
    return g;
}

void dev_groups_init(Dev *d) {
    group_add(d, 0, NULL, (Members){0, 1, d->world_size}, "world", "world");
}

void dev_groups_fini(Dev *d) {
    for (int i = 0; i < d->npgs; i++) {
        dev_ops(d)->group_fini(d->pgs[i]);
        free(d->pgs[i]);
    }
    d->npgs = 0;
}

/* The group of the ranks of this rank's color, of kind `kind`, named `name` (members m where known). */
static ProcessGroup *group_new(Dev *d, int color, Members m, const char *kind, const char *name) {
    if (color < 0) fatal("rank %d: dev_group_new('%s'): color %d is negative", d->rank, name ? name : "", color);
    if (!m.stride && dev_executed_count(d) < d->world_size) {
        /* every executed rank makes the same call: the lowest says so, once (the others wait for its exit) */
        if (d->rank != dev_executed_rank(d, 0))
            for (;;) pause();
        fatal("rank %d: dev_group_new('%s'): with representative ranks (a dry run of %d ranks executing %d) the "
              "ranks that do not execute pass no color: make the group from its structure (dev_group_new_of)",
              d->rank, name ? name : "", d->world_size, dev_executed_count(d));
    }
    double colors[WORLD_MAX_RANKS];
    dev_ops(d)->host_exchange(d, (double)color, colors); /* every executed rank's color: the members */
    ProcessGroup *g = group_add(d, color, colors, m, kind, name && *name ? name : "group");
    for (int i = 0; i < d->nstreams; i++) dev_ops(d)->stream_join_group(d->streams[i], g);
    return g;
}

ProcessGroup *dev_group_new(Dev *d, int color, const char *name) {
    return group_new(d, color, (Members){0, 0, 0}, "group", name);
}

ProcessGroup *dev_group_new_of(Dev *d, int color, const char *kind, int first, int stride, int size) {
    char name[PG_NAME_MAX]; /* the one place a group's name is made from its kind: "shard0", "replicate1", "stage2" */
    snprintf(name, sizeof name, "%s%d", kind, color);
    if (stride < 1 || size < 1 || first < 0 || first + (long long)(size - 1) * stride >= d->world_size)
        fatal("rank %d: dev_group_new_of('%s'): %d ranks from %d every %d do not lie in the world of %d", d->rank,
              name, size, first, stride, d->world_size);
    return group_new(d, color, (Members){first, stride, size}, kind, name);
}

void dev_mesh_build(Dev *d, DeviceMesh *m, int replicas, int shards) {
    memset(m, 0, sizeof *m);
    m->size = d->world_size;
    for (int r = 0; r < m->size && r < WORLD_MAX_RANKS; r++) m->ranks[r] = r;
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
    m->shard_group = dev_group_new_of(d, row, "shard", row * shards, 1, shards);       /* row i: i*S .. i*S+S-1 */
    m->replicate_group = dev_group_new_of(d, col, "replicate", col, shards, replicas); /* column j: j, j+S, ... */
    dev_fact_mesh(d, 2, m->shape, (const char *const[]){"replicate", "shard"});
}

ProcessGroup *dev_world_group(Dev *d) { return d->pgs[0]; }
int pg_rank(const ProcessGroup *g) { return g->rank; }
int pg_size(const ProcessGroup *g) { return g->size; }
const char *pg_name(const ProcessGroup *g) { return g->name; }
