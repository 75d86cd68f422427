/* facts.c — what a run used, stated once by the runtime instead of re-derived by its readers: the process
 * groups (name, kind, world ranks; group.c records each as a rank makes it), the device mesh (dims and their
 * names), the pipeline's stage map (which modules and ranks each stage holds; the driver records its stage),
 * and the vocabularies its records use (phases, memory tags, collective kinds). trace.json's otherData and
 * run.json carry them (world_facts_json). The ranks this process runs record them (all of them for the
 * thread backends; with MPI, the groups and stages of this process's ranks). */
#include "runtime/facts.h"
#include "runtime/coll.h"
#include "runtime/internal.h"
#include "runtime/json.h"
#include "runtime/phase.h"
#include "runtime/util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FACT_DIMS 2
#define FACT_STAGES WORLD_MAX_RANKS /* a stage holds at least one rank */

typedef struct {
    char name[PG_NAME_MAX], kind[16];
    int id, color;            /* creation index (the same on every rank) and which of its groups: the order */
    int size, first, stride;  /* its members: first + i * stride (i < size); stride 0: members[] lists them */
    int *members;             /* [size] when stride is 0 (a world whose every rank executes), else NULL */
} FactGroup;

typedef struct {
    char **modules;           /* [n_modules] its modules in forward order; NULL until a rank states them */
    int n_modules;
    int first_rank, nranks;   /* its ranks: first_rank .. first_rank + nranks - 1 */
} FactStage;

struct WorldFacts {
    pthread_mutex_t mu;
    int ngroups;
    FactGroup groups[WORLD_MAX_RANKS * PG_MAX];
    int mesh_ndim, mesh_shape[FACT_DIMS];
    char mesh_dims[FACT_DIMS][16];
    int nstages;
    FactStage stages[FACT_STAGES];
};

WorldFacts *world_facts_create(void) {
    WorldFacts *f = xcalloc(1, sizeof *f);
    pthread_mutex_init(&f->mu, NULL);
    return f;
}

void world_facts_free(WorldFacts *f) {
    if (!f) return;
    for (int p = 0; p < FACT_STAGES; p++) {
        for (int i = 0; i < f->stages[p].n_modules; i++) free(f->stages[p].modules[i]);
        free(f->stages[p].modules);
    }
    for (int i = 0; i < f->ngroups; i++) free(f->groups[i].members);
    pthread_mutex_destroy(&f->mu);
    free(f);
}

void facts_group(World *w, const ProcessGroup *pg, const char *kind) {
    WorldFacts *f = w->facts;
    pthread_mutex_lock(&f->mu);
    int known = 0;
    for (int i = 0; i < f->ngroups && !known; i++) known = !strcmp(f->groups[i].name, pg->name);
    if (!known && f->ngroups < (int)(sizeof f->groups / sizeof *f->groups)) { /* every executed rank of a group makes it */
        FactGroup *g = &f->groups[f->ngroups++];
        snprintf(g->name, sizeof g->name, "%s", pg->name);
        snprintf(g->kind, sizeof g->kind, "%s", kind);
        g->id = pg->id;
        g->color = pg->color;
        g->size = pg->size;
        g->first = pg->first;
        g->stride = pg->stride;
        g->members = NULL;
        if (!pg->stride) { /* no structure: every rank executes, and members[] holds them all */
            g->members = xmalloc((size_t)pg->size * sizeof *g->members);
            memcpy(g->members, pg->members, (size_t)pg->size * sizeof *g->members);
        }
    }
    pthread_mutex_unlock(&f->mu);
}

void dev_fact_mesh(Dev *d, int ndim, const int *shape, const char *const *dim_names) {
    WorldFacts *f = d->world->facts;
    if (ndim > FACT_DIMS) fatal("dev_fact_mesh: a mesh of %d dims (at most %d)", ndim, FACT_DIMS);
    pthread_mutex_lock(&f->mu);
    f->mesh_ndim = ndim; /* every rank builds the same mesh */
    for (int i = 0; i < ndim; i++) {
        f->mesh_shape[i] = shape[i];
        snprintf(f->mesh_dims[i], sizeof f->mesh_dims[i], "%s", dim_names[i]);
    }
    pthread_mutex_unlock(&f->mu);
}

