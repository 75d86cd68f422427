/* step_log.c — the per-step metrics (step_log.h). */
#include "driver/step_log.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/json.h"
#include "runtime/runtime.h"
#include "runtime/util.h"

void step_log_open(StepLog *l, Dev *dev, const char *out_dir) {
    l->metrics = NULL;
    l->over_capacity = 0;
    l->all = xcalloc((size_t)dev_executed_count(dev), sizeof(double)); /* a host exchange's values */
    if (dev_rank(dev) != 0 || !out_dir) return;
    char *path = xasprintf("%s/metrics.jsonl", out_dir);
    l->metrics = fopen(path, "w");
    if (!l->metrics) fatal("cannot write %s: %s", path, strerror(errno));
    free(path);
}

/* max over the executed ranks of the values the last host exchange gathered */
static double max_of(const double *all, int world) {
    double m = 0;
    for (int r = 0; r < world; r++) m = all[r] > m ? all[r] : m;
    return m;
}

/* This rank's clip coefficients of the step (the clip probe, runtime.h): the
 * smallest and largest any AdamW launch applied, and how many launches; with no
 * launch min and max are NaN, with too many to record launches is -1. */
typedef struct { double min, max, launches; } ClipStats;
static ClipStats clip_stats(Dev *dev) {
    float *coef = xmalloc(CLIP_PROBE_SLOTS * sizeof *coef); /* per rank: ranks may be threads */
    ClipStats c = {NAN, NAN, 0};
    int n = dev_clip_collect(dev, coef, CLIP_PROBE_SLOTS);
    c.launches = n;
    for (int i = 0; i < n; i++) {
        if (i == 0 || coef[i] < c.min) c.min = coef[i];
        if (i == 0 || coef[i] > c.max) c.max = coef[i];
    }
    free(coef);
    return c;
}

/* key: [v per executed rank] (every rank's, unless representative ranks stand in: run.json "executed_ranks"
 * says whose), each printed as json_g (significant digits) or, with digits < 0, as a whole number */
static void per_rank(Json *j, const char *key, const double *v, int world, int digits) {
    json_key(j, key);
    json_array_begin(j);
    for (int r = 0; r < world; r++) {
        if (digits < 0) json_fixed(j, v[r], 0);
        else json_g(j, v[r], digits);
    }
    json_array_end(j);
}

/* One line of metrics.jsonl (not finite: null; a grad norm never computed, with --forward-only: null too,
 * without "nan": the line is not bad for it). */
static void write_metrics_line(FILE *f, int step, double loss, float grad_norm, float lr, const double *peaks,
                               const double *clip, int world, double step_max_us, double tps,
                               double model_step_max_us, int bad, int dry, size_t capacity) {
    Json j = {0};
    json_object_begin(&j);
    json_key(&j, "step");
    json_int(&j, step + 1);
    json_key(&j, "loss");
    if (dry) json_null(&j); /* a dry run computes no value */
    else json_g(&j, loss, 9);
    json_key(&j, "grad_norm");
    if (clip) json_g(&j, (double)grad_norm, 9);
    else json_null(&j); /* --forward-only or a dry run: no norm (and no clip probe) */
    if (dry) {
        json_key(&j, "dry_run");
        json_bool(&j, 1);
    }
    json_key(&j, "lr");
    json_g(&j, (double)lr, 9);
    json_key(&j, "peak_mem_bytes");
    json_fixed(&j, max_of(peaks, world), 0);
    per_rank(&j, "peak_mem_bytes_per_rank", peaks, world, -1);
    if (capacity) { /* a profile with a memory capacity (teach has none: no key) */
        json_key(&j, "hbm_capacity_bytes");
        json_uint(&j, capacity);
        json_key(&j, "fits"); /* every rank's allocations of this step within it */
        json_bool(&j, max_of(peaks, world) <= (double)capacity);
    }
    if (clip) {
        per_rank(&j, "clip_coef_min_per_rank", clip, world, 9);
        per_rank(&j, "clip_coef_max_per_rank", clip + world, world, 9);
        per_rank(&j, "adamw_launches_per_rank", clip + 2 * world, world, -1);
    }
    json_key(&j, "step_ms");
    json_fixed(&j, step_max_us / 1000.0, 3);
    json_key(&j, "tokens_per_s"); /* on the wall clock: a dry run's says how fast it priced the step, nothing more */
    if (dry) json_null(&j);
    else json_fixed(&j, tps, 1);
    json_key(&j, "model_step_ms"); /* on the world's clock (dev_clock_name): the same on every run on the CPU */
    json_fixed(&j, model_step_max_us / 1000.0, 3);
    if (bad) {
        json_key(&j, "nan");
        json_bool(&j, 1);
    }
    json_object_end(&j);
    json_line_end(&j);
    if (fwrite(json_text(&j), 1, json_len(&j), f) != json_len(&j) || fflush(f))
        fatal("cannot write metrics.jsonl: %s", strerror(errno));
    json_free(&j);
}

