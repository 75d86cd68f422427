/* trainer.c — the steps every schedule runs (trainer.h): each module's
 * forward and backward between the student's hooks, called as PyTorch
 * autograd calls FSDP2's, and the optimizer step in its hook. The schedules
 * call them: train_step.c's accumulation loop and pipeline.c (--pp). */
#include "driver/trainer.h"

#include <math.h>
#include <stdio.h>

#include "model/model.h"
#include "model/optim.h"
#include "runtime/runtime.h"

void trainer_at(Trainer *t, int step, const char *module, Phase phase) {
    dev_set_scope(t->dev, step, module, phase_name(phase));
}

/* The unsharded grads of a module's backward, zeroed, as autograd allocates
 * them; grads kept from the previous microbatch are accumulated into. */
static void alloc_unsharded_grads(Trainer *t, Module *mod) {
    for (int j = 0; j < mod->n_params; j++) {
        Param *p = &mod->params[j];
        if (p->grad) continue;
        char name[96];
        snprintf(name, sizeof name, "%s.grad", p->name);
        p->grad = dev_alloc_f32(t->dev, p->numel, MEM_UNSHARDED_GRAD, name);
        dev_memset_async(t->run.stream, p->grad, 0, p->numel * sizeof(float));
    }
}

/* After post_backward: the grads are the student's, unless the module was
 * told not to sync (mod->requires_gradient_sync 0): then what it left in
 * Param.grad, still the allocation the probes captured for this backward, is
 * kept for the next microbatch, as autograd keeps .grad. A grad freed or
 * replaced anyway is dropped: the next backward starts it from zero, the
 * microbatch's gradient is lost, and the grader's checks say where. */
static void after_post_backward(Trainer *t, Module *mod) {
    const Captured *grads = &t->probes.grads;
    for (int j = 0; j < mod->n_params; j++) {
        Param *p = &mod->params[j];
        int kept = !mod->requires_gradient_sync && p->grad && grads->id[j] &&
                   dev_mem_live_id_containing(t->dev, p->grad) == grads->id[j];
        if (!kept) p->grad = NULL;
    }
}

/* A hook call, in its scope, with its memory recorded (probes.h). */
#define HOOK(t, s, module, phase, call)                                  \
    do {                                                                 \
        trainer_at(t, s, module, phase);                                 \
        probe_hook_begin((t)->dev, &(t)->probes);                        \
        call;                                                            \
        probe_hook_end((t)->dev, &(t)->probes, s, module, phase_name(phase)); \
    } while (0)

/* One module's forward, between its hooks. */
static void forward_module(Trainer *t, int s, Module *mod) {
    Fsdp *f = t->fsdp;
    HOOK(t, s, mod->name, PHASE_PRE_FORWARD, fsdp_pre_forward(f, mod));
    probe_params_ready(t->dev, &t->probes, mod, s, phase_name(PHASE_PRE_FORWARD), 0);
    trainer_at(t, s, mod->name, PHASE_FORWARD);
    module_forward(t->model, mod, &t->run);
    HOOK(t, s, mod->name, PHASE_POST_FORWARD, fsdp_post_forward(f, mod));
    probe_after_post_forward(t->dev, &t->probes, s, mod);
}

/* One module's backward, between its hooks; a block that recomputes
 * (model.h: module_recomputes, from --ac, --ac-every or --ac-op) runs its
 * forward again first, between its forward hooks. */
static void backward_module(Trainer *t, int s, Module *mod) {
    Model *m = t->model;
    Fsdp *f = t->fsdp;
    HOOK(t, s, mod->name, PHASE_PRE_BACKWARD, fsdp_pre_backward(f, mod));
    if (module_recomputes(&t->run, mod)) { /* activation checkpointing: the forward again */
        HOOK(t, s, mod->name, PHASE_RECOMPUTE_PRE_FORWARD, fsdp_pre_forward(f, mod));
        probe_params_ready(t->dev, &t->probes, mod, s, phase_name(PHASE_RECOMPUTE_PRE_FORWARD), 0);
        trainer_at(t, s, mod->name, PHASE_RECOMPUTE);
        module_recompute(m, mod, &t->run);
        HOOK(t, s, mod->name, PHASE_RECOMPUTE_POST_FORWARD, fsdp_post_forward(f, mod));
    }
    trainer_at(t, s, mod->name, PHASE_BACKWARD);
    probe_params_ready(t->dev, &t->probes, mod, s, phase_name(PHASE_PRE_BACKWARD), 1);
    alloc_unsharded_grads(t, mod);
    probe_grads_allocated(t->dev, &t->probes, mod);
    module_backward(m, mod, &t->run);
    HOOK(t, s, mod->name, PHASE_POST_BACKWARD, fsdp_post_backward(f, mod));
    probe_after_post_backward(t->dev, &t->probes, s, mod);
    after_post_backward(t, mod);
}

void trainer_forward(Trainer *t, int s) {
    Model *m = t->model;
    for (int i = 0; i < m->n_modules; i++) forward_module(t, s, &m->modules[i]);
}

void trainer_backward(Trainer *t, int s) {
    Model *m = t->model;
    for (int i = m->n_modules - 1; i >= 0; i--) backward_module(t, s, &m->modules[i]);
    HOOK(t, s, "root", PHASE_FINISH_BACKWARD, fsdp_finish_backward(t->fsdp));
    probe_grad_state(t->dev, &t->probes, s);
}

float trainer_optimizer_step(Trainer *t, int s) {
    float grad_norm = NAN;
    probe_grad_padding(t->dev, &t->probes, s); /* the grad shards the optimizer reads: padding rows zero */
    HOOK(t, s, "optimizer", PHASE_OPTIMIZER,
         grad_norm = fsdp_optimizer_step(t->fsdp, lr_at_step(&t->opt->optim, s), s + 1));
    return grad_norm;
}
#undef HOOK
