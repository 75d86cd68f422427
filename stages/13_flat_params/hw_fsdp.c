/* STARTER for stage 13 — it stubs every stage up to 13: each TODO(stage NN) below stops
 * the run until you fill it (see HANDOUT.md#stage-NN). If you did the earlier stages, do not
 * start here: run `make carry STAGE=13`, which carries your own file into this stage and
 * lists what stage 13 adds. Starting from scratch, fill the TODOs stage by stage from
 * stage 01. Generated from the instructors' solution by tools/make_starters.py. */
/* hw_fsdp.c — stage 13: flat parameters and buckets (FSDP1's FlatParameter).
 *
 * Stage 07 (gradient accumulation) with FSDP1's layout in place of FSDP2's
 * per-parameter Shard(0). A flat unit is one module, or with --bucket-mb B a
 * run of consecutive modules that holds at least B x 2^20 bytes of float32
 * params (FsdpConfig.bucket_bytes). Its params lie one after another in one
 * 1-D buffer of `total` elements, padded to W x S (S = ceil(total / W)), and
 * rank r owns flat[r*S, (r+1)*S) (device.h, PLACEMENT_FLAT):
 *
 *   flat:   [ p0 ........ | p1 ... | p2 ............. |pad]     total -> W*S
 *   ranks:  [   r0: S   ][   r1: S   ][   r2: S   ][   r3: S   ]
 *
 * so a rank's shard may hold the tail of one param and the head of the next.
 *   - all-gather: the [S] shards straight into the [W*S] flat buffer (no
 *     copy-in: the shard is already contiguous); Param.data are views into it
 *     (no copy-out);
 *   - backward: Param.grad are views into a [W*S] flat gradient, zeroed by
 *     us, which the reduce-scatter reads as is (no chunk-cat). With
 *     --grad-sync last the microbatches before the last keep per-param grads
 *     (the runtime allocates them) and the last one forms the flat gradient
 *     once: one batched copy per unit and step (the "cat only on the last
 *     microbatch");
 *   - optimizer: one AdamW launch per unit on its [S] shard (AdamW and the
 *     weight decay are element-wise and the same for every element; the
 *     padding stays 0 because its param, grad and moments are 0).
 *
 * Streams: compute, all_gather, reduce_scatter. A unit's collectives are
 * labelled with its first module's name.
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

/* One flat unit: modules first..last, their params in one flat buffer. */
typedef struct {
    int first, last;      /* Module.index of its first and last module */
    int n_params;
    Param **params;       /* [n_params] in flat order */
    size_t *offset;       /* [n_params] flat_offset: param k is flat[offset[k], offset[k] + numel) */
    size_t *at;           /* [n_params] where this rank's piece of param k sits in the [S] shard */
    size_t total;         /* elements of all its params (the flat size before padding) */
    size_t S;             /* flat_shard_numel: ceil(total / W) */
    float *shard;         /* [S] this rank's flat[r*S, (r+1)*S); DTensor.local are views */
    float *flat;          /* [W*S] the unsharded flat param while unsharded; Param.data are views */
    float *ag_flat;       /* [W*S] the all-gather output while in flight */
    Event *ag_done;       /* recorded on the all-gather stream after the all-gather */
    float *flat_grad;     /* [W*S] the flat gradient of this backward; Param.grad are views */
    float *grad_shard;    /* [S] reduce-scatter output; DTensor.grad are views */
    float *exp_avg, *exp_avg_sq; /* [S] AdamW state; DTensor.exp_avg/exp_avg_sq are views */
} Unit;

/* Per module: its unit and its training state (mod->fsdp). */
typedef struct {
    Unit *unit;
    TrainingState state;
} ModState;

struct Fsdp {
    Dev *dev;
    Model *model;
    const DeviceMesh *mesh;
    int rank, world;
    Stream *compute, *ag_stream, *rs_stream;
    Event *shards_ready;  /* compute: the shards were last written (init, optimizer) */
    Event *params_read;   /* compute: the latest reads of a flat buffer about to be freed were queued */
    Event *grads_ready;   /* compute: a reduce-scatter input is filled */
    Event *rs_done;       /* reduce_scatter stream: the latest reduce-scatter finished */
    /* FSDP2's ReduceScatterState: the latest reduce-scatter input (a flat
     * gradient, a block of compute's pool), kept alive until compute has
     * waited for rs_done. */
    float *rs_state;
    int reshard_after_forward; /* 0: ZeRO-2, keep params unsharded from forward to backward */
    AdamWConfig optim;
    size_t bucket_bytes;
    int n_units;
    Unit *units;          /* [n_units] in forward order */
    ModState *mods;       /* [n_modules] */
};

/* clamp(a - b, 0, hi) in size_t */
static size_t clamp_diff(size_t a, size_t b, size_t hi) { return a <= b ? 0 : (a - b < hi ? a - b : hi); }

