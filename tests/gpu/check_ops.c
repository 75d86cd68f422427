/* check_ops.c — `make gpu-check`, part 1: every CUDA stream kernel against
 * the CPU kernel on fresh random inputs.
 *
 * Each case builds its inputs on the host (outputs that accumulate start
 * random too, so += is checked), runs the kcpu_ kernel on host copies, and
 * runs the kcuda_ kernel twice through the runtime (dev_alloc, copies,
 * dev_launch on the compute stream). It prints, per output, the largest
 * error relative to the largest reference magnitude,
 *     max_i |gpu_i - cpu_i| / max_i |cpu_i|,
 * against the bound of the op, and checks that the two GPU runs agree
 * bitwise (the kernels use no atomics). Usage: check_ops [--tf32].
 *
 * Bounds: elementwise float math (embedding, add, swiglu, rope, adamw,
 * rmsnorm, cross-entropy): 1e-5, a few ulps of libm vs CUDA's expf/powf/
 * sinf plus a different summation order; matmuls in fp32: 1e-5 (K <= 100
 * terms summed in another order); attention: 1e-5 forward, 1e-4 backward
 * (two chained reductions over T); sum of squares: 1e-6 (double
 * accumulation); with --tf32 the matmul bound is 5e-3 (TF32 keeps 10
 * mantissa bits: ~5e-4 per product). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device.h"
#include "kernels.h"
#include "ops.h"
#include "util.h"

#ifdef CHECK_OPS_SELFTEST
/* The harness tested on the CPU build (tests/test_cuda_build.py): the "GPU"
 * side runs the CPU kernels through the CPU runtime, so every error must be
 * exactly 0; a harness that mixed up buffers or pointers would show it. */
#define kcuda_embedding_forward kcpu_embedding_forward
#define kcuda_embedding_backward kcpu_embedding_backward
#define kcuda_rmsnorm_forward kcpu_rmsnorm_forward
#define kcuda_rmsnorm_backward kcpu_rmsnorm_backward
#define kcuda_matmul_forward kcpu_matmul_forward
#define kcuda_matmul_backward kcpu_matmul_backward
#define kcuda_rope kcpu_rope
#define kcuda_rope_tables kcpu_rope_tables
#define kcuda_attention_forward kcpu_attention_forward
#define kcuda_attention_backward kcpu_attention_backward
#define kcuda_attention_scratch_floats kcpu_attention_scratch_floats
#define kcuda_swiglu_forward kcpu_swiglu_forward
#define kcuda_swiglu_backward kcpu_swiglu_backward
#define kcuda_add kcpu_add
#define kcuda_crossentropy_forward kcpu_crossentropy_forward
#define kcuda_crossentropy_backward kcpu_crossentropy_backward
#define kcuda_sumsq_accumulate kcpu_sumsq_accumulate
#define kcuda_adamw kcpu_adamw
#endif

typedef struct {
    const char *what;
    void *h;       /* host data (the case's pristine inputs) */
    size_t bytes;
    int role;      /* 0 input, 1 output (compared), 2 scratch (not compared) */
} Buf;

typedef struct {
    Dev *dev;
    int tf32;
    int passed, failed;
} Ctx;

static Rng rng;

static float *randf(size_t n, float scale) {
    float *p = xmalloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) p[i] = (rng_uniform(&rng) * 2.0f - 1.0f) * scale;
    return p;
}

static int32_t *randi(size_t n, int32_t hi) {
    int32_t *p = xmalloc((n ? n : 1) * sizeof(int32_t));
    for (size_t i = 0; i < n; i++) p[i] = (int32_t)(rng_u64(&rng) % (uint64_t)hi);
    return p;
}

/* The argument structs hold host pointers to the case's buffers; a copy of
 * the struct gets them replaced by another set (CPU copies or device
 * buffers). Pointers sit at pointer-aligned offsets in these structs. */
