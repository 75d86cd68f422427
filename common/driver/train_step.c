/* train_step.c — the training loop: train_step() is the loop of hw_fsdp.h,
 * one step as a schedule over the step's microbatches (microbatch.h: the
 * accumulation loop here, or with --pp the student's pipe_schedule through
 * pipeline.c), each microbatch run by trainer.c, which calls the student's
 * hooks around every module as PyTorch autograd calls FSDP2's; then the
 * optimizer. train_rank() sets a rank up, runs the steps and tears it down.
 * What the grader records around the hooks is in probes.c, the metrics in
 * step_log.c, checkpoints in checkpoint.c. Calls go down only: train_step.c
 * -> pipeline.c -> trainer.c -> microbatch.c (tests/test_driver_layers.py). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "driver/checkpoint.h"
#include "driver/flag_check.h"
#include "driver/flat.h"
#include "driver/microbatch.h"
#include "driver/pipeline.h"
#include "driver/probes.h"
#include "driver/step_log.h"
#include "driver/train.h"
#include "driver/trainer.h"
#include "hw_fsdp.h"
#include "model/model.h"
#include "runtime/runtime.h"
#include "runtime/util.h"

/* This rank's sequences of step s (model/data.h: the data-order contract). */
static void load_batch(Trainer *t, const TrainJob *job, int s) {
    const Microbatches *mb = &t->mb;
    size_t N = mb->B * mb->T;
    trainer_at(t, s, "data", PHASE_DATA);
    int shards, shard = pipe_data_shard(t->opt, dev_rank(t->dev), &shards); /* --pp: every stage of a shard reads it */
    data_batch(job->data, s, shard, shards, mb->B, mb->T, t->host_inputs, t->host_targets);
    dev_memcpy_async(t->run.stream, mb->inputs, t->host_inputs, N * sizeof(int32_t));
    dev_memcpy_async(t->run.stream, mb->targets, t->host_targets, N * sizeof(int32_t));
}

/* The default schedule (no --pp): gradient accumulation, the K microbatches
 * one after the other, each forward then backward, with FSDP2's user-side
 * switches for microbatch k of K (sync and reshard after the last, or every
 * time with --grad-sync-every / --reshard-after-backward). Returns 0 when
 * --forward-only stopped after the forward. */
static int accumulate(Trainer *t, int s) {
    const int K = t->mb.K;
    for (int k = 0; k < K; k++) {
        int last = k == K - 1;
        microbatch_use(&t->mb, &t->run, k);
        microbatch_set_sync(t->model, last || t->opt->grad_sync_every, last || t->opt->reshard_after_backward);
        trainer_forward(t, s);
        microbatch_record_loss(&t->mb, &t->run, k);
        if (t->opt->forward_only) {
            trainer_at(t, s, "step", PHASE_DISCARD);
            model_discard_activations(t->model, &t->run);
            return 0;
        }
        trainer_backward(t, s);
        if (k == 0 && s == t->flags.step) flag_check_end(t->dev, &t->flags);
    }
    return 1;
}

/* One step: a schedule runs the step's microbatches (the default one, or
 * with --pp the student's), then the whole batch again and the optimizer.
 * Returns the grad norm (NAN with --forward-only); the step's loss is
 * microbatch_step_loss (valid once the compute stream has run). */
