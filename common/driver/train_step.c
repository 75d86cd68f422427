/* train_step.c — the training loop: train_step() is the loop of hw_fsdp.h,
 * calling the student's hooks around every module as PyTorch autograd calls
 * FSDP2's; train_rank() sets a rank up, runs the steps and tears it down.
 * What the grader records around the hooks is in probes.c, the metrics in
 * step_log.c, checkpoints in checkpoint.c. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "driver/checkpoint.h"
#include "driver/flag_check.h"
#include "driver/probes.h"
#include "driver/step_log.h"
#include "driver/train.h"
#include "driver/trainer.h"
#include "hw_fsdp.h"
#include "model/model.h"
#include "model/optim.h"
#include "runtime/phase.h"
#include "runtime/runtime.h"
#include "runtime/util.h"

/* What the host does now (module, phase), for traces and snapshots. */
static void at(Trainer *t, int step, const char *module, Phase phase) {
    dev_set_scope(t->dev, step, module, phase_name(phase));
}

/* This rank's sequences of step s (model/data.h: the data-order contract). */
static void load_batch(Trainer *t, const TrainJob *job, int s) {
    size_t N = t->run.B * t->run.T;
    at(t, s, "data", PHASE_DATA);
    int shards, shard = pipe_data_shard(t->opt, dev_rank(t->dev), &shards); /* --pp: every stage of a shard reads it */
    data_batch(job->data, s, shard, shards, t->run.B, t->run.T, t->host_inputs, t->host_targets);
    dev_memcpy_async(t->run.stream, t->inputs, t->host_inputs, N * sizeof(int32_t));
    dev_memcpy_async(t->run.stream, t->targets, t->host_targets, N * sizeof(int32_t));
}

/* The unsharded grads of a module's backward, zeroed, as autograd allocates
 * them; grads kept from the previous microbatch are accumulated into. */
static void alloc_unsharded_grads(Trainer *t, Module *mod) {
    for (int j = 0; j < mod->n_params; j++) {
        Param *p = &mod->params[j];
        if (p->grad) continue;
        char name[96];
        snprintf(name, sizeof name, "%s.grad", p->name);
        p->grad = dev_alloc_f32(t->dev, p->numel, MEM_UNSHARDED_GRAD, name);
        dev_memset_async(t->run.stream, p->grad, 0, p->numel * sizeof(float));
    }
}

/* After post_backward: the grads are the student's, unless the module was
 * told not to sync (mod->requires_gradient_sync 0): then what it left in
 * Param.grad, still the allocation the probes captured for this backward, is
 * kept for the next microbatch, as autograd keeps .grad. A grad freed or
 * replaced anyway is dropped: the next backward starts it from zero, the
 * microbatch's gradient is lost, and the grader's checks say where. */
static void after_post_backward(Trainer *t, Module *mod) {
    const Captured *grads = &t->probes.grads;
    for (int j = 0; j < mod->n_params; j++) {
        Param *p = &mod->params[j];
        int kept = !mod->requires_gradient_sync && p->grad && grads->id[j] &&
                   dev_mem_live_id_containing(t->dev, p->grad) == grads->id[j];
        if (!kept) p->grad = NULL;
    }
}

/* FSDP2's user-side switches for microbatch k of K, on every module. */
static void set_microbatch(Trainer *t, int k, int K) {
    Model *m = t->model;
    int last = k == K - 1;
    dev_set_microbatch(t->dev, K > 1 ? k : -1);
    for (int i = 0; i < m->n_modules; i++) {
        m->modules[i].requires_gradient_sync = last || t->opt->grad_sync_every;
        m->modules[i].reshard_after_backward = last || t->opt->reshard_after_backward;
    }
    size_t Bm = t->opt->batch_size / (size_t)K, T = t->opt->seq_len;
    t->run.B = Bm;
    t->run.inputs = t->inputs + (size_t)k * Bm * T;
    t->run.targets = t->targets + (size_t)k * Bm * T;
}

/* A hook call, in its scope, with its memory recorded (probes.h). */
#define HOOK(t, s, module, phase, call)                                  \
    do {                                                                 \
        at(t, s, module, phase);                                         \
        probe_hook_begin((t)->dev, &(t)->probes);                        \
        call;                                                            \
        probe_hook_end((t)->dev, &(t)->probes, s, module, phase_name(phase)); \
    } while (0)

/* One module's forward, between its hooks (the pipeline's too: pipeline.c). */
void trainer_forward_module(Trainer *t, int s, Module *mod) {
    Fsdp *f = t->fsdp;
    HOOK(t, s, mod->name, PHASE_PRE_FORWARD, fsdp_pre_forward(f, mod));
    probe_params_ready(t->dev, &t->probes, mod, s, phase_name(PHASE_PRE_FORWARD), 0);
    at(t, s, mod->name, PHASE_FORWARD);
    module_forward(t->model, mod, &t->run);
    HOOK(t, s, mod->name, PHASE_POST_FORWARD, fsdp_post_forward(f, mod));
    probe_after_post_forward(t->dev, &t->probes, s, mod);
}

