/* STARTER for stage 06 — it stubs every stage up to 06: each TODO(stage NN) below stops
 * the run until you fill it (see HANDOUT.md#stage-NN). If you did the earlier stages, do not
 * start here: run `make carry STAGE=06`, which carries your own file into this stage and
 * lists what stage 06 adds. Starting from scratch, fill the TODOs stage by stage from
 * stage 01. Generated from the instructors' solution by tools/make_starters.py. */
/* hw_fsdp.c — stage 06: ZeRO-2 (--reshard-after-forward=false).
 *
 * Stage 05 plus the option FSDP2 calls reshard_after_forward=False: params
 * are not freed after forward, so backward needs no all-gather at all; they
 * are freed in post_backward. More memory, less communication. With the
 * default (true) this file behaves exactly like stage 05.
 *
 * Streams: compute, all_gather (copy-in + all-gather), reduce_scatter.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hw_fsdp.h"

/* FSDP2's training state of a module, so the hooks know where they are. */
typedef enum {
    TS_IDLE = 0,       /* between steps, or forward done */
    TS_FORWARD,        /* between pre_forward and post_forward */
    TS_PRE_BACKWARD,   /* pre_backward ran: params unsharded for the backward */
    TS_POST_BACKWARD,  /* post_backward ran: grads handed to the reduce-scatter */
} TrainingState;

/* One FSDP unit: a module and the flat layout of its parameters. */
typedef struct {
    Module *mod;
    TrainingState state;
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
    Stream *compute, *ag_stream, *rs_stream;
    Event *shards_ready;  /* compute: the shards were last written (init, optimizer) */
    /* FSDP2's AllGatherState: the all-gather output compute last copied out of. Its
     * block belongs to the all-gather stream's pool, so it is kept alive until that
     * stream has waited for copy_out_done: freed earlier, the next all-gather could
     * take the block while compute still copies out of it. */
    float *ag_state;
    Event *copy_out_done; /* compute: the latest copy-out finished */
    Event *grads_ready;   /* compute: a reduce-scatter input is filled */
    Event *rs_done;       /* reduce_scatter stream: the latest reduce-scatter finished */
    /* FSDP2's ReduceScatterState: the latest reduce-scatter input (a block of
     * compute's pool), kept alive until compute has waited for rs_done. */
    float *rs_state;
    int reshard_after_forward; /* 0: ZeRO-2, keep params unsharded from forward to backward */
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
    f->reshard_after_forward = cfg->reshard_after_forward;
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
            hw_todo("shard p into a DTensor: Shard(0) on the world mesh, torch.chunk rows, padded local storage", "HANDOUT.md#stage-01; did stage 05 already? `make carry STAGE=06` brings your file here");
        }
    }
    /* TODO(stage 03): create the all-gather stream and the events that order it with compute. */
    hw_todo("create the all-gather stream and the events that order it with compute", "HANDOUT.md#stage-03; did stage 05 already? `make carry STAGE=06` brings your file here");
    /* TODO(stage 04): create the reduce-scatter stream and its events. */
    hw_todo("create the reduce-scatter stream and its events", "HANDOUT.md#stage-04; did stage 05 already? `make carry STAGE=06` brings your file here");
    return f;
}

static int is_unsharded(const Group *g) { return g->mod->params[0].data != NULL; }

/* Drop the AllGatherState: once the all-gather stream has waited for the
 * copy-out that read the kept output, its later work runs after that read,
 * so its next allocation may take the block. */
static void release_all_gather_state(Fsdp *f) {
    if (!f->ag_state) return;
    /* TODO(stage 03): the all-gather stream waits for the copy-out, then the kept output is freed. */
    hw_todo("the all-gather stream waits for the copy-out, then the kept output is freed", "HANDOUT.md#stage-03; did stage 05 already? `make carry STAGE=06` brings your file here");
}

/* Issue g's all-gather on the all-gather stream (returns at once): copy-in
 * this rank's padded shards into its segment of the flat output, all-gather
 * in place, record ag_done. The output is [r0: p0|p1|..][r1: p0|p1|..]..
 * The copy-in is one launch, a list of copies (HANDOUT.md#fused-copies). */
