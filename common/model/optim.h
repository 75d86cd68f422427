/* optim.h — AdamW (torch.optim.AdamW semantics), LR warmup, grad clipping.
 *
 * The update works on any (param, grad, state) arrays: a full tensor or one
 * rank's shard, so FSDP steps each local shard with its own sharded state. */
#ifndef HWFSDP_OPTIM_H
#define HWFSDP_OPTIM_H

#include <stddef.h>

#include "device.h"

/* AdamWConfig (lr, betas, eps, weight decay, warmup, max_norm) is in device.h:
 * student code passes it to launch_adamw. */

/* Defaults above. */
AdamWConfig adamw_default_config(void);

/* LR for 0-based step s: linear warmup as torchtitan's
 * lr * (s + 1) / (warmup_steps + 1) for s < warmup_steps, then lr
 * (warmup_steps = 0: constant lr). */
float lr_at_step(const AdamWConfig *c, int step);

/* clip_grad_norm_ factor: min(1, max_norm / (total_norm + 1e-6)); 1 when
 * clipping is off. Multiply every grad by it before the update. */
float clip_coefficient(const AdamWConfig *c, float total_norm);

/* The per-step scalars of the update, formed as torch forms them (in double
 * from the decimal hyperparameters, then cast to float). Shared by the CPU
 * update and the CUDA kernel. */
typedef struct {
    float decay;          /* 1 - lr * weight_decay */
    float b1, one_minus_b1, b2, one_minus_b2;
    float neg_step_size;  /* -lr / (1 - beta1^t) */
    float bc2_sqrt;       /* sqrt(1 - beta2^t) */
    float eps;
} AdamWScalars;
AdamWScalars adamw_scalars(const AdamWConfig *c, float lr, int t);

/* One AdamW update of n elements, t = 1-based step count for bias correction:
 *   g = grad * grad_scale
 *   param *= 1 - lr * weight_decay
 *   m = beta1 m + (1 - beta1) g ;  v = beta2 v + (1 - beta2) g^2
 *   param -= lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
 * computed in the same order as torch's single-tensor AdamW. */
void adamw_update(float *param, const float *grad, float *exp_avg, float *exp_avg_sq, size_t n,
                  const AdamWConfig *c, float lr, int t, float grad_scale);

#endif
