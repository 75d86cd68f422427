/* hw_fsdp.c — stage 11: pipeline parallelism (--pp P, hw_pipe.h).
 *
 * Stage 07's FSDP on the stage's own modules, split over the stage's shard
 * group (FsdpConfig.mesh->shard_group, as stage 09 splits over a mesh row;
 * one rank in stage 11), plus the schedule: pipe_schedule runs the step's
 * microbatches through this stage and passes activations forward and their
 * grads back with dev_send / dev_recv. The runtime sets every module's
 * requires_gradient_sync and reshard_after_backward to 1 when the step
 * starts and never changes them (hw_pipe.h), so here every backward
 * reduce-scatters and stage 07's code adds each microbatch's grads into the
 * grad shards; stage 12's schedule clears them before all but the last.
 *   gpipe: every forward, then the backwards in microbatch order B0 ..
 *     B(M-1), as torch's ScheduleGPipe runs them (the grader compares the
 *     order pass by pass); the first stage holds all M microbatches'
 *     activations at once;
 *   1f1b: P-1-p warm-up forwards on stage p, then one forward and one
 *     backward in turn, then the cool-down backwards (at most P held).
 * The grad norm spans every stage: each stage holds different parameters.
 *
 * Streams: compute (module compute and the point-to-point transfers),
 * all_gather (copy-in + all-gather), reduce_scatter.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hw_fsdp.h"
#include "hw_pipe.h"

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
    float *ag_flat;       /* [nshards * shard_numel] all-gather output while in flight */
    Event *ag_done;       /* recorded on the all-gather stream after the all-gather */
    float *grad_shards;   /* [shard_numel] reduce-scatter output; DTensor.grad are views */
} Group;

