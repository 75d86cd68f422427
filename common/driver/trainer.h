/* trainer.h — one rank's training state, shared by the loop (train_step.c)
 * and the pipeline runtime (pipeline.c, --pp: hw_pipe.h). */
#ifndef HWFSDP_TRAINER_H
#define HWFSDP_TRAINER_H

#include <stdint.h>

#include "driver/flag_check.h"
#include "driver/options.h"
#include "driver/probes.h"
#include "hw_fsdp.h"
#include "model/model.h"

typedef struct Pipe Pipe;

typedef struct {
    Dev *dev;
    const Options *opt;
    Model *model;                       /* what the hooks see: the whole model, or with --pp this stage's modules */
    Model *full;                        /* the whole model (== model without --pp) */
    Fsdp *fsdp;
    ModelRun run;
    Probes probes;
    FlagCheck flags;                    /* the stage-10 flags against the first step's collectives */
    int32_t *inputs, *targets;          /* [B*T] device: this step's batch */
    int32_t *host_inputs, *host_targets;
    float *host_loss;                   /* [K] each microbatch's mean loss (K = --grad-accum, or --microbatches) */
    Pipe *pipe;                         /* --pp: the pipeline runtime (pipeline.c); NULL otherwise */
} Trainer;

/* One module's forward or backward (on t->run's microbatch), between its
 * hooks, as the loop runs them; the end of one backward (finish_backward). */
void trainer_forward_module(Trainer *t, int s, Module *mod);
void trainer_backward_module(Trainer *t, int s, Module *mod);
void trainer_finish_backward(Trainer *t, int s);

/* pipeline.c. pipe_stage_model: this rank's stage of `full` (hw_pipe.h's split):
 * a Model over its contiguous modules, renumbered 0..n-1; *first_param: the
 * offset of its first parameter in full's layout (model_param_offset). */
Model *pipe_stage_model(const Model *full, int P, int stage, size_t *first_param);
void pipe_stage_model_free(Model *stage);
/* The mesh of a pipeline run: 1-D over the stage's S ranks (group "stage<p>"). */
void pipe_mesh_build(Dev *dev, DeviceMesh *mesh, int P);
Pipe *pipe_create(Trainer *t);
void pipe_destroy(Pipe *p);
/* One step: the student's pipe_schedule, then the check that every microbatch ran. */
void pipe_run_step(Pipe *p, int s);
/* The shard of the data this rank reads: j of S (without --pp: its rank of the world). */
int pipe_data_shard(const Options *o, int rank, int *shards);

#endif
