/* phase.c — the phases' table (phase.h): each row by its enum, no order to keep in step. */
#include "runtime/phase.h"

#include <string.h>

static const PhaseInfo PHASES[PHASE_COUNT] = {
    [PHASE_INIT] = {"init", PASS_NONE, NULL},
    [PHASE_DATA] = {"data", PASS_NONE, NULL},
    [PHASE_PRE_FORWARD] = {"pre_forward", PASS_FORWARD, "fsdp_pre_forward"},
    [PHASE_FORWARD] = {"forward", PASS_FORWARD, NULL},
    [PHASE_POST_FORWARD] = {"post_forward", PASS_FORWARD, "fsdp_post_forward"},
    [PHASE_PRE_BACKWARD] = {"pre_backward", PASS_BACKWARD, "fsdp_pre_backward"},
    [PHASE_RECOMPUTE_PRE_FORWARD] = {"recompute.pre_forward", PASS_BACKWARD, "fsdp_pre_forward"},
    [PHASE_RECOMPUTE] = {"recompute", PASS_BACKWARD, NULL},
    [PHASE_RECOMPUTE_POST_FORWARD] = {"recompute.post_forward", PASS_BACKWARD, "fsdp_post_forward"},
    [PHASE_BACKWARD] = {"backward", PASS_BACKWARD, NULL},
    [PHASE_POST_BACKWARD] = {"post_backward", PASS_BACKWARD, "fsdp_post_backward"},
    [PHASE_FINISH_BACKWARD] = {"finish_backward", PASS_BACKWARD, "fsdp_finish_backward"},
    [PHASE_OPTIMIZER] = {"optimizer", PASS_NONE, "fsdp_optimizer_step"},
    [PHASE_DISCARD] = {"discard", PASS_NONE, NULL},
    [PHASE_P2P] = {"p2p", PASS_NONE, NULL},
    [PHASE_END] = {"end", PASS_NONE, NULL},
};

const PhaseInfo *phase_info(Phase p) {
    if ((int)p < 0 || p >= PHASE_COUNT || !PHASES[p].name) return NULL; /* a phase added without a row */
    return &PHASES[p];
}

const char *phase_name(Phase p) {
    const PhaseInfo *i = phase_info(p);
    return i ? i->name : "?";
}

int phase_is(const char *name, Phase p) { return name && !strcmp(name, phase_name(p)); }
