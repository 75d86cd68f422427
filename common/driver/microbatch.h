/* microbatch.h — one step's batch as K microbatches: the one mechanism behind
 * gradient accumulation (--grad-accum K) and the pipeline (--pp P
 * --microbatches M, where K = M). It owns the step's batch, decides K once
 * from the options, hands a schedule microbatch k's slice of the batch,
 * flips FSDP2's user-side switches, and keeps each microbatch's loss.
 *
 * Who runs the microbatches, and in which order, is a schedule over this
 * API: the default one is train_step.c's accumulation loop (k = 0 .. K-1,
 * each forward then backward); with --pp it is the student's pipe_schedule
 * (hw_pipe.h), through pipeline.c's pipe_forward / pipe_backward. After the
 * schedule, microbatch_whole puts the whole batch back for the optimizer. */
#ifndef HWFSDP_MICROBATCH_H
#define HWFSDP_MICROBATCH_H

#include <stddef.h>
#include <stdint.h>

#include "driver/options.h"
#include "model/model.h"

typedef struct {
    Dev *dev;
    int K;                      /* microbatches per step (1: the whole batch at once) */
    int named;                  /* 1: the trace names microbatch k even when K == 1 (the pipeline's) */
    size_t B, T;                /* this rank's batch: B sequences of T tokens; a microbatch holds B / K */
    int32_t *inputs, *targets;  /* [B*T] device: the step's batch; microbatch k is rows k*B/K .. (k+1)*B/K - 1 */
    float *host_loss;           /* [K] host: each microbatch's mean loss (with --pp, the last stage's) */
} Microbatches;

/* K of a step, from the options: --microbatches with --pp, else --grad-accum. */
int microbatch_count(const Options *o);
/* Allocate the step's batch (device, tag MEM_ACTIVATION) and the K losses. */
void microbatches_init(Microbatches *mb, Dev *dev, const Options *o);
void microbatches_free(Microbatches *mb);

/* Run microbatch k next: run->B, run->inputs and run->targets are its slice
 * (B / K sequences), and the trace records it as microbatch k. */
void microbatch_use(const Microbatches *mb, ModelRun *run, int k);
/* FSDP2's user-side switches on every module of m, for the backwards to come
 * (set_requires_gradient_sync, set_reshard_after_backward). */
void microbatch_set_sync(Model *m, int requires_gradient_sync, int reshard_after_backward);
/* After the schedule: the whole batch again, no microbatch in scope, and the
 * switches back at FSDP2's defaults (1), as the optimizer step sees them. */
void microbatch_whole(const Microbatches *mb, ModelRun *run, Model *m);

/* Queue the copy of run's loss (microbatch k's mean, device) to host_loss[k]. */
void microbatch_record_loss(Microbatches *mb, const ModelRun *run, int k);
/* The step's loss: the mean over the whole batch, i.e. the mean of the K equal
 * microbatches' means. Valid once the compute stream has run. */
double microbatch_step_loss(const Microbatches *mb);

#endif