/* One module's backward, between its hooks (with --ac, the forward again first). */
void trainer_backward_module(Trainer *t, int s, Module *mod) {
    Model *m = t->model;
    Fsdp *f = t->fsdp;
    HOOK(t, s, mod->name, PHASE_PRE_BACKWARD, fsdp_pre_backward(f, mod));
    if (t->opt->ac && mod->kind == MOD_BLOCK) { /* activation checkpointing: the forward again */
        HOOK(t, s, mod->name, PHASE_RECOMPUTE_PRE_FORWARD, fsdp_pre_forward(f, mod));
        probe_params_ready(t->dev, &t->probes, mod, s, phase_name(PHASE_RECOMPUTE_PRE_FORWARD), 0);
        at(t, s, mod->name, PHASE_RECOMPUTE);
        module_recompute(m, mod, &t->run);
        HOOK(t, s, mod->name, PHASE_RECOMPUTE_POST_FORWARD, fsdp_post_forward(f, mod));
    }
    at(t, s, mod->name, PHASE_BACKWARD);
    probe_params_ready(t->dev, &t->probes, mod, s, phase_name(PHASE_PRE_BACKWARD), 1);
    alloc_unsharded_grads(t, mod);
    probe_grads_allocated(t->dev, &t->probes, mod);
    module_backward(m, mod, &t->run);
    HOOK(t, s, mod->name, PHASE_POST_BACKWARD, fsdp_post_backward(f, mod));
    probe_after_post_backward(t->dev, &t->probes, s, mod);
    after_post_backward(t, mod);
}

/* The end of one backward: FSDP2's root post-backward callback (once per
 * backward, so once per microbatch). */
void trainer_finish_backward(Trainer *t, int s) {
    HOOK(t, s, "root", PHASE_FINISH_BACKWARD, fsdp_finish_backward(t->fsdp));
    probe_grad_state(t->dev, &t->probes, s);
}

/* The forward of step s's current (micro)batch; its mean loss goes to *host_loss. */
static void forward(Trainer *t, int s, float *host_loss) {
    Model *m = t->model;
    for (int i = 0; i < m->n_modules; i++) trainer_forward_module(t, s, &m->modules[i]);
    dev_memcpy_async(t->run.stream, host_loss, t->run.loss, sizeof(float)); /* device -> host */
}

/* The backward, in reverse module order, then finish_backward. */
static void backward(Trainer *t, int s) {
    Model *m = t->model;
    for (int i = m->n_modules - 1; i >= 0; i--) trainer_backward_module(t, s, &m->modules[i]);
    trainer_finish_backward(t, s);
}

/* One step: forward and backward of each microbatch (one without
 * --grad-accum), then the optimizer. Returns the grad norm (NAN with
 * --forward-only); the step's loss is the mean of t->host_loss (valid once
 * the compute stream has run). */
static float train_step(Trainer *t, int s) {
    const int K = t->opt->grad_accum;
    float grad_norm = NAN;
    if (t->pipe) { /* --pp: the student's schedule runs the microbatches (pipeline.c) */
        pipe_run_step(t->pipe, s);
        if (s == t->flags.step) flag_check_end(t->dev, &t->flags);
        HOOK(t, s, "optimizer", PHASE_OPTIMIZER,
             grad_norm = fsdp_optimizer_step(t->fsdp, lr_at_step(&t->opt->optim, s), s + 1));
        return grad_norm;
    }
    for (int k = 0; k < K; k++) {
        set_microbatch(t, k, K);
        forward(t, s, &t->host_loss[k]);
        if (t->opt->forward_only) {
            at(t, s, "step", PHASE_DISCARD);
            model_discard_activations(t->model, &t->run);
            return NAN;
        }
        backward(t, s);
        if (k == 0 && s == t->flags.step) flag_check_end(t->dev, &t->flags);
    }
    set_microbatch(t, 0, 1); /* the whole batch again, no microbatch in scope */
    HOOK(t, s, "optimizer", PHASE_OPTIMIZER,
         grad_norm = fsdp_optimizer_step(t->fsdp, lr_at_step(&t->opt->optim, s), s + 1));
    return grad_norm;
}
#undef HOOK

/* The full model on every rank (a module materialized before fully_shard),
 * then fsdp_init shards it; with --pp, the modules of this rank's stage. */
