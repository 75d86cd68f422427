/* hw_fsdp.c — stage 01: a blocking FSDP forward.
 *
 * Everything (copies, collectives, compute) is queued on the compute stream,
 * so stream order alone makes it correct: no events needed yet.
 *
 *   fsdp_init          shard every parameter into a DTensor (Shard(0), padded)
 *   pre_forward        unshard: copy-in -> all-gather -> copy-out
 *   post_forward       reshard: free the unsharded params
 * The stage runs with --forward-only: the loss of the initial weights on each
 * step's batch. The backward hooks are stage 02's.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hw_fsdp.h"

/* One FSDP unit: a module and the flat layout of its parameters. */
typedef struct {
    Module *mod;
    size_t shard_numel;   /* per-rank segment: sum of every param's padded shard */
    size_t offsets[MODULE_MAX_PARAMS]; /* where param j's padded shard starts in a segment */
} Group;

struct Fsdp {
    Dev *dev;
    Model *model;
    const DeviceMesh *mesh;
    int rank, world;
    Stream *compute;
    AdamWConfig optim;
    Group *groups;        /* [n_modules] */
};

/* Rows of a dim-0 split that rank r owns: torch.chunk gives every rank
 * ceil(rows / world) rows until they run out (5 rows, 4 ranks: 2, 2, 1, 0). */
static size_t chunk_rows(size_t rows, int world) { return (rows + (size_t)world - 1) / (size_t)world; }
static size_t rows_of_rank(size_t rows, int world, int r) {
    size_t chunk = chunk_rows(rows, world), start = chunk * (size_t)r;
    return start >= rows ? 0 : (rows - start < chunk ? rows - start : chunk);
}

Fsdp *fsdp_init(const FsdpConfig *cfg) {
    Fsdp *f = xcalloc(1, sizeof *f);
    f->dev = cfg->dev;
    f->model = cfg->model;
    f->mesh = cfg->mesh;
    f->rank = dev_rank(cfg->dev);
    f->world = dev_world_size(cfg->dev);
    f->compute = dev_compute_stream(cfg->dev);
    f->optim = cfg->optim;
    f->groups = xcalloc((size_t)f->model->n_modules, sizeof(Group));
    for (int i = 0; i < f->model->n_modules; i++) {
        Module *mod = &f->model->modules[i];
        Group *g = &f->groups[i];
        g->mod = mod;
        mod->fsdp = g;
        for (int j = 0; j < mod->n_params; j++) {
            Param *p = &mod->params[j];
            DTensor *dt = &p->dt;
            /* BEGIN SOLUTION: shard p into a DTensor: Shard(0) on the world mesh, torch.chunk rows, padded local storage (HANDOUT.md#stage-01) */
            dt->global_rows = p->shape[0];
            dt->row_numel = p->numel / p->shape[0];
            dt->padded_rows = chunk_rows(p->shape[0], f->world);
            dt->local_rows = rows_of_rank(p->shape[0], f->world, f->rank);
            /* a rank with no rows starts at the end (device.h, DTensor.row_offset) */
            dt->row_offset = dt->local_rows ? dt->padded_rows * (size_t)f->rank : p->shape[0];
            dt->mesh = f->mesh;
            dt->placement = PLACEMENT_SHARD0;
            size_t padded = dt->padded_rows * dt->row_numel, local = dt->local_rows * dt->row_numel;
            dt->local = dev_alloc_f32(f->dev, padded, MEM_PARAM_SHARD, p->name);
            dev_memcpy_async(f->compute, dt->local, p->data + dt->row_offset * dt->row_numel, local * sizeof(float));
            dev_memset_async(f->compute, dt->local + local, 0, (padded - local) * sizeof(float));
            dev_free(f->dev, p->data); /* the full tensor is gone: only the shard remains */
            p->data = NULL;
            g->offsets[j] = g->shard_numel;
            g->shard_numel += padded;
            /* END SOLUTION */
        }
    }
    return f;
}

/* unshard: every rank contributes its padded shards as one flat segment;
 * after the all-gather the buffer holds [r0: p0|p1|..][r1: p0|p1|..]..;
 * param j's full value is rank r's rows of j, for r = 0..world-1. */
static void unshard(Fsdp *f, Group *g) {
    Module *mod = g->mod;
    if (mod->params[0].data) return; /* already unsharded */
    /* BEGIN SOLUTION: copy-in, all-gather on the compute stream, copy-out into each Param.data (HANDOUT.md#stage-01) */
    size_t S = g->shard_numel;
    char name[64];
    snprintf(name, sizeof name, "%s.all_gather_buffer", mod->name);
    float *flat = dev_alloc_f32(f->dev, S * (size_t)f->world, MEM_COMM_BUFFER, name);
    float *mine = flat + (size_t)f->rank * S;
    for (int j = 0; j < mod->n_params; j++) {
        DTensor *dt = &mod->params[j].dt;
        dev_memcpy_async(f->compute, mine + g->offsets[j], dt->local, dt->padded_rows * dt->row_numel * sizeof(float));
    }
    coll_all_gather(f->dev, mine, flat, S, f->compute, mod->name);
    for (int j = 0; j < mod->n_params; j++) {
        Param *p = &mod->params[j];
        size_t chunk = p->dt.padded_rows, rn = p->dt.row_numel;
        p->data = dev_alloc_f32(f->dev, p->numel, MEM_UNSHARDED_PARAM, p->name);
        for (int r = 0; r < f->world; r++) {
            size_t rows = rows_of_rank(p->shape[0], f->world, r);
            if (rows)
                dev_memcpy_async(f->compute, p->data + chunk * (size_t)r * rn, flat + (size_t)r * S + g->offsets[j],
                                 rows * rn * sizeof(float));
        }
    }
    dev_free(f->dev, flat);
    /* END SOLUTION */
}

/* reshard: free the unsharded params; the DTensor shards stay. */
static void reshard(Fsdp *f, Group *g) {
    /* BEGIN SOLUTION: free every unsharded Param.data of the module (HANDOUT.md#stage-01) */
    for (int j = 0; j < g->mod->n_params; j++) {
        dev_free(f->dev, g->mod->params[j].data);
        g->mod->params[j].data = NULL;
    }
    /* END SOLUTION */
}

void fsdp_pre_forward(Fsdp *f, Module *mod) { unshard(f, mod->fsdp); }

void fsdp_post_forward(Fsdp *f, Module *mod) { reshard(f, mod->fsdp); }

/* The backward is stage 02: stage 01 runs --forward-only, so these never run. */
void fsdp_pre_backward(Fsdp *f, Module *mod) { hw_todo("fsdp_pre_backward (stage 02)", "HANDOUT.md#stage-02"); }
void fsdp_post_backward(Fsdp *f, Module *mod) { hw_todo("fsdp_post_backward (stage 02)", "HANDOUT.md#stage-02"); }
void fsdp_finish_backward(Fsdp *f) { hw_todo("fsdp_finish_backward (stage 02)", "HANDOUT.md#stage-02"); }
float fsdp_optimizer_step(Fsdp *f, float lr, int t) { hw_todo("fsdp_optimizer_step (stage 02)", "HANDOUT.md#stage-02"); }

void fsdp_destroy(Fsdp *f) {
    Model *m = f->model;
    for (int i = 0; i < m->n_modules; i++) {
        for (int j = 0; j < m->modules[i].n_params; j++) {
            Param *p = &m->modules[i].params[j];
            dev_free(f->dev, p->data);
            dev_free(f->dev, p->dt.local);
            p->data = p->dt.local = NULL;
        }
    }
    free(f->groups);
    free(f);
}
