/* kernels_cpu.c — the CPU stream kernels (kernels.h): argument unpacking
 * around the plain C ops. They run on a stream's worker thread. */
#include "model/kernels.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model/ops.h"
#include "runtime/util.h"

/* --- bf16 tensors (kernels.h: the [a] tensors under bf16) ----------------
 * The ops of ops.h are float32. A bf16 tensor is widened (exact) into this
 * kernel's own float32 working copy, the op runs, and what it wrote is
 * rounded back once. The working copies are the CPU kernel's, like BLAS's
 * packing buffers (host memory of the worker thread, not device memory): a
 * GPU kernel reads the bf16 words directly, and the memory count is of the
 * device tensors, 2 bytes an element. */
typedef struct {
    void *dev; /* the tensor: bf16 words, or the float32 tensor itself */
    float *f;  /* what the op reads and writes */
    size_t n;
    int bf16;
} View;

/* a tensor the op reads (NULL stays NULL) */
static View view_in(const void *p, size_t n, int bf16) {
    View v = {(void *)p, (float *)p, n, bf16 && p};
    if (v.bf16) {
        v.f = xmalloc(n * sizeof(float));
        cast_from_bf16(v.f, p, n);
    }
    return v;
}
/* a tensor the op writes (acc = 0) or accumulates into (acc = 1: widened first) */
static View view_out(void *p, size_t n, int bf16, int acc) {
    if (acc || !bf16 || !p) return view_in(p, n, bf16);
    View v = {p, xmalloc(n * sizeof(float)), n, 1};
    return v;
}
/* rounds what the op wrote into the tensor (once), frees the working copy */
static void put_back(View *v) {
    if (!v->bf16) return;
    cast_to_bf16(v->dev, v->f, v->n);
    free(v->f);
}
/* frees the working copy of a tensor the op only read */
static void drop(View *v) {
    if (v->bf16) free(v->f);
}

void kcpu_embedding_forward(void *a) {
    EmbArgs *x = a;
    if (!x->bf16) {
        embedding_forward(x->out, x->tok, x->w, x->N, x->D);
        return;
    }
    /* bf16: the rows are copied as words (the loader checked every id < V) */
    uint16_t *out = x->out;
    const uint16_t *w = x->w;
    for (size_t n = 0; n < x->N; n++) {
        if (x->tok[n] < 0) fatal("embedding_forward: negative token id %d at row %zu", (int)x->tok[n], n);
        memcpy(out + n * x->D, w + (size_t)x->tok[n] * x->D, x->D * sizeof *out);
    }
}
void kcpu_embedding_backward(void *a) {
    EmbArgs *x = a; /* out = dwte (float32), w = dout [a] */
    View d = view_in(x->w, x->N * x->D, x->bf16);
    embedding_backward(x->out, d.f, x->tok, x->N, x->D);
    drop(&d);
}

void kcpu_rmsnorm_forward(void *a) {
    NormArgs *x = a;
    View in = view_in(x->in, x->N * x->D, x->bf16), w = view_in(x->w, x->D, x->bf16);
    View out = view_out(x->out, x->N * x->D, x->bf16, 0);
    rmsnorm_forward(out.f, x->rstd, in.f, w.f, x->N, x->D, x->eps);
    put_back(&out);
    drop(&in);
    drop(&w);
}
void kcpu_rmsnorm_backward(void *a) {
    NormBwdArgs *x = a;
    size_t nd = x->N * x->D;
    View dout = view_in(x->dout, nd, x->bf16), in = view_in(x->in, nd, x->bf16), w = view_in(x->w, x->D, x->bf16);
    View dinp = view_out(x->dinp, nd, x->bf16, 1);
    rmsnorm_backward(dinp.f, x->dw, dout.f, in.f, w.f, x->rstd, x->N, x->D);
    put_back(&dinp);
    drop(&dout);
    drop(&in);
    drop(&w);
}

