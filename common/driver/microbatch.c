/* microbatch.c — see microbatch.h. */
#include "driver/microbatch.h"

#include <stdlib.h>

#include "runtime/runtime.h"
#include "runtime/util.h"

int microbatch_count(const Options *o) { return o->pp ? o->microbatches : o->grad_accum; }

void microbatches_init(Microbatches *mb, Dev *dev, const Options *o) {
    const size_t N = o->batch_size * o->seq_len;
    *mb = (Microbatches){.dev = dev, .K = microbatch_count(o), .named = o->pp != 0, .B = o->batch_size,
                         .T = o->seq_len};
    mb->inputs = dev_alloc(dev, N * sizeof(int32_t), MEM_ACTIVATION, "inputs");
    mb->targets = dev_alloc(dev, N * sizeof(int32_t), MEM_ACTIVATION, "targets");
    mb->host_loss = xcalloc((size_t)mb->K, sizeof(float));
}

void microbatches_free(Microbatches *mb) {
    dev_free(mb->dev, mb->inputs);
    dev_free(mb->dev, mb->targets);
    free(mb->host_loss);
    mb->inputs = mb->targets = NULL;
    mb->host_loss = NULL;
}

void microbatch_use(const Microbatches *mb, ModelRun *run, int k) {
    const size_t Bm = mb->B / (size_t)mb->K; /* options.c: K divides B */
    dev_set_microbatch(mb->dev, mb->K > 1 || mb->named ? k : -1);
    run->B = Bm;
    run->inputs = mb->inputs + (size_t)k * Bm * mb->T;
    run->targets = mb->targets + (size_t)k * Bm * mb->T;
}

void microbatch_set_sync(Model *m, int requires_gradient_sync, int reshard_after_backward) {
    for (int i = 0; i < m->n_modules; i++) {
        m->modules[i].requires_gradient_sync = requires_gradient_sync;
        m->modules[i].reshard_after_backward = reshard_after_backward;
    }
}

void microbatch_whole(const Microbatches *mb, ModelRun *run, Model *m) {
    dev_set_microbatch(mb->dev, -1);
    run->B = mb->B;
    run->inputs = mb->inputs;
    run->targets = mb->targets;
    microbatch_set_sync(m, 1, 1);
}

void microbatch_record_loss(Microbatches *mb, const ModelRun *run, int k) {
    dev_memcpy_async(run->stream, &mb->host_loss[k], run->loss, sizeof(float)); /* device -> host */
}

double microbatch_step_loss(const Microbatches *mb) {
    double loss = 0;
    for (int k = 0; k < mb->K; k++) loss += mb->host_loss[k];
    return loss / mb->K;
}
