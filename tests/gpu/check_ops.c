/* check_ops.c — `make gpu-check`, part 1: every CUDA stream kernel against
 * the CPU kernel on fresh random inputs.
 *
 * Each case builds its inputs on the host with a fixed seed (outputs that
 * accumulate start random too, so += is checked; outputs that are written
 * start random, so a missed element shows), runs the kcpu_ kernel on host
 * copies, and runs the kcuda_ kernel twice through the public runtime API
 * (world of 1 rank, dev_alloc, copies, dev_launch on the compute stream,
 * dev_stream_synchronize). Per output it prints
 *     op <name> <dtype> <shape> <buffer> max_rel_err E bound B OK|FAIL
 * with E = max_i |gpu_i - cpu_i| / max_i |cpu_i| (a NaN anywhere fails), and
 * it fails an output whose two GPU runs differ in any bit (the kernels use no
 * atomics, so they must be deterministic). Then "N ops passed, M failed";
 * the exit status is non-zero on any failure. Usage: check_ops [--tf32]
 * (--tf32: float32 matmuls on TF32 tensor cores, with the looser matmul bound).
 *
 * Two dtypes (kernels.h, the `bf16` field): every kernel with an [a] tensor
 * runs once with float32 tensors (<dtype> f32) and once with bf16 = 1
 * (<dtype> bf16): its [a] tensors are then bfloat16 words, the inputs random
 * floats rounded to bf16 (so both sides read the same exact values), and a bf16
 * output is compared widened; its float32 tensors (rstd, lse, dw, the tables,
 * the scratch) stay float32. The ops with no [a] tensor (rope_tables, sumsq,
 * adamw, cross-entropy) run once, as f32.
 *
 * The bounds, per op (BOUNDS below holds the same numbers; - = no bf16 case):
 *   op                     fp32   tf32   bf16   why
 *   embedding_forward      0      0      0      a copy of rows (under bf16: of words)
 *   embedding_backward     0      0      0      the CPU's float adds, in its token order, per element (dwte is float32
 *                                               under bf16 too, dout widened exactly: the same adds)
 *   add                    0      0      0      one IEEE add per element (bf16: of the widened inputs, rounded once:
 *                                               the same float, so the same word)
 *   rope_forward/backward  1e-6   1e-6   1e-6   the CPU's products and adds (no FMA) on the same tables: expected
 *                                               exact; bf16: the same floats round to the same words (a float ulp apart
 *                                               at a rounding boundary would show as a whole bf16 step)
 *   adamw                  1e-6   1e-6   -      host-formed scalars, the CPU's IEEE ops (fmaf, sqrtf, /) in order
 *                                               (exact)
 *   rope_tables            1e-6   1e-6   -      the same float angle; cos/sin in double then rounded vs glibc's
 *                                               (< 1 ulp)
 *   sumsq_accumulate       1e-6   1e-6   -      a double sum in another order, rounded to float once
 *   rmsnorm_forward        1e-6   1e-6   1e-2   sum of squares in double on both sides: rstd at most 1 ulp apart
 *   crossentropy_forward   1e-6   1e-6   -      CUDA expf (<= 2 ulp) in a double sum: each row's lse at most
 *                                               ~1 ulp apart
 *   rmsnorm_backward       1e-5   1e-5   1e-2   dweight sums N rows in float in another order (~sqrt(N) ulps)
 *   matmul_forward/bwd     1e-5   1e-2   1e-2   fp32: K-term sums in another order (~sqrt(K) ulps); TF32 keeps 10
 *                                               mantissa bits: ~1e-3 per product, random signs keep the sum's error at
 *                                               that scale
 *   swiglu_forward/bwd     1e-5   1e-5   1e-2   CUDA expf within 2 ulp of glibc's, and FMA contraction: a few ulps
 *   crossentropy_backward  1e-5   1e-5   -      softmax terms by CUDA expf (<= 2 ulp), times 1/N
 *   attention_forward      1e-5   1e-5   1e-2   out: a convex mix of v rows summed in 32-key tiles (the CPU's: 64) with
 *                                               an online rescale per tile, hd-term dots reordered, expf within 2 ulp:
 *                                               a few ulps of |v|; lse = m + log(l): l to a few ulps, so lse to ~1e-7
 *                                               relative
 *   attention_backward     1e-4   1e-4   1e-2   p = exp(s - lse) from a reordered dot; dS = p (dP - D) subtracts two
 *                                               hd-term dots (their rounding lands on dS undivided), then T-term sums
 *                                               into dq, dk and (over the heads of a group) dv: the longest chain of
 *                                               reordered sums
 * (Attention measured on a CPU emulation of the CUDA kernels, one fiber per
 * thread, against the CPU's materialising attention and a plain row-by-row
 * one, on these shapes and on peaky softmax rows (q, k scaled by 6):
 * forward <= 1.4e-6, backward <= 1.2e-6; the GPU adds FMA contraction and
 * its expf, a few ulps more.)
 * (The error is relative to the largest reference magnitude, so a few ulps
 * of the largest entry is ~1e-7: the bounds leave >= 10x margin, while a
 * wrong index, mask or transpose gives errors of order 1.)
 * (bf16 = 1e-2 where the float32 math is reordered: both sides compute in
 * float32 on the same widened inputs, so their floats a, b differ as in the
 * fp32 column (<= 1e-4 of max|ref|), and each side rounds its float to bf16
 * once, moving it by at most half a bf16 step. So the words differ by at most
 * |a - b| + one step, and a step at x is at most 2^-7 |x| (bf16 keeps 8
 * significant bits; half a step, 2^-8, is one rounding's relative error):
 * 1e-4 + 2^-7 = 7.9e-3 < 1e-2 of max|ref|. The float32 outputs of these ops
 * (rstd, lse, dw) are held to the same bound (cuBLAS's tensor cores sum the
 * bf16 products in float32 but need not round each add as IEEE does). A
 * wrong index, mask or dtype still gives errors of order 1.) */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/bf16.h"
