/* pipeline.h — the runtime's side of hw_pipe.h (--pp), as the loop
 * (train_step.c) uses it: the split of the model into stages, the stage's
 * mesh, and one step of the student's pipe_schedule. pipeline.c runs each
 * microbatch through trainer.h's steps, over microbatch.h's microbatches. */
#ifndef HWFSDP_PIPELINE_H
#define HWFSDP_PIPELINE_H

#include <stddef.h>

#include "driver/options.h"
#include "driver/trainer.h"
#include "hw_pipe.h"
#include "model/model.h"

/* pipe_stage_model: this rank's stage of `full` (hw_pipe.h's split): a Model
 * over its contiguous modules, renumbered 0..n-1; *first_param: the offset of
 * its first parameter in full's layout (model_param_offset). */
Model *pipe_stage_model(const Model *full, int P, int stage, size_t *first_param);
void pipe_stage_model_free(Model *stage);
/* The mesh of a pipeline run: 1-D over the stage's S ranks (group "stage<p>"). */
void pipe_mesh_build(Dev *dev, DeviceMesh *mesh, int P);
/* The pipeline runtime of trainer t (its microbatches: t->mb). */
Pipe *pipe_create(Trainer *t);
void pipe_destroy(Pipe *p);
/* One step: the student's pipe_schedule over the step's microbatches, then
 * the check that every microbatch ran forward and backward. */
void pipe_run_step(Pipe *p, int s);
/* The shard of the data this rank reads: j of S (without --pp: its rank of the world). */
int pipe_data_shard(const Options *o, int rank, int *shards);

#endif
