/* flag_check.h — the stage-10 flags a hw_fsdp.c can silently ignore, checked
 * from what its hooks queue in the run's first step (runtime.h:
 * dev_watch_collectives), so that a stage before 10 run with them stops with
 * one line instead of running another schedule under the flag's name:
 *   --backward-prefetch P (given on the command line): where each module's
 *     backward all-gather (labelled with the module's name) was issued. If
 *     that is exactly the schedule of another policy, the hooks ignore
 *     FsdpConfig.backward_prefetch: one line naming a module, the hook that
 *     issued its all-gather and the hook P asks for.
 *   --single-comm-stream: every all-gather and reduce-scatter of the run
 *     runs on one stream: the first on a second stream, in any step, stops
 *     the run with one line naming the streams (the only statement of this
 *     rule: the grader finds such a run stopped).
 * Any other wrong schedule (a stage 10 bug, not the flag ignored) runs on:
 * the grader's prefetch_policy check finds it in the trace. */
#ifndef HWFSDP_FLAG_CHECK_H
#define HWFSDP_FLAG_CHECK_H

#include "driver/options.h"
#include "model/model.h"
#include "runtime/json.h"

#define FLAG_CHECK_STREAMS 8

/* Who issued a module's first backward all-gather. */
typedef struct {
    int issuer;                   /* the issuing module's index; -1: none seen */
    int post;                     /* 1: in its post_backward, 0: in its pre_backward */
    int consistent;               /* 0: a later all-gather of the module was issued elsewhere */
} Issued;

typedef struct {
    const Options *opt;
    const Model *model;
    int step;                     /* the step whose backward prefetch is watched: the run's first */
    int prefetch_done;            /* 1 after that step's check (flag_check_end) */
    Issued *issued;               /* [n_modules] in model order; NULL: no flag to check */
    int n_streams;                /* streams the all-gathers and reduce-scatters ran on */
    int stream[FLAG_CHECK_STREAMS];           /* their stream_index */
    const char *stream_name[FLAG_CHECK_STREAMS];
} FlagCheck;

/* run.json's "prefetch_schedule" (the one statement of the backward-prefetch
 * rule, which this file checks and the grader's prefetch_policy check reads):
 * {"policy": P, "issued_in": {module: [issuing module, hook]}} for every
 * module of m. Policy pre: module i's all-gather in module i+1's pre_backward;
 * post: in module i+1's post_backward; none, and the backward's first module
 * (the last in model order) under any policy: in its own pre_backward. */
void flag_check_schedule_json(Json *j, const Model *m, BackwardPrefetch p);

/* Watch the collectives this rank issues: the backward prefetch of step `step`
 * (its first microbatch), and with --single-comm-stream the streams of every step. */
void flag_check_begin(Dev *dev, FlagCheck *fc, const Options *o, const Model *m, int step);
/* After that step's first backward: stop with one line if the hooks follow
 * another prefetch policy; then flag_check_free, unless --single-comm-stream
 * keeps the streams watched to the end of the run. */
void flag_check_end(Dev *dev, FlagCheck *fc);
/* Stop watching and free (a no-op after flag_check_end). */
void flag_check_free(Dev *dev, FlagCheck *fc);

#endif
