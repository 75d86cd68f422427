/* pipeline.c — the runtime's side of hw_pipe.h (--pp, stages 11 and 12): the
 * split of the modules into stages, the stage's mesh, and pipe_forward /
 * pipe_backward, which run one microbatch (microbatch.h) through this stage's
 * modules with the student's FSDP hooks around each (trainer.h's steps, the
 * ones the accumulation loop runs). The student's pipe_schedule decides their
 * order and moves the activations. */
#include "driver/pipeline.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "driver/microbatch.h"
#include "driver/pipe_split.h"
#include "driver/trainer.h"
#include "hw_pipe.h"
#include "runtime/facts.h"
#include "runtime/phase.h"
#include "runtime/runtime.h"
#include "runtime/util.h"

struct Pipe {
    PipeInfo info;
    Trainer *t;
    int step;                 /* the step pipe_schedule is running; -1 outside it */
    ActsSlots *acts;          /* one set of saved activations per microbatch */
    unsigned char *fwd, *bwd; /* [M] this step's forwards / backwards run */
    int backwards;            /* backwards run this step */
};

/* ------------------------------------------------------------- the split */

Model *pipe_stage_model(const Model *full, int P, int stage, size_t *first_param) {
    int first, last; /* pipe_split.h: the one definition of the split (the flag check refused an empty stage) */
    if (!pipe_split(full->cfg.n_layers, P, stage, &first, &last)) fatal("--pp %d: stage %d would hold no module", P, stage);
    Model *m = xcalloc(1, sizeof *m);
    m->cfg = full->cfg;
    m->n_modules = last - first + 1;
    m->modules = full->modules + first;
    for (int i = 0; i < m->n_modules; i++) {
        m->modules[i].index = i; /* forward order within the stage: what the hooks index by */
        for (int j = 0; j < m->modules[i].n_params; j++) m->n_params_total += m->modules[i].params[j].numel;
    }
    *first_param = model_param_offset(full, &m->modules[0].params[0]);
    return m;
}

void pipe_stage_model_free(Model *stage) { free(stage); }

void pipe_mesh_build(Dev *dev, DeviceMesh *mesh, int P) {
    const int W = dev_world_size(dev), S = W / P;
    memset(mesh, 0, sizeof *mesh);
    mesh->size = W;
    for (int r = 0; r < W && r < WORLD_MAX_RANKS; r++) mesh->ranks[r] = r;
    mesh->ndim = 1;
    mesh->shape[0] = S;
    mesh->shape[1] = 1;
    const int stage = dev_rank(dev) / S; /* stage p: ranks p*S .. p*S+S-1 */
    mesh->shard_group = P == 1 ? dev_world_group(dev) : dev_group_new_of(dev, stage, "stage", stage * S, 1, S);
    dev_fact_mesh(dev, 1, &S, (const char *const[]){"shard"}); /* within the stage */
}

int pipe_data_shard(const Options *o, int rank, int *shards) {
    if (!o->pp) {
        *shards = o->world.world_size;
        return rank;
    }
    *shards = o->world.world_size / o->pp;
    return rank % *shards;
}

/* ----------------------------------------------------------- the runtime */

Pipe *pipe_create(Trainer *t) {
    const Options *o = t->opt;
    const int W = dev_world_size(t->dev), P = o->pp, S = W / P, rank = dev_rank(t->dev), stage = rank / S;
    const int M = t->mb.K; /* --microbatches */
    Pipe *p = xcalloc(1, sizeof *p);
    p->t = t;
    p->step = -1;
    p->info = (PipeInfo){.dev = t->dev,
                         .stream = t->run.stream,
                         .stage = stage,
                         .stages = P,
                         .microbatches = M,
                         .schedule = o->pp_schedule,
                         .prev = stage > 0 ? rank - S : -1,
                         .next = stage < P - 1 ? rank + S : -1,
                         .act_numel = t->mb.B / (size_t)M * t->mb.T * (size_t)o->model.dim,
                         .model = t->model};
    p->acts = model_acts_slots(t->model, M);
    const char **names = xmalloc((size_t)t->model->n_modules * sizeof *names);
    for (int i = 0; i < t->model->n_modules; i++) names[i] = t->model->modules[i].name;
    dev_fact_pipe_stage(t->dev, stage, P, names, t->model->n_modules, stage * S, S); /* run.json's stage map */
    free(names);
    p->fwd = xcalloc((size_t)M, 1);
    p->bwd = xcalloc((size_t)M, 1);
    return p;
}

void pipe_destroy(Pipe *p) {
    if (!p) return;
    model_acts_slots_free(p->acts);
    free(p->fwd);
    free(p->bwd);
    free(p);
}

const PipeInfo *pipe_info(const Pipe *pipe) { return &pipe->info; }

/* The model runs microbatch mb: its sequences (microbatch.h), its saved activations. */
static void use_microbatch(Pipe *p, int mb) {
    microbatch_use(&p->t->mb, &p->t->run, mb);
    model_acts_use(p->acts, mb);
}

static void check_call(const Pipe *p, const char *what, int mb) {
    const PipeInfo *in = &p->info;
    if (p->step < 0) fatal("%s(microbatch %d) on rank %d: called outside pipe_schedule", what, mb, dev_rank(in->dev));
    if (mb < 0 || mb >= in->microbatches)
        fatal("%s on stage %d (rank %d): microbatch %d is not one of 0..%d (--microbatches %d)", what, in->stage,
              dev_rank(in->dev), mb, in->microbatches - 1, in->microbatches);
}

