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
    int size, members[WORLD_MAX_RANKS];
} FactGroup;

typedef struct {
    char **modules;           /* [n_modules] its modules in forward order; NULL until a rank states them */
    int n_modules;
    int nranks, ranks[WORLD_MAX_RANKS];
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
    pthread_mutex_destroy(&f->mu);
    free(f);
}

void facts_group(World *w, int id, int color, const char *kind, const char *name, const int *members, int size) {
    WorldFacts *f = w->facts;
    pthread_mutex_lock(&f->mu);
    int known = 0;
    for (int i = 0; i < f->ngroups && !known; i++) known = !strcmp(f->groups[i].name, name);
    if (!known && f->ngroups < (int)(sizeof f->groups / sizeof *f->groups)) { /* every rank of a group makes it */
        FactGroup *g = &f->groups[f->ngroups++];
        snprintf(g->name, sizeof g->name, "%s", name);
        snprintf(g->kind, sizeof g->kind, "%s", kind);
        g->id = id;
        g->color = color;
        g->size = size;
        memcpy(g->members, members, (size_t)size * sizeof *members);
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

void dev_fact_pipe_stage(Dev *d, int stage, int stages, const char *const *modules, int n_modules) {
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
    }
    s->ranks[s->nranks++] = d->rank;
    pthread_mutex_unlock(&f->mu);
}

static void json_ints(Json *j, const int *v, int n) {
    json_array_begin(j);
    for (int i = 0; i < n; i++) json_int(j, v[i]);
    json_array_end(j);
}

static void json_words(Json *j, const char *(*name)(int), int n) {
    json_array_begin(j);
    for (int i = 0; i < n; i++) json_string(j, name(i));
    json_array_end(j);
}

static const char *phase_word(int p) { return phase_name((Phase)p); }
static const char *tag_word(int t) { return mem_tag_name((MemTag)t); }

static int by_rank(const void *a, const void *b) { return *(const int *)a - *(const int *)b; }

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
        json_ints(j, f->groups[i].members, f->groups[i].size);
        json_object_end(j);
    }
    json_array_end(j);
    json_key(j, "device_mesh");
    if (f->mesh_ndim) {
        json_object_begin(j);
        json_key(j, "shape");
        json_ints(j, f->mesh_shape, f->mesh_ndim);
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
            qsort(s->ranks, (size_t)s->nranks, sizeof *s->ranks, by_rank);
            json_object_begin(j);
            json_key(j, "stage");
            json_int(j, p);
            json_key(j, "modules");
            json_array_begin(j);
            for (int i = 0; i < s->n_modules; i++) json_string(j, s->modules[i]);
            json_array_end(j);
            json_key(j, "ranks");
            json_ints(j, s->ranks, s->nranks);
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
