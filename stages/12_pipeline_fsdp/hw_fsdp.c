/* STARTER for stage 12 — it stubs every stage up to 12: each TODO(stage NN) below stops
 * the run until you fill it (see HANDOUT.md#stage-NN). If you did the earlier stages, do not
 * start here: run `make carry STAGE=12`, which carries your own file into this stage and
 * lists what stage 12 adds. Starting from scratch, fill the TODOs stage by stage from
 * stage 01. Generated from the instructors' solution by tools/make_starters.py. */
/* hw_fsdp.c — stage 12: pipeline x FSDP on a 2-D mesh (--pp P, world P x S).
 *
 * Stage 11's file at S > 1: each pipeline stage's S ranks shard its modules
 * with the FSDP of stage 07 over the stage's shard group, and the schedule
 * passes activations between the stages' matching shards (rank p * S + j
 * talks to (p +- 1) * S + j). What makes it work is how the two meet, as
 * torch.distributed.pipelining's stages drive FSDP2: before each backward the
 * schedule tells the stage's modules whether it is the step's last one there
 * (requires_gradient_sync, reshard_after_backward), so the grads of all M
 * microbatches accumulate unsharded and are reduce-scattered once, and the
 * params stay unsharded from the step's first forward to its last backward:
 * with --reshard-after-forward=false, one all-gather per module and step
 * instead of two per microbatch.
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
    /* TODO(stage 09): split over the shard group: its size and this rank's place in it (with --pp, the stage's ranks). */
    hw_todo("split over the shard group: its size and this rank's place in it (with --pp, the stage's ranks)", "HANDOUT.md#stage-09; did stage 11 already? `make carry STAGE=12` brings your file here");
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
            /* TODO(stage 01): shard p into a DTensor: Shard(0) over the shard group (nshards, srank), torch.chunk rows, padded local storage. */
            hw_todo("shard p into a DTensor: Shard(0) over the shard group (nshards, srank), torch.chunk rows, padded local storage", "HANDOUT.md#stage-01; did stage 11 already? `make carry STAGE=12` brings your file here");
        }
    }
    /* TODO(stage 03): create the all-gather stream and the events that order it with compute. */
    hw_todo("create the all-gather stream and the events that order it with compute", "HANDOUT.md#stage-03; did stage 11 already? `make carry STAGE=12` brings your file here");
    /* TODO(stage 04): create the reduce-scatter stream and its events. */
    hw_todo("create the reduce-scatter stream and its events", "HANDOUT.md#stage-04; did stage 11 already? `make carry STAGE=12` brings your file here");
    return f;
}

static int is_unsharded(const Group *g) { return g->mod->params[0].data != NULL; }

/* Drop the AllGatherState: once the all-gather stream has waited for the
 * copy-out that read the kept output, its later work runs after that read,
 * so its next allocation may take the block. */
static void release_all_gather_state(Fsdp *f) {
    if (!f->ag_state) return;
    /* TODO(stage 03): the all-gather stream waits for the copy-out, then the kept output is freed. */
    hw_todo("the all-gather stream waits for the copy-out, then the kept output is freed", "HANDOUT.md#stage-03; did stage 11 already? `make carry STAGE=12` brings your file here");
}

/* Issue g's all-gather on the all-gather stream (returns at once): copy-in
 * this rank's padded shards into its segment of the flat output, all-gather
 * in place, record ag_done. The output is [r0: p0|p1|..][r1: p0|p1|..]..
 * The copy-in is one launch, a list of copies (HANDOUT.md#fused-copies). */
static void issue_all_gather(Fsdp *f, Group *g) {
    if (g->ag_flat || is_unsharded(g)) return; /* already in flight or done */
    Module *mod = g->mod;
    /* TODO(stage 03): copy-in on the all-gather stream into this rank's segment of the shard group's output, after the shards are ready. */
    hw_todo("copy-in on the all-gather stream into this rank's segment of the shard group's output, after the shards are ready", "HANDOUT.md#stage-03; did stage 11 already? `make carry STAGE=12` brings your file here");
    /* TODO(stage 09): all-gather the module's segments inside the shard group. */
    hw_todo("all-gather the module's segments inside the shard group", "HANDOUT.md#stage-09; did stage 11 already? `make carry STAGE=12` brings your file here");
    /* TODO(stage 03): record ag_done. */
    hw_todo("record ag_done", "HANDOUT.md#stage-03; did stage 11 already? `make carry STAGE=12` brings your file here");
}

/* Make g's params usable by compute: the compute stream waits for the
 * all-gather, then copies each param's rows out of every rank's segment.
 * One launch for all of them: at world 64 a block's 9 params are 576 copies. */
static void wait_all_gather(Fsdp *f, Group *g) {
    if (!g->ag_flat) return;
    Module *mod = g->mod;
    /* TODO(stage 03): compute waits on ag_done, copy-out of every shard-group rank's rows into each Param.data, record copy_out_done and keep the flat buffer as the AllGatherState. */
    hw_todo("compute waits on ag_done, copy-out of every shard-group rank's rows into each Param.data, record copy_out_done and keep the flat buffer as the AllGatherState", "HANDOUT.md#stage-03; did stage 11 already? `make carry STAGE=12` brings your file here");
}