/* A buffer the student hands over: a live allocation of act_numel floats. */
static void check_handed(const Pipe *p, const char *what, int mb, const float *buf, const char *name) {
    const PipeInfo *in = &p->info;
    size_t want = in->act_numel * sizeof(float), have = dev_mem_live_size_containing(in->dev, buf);
    if (!have)
        fatal("%s(microbatch %d) on stage %d (rank %d): %s is not a live allocation (allocate it with dev_alloc, "
              "receive into it, and hand it over once)", what, mb, in->stage, dev_rank(in->dev), name);
    if (have < want)
        fatal("%s(microbatch %d) on stage %d (rank %d): %s holds %zu bytes, less than one activation (act_numel = %zu "
              "floats)", what, mb, in->stage, dev_rank(in->dev), name, have, in->act_numel);
}

float *pipe_forward(Pipe *p, int mb, float *in) {
    const PipeInfo *pi = &p->info;
    Trainer *t = p->t;
    const int s = p->step, rank = dev_rank(pi->dev);
    check_call(p, "pipe_forward", mb);
    if (p->fwd[mb])
        fatal("pipe_forward on stage %d (rank %d): microbatch %d's forward already ran this step (each microbatch "
              "runs forward once per step)", pi->stage, rank, mb);
    if (pi->stage == 0 && in)
        fatal("pipe_forward(microbatch %d) on stage 0 (rank %d): `in` must be NULL: the first stage reads the tokens",
              mb, rank);
    if (pi->stage > 0 && !in)
        fatal("pipe_forward(microbatch %d) on stage %d (rank %d): `in` is NULL: pass the activation received from "
              "stage %d (rank %d)", mb, pi->stage, rank, pi->stage - 1, pi->prev);
    if (in) check_handed(p, "pipe_forward", mb, in, "in");
    use_microbatch(p, mb);
    t->run.h = in;
    trainer_forward(t, s);
    float *out = NULL;
    if (pi->next < 0) microbatch_record_loss(&t->mb, &t->run, mb);
    else out = t->run.h;
    t->run.h = NULL;
    p->fwd[mb] = 1;
    dev_set_scope(pi->dev, s, "pipe", phase_name(PHASE_P2P)); /* the schedule's sends and receives */
    return out;
}

float *pipe_backward(Pipe *p, int mb, float *dout) {
    const PipeInfo *pi = &p->info;
    Trainer *t = p->t;
    const int s = p->step, rank = dev_rank(pi->dev);
    check_call(p, "pipe_backward", mb);
    if (!p->fwd[mb])
        fatal("pipe_backward(microbatch %d) on stage %d (rank %d): its forward has not run this step (a backward "
              "needs its forward's saved activations)", mb, pi->stage, rank);
    if (p->bwd[mb])
        fatal("pipe_backward on stage %d (rank %d): microbatch %d's backward already ran this step", pi->stage, rank,
              mb);
    if (pi->next < 0 && dout)
        fatal("pipe_backward(microbatch %d) on the last stage (rank %d): `dout` must be NULL: the loss starts the "
              "backward", mb, rank);
    if (pi->next >= 0 && !dout)
        fatal("pipe_backward(microbatch %d) on stage %d (rank %d): `dout` is NULL: pass the grad received from "
              "stage %d (rank %d)", mb, pi->stage, rank, pi->stage + 1, pi->next);
    if (dout) check_handed(p, "pipe_backward", mb, dout, "dout");
    use_microbatch(p, mb); /* the modules' requires_gradient_sync / reshard_after_backward: the schedule's */
    t->run.dh = dout;
    trainer_backward(t, s);
    float *out = pi->prev < 0 ? NULL : t->run.dh; /* the embedding's backward consumed it on stage 0 */
    t->run.dh = NULL;
    p->bwd[mb] = 1;
    p->backwards++;
    dev_set_scope(pi->dev, s, "pipe", phase_name(PHASE_P2P));
    return out;
}

void pipe_run_step(Pipe *p, int s) {
    Trainer *t = p->t;
    const PipeInfo *pi = &p->info;
    const int M = pi->microbatches;
    p->step = s;
    p->backwards = 0;
    memset(p->fwd, 0, (size_t)M);
    memset(p->bwd, 0, (size_t)M);
    microbatch_set_sync(t->model, 1, 1); /* the schedule may clear them before a backward (hw_pipe.h) */
    dev_set_scope(pi->dev, s, "pipe", phase_name(PHASE_P2P));
    pipe_schedule(p);
    for (int mb = 0; mb < M; mb++)
        if (!p->fwd[mb] || !p->bwd[mb])
            fatal("pipe_schedule returned on stage %d (rank %d) with microbatch %d's %s not run: every microbatch runs "
                  "forward and backward once per step", pi->stage, dev_rank(pi->dev), mb,
                  !p->fwd[mb] ? "forward" : "backward");
    p->step = -1; /* the loop puts the whole batch back (microbatch_whole) */
}

/* A binary whose hw_fsdp.c has no schedule (stages 01-10) answers --pp with one line. */
__attribute__((weak)) void pipe_schedule(Pipe *pipe) {
    fatal("--pp needs a pipeline schedule, and this binary's hw_fsdp.c defines no pipe_schedule (the "
          "schedule of hw_pipe.h) on rank %d", dev_rank(pipe->info.dev));
}
