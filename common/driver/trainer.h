/* trainer.h — one rank's training state, and the steps every schedule runs
 * on it (trainer.c): one forward or backward of the current microbatch
 * through this rank's modules with the student's hooks around each, and the
 * optimizer step. The schedules sit above: train_step.c's accumulation loop
 * and pipeline.c's pipe_forward / pipe_backward (--pp: hw_pipe.h). */
#ifndef HWFSDP_TRAINER_H
#define HWFSDP_TRAINER_H

#include <stdint.h>

#include "driver/flag_check.h"
#include "driver/microbatch.h"
#include "driver/options.h"
#include "driver/probes.h"
#include "hw_fsdp.h"
#include "hw_pipe.h"
#include "model/model.h"
#include "runtime/phase.h"

typedef struct {
    Dev *dev;
    const Options *opt;
    Model *model;                       /* what the hooks see: the whole model, or with --pp this stage's modules */
    Model *full;                        /* the whole model (== model without --pp) */
    Fsdp *fsdp;
    ModelRun run;                       /* the microbatch being run (microbatch_use), else the whole batch */
    Microbatches mb;                    /* the step's batch and its K microbatches (microbatch.h) */
    Probes probes;
    FlagCheck flags;                    /* the stage-10 flags against the first step's collectives */
    int32_t *host_inputs, *host_targets; /* [B*T] host: the step's batch as read */
    Pipe *pipe;                         /* --pp: the pipeline runtime (pipeline.c); NULL otherwise */
} Trainer;

/* What the host does now (module, phase), for traces and snapshots. */
void trainer_at(Trainer *t, int step, const char *module, Phase phase);
/* The forward of t->run's microbatch through every module of t->model, in
 * order, each between its hooks; the input is the tokens (the first module)
 * or t->run.h, the output is t->run.h, or the loss at t->run.loss. */
void trainer_forward(Trainer *t, int s);
/* Its backward, modules in reverse order (a block that recomputes,
 * module_recomputes: its forward again first), then finish_backward: FSDP2's root post-backward callback,
 * once per backward, so once per microbatch. */
void trainer_backward(Trainer *t, int s);
/* The step's optimizer step, in its hook (after the schedule and
 * microbatch_whole). Returns the grad norm. */
float trainer_optimizer_step(Trainer *t, int s);

#endif