/* The units: consecutive modules until one holds at least bucket_bytes of
 * float32 params (0: a unit per module); the last may hold less. */
static void plan_units(Fsdp *f) {
    /* TODO(stage 13): the units: consecutive modules until one holds at least bucket_bytes of float32 params (0: a unit per module). */
    hw_todo("the units: consecutive modules until one holds at least bucket_bytes of float32 params (0: a unit per module)", "HANDOUT.md#stage-13");
}

/* Lay a unit's params out flat, shard it into W chunks of S, and make each
 * param's DTensor its piece (device.h, PLACEMENT_FLAT). */
static void shard_unit(Fsdp *f, Unit *u) {
    /* TODO(stage 13): the flat layout (offsets, total, S) and the zeroed [S] shard. */
    hw_todo("the flat layout (offsets, total, S) and the zeroed [S] shard", "HANDOUT.md#stage-13");
    for (int k = 0; k < u->n_params; k++) {
        Param *p = u->params[k];
        DTensor *dt = &p->dt;
        /* TODO(stage 13): describe this rank's piece of p as a Flat DTensor, DTensor.local a view into the shard. */
        hw_todo("describe this rank's piece of p as a Flat DTensor, DTensor.local a view into the shard", "HANDOUT.md#stage-13");
        /* TODO(stage 01): copy this rank's piece of p into its shard, then free the full param. */
        hw_todo("copy this rank's piece of p into its shard, then free the full param", "HANDOUT.md#stage-01; did stage 07 already? `make carry STAGE=13` brings your file here");
    }
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
    f->bucket_bytes = cfg->bucket_bytes;
    f->units = xcalloc((size_t)f->model->n_modules, sizeof(Unit));
    f->mods = xcalloc((size_t)f->model->n_modules, sizeof(ModState));
    for (int i = 0; i < f->model->n_modules; i++) f->model->modules[i].fsdp = &f->mods[i];
    plan_units(f);
    for (int u = 0; u < f->n_units; u++) shard_unit(f, &f->units[u]);
    /* TODO(stage 03): create the all-gather stream and the events that order it with compute. */
    hw_todo("create the all-gather stream and the events that order it with compute", "HANDOUT.md#stage-03; did stage 07 already? `make carry STAGE=13` brings your file here");
    /* TODO(stage 13): the event the all-gather stream waits for before a flat param's block goes back to its pool. */
    hw_todo("the event the all-gather stream waits for before a flat param's block goes back to its pool", "HANDOUT.md#stage-13");
    /* TODO(stage 04): create the reduce-scatter stream and its events. */
    hw_todo("create the reduce-scatter stream and its events", "HANDOUT.md#stage-04; did stage 07 already? `make carry STAGE=13` brings your file here");
    return f;
}

static Module *first_module(Fsdp *f, const Unit *u) { return &f->model->modules[u->first]; }

/* Issue u's all-gather on the all-gather stream (returns at once): every
 * rank's [S] shard into the [W*S] flat buffer, straight from the shard (it
 * is contiguous: no copy-in); record ag_done. */
static void issue_all_gather(Fsdp *f, Unit *u) {
    if (u->ag_flat || u->flat) return; /* already in flight or unsharded */
    /* TODO(stage 13): all-gather the [S] shards into a [W*S] flat buffer of the all-gather stream's pool, after the shards are ready; record ag_done. */
    hw_todo("all-gather the [S] shards into a [W*S] flat buffer of the all-gather stream's pool, after the shards are ready; record ag_done", "HANDOUT.md#stage-13");
}

/* Make u's params usable by compute: compute waits for the all-gather, and
 * every Param.data is a view into the flat buffer (no copy-out). */
static void wait_all_gather(Fsdp *f, Unit *u) {
    if (!u->ag_flat) return;
    /* TODO(stage 13): compute waits on ag_done; Param.data = flat + flat_offset. */
    hw_todo("compute waits on ag_done; Param.data = flat + flat_offset", "HANDOUT.md#stage-13");
}

/* reshard: the flat buffer goes back to the all-gather stream's pool once
 * that stream has waited for compute's reads of it; the shards stay. */
static void reshard(Fsdp *f, Unit *u) {
    if (!u->flat) return;
    /* TODO(stage 13): the all-gather stream waits for compute's reads, then the flat buffer is freed and Param.data dropped. */
    hw_todo("the all-gather stream waits for compute's reads, then the flat buffer is freed and Param.data dropped", "HANDOUT.md#stage-13");
}

/* Drop the ReduceScatterState: once compute has waited for the reduce-scatter
 * that read the kept input, compute's next allocation may take its block. */
