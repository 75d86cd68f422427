/* phase.h — the phases of a training step: where the host was when it queued
 * an op (dev_set_scope's phase, every trace slice's args.phase, every
 * allocation's "phase" in the snapshots). The driver sets them (trainer.c, train_step.c,
 * pipeline.c); the grader reads them by the words of this table, which
 * grader/trace_names.py is generated from (tools/trace_names.c). */
#ifndef HWFSDP_PHASE_H
#define HWFSDP_PHASE_H

/* The phases, in the order a step visits them. */
typedef enum {
    PHASE_INIT = 0,                /* fsdp_init and the model's setup, before step 1 */
    PHASE_DATA,                    /* the step's batch copied in */
    PHASE_PRE_FORWARD,             /* fsdp_pre_forward */
    PHASE_FORWARD,                 /* a module's forward kernels */
    PHASE_POST_FORWARD,            /* fsdp_post_forward */
    PHASE_PRE_BACKWARD,            /* fsdp_pre_backward */
    PHASE_RECOMPUTE_PRE_FORWARD,   /* --ac: fsdp_pre_forward again, inside the backward */
    PHASE_RECOMPUTE,               /* --ac: the forward's kernels again */
    PHASE_RECOMPUTE_POST_FORWARD,  /* --ac: fsdp_post_forward again */
    PHASE_BACKWARD,                /* a module's backward kernels */
    PHASE_POST_BACKWARD,           /* fsdp_post_backward */
    PHASE_FINISH_BACKWARD,         /* fsdp_finish_backward, once per backward */
    PHASE_OPTIMIZER,               /* fsdp_optimizer_step */
    PHASE_DISCARD,                 /* --forward-only: the activations dropped */
    PHASE_P2P,                     /* --pp: the schedule's sends and receives (module "pipe") */
    PHASE_END,                     /* after the last step */
    PHASE_COUNT /* keep last */
} Phase;

/* Which pass a phase belongs to. */
typedef enum { PASS_NONE = 0, PASS_FORWARD, PASS_BACKWARD } PhasePass;

typedef struct {
    const char *name; /* the trace's word: "pre_forward", "recompute.pre_forward", ... */
    PhasePass pass;   /* forward, backward (the --ac recompute included) or neither */
    const char *hook; /* the hw_fsdp.h hook the phase calls ("fsdp_pre_forward"), or NULL */
} PhaseInfo;

/* The row of phase p (NULL past the last). */
const PhaseInfo *phase_info(Phase p);
/* Its word ("?" for a number that is no phase). */
const char *phase_name(Phase p);
/* 1 if `name` is phase p's word (a scope's or a trace record's phase; NULL never is). */
int phase_is(const char *name, Phase p);

#endif
