/* optim.c — AdamW with torch.optim.AdamW (single-tensor, foreach=False)
 * semantics, linear LR warmup, and the clip_grad_norm_ coefficient.
 *
 * torch computes its scalar factors in double (Python floats) and applies them
 * to float32 tensors one elementwise op at a time; we do the same, in the same
 * order, so a C step and a torch step agree to the last bit or two. torch's
 * CPU kernels (AVX2/AVX-512 builds) compute add_(x, alpha) and addcmul_ with a
 * fused multiply-add, so we use fmaf there; with that, the results are
 * bit-identical to torch 1.13 on this machine. */
#include "model/optim.h"
#include "model/ops_math.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

AdamWConfig adamw_default_config(void) {
    AdamWConfig c;
    c.lr = 8e-4f;
    c.beta1 = 0.9f;
    c.beta2 = 0.95f;
    c.eps = 1e-8f;
    c.weight_decay = 0.1f;
    c.warmup_steps = 2;    /* torchtitan debugmodel */
    c.max_norm = 1.0f;
    return c;
}

/* The double a user meant when they wrote the decimal that became this float:
 * the shortest decimal that rounds back to f (0.9f -> 0.9, not 0.899999976).
 * torch keeps hyperparameters as Python floats (doubles), so this is what its
 * scalar math sees. */
static double as_decimal(float f) {
    if (!isfinite(f) || f == 0.0f) return (double)f;
    char buf[48];
    for (int prec = 6; prec <= 9; prec++) {
        snprintf(buf, sizeof buf, "%.*g", prec, (double)f);
        double d = strtod(buf, NULL);
        if ((float)d == f) return d;
    }
    return (double)f;
}

float lr_at_step(const AdamWConfig *c, int step) {
    double lr = as_decimal(c->lr);
    if (c->warmup_steps > 0 && step < c->warmup_steps) {
        /* LambdaLR: base_lr * factor, factor = (step + 1) / (warmup + 1) */
        double factor = (double)(step + 1) / (double)(c->warmup_steps + 1);
        return (float)(lr * factor);
    }
    return (float)lr;
}

float clip_coefficient(const AdamWConfig *c, float total_norm) {
    return clip_coef(c->max_norm, total_norm); /* ops_math.h */
}

AdamWScalars adamw_scalars(const AdamWConfig *c, float lr, int t) {
    const double lr_d = as_decimal(lr);
    const double beta1 = as_decimal(c->beta1), beta2 = as_decimal(c->beta2);
    const double eps = as_decimal(c->eps), wd = as_decimal(c->weight_decay);
    const double step = (double)t;
    /* scalars exactly as torch forms them (double), then cast to the tensor
     * dtype when applied */
    AdamWScalars k;
    k.decay = (float)(1.0 - lr_d * wd);                         /* param.mul_(1 - lr*wd) */
    k.b1 = (float)beta1;
    k.one_minus_b1 = (float)(1.0 - beta1);
    k.b2 = (float)beta2;
    k.one_minus_b2 = (float)(1.0 - beta2);
    const double bias_correction1 = 1.0 - pow(beta1, step);
    const double bias_correction2 = 1.0 - pow(beta2, step);
    k.neg_step_size = (float)(-(lr_d / bias_correction1));
    k.bc2_sqrt = (float)sqrt(bias_correction2);
    k.eps = (float)eps;
    return k;
}

void adamw_update(float *param, const float *grad, float *exp_avg, float *exp_avg_sq, size_t n,
                  const AdamWConfig *c, float lr, int t, float grad_scale) {
    const AdamWScalars k = adamw_scalars(c, lr, t);
    for (size_t i = 0; i < n; i++) adamw_elem(&param[i], grad[i], &exp_avg[i], &exp_avg_sq[i], &k, grad_scale);
}