static void retarget(void *args, size_t size, Buf *b, int nb, void **to) {
    for (size_t off = 0; off + sizeof(void *) <= size; off += sizeof(void *)) {
        void *p;
        memcpy(&p, (char *)args + off, sizeof p);
        for (int i = 0; i < nb; i++)
            if (p && p == b[i].h) {
                memcpy((char *)args + off, &to[i], sizeof p);
                break;
            }
    }
}

static void run_case(Ctx *c, const char *op, const char *shape, void (*kcpu)(void *), void (*kcuda)(void *),
                     const void *args, size_t args_size, Buf *b, int nb, double bound) {
    unsigned char a[DEV_ARGS_MAX];
    void *cpu[16], *dev[16], *gpu[2][16];
    /* CPU reference on copies */
    for (int i = 0; i < nb; i++) {
        cpu[i] = xmalloc(b[i].bytes ? b[i].bytes : 1);
        memcpy(cpu[i], b[i].h, b[i].bytes);
    }
    memcpy(a, args, args_size);
    retarget(a, args_size, b, nb, cpu);
    kcpu(a);
    /* GPU twice from the same inputs */
    Stream *s = dev_compute_stream(c->dev);
    for (int run = 0; run < 2; run++) {
        for (int i = 0; i < nb; i++) {
            dev[i] = dev_alloc(c->dev, b[i].bytes, MEM_TEMP, b[i].what);
            dev_memcpy_async(s, dev[i], b[i].h, b[i].bytes);
        }
        memcpy(a, args, args_size);
        retarget(a, args_size, b, nb, dev);
        dev_launch(s, op, kcuda, a, args_size);
        for (int i = 0; i < nb; i++) {
            gpu[run][i] = xmalloc(b[i].bytes ? b[i].bytes : 1);
            dev_memcpy_async(s, gpu[run][i], dev[i], b[i].bytes);
        }
        dev_stream_synchronize(s);
        for (int i = 0; i < nb; i++) dev_free(c->dev, dev[i]);
    }
    for (int i = 0; i < nb; i++) {
        if (b[i].role != 1) continue;
        const float *ref = cpu[i], *got = gpu[0][i];
        size_t n = b[i].bytes / sizeof(float);
        double worst = 0, scale = 0;
        for (size_t k = 0; k < n; k++) {
            double e = fabs((double)got[k] - (double)ref[k]);
            if (!(e <= worst)) worst = e; /* a NaN makes it NaN */
            if (fabs((double)ref[k]) > scale) scale = fabs((double)ref[k]);
        }
        double rel = worst / (scale > 0 ? scale : 1e-30);
        int same = memcmp(gpu[0][i], gpu[1][i], b[i].bytes) == 0;
        int ok = rel <= bound && same;
        printf("op %-22s %-26s %-8s max_rel_err %.2e bound %.0e %s%s\n", op, shape, b[i].what, rel, bound,
               same ? "" : "NOT DETERMINISTIC ", ok ? "OK" : "FAIL");
        if (ok) c->passed++;
        else c->failed++;
    }
    for (int i = 0; i < nb; i++) {
        free(cpu[i]);
        free(gpu[0][i]);
        free(gpu[1][i]);
    }
}

#define F(n) ((n) * sizeof(float))
#define CASE(op, shape, cpu, cuda, args, bufs, bound)                                                                  \
    run_case(c, op, shape, cpu, cuda, &(args), sizeof(args), bufs, (int)(sizeof(bufs) / sizeof(bufs[0])), bound)

static void check_embedding(Ctx *c, size_t N, size_t D, size_t V) {
    int32_t *tok = randi(N, (int32_t)V);
    float *w = randf(V * D, 1), *out = randf(N * D, 1), *dw = randf(V * D, 1), *dout = randf(N * D, 1);
    char shape[64];
    snprintf(shape, sizeof shape, "N%zu D%zu V%zu", N, D, V);
    EmbArgs f = {out, tok, w, N, D};
    Buf bf[] = {{"tokens", tok, N * 4, 0}, {"wte", w, F(V * D), 0}, {"out", out, F(N * D), 1}};
    CASE("embedding_forward", shape, kcpu_embedding_forward, kcuda_embedding_forward, f, bf, 1e-5);
    EmbArgs g = {dw, tok, dout, N, D};
    Buf bg[] = {{"tokens", tok, N * 4, 0}, {"dout", dout, F(N * D), 0}, {"dwte", dw, F(V * D), 1}};
    CASE("embedding_backward", shape, kcpu_embedding_backward, kcuda_embedding_backward, g, bg, 1e-5);
    free(tok), free(w), free(out), free(dw), free(dout);
}

