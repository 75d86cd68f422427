/* hw_pipe.h — THE PIPELINE CONTRACT (stages 11 and 12). Read hw_fsdp.h first:
 * your FSDP hooks keep running, on your stage's modules only.
 *
 * --pp P splits the world into P pipeline stages of S = world / P ranks each:
 * rank = p * S + j is shard j of stage p. The modules are split into P
 * contiguous runs: the embedding on stage 0, the head (and the loss) on stage
 * P-1, and the L blocks balanced: stage p gets L / P blocks, one more when
 * p < L % P. Your hw_fsdp.c sees only this stage's modules (FsdpConfig.model)
 * and shards them over the stage's S ranks (FsdpConfig.mesh->shard_group;
 * stage 11 has S = 1).
 *
 * Each step splits every shard's batch into M = --microbatches equal
 * microbatches, and the runtime calls your pipe_schedule(pipe) once. It must
 * run every microbatch's forward and backward through this stage, once each,
 * in the order --pp-schedule names (PipeInfo.schedule), and move the
 * activations between stages with dev_send / dev_recv (device.h):
 *
 *   float *pipe_forward(pipe, mb, in)    this stage's forward of microbatch mb:
 *     in:  stage 0: NULL (the runtime reads the tokens); else the activation
 *          from stage p-1, act_numel floats you allocated (dev_alloc, tag
 *          MEM_ACTIVATION) and received. It is the runtime's from now on:
 *          it frees it in mb's backward, so do not free it yourself.
 *     out: the activation for stage p+1 (act_numel floats): yours, send it
 *          and dev_free it; NULL on the last stage (the loss is recorded).
 *   float *pipe_backward(pipe, mb, dout) its backward (after its forward):
 *     dout: the last stage: NULL (the loss); else the grad of this stage's
 *          output from stage p+1, act_numel floats you allocated and
 *          received: the runtime's from now on.
 *     out: the grad of this stage's input for stage p-1 (act_numel floats):
 *          yours, send it and dev_free it; NULL on stage 0.
 *
 * Around each module the runtime calls your FSDP hooks as in hw_fsdp.h. Each
 * microbatch's loss is mean / M, so the grads of the M backwards add up to
 * the whole batch's. The runtime sets every module's requires_gradient_sync
 * and reshard_after_backward to 1 when the step starts and then leaves them
 * to you: as torch.distributed.pipelining's stages do for an FSDP module,
 * your schedule may clear them before a backward (stage 12: only the step's
 * last backward syncs, and the params stay unsharded until it). Then
 * fsdp_optimizer_step, as always: its grad norm is the norm over every
 * parameter of the model, so it must span every stage.
 *
 * What the runtime guarantees and checks: module compute on the compute
 * stream, in the order you call pipe_forward / pipe_backward; one line and
 * exit 2 for a microbatch run twice, a backward before its forward, a
 * schedule that returns with a microbatch unfinished, or a send / receive
 * whose partner disagrees or never comes (names both ranks and the
 * microbatch).
 * What the grader checks (stages 11 and 12): see HANDOUT.md. */
#ifndef HWFSDP_HW_PIPE_H
#define HWFSDP_HW_PIPE_H

#include "hw_fsdp.h"

typedef enum { PIPE_GPIPE = 0, PIPE_1F1B = 1 } PipeSchedule;

typedef struct {
    Dev *dev;
    Stream *stream;           /* the compute stream: where module compute runs */
    int stage, stages;        /* p and P */
    int microbatches;         /* M */
    PipeSchedule schedule;    /* --pp-schedule: gpipe (all forwards, then the backwards B0 .. B(M-1)) or 1f1b */
    int prev, next;           /* world ranks of this shard on stage p-1 / p+1; -1 at either end */
    size_t act_numel;         /* floats of one microbatch's activation between stages: (B / M) * T * D */
    Model *model;             /* this stage's modules (FsdpConfig.model) */
} PipeInfo;

typedef struct Pipe Pipe;     /* the runtime's */

const PipeInfo *pipe_info(const Pipe *pipe);
float *pipe_forward(Pipe *pipe, int mb, float *in);
float *pipe_backward(Pipe *pipe, int mb, float *dout);

/* Yours (stages 11 and 12, in hw_fsdp.c): one step's schedule. */
void pipe_schedule(Pipe *pipe);

#endif