static void issue_all_gather(Fsdp *f, Group *g) {
    if (g->ag_flat || is_unsharded(g)) return; /* already in flight or done */
    Module *mod = g->mod;
    /* TODO(stage 03): copy-in + all-gather on the all-gather stream, after the shards are ready; record ag_done. */
    hw_todo("copy-in + all-gather on the all-gather stream, after the shards are ready; record ag_done", "HANDOUT.md#stage-03; did stage 05 already? `make carry STAGE=06` brings your file here");
}

/* Make g's params usable by compute: the compute stream waits for the
 * all-gather, then copies each param's rows out of every rank's segment.
 * One launch for all of them: at world 64 a block's 9 params are 576 copies. */
static void wait_all_gather(Fsdp *f, Group *g) {
    if (!g->ag_flat) return;
    Module *mod = g->mod;
    /* TODO(stage 03): compute waits on ag_done, copy-out into each Param.data, record copy_out_done and keep the flat buffer as the AllGatherState. */
    hw_todo("compute waits on ag_done, copy-out into each Param.data, record copy_out_done and keep the flat buffer as the AllGatherState", "HANDOUT.md#stage-03; did stage 05 already? `make carry STAGE=06` brings your file here");
}

/* reshard: free the unsharded params; the DTensor shards stay. */
static void reshard(Fsdp *f, Group *g) {
    /* TODO(stage 01): free every unsharded Param.data of the module. */
    hw_todo("free every unsharded Param.data of the module", "HANDOUT.md#stage-01; did stage 05 already? `make carry STAGE=06` brings your file here");
}

/* Drop the ReduceScatterState: once compute has waited for the reduce-scatter
 * that read the kept input, compute's next allocation may take its block. */
static void release_reduce_scatter_state(Fsdp *f) {
    if (!f->rs_state) return;
    /* TODO(stage 04): compute waits for the reduce-scatter, then its input is freed. */
    hw_todo("compute waits for the reduce-scatter, then its input is freed", "HANDOUT.md#stage-04; did stage 05 already? `make carry STAGE=06` brings your file here");
}

/* reduce-scatter on its own stream: compute fills the chunk-cat input (row r
 * of (world, S) holds chunk r of every grad) and frees the grads; the
 * reduce-scatter stream waits for that, averages, and records rs_done.
 * The chunk-cat is one launch, a list of copies (HANDOUT.md#fused-copies). */
static void reduce_grads(Fsdp *f, Group *g) {
    Module *mod = g->mod;
    /* TODO(stage 04): chunk-cat on compute (after releasing the previous ReduceScatterState), reduce-scatter on its stream, record rs_done, keep the input as the ReduceScatterState. */
    hw_todo("chunk-cat on compute (after releasing the previous ReduceScatterState), reduce-scatter on its stream, record rs_done, keep the input as the ReduceScatterState", "HANDOUT.md#stage-04; did stage 05 already? `make carry STAGE=06` brings your file here");
}

void fsdp_pre_forward(Fsdp *f, Module *mod) {
    Group *g = mod->fsdp;
    /* TODO(stage 05): an activation-checkpoint recompute runs pre_forward inside backward: params are already unsharded, do nothing. */
    hw_todo("an activation-checkpoint recompute runs pre_forward inside backward: params are already unsharded, do nothing", "HANDOUT.md#stage-05; did stage 05 already? `make carry STAGE=06` brings your file here");
    /* TODO(stage 03): unshard (unless prefetched), wait, then prefetch the next module in forward order. */
    hw_todo("unshard (unless prefetched), wait, then prefetch the next module in forward order", "HANDOUT.md#stage-03; did stage 05 already? `make carry STAGE=06` brings your file here");
}

void fsdp_post_forward(Fsdp *f, Module *mod) {
    Group *g = mod->fsdp;
    /* TODO(stage 05): after a recompute the backward still needs the params: do not reshard. */
    hw_todo("after a recompute the backward still needs the params: do not reshard", "HANDOUT.md#stage-05; did stage 05 already? `make carry STAGE=06` brings your file here");
    /* TODO(stage 06): ZeRO-2: without reshard-after-forward the params stay unsharded until post_backward. */
    hw_todo("ZeRO-2: without reshard-after-forward the params stay unsharded until post_backward", "HANDOUT.md#stage-06");
    reshard(f, g);
    /* TODO(stage 05): the forward is done: back to IDLE. */
    hw_todo("the forward is done: back to IDLE", "HANDOUT.md#stage-05; did stage 05 already? `make carry STAGE=06` brings your file here");
}