/* reshard: free the unsharded params; the DTensor shards stay. */
static void reshard(Fsdp *f, Group *g) {
    /* TODO(stage 01): free every unsharded Param.data of the module. */
    hw_todo("free every unsharded Param.data of the module", "HANDOUT.md#stage-01; did stage 11 already? `make carry STAGE=12` brings your file here");
}

/* Drop the ReduceScatterState: once compute has waited for the reduce-scatter
 * that read the kept input, compute's next allocation may take its block. */
static void release_reduce_scatter_state(Fsdp *f) {
    if (!f->rs_state) return;
    /* TODO(stage 04): compute waits for the reduce-scatter, then its input is freed. */
    hw_todo("compute waits for the reduce-scatter, then its input is freed", "HANDOUT.md#stage-04; did stage 11 already? `make carry STAGE=12` brings your file here");
}

/* reduce-scatter on its own stream: compute fills the chunk-cat input (row r
 * of (nshards, S) holds chunk r of every grad) and frees the grads; the
 * reduce-scatter stream waits for that, averages over the shard group, and
 * records rs_done.
 * The chunk-cat is one launch, a list of copies (HANDOUT.md#fused-copies). */
static void reduce_grads(Fsdp *f, Group *g) {
    /* TODO(stage 04): chunk-cat the grads over the shard group on compute (after releasing the previous ReduceScatterState) and free them; the reduce-scatter stream waits for the input. */
    hw_todo("chunk-cat the grads over the shard group on compute (after releasing the previous ReduceScatterState) and free them; the reduce-scatter stream waits for the input", "HANDOUT.md#stage-04; did stage 11 already? `make carry STAGE=12` brings your file here");
    /* TODO(stage 07): reduce-scatter into the grad shards inside the shard group; with --grad-sync every a later microbatch's goes to a buffer of its own and is added to what the earlier ones left. */
    hw_todo("reduce-scatter into the grad shards inside the shard group; with --grad-sync every a later microbatch's goes to a buffer of its own and is added to what the earlier ones left", "HANDOUT.md#stage-07; did stage 11 already? `make carry STAGE=12` brings your file here");
    /* TODO(stage 04): record rs_done, keep the input as the ReduceScatterState, DTensor.grad as views of the grad shards. */
    hw_todo("record rs_done, keep the input as the ReduceScatterState, DTensor.grad as views of the grad shards", "HANDOUT.md#stage-04; did stage 11 already? `make carry STAGE=12` brings your file here");
}

void fsdp_pre_forward(Fsdp *f, Module *mod) {
    Group *g = mod->fsdp;
    /* TODO(stage 05): an activation-checkpoint recompute runs pre_forward inside backward: params are already unsharded, do nothing. */
    hw_todo("an activation-checkpoint recompute runs pre_forward inside backward: params are already unsharded, do nothing", "HANDOUT.md#stage-05; did stage 11 already? `make carry STAGE=12` brings your file here");
    /* TODO(stage 03): unshard (unless prefetched), wait, then prefetch the next module in forward order. */
    hw_todo("unshard (unless prefetched), wait, then prefetch the next module in forward order", "HANDOUT.md#stage-03; did stage 11 already? `make carry STAGE=12` brings your file here");
}

void fsdp_post_forward(Fsdp *f, Module *mod) {
    Group *g = mod->fsdp;
    /* TODO(stage 05): after a recompute the backward still needs the params: do not reshard. */
    hw_todo("after a recompute the backward still needs the params: do not reshard", "HANDOUT.md#stage-05; did stage 11 already? `make carry STAGE=12` brings your file here");
    /* TODO(stage 06): ZeRO-2: without reshard-after-forward the params stay unsharded until post_backward. */
    hw_todo("ZeRO-2: without reshard-after-forward the params stay unsharded until post_backward", "HANDOUT.md#stage-06; did stage 11 already? `make carry STAGE=12` brings your file here");
    reshard(f, g);
    /* TODO(stage 05): the forward is done: back to IDLE. */
    hw_todo("the forward is done: back to IDLE", "HANDOUT.md#stage-05; did stage 11 already? `make carry STAGE=12` brings your file here");
}

void fsdp_pre_backward(Fsdp *f, Module *mod) {
    Group *g = mod->fsdp;
    /* TODO(stage 03): drop the forward's last AllGatherState. */
    hw_todo("drop the forward's last AllGatherState", "HANDOUT.md#stage-03; did stage 11 already? `make carry STAGE=12` brings your file here");
    /* TODO(stage 05): enter PRE_BACKWARD (once) so the recompute's forward hooks know. */
    hw_todo("enter PRE_BACKWARD (once) so the recompute's forward hooks know", "HANDOUT.md#stage-05; did stage 11 already? `make carry STAGE=12` brings your file here");
    /* TODO(stage 04): unshard (unless prefetched), wait, prefetch the module that ran forward just before. */
    hw_todo("unshard (unless prefetched), wait, prefetch the module that ran forward just before", "HANDOUT.md#stage-04; did stage 11 already? `make carry STAGE=12` brings your file here");
}