#include "runtime/runtime.h"
#include "model/kernels.h"
#include "model/ops.h"
#include "runtime/util.h"

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

/* no bf16 case: the op has no [a] tensor */
#define NO_BF16 (-1.0)

static const struct {
    const char *op;
    double fp32, tf32, bf16; /* bound on max|gpu - cpu| / max|cpu|: fp32 without and with --tf32, and bf16 */
} BOUNDS[] = {
    {"embedding_forward", 0, 0, 0},              {"embedding_backward", 0, 0, 0},
    {"add", 0, 0, 0},                            {"rope_forward", 1e-6, 1e-6, 1e-6},
    {"rope_backward", 1e-6, 1e-6, 1e-6},         {"adamw", 1e-6, 1e-6, NO_BF16},
    {"rope_tables", 1e-6, 1e-6, NO_BF16},        {"sumsq_accumulate", 1e-6, 1e-6, NO_BF16},
    {"rmsnorm_forward", 1e-6, 1e-6, 1e-2},       {"crossentropy_forward", 1e-6, 1e-6, NO_BF16},
    {"rmsnorm_backward", 1e-5, 1e-5, 1e-2},      {"matmul_forward", 1e-5, 1e-2, 1e-2},
    {"matmul_backward", 1e-5, 1e-2, 1e-2},       {"swiglu_forward", 1e-5, 1e-5, 1e-2},
    {"swiglu_backward", 1e-5, 1e-5, 1e-2},       {"crossentropy_backward", 1e-5, 1e-5, NO_BF16},
    {"attention_forward", 1e-5, 1e-5, 1e-2},     {"attention_backward", 1e-4, 1e-4, 1e-2},
};

typedef struct {
    const char *what;
    void *h;       /* host data (the case's pristine inputs) */
    size_t bytes;
    int role;      /* 0 input, 1 output (compared), 2 scratch (not compared) */
    int bf16;      /* 1: bfloat16 words (compared widened); 0: float32 (or int32 tokens, never compared) */
} Buf;

