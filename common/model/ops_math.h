/* ops_math.h — per-element math shared by the CPU ops (ops.c, optim.c) and
 * the CUDA kernels (cuda/kernels_cuda.cu), so the CPU tests exercise the
 * formulas the GPU runs. Plain C; __host__ __device__ under nvcc (HWFSDP_HD,
 * runtime/bf16.h, which also holds the bfloat16 conversions). */
#ifndef HWFSDP_OPS_MATH_H
#define HWFSDP_OPS_MATH_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "model/ops.h" /* RopeScaling */
#include "model/optim.h"
#include "runtime/bf16.h" /* HWFSDP_HD; bf16_from_f32 / bf16_to_f32 */

/* a * b rounded to float on its own. nvcc fuses a*b + c into one FMA by
 * default (one rounding instead of two); the CPU build (-std=c11, no -mfma)
 * never does. Where a formula should give the CPU's bits on the GPU, its
 * products go through this. */
#ifdef __CUDA_ARCH__
#define HWFSDP_MUL(a, b) __fmul_rn((a), (b))
#else
#define HWFSDP_MUL(a, b) ((a) * (b))
#endif

/* silu(a) b with silu(a) = a / (1 + exp(-a)); for a -> -inf, silu = -0 (no NaN) */
HWFSDP_HD float swiglu_elem(float a, float b) { return (a / (1.0f + expf(-a))) * b; }

/* sig = 1 / (1 + exp(-a)); d silu/da = sig (1 + a (1 - sig)):
 *   da += g b sig (1 + a (1 - sig)),   db += g silu(a) */
HWFSDP_HD void swiglu_backward_elem(float g, float a, float b, float *da, float *db) {
    float sig = 1.0f / (1.0f + expf(-a));
    float silu = a * sig;
    *da += g * b * (sig * (1.0f + a * (1.0f - sig)));
    *db += g * silu;
}

/* RoPE frequency of pair i: 1 / theta^(2i/hd), in float as torch forms it */
HWFSDP_HD float rope_freq(size_t i, size_t hd, float theta) { return 1.0f / powf(theta, (float)(2 * i) / (float)hd); }

/* Pair i's frequency under Llama 3.1's scaling (ops.h: RopeScaling, its three
 * bands), in float32: f = rope_freq, w = 2 pi / f its wavelength in positions,
 * C the original context. Unscaled when sc is NULL or sc->factor is 0. */
HWFSDP_HD float rope_freq_scaled(size_t i, size_t hd, float theta, const RopeScaling *sc) {
    float f = rope_freq(i, hd, theta);
    if (!sc || sc->factor == 0.0f) return f;
    const float two_pi = 6.28318530717958647692f;
    float w = two_pi / f;                                         /* positions per turn */
    if (w < sc->old_context / sc->high_freq_factor) return f;     /* short wave: as trained */
    if (w > sc->old_context / sc->low_freq_factor) return f / sc->factor; /* long wave: stretched */
    /* between: s runs from 0 (w = C / low_freq_factor) to 1 (w = C / high_freq_factor), linear in C / w */
    float s = (sc->old_context / w - sc->low_freq_factor) / (sc->high_freq_factor - sc->low_freq_factor);
    return (1.0f - s) * f / sc->factor + s * f;
}

/* the complex product (x0 + i x1)(c + i s): a rotation of the adjacent pair by
 * angle (s = sin, or -sin to undo); products rounded as on the CPU (no FMA) */
HWFSDP_HD void rope_pair(float *x0, float *x1, float c, float s) {
    float a = *x0, b = *x1;
    *x0 = HWFSDP_MUL(a, c) - HWFSDP_MUL(b, s);
    *x1 = HWFSDP_MUL(a, s) + HWFSDP_MUL(b, c);
}

/* clip_grad_norm_: coef = max_norm / (total_norm + 1e-6) in float32, clamped to
 * at most 1 (a NaN norm stays NaN); 1 when clipping is off */
HWFSDP_HD float clip_coef(float max_norm, float total_norm) {
    if (!(max_norm > 0.0f)) return 1.0f;
    float coef = max_norm / (total_norm + 1e-6f);
    return coef > 1.0f ? 1.0f : coef;
}

/* one AdamW element, in torch's single-tensor order (see adamw_update) */
HWFSDP_HD void adamw_elem(float *param, float grad, float *exp_avg, float *exp_avg_sq, const AdamWScalars *k,
                          float grad_scale) {
    float g = grad * grad_scale;                      /* clip: grad.mul_(coef) */
    float p = HWFSDP_MUL(*param, k->decay);           /* param.mul_(1 - lr*wd) (not fused into the last add) */
    float m = fmaf(g, k->one_minus_b1, *exp_avg * k->b1); /* exp_avg.mul_(beta1).add_(grad, alpha=1-beta1) */
    float v = fmaf(k->one_minus_b2 * g, g, *exp_avg_sq * k->b2); /* exp_avg_sq.mul_(beta2).addcmul_(g, g, 1-beta2) */
    float denom = sqrtf(v) / k->bc2_sqrt + k->eps;    /* (v.sqrt() / bc2_sqrt).add_(eps) */
    *param = p + k->neg_step_size * m / denom;        /* addcdiv_(m, denom, -step_size) */
    *exp_avg = m;
    *exp_avg_sq = v;
}

#endif
