/* checkpoint.h — checkpoints in safetensors with torchtitan's tensor names:
 * the weights, and (from --save) the AdamW state as "optim.<name>.exp_avg" /
 * ".exp_avg_sq" plus the step in the metadata. Writes are atomic. */
#ifndef HWFSDP_CHECKPOINT_H
#define HWFSDP_CHECKPOINT_H

#include "model/model.h"

/* Weights (and, from a checkpoint written by --save, the AdamW state and the
 * step) into host arrays [n_params_total] in model_param_offset order;
 * *exp_avg / *exp_avg_sq are allocated only when the file has them. Returns
 * the step to continue from (0 for plain weights). */
int checkpoint_load(const Model *m, const char *path, float *w, float **exp_avg, float **exp_avg_sq);
/* Write host arrays (exp_avg / exp_avg_sq may be NULL: weights only). */
void checkpoint_save(const Model *m, const char *path, const float *w, const float *exp_avg,
                     const float *exp_avg_sq, int step);
/* --save during training: every rank gathers the full weights and AdamW state
 * from the DTensors (collectives on the compute stream; a flat param's pieces
 * too, device.h PLACEMENT_FLAT: the same file as per param); rank 0 writes. */
void checkpoint_write(Dev *dev, Model *m, const char *path, int step);
/* Resuming: give every DTensor its rows of the saved AdamW state (after
 * fsdp_init; the student's optimizer creates state only where it is NULL); a
 * flat unit gets one zeroed [S] allocation each, its params views into them. */
void checkpoint_restore_optimizer(Dev *dev, Model *m, const float *exp_avg, const float *exp_avg_sq);

#endif