typedef struct {
    Dev *dev;
    int tf32;
    int bf16; /* the [a] tensors of the cases now running: bfloat16 words (1) or float32 (0) */
    int passed, failed;
} Ctx;

static Rng rng;

static double bound_of(const Ctx *c, const char *op, int bf16) {
    for (size_t i = 0; i < sizeof BOUNDS / sizeof BOUNDS[0]; i++) {
        if (strcmp(BOUNDS[i].op, op)) continue;
        if (!bf16) return c->tf32 ? BOUNDS[i].tf32 : BOUNDS[i].fp32;
        if (BOUNDS[i].bf16 < 0) fatal("check_ops: op %s has no bf16 bound", op);
        return BOUNDS[i].bf16;
    }
    fatal("check_ops: no bound for op %s", op);
}

static float *randf(size_t n, float scale) {
    float *p = xmalloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) p[i] = (rng_uniform(&rng) * 2.0f - 1.0f) * scale;
    return p;
}

/* an [a] tensor of n random values in (-scale, scale): float32, or under
 * c->bf16 the same draws rounded to bfloat16 words */
static void *randa(const Ctx *c, size_t n, float scale) {
    float *f = randf(n, scale);
    if (!c->bf16) return f;
    uint16_t *w = xmalloc((n ? n : 1) * sizeof(uint16_t));
    for (size_t i = 0; i < n; i++) w[i] = bf16_from_f32(f[i]);
    free(f);
    return w;
}

static int32_t *randi(size_t n, int32_t hi) {
    int32_t *p = xmalloc((n ? n : 1) * sizeof(int32_t));
    for (size_t i = 0; i < n; i++) p[i] = (int32_t)(rng_u64(&rng) % (uint64_t)hi);
    return p;
}

/* element k of a compared buffer, widened */
static double elem(const void *p, size_t k, int bf16) {
    return bf16 ? (double)bf16_to_f32(((const uint16_t *)p)[k]) : (double)((const float *)p)[k];
}

/* The argument structs hold host pointers to the case's buffers; a copy of
 * the struct gets them replaced by another set (CPU copies or device
 * buffers). Pointers sit at pointer-aligned offsets in these structs; two
 * fields naming one buffer (add in place) both move to its copy. */
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

/* bf16: the case's dtype (its args' bf16 field), for the bound and the line */
static void run_case(Ctx *c, const char *op, int bf16, const char *shape, void (*kcpu)(void *),
                     void (*kcuda)(void *), const void *args, size_t args_size, Buf *b, int nb) {
    unsigned char a[DEV_ARGS_MAX];
    void *cpu[16], *dev[16], *gpu[2][16];
    double bound = bound_of(c, op, bf16);
    if (nb > 16 || args_size > sizeof a) fatal("check_ops: case %s is too big for the harness", op);
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
        KernelCost cost = {.cls = COST_ELEMENTWISE}; /* the GPU times itself: a declared cost, unused */
        dev_launch(s, op, &cost, kcuda, a, args_size);
        for (int i = 0; i < nb; i++) {
            gpu[run][i] = xmalloc(b[i].bytes ? b[i].bytes : 1);
            dev_memcpy_async(s, gpu[run][i], dev[i], b[i].bytes);
        }
        dev_stream_synchronize(s);
        for (int i = 0; i < nb; i++) dev_free(c->dev, dev[i]);
    }
    for (int i = 0; i < nb; i++) {
        if (b[i].role != 1) continue;
        size_t n = b[i].bytes / (b[i].bf16 ? sizeof(uint16_t) : sizeof(float));
        double worst = 0, scale = 0;
        for (size_t k = 0; k < n; k++) {
            double ref = elem(cpu[i], k, b[i].bf16), e = fabs(elem(gpu[0][i], k, b[i].bf16) - ref);
            if (!(e <= worst)) worst = e; /* a NaN makes it NaN, and NaN fails */
            if (fabs(ref) > scale) scale = fabs(ref);
        }
        double rel = worst / (scale > 0 ? scale : 1e-30);
        int same = memcmp(gpu[0][i], gpu[1][i], b[i].bytes) == 0;
        int ok = rel <= bound && same;
        printf("op %-21s %-4s %-24s %-10s max_rel_err %.2e bound %.0e %s%s\n", op, bf16 ? "bf16" : "f32", shape,
               b[i].what, rel, bound, same ? "" : "NOT-DETERMINISTIC ", ok ? "OK" : "FAIL");
        if (ok) c->passed++;
        else c->failed++;
    }
    for (int i = 0; i < nb; i++) {
        free(cpu[i]);
        free(gpu[0][i]);
        free(gpu[1][i]);
    }
}

