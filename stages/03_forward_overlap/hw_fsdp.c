/* STARTER for stage 03 — it stubs every stage up to 03: each TODO(stage NN) below stops
 * the run until you fill it (see HANDOUT.md#stage-NN). If you did the earlier stages, do not
 * start here: run `make carry STAGE=03`, which carries your own file into this stage and
 * lists what stage 03 adds. Starting from scratch, fill the TODOs stage by stage from
 * stage 01. Generated from the instructors' solution by tools/make_starters.py. */
/* hw_fsdp.c — stage 03: forward all-gathers overlapped with compute.
 *
 * Streams (as FSDP2):
 *   compute         module forward/backward, copy-out, reduce-scatter (still blocking)
 *   all_gather      copy-in of the shards + the all-gather
 * Events order them.
 *
 *   forward:  pre_forward(i) waits for i's all-gather (issued as a prefetch by
 *             pre_forward(i-1)), then prefetches i+1: i+1's all-gather runs
 *             while i computes. At most modules i and i+1 are unsharded.
 *   backward: as stage 02 (unshard when needed, reduce-scatter on compute);
 *             stage 04 overlaps it.
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
    float *ag_flat;       /* [world * shard_numel] all-gather output while in flight */
    Event *ag_done;       /* recorded on the all-gather stream after the all-gather */
    float *grad_shards;   /* [shard_numel] reduce-scatter output; DTensor.grad are views */
} Group;

struct Fsdp {
    Dev *dev;
    Model *model;
    const DeviceMesh *mesh;
    int rank, world;
    Stream *compute, *ag_stream;
    Event *shards_ready;  /* compute: the shards were last written (init, optimizer) */
    /* FSDP2's AllGatherState: the all-gather output compute last copied out of. Its
     * block belongs to the all-gather stream's pool, so it is kept alive until that
     * stream has waited for copy_out_done: freed earlier, the next all-gather could
     * take the block while compute still copies out of it. */
    float *ag_state;
    Event *copy_out_done; /* compute: the latest copy-out finished */
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
            hw_todo("shard p into a DTensor: Shard(0) on the world mesh, torch.chunk rows, padded local storage", "HANDOUT.md#stage-01; did stage 02 already? `make carry STAGE=03` brings your file here");
        }
    }
    /* TODO(stage 03): create the all-gather stream and the events that order it with compute. */
    hw_todo("create the all-gather stream and the events that order it with compute", "HANDOUT.md#stage-03");
    return f;
}

static int is_unsharded(const Group *g) { return g->mod->params[0].data != NULL; }

/* Drop the AllGatherState: once the all-gather stream has waited for the
 * copy-out that read the kept output, its later work runs after that read,
 * so its next allocation may take the block. */
static void release_all_gather_state(Fsdp *f) {
    if (!f->ag_state) return;
    /* TODO(stage 03): the all-gather stream waits for the copy-out, then the kept output is freed. */
    hw_todo("the all-gather stream waits for the copy-out, then the kept output is freed", "HANDOUT.md#stage-03");
}

/* Issue g's all-gather on the all-gather stream (returns at once): copy-in
 * this rank's padded shards into its segment of the flat output, all-gather
 * in place, record ag_done. The output is [r0: p0|p1|..][r1: p0|p1|..]..
 * The copy-in is one launch, a list of copies (HANDOUT.md#fused-copies). */
static void issue_all_gather(Fsdp *f, Group *g) {
    if (g->ag_flat || is_unsharded(g)) return; /* already in flight or done */
    Module *mod = g->mod;
    /* TODO(stage 03): copy-in + all-gather on the all-gather stream, after the shards are ready; record ag_done. */
    hw_todo("copy-in + all-gather on the all-gather stream, after the shards are ready; record ag_done", "HANDOUT.md#stage-03");
}

/* Make g's params usable by compute: the compute stream waits for the
 * all-gather, then copies each param's rows out of every rank's segment.
 * One launch for all of them: at world 64 a block's 9 params are 576 copies. */
static void wait_all_gather(Fsdp *f, Group *g) {
    if (!g->ag_flat) return;
    Module *mod = g->mod;
    /* TODO(stage 03): compute waits on ag_done, copy-out into each Param.data, record copy_out_done and keep the flat buffer as the AllGatherState. */
    hw_todo("compute waits on ag_done, copy-out into each Param.data, record copy_out_done and keep the flat buffer as the AllGatherState", "HANDOUT.md#stage-03");
}

