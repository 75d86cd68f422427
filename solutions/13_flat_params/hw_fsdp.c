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
    /* BEGIN SOLUTION: the units: consecutive modules until one holds at least bucket_bytes of float32 params (0: a unit per module) (HANDOUT.md#stage-13) */
    Model *m = f->model;
    size_t bytes = 0;
    for (int i = 0; i < m->n_modules; i++) {
        if (i == 0 || bytes >= f->bucket_bytes) { /* the previous unit is full: module i opens the next */
            f->units[f->n_units++].first = i;
            bytes = 0;
        }
        Unit *u = &f->units[f->n_units - 1];
        u->last = i;
        u->n_params += m->modules[i].n_params;
        f->mods[i].unit = u;
        for (int j = 0; j < m->modules[i].n_params; j++) bytes += m->modules[i].params[j].numel * sizeof(float);
    }
    /* END SOLUTION */
}

/* Lay a unit's params out flat, shard it into W chunks of S, and make each
 * param's DTensor its piece (device.h, PLACEMENT_FLAT). */
static void shard_unit(Fsdp *f, Unit *u) {
    /* BEGIN SOLUTION: the flat layout (offsets, total, S) and the zeroed [S] shard (HANDOUT.md#stage-13) */
    Model *m = f->model;
    u->params = xmalloc((size_t)u->n_params * sizeof *u->params);
    u->offset = xmalloc((size_t)u->n_params * sizeof *u->offset);
    u->at = xmalloc((size_t)u->n_params * sizeof *u->at);
    int n = 0;
    /* No alignment padding between params: a float32 view at any element is
     * aligned for every kernel of this runtime, FSDP1 with
     * use_orig_params=False lays them out the same way (so its shards can be
     * compared element for element), and the only padding is the tail that
     * makes W x S (fewer than W elements). */
    for (int i = u->first; i <= u->last; i++)
        for (int j = 0; j < m->modules[i].n_params; j++) {
            u->params[n] = &m->modules[i].params[j];
            u->offset[n] = u->total;
            u->total += u->params[n]->numel;
            n++;
        }
    const size_t W = (size_t)f->world;
    u->S = (u->total + W - 1) / W;
    char name[64];
    snprintf(name, sizeof name, "%s.flat_param", m->modules[u->first].name);
    u->shard = dev_alloc_f32(f->dev, u->S, MEM_PARAM_SHARD, name);
    dev_memset_async(f->compute, u->shard, 0, u->S * sizeof(float)); /* the padding and gaps stay 0 */
    /* END SOLUTION */
    for (int k = 0; k < u->n_params; k++) {
        Param *p = u->params[k];
        DTensor *dt = &p->dt;
        /* BEGIN SOLUTION: describe this rank's piece of p as a Flat DTensor, DTensor.local a view into the shard (HANDOUT.md#stage-13) */
        const size_t r = (size_t)f->rank;
        /* rank r holds the param's elements [lo, hi) = flat[r*S, (r+1)*S) shifted by its offset, clamped */
        size_t lo = clamp_diff(r * u->S, u->offset[k], p->numel), hi = clamp_diff((r + 1) * u->S, u->offset[k], p->numel);
        u->at[k] = clamp_diff(u->offset[k] + lo, r * u->S, u->S);
        dt->placement = PLACEMENT_FLAT;
        dt->mesh = f->mesh;
        dt->global_rows = p->numel; /* seen as 1-D */
        dt->row_numel = 1;
        dt->row_offset = lo;
        dt->local_rows = hi - lo;
        dt->padded_rows = hi - lo;
        dt->flat_offset = u->offset[k];
        dt->flat_shard_numel = u->S;
        dt->flat_unit = u->first;
        dt->local = u->shard + u->at[k];
        /* END SOLUTION */
        /* BEGIN SOLUTION: copy this rank's piece of p into its shard, then free the full param (HANDOUT.md#stage-01) */
        if (dt->local_rows)
            dev_memcpy_async(f->compute, dt->local, p->data + dt->row_offset, dt->local_rows * sizeof(float));
        dev_free(f->dev, p->data); /* the full tensor is gone: only the shard remains */
        p->data = NULL;
        /* END SOLUTION */
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
    /* BEGIN SOLUTION: create the all-gather stream and the events that order it with compute (HANDOUT.md#stage-03) */
    f->ag_stream = dev_stream_create(f->dev, "all_gather");
    f->shards_ready = dev_event_create(f->dev, "shards_ready");
    dev_event_record(f->shards_ready, f->compute); /* the copies above wrote the shards */
    for (int u = 0; u < f->n_units; u++) {
        char name[64];
        snprintf(name, sizeof name, "%s.all_gather_done", f->model->modules[f->units[u].first].name);
        f->units[u].ag_done = dev_event_create(f->dev, name);
    }
    /* END SOLUTION */
    /* BEGIN SOLUTION: the event the all-gather stream waits for before a flat param's block goes back to its pool (HANDOUT.md#stage-13) */
    f->params_read = dev_event_create(f->dev, "params_read");
    /* END SOLUTION */
    /* BEGIN SOLUTION: create the reduce-scatter stream and its events (HANDOUT.md#stage-04) */
    f->rs_stream = dev_stream_create(f->dev, "reduce_scatter");
    f->grads_ready = dev_event_create(f->dev, "grads_ready");
    f->rs_done = dev_event_create(f->dev, "reduce_scatter_done");
    /* END SOLUTION */
    return f;
}

static Module *first_module(Fsdp *f, const Unit *u) { return &f->model->modules[u->first]; }

/* Issue u's all-gather on the all-gather stream (returns at once): every
 * rank's [S] shard into the [W*S] flat buffer, straight from the shard (it
 * is contiguous: no copy-in); record ag_done. */
static void issue_all_gather(Fsdp *f, Unit *u) {
    if (u->ag_flat || u->flat) return; /* already in flight or unsharded */
    /* BEGIN SOLUTION: all-gather the [S] shards into a [W*S] flat buffer of the all-gather stream's pool, after the shards are ready; record ag_done (HANDOUT.md#stage-13) */
    const char *label = first_module(f, u)->name;
    char name[64];
    snprintf(name, sizeof name, "%s.flat_param_unsharded", label);
    u->ag_flat = dev_alloc_f32_on(f->ag_stream, u->S * (size_t)f->world, MEM_UNSHARDED_PARAM, name);
    dev_stream_wait_event(f->ag_stream, f->shards_ready); /* read the shards only after the optimizer wrote them */
    coll_all_gather(f->dev, u->shard, u->ag_flat, u->S, f->ag_stream, label);
    dev_event_record(u->ag_done, f->ag_stream);
    /* END SOLUTION */
}

/* Make u's params usable by compute: compute waits for the all-gather, and
 * every Param.data is a view into the flat buffer (no copy-out). */
static void wait_all_gather(Fsdp *f, Unit *u) {
    if (!u->ag_flat) return;
    /* BEGIN SOLUTION: compute waits on ag_done; Param.data = flat + flat_offset (HANDOUT.md#stage-13) */
    dev_stream_wait_event(f->compute, u->ag_done);
    u->flat = u->ag_flat;
    u->ag_flat = NULL;
    for (int k = 0; k < u->n_params; k++) u->params[k]->data = u->flat + u->offset[k];
    /* END SOLUTION */
}

/* reshard: the flat buffer goes back to the all-gather stream's pool once
 * that stream has waited for compute's reads of it; the shards stay. */
static void reshard(Fsdp *f, Unit *u) {
    if (!u->flat) return;
    /* BEGIN SOLUTION: the all-gather stream waits for compute's reads, then the flat buffer is freed and Param.data dropped (HANDOUT.md#stage-13) */
    dev_event_record(f->params_read, f->compute);
    dev_stream_wait_event(f->ag_stream, f->params_read);
    dev_free(f->dev, u->flat);
    u->flat = NULL;
    for (int k = 0; k < u->n_params; k++) u->params[k]->data = NULL;
    /* END SOLUTION */
}

/* Drop the ReduceScatterState: once compute has waited for the reduce-scatter
 * that read the kept input, compute's next allocation may take its block. */
static void release_reduce_scatter_state(Fsdp *f) {
    if (!f->rs_state) return;
    /* BEGIN SOLUTION: compute waits for the reduce-scatter, then its input is freed (HANDOUT.md#stage-04) */
    dev_stream_wait_event(f->compute, f->rs_done);
    dev_free(f->dev, f->rs_state);
    f->rs_state = NULL;
    /* END SOLUTION */
}

/* The flat gradient of u's backward, before its first module (in backward
 * order) runs: [W*S] zeroed, Param.grad views into it. Per-param grads kept
 * from earlier microbatches (--grad-sync last) are copied in first, all in
 * one launch: the only copy of the grads, once per step. */
static void form_flat_grad(Fsdp *f, Unit *u) {
    if (u->flat_grad) return;
    /* BEGIN SOLUTION: a zeroed [W*S] flat gradient; the kept per-param grads copied in (one launch) and freed; Param.grad views into it (HANDOUT.md#stage-13) */
    char name[64];
    snprintf(name, sizeof name, "%s.flat_grad", first_module(f, u)->name);
    size_t n = u->S * (size_t)f->world;
    u->flat_grad = dev_alloc_f32(f->dev, n, MEM_UNSHARDED_GRAD, name);
    dev_memset_async(f->compute, u->flat_grad, 0, n * sizeof(float));
    DevCopy *cat = xmalloc((size_t)u->n_params * sizeof *cat);
    size_t ncat = 0;
    for (int k = 0; k < u->n_params; k++) {
        Param *p = u->params[k];
        if (p->grad) cat[ncat++] = (DevCopy){u->flat_grad + u->offset[k], p->grad, p->numel * sizeof(float)};
    }
    dev_memcpy_batch_async(f->compute, "grad_cat", cat, ncat); /* n == 0 (no kept grads): nothing */
    free(cat); /* the launch read the list */
    for (int k = 0; k < u->n_params; k++) {
        Param *p = u->params[k];
        dev_free(f->dev, p->grad); /* a kept per-param grad (NULL: nothing) */
        p->grad = u->flat_grad + u->offset[k];
    }
    /* END SOLUTION */
}

/* Reduce-scatter u's flat gradient as is (no chunk-cat: rank r's chunk is
 * flat[r*S, (r+1)*S), its own shard's elements) into the [S] grad shard. */
static void reduce_grads(Fsdp *f, Unit *u) {
    const char *label = first_module(f, u)->name;
    float *in = u->flat_grad; /* the reduce-scatter's input: the flat gradient as it is */
    /* BEGIN SOLUTION: release the previous ReduceScatterState; the reduce-scatter stream waits for the flat gradient (HANDOUT.md#stage-13) */
    release_reduce_scatter_state(f); /* one reduce-scatter in flight at a time bounds the comm buffers */
    u->flat_grad = NULL;
    for (int k = 0; k < u->n_params; k++) u->params[k]->grad = NULL; /* views: the buffer is the reduce-scatter's */
    dev_event_record(f->grads_ready, f->compute);
    dev_stream_wait_event(f->rs_stream, f->grads_ready);
    /* END SOLUTION */
    /* BEGIN SOLUTION: reduce-scatter into the grad shards; with --grad-sync every a later microbatch's goes to a buffer of its own and is added to what the earlier ones left (HANDOUT.md#stage-07) */
    char name[64];
    if (!u->grad_shard) {
        snprintf(name, sizeof name, "%s.grad_shards", label);
        u->grad_shard = dev_alloc_f32_on(f->rs_stream, u->S, MEM_GRAD_SHARD, name); /* the stream that fills it */
        coll_reduce_scatter(f->dev, in, u->grad_shard, u->S, RED_AVG, f->rs_stream, label);
    } else { /* FSDP2: sharded_param.grad += the new reduce-scatter output */
        snprintf(name, sizeof name, "%s.reduce_scatter_output", label);
        float *partial = dev_alloc_f32_on(f->rs_stream, u->S, MEM_COMM_BUFFER, name); /* filled and read by the rs stream */
        coll_reduce_scatter(f->dev, in, partial, u->S, RED_AVG, f->rs_stream, label);
        launch_add(f->rs_stream, u->grad_shard, u->grad_shard, partial, u->S);
        dev_free(f->dev, partial); /* its own stream's later work runs after the add */
    }
    /* END SOLUTION */
    /* BEGIN SOLUTION: record rs_done, keep the flat gradient as the ReduceScatterState, DTensor.grad as views of the grad shard (HANDOUT.md#stage-13) */
    dev_event_record(f->rs_done, f->rs_stream);
    f->rs_state = in; /* the reduce-scatter stream still reads it: kept until compute waited for rs_done */
    for (int k = 0; k < u->n_params; k++) u->params[k]->dt.grad = u->grad_shard + u->at[k];
    /* END SOLUTION */
}

void fsdp_pre_forward(Fsdp *f, Module *mod) {
    ModState *ms = mod->fsdp;
    Unit *u = ms->unit;
    /* BEGIN SOLUTION: an activation-checkpoint recompute runs pre_forward inside backward: params are already unsharded, do nothing (HANDOUT.md#stage-05) */
    if (ms->state == TS_PRE_BACKWARD) return;
    ms->state = TS_FORWARD;
    /* END SOLUTION */
    /* BEGIN SOLUTION: unshard the module's unit (unless prefetched or already unsharded for an earlier module of it), wait, prefetch the next unit (HANDOUT.md#stage-13) */
    issue_all_gather(f, u); /* no-op when prefetched, or when an earlier module of the unit unsharded it */
    wait_all_gather(f, u);
    if (u + 1 < f->units + f->n_units) issue_all_gather(f, u + 1);
    /* END SOLUTION */
}

void fsdp_post_forward(Fsdp *f, Module *mod) {
    ModState *ms = mod->fsdp;
    /* BEGIN SOLUTION: after a recompute the backward still needs the params: do not reshard (HANDOUT.md#stage-05) */
    if (ms->state == TS_PRE_BACKWARD) return;
    /* END SOLUTION */
    /* BEGIN SOLUTION: ZeRO-2: without reshard-after-forward the params stay unsharded until post_backward (HANDOUT.md#stage-06) */
    if (!f->reshard_after_forward) { /* ZeRO-2 (stage 06) */
        ms->state = TS_IDLE;
        return; /* pre_backward's unshard is then a no-op: no all-gather in backward */
    }
    /* END SOLUTION */
    /* BEGIN SOLUTION: reshard once the unit's last module ran its forward (HANDOUT.md#stage-13) */
    if (mod->index == ms->unit->last) reshard(f, ms->unit);
    /* END SOLUTION */
    /* BEGIN SOLUTION: the forward is done: back to IDLE (HANDOUT.md#stage-05) */
    ms->state = TS_IDLE;
    /* END SOLUTION */
}

void fsdp_pre_backward(Fsdp *f, Module *mod) {
    ModState *ms = mod->fsdp;
    Unit *u = ms->unit;
    /* BEGIN SOLUTION: enter PRE_BACKWARD (once) so the recompute's forward hooks know (HANDOUT.md#stage-05) */
    if (ms->state == TS_PRE_BACKWARD) return;
    ms->state = TS_PRE_BACKWARD;
    /* END SOLUTION */
    /* BEGIN SOLUTION: unshard the unit (unless prefetched or unsharded), wait, prefetch the unit that ran forward just before (HANDOUT.md#stage-13) */
    issue_all_gather(f, u);
    wait_all_gather(f, u);
    if (u > f->units) issue_all_gather(f, u - 1);
    /* END SOLUTION */
    /* BEGIN SOLUTION: a backward that syncs writes its grads into the unit's flat gradient (formed when the unit's backward starts) (HANDOUT.md#stage-13) */
    if (mod->requires_gradient_sync) form_flat_grad(f, u);
    /* END SOLUTION */
}

void fsdp_post_backward(Fsdp *f, Module *mod) {
    ModState *ms = mod->fsdp;
    Unit *u = ms->unit;
    /* BEGIN SOLUTION: enter POST_BACKWARD (HANDOUT.md#stage-05) */
    ms->state = TS_POST_BACKWARD;
    /* END SOLUTION */
    /* BEGIN SOLUTION: a unit reduces and reshards once its first module's backward ran (the last of the unit's) (HANDOUT.md#stage-13) */
    if (mod->index != u->first) return; /* the unit's other modules: their grads are views the unit reduces later */
    /* END SOLUTION */
    /* BEGIN SOLUTION: without gradient sync keep Param.grad for the next microbatch and reduce nothing; reshard only when reshard_after_backward says so (HANDOUT.md#stage-07) */
    if (!mod->requires_gradient_sync) {
        if (mod->reshard_after_backward) reshard(f, u);
        return; /* the loop keeps Param.grad: the next backward adds to it */
    }
    reduce_grads(f, u);
    if (!mod->reshard_after_backward) return; /* the next microbatch's forward finds them unsharded */
    /* END SOLUTION */
    /* BEGIN SOLUTION: reshard after the backward (HANDOUT.md#stage-02) */
    reshard(f, u);
    /* END SOLUTION */
}

void fsdp_finish_backward(Fsdp *f) {
    /* BEGIN SOLUTION: the optimizer (compute stream) must see every reduce-scatter's output (HANDOUT.md#stage-04) */
    release_reduce_scatter_state(f);
    /* END SOLUTION */
    /* BEGIN SOLUTION: every module back to IDLE for the next step (HANDOUT.md#stage-05) */
    for (int i = 0; i < f->model->n_modules; i++) f->mods[i].state = TS_IDLE;
    /* END SOLUTION */
}

float fsdp_optimizer_step(Fsdp *f, float lr, int t) {
    /* BEGIN SOLUTION: global grad norm = sqrt(all-reduce of the units' [S] grad shards' sums of squares: the padding adds 0); clip; one AdamW per unit on its [S] shard, state created (or found restored) as [S] with DTensor views; free the grad shards (HANDOUT.md#stage-13) */
    float *sumsq = dev_alloc_f32(f->dev, 1, MEM_TEMP, "grad_norm.sumsq");
    dev_memset_async(f->compute, sumsq, 0, sizeof(float));
    for (int i = 0; i < f->n_units; i++) launch_sumsq_accumulate(f->compute, sumsq, f->units[i].grad_shard, f->units[i].S);
    coll_all_reduce(f->dev, sumsq, sumsq, 1, RED_SUM, f->compute, "grad_norm");
    for (int i = 0; i < f->n_units; i++) {
        Unit *u = &f->units[i];
        if (!u->exp_avg) {
            DTensor *dt0 = &u->params[0]->dt;
            if (dt0->exp_avg) { /* --load: the runtime restored one [S] allocation per unit, DTensor views into it */
                u->exp_avg = dt0->exp_avg - u->at[0];
                u->exp_avg_sq = dt0->exp_avg_sq - u->at[0];
            } else { /* created at the first step, [S] like the shard */
                char name[64];
                snprintf(name, sizeof name, "%s.flat_exp_avg", first_module(f, u)->name);
                u->exp_avg = dev_alloc_f32(f->dev, u->S, MEM_OPTIM_STATE, name);
                snprintf(name, sizeof name, "%s.flat_exp_avg_sq", first_module(f, u)->name);
                u->exp_avg_sq = dev_alloc_f32(f->dev, u->S, MEM_OPTIM_STATE, name);
                dev_memset_async(f->compute, u->exp_avg, 0, u->S * sizeof(float));
                dev_memset_async(f->compute, u->exp_avg_sq, 0, u->S * sizeof(float));
                for (int k = 0; k < u->n_params; k++) {
                    u->params[k]->dt.exp_avg = u->exp_avg + u->at[k];
                    u->params[k]->dt.exp_avg_sq = u->exp_avg_sq + u->at[k];
                }
            }
        }
        launch_adamw(f->compute, u->shard, u->grad_shard, u->exp_avg, u->exp_avg_sq, u->S, &f->optim, lr, t, sumsq);
        for (int k = 0; k < u->n_params; k++) u->params[k]->dt.grad = NULL;
        dev_free(f->dev, u->grad_shard); /* zero_grad(set_to_none=True) */
        u->grad_shard = NULL;
    }
    /* END SOLUTION */
    /* BEGIN SOLUTION: the next all-gathers must read the updated shards (HANDOUT.md#stage-03) */
    dev_event_record(f->shards_ready, f->compute);
    /* END SOLUTION */
    /* BEGIN SOLUTION: read the global grad norm back and return it (HANDOUT.md#stage-02) */
    float host_sumsq = 0;
    dev_memcpy_async(f->compute, &host_sumsq, sumsq, sizeof(float));
    dev_stream_synchronize(f->compute);
    dev_free(f->dev, sumsq);
    return sqrtf(host_sumsq);
    /* END SOLUTION */
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