/* bytes of n float32 elements, and of n elements of an [a] tensor (2 under bf16) */
#define F(n) ((n) * sizeof(float))
#define A(n) ((n) * (c->bf16 ? sizeof(uint16_t) : sizeof(float)))
/* the Buf fields after the bytes: role, and whether the buffer is bf16 words (an [a] tensor under bf16) */
#define IN 0, 0
#define OUT 1, 0
#define SCRATCH 2, 0
#define IN_A 0, c->bf16
#define OUT_A 1, c->bf16
#define CASE(op, shape, cpu, cuda, args, bufs)                                                                         \
    run_case(c, op, (args).bf16, shape, cpu, cuda, &(args), sizeof(args), bufs, (int)(sizeof(bufs) / sizeof(bufs[0])))
/* the ops with no [a] tensor: no bf16 field, run as f32 */
#define CASE_F32(op, shape, cpu, cuda, args, bufs)                                                                     \
    run_case(c, op, 0, shape, cpu, cuda, &(args), sizeof(args), bufs, (int)(sizeof(bufs) / sizeof(bufs[0])))

/* N > V repeats tokens: the backward adds several rows into one */
static void check_embedding(Ctx *c, size_t N, size_t D, size_t V) {
    int32_t *tok = randi(N, (int32_t)V);
    void *w = randa(c, V * D, 1), *out = randa(c, N * D, 1), *dout = randa(c, N * D, 1);
    float *dw = randf(V * D, 1); /* dwte: float32 under bf16 too */
    char shape[64];
    snprintf(shape, sizeof shape, "N%zu D%zu V%zu", N, D, V);
    EmbArgs f = {out, tok, w, N, D, c->bf16};
    Buf bf[] = {{"tokens", tok, N * 4, IN}, {"wte", w, A(V * D), IN_A}, {"out", out, A(N * D), OUT_A}};
    CASE("embedding_forward", shape, kcpu_embedding_forward, kcuda_embedding_forward, f, bf);
    EmbArgs g = {dw, tok, dout, N, D, c->bf16};
    Buf bg[] = {{"tokens", tok, N * 4, IN}, {"dout", dout, A(N * D), IN_A}, {"dwte", dw, F(V * D), OUT}};
    CASE("embedding_backward", shape, kcpu_embedding_backward, kcuda_embedding_backward, g, bg);
    free(tok), free(w), free(out), free(dw), free(dout);
}