static float train_step(Trainer *t, int s) {
    if (t->pipe) pipe_run_step(t->pipe, s); /* --pp: the student's pipe_schedule (pipeline.c) */
    else if (!accumulate(t, s)) return NAN;
    microbatch_whole(&t->mb, &t->run, t->model);
    if (t->pipe && s == t->flags.step) flag_check_end(t->dev, &t->flags); /* after the whole schedule */
    return trainer_optimizer_step(t, s);
}

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
    *t = (Trainer){.dev = dev, .opt = o, .model = m, .full = full};
    trainer_at(t, -1, "init", PHASE_INIT);
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
                     .offload_params = o->offload_params,
                     .bucket_bytes = (size_t)(o->bucket_mb * 1048576.0)}; /* --bucket-mb MB: MB x 2^20 bytes */
    trainer_at(t, -1, "fsdp", PHASE_INIT);
    t->fsdp = fsdp_init(&fc);
    probes_check_mesh(m, mesh);
    if (o->offload_params) probes_check_offload(dev, m);
    if (o->bucket_mb_given && !flat_any(m))
        fatal("--bucket-mb %g: no DTensor is Flat after fsdp_init, so this FSDP ignores buckets (flat parameters: "
              "stage 13; HANDOUT.md#stage-13)", o->bucket_mb);
    probes_init(&t->probes, m, o->mp.param_dtype == DTYPE_BF16, o->ac);
    if (o->out_dir) probes_write_dtensors(dev, m, init, o->out_dir, mesh);
    if (job->init_exp_avg && !o->forward_only)
        checkpoint_restore_optimizer(dev, m, job->init_exp_avg, job->init_exp_avg_sq);

    t->run = (ModelRun){.dev = dev, .stream = cs, .B = o->batch_size, .T = o->seq_len, .ac = o->ac,
                        .param_bf16 = o->mp.param_dtype == DTYPE_BF16,
                        .eager_memory = o->world.price_ops != PRICE_FUSED};
    trainer_at(t, -1, "init", PHASE_INIT);
    microbatches_init(&t->mb, dev, o); /* the step's batch, whole: run.inputs / targets until a schedule slices it */
    t->run.microbatches = t->mb.K;     /* each microbatch's backward is its loss / K's */
    t->run.inputs = t->mb.inputs;
    t->run.targets = t->mb.targets;
    model_run_begin(m, &t->run);
    size_t N = o->batch_size * o->seq_len;
    t->host_inputs = xmalloc(N * sizeof(int32_t));
    t->host_targets = xmalloc(N * sizeof(int32_t));
    if (o->pp) t->pipe = pipe_create(t);
}

void train_rank(Dev *dev, void *arg) {
    TrainJob *job = arg;
    const Options *o = job->opt;
    DeviceMesh mesh;
    Trainer t;
    if (o->out_dir) dev_record_partial(dev, o->out_dir); /* a runtime error leaves what the grader can judge */
    trainer_init(&t, dev, job, &mesh);
    if (dev_rank(dev) == 0) job->flat = flat_any(t.model); /* run.json states the flat units (train_main.c) */
    flag_check_begin(dev, &t.flags, o, t.model, job->start_step);
    StepLog log;
    step_log_open(&log, dev, o->out_dir);
    dev_mem_watch_capacity(dev, 1); /* the steps are held to the device's memory, not init (step_log.h) */
    int stop_nan = 0;
    for (int s = job->start_step; s < o->steps && !stop_nan; s++) {
        dev_synchronize(dev);
        dev_set_tracing(dev, s < o->profile_steps);
        dev_mem_reset_peak(dev);
        double t0 = now_us(), m0 = dev_host_time_us(dev);
        load_batch(&t, job, s);
        float grad_norm = train_step(&t, s);
        dev_synchronize(dev);
        double loss = microbatch_step_loss(&t.mb); /* with --pp, only the last stage's mean */
        int bad = step_log_write(&log, dev, o, &t.run, s, loss, grad_norm, now_us() - t0,
                                 dev_host_time_us(dev) - m0);
        if (o->save_every && (s + 1) % o->save_every == 0 && !bad) checkpoint_write(dev, t.model, o->save_path, s + 1);
        if (bad) {
            stop_nan = 1;
            if (dev_rank(dev) == 0) job->exit_code = EXIT_NAN; /* step_log_write said why */
        }
    }
    dev_mem_watch_capacity(dev, 0);
    if (log.over_capacity && dev_rank(dev) == 0) {
        job->over_capacity = 1;
        if (!job->exit_code) job->exit_code = EXIT_OVER_CAPACITY; /* step_log_write said where */
    }
    step_log_close(&log);

    trainer_at(&t, o->steps, "end", PHASE_END);
    if (o->save_path && !stop_nan)
        checkpoint_write(dev, t.model, o->save_path, o->steps > job->start_step ? o->steps : job->start_step);
    model_run_end(t.model, &t.run);
    microbatches_free(&t.mb);
    dev_synchronize(dev);
    if (o->out_dir) dev_write_artifacts(dev, o->out_dir);
    flag_check_free(dev, &t.flags);
    fsdp_destroy(t.fsdp);
    probes_free(&t.probes);
    free(t.host_inputs);
    free(t.host_targets);
    pipe_destroy(t.pipe);
    if (t.model != t.full) pipe_stage_model_free(t.model);
    model_destroy(t.full);
}
