/* test_model.c — the whole model: gradient check by finite differences,
 * recompute (activation checkpointing: full, every N-th block, per op) equals
 * the plain backward bit for bit, config validation, and no activation leaks.
 *
 * Runs one rank through the real runtime (streams, allocator). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "runtime/runtime.h"
#include "model/model.h"
#include "runtime/util.h"

typedef struct {
    Model *m;
    size_t B, T;
    int32_t *inputs, *targets;      /* host */
    float *params;                  /* host copy of every parameter [n_params_total] */
    float *grads;                   /* host: analytic grads */
    AcPolicy ac;                    /* activation checkpointing (AC_NONE: none) */
    double loss;                    /* out */
} Job;

/* Forward (and backward if want_grads) on one rank; params from job->params. */
static void run_model(Dev *dev, Job *job, int want_grads) {
    Model *m = job->m;
    Stream *s = dev_compute_stream(dev);
    size_t N = job->B * job->T;
    for (int i = 0; i < m->n_modules; i++)
        for (int j = 0; j < m->modules[i].n_params; j++) {
            Param *p = &m->modules[i].params[j];
            p->data = dev_alloc_f32(dev, p->numel, MEM_PARAM, p->name);
            memcpy(p->data, job->params + model_param_offset(m, p), p->numel * sizeof(float));
        }
    int32_t *in = dev_alloc(dev, N * sizeof(int32_t), MEM_ACTIVATION, "inputs");
    int32_t *tg = dev_alloc(dev, N * sizeof(int32_t), MEM_ACTIVATION, "targets");
    memcpy(in, job->inputs, N * sizeof(int32_t));
    memcpy(tg, job->targets, N * sizeof(int32_t));
    ModelRun run = {0};
    run.dev = dev;
    run.stream = s;
    run.B = job->B;
    run.T = job->T;
    run.ac = job->ac;
    run.inputs = in;
    run.targets = tg;
    model_run_begin(m, &run);
    for (int i = 0; i < m->n_modules; i++) module_forward(m, &m->modules[i], &run);
    if (want_grads) {
        for (int i = m->n_modules - 1; i >= 0; i--) {
            Module *mod = &m->modules[i];
            if (module_recomputes(&run, mod)) module_recompute(m, mod, &run);
            for (int j = 0; j < mod->n_params; j++) {
                Param *p = &mod->params[j];
                p->grad = dev_alloc_f32(dev, p->numel, MEM_UNSHARDED_GRAD, p->name);
                dev_memset_async(s, p->grad, 0, p->numel * sizeof(float));
            }
            module_backward(m, mod, &run);
        }
    }
    dev_synchronize(dev);
    job->loss = *run.loss;
    for (int i = 0; i < m->n_modules; i++)
        for (int j = 0; j < m->modules[i].n_params; j++) {
            Param *p = &m->modules[i].params[j];
            if (want_grads) memcpy(job->grads + model_param_offset(m, p), p->grad, p->numel * sizeof(float));
            dev_free(dev, p->grad);
            dev_free(dev, p->data);
            p->grad = p->data = NULL;
        }
    model_run_end(m, &run);
    dev_free(dev, in);
    dev_free(dev, tg);
    dev_synchronize(dev);
}

typedef struct {
    Job *job;
    int mode;             /* 0: gradient check, 1: recompute compare, 2: leak check */
    int failures;
    size_t leaked;
} Ctx;

static ModelConfig small_config(void) {
    ModelConfig c;
    model_flavor(&c, "tiny");
    c.dim = 16;
    c.n_layers = 2;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.vocab_size = 11;
    c.multiple_of = 8;
    return c;
}

static Job make_job(ModelConfig c, size_t B, size_t T, uint64_t seed) {
    Job j = {0};
    j.m = model_create(&c);
    j.B = B;
    j.T = T;
    j.inputs = xmalloc(B * T * sizeof(int32_t));
    j.targets = xmalloc(B * T * sizeof(int32_t));
    Rng r;
    rng_seed(&r, seed);
    for (size_t i = 0; i < B * T; i++) {
        j.inputs[i] = (int32_t)(rng_u64(&r) % (uint64_t)c.vocab_size);
        j.targets[i] = (int32_t)(rng_u64(&r) % (uint64_t)c.vocab_size);
    }
    j.params = xmalloc(j.m->n_params_total * sizeof(float));
    j.grads = xcalloc(j.m->n_params_total, sizeof(float));
    model_init_host(j.m, seed, j.params);
    /* The init's 0.02 std makes the block grads tiny; scale the block matrices up
     * and perturb the norm weights so every tensor's gradient is well above
     * float32 finite-difference noise. */
    for (int i = 0; i < j.m->n_modules; i++)
        for (int k = 0; k < j.m->modules[i].n_params; k++) {
            const Param *p = &j.m->modules[i].params[k];
            float *w = j.params + model_param_offset(j.m, p);
            for (size_t e = 0; e < p->numel; e++) {
                if (p->ndim == 1) w[e] = 1.0f + 0.1f * rng_normal(&r);
                else if (j.m->modules[i].kind == MOD_BLOCK) w[e] *= 8.0f;
            }
        }
    return j;
}