static void trainer_init(Trainer *t, Dev *dev, const TrainJob *job, DeviceMesh *mesh) {
    const Options *o = job->opt;
    Stream *cs = dev_compute_stream(dev);
    Model *full = model_create(&o->model), *m = full;
    const float *init = job->init;
    if (o->pp) {
        int S = dev_world_size(dev) / o->pp;
        size_t first = 0;
        m = pipe_stage_model(full, o->pp, dev_rank(dev) / S, &first);
        init += first;
    }
    size_t N = o->batch_size * o->seq_len;
    *t = (Trainer){.dev = dev, .opt = o, .model = m, .full = full};
    at(t, -1, "init", PHASE_INIT);
    for (int i = 0; i < m->n_modules; i++)
        for (int j = 0; j < m->modules[i].n_params; j++) {
            Param *p = &m->modules[i].params[j];
            p->data = dev_alloc_f32(dev, p->numel, MEM_PARAM, p->name);
            dev_memcpy_async(cs, p->data, init + model_param_offset(m, p), p->numel * sizeof(float));
        }
    if (o->pp) pipe_mesh_build(dev, mesh, o->pp);
    else dev_mesh_build(dev, mesh, o->mesh_replicas, o->mesh_shards);
    FsdpConfig fc = {.dev = dev,
                     .model = m,
                     .mesh = mesh,
                     .reshard_after_forward = o->reshard_after_forward,
                     .mp = o->mp,
                     .optim = o->optim,
                     .backward_prefetch = o->backward_prefetch,
                     .single_comm_stream = o->single_comm_stream,
                     .offload_params = o->offload_params};
    at(t, -1, "fsdp", PHASE_INIT);
    t->fsdp = fsdp_init(&fc);
    probes_check_mesh(m, mesh);
    if (o->offload_params) probes_check_offload(dev, m);
    probes_init(&t->probes, m, o->mp.param_dtype == DTYPE_BF16);
    if (o->out_dir) probes_write_dtensors(dev, m, init, o->out_dir, mesh);
    if (job->init_exp_avg && !o->forward_only)
        checkpoint_restore_optimizer(dev, m, job->init_exp_avg, job->init_exp_avg_sq);

    const int K = o->pp ? o->microbatches : o->grad_accum;
    t->run = (ModelRun){.dev = dev, .stream = cs, .B = o->batch_size, .T = o->seq_len, .recompute = o->ac,
                        .microbatches = K, .param_bf16 = o->mp.param_dtype == DTYPE_BF16};
    at(t, -1, "init", PHASE_INIT);
    t->inputs = dev_alloc(dev, N * sizeof(int32_t), MEM_ACTIVATION, "inputs");
    t->targets = dev_alloc(dev, N * sizeof(int32_t), MEM_ACTIVATION, "targets");
    t->run.inputs = t->inputs;
    t->run.targets = t->targets;
    model_run_begin(m, &t->run);
    t->host_inputs = xmalloc(N * sizeof(int32_t));
    t->host_targets = xmalloc(N * sizeof(int32_t));
    t->host_loss = xcalloc((size_t)K, sizeof(float));
    if (o->pp) t->pipe = pipe_create(t);
}

void train_rank(Dev *dev, void *arg) {
    TrainJob *job = arg;
    const Options *o = job->opt;
    DeviceMesh mesh;
    Trainer t;
    trainer_init(&t, dev, job, &mesh);
    flag_check_begin(dev, &t.flags, o, t.model, job->start_step);
    StepLog log;
    step_log_open(&log, dev, o->out_dir);
    int stop_nan = 0;
    for (int s = job->start_step; s < o->steps && !stop_nan; s++) {
        dev_synchronize(dev);
        dev_set_tracing(dev, s < o->profile_steps);
        dev_mem_reset_peak(dev);
        double t0 = now_us(), m0 = dev_host_time_us(dev);
        load_batch(&t, job, s);
        float grad_norm = train_step(&t, s);
        dev_synchronize(dev);
        const int K = o->pp ? o->microbatches : o->grad_accum;
        double loss = 0; /* the mean over the whole batch: the mean of the K equal microbatches' means */
        for (int k = 0; k < K; k++) loss += t.host_loss[k]; /* with --pp, only the last stage's mean */
        int bad = step_log_write(&log, dev, o, &t.run, s, loss / K, grad_norm, now_us() - t0,
                                 dev_host_time_us(dev) - m0);
        if (o->save_every && (s + 1) % o->save_every == 0 && !bad) checkpoint_write(dev, t.model, o->save_path, s + 1);
        if (bad) {
            stop_nan = 1;
            if (dev_rank(dev) == 0) job->exit_code = EXIT_NAN; /* step_log_write said why */
        }
    }
    step_log_close(&log);

    at(&t, o->steps, "end", PHASE_END);
    if (o->save_path && !stop_nan)
        checkpoint_write(dev, t.model, o->save_path, o->steps > job->start_step ? o->steps : job->start_step);
    model_run_end(t.model, &t.run);
    dev_free(dev, t.inputs);
    dev_free(dev, t.targets);
    dev_synchronize(dev);
    if (o->out_dir) dev_write_artifacts(dev, o->out_dir);
    flag_check_free(dev, &t.flags);
    fsdp_destroy(t.fsdp);
    probes_free(&t.probes);
    free(t.host_inputs);
    free(t.host_targets);
    free(t.host_loss);
    pipe_destroy(t.pipe);
    if (t.model != t.full) pipe_stage_model_free(t.model);
    model_destroy(t.full);
}