static void check_rmsnorm(Ctx *c, size_t N, size_t D) {
    float *x = randf(N * D, 2), *w = randf(D, 1), *out = randf(N * D, 1), *rstd = randf(N, 1);
    float *dout = randf(N * D, 1), *dx = randf(N * D, 1), *dw = randf(D, 1);
    char shape[64];
    snprintf(shape, sizeof shape, "N%zu D%zu", N, D);
    rmsnorm_forward(out, rstd, x, w, N, D, 1e-5f); /* the saved rstd the backward reads */
    NormArgs f = {out, rstd, x, w, N, D, 1e-5f};
    Buf bf[] = {{"x", x, F(N * D), 0}, {"w", w, F(D), 0}, {"out", out, F(N * D), 1}, {"rstd", rstd, F(N), 1}};
    CASE("rmsnorm_forward", shape, kcpu_rmsnorm_forward, kcuda_rmsnorm_forward, f, bf, 1e-5);
    NormBwdArgs g = {dx, dw, dout, x, w, rstd, N, D};
    Buf bg[] = {{"dout", dout, F(N * D), 0}, {"x", x, F(N * D), 0}, {"w", w, F(D), 0},
                {"rstd", rstd, F(N), 0},     {"dx", dx, F(N * D), 1}, {"dw", dw, F(D), 1}};
    CASE("rmsnorm_backward", shape, kcpu_rmsnorm_backward, kcuda_rmsnorm_backward, g, bg, 1e-5);
    free(x), free(w), free(out), free(rstd), free(dout), free(dx), free(dw);
}

static void check_matmul(Ctx *c, size_t N, size_t C, size_t OC) {
    float *in = randf(N * C, 1), *w = randf(OC * C, 1), *out = randf(N * OC, 1);
    float *dout = randf(N * OC, 1), *din = randf(N * C, 1), *dw = randf(OC * C, 1);
    double bound = c->tf32 ? 5e-3 : 1e-5;
    char shape[64];
    snprintf(shape, sizeof shape, "N%zu C%zu OC%zu", N, C, OC);
    MmArgs f = {out, in, w, N, C, OC};
    Buf bf[] = {{"in", in, F(N * C), 0}, {"w", w, F(OC * C), 0}, {"out", out, F(N * OC), 1}};
    CASE("matmul_forward", shape, kcpu_matmul_forward, kcuda_matmul_forward, f, bf, bound);
    MmBwdArgs g = {din, dw, dout, in, w, N, C, OC};
    Buf bg[] = {{"dout", dout, F(N * OC), 0}, {"in", in, F(N * C), 0}, {"w", w, F(OC * C), 0},
                {"dinp", din, F(N * C), 1},   {"dw", dw, F(OC * C), 1}};
    CASE("matmul_backward", shape, kcpu_matmul_backward, kcuda_matmul_backward, g, bg, bound);
    free(in), free(w), free(out), free(dout), free(din), free(dw);
}

static void check_rope(Ctx *c, size_t B, size_t T, size_t nh, size_t hd) {
    size_t half = hd / 2;
    float *cs = randf(T * half, 1), *sn = randf(T * half, 1), *x = randf(B * T * nh * hd, 1);
    char shape[64];
    snprintf(shape, sizeof shape, "B%zu T%zu nh%zu hd%zu", B, T, nh, hd);
    RopeTabArgs t = {cs, sn, T, hd, 500000.0f};
    Buf bt[] = {{"cos", cs, F(T * half), 1}, {"sin", sn, F(T * half), 1}};
    CASE("rope_tables", shape, kcpu_rope_tables, kcuda_rope_tables, t, bt, 1e-5);
    rope_tables(cs, sn, T, hd, 500000.0f);
    for (int bwd = 0; bwd < 2; bwd++) {
        RopeArgs r = {x, cs, sn, B, T, nh, hd, bwd};
        Buf br[] = {{"cos", cs, F(T * half), 0}, {"sin", sn, F(T * half), 0}, {"x", x, F(B * T * nh * hd), 1}};
        CASE(bwd ? "rope_backward" : "rope_forward", shape, kcpu_rope, kcuda_rope, r, br, 1e-5);
    }
    free(cs), free(sn), free(x);
}

