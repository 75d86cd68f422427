/* hw_fsdp.c — stage 02: a full FSDP training step, blocking, one stream.
 *
 * Everything (copies, collectives, compute) is queued on the compute stream,
 * so stream order alone makes it correct: no events needed yet.
 *
 *   fsdp_init          shard every parameter into a DTensor (Shard(0), padded)
 *   pre_forward        unshard: copy-in -> all-gather -> copy-out
 *   post_forward       reshard: free the unsharded params
 *   pre_backward       unshard again
 *   post_backward      reduce-scatter the grads (average), free them, reshard
 *   optimizer_step     global grad norm (all-reduce), clip, AdamW on shards
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hw_fsdp.h"

/* One FSDP unit: a module and the flat layout of its parameters. */
typedef struct {
    Module *mod;
    size_t shard_numel;   /* per-rank segment: sum of every param's padded shard */
    size_t offsets[MODULE_MAX_PARAMS]; /* where param j's padded shard starts in a segment */
    float *grad_shards;   /* [shard_numel] reduce-scatter output; DTensor.grad are views */
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

/* reduce-scatter: row r of the (world, S) input holds chunk r of every grad
 * (FSDP2's chunk-cat, zero padded); rank r receives the average of row r. */
static void reduce_grads(Fsdp *f, Group *g) {
    Module *mod = g->mod;
    /* BEGIN SOLUTION: chunk-cat the grads, free them, reduce-scatter with an average, DTensor.grad as views (HANDOUT.md#stage-02) */
    size_t S = g->shard_numel;
    char name[64];
    snprintf(name, sizeof name, "%s.reduce_scatter_input", mod->name);
    float *in = dev_alloc_f32(f->dev, S * (size_t)f->world, MEM_COMM_BUFFER, name);
    dev_memset_async(f->compute, in, 0, S * (size_t)f->world * sizeof(float));
    for (int j = 0; j < mod->n_params; j++) {
        Param *p = &mod->params[j];
        size_t chunk = p->dt.padded_rows, rn = p->dt.row_numel;
        for (int r = 0; r < f->world; r++) {
            size_t rows = rows_of_rank(p->shape[0], f->world, r);
            if (rows)
                dev_memcpy_async(f->compute, in + (size_t)r * S + g->offsets[j], p->grad + chunk * (size_t)r * rn,
                                 rows * rn * sizeof(float));
        }
        dev_free(f->dev, p->grad); /* the unsharded grad is not needed any more */
        p->grad = NULL;
    }
    snprintf(name, sizeof name, "%s.grad_shards", mod->name);
    g->grad_shards = dev_alloc_f32(f->dev, S, MEM_GRAD_SHARD, name);
    coll_reduce_scatter(f->dev, in, g->grad_shards, S, RED_AVG, f->compute, mod->name);
    dev_free(f->dev, in);
    for (int j = 0; j < mod->n_params; j++) mod->params[j].dt.grad = g->grad_shards + g->offsets[j];
    /* END SOLUTION */
}

void fsdp_pre_forward(Fsdp *f, Module *mod) { unshard(f, mod->fsdp); }

void fsdp_post_forward(Fsdp *f, Module *mod) { reshard(f, mod->fsdp); }

void fsdp_pre_backward(Fsdp *f, Module *mod) {
    /* BEGIN SOLUTION: the backward needs the params again (HANDOUT.md#stage-02) */
    unshard(f, mod->fsdp);
    /* END SOLUTION */
}

void fsdp_post_backward(Fsdp *f, Module *mod) {
    /* BEGIN SOLUTION: reduce-scatter this module's grads, then reshard (HANDOUT.md#stage-02) */
    reduce_grads(f, mod->fsdp);
    reshard(f, mod->fsdp);
    /* END SOLUTION */
}

void fsdp_finish_backward(Fsdp *f) {
    (void)f; /* one stream: every reduce-scatter is already ordered before the optimizer */
}

float fsdp_optimizer_step(Fsdp *f, float lr, int t) {
    /* BEGIN SOLUTION: global grad norm = sqrt(all-reduce of local sums of squares); clip; AdamW on local rows (HANDOUT.md#stage-02) */
    Model *m = f->model;
    float *sumsq = dev_alloc_f32(f->dev, 1, MEM_TEMP, "grad_norm.sumsq");
    dev_memset_async(f->compute, sumsq, 0, sizeof(float));
    for (int i = 0; i < m->n_modules; i++)
        for (int j = 0; j < m->modules[i].n_params; j++) {
            DTensor *dt = &m->modules[i].params[j].dt;
            launch_sumsq_accumulate(f->compute, sumsq, dt->grad, dt->local_rows * dt->row_numel);
        }
    coll_all_reduce(f->dev, sumsq, sumsq, 1, RED_SUM, f->compute, "grad_norm");
    for (int i = 0; i < m->n_modules; i++) {
        for (int j = 0; j < m->modules[i].n_params; j++) {
            Param *p = &m->modules[i].params[j];
            DTensor *dt = &p->dt;
            size_t n = dt->local_rows * dt->row_numel;
            if (!dt->exp_avg) { /* optimizer state is created at the first step, sharded like the param */
                dt->exp_avg = dev_alloc_f32(f->dev, n, MEM_OPTIM_STATE, p->name);
                dt->exp_avg_sq = dev_alloc_f32(f->dev, n, MEM_OPTIM_STATE, p->name);
                dev_memset_async(f->compute, dt->exp_avg, 0, n * sizeof(float));
                dev_memset_async(f->compute, dt->exp_avg_sq, 0, n * sizeof(float));
            }
            launch_adamw(f->compute, dt->local, dt->grad, dt->exp_avg, dt->exp_avg_sq, n, &f->optim, lr, t, sumsq);
            dt->grad = NULL;
        }
        dev_free(f->dev, f->groups[i].grad_shards); /* zero_grad(set_to_none=True) */
        f->groups[i].grad_shards = NULL;
    }
    float host_sumsq = 0;
    dev_memcpy_async(f->compute, &host_sumsq, sumsq, sizeof(float));
    dev_stream_synchronize(f->compute);
    dev_free(f->dev, sumsq);
    return sqrtf(host_sumsq);
    /* END SOLUTION */
}

void fsdp_destroy(Fsdp *f) {
    Model *m = f->model;
    for (int i = 0; i < m->n_modules; i++) {
        for (int j = 0; j < m->modules[i].n_params; j++) {
            Param *p = &m->modules[i].params[j];
            dev_free(f->dev, p->data);
            dev_free(f->dev, p->dt.local);
            dev_free(f->dev, p->dt.exp_avg);
            dev_free(f->dev, p->dt.exp_avg_sq);
            p->data = p->dt.local = p->dt.exp_avg = p->dt.exp_avg_sq = NULL;
        }
        dev_free(f->dev, f->groups[i].grad_shards);
    }
    free(f->groups);
    free(f);
}