static void check_rmsnorm(Ctx *c, size_t N, size_t D) {
    void *x = randa(c, N * D, 2), *w = randa(c, D, 1), *out = randa(c, N * D, 1);
    void *dout = randa(c, N * D, 1), *dx = randa(c, N * D, 1), *y = randa(c, N * D, 1);
    float *rstd = randf(N, 1), *dw = randf(D, 1), *saved = randf(N, 1);
    char shape[64];
    snprintf(shape, sizeof shape, "N%zu D%zu", N, D);
    NormArgs f = {out, rstd, x, w, N, D, 1e-5f, c->bf16};
    Buf bf[] = {{"x", x, A(N * D), IN_A}, {"w", w, A(D), IN_A}, {"out", out, A(N * D), OUT_A},
                {"rstd", rstd, F(N), OUT}};
    CASE("rmsnorm_forward", shape, kcpu_rmsnorm_forward, kcuda_rmsnorm_forward, f, bf);
    NormArgs pre = {y, saved, x, w, N, D, 1e-5f, c->bf16};
    kcpu_rmsnorm_forward(&pre); /* the saved rstd the backward reads */
    NormBwdArgs g = {dx, dw, dout, x, w, saved, N, D, c->bf16};
    Buf bg[] = {{"dout", dout, A(N * D), IN_A}, {"x", x, A(N * D), IN_A},   {"w", w, A(D), IN_A},
                {"rstd", saved, F(N), IN},      {"dx", dx, A(N * D), OUT_A}, {"dw", dw, F(D), OUT}};
    CASE("rmsnorm_backward", shape, kcpu_rmsnorm_backward, kcuda_rmsnorm_backward, g, bg);
    free(x), free(w), free(out), free(rstd), free(dout), free(dx), free(dw), free(y), free(saved);
}

static void check_matmul(Ctx *c, size_t N, size_t C, size_t OC) {
    void *in = randa(c, N * C, 1), *w = randa(c, OC * C, 1), *out = randa(c, N * OC, 1);
    void *dout = randa(c, N * OC, 1), *din = randa(c, N * C, 1);
    float *dw = randf(OC * C, 1); /* float32 under bf16 too */
    char shape[64];
    snprintf(shape, sizeof shape, "N%zu C%zu OC%zu", N, C, OC);
    MmArgs f = {out, in, w, N, C, OC, c->bf16};
    Buf bf[] = {{"in", in, A(N * C), IN_A}, {"w", w, A(OC * C), IN_A}, {"out", out, A(N * OC), OUT_A}};
    CASE("matmul_forward", shape, kcpu_matmul_forward, kcuda_matmul_forward, f, bf);
    MmBwdArgs g = {din, dw, dout, in, w, N, C, OC, c->bf16};
    Buf bg[] = {{"dout", dout, A(N * OC), IN_A}, {"in", in, A(N * C), IN_A}, {"w", w, A(OC * C), IN_A},
                {"dinp", din, A(N * C), OUT_A},   {"dw", dw, F(OC * C), OUT}};
    CASE("matmul_backward", shape, kcpu_matmul_backward, kcuda_matmul_backward, g, bg);
    /* one of the two grads NULL (and the operand only it would read) */
    MmBwdArgs gi = {din, NULL, dout, NULL, w, N, C, OC, c->bf16}, gw = {NULL, dw, dout, in, NULL, N, C, OC, c->bf16};
    Buf bi[] = {{"dout", dout, A(N * OC), IN_A}, {"w", w, A(OC * C), IN_A}, {"dinp", din, A(N * C), OUT_A}};
    Buf bw[] = {{"dout", dout, A(N * OC), IN_A}, {"in", in, A(N * C), IN_A}, {"dw", dw, F(OC * C), OUT}};
    CASE("matmul_backward", shape, kcpu_matmul_backward, kcuda_matmul_backward, gi, bi);
    CASE("matmul_backward", shape, kcpu_matmul_backward, kcuda_matmul_backward, gw, bw);
    free(in), free(w), free(out), free(dout), free(din), free(dw);
}