void kcpu_matmul_forward(void *a) {
    MmArgs *x = a;
    View in = view_in(x->in, x->N * x->C, x->bf16), w = view_in(x->w, x->OC * x->C, x->bf16);
    View out = view_out(x->out, x->N * x->OC, x->bf16, 0);
    matmul_forward(out.f, in.f, w.f, x->N, x->C, x->OC);
    put_back(&out);
    drop(&in);
    drop(&w);
}
void kcpu_matmul_backward(void *a) {
    MmBwdArgs *x = a;
    View dout = view_in(x->dout, x->N * x->OC, x->bf16), in = view_in(x->in, x->N * x->C, x->bf16);
    View w = view_in(x->w, x->OC * x->C, x->bf16), dinp = view_out(x->dinp, x->N * x->C, x->bf16, 1);
    matmul_backward(dinp.f, x->dw, dout.f, in.f, w.f, x->N, x->C, x->OC);
    put_back(&dinp);
    drop(&dout);
    drop(&in);
    drop(&w);
}

void kcpu_rope(void *a) {
    RopeArgs *r = a;
    View v = view_out(r->x, r->B * r->T * r->nh * r->hd, r->bf16, 1);
    if (r->backward) rope_backward(v.f, r->cos, r->sin, r->B, r->T, r->nh, r->hd);
    else rope_forward(v.f, r->cos, r->sin, r->B, r->T, r->nh, r->hd);
    put_back(&v);
}
void kcpu_rope_tables(void *a) { RopeTabArgs *r = a; rope_tables(r->cos, r->sin, r->T, r->hd, r->theta, &r->scaling); }

void kcpu_attention_forward(void *a) {
    AttArgs *x = a;
    size_t nq = x->B * x->T * x->H * x->hd, nk = x->B * x->T * x->KV * x->hd;
    View q = view_in(x->q, nq, x->bf16), k = view_in(x->k, nk, x->bf16), v = view_in(x->v, nk, x->bf16);
    View out = view_out(x->out, nq, x->bf16, 0);
    attention_forward(out.f, x->lse, q.f, k.f, v.f, x->B, x->T, x->H, x->KV, x->hd);
    put_back(&out);
    drop(&q);
    drop(&k);
    drop(&v);
}
void kcpu_attention_backward(void *a) {
    AttBwdArgs *x = a;
    size_t nq = x->B * x->T * x->H * x->hd, nk = x->B * x->T * x->KV * x->hd;
    View q = view_in(x->q, nq, x->bf16), k = view_in(x->k, nk, x->bf16), v = view_in(x->v, nk, x->bf16);
    View out = view_in(x->out, nq, x->bf16), dout = view_in(x->dout, nq, x->bf16);
    View dq = view_out(x->dq, nq, x->bf16, 1), dk = view_out(x->dk, nk, x->bf16, 1), dv = view_out(x->dv, nk, x->bf16, 1);
    attention_backward(dq.f, dk.f, dv.f, dout.f, q.f, k.f, v.f, out.f, x->lse, x->scratch, x->B, x->T, x->H, x->KV,
                       x->hd);
    put_back(&dq);
    put_back(&dk);
    put_back(&dv);
    drop(&q);
    drop(&k);
    drop(&v);
    drop(&out);
    drop(&dout);
}
size_t kcpu_attention_scratch_floats(size_t B, size_t T, size_t H) {
    (void)B;
    (void)H;
    return attention_scratch_floats(T); /* one head's tiles at a time */
}

void kcpu_swiglu_forward(void *a) {
    SwiArgs *x = a;
    View va = view_in(x->a, x->n, x->bf16), vb = view_in(x->b, x->n, x->bf16), out = view_out(x->out, x->n, x->bf16, 0);
    swiglu_forward(out.f, va.f, vb.f, x->n);
    put_back(&out);
    drop(&va);
    drop(&vb);
}
void kcpu_swiglu_backward(void *a) {
    SwiBwdArgs *x = a;
    View va = view_in(x->a, x->n, x->bf16), vb = view_in(x->b, x->n, x->bf16), dout = view_in(x->dout, x->n, x->bf16);
    View da = view_out(x->da, x->n, x->bf16, 1), db = view_out(x->db, x->n, x->bf16, 1);
    swiglu_backward(da.f, db.f, dout.f, va.f, vb.f, x->n);
    put_back(&da);
    put_back(&db);
    drop(&va);
    drop(&vb);
    drop(&dout);
}

void kcpu_add(void *a) {
    AddArgs *x = a; /* out may alias a or b: widen both before writing */
    View va = view_in(x->a, x->n, x->bf16), vb = view_in(x->b, x->n, x->bf16), out = view_out(x->out, x->n, x->bf16, 0);
    add_forward(out.f, va.f, vb.f, x->n);
    put_back(&out);
    drop(&va);
    drop(&vb);
}
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
