/* STARTER for stage 02 — it stubs every stage up to 02: each TODO(stage NN) below stops
 * the run until you fill it (see HANDOUT.md#stage-NN). If you did the earlier stages, do not
 * start here: run `make carry STAGE=02`, which carries your own file into this stage and
 * lists what stage 02 adds. Starting from scratch, fill the TODOs stage by stage from
 * stage 01. Generated from the instructors' solution by tools/make_starters.py. */
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
            /* TODO(stage 01): shard p into a DTensor: Shard(0) on the world mesh, torch.chunk rows, padded local storage. */
            hw_todo("shard p into a DTensor: Shard(0) on the world mesh, torch.chunk rows, padded local storage", "HANDOUT.md#stage-01; did stage 01 already? `make carry STAGE=02` brings your file here");
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
    /* TODO(stage 01): copy-in, all-gather on the compute stream, copy-out into each Param.data. */
    hw_todo("copy-in, all-gather on the compute stream, copy-out into each Param.data", "HANDOUT.md#stage-01; did stage 01 already? `make carry STAGE=02` brings your file here");
}

/* reshard: free the unsharded params; the DTensor shards stay. */
static void reshard(Fsdp *f, Group *g) {
    /* TODO(stage 01): free every unsharded Param.data of the module. */
    hw_todo("free every unsharded Param.data of the module", "HANDOUT.md#stage-01; did stage 01 already? `make carry STAGE=02` brings your file here");
}

/* reduce-scatter: row r of the (world, S) input holds chunk r of every grad
 * (FSDP2's chunk-cat, zero padded); rank r receives the average of row r. */
static void reduce_grads(Fsdp *f, Group *g) {
    Module *mod = g->mod;
    /* TODO(stage 02): chunk-cat the grads, free them, reduce-scatter with an average, DTensor.grad as views. */
    hw_todo("chunk-cat the grads, free them, reduce-scatter with an average, DTensor.grad as views", "HANDOUT.md#stage-02");
}

void fsdp_pre_forward(Fsdp *f, Module *mod) { unshard(f, mod->fsdp); }

void fsdp_post_forward(Fsdp *f, Module *mod) { reshard(f, mod->fsdp); }

void fsdp_pre_backward(Fsdp *f, Module *mod) {
    /* TODO(stage 02): the backward needs the params again. */
    hw_todo("the backward needs the params again", "HANDOUT.md#stage-02");
}

void fsdp_post_backward(Fsdp *f, Module *mod) {
    /* TODO(stage 02): reduce-scatter this module's grads, then reshard. */
    hw_todo("reduce-scatter this module's grads, then reshard", "HANDOUT.md#stage-02");
}

void fsdp_finish_backward(Fsdp *f) {
    (void)f; /* one stream: every reduce-scatter is already ordered before the optimizer */
}

float fsdp_optimizer_step(Fsdp *f, float lr, int t) {
    /* TODO(stage 02): global grad norm = sqrt(all-reduce of local sums of squares); clip; AdamW on local rows. */
    hw_todo("global grad norm = sqrt(all-reduce of local sums of squares); clip; AdamW on local rows", "HANDOUT.md#stage-02");
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