/* rope_tables (float32 tables, no [a] tensor) in the f32 pass only */
static void check_rope(Ctx *c, size_t B, size_t T, size_t nh, size_t hd) {
    size_t half = hd / 2;
    float *cs = randf(T * half, 1), *sn = randf(T * half, 1);
    void *x = randa(c, B * T * nh * hd, 1);
    char shape[64];
    snprintf(shape, sizeof shape, "B%zu T%zu nh%zu hd%zu", B, T, nh, hd);
    if (!c->bf16) {
        /* Llama 3's tables, then Llama 3.1's scaled ones (ops.h: RopeScaling; its frequencies are formed on the
         * host, as the CPU forms them, so the two agree as the unscaled ones do) */
        const RopeScaling none = {0, 0, 0, 0}, llama31 = {8.0f, 1.0f, 4.0f, 8192.0f};
        for (int scaled = 0; scaled < 2; scaled++) {
            RopeTabArgs t = {cs, sn, T, hd, 500000.0f, scaled ? llama31 : none};
            Buf bt[] = {{"cos", cs, F(T * half), OUT}, {"sin", sn, F(T * half), OUT}};
            char tshape[80];
            snprintf(tshape, sizeof tshape, "%s%s", shape, scaled ? " scaled" : "");
            CASE_F32("rope_tables", tshape, kcpu_rope_tables, kcuda_rope_tables, t, bt);
        }
    }
    rope_tables(cs, sn, T, hd, 500000.0f, NULL); /* the same tables on both sides */
    for (int bwd = 0; bwd < 2; bwd++) {
        RopeArgs r = {x, cs, sn, B, T, nh, hd, bwd, c->bf16};
        Buf br[] = {{"cos", cs, F(T * half), IN}, {"sin", sn, F(T * half), IN},
                    {"x", x, A(B * T * nh * hd), OUT_A}};
        CASE(bwd ? "rope_backward" : "rope_forward", shape, kcpu_rope, kcuda_rope, r, br);
    }
    free(cs), free(sn), free(x);
}

/* The backward reads the forward's out and lse: both from the CPU forward, so
 * the two sides start from the same bits. */
static void check_attention(Ctx *c, size_t B, size_t T, size_t H, size_t KV, size_t hd) {
    size_t nq = B * T * H * hd, nk = B * T * KV * hd, nl = B * H * T; /* q/out [B,T,H,hd], k/v [B,T,KV,hd], lse [B,H,T] */
    void *q = randa(c, nq, 1), *k = randa(c, nk, 1), *v = randa(c, nk, 1), *out = randa(c, nq, 1);
    void *dout = randa(c, nq, 1), *dq = randa(c, nq, 1), *dk = randa(c, nk, 1), *dv = randa(c, nk, 1);
    void *o2 = randa(c, nq, 1);
    float *lse = randf(nl, 1), *lse2 = randf(nl, 1);
    size_t ns = kcpu_attention_scratch_floats(B, T, H), ng = kcuda_attention_scratch_floats(B, T, H);
    size_t nscr = ns > ng ? ns : ng;
    float *scratch = randf(nscr, 1);
    char shape[64];
    snprintf(shape, sizeof shape, "B%zu T%zu H%zu KV%zu hd%zu", B, T, H, KV, hd);
    AttArgs f = {out, lse, q, k, v, B, T, H, KV, hd, c->bf16};
    Buf bf[] = {{"q", q, A(nq), IN_A}, {"k", k, A(nk), IN_A}, {"v", v, A(nk), IN_A}, {"out", out, A(nq), OUT_A},
                {"lse", lse, F(nl), OUT}};
    CASE("attention_forward", shape, kcpu_attention_forward, kcuda_attention_forward, f, bf);
    AttArgs pre = {o2, lse2, q, k, v, B, T, H, KV, hd, c->bf16};
    kcpu_attention_forward(&pre); /* the saved out and lse the backward reads */
    AttBwdArgs g = {dq, dk, dv, scratch, dout, q, k, v, o2, lse2, B, T, H, KV, hd, c->bf16};
    Buf bg[] = {{"dout", dout, A(nq), IN_A},  {"q", q, A(nq), IN_A},      {"k", k, A(nk), IN_A},
                {"v", v, A(nk), IN_A},        {"out", o2, A(nq), IN_A},   {"lse", lse2, F(nl), IN},
                {"scratch", scratch, F(nscr), SCRATCH},
                {"dq", dq, A(nq), OUT_A},     {"dk", dk, A(nk), OUT_A},   {"dv", dv, A(nk), OUT_A}};
    CASE("attention_backward", shape, kcpu_attention_backward, kcuda_attention_backward, g, bg);
    free(q), free(k), free(v), free(out), free(lse), free(dout), free(dq), free(dk), free(dv), free(scratch);
    free(o2), free(lse2);
}

