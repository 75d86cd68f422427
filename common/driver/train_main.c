/* train_main.c — the training binary every FSDP implementation links with:
 * flags, initial weights (seed or --load), the token data and the world;
 * then every rank runs train_rank (train_step.c), which calls the hooks of
 * hw_fsdp.h exactly as PyTorch autograd calls FSDP2's. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "driver/checkpoint.h"
#include "driver/flag_check.h"
#include "driver/flat.h"
#include "driver/options.h"
#include "driver/train.h"
#include "model/data.h"
#include "model/model.h"
#include "runtime/dry.h"
#include "runtime/json.h"
#include "runtime/profile.h"
#include "runtime/runtime.h"
#include "runtime/util.h"

/* run.json: the run's configuration, for plots, the grader and references; written again after the run
 * (w and job not NULL) with what the run used (runtime/facts.h: groups, mesh, stage map, vocabularies) and,
 * on a profile with a memory capacity, whether it fitted. */
/* The rules of the run, stated by the code that defines them: "prefetch_schedule" (flag_check.h), null
 * with --pp (each rank holds one stage's modules; the prefetch policy is the FSDP stages' rule), and
 * "recompute_blocks": the blocks that re-run their forward and its hooks in backward (model.h,
 * ac_block_recomputes: the predicate the training loop follows); after a run whose params are Flat (stage 13),
 * "flat_units": the modules of each unit by --bucket-mb's rule (flat.h, flat_bucket_units). */
typedef struct {
    const Model *m;
    const TrainJob *job; /* NULL before the run */
} RulesCtx;

static void run_rules(Json *j, const Options *o, const void *ctx) {
    const RulesCtx *rc = ctx;
    const Model *m = rc->m;
    json_key(j, "prefetch_schedule");
    if (o->pp) json_null(j);
    else flag_check_schedule_json(j, m, o->backward_prefetch);
    json_key(j, "recompute_blocks");
    json_array_begin(j);
    for (int i = 0; i < m->n_modules; i++)
        if (m->modules[i].kind == MOD_BLOCK && ac_block_recomputes(o->ac, m->modules[i].layer))
            json_string(j, m->modules[i].name);
    json_array_end(j);
    if (rc->job && rc->job->flat) {
        int *unit_of = xmalloc((size_t)m->n_modules * sizeof *unit_of);
        flat_bucket_units(m, (size_t)(o->bucket_mb * 1048576.0), unit_of);
        json_key(j, "flat_units"); /* [["embedding", "block0"], ["block1", "head"]] */
        json_array_begin(j);
        for (int i = 0; i < m->n_modules; i++) {
            if (unit_of[i] == i) {
                if (i) json_array_end(j);
                json_array_begin(j);
            }
            json_string(j, m->modules[i].name);
        }
        if (m->n_modules) json_array_end(j);
        json_array_end(j);
        free(unit_of);
    }
}

static void write_run_json(const Options *o, const Model *m, World *w, const TrainJob *job) {
    char host[256] = "unknown";
    gethostname(host, sizeof host - 1);
    RulesCtx rc = {m, job};
    RunFacts facts = {.n_params = m->n_params_total, .device = dev_is_cuda_build() ? "cuda" : "cpu", .host = host, .world = w,
                       .rules = run_rules, .rules_ctx = &rc,
                       /* the profile's memory holds on the modelled clock (the CPU build's; dev_mem_capacity) */
                       .hbm_capacity_bytes = dev_is_cuda_build() ? 0 : o->world.profile->hbm_capacity_bytes,
                       .fits = job ? !job->over_capacity : -1};
    Json j = {0};
    options_run_json(&j, o, &facts);
    json_line_end(&j);
    char *path = xasprintf("%s/run.json", o->out_dir);
    json_write_file(&j, path);
    free(path);
}

int main(int argc, char **argv) {
    Options o;
    parse_options(argc, argv, &o);
    Model *m = model_create(&o.model);
    const size_t init_bytes = m->n_params_total * sizeof(float);
    float *init, *exp_avg = NULL, *exp_avg_sq = NULL;
    int start_step = 0;
    if (o.world.dry_run) {
        /* no values (263 GiB for 70B): address space only; the h2d copies from it are priced, never run */
        init = dry_reserve(init_bytes, "the initial weights in host memory (TrainJob.init; nothing behind them in "
                                       "a dry run)");
        if (!init) fatal("dry run: no address space left for the %zu bytes of initial weights", init_bytes);
    } else {
        init = xmalloc(init_bytes);
    }
    if (o.load_path) start_step = checkpoint_load(m, o.load_path, init, &exp_avg, &exp_avg_sq);
    else if (!o.world.dry_run) model_init_host(m, o.seed, init);
    if (o.save_init_path) {
        checkpoint_save(m, o.save_init_path, init, NULL, NULL, 0);
        printf("wrote initial weights (%zu parameters) to %s\n", m->n_params_total, o.save_init_path);
        free(init);
        model_destroy(m);
        return 0;
    }
    TokenData data = data_load(o.data_path);
    data_check(&data, o.seq_len, o.model.vocab_size);
    World *w = world_create(&o.world);
    if (o.out_dir) {
        make_dirs(o.out_dir);
        if (world_first_local_rank(w) == 0) write_run_json(&o, m, NULL, NULL);
    }
    if (start_step > 0 && !o.quiet)
        printf("resuming from %s at step %d (optimizer state restored)\n", o.load_path, start_step);
    TrainJob job = {&o, init, exp_avg, exp_avg_sq, start_step, &data, 0, 0, 0};
    world_run(w, train_rank, &job);
    if (o.out_dir && world_first_local_rank(w) == 0) write_run_json(&o, m, w, &job);
    world_destroy(w);
    data_free(&data);
    if (o.world.dry_run) dry_release(init, init_bytes);
    else free(init);
    free(exp_avg);
    free(exp_avg_sq);
    model_destroy(m);
    return job.exit_code;
}