struct Fsdp {
    Dev *dev;
    Model *model;
    const DeviceMesh *mesh;
    ProcessGroup *shard_pg;     /* the ranks a param is split over: the mesh's row (the world when 1-D) */
    int srank, nshards;         /* this rank's place in shard_pg, and its size */
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

/* Rows of a dim-0 split over n ranks that rank r (of n) owns: torch.chunk gives
 * every rank ceil(rows / n) rows until they run out (5 rows, 4 ranks: 2, 2, 1, 0). */
static size_t chunk_rows(size_t rows, int n) { return (rows + (size_t)n - 1) / (size_t)n; }
static size_t rows_of_rank(size_t rows, int n, int r) {
    size_t chunk = chunk_rows(rows, n), start = chunk * (size_t)r;
    return start >= rows ? 0 : (rows - start < chunk ? rows - start : chunk);
}

Fsdp *fsdp_init(const FsdpConfig *cfg) {
    Fsdp *f = xcalloc(1, sizeof *f);
    f->dev = cfg->dev;
    f->model = cfg->model;
    f->mesh = cfg->mesh;
    /* BEGIN SOLUTION: split over the shard group: its size and this rank's place in it (with --pp, the stage's ranks) (HANDOUT.md#stage-09) */
    f->shard_pg = cfg->mesh->shard_group;
    f->srank = pg_rank(f->shard_pg);
    f->nshards = pg_size(f->shard_pg);
    /* END SOLUTION */
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
            /* BEGIN SOLUTION: shard p into a DTensor: Shard(0) over the shard group (nshards, srank), torch.chunk rows, padded local storage (HANDOUT.md#stage-01) */
            dt->global_rows = p->shape[0];
            dt->row_numel = p->numel / p->shape[0];
            dt->padded_rows = chunk_rows(p->shape[0], f->nshards);
            dt->local_rows = rows_of_rank(p->shape[0], f->nshards, f->srank);
            /* a rank with no rows starts at the end (device.h, DTensor.row_offset) */
            dt->row_offset = dt->local_rows ? dt->padded_rows * (size_t)f->srank : p->shape[0];
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
    /* BEGIN SOLUTION: create the all-gather stream and the events that order it with compute (HANDOUT.md#stage-03) */
    f->ag_stream = dev_stream_create(f->dev, "all_gather");
    f->shards_ready = dev_event_create(f->dev, "shards_ready");
    f->copy_out_done = dev_event_create(f->dev, "copy_out_done");
    dev_event_record(f->shards_ready, f->compute); /* the copies above wrote the shards */
    for (int i = 0; i < f->model->n_modules; i++) {
        char name[64];
        snprintf(name, sizeof name, "%s.all_gather_done", f->model->modules[i].name);
        f->groups[i].ag_done = dev_event_create(f->dev, name);
    }
    /* END SOLUTION */
    /* BEGIN SOLUTION: create the reduce-scatter stream and its events (HANDOUT.md#stage-04) */
    f->rs_stream = dev_stream_create(f->dev, "reduce_scatter");
    f->grads_ready = dev_event_create(f->dev, "grads_ready");
    f->rs_done = dev_event_create(f->dev, "reduce_scatter_done");
    /* END SOLUTION */
    return f;
}

static int is_unsharded(const Group *g) { return g->mod->params[0].data != NULL; }

/* Drop the AllGatherState: once the all-gather stream has waited for the
 * copy-out that read the kept output, its later work runs after that read,
 * so its next allocation may take the block. */
static void release_all_gather_state(Fsdp *f) {
    if (!f->ag_state) return;
    /* BEGIN SOLUTION: the all-gather stream waits for the copy-out, then the kept output is freed (HANDOUT.md#stage-03) */
    dev_stream_wait_event(f->ag_stream, f->copy_out_done);
    dev_free(f->dev, f->ag_state);
    f->ag_state = NULL;
    /* END SOLUTION */
}

/* Issue g's all-gather on the all-gather stream (returns at once): copy-in
 * this rank's padded shards into its segment of the flat output, all-gather
 * in place, record ag_done. The output is [r0: p0|p1|..][r1: p0|p1|..]..
 * The copy-in is one launch, a list of copies (HANDOUT.md#fused-copies). */
static void issue_all_gather(Fsdp *f, Group *g) {
    if (g->ag_flat || is_unsharded(g)) return; /* already in flight or done */
    Module *mod = g->mod;
    /* BEGIN SOLUTION: copy-in on the all-gather stream into this rank's segment of the shard group's output, after the shards are ready (HANDOUT.md#stage-03) */
    size_t S = g->shard_numel;
    char name[64];
    snprintf(name, sizeof name, "%s.all_gather_buffer", mod->name);
    release_all_gather_state(f); /* before the allocation: its block may serve this one */
    g->ag_flat = dev_alloc_f32_on(f->ag_stream, S * (size_t)f->nshards, MEM_COMM_BUFFER, name); /* the stream that fills it */
    float *mine = g->ag_flat + (size_t)f->srank * S;
    dev_stream_wait_event(f->ag_stream, f->shards_ready); /* read the shards only after the optimizer wrote them */
    DevCopy in[MODULE_MAX_PARAMS]; /* FSDP2's foreach copy-in: every shard, one launch */
    for (int j = 0; j < mod->n_params; j++) {
        DTensor *dt = &mod->params[j].dt;
        in[j] = (DevCopy){mine + g->offsets[j], dt->local, dt->padded_rows * dt->row_numel * sizeof(float)};
    }
    dev_memcpy_batch_async(f->ag_stream, "copy_in", in, (size_t)mod->n_params);
    /* END SOLUTION */
    /* BEGIN SOLUTION: all-gather the module's segments inside the shard group (HANDOUT.md#stage-09) */
    pg_all_gather(f->shard_pg, mine, g->ag_flat, S, f->ag_stream, mod->name);
    /* END SOLUTION */
    /* BEGIN SOLUTION: record ag_done (HANDOUT.md#stage-03) */
    dev_event_record(g->ag_done, f->ag_stream);
    /* END SOLUTION */
}

/* Make g's params usable by compute: the compute stream waits for the
 * all-gather, then copies each param's rows out of every rank's segment.
 * One launch for all of them: at world 64 a block's 9 params are 576 copies. */
static void wait_all_gather(Fsdp *f, Group *g) {
    if (!g->ag_flat) return;
    Module *mod = g->mod;
    /* BEGIN SOLUTION: compute waits on ag_done, copy-out of every shard-group rank's rows into each Param.data, record copy_out_done and keep the flat buffer as the AllGatherState (HANDOUT.md#stage-03) */
    size_t S = g->shard_numel;
    dev_stream_wait_event(f->compute, g->ag_done);
    /* FSDP2's split_with_sizes_copy: one launch of params x ranks copies (up to 16384 ranks) */
    DevCopy *out = xmalloc((size_t)mod->n_params * (size_t)f->nshards * sizeof *out);
    size_t nout = 0;
    for (int j = 0; j < mod->n_params; j++) {
        Param *p = &mod->params[j];
        size_t chunk = p->dt.padded_rows, rn = p->dt.row_numel;
        p->data = dev_alloc_f32(f->dev, p->numel, MEM_UNSHARDED_PARAM, p->name);
        for (int r = 0; r < f->nshards; r++) {
            size_t rows = rows_of_rank(p->shape[0], f->nshards, r);
            if (rows)
                out[nout++] = (DevCopy){p->data + chunk * (size_t)r * rn, g->ag_flat + (size_t)r * S + g->offsets[j],
                                        rows * rn * sizeof(float)};
        }
    }
    dev_memcpy_batch_async(f->compute, "copy_out", out, nout);
    free(out); /* the launch read the list */
    dev_event_record(f->copy_out_done, f->compute);
    f->ag_state = g->ag_flat; /* kept until the all-gather stream waited for the copy-out */
    g->ag_flat = NULL;
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

/* reduce-scatter on its own stream: compute fills the chunk-cat input (row r
 * of (nshards, S) holds chunk r of every grad) and frees the grads; the
 * reduce-scatter stream waits for that, averages over the shard group, and
 * records rs_done.
 * The chunk-cat is one launch, a list of copies (HANDOUT.md#fused-copies). */
static void reduce_grads(Fsdp *f, Group *g) {
    /* BEGIN SOLUTION: chunk-cat the grads over the shard group on compute (after releasing the previous ReduceScatterState) and free them; the reduce-scatter stream waits for the input (HANDOUT.md#stage-04) */
    Module *mod = g->mod;
    size_t S = g->shard_numel;
    char name[64];
    /* one reduce-scatter in flight at a time bounds the comm buffers (FSDP2 does the same);
     * the previous one's input goes once compute has waited for it */
    release_reduce_scatter_state(f);
    snprintf(name, sizeof name, "%s.reduce_scatter_input", mod->name);
    float *in = dev_alloc_f32(f->dev, S * (size_t)f->nshards, MEM_COMM_BUFFER, name);
    dev_memset_async(f->compute, in, 0, S * (size_t)f->nshards * sizeof(float));
    /* FSDP2's chunk_cat: one launch of params x ranks copies (a dry run's world: up to 16384) */
    DevCopy *cat = xmalloc((size_t)mod->n_params * (size_t)f->nshards * sizeof *cat);
    size_t ncat = 0;
    for (int j = 0; j < mod->n_params; j++) {
        Param *p = &mod->params[j];
        size_t chunk = p->dt.padded_rows, rn = p->dt.row_numel;
        for (int r = 0; r < f->nshards; r++) {
            size_t rows = rows_of_rank(p->shape[0], f->nshards, r);
            if (rows)
                cat[ncat++] = (DevCopy){in + (size_t)r * S + g->offsets[j], p->grad + chunk * (size_t)r * rn,
                                        rows * rn * sizeof(float)};
        }
    }
    dev_memcpy_batch_async(f->compute, "chunk_cat", cat, ncat);
    free(cat); /* the launch read the list */
    for (int j = 0; j < mod->n_params; j++) { /* the unsharded grads are not needed any more */
        dev_free(f->dev, mod->params[j].grad);
        mod->params[j].grad = NULL;
    }
    dev_event_record(f->grads_ready, f->compute);
    dev_stream_wait_event(f->rs_stream, f->grads_ready);
    /* END SOLUTION */
    /* BEGIN SOLUTION: reduce-scatter into the grad shards inside the shard group; with --grad-sync every a later microbatch's goes to a buffer of its own and is added to what the earlier ones left (HANDOUT.md#stage-07) */
    if (!g->grad_shards) {
        snprintf(name, sizeof name, "%s.grad_shards", mod->name);
        g->grad_shards = dev_alloc_f32_on(f->rs_stream, S, MEM_GRAD_SHARD, name); /* the stream that fills it */
        pg_reduce_scatter(f->shard_pg, in, g->grad_shards, S, RED_AVG, f->rs_stream, mod->name);
    } else { /* FSDP2: sharded_param.grad += the new reduce-scatter output */
        snprintf(name, sizeof name, "%s.reduce_scatter_output", mod->name);
        float *partial = dev_alloc_f32_on(f->rs_stream, S, MEM_COMM_BUFFER, name); /* filled and read by the rs stream */
        pg_reduce_scatter(f->shard_pg, in, partial, S, RED_AVG, f->rs_stream, mod->name);
        launch_add(f->rs_stream, g->grad_shards, g->grad_shards, partial, S);
        dev_free(f->dev, partial); /* its own stream's later work runs after the add */
    }
    /* END SOLUTION */
    /* BEGIN SOLUTION: record rs_done, keep the input as the ReduceScatterState, DTensor.grad as views of the grad shards (HANDOUT.md#stage-04) */
    dev_event_record(f->rs_done, f->rs_stream);
    f->rs_state = in; /* the reduce-scatter stream still reads it: kept until compute waited for rs_done */
    for (int j = 0; j < mod->n_params; j++) mod->params[j].dt.grad = g->grad_shards + g->offsets[j];
    /* END SOLUTION */
}

void fsdp_pre_forward(Fsdp *f, Module *mod) {
    Group *g = mod->fsdp;
    /* BEGIN SOLUTION: an activation-checkpoint recompute runs pre_forward inside backward: params are already unsharded, do nothing (HANDOUT.md#stage-05) */
    if (g->state == TS_PRE_BACKWARD) return;
    g->state = TS_FORWARD;
    /* END SOLUTION */
    /* BEGIN SOLUTION: unshard (unless prefetched), wait, then prefetch the next module in forward order (HANDOUT.md#stage-03) */
    issue_all_gather(f, g); /* no-op when the previous module prefetched it */
    wait_all_gather(f, g);
    if (mod->index + 1 < f->model->n_modules) issue_all_gather(f, &f->groups[mod->index + 1]);
    /* END SOLUTION */
}

void fsdp_post_forward(Fsdp *f, Module *mod) {
    Group *g = mod->fsdp;
    /* BEGIN SOLUTION: after a recompute the backward still needs the params: do not reshard (HANDOUT.md#stage-05) */
    if (g->state == TS_PRE_BACKWARD) return;
    /* END SOLUTION */
    /* BEGIN SOLUTION: ZeRO-2: without reshard-after-forward the params stay unsharded until post_backward (HANDOUT.md#stage-06) */
    if (!f->reshard_after_forward) { /* ZeRO-2 (stage 06) */
        g->state = TS_IDLE;
        return; /* pre_backward's unshard is then a no-op: no all-gather in backward */
    }
    /* END SOLUTION */
    reshard(f, g);
    /* BEGIN SOLUTION: the forward is done: back to IDLE (HANDOUT.md#stage-05) */
    g->state = TS_IDLE;
    /* END SOLUTION */
}

void fsdp_pre_backward(Fsdp *f, Module *mod) {
    Group *g = mod->fsdp;
    /* BEGIN SOLUTION: drop the forward's last AllGatherState (HANDOUT.md#stage-03) */
    release_all_gather_state(f); /* the forward's last one: no forward all-gather comes to drop it */
    /* END SOLUTION */
    /* BEGIN SOLUTION: enter PRE_BACKWARD (once) so the recompute's forward hooks know (HANDOUT.md#stage-05) */
    if (g->state == TS_PRE_BACKWARD) return;
    g->state = TS_PRE_BACKWARD;
    /* END SOLUTION */
    /* BEGIN SOLUTION: unshard (unless prefetched), wait, prefetch the module that ran forward just before (HANDOUT.md#stage-04) */
    issue_all_gather(f, g);
    wait_all_gather(f, g);
    if (mod->index > 0) issue_all_gather(f, &f->groups[mod->index - 1]);
    /* END SOLUTION */
}

void fsdp_post_backward(Fsdp *f, Module *mod) {
    Group *g = mod->fsdp;
    /* BEGIN SOLUTION: enter POST_BACKWARD (HANDOUT.md#stage-05) */
    g->state = TS_POST_BACKWARD;
    /* END SOLUTION */
    /* BEGIN SOLUTION: without gradient sync keep Param.grad for the next microbatch and reduce nothing; reshard only when reshard_after_backward says so (HANDOUT.md#stage-07) */
    if (!mod->requires_gradient_sync) {
        if (mod->reshard_after_backward) reshard(f, g);
        return; /* the loop keeps Param.grad: the next backward adds to it */
    }
    reduce_grads(f, g);
    if (!mod->reshard_after_backward) return; /* the next microbatch's forward finds them unsharded */
    /* END SOLUTION */
    /* BEGIN SOLUTION: reshard after the backward (HANDOUT.md#stage-02) */
    reshard(f, g);
    /* END SOLUTION */
}

void fsdp_finish_backward(Fsdp *f) {
    /* BEGIN SOLUTION: drop the backward's last AllGatherState before the optimizer (HANDOUT.md#stage-03) */
    release_all_gather_state(f); /* the backward's last one, before the optimizer */
    /* END SOLUTION */
    /* BEGIN SOLUTION: the optimizer (compute stream) must see every reduce-scatter's output (HANDOUT.md#stage-04) */
    release_reduce_scatter_state(f);
    /* END SOLUTION */
    /* BEGIN SOLUTION: every module back to IDLE for the next step (HANDOUT.md#stage-05) */
    for (int i = 0; i < f->model->n_modules; i++) f->groups[i].state = TS_IDLE;
    /* END SOLUTION */
}

float fsdp_optimizer_step(Fsdp *f, float lr, int t) {
    /* BEGIN SOLUTION: the local sums of squares of the grad shards (HANDOUT.md#stage-02) */
    Model *m = f->model;
    float *sumsq = dev_alloc_f32(f->dev, 1, MEM_TEMP, "grad_norm.sumsq");
    dev_memset_async(f->compute, sumsq, 0, sizeof(float));
    for (int i = 0; i < m->n_modules; i++)
        for (int j = 0; j < m->modules[i].n_params; j++) {
            DTensor *dt = &m->modules[i].params[j].dt;
            launch_sumsq_accumulate(f->compute, sumsq, dt->grad, dt->local_rows * dt->row_numel);
        }
    /* END SOLUTION */
    /* BEGIN SOLUTION: the global norm: sum the local sums of squares over every rank: every stage's shard groups hold different parameters (HANDOUT.md#stage-11) */
    coll_all_reduce(f->dev, sumsq, sumsq, 1, RED_SUM, f->compute, "grad_norm");
    /* END SOLUTION */
    /* BEGIN SOLUTION: clip; AdamW on local rows; free the grad shards (HANDOUT.md#stage-02) */
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

/* ---------------------------------------------------------------- schedule */

/* A microbatch's activation (or its grad) from a neighbour: a fresh buffer,
 * received on compute; pipe_forward / pipe_backward then own it. */
static float *recv_activation(const PipeInfo *pi, int mb, int from, const char *what) {
    float *buf = dev_alloc_f32(pi->dev, pi->act_numel, MEM_ACTIVATION, what);
    dev_recv(pi->stream, buf, pi->act_numel, from, mb, what);
    return buf;
}

/* An activation (or grad) to a neighbour, then freed: the send is queued on
 * compute, so compute's later reuse of the block comes after it. Outside a
 * group only: inside one, the send is queued at dev_group_end. */
static void send_and_free(const PipeInfo *pi, float *buf, int mb, int to, const char *what) {
    dev_send(pi->stream, buf, pi->act_numel, to, mb, what);
    dev_free(pi->dev, buf);
}

void pipe_schedule(Pipe *pipe) {
    const PipeInfo *pi = pipe_info(pipe);
    const int M = pi->microbatches, first = pi->prev < 0, last = pi->next < 0;
    /* BEGIN SOLUTION: GPipe: every microbatch's forward (receive, forward, send), then every backward in microbatch order B0 .. B(M-1), as torch's ScheduleGPipe (HANDOUT.md#stage-11) */
    if (pi->schedule == PIPE_GPIPE) {
        for (int mb = 0; mb < M; mb++) {
            float *in = first ? NULL : recv_activation(pi, mb, pi->prev, "act");
            float *out = pipe_forward(pipe, mb, in);
            if (!last) send_and_free(pi, out, mb, pi->next, "act");
        }
        for (int mb = 0; mb < M; mb++) {
            float *dout = last ? NULL : recv_activation(pi, mb, pi->next, "grad");
            float *din = pipe_backward(pipe, mb, dout);
            if (!first) send_and_free(pi, din, mb, pi->prev, "grad");
        }
        return;
    }
    /* END SOLUTION */
    /* BEGIN SOLUTION: 1F1B: P-1-p warm-up forwards, then a forward and a backward in turn, each send grouped with the receive the neighbour sends back, then the cool-down backwards (HANDOUT.md#stage-11) */
    int warmup = pi->stages - 1 - pi->stage;
    if (warmup > M) warmup = M;
    for (int mb = 0; mb < warmup; mb++) {
        float *in = first ? NULL : recv_activation(pi, mb, pi->prev, "act");
        float *out = pipe_forward(pipe, mb, in);
        if (!last) send_and_free(pi, out, mb, pi->next, "act");
    }
    float *in = NULL; /* the next forward's input, received with the previous backward's send */
    if (warmup < M && !first) in = recv_activation(pi, warmup, pi->prev, "act");
    for (int k = 0; k < M - warmup; k++) {
        const int f = warmup + k, b = k;
        float *out = pipe_forward(pipe, f, in);
        float *dout = NULL;
        /* the activation goes down while the grad of microbatch b comes back: one group, or each
         * neighbour would wait in its send for the other's receive */
        dev_group_start(pi->dev);
        if (!last) {
            dout = recv_activation(pi, b, pi->next, "grad");
            dev_send(pi->stream, out, pi->act_numel, pi->next, f, "act");
        }
        dev_group_end(pi->dev); /* the group's op is queued here: only now may its send buffer go */
        if (!last) dev_free(pi->dev, out);
        float *din = pipe_backward(pipe, b, dout);
        in = NULL;
        dev_group_start(pi->dev);
        if (!first) {
            dev_send(pi->stream, din, pi->act_numel, pi->prev, b, "grad");
            if (f + 1 < M) in = recv_activation(pi, f + 1, pi->prev, "act");
        }
        dev_group_end(pi->dev);
        if (!first) dev_free(pi->dev, din);
    }
    for (int b = M - warmup; b < M; b++) {
        float *dout = last ? NULL : recv_activation(pi, b, pi->next, "grad");
        float *din = pipe_backward(pipe, b, dout);
        if (!first) send_and_free(pi, din, b, pi->prev, "grad");
    }
    /* END SOLUTION */
}