static void check_elementwise(Ctx *c, size_t n) {
    void *a = randa(c, n, 4), *b = randa(c, n, 2), *out = randa(c, n, 1), *dout = randa(c, n, 1);
    void *da = randa(c, n, 1), *db = randa(c, n, 1);
    char shape[64];
    snprintf(shape, sizeof shape, "n%zu", n);
    SwiArgs f = {out, a, b, n, c->bf16};
    Buf bf[] = {{"a", a, A(n), IN_A}, {"b", b, A(n), IN_A}, {"out", out, A(n), OUT_A}};
    CASE("swiglu_forward", shape, kcpu_swiglu_forward, kcuda_swiglu_forward, f, bf);
    SwiBwdArgs g = {da, db, dout, a, b, n, c->bf16};
    Buf bg[] = {{"dout", dout, A(n), IN_A}, {"a", a, A(n), IN_A}, {"b", b, A(n), IN_A}, {"da", da, A(n), OUT_A},
                {"db", db, A(n), OUT_A}};
    CASE("swiglu_backward", shape, kcpu_swiglu_backward, kcuda_swiglu_backward, g, bg);
    AddArgs s = {out, a, b, n, c->bf16};
    Buf bs[] = {{"a", a, A(n), IN_A}, {"b", b, A(n), IN_A}, {"out", out, A(n), OUT_A}};
    CASE("add", shape, kcpu_add, kcuda_add, s, bs);
    AddArgs si = {a, a, b, n, c->bf16}; /* in place, as the residual adds run */
    Buf bi[] = {{"a=out", a, A(n), OUT_A}, {"b", b, A(n), IN_A}};
    CASE("add", shape, kcpu_add, kcuda_add, si, bi);
    free(a), free(b), free(out), free(dout), free(da), free(db);
}

static void check_sumsq(Ctx *c, size_t n) {
    float *x = randf(n, 4), *acc = randf(1, 1);
    char shape[64];
    snprintf(shape, sizeof shape, "n%zu", n);
    SumsqArgs q = {acc, x, n};
    Buf bq[] = {{"x", x, F(n), IN}, {"acc", acc, F(1), OUT}};
    CASE_F32("sumsq_accumulate", shape, kcpu_sumsq_accumulate, kcuda_sumsq_accumulate, q, bq);
    free(x), free(acc);
}

/* clipping off (max_norm 0), on but inactive (norm < max_norm), and active */
static void check_adamw(Ctx *c, size_t n) {
    float *p = randf(n, 1), *g = randf(n, 2), *m = randf(n, 0.1f), *v = randf(n, 0.01f), *tot = randf(1, 1);
    for (size_t i = 0; i < n; i++) v[i] = fabsf(v[i]);
    const struct { const char *name; float max_norm, sumsq; int t; } mode[] = {
        {"noclip", 0.0f, 1e4f, 1}, {"clip-idle", 1.0f, 0.25f, 3}, {"clipped", 1.0f, 1e4f, 7}};
    for (int k = 0; k < 3; k++) {
        char shape[64];
        snprintf(shape, sizeof shape, "n%zu %s t%d", n, mode[k].name, mode[k].t);
        tot[0] = mode[k].sumsq;
        AdamArgs w = {p, g, m, v, n, adamw_default_config(), 1e-3f, mode[k].t, tot, NULL};
        w.c.max_norm = mode[k].max_norm;
        Buf bw[] = {{"grad", g, F(n), IN}, {"sumsq", tot, F(1), IN}, {"param", p, F(n), OUT},
                    {"exp_avg", m, F(n), OUT}, {"exp_avg_sq", v, F(n), OUT}};
        CASE_F32("adamw", shape, kcpu_adamw, kcuda_adamw, w, bw);
    }
    free(p), free(g), free(m), free(v), free(tot);
}

