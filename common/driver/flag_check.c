/* flag_check.c — see flag_check.h. */
#include "driver/flag_check.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/phase.h"
#include "runtime/runtime.h"
#include "runtime/util.h"

static int module_index(const Model *m, const char *name) {
    if (!name) return -1;
    for (int i = 0; i < m->n_modules; i++)
        if (!strcmp(m->modules[i].name, name)) return i;
    return -1;
}

/* Where policy p issues module i's backward all-gather: in module *issuer's
 * pre_backward (*post 0) or post_backward (*post 1). The backward runs the
 * modules from the last to the first; the first of them has nobody before it. */
static void expected(const Model *m, BackwardPrefetch p, int i, int *issuer, int *post) {
    if (i == m->n_modules - 1 || p == BACKWARD_PREFETCH_NONE) {
        *issuer = i;
        *post = 0;
    } else {
        *issuer = i + 1;
        *post = p == BACKWARD_PREFETCH_POST;
    }
}

/* --single-comm-stream holds for the whole run: the first all-gather or
 * reduce-scatter on a second stream, in any step or microbatch, stops it. */
static void check_single_stream(const FlagCheck *fc) {
    if (!fc->opt->single_comm_stream || fc->n_streams < 2) return;
    char names[256] = "";
    size_t len = 0;
    for (int k = 0; k < fc->n_streams && len < sizeof names; k++)
        len += (size_t)snprintf(names + len, sizeof names - len, "%s%s", k ? ", " : "", fc->stream_name[k]);
    fatal("--single-comm-stream: the all-gathers and reduce-scatters ran on %d streams (%s): with "
          "--single-comm-stream every one goes on one stream (FsdpConfig.single_comm_stream; HANDOUT.md, "
          "--single-comm-stream)",
          fc->n_streams, names);
}

static void on_collective(void *ctx, const CollIssue *c) {
    FlagCheck *fc = ctx;
    int ag = c->kind == COLL_ALL_GATHER;
    if (!ag && c->kind != COLL_REDUCE_SCATTER) return;
    int seen = 0;
    for (int k = 0; k < fc->n_streams; k++) seen |= fc->stream[k] == c->stream;
    if (!seen && fc->n_streams < FLAG_CHECK_STREAMS) {
        fc->stream[fc->n_streams] = c->stream;
        fc->stream_name[fc->n_streams++] = c->stream_name;
    }
    check_single_stream(fc);
    /* the backward prefetch: where the watched step's first microbatch issued each all-gather */
    if (fc->prefetch_done || c->step != fc->step || c->micro > 0) return;
    if (!ag || !c->phase) return;
    int post = phase_is(c->phase, PHASE_POST_BACKWARD);
    /* an --ac recompute's pre_forward runs inside the module's backward, after its pre_backward */
    if (!post && !phase_is(c->phase, PHASE_PRE_BACKWARD) && !phase_is(c->phase, PHASE_RECOMPUTE_PRE_FORWARD)) return;
    int target = module_index(fc->model, c->label), issuer = module_index(fc->model, c->module);
    if (target < 0 || issuer < 0) return;
    Issued *got = &fc->issued[target];
    if (got->issuer < 0) {
        got->issuer = issuer;
        got->post = post;
    } else if (got->issuer != issuer || got->post != post) {
        got->consistent = 0;
    }
}

void flag_check_schedule_json(Json *j, const Model *m, BackwardPrefetch p) {
    json_object_begin(j);
    json_key(j, "policy");
    json_string(j, backward_prefetch_name(p));
    json_key(j, "issued_in");
    json_object_begin(j);
    for (int i = 0; i < m->n_modules; i++) {
        int issuer, post;
        expected(m, p, i, &issuer, &post);
        json_key(j, m->modules[i].name);
        json_array_begin(j);
        json_string(j, m->modules[issuer].name);
        json_string(j, phase_name(post ? PHASE_POST_BACKWARD : PHASE_PRE_BACKWARD));
        json_array_end(j);
    }
    json_object_end(j);
    json_object_end(j);
}

void flag_check_begin(Dev *dev, FlagCheck *fc, const Options *o, const Model *m, int step) {
    int n = m->n_modules;
    *fc = (FlagCheck){.opt = o, .model = m, .step = step};
    if (!o->backward_prefetch_given && !o->single_comm_stream) return;
    fc->issued = xmalloc((size_t)n * sizeof *fc->issued);
    for (int i = 0; i < n; i++) fc->issued[i] = (Issued){.issuer = -1, .post = 0, .consistent = 1};
    dev_watch_collectives(dev, on_collective, fc);
}

/* 1 if every module's backward all-gather was issued once, or always in the
 * same hook, exactly where policy p issues it. */
static int follows(const FlagCheck *fc, BackwardPrefetch p) {
    for (int i = 0; i < fc->model->n_modules; i++) {
        int issuer, post;
        expected(fc->model, p, i, &issuer, &post);
        const Issued *got = &fc->issued[i];
        if (!got->consistent || got->issuer != issuer || got->post != post) return 0;
    }
    return 1;
}

static void check_prefetch(const FlagCheck *fc) {
    const Model *m = fc->model;
    BackwardPrefetch want = fc->opt->backward_prefetch;
    if (follows(fc, want)) return;
    static const BackwardPrefetch all[] = {BACKWARD_PREFETCH_PRE, BACKWARD_PREFETCH_POST, BACKWARD_PREFETCH_NONE};
    for (int k = 0; k < 3; k++) {
        BackwardPrefetch got = all[k];
        if (got == want || !follows(fc, got)) continue;
        for (int i = m->n_modules - 1; i >= 0; i--) { /* the first module of the backward where they differ */
            int issuer, post;
            expected(m, want, i, &issuer, &post);
            const Issued *at = &fc->issued[i];
            if (at->issuer == issuer && at->post == post) continue;
            fatal("--backward-prefetch %s: %s's backward all-gather was issued in %s's %s, not %s's %s: the hooks "
                  "follow --backward-prefetch %s's schedule, not %s's (FsdpConfig.backward_prefetch; HANDOUT.md, "
                  "--backward-prefetch)",
                  backward_prefetch_name(want), m->modules[i].name, m->modules[at->issuer].name,
                  phase_name(at->post ? PHASE_POST_BACKWARD : PHASE_PRE_BACKWARD), m->modules[issuer].name,
                  phase_name(post ? PHASE_POST_BACKWARD : PHASE_PRE_BACKWARD), backward_prefetch_name(got), backward_prefetch_name(want));
        }
    }
    /* another wrong schedule: the grader's prefetch_policy check names it */
}

void flag_check_end(Dev *dev, FlagCheck *fc) {
    if (!fc->issued || fc->prefetch_done) return;
    if (fc->opt->backward_prefetch_given) check_prefetch(fc);
    fc->prefetch_done = 1;
    if (!fc->opt->single_comm_stream) flag_check_free(dev, fc); /* else: the streams are watched to the end */
}

void flag_check_free(Dev *dev, FlagCheck *fc) {
    if (!fc->issued) return;
    dev_watch_collectives(dev, NULL, NULL);
    free(fc->issued);
    fc->issued = NULL;
}