void dev_fact_pipe_stage(Dev *d, int stage, int stages, const char *const *modules, int n_modules, int first_rank,
                         int nranks) {
    WorldFacts *f = d->world->facts;
    if (stage < 0 || stage >= FACT_STAGES || stages > FACT_STAGES)
        fatal("dev_fact_pipe_stage: stage %d of %d (at most %d stages)", stage, stages, FACT_STAGES);
    pthread_mutex_lock(&f->mu);
    f->nstages = stages;
    FactStage *s = &f->stages[stage];
    if (!s->modules) { /* the stage's first rank to get here; its other ranks hold the same modules */
        s->modules = xmalloc((size_t)(n_modules > 0 ? n_modules : 1) * sizeof *s->modules);
        for (int i = 0; i < n_modules; i++) s->modules[i] = xstrdup(modules[i]);
        s->n_modules = n_modules;
        s->first_rank = first_rank;
        s->nranks = nranks;
    }
    pthread_mutex_unlock(&f->mu);
}

/* [first, first + stride, ...] (n of them), or v[0..n) when v is not NULL */
static void json_ranks(Json *j, const int *v, int first, int stride, int n) {
    json_array_begin(j);
    for (int i = 0; i < n; i++) json_int(j, v ? v[i] : first + i * stride);
    json_array_end(j);
}

static void json_words(Json *j, const char *(*name)(int), int n) {
    json_array_begin(j);
    for (int i = 0; i < n; i++) json_string(j, name(i));
    json_array_end(j);
}

static const char *phase_word(int p) { return phase_name((Phase)p); }
static const char *tag_word(int t) { return mem_tag_name((MemTag)t); }

static int by_creation(const void *a, const void *b) { /* the ranks are threads: they record in any order */
    const FactGroup *x = a, *y = b;
    return x->id != y->id ? x->id - y->id : x->color - y->color;
}

void world_facts_json(World *w, Json *j) {
    WorldFacts *f = w->facts;
    pthread_mutex_lock(&f->mu);
    qsort(f->groups, (size_t)f->ngroups, sizeof *f->groups, by_creation);
    json_key(j, "groups"); /* in the order they were made (the world first), a split's groups by color */
    json_array_begin(j);
    for (int i = 0; i < f->ngroups; i++) {
        json_object_begin(j);
        json_key_string(j, "name", f->groups[i].name);
        json_key_string(j, "kind", f->groups[i].kind);
        json_key(j, "ranks");
        json_ranks(j, f->groups[i].members, f->groups[i].first, f->groups[i].stride, f->groups[i].size);
        json_object_end(j);
    }
    json_array_end(j);
    json_key(j, "device_mesh");
    if (f->mesh_ndim) {
        json_object_begin(j);
        json_key(j, "shape");
        json_ranks(j, f->mesh_shape, 0, 0, f->mesh_ndim);
        json_key(j, "dims");
        json_array_begin(j);
        for (int i = 0; i < f->mesh_ndim; i++) json_string(j, f->mesh_dims[i]);
        json_array_end(j);
        json_object_end(j);
    } else {
        json_null(j);
    }
    json_key(j, "pipeline"); /* --pp: stage p's modules (forward order) and ranks; null without --pp */
    if (f->nstages) {
        json_array_begin(j);
        for (int p = 0; p < f->nstages; p++) {
            FactStage *s = &f->stages[p];
            json_object_begin(j);
            json_key(j, "stage");
            json_int(j, p);
            json_key(j, "modules");
            json_array_begin(j);
            for (int i = 0; i < s->n_modules; i++) json_string(j, s->modules[i]);
            json_array_end(j);
            json_key(j, "ranks");
            json_ranks(j, NULL, s->first_rank, 1, s->nranks);
            json_object_end(j);
        }
        json_array_end(j);
    } else {
        json_null(j);
    }
    pthread_mutex_unlock(&f->mu);
    json_key(j, "vocab"); /* the words its records use (runtime/phase.h, device.h's MemTag, CollKind) */
    json_object_begin(j);
    json_key(j, "phases");
    json_words(j, phase_word, PHASE_COUNT);
    json_key(j, "mem_tags");
    json_words(j, tag_word, MEM_TAG_COUNT);
    json_key(j, "collective_kinds");
    json_words(j, coll_kind_name, COLL_KIND_COUNT);
    json_object_end(j);
}