static void release_reduce_scatter_state(Fsdp *f) {
    if (!f->rs_state) return;
    /* TODO(stage 04): compute waits for the reduce-scatter, then its input is freed. */
    hw_todo("compute waits for the reduce-scatter, then its input is freed", "HANDOUT.md#stage-04; did stage 07 already? `make carry STAGE=13` brings your file here");
}

/* The flat gradient of u's backward, before its first module (in backward
 * order) runs: [W*S] zeroed, Param.grad views into it. Per-param grads kept
 * from earlier microbatches (--grad-sync last) are copied in first, all in
 * one launch: the only copy of the grads, once per step. */
static void form_flat_grad(Fsdp *f, Unit *u) {
    if (u->flat_grad) return;
    /* TODO(stage 13): a zeroed [W*S] flat gradient; the kept per-param grads copied in (one launch) and freed; Param.grad views into it. */
    hw_todo("a zeroed [W*S] flat gradient; the kept per-param grads copied in (one launch) and freed; Param.grad views into it", "HANDOUT.md#stage-13");
}

/* Reduce-scatter u's flat gradient as is (no chunk-cat: rank r's chunk is
 * flat[r*S, (r+1)*S), its own shard's elements) into the [S] grad shard. */
static void reduce_grads(Fsdp *f, Unit *u) {
    const char *label = first_module(f, u)->name;
    float *in = u->flat_grad; /* the reduce-scatter's input: the flat gradient as it is */
    /* TODO(stage 13): release the previous ReduceScatterState; the reduce-scatter stream waits for the flat gradient. */
    hw_todo("release the previous ReduceScatterState; the reduce-scatter stream waits for the flat gradient", "HANDOUT.md#stage-13");
    /* TODO(stage 07): reduce-scatter into the grad shards; with --grad-sync every a later microbatch's goes to a buffer of its own and is added to what the earlier ones left. */
    hw_todo("reduce-scatter into the grad shards; with --grad-sync every a later microbatch's goes to a buffer of its own and is added to what the earlier ones left", "HANDOUT.md#stage-07; did stage 07 already? `make carry STAGE=13` brings your file here");
    /* TODO(stage 13): record rs_done, keep the flat gradient as the ReduceScatterState, DTensor.grad as views of the grad shard. */
    hw_todo("record rs_done, keep the flat gradient as the ReduceScatterState, DTensor.grad as views of the grad shard", "HANDOUT.md#stage-13");
}

void fsdp_pre_forward(Fsdp *f, Module *mod) {
    ModState *ms = mod->fsdp;
    Unit *u = ms->unit;
    /* TODO(stage 05): an activation-checkpoint recompute runs pre_forward inside backward: params are already unsharded, do nothing. */
    hw_todo("an activation-checkpoint recompute runs pre_forward inside backward: params are already unsharded, do nothing", "HANDOUT.md#stage-05; did stage 07 already? `make carry STAGE=13` brings your file here");
    /* TODO(stage 13): unshard the module's unit (unless prefetched or already unsharded for an earlier module of it), wait, prefetch the next unit. */
    hw_todo("unshard the module's unit (unless prefetched or already unsharded for an earlier module of it), wait, prefetch the next unit", "HANDOUT.md#stage-13");
}

void fsdp_post_forward(Fsdp *f, Module *mod) {
    ModState *ms = mod->fsdp;
    /* TODO(stage 05): after a recompute the backward still needs the params: do not reshard. */
    hw_todo("after a recompute the backward still needs the params: do not reshard", "HANDOUT.md#stage-05; did stage 07 already? `make carry STAGE=13` brings your file here");
    /* TODO(stage 06): ZeRO-2: without reshard-after-forward the params stay unsharded until post_backward. */
    hw_todo("ZeRO-2: without reshard-after-forward the params stay unsharded until post_backward", "HANDOUT.md#stage-06; did stage 07 already? `make carry STAGE=13` brings your file here");
    /* TODO(stage 13): reshard once the unit's last module ran its forward. */
    hw_todo("reshard once the unit's last module ran its forward", "HANDOUT.md#stage-13");
    /* TODO(stage 05): the forward is done: back to IDLE. */
    hw_todo("the forward is done: back to IDLE", "HANDOUT.md#stage-05; did stage 07 already? `make carry STAGE=13` brings your file here");
}

void fsdp_pre_backward(Fsdp *f, Module *mod) {
    ModState *ms = mod->fsdp;
    Unit *u = ms->unit;
    /* TODO(stage 05): enter PRE_BACKWARD (once) so the recompute's forward hooks know. */
    hw_todo("enter PRE_BACKWARD (once) so the recompute's forward hooks know", "HANDOUT.md#stage-05; did stage 07 already? `make carry STAGE=13` brings your file here");
    /* TODO(stage 13): unshard the unit (unless prefetched or unsharded), wait, prefetch the unit that ran forward just before. */
    hw_todo("unshard the unit (unless prefetched or unsharded), wait, prefetch the unit that ran forward just before", "HANDOUT.md#stage-13");
    /* TODO(stage 13): a backward that syncs writes its grads into the unit's flat gradient (formed when the unit's backward starts). */
    hw_todo("a backward that syncs writes its grads into the unit's flat gradient (formed when the unit's backward starts)", "HANDOUT.md#stage-13");
}