int step_log_write(StepLog *l, Dev *dev, const Options *o, const ModelRun *run, int step, double loss_local,
                   float grad_norm, double step_us, double model_step_us) {
    /* W: the executed ranks, whose values the host exchanges gather (every rank's, unless representative
     * ranks stand in for the others: a dry run's, which has no loss to average) */
    const int W = dev_executed_count(dev);
    dev_host_allgather_f64(dev, loss_local, l->all);
    /* the mean over the data shards; with --pp only the last stage (ranks (P-1)*S ..) computed a loss */
    const int P = o->pp ? o->pp : 1, S = dev_world_size(dev) / P;
    double loss = 0;
    int shards = 0;
    for (int i = 0; i < W; i++)
        if (dev_executed_rank(dev, i) >= (P - 1) * S) loss += l->all[i], shards++;
    loss /= shards;
    const int dry = dev_dry_run(dev); /* no loss, grad norm or clip coefficient: nothing ran */
    double *peaks = xmalloc((size_t)W * sizeof(double)), *clip = NULL;
    dev_host_allgather_f64(dev, (double)dev_mem_peak(dev), peaks);
    const size_t capacity = dev_mem_capacity(dev); /* the same on every rank: one profile */
    if (capacity) {
        /* which ranks went past the device's memory so far; the lowest says so, the first time any did */
        dev_host_allgather_f64(dev, dev_mem_over_capacity(dev) ? 1.0 : 0.0, l->all);
        int first = -1;
        for (int i = W - 1; i >= 0; i--)
            if (l->all[i] != 0) first = i;
        if (first >= 0 && !l->over_capacity) {
            l->over_capacity = 1;
            if (dev_rank(dev) == dev_executed_rank(dev, first))
                fprintf(stderr, "error: %s%s; a GPU would stop here, the %s goes on and records that the "
                        "configuration does not fit (\"fits\": false in run.json and metrics.jsonl; exit status %d)\n",
                        dry ? "dry run: " : "", dev_mem_over_capacity(dev), dry ? "dry run" : "run",
                        EXIT_OVER_CAPACITY);
        }
    }
    if (!o->forward_only && !dry) {
        ClipStats c = clip_stats(dev);
        clip = xmalloc(3 * (size_t)W * sizeof(double));
        dev_host_allgather_f64(dev, c.min, clip);
        dev_host_allgather_f64(dev, c.max, clip + W);
        dev_host_allgather_f64(dev, c.launches, clip + 2 * W);
    }
    dev_host_allgather_f64(dev, step_us, l->all);
    double step_max = max_of(l->all, W);
    dev_host_allgather_f64(dev, model_step_us, l->all);
    double model_step_max = max_of(l->all, W);
    int bad = !dry && (!isfinite(loss) || (!o->forward_only && !isfinite(grad_norm)));
    if (dev_rank(dev) == 0) {
        double tps = (double)(run->B * run->T * (size_t)S) / (step_max * 1e-6); /* S data shards of B sequences */
        float lr = lr_at_step(&o->optim, step);
        if (l->metrics)
            write_metrics_line(l->metrics, step, loss, grad_norm, lr, peaks, clip, W, step_max, tps, model_step_max, bad,
                               dry, capacity);
        if (!o->quiet && dry) {
            /* the modelled clock's tokens per second per GPU: what the report (tools/simulate.py) reads too */
            double model_tps = (double)(run->B * run->T) / P / (model_step_max * 1e-6), peak = max_of(peaks, W);
            int gib = peak >= 1073741824.0;
            char over[48] = ""; /* past the device's memory: the line says so beside the figure */
            if (capacity && peak > (double)capacity)
                snprintf(over, sizeof over, " (over %.2fGiB)", (double)capacity / 1073741824.0);
            printf("step: %3d  loss: dry run  grad_norm: dry run  memory: %8.2f%s%s  lr: %.2e  modelled step: %.3fms  "
                   "modelled tokens/s/GPU: %.0f\n",
                   step + 1, peak / (gib ? 1073741824.0 : 1048576.0), gib ? "GiB" : "MiB", over, (double)lr,
                   model_step_max / 1000.0, model_tps);
        } else if (!o->quiet) {
            char norm[48]; /* --forward-only runs no backward: say so rather than print nan */
            if (o->forward_only) snprintf(norm, sizeof norm, "not computed (--forward-only)");
            else snprintf(norm, sizeof norm, "%8.4f", (double)grad_norm);
            printf("step: %3d  loss: %8.4f  grad_norm: %s  memory: %7.2fMiB  tps: %9.0f  lr: %.2e  %s: %.3fms\n",
                   step + 1, loss, norm, max_of(peaks, W) / 1048576.0, tps, (double)lr,
                   strcmp(dev_clock_name(dev), "model") ? "step" : "modelled step", model_step_max / 1000.0);
        }
        fflush(stdout);
        if (bad && o->forward_only)
            fprintf(stderr, "error: loss is not finite at step %d (loss %g; --forward-only computes no grad norm)\n",
                    step + 1, loss);
        else if (bad)
            fprintf(stderr, "error: %s is not finite at step %d (loss %g, grad_norm %g)\n",
                    isfinite(loss) ? "grad_norm" : "loss", step + 1, loss, (double)grad_norm);
    }
    free(peaks);
    free(clip);
    return bad;
}

void step_log_close(StepLog *l) {
    if (l->metrics) fclose(l->metrics);
    free(l->all);
    l->metrics = NULL;
    l->all = NULL;
}