static void check_attention(Ctx *c, size_t B, size_t T, size_t H, size_t KV, size_t hd) {
    size_t nq = B * T * H * hd, nk = B * T * KV * hd, np = B * H * T * T;
    float *q = randf(nq, 1), *k = randf(nk, 1), *v = randf(nk, 1), *out = randf(nq, 1), *probs = randf(np, 1);
    float *dout = randf(nq, 1), *dq = randf(nq, 1), *dk = randf(nk, 1), *dv = randf(nk, 1);
    size_t ns = kcpu_attention_scratch_floats(B, T, H), ng = kcuda_attention_scratch_floats(B, T, H);
    float *scratch = randf(ns > ng ? ns : ng, 1);
    char shape[64];
    snprintf(shape, sizeof shape, "B%zu T%zu H%zu KV%zu hd%zu", B, T, H, KV, hd);
    AttArgs f = {out, probs, q, k, v, B, T, H, KV, hd};
    Buf bf[] = {{"q", q, F(nq), 0}, {"k", k, F(nk), 0}, {"v", v, F(nk), 0}, {"out", out, F(nq), 1},
                {"probs", probs, F(np), 1}};
    CASE("attention_forward", shape, kcpu_attention_forward, kcuda_attention_forward, f, bf, 1e-5);
    attention_forward(out, probs, q, k, v, B, T, H, KV, hd); /* the saved probs */
    AttBwdArgs g = {dq, dk, dv, scratch, dout, q, k, v, probs, B, T, H, KV, hd};
    Buf bg[] = {{"dout", dout, F(nq), 0},  {"q", q, F(nq), 0},   {"k", k, F(nk), 0},
                {"v", v, F(nk), 0},        {"probs", probs, F(np), 0},
                {"scratch", scratch, F(ns > ng ? ns : ng), 2},
                {"dq", dq, F(nq), 1},      {"dk", dk, F(nk), 1}, {"dv", dv, F(nk), 1}};
    CASE("attention_backward", shape, kcpu_attention_backward, kcuda_attention_backward, g, bg, 1e-4);
    free(q), free(k), free(v), free(out), free(probs), free(dout), free(dq), free(dk), free(dv), free(scratch);
}