void fsdp_post_backward(Fsdp *f, Module *mod) {
    ModState *ms = mod->fsdp;
    Unit *u = ms->unit;
    /* TODO(stage 05): enter POST_BACKWARD. */
    hw_todo("enter POST_BACKWARD", "HANDOUT.md#stage-05; did stage 07 already? `make carry STAGE=13` brings your file here");
    /* TODO(stage 13): a unit reduces and reshards once its first module's backward ran (the last of the unit's). */
    hw_todo("a unit reduces and reshards once its first module's backward ran (the last of the unit's)", "HANDOUT.md#stage-13");
    /* TODO(stage 07): without gradient sync keep Param.grad for the next microbatch and reduce nothing; reshard only when reshard_after_backward says so. */
    hw_todo("without gradient sync keep Param.grad for the next microbatch and reduce nothing; reshard only when reshard_after_backward says so", "HANDOUT.md#stage-07; did stage 07 already? `make carry STAGE=13` brings your file here");
    /* TODO(stage 02): reshard after the backward. */
    hw_todo("reshard after the backward", "HANDOUT.md#stage-02; did stage 07 already? `make carry STAGE=13` brings your file here");
}

void fsdp_finish_backward(Fsdp *f) {
    /* TODO(stage 04): the optimizer (compute stream) must see every reduce-scatter's output. */
    hw_todo("the optimizer (compute stream) must see every reduce-scatter's output", "HANDOUT.md#stage-04; did stage 07 already? `make carry STAGE=13` brings your file here");
    /* TODO(stage 05): every module back to IDLE for the next step. */
    hw_todo("every module back to IDLE for the next step", "HANDOUT.md#stage-05; did stage 07 already? `make carry STAGE=13` brings your file here");
}

float fsdp_optimizer_step(Fsdp *f, float lr, int t) {
    /* TODO(stage 13): global grad norm = sqrt(all-reduce of the units' [S] grad shards' sums of squares: the padding adds 0); clip; one AdamW per unit on its [S] shard, state created (or found restored) as [S] with DTensor views; free the grad shards. */
    hw_todo("global grad norm = sqrt(all-reduce of the units' [S] grad shards' sums of squares: the padding adds 0); clip; one AdamW per unit on its [S] shard, state created (or found restored) as [S] with DTensor views; free the grad shards", "HANDOUT.md#stage-13");
    /* TODO(stage 03): the next all-gathers must read the updated shards. */
    hw_todo("the next all-gathers must read the updated shards", "HANDOUT.md#stage-03; did stage 07 already? `make carry STAGE=13` brings your file here");
    /* TODO(stage 02): read the global grad norm back and return it. */
    hw_todo("read the global grad norm back and return it", "HANDOUT.md#stage-02; did stage 07 already? `make carry STAGE=13` brings your file here");
}

void fsdp_destroy(Fsdp *f) {
    dev_synchronize(f->dev);
    for (int i = 0; i < f->n_units; i++) {
        Unit *u = &f->units[i];
        if (!u->exp_avg && u->params[0]->dt.exp_avg) { /* restored by --load, never stepped */
            u->exp_avg = u->params[0]->dt.exp_avg - u->at[0];
            u->exp_avg_sq = u->params[0]->dt.exp_avg_sq - u->at[0];
        }
        dev_free(f->dev, u->flat);
        dev_free(f->dev, u->ag_flat);
        dev_free(f->dev, u->flat_grad);
        dev_free(f->dev, u->grad_shard);
        dev_free(f->dev, u->shard);
        dev_free(f->dev, u->exp_avg);
        dev_free(f->dev, u->exp_avg_sq);
        for (int k = 0; k < u->n_params; k++) { /* views: nothing of theirs to free */
            Param *p = u->params[k];
            p->data = p->grad = p->dt.local = p->dt.grad = p->dt.exp_avg = p->dt.exp_avg_sq = NULL;
        }
        if (u->ag_done) dev_event_destroy(u->ag_done);
        free(u->params);
        free(u->offset);
        free(u->at);
    }
    dev_free(f->dev, f->rs_state);
    if (f->shards_ready) dev_event_destroy(f->shards_ready);
    if (f->params_read) dev_event_destroy(f->params_read);
    if (f->grads_ready) dev_event_destroy(f->grads_ready);
    if (f->rs_done) dev_event_destroy(f->rs_done);
    free(f->units);
    free(f->mods);
    free(f);
}