static void free_job(Job *j) {
    free(j->inputs);
    free(j->targets);
    free(j->params);
    free(j->grads);
    model_destroy(j->m);
}

/* Directional finite difference: (L(p + h u) - L(p - h u)) / 2h vs g . u,
 * u random on one parameter tensor (or on all of them). Loss in float32, so h
 * is large (1e-2) and the tolerance 2e-2 relative; the negative control below
 * shows the check does catch a wrong gradient. */
static double directional_error(Dev *dev, Job *job, const Param *only, uint64_t seed, double *analytic_out,
                                double *numeric_out) {
    Model *m = job->m;
    size_t n = m->n_params_total;
    float *u = xcalloc(n, sizeof(float)), *saved = xmalloc(n * sizeof(float));
    Rng r;
    rng_seed(&r, seed);
    size_t lo = 0, hi = n;
    if (only) {
        lo = model_param_offset(m, only);
        hi = lo + only->numel;
    }
    double unorm = 0;
    for (size_t i = lo; i < hi; i++) {
        u[i] = rng_normal(&r);
        unorm += (double)u[i] * u[i];
    }
    unorm = sqrt(unorm);
    double analytic = 0;
    for (size_t i = lo; i < hi; i++) {
        u[i] = (float)(u[i] / unorm);
        analytic += (double)job->grads[i] * u[i];
    }
    memcpy(saved, job->params, n * sizeof(float));
    const float h = 1e-2f;
    for (size_t i = lo; i < hi; i++) job->params[i] = saved[i] + h * u[i];
    run_model(dev, job, 0);
    double lp = job->loss;
    for (size_t i = lo; i < hi; i++) job->params[i] = saved[i] - h * u[i];
    run_model(dev, job, 0);
    double lm = job->loss;
    memcpy(job->params, saved, n * sizeof(float));
    double numeric = (lp - lm) / (2.0 * h);
    free(u);
    free(saved);
    *analytic_out = analytic;
    *numeric_out = numeric;
    return fabs(analytic - numeric) / fmax(fabs(numeric), 1e-3);
}

static void rank_main(Dev *dev, void *arg) {
    Ctx *ctx = arg;
    Job *job = ctx->job;
    if (ctx->mode == 0) {
        run_model(dev, job, 1);
        Model *m = job->m;
        for (int i = 0; i < m->n_modules; i++)
            for (int k = 0; k < m->modules[i].n_params; k++) {
                const Param *p = &m->modules[i].params[k];
                double a, nu;
                double err = directional_error(dev, job, p, 17 + (uint64_t)k, &a, &nu);
                if (!(err < 2e-2)) {
                    ctx->failures++;
                    fprintf(stderr, "  gradient of %s: analytic %.6g vs finite difference %.6g (rel %.2e)\n", p->name,
                            a, nu, err);
                }
            }
        double a, nu;
        double err = directional_error(dev, job, NULL, 99, &a, &nu);
        if (!(err < 2e-2)) {
            ctx->failures++;
            fprintf(stderr, "  whole-model directional derivative: %.6g vs %.6g (rel %.2e)\n", a, nu, err);
        }
        /* negative control: a wrong gradient (one tensor scaled by 1.1) must be caught */
        const Param *wq = model_find_param(m, "layers.1.attention.wq.weight");
        size_t off = model_param_offset(m, wq);
        for (size_t e = 0; e < wq->numel; e++) job->grads[off + e] *= 1.1f;
        err = directional_error(dev, job, wq, 5, &a, &nu);
        if (err < 2e-2) {
            ctx->failures++;
            fprintf(stderr, "  negative control: a 10%% wrong gradient passed the check (rel %.2e)\n", err);
        }
    } else if (ctx->mode == 1) {
        run_model(dev, job, 1);
    } else {
        size_t before = dev_mem_current(dev);
        run_model(dev, job, 1);
        ctx->leaked = dev_mem_current(dev) - before;
    }
}

static void run_world(Ctx *ctx) {
    WorldConfig wc = {0};
    wc.world_size = 1;
    wc.poison = 1;
    World *w = world_create(&wc);
    world_run(w, rank_main, ctx);
    world_destroy(w);
}