static void check_elementwise(Ctx *c, size_t n) {
    float *a = randf(n, 4), *b = randf(n, 2), *out = randf(n, 1), *dout = randf(n, 1), *da = randf(n, 1),
          *db = randf(n, 1);
    char shape[64];
    snprintf(shape, sizeof shape, "n%zu", n);
    SwiArgs f = {out, a, b, n};
    Buf bf[] = {{"a", a, F(n), 0}, {"b", b, F(n), 0}, {"out", out, F(n), 1}};
    CASE("swiglu_forward", shape, kcpu_swiglu_forward, kcuda_swiglu_forward, f, bf, 1e-5);
    SwiBwdArgs g = {da, db, dout, a, b, n};
    Buf bg[] = {{"dout", dout, F(n), 0}, {"a", a, F(n), 0}, {"b", b, F(n), 0}, {"da", da, F(n), 1}, {"db", db, F(n), 1}};
    CASE("swiglu_backward", shape, kcpu_swiglu_backward, kcuda_swiglu_backward, g, bg, 1e-5);
    AddArgs s = {out, a, b, n};
    Buf bs[] = {{"a", a, F(n), 0}, {"b", b, F(n), 0}, {"out", out, F(n), 1}};
    CASE("add", shape, kcpu_add, kcuda_add, s, bs, 1e-5);
    float *acc = randf(1, 1);
    SumsqArgs q = {acc, a, n};
    Buf bq[] = {{"x", a, F(n), 0}, {"acc", acc, F(1), 1}};
    CASE("sumsq_accumulate", shape, kcpu_sumsq_accumulate, kcuda_sumsq_accumulate, q, bq, 1e-6);
    float *m = randf(n, 0.1f), *v = randf(n, 0.01f), *tot = randf(1, 1);
    for (size_t i = 0; i < n; i++) v[i] = fabsf(v[i]);
    for (int clip = 0; clip < 2; clip++) {
        tot[0] = clip ? 1e4f : 0.25f; /* clipped (coef < 1) and not */
        AdamArgs w = {out, b, m, v, n, adamw_default_config(), 1e-3f, 3, tot};
        w.c.max_norm = 1.0f;
        Buf bw[] = {{"grad", b, F(n), 0}, {"sumsq", tot, F(1), 0}, {"param", out, F(n), 1},
                    {"exp_avg", m, F(n), 1}, {"exp_avg_sq", v, F(n), 1}};
        CASE(clip ? "adamw (clipped)" : "adamw", shape, kcpu_adamw, kcuda_adamw, w, bw, 1e-5);
    }
    free(a), free(b), free(out), free(dout), free(da), free(db), free(acc), free(m), free(v), free(tot);
}

static void check_crossentropy(Ctx *c, size_t N, size_t V) {
    float *logits = randf(N * V, 6), *loss = randf(1, 1), *dl = randf(N * V, 1);
    int32_t *tgt = randi(N, (int32_t)V);
    char shape[64];
    snprintf(shape, sizeof shape, "N%zu V%zu", N, V);
    CeArgs f = {loss, NULL, logits, tgt, N, V};
    Buf bf[] = {{"logits", logits, F(N * V), 0}, {"targets", tgt, N * 4, 0}, {"loss", loss, F(1), 1}};
    CASE("crossentropy_forward", shape, kcpu_crossentropy_forward, kcuda_crossentropy_forward, f, bf, 1e-5);
    CeArgs g = {NULL, dl, logits, tgt, N, V};
    Buf bg[] = {{"logits", logits, F(N * V), 0}, {"targets", tgt, N * 4, 0}, {"dlogits", dl, F(N * V), 1}};
    CASE("crossentropy_backward", shape, kcpu_crossentropy_backward, kcuda_crossentropy_backward, g, bg, 1e-5);
    free(logits), free(loss), free(dl), free(tgt);
}

static void rank_main(Dev *dev, void *arg) {
    Ctx *c = arg;
    c->dev = dev;
    check_embedding(c, 37, 48, 50);
    check_rmsnorm(c, 33, 96);
    check_rmsnorm(c, 7, 1000);
    check_matmul(c, 45, 70, 33);
    check_matmul(c, 128, 64, 256);
    check_rope(c, 2, 19, 3, 16);
    check_attention(c, 2, 37, 4, 2, 16); /* GQA, T not a multiple of 32 */
    check_attention(c, 1, 64, 2, 2, 32);
    check_elementwise(c, 100003);
    check_crossentropy(c, 29, 203);
    check_crossentropy(c, 4, 2048);
}

int main(int argc, char **argv) {
    Ctx c = {0};
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--tf32")) c.tf32 = 1;
        else fatal("usage: check_ops [--tf32] (unknown argument '%s')", argv[i]);
    }
    rng_seed(&rng, 20261122);
    WorldConfig cfg = {0};
    cfg.world_size = 1;
    cfg.backend = BACKEND_LOCAL;
    cfg.poison = 1;
    cfg.tf32 = c.tf32;
    World *w = world_create(&cfg);
    world_run(w, rank_main, &c);
    world_destroy(w);
    printf("%d ops passed, %d failed%s\n", c.passed, c.failed, c.tf32 ? " (--tf32)" : "");
    return c.failed ? 1 : 0;
}