static void check_crossentropy(Ctx *c, size_t N, size_t V) {
    float *logits = randf(N * V, 6), *loss = randf(1, 1), *dl = randf(N * V, 1);
    int32_t *tgt = randi(N, (int32_t)V);
    char shape[64];
    snprintf(shape, sizeof shape, "N%zu V%zu", N, V);
    CeArgs f = {loss, NULL, logits, tgt, N, V, N};
    Buf bf[] = {{"logits", logits, F(N * V), IN}, {"targets", tgt, N * 4, IN}, {"loss", loss, F(1), OUT}};
    CASE_F32("crossentropy_forward", shape, kcpu_crossentropy_forward, kcuda_crossentropy_forward, f, bf);
    CeArgs g = {NULL, dl, logits, tgt, N, V, N};
    Buf bg[] = {{"logits", logits, F(N * V), IN}, {"targets", tgt, N * 4, IN}, {"dlogits", dl, F(N * V), OUT}};
    CASE_F32("crossentropy_backward", shape, kcpu_crossentropy_backward, kcuda_crossentropy_backward, g, bg);
    free(logits), free(loss), free(dl), free(tgt);
}

/* the ops with [a] tensors, in the dtype c->bf16 says */
static void check_activation_ops(Ctx *c) {
    check_embedding(c, 37, 48, 50);
    check_embedding(c, 300, 33, 17);     /* every token repeated many times */
    check_embedding(c, 1, 7, 3);
    check_rmsnorm(c, 33, 96);
    check_rmsnorm(c, 7, 1000);            /* rows wider than a block */
    check_rmsnorm(c, 517, 40);            /* dweight: many rows, a partial column tile */
    check_matmul(c, 45, 70, 33);
    check_matmul(c, 128, 64, 256);
    check_matmul(c, 1, 17, 5);
    check_matmul(c, 300, 96, 3);
    check_rope(c, 2, 19, 3, 16);
    check_rope(c, 1, 300, 2, 64);
    /* the CUDA flash kernels work in tiles of 32 query and 32 key rows (the CPU's in 64 x 64) */
    check_attention(c, 2, 37, 4, 2, 16);   /* GQA (2 heads per kv head), T not a multiple of the tiles */
    check_attention(c, 1, 64, 2, 2, 32);   /* plain multi-head, T whole tiles */
    check_attention(c, 1, 300, 6, 2, 24);  /* 3 heads per kv head, 10 tiles (the last partial), hd not 32k */
    check_attention(c, 3, 1, 2, 1, 8);     /* T = 1 */
    check_attention(c, 1, 70, 2, 1, 128);  /* head dim at the CUDA kernels' limit; both heads on one kv head */
    check_attention(c, 2, 33, 3, 3, 100);  /* one row past a tile, a partial chunk of lanes (100 = 3 x 32 + 4) */
    check_elementwise(c, 100003);
    check_elementwise(c, 1);
}

static void rank_main(Dev *dev, void *arg) {
    Ctx *c = arg;
    c->dev = dev;
    c->bf16 = 0;
    check_activation_ops(c);
    check_sumsq(c, 100003);
    check_sumsq(c, 3000017);              /* many elements per thread */
    check_sumsq(c, 1);
    check_adamw(c, 100003);
    check_crossentropy(c, 29, 203);
    check_crossentropy(c, 4, 2048);
    check_crossentropy(c, 300, 259);      /* more rows than the loss kernel's warps */
    check_crossentropy(c, 3, 1);
    c->bf16 = 1; /* the same cases with bfloat16 activations and weights (--param-dtype bf16) */
    check_activation_ops(c);
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
    printf("check_ops: GPU kernels vs CPU kernels, f32 and bf16 activations, error = max|gpu - cpu| / max|cpu| "
           "per output, two GPU runs bitwise equal%s\n", c.tf32 ? "; float32 matmuls in TF32" : "");
    world_run(w, rank_main, &c);
    world_destroy(w);
    printf("%d ops passed, %d failed%s\n", c.passed, c.failed, c.tf32 ? " (--tf32)" : "");
    return c.failed ? 1 : 0;
}