void fsdp_pre_backward(Fsdp *f, Module *mod) {
    Group *g = mod->fsdp;
    /* TODO(stage 03): drop the forward's last AllGatherState. */
    hw_todo("drop the forward's last AllGatherState", "HANDOUT.md#stage-03; did stage 05 already? `make carry STAGE=06` brings your file here");
    /* TODO(stage 05): enter PRE_BACKWARD (once) so the recompute's forward hooks know. */
    hw_todo("enter PRE_BACKWARD (once) so the recompute's forward hooks know", "HANDOUT.md#stage-05; did stage 05 already? `make carry STAGE=06` brings your file here");
    /* TODO(stage 04): unshard (unless prefetched), wait, prefetch the module that ran forward just before. */
    hw_todo("unshard (unless prefetched), wait, prefetch the module that ran forward just before", "HANDOUT.md#stage-04; did stage 05 already? `make carry STAGE=06` brings your file here");
}

void fsdp_post_backward(Fsdp *f, Module *mod) {
    Group *g = mod->fsdp;
    /* TODO(stage 05): enter POST_BACKWARD. */
    hw_todo("enter POST_BACKWARD", "HANDOUT.md#stage-05; did stage 05 already? `make carry STAGE=06` brings your file here");
    /* TODO(stage 02): reduce-scatter this module's grads, then reshard. */
    hw_todo("reduce-scatter this module's grads, then reshard", "HANDOUT.md#stage-02; did stage 05 already? `make carry STAGE=06` brings your file here");
}

void fsdp_finish_backward(Fsdp *f) {
    /* TODO(stage 03): drop the backward's last AllGatherState before the optimizer. */
    hw_todo("drop the backward's last AllGatherState before the optimizer", "HANDOUT.md#stage-03; did stage 05 already? `make carry STAGE=06` brings your file here");
    /* TODO(stage 04): the optimizer (compute stream) must see every reduce-scatter's output. */
    hw_todo("the optimizer (compute stream) must see every reduce-scatter's output", "HANDOUT.md#stage-04; did stage 05 already? `make carry STAGE=06` brings your file here");
    /* TODO(stage 05): every module back to IDLE for the next step. */
    hw_todo("every module back to IDLE for the next step", "HANDOUT.md#stage-05; did stage 05 already? `make carry STAGE=06` brings your file here");
}

float fsdp_optimizer_step(Fsdp *f, float lr, int t) {
    /* TODO(stage 02): global grad norm = sqrt(all-reduce of local sums of squares); clip; AdamW on local rows; free the grad shards. */
    hw_todo("global grad norm = sqrt(all-reduce of local sums of squares); clip; AdamW on local rows; free the grad shards", "HANDOUT.md#stage-02; did stage 05 already? `make carry STAGE=06` brings your file here");
    /* TODO(stage 03): the next all-gathers must read the updated shards. */
    hw_todo("the next all-gathers must read the updated shards", "HANDOUT.md#stage-03; did stage 05 already? `make carry STAGE=06` brings your file here");
    /* TODO(stage 02): read the global grad norm back and return it. */
    hw_todo("read the global grad norm back and return it", "HANDOUT.md#stage-02; did stage 05 already? `make carry STAGE=06` brings your file here");
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
        if (i == 0) {
            dev_free(f->dev, f->ag_state);
            dev_free(f->dev, f->rs_state);
        }
        dev_free(f->dev, g->grad_shards);
        if (g->ag_done) dev_event_destroy(g->ag_done);
    }
    if (f->shards_ready) dev_event_destroy(f->shards_ready);
    if (f->copy_out_done) dev_event_destroy(f->copy_out_done);
    if (f->grads_ready) dev_event_destroy(f->grads_ready);
    if (f->rs_done) dev_event_destroy(f->rs_done);
    free(f->groups);
    free(f);
}
