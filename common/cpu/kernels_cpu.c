/* kernels_cpu.c — the CPU stream kernels (kernels.h): argument unpacking
 * around the plain C ops. They run on a stream's worker thread. */
#include "model/kernels.h"

#include <math.h>

#include "model/ops.h"

void kcpu_embedding_forward(void *a) { EmbArgs *x = a; embedding_forward(x->out, x->tok, x->w, x->N, x->D); }
void kcpu_embedding_backward(void *a) { EmbArgs *x = a; embedding_backward(x->out, x->w, x->tok, x->N, x->D); }

void kcpu_rmsnorm_forward(void *a) {
    NormArgs *x = a;
    rmsnorm_forward(x->out, x->rstd, x->in, x->w, x->N, x->D, x->eps);
}
void kcpu_rmsnorm_backward(void *a) {
    NormBwdArgs *x = a;
    rmsnorm_backward(x->dinp, x->dw, x->dout, x->in, x->w, x->rstd, x->N, x->D);
}

void kcpu_matmul_forward(void *a) { MmArgs *x = a; matmul_forward(x->out, x->in, x->w, x->N, x->C, x->OC); }
void kcpu_matmul_backward(void *a) {
    MmBwdArgs *x = a;
    matmul_backward(x->dinp, x->dw, x->dout, x->in, x->w, x->N, x->C, x->OC);
}

void kcpu_rope(void *a) {
    RopeArgs *r = a;
    if (r->backward) rope_backward(r->x, r->cos, r->sin, r->B, r->T, r->nh, r->hd);
    else rope_forward(r->x, r->cos, r->sin, r->B, r->T, r->nh, r->hd);
}
void kcpu_rope_tables(void *a) { RopeTabArgs *r = a; rope_tables(r->cos, r->sin, r->T, r->hd, r->theta); }

void kcpu_attention_forward(void *a) {
    AttArgs *x = a;
    attention_forward(x->out, x->lse, x->q, x->k, x->v, x->B, x->T, x->H, x->KV, x->hd);
}
void kcpu_attention_backward(void *a) {
    AttBwdArgs *x = a;
    attention_backward(x->dq, x->dk, x->dv, x->dout, x->q, x->k, x->v, x->out, x->lse, x->scratch, x->B, x->T, x->H,
                       x->KV, x->hd);
}
size_t kcpu_attention_scratch_floats(size_t B, size_t T, size_t H) {
    (void)B;
    (void)H;
    return attention_scratch_floats(T); /* one head's tiles at a time */
}

void kcpu_swiglu_forward(void *a) { SwiArgs *x = a; swiglu_forward(x->out, x->a, x->b, x->n); }
void kcpu_swiglu_backward(void *a) { SwiBwdArgs *x = a; swiglu_backward(x->da, x->db, x->dout, x->a, x->b, x->n); }

void kcpu_add(void *a) { AddArgs *x = a; add_forward(x->out, x->a, x->b, x->n); }
void kcpu_cast_to_bf16(void *a) { CastArgs *x = a; cast_to_bf16(x->bf16, x->f32, x->n); }
void kcpu_cast_from_bf16(void *a) { CastArgs *x = a; cast_from_bf16(x->f32, x->bf16, x->n); }
void kcpu_cast_batch_to_bf16(void *a) {
    CastBatchArgs *x = a;
    for (size_t c = 0; c < x->n; c++) cast_to_bf16(x->list[c].dst, x->list[c].src, x->list[c].n);
}

void kcpu_crossentropy_forward(void *a) {
    CeArgs *x = a;
    *x->loss = crossentropy_forward(x->logits, x->tgt, x->N, x->V);
}
void kcpu_crossentropy_backward(void *a) {
    CeArgs *x = a;
    crossentropy_backward(x->dlogits, x->logits, x->tgt, x->N, x->V, 1.0f / (float)x->mean_over);
}

void kcpu_sumsq_accumulate(void *a) { SumsqArgs *s = a; *s->acc += (float)sumsq(s->x, s->n); }

void kcpu_adamw(void *a) {
    AdamArgs *x = a;
    float norm = sqrtf(*x->total_sumsq), coef = clip_coefficient(&x->c, norm);
    if (x->clip_out) *x->clip_out = coef;
    adamw_update(x->param, x->grad, x->m, x->v, x->n, &x->c, x->lr, x->t, coef);
}

/* The CPU backends' kernels (cpu_internal.h: CPU_BACKEND_OPS). */
#define KCPU_ENTRY(name) .name = kcpu_##name,
const KernelTable kcpu_kernels = {HWFSDP_KERNEL_LIST(KCPU_ENTRY).attention_scratch_floats = kcpu_attention_scratch_floats};
#undef KCPU_ENTRY