TEST(config_sizes) {
    ModelConfig c;
    CHECK(model_flavor(&c, "debugmodel"), "debugmodel flavour");
    model_config_finalize(&c);
    CHECK(c.dim == 256 && c.n_layers == 6 && c.n_heads == 16 && c.vocab_size == 2048, "debugmodel dims");
    CHECK(c.hidden_dim == 768, "debugmodel FFN hidden %d (torchtitan: 768)", c.hidden_dim);
    CHECK(c.head_dim == 16 && c.n_kv_heads == 16, "head dim %d kv %d", c.head_dim, c.n_kv_heads);
    CHECK(model_flavor(&c, "1B"), "1B flavour");
    model_config_finalize(&c);
    CHECK(c.dim == 2048 && c.n_layers == 18 && c.n_heads == 16, "1B dims");
    CHECK(c.hidden_dim == 5632, "1B FFN hidden %d", c.hidden_dim);
    CHECK(!model_flavor(&c, "huge"), "unknown flavour refused");
    Model *m;
    model_flavor(&c, "tiny");
    m = model_create(&c);
    CHECK(m->n_modules == c.n_layers + 2, "modules");
    CHECK(strcmp(m->modules[1].params[1].name, "layers.0.attention.wq.weight") == 0, "torchtitan names");
    Param *wk = model_find_param(m, "layers.1.attention.wk.weight");
    CHECK(wk && wk->shape[0] == (size_t)(c.n_kv_heads * (c.dim / c.n_heads)) && wk->shape[1] == (size_t)c.dim,
          "wk is [kv*hd, dim] ([out, in])");
    model_destroy(m);
}

TEST(gradient_check) {
    Job job = make_job(small_config(), 2, 5, 3);
    Ctx ctx = {&job, 0, 0, 0};
    run_world(&ctx);
    CHECK(ctx.failures == 0, "%d gradient mismatches (see above)", ctx.failures);
    free_job(&job);
}

/* Every mode, on three blocks (--ac-every 2: only the second recomputes). */
static const AcPolicy AC_MODES[] = {{AC_FULL, 0}, {AC_EVERY, 2}, {AC_EVERY, 1}, {AC_EVERY, 4}, {AC_OP, 0}};
#define N_AC_MODES (sizeof AC_MODES / sizeof AC_MODES[0])

TEST(recompute_equals_plain_backward) {
    ModelConfig c = small_config();
    c.n_layers = 3;
    Job a = make_job(c, 2, 7, 4);
    Ctx ca = {&a, 1, 0, 0};
    run_world(&ca);
    for (size_t k = 0; k < N_AC_MODES; k++) {
        Job b = make_job(c, 2, 7, 4);
        b.ac = AC_MODES[k];
        Ctx cb = {&b, 1, 0, 0};
        run_world(&cb);
        CHECK(a.loss == b.loss, "%s (every %d): loss %.9g vs %.9g", ac_mode_name(b.ac.mode), b.ac.every, a.loss, b.loss);
        CHECK(memcmp(a.grads, b.grads, a.m->n_params_total * sizeof(float)) == 0, "grads differ with recompute %s (every %d)",
              ac_mode_name(b.ac.mode), b.ac.every);
        free_job(&b);
    }
    free_job(&a);
}

/* torchtitan's selective_ac_option N: blocks counted from 1, those whose count is a multiple of N. */
TEST(ac_every_counts_blocks_from_one) {
    AcPolicy every2 = {AC_EVERY, 2}, every3 = {AC_EVERY, 3}, full = {AC_FULL, 0}, op = {AC_OP, 0}, none = {AC_NONE, 0};
    for (int l = 0; l < 6; l++) {
        CHECK(ac_block_recomputes(every2, l) == (l == 1 || l == 3 || l == 5), "every 2, block %d", l);
        CHECK(ac_block_recomputes(every3, l) == (l == 2 || l == 5), "every 3, block %d", l);
        CHECK(ac_block_recomputes(full, l) && ac_block_recomputes(op, l) && !ac_block_recomputes(none, l), "block %d", l);
    }
}

TEST(no_leaks) {
    Job a = make_job(small_config(), 2, 6, 5);
    Ctx ctx = {&a, 2, 0, 0};
    run_world(&ctx);
    CHECK(ctx.leaked == 0, "%zu bytes still allocated after a forward+backward", ctx.leaked);
    for (size_t k = 0; k < N_AC_MODES; k++) {
        a.ac = AC_MODES[k];
        run_world(&ctx);
        CHECK(ctx.leaked == 0, "%zu bytes still allocated after a forward+backward with recompute %s (every %d)",
              ctx.leaked, ac_mode_name(a.ac.mode), a.ac.every);
    }
    free_job(&a);
}

TEST(loss_at_init_is_about_log_vocab) {
    ModelConfig c;
    model_flavor(&c, "tiny");
    Job j = make_job(c, 2, 16, 6);
    model_init_host(j.m, 6, j.params); /* the real init, unscaled */
    Ctx ctx = {&j, 1, 0, 0};
    run_world(&ctx);
    /* the output layer's std dim^-0.5 over a unit-RMS input gives logits of std ~1,
     * so the loss starts near log(V) + 1/2 */
    CHECK(fabs(j.loss - log((double)c.vocab_size)) < 1.5, "loss %.4f vs log(V) %.4f", j.loss,
          log((double)c.vocab_size));
    free_job(&j);
}

int main(int argc, char **argv) { return check_main(argc, argv); }
