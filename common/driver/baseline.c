/* baseline.c — the non-sharded reference: plain data parallel (DDP).
 *
 * Every rank keeps the full parameters; after each module's backward its
 * grads are all-reduced (average) in place; the optimizer steps on the full
 * tensors. With --world 1 and the global batch (--batch-size W*B) this is the
 * non-sharded baseline every FSDP stage is compared with. It implements the
 * hooks of hw_fsdp.h like any student file, so it runs through the same loop.
 * With --param-dtype bf16 (stage 08's policy) compute reads a bfloat16 copy
 * of each full param, made in pre_forward / pre_backward and freed after the
 * module: the same rounded values a sharded run all-gathers. --reduce-dtype
 * has no effect here (its all-reduce stays float32). */
#include <math.h>
#include <stdlib.h>

#include "hw_fsdp.h"
#include "runtime/util.h"

struct Fsdp {
    Dev *dev;
    Model *model;
    Stream *compute;
    int param_bf16;
    int *in_backward;     /* [n_modules]: pre_backward ran (an --ac recompute keeps the bf16 copy) */
    AdamWConfig optim;
};

Fsdp *fsdp_init(const FsdpConfig *cfg) {
    Fsdp *f = xcalloc(1, sizeof *f);
    f->dev = cfg->dev;
    f->model = cfg->model;
    f->compute = dev_compute_stream(cfg->dev);
    f->optim = cfg->optim;
    f->param_bf16 = cfg->mp.param_dtype == DTYPE_BF16;
    f->in_backward = xcalloc((size_t)f->model->n_modules, sizeof(int));
    for (int i = 0; i < f->model->n_modules; i++)
        for (int j = 0; j < f->model->modules[i].n_params; j++) {
            Param *p = &f->model->modules[i].params[j];
            DTensor *dt = &p->dt;
            dt->local = p->data; /* replicated: the full tensor is the local tensor */
            dt->global_rows = dt->local_rows = dt->padded_rows = p->shape[0];
            dt->row_numel = p->numel / p->shape[0];
            dt->row_offset = 0;
            dt->mesh = cfg->mesh;
            dt->placement = PLACEMENT_REPLICATE;
        }
    return f;
}

/* --param-dtype bf16: the module's params rounded to bfloat16 for compute */
static void cast_params(Fsdp *f, Module *mod) {
    for (int j = 0; f->param_bf16 && j < mod->n_params; j++) {
        Param *p = &mod->params[j];
        if (p->data_bf16) continue; /* --ac: the recompute's pre_forward inside backward */
        p->data_bf16 = dev_alloc_bf16(f->dev, p->numel, MEM_UNSHARDED_PARAM, p->name);
        launch_cast_to_bf16(f->compute, p->data_bf16, p->data, p->numel);
    }
}

static void free_cast(Fsdp *f, Module *mod) {
    for (int j = 0; j < mod->n_params; j++) {
        dev_free(f->dev, mod->params[j].data_bf16);
        mod->params[j].data_bf16 = NULL;
    }
}

void fsdp_pre_forward(Fsdp *f, Module *mod) { cast_params(f, mod); }
void fsdp_post_forward(Fsdp *f, Module *mod) {
    if (!f->in_backward[mod->index]) free_cast(f, mod);
}
void fsdp_pre_backward(Fsdp *f, Module *mod) {
    f->in_backward[mod->index] = 1;
    cast_params(f, mod);
}

void fsdp_post_backward(Fsdp *f, Module *mod) {
    f->in_backward[mod->index] = 0;
    free_cast(f, mod);
    for (int j = 0; j < mod->n_params; j++) {
        Param *p = &mod->params[j];
        coll_all_reduce(f->dev, p->grad, p->grad, p->numel, RED_AVG, f->compute, mod->name);
        p->dt.grad = p->grad; /* kept until the optimizer step */
    }
}

void fsdp_finish_backward(Fsdp *f) { (void)f; }

float fsdp_optimizer_step(Fsdp *f, float lr, int t) {
    float *sumsq = dev_alloc_f32(f->dev, 1, MEM_TEMP, "grad_sumsq");
    dev_memset_async(f->compute, sumsq, 0, sizeof(float));
    Model *m = f->model;
    for (int i = 0; i < m->n_modules; i++)
        for (int j = 0; j < m->modules[i].n_params; j++) {
            Param *p = &m->modules[i].params[j];
            launch_sumsq_accumulate(f->compute, sumsq, p->dt.grad, p->numel);
        }
    for (int i = 0; i < m->n_modules; i++)
        for (int j = 0; j < m->modules[i].n_params; j++) {
            Param *p = &m->modules[i].params[j];
            DTensor *dt = &p->dt;
            if (!dt->exp_avg) {
                dt->exp_avg = dev_alloc_f32(f->dev, p->numel, MEM_OPTIM_STATE, p->name);
                dt->exp_avg_sq = dev_alloc_f32(f->dev, p->numel, MEM_OPTIM_STATE, p->name);
                dev_memset_async(f->compute, dt->exp_avg, 0, p->numel * sizeof(float));
                dev_memset_async(f->compute, dt->exp_avg_sq, 0, p->numel * sizeof(float));
            }
            launch_adamw(f->compute, dt->local, dt->grad, dt->exp_avg, dt->exp_avg_sq, p->numel, &f->optim, lr, t,
                         sumsq);
            dev_free(f->dev, dt->grad);
            dt->grad = NULL;
        }
    float host_sumsq = 0;
    dev_memcpy_async(f->compute, &host_sumsq, sumsq, sizeof(float));
    dev_stream_synchronize(f->compute);
    dev_free(f->dev, sumsq);
    return sqrtf(host_sumsq);
}

void fsdp_destroy(Fsdp *f) {
    Model *m = f->model;
    for (int i = 0; i < m->n_modules; i++)
        for (int j = 0; j < m->modules[i].n_params; j++) {
            Param *p = &m->modules[i].params[j];
            dev_free(f->dev, p->dt.exp_avg);
            dev_free(f->dev, p->dt.exp_avg_sq);
            dev_free(f->dev, p->data);
            p->data = p->dt.local = NULL;
        }
    free(f->in_backward);
    free(f);
}