void fsdp_post_backward(Fsdp *f, Module *mod) {
    Group *g = mod->fsdp;
    /* TODO(stage 05): enter POST_BACKWARD. */
    hw_todo("enter POST_BACKWARD", "HANDOUT.md#stage-05; did stage 11 already? `make carry STAGE=12` brings your file here");
    /* TODO(stage 07): without gradient sync keep Param.grad for the next microbatch and reduce nothing; reshard only when reshard_after_backward says so. */
    hw_todo("without gradient sync keep Param.grad for the next microbatch and reduce nothing; reshard only when reshard_after_backward says so", "HANDOUT.md#stage-07; did stage 11 already? `make carry STAGE=12` brings your file here");
    /* TODO(stage 02): reshard after the backward. */
    hw_todo("reshard after the backward", "HANDOUT.md#stage-02; did stage 11 already? `make carry STAGE=12` brings your file here");
}

void fsdp_finish_backward(Fsdp *f) {
    /* TODO(stage 03): drop the backward's last AllGatherState before the optimizer. */
    hw_todo("drop the backward's last AllGatherState before the optimizer", "HANDOUT.md#stage-03; did stage 11 already? `make carry STAGE=12` brings your file here");
    /* TODO(stage 04): the optimizer (compute stream) must see every reduce-scatter's output. */
    hw_todo("the optimizer (compute stream) must see every reduce-scatter's output", "HANDOUT.md#stage-04; did stage 11 already? `make carry STAGE=12` brings your file here");
    /* TODO(stage 05): every module back to IDLE for the next step. */
    hw_todo("every module back to IDLE for the next step", "HANDOUT.md#stage-05; did stage 11 already? `make carry STAGE=12` brings your file here");
}

float fsdp_optimizer_step(Fsdp *f, float lr, int t) {
    /* TODO(stage 02): the local sums of squares of the grad shards. */
    hw_todo("the local sums of squares of the grad shards", "HANDOUT.md#stage-02; did stage 11 already? `make carry STAGE=12` brings your file here");
    /* TODO(stage 11): the global norm: sum the local sums of squares over every rank: every stage's shard groups hold different parameters. */
    hw_todo("the global norm: sum the local sums of squares over every rank: every stage's shard groups hold different parameters", "HANDOUT.md#stage-11; did stage 11 already? `make carry STAGE=12` brings your file here");
    /* TODO(stage 02): clip; AdamW on local rows; free the grad shards. */
    hw_todo("clip; AdamW on local rows; free the grad shards", "HANDOUT.md#stage-02; did stage 11 already? `make carry STAGE=12` brings your file here");
    /* TODO(stage 03): the next all-gathers must read the updated shards. */
    hw_todo("the next all-gathers must read the updated shards", "HANDOUT.md#stage-03; did stage 11 already? `make carry STAGE=12` brings your file here");
    /* TODO(stage 02): read the global grad norm back and return it. */
    hw_todo("read the global grad norm back and return it", "HANDOUT.md#stage-02; did stage 11 already? `make carry STAGE=12` brings your file here");
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

/* A backward, with FSDP2's knobs set the way a pipeline stage sets them on an
 * FSDP module (torch.distributed.pipelining: set_requires_gradient_sync and
 * set_reshard_after_backward): done counts this step's backwards so far. */
static float *backward(Pipe *pipe, int mb, float *dout, int *done) {
    const PipeInfo *pi = pipe_info(pipe);
    /* TODO(stage 12): only the step's last backward on this stage reduce-scatters and reshards; before it the grads accumulate unsharded and the params stay. */
    hw_todo("only the step's last backward on this stage reduce-scatters and reshards; before it the grads accumulate unsharded and the params stay", "HANDOUT.md#stage-12");
    return pipe_backward(pipe, mb, dout);
}

void pipe_schedule(Pipe *pipe) {
    const PipeInfo *pi = pipe_info(pipe);
    const int M = pi->microbatches, first = pi->prev < 0, last = pi->next < 0;
    int done = 0; /* backwards run this step */
    /* TODO(stage 11): GPipe: every microbatch's forward (receive, forward, send), then every backward in microbatch order B0 .. B(M-1), as torch's ScheduleGPipe. */
    hw_todo("GPipe: every microbatch's forward (receive, forward, send), then every backward in microbatch order B0 .. B(M-1), as torch's ScheduleGPipe", "HANDOUT.md#stage-11; did stage 11 already? `make carry STAGE=12` brings your file here");
    /* TODO(stage 11): 1F1B: P-1-p warm-up forwards, then a forward and a backward in turn, each send grouped with the receive the neighbour sends back, then the cool-down backwards. */
    hw_todo("1F1B: P-1-p warm-up forwards, then a forward and a backward in turn, each send grouped with the receive the neighbour sends back, then the cool-down backwards", "HANDOUT.md#stage-11; did stage 11 already? `make carry STAGE=12` brings your file here");
}