/* reshard: free the unsharded params; the DTensor shards stay. */
static void reshard(Fsdp *f, Group *g) {
    /* TODO(stage 01): free every unsharded Param.data of the module. */
    hw_todo("free every unsharded Param.data of the module", "HANDOUT.md#stage-01; did stage 02 already? `make carry STAGE=03` brings your file here");
}

/* reduce-scatter: row r of the (world, S) input holds chunk r of every grad
 * (FSDP2's chunk-cat, zero padded); rank r receives the average of row r.
 * The chunk-cat is one launch, a list of copies (HANDOUT.md#fused-copies). */
static void reduce_grads(Fsdp *f, Group *g) {
    Module *mod = g->mod;
    /* TODO(stage 02): chunk-cat the grads, free them, reduce-scatter with an average, DTensor.grad as views. */
    hw_todo("chunk-cat the grads, free them, reduce-scatter with an average, DTensor.grad as views", "HANDOUT.md#stage-02; did stage 02 already? `make carry STAGE=03` brings your file here");
}

void fsdp_pre_forward(Fsdp *f, Module *mod) {
    Group *g = mod->fsdp;
    /* TODO(stage 03): unshard (unless prefetched), wait, then prefetch the next module in forward order. */
    hw_todo("unshard (unless prefetched), wait, then prefetch the next module in forward order", "HANDOUT.md#stage-03");
}

void fsdp_post_forward(Fsdp *f, Module *mod) { reshard(f, mod->fsdp); }

void fsdp_pre_backward(Fsdp *f, Module *mod) {
    /* TODO(stage 03): the backward needs the params again: drop the forward's AllGatherState, all-gather and wait. */
    hw_todo("the backward needs the params again: drop the forward's AllGatherState, all-gather and wait", "HANDOUT.md#stage-03");
}

void fsdp_post_backward(Fsdp *f, Module *mod) {
    /* TODO(stage 02): reduce-scatter this module's grads, then reshard. */
    hw_todo("reduce-scatter this module's grads, then reshard", "HANDOUT.md#stage-02; did stage 02 already? `make carry STAGE=03` brings your file here");
}

void fsdp_finish_backward(Fsdp *f) {
    /* TODO(stage 03): drop the backward's last AllGatherState before the optimizer. */
    hw_todo("drop the backward's last AllGatherState before the optimizer", "HANDOUT.md#stage-03");
    /* reduce-scatters run on the compute stream: already ordered before the optimizer */
}

float fsdp_optimizer_step(Fsdp *f, float lr, int t) {
    /* TODO(stage 02): global grad norm = sqrt(all-reduce of local sums of squares); clip; AdamW on local rows; free the grad shards. */
    hw_todo("global grad norm = sqrt(all-reduce of local sums of squares); clip; AdamW on local rows; free the grad shards", "HANDOUT.md#stage-02; did stage 02 already? `make carry STAGE=03` brings your file here");
    /* TODO(stage 03): the next all-gathers must read the updated shards. */
    hw_todo("the next all-gathers must read the updated shards", "HANDOUT.md#stage-03");
    /* TODO(stage 02): read the global grad norm back and return it. */
    hw_todo("read the global grad norm back and return it", "HANDOUT.md#stage-02; did stage 02 already? `make carry STAGE=03` brings your file here");
}

void fsdp_destroy(Fsdp *f) {
    Model *m = f->model;
    dev_synchronize(f->dev);
    for (int i = 0; i < m->n_modules; i++) {
        Group *g = &f->groups[i];
        for (int j = 0; j < m->modules[i].n_params; j++) {
            Param *p = &m->modules[i].params[j];
            dev_free(f->dev, p->data);
            dev_free(f->dev, p->dt.local);
            dev_free(f->dev, p->dt.exp_avg);
            dev_free(f->dev, p->dt.exp_avg_sq);
            p->data = p->dt.local = p->dt.exp_avg = p->dt.exp_avg_sq = NULL;
        }
        dev_free(f->dev, g->ag_flat);
        if (i == 0) dev_free(f->dev, f->ag_state);
        dev_free(f->dev, g->grad_shards);
        if (g->ag_done) dev_event_destroy(g->ag_done);
    }
    if (f->shards_ready) dev_event_destroy(f->shards_ready);
    if (f->copy_out_done) dev_event_destroy(f->copy_out_done);
    free(f->groups);
    free(f);
}
