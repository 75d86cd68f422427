/* model.c — torchtitan's Llama 3 as modules with explicit forward/backward.
 *
 * Every kernel call is queued on the compute stream (dev_launch), so the host
 * only allocates, queues and moves on, exactly as with CUDA. The kernels
 * (kernels.h) are plain C in ops.c on the CPU backend, CUDA on the GPU one.
 *
 * Block math (x is the block input, N = B*T rows):
 *   xn  = RMSNorm(x) * attention_norm              [N, D]
 *   q   = RoPE(xn Wq^T), k = RoPE(xn Wk^T), v = xn Wv^T
 *   att = softmax(q k^T / sqrt(hd) + causal) v     [N, H*hd]  (flash: saves lse [B,H,T], no [T,T])
 *   h   = x + att Wo^T                             [N, D]
 *   hn  = RMSNorm(h) * ffn_norm
 *   g   = silu(hn W1^T) * (hn W3^T)                [N, F]
 *   out = h + g W2^T
 */
#include "model/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/costs.h"
#include "model/kernels.h"
#include "runtime/runtime.h"
#include "runtime/util.h"

/* ------------------------------------------------------------ configuration */

/* The published Llama models, as their configs define them: llama-models' sku_list.py for Llama 3 and 3.1,
 * Llama 2's params.json (not sku_list.py, whose Llama 2 entries copy Llama 3's arguments). F is derived by
 * model_config_finalize: 14336 / 28672 / 53248 for Llama 3 and 3.1's 8B / 70B / 405B, 11008 / 13824 / 28672
 * for Llama 2's 7B / 13B / 70B. Vocab: Llama 3's tokenizer's 128,000 + 256 special tokens, Llama 2's 32,000.
 * 8B and 70B are Llama 3 as torchtitan defines it (no RoPE scaling, context 8192); Llama 3.1 has the same
 * shapes (405B: its own), Llama 3.1's scaled RoPE and context 131072. */
static const struct {
    const char *name, *family;
    int dim, n_layers, n_heads, n_kv_heads, vocab_size, multiple_of;
    float ffn_dim_multiplier; /* 0: none (Llama 2 7B and 13B) */
    float rope_theta;
    int scaled_rope;          /* Llama 3.1's RoPE scaling (LLAMA31_ROPE) */
    size_t max_seq_len;       /* context */
} LLAMA[] = {
    /* name           family       dim    L    H    KV  vocab   mult_of mult  theta      scaled context */
    {"8B",            "Llama 3",   4096,  32,  32,  8,  128256, 1024,   1.3f, 500000.0f, 0,     8192},
    {"70B",           "Llama 3",   8192,  80,  64,  8,  128256, 4096,   1.3f, 500000.0f, 0,     8192},
    {"llama2-7B",     "Llama 2",   4096,  32,  32,  32, 32000,  256,    0.0f, 10000.0f,  0,     4096},
    {"llama2-13B",    "Llama 2",   5120,  40,  40,  40, 32000,  256,    0.0f, 10000.0f,  0,     4096},
    {"llama2-70B",    "Llama 2",   8192,  80,  64,  8,  32000,  4096,   1.3f, 10000.0f,  0,     4096},
    {"llama3.1-8B",   "Llama 3.1", 4096,  32,  32,  8,  128256, 1024,   1.3f, 500000.0f, 1,     131072},
    {"llama3.1-70B",  "Llama 3.1", 8192,  80,  64,  8,  128256, 4096,   1.3f, 500000.0f, 1,     131072},
    {"llama3.1-405B", "Llama 3.1", 16384, 126, 128, 8,  128256, 4096,   1.2f, 500000.0f, 1,     131072},
};
#define N_LLAMA (sizeof LLAMA / sizeof LLAMA[0])

/* Llama 3.1's RoPE scaling (llama-models' apply_scaling): factor 8, low / high frequency factors 1 and 4,
 * original context 8192 (ops.h: the formula) */
static const RopeScaling LLAMA31_ROPE = {8.0f, 1.0f, 4.0f, 8192.0f};

int model_flavor(ModelConfig *c, const char *name) {
    memset(c, 0, sizeof *c);
    c->norm_eps = 1e-5f;
    c->rope_theta = 500000.0f;
    c->multiple_of = 256;
    if (strcmp(name, "tiny") == 0) {
        /* Small enough that 4 ranks x 10 steps take about a second on 2 cores.
         * vocab 259 is not divisible by 2, 3 or 4, so sharding pads at every
         * grading world size; n_kv_heads < n_heads exercises GQA. */
        c->dim = 64;
        c->n_layers = 2;
        c->n_heads = 4;
        c->n_kv_heads = 2;
        c->vocab_size = 259;
        c->multiple_of = 32;
    } else if (strcmp(name, "debugmodel") == 0) {
        c->dim = 256;
        c->n_layers = 6;
        c->n_heads = 16;
        c->vocab_size = 2048;
    } else if (strcmp(name, "1B") == 0) {
        c->dim = 2048;
        c->n_layers = 18;
        c->n_heads = 16;
        c->vocab_size = 2048;
    } else {
        for (size_t i = 0; i < N_LLAMA; i++)
            if (strcmp(name, LLAMA[i].name) == 0) {
                c->dim = LLAMA[i].dim;
                c->n_layers = LLAMA[i].n_layers;
                c->n_heads = LLAMA[i].n_heads;
                c->n_kv_heads = LLAMA[i].n_kv_heads;
                c->vocab_size = LLAMA[i].vocab_size;
                c->multiple_of = LLAMA[i].multiple_of;
                c->ffn_dim_multiplier = LLAMA[i].ffn_dim_multiplier;
                c->rope_theta = LLAMA[i].rope_theta;
                if (LLAMA[i].scaled_rope) {
                    c->rope_factor = LLAMA31_ROPE.factor;
                    c->rope_low_freq_factor = LLAMA31_ROPE.low_freq_factor;
                    c->rope_high_freq_factor = LLAMA31_ROPE.high_freq_factor;
                    c->rope_old_context = LLAMA31_ROPE.old_context;
                }
                return 1;
            }
        return 0;
    }
    return 1;
}

size_t model_flavor_max_seq_len(const char *name) {
    /* the published models' context; the small flavours are this project's and take any length */
    for (size_t i = 0; name && i < N_LLAMA; i++)
        if (strcmp(name, LLAMA[i].name) == 0) return LLAMA[i].max_seq_len;
    return 0;
}

const char *model_flavor_family(const char *name) {
    for (size_t i = 0; name && i < N_LLAMA; i++)
        if (strcmp(name, LLAMA[i].name) == 0) return LLAMA[i].family;
    return NULL;
}

void model_config_finalize(ModelConfig *c) {
    if (c->dim <= 0 || c->n_layers <= 0 || c->n_heads <= 0 || c->vocab_size <= 0 || c->multiple_of <= 0)
        fatal("model sizes must be positive (dim %d, n-layers %d, n-heads %d, vocab-size %d, multiple-of %d)",
              c->dim, c->n_layers, c->n_heads, c->vocab_size, c->multiple_of);
    if (c->n_kv_heads == 0) c->n_kv_heads = c->n_heads;
    if (c->n_kv_heads < 0) fatal("n-kv-heads must be positive (got %d)", c->n_kv_heads);
    if (c->dim % c->n_heads != 0) fatal("dim %d is not divisible by n-heads %d", c->dim, c->n_heads);
    if (c->n_heads % c->n_kv_heads != 0)
        fatal("n-heads %d is not divisible by n-kv-heads %d", c->n_heads, c->n_kv_heads);
    c->head_dim = c->dim / c->n_heads;
    if (c->head_dim % 2 != 0) fatal("head dim %d (dim / n-heads) must be even for RoPE", c->head_dim);
    if (c->ffn_dim_multiplier < 0) fatal("ffn-dim-multiplier must be positive");
    /* Llama 3.1's RoPE scaling (ops.h): its blend divides by high - low and the bands by both */
    if (c->rope_factor != 0.0f && !(c->rope_factor > 0.0f && c->rope_low_freq_factor > 0.0f &&
                                    c->rope_high_freq_factor > c->rope_low_freq_factor && c->rope_old_context > 0.0f))
        fatal("RoPE scaling needs factor > 0, 0 < low-freq factor < high-freq factor and an original context > 0 "
              "(got %g, %g, %g, %g)", c->rope_factor, c->rope_low_freq_factor, c->rope_high_freq_factor,
              c->rope_old_context);
    /* torchtitan: hidden = int(2 * 4d / 3); times multiplier; round up to multiple_of */
    long hidden = (long)(2 * (4 * (long)c->dim) / 3);
    if (c->ffn_dim_multiplier > 0) hidden = (long)(c->ffn_dim_multiplier * (float)hidden);
    hidden = c->multiple_of * ((hidden + c->multiple_of - 1) / c->multiple_of);
    c->hidden_dim = (int)hidden;
}

/* Saved activations of one module (what its backward needs). The void *
 * ones are activations: float32, or bfloat16 words under --param-dtype bf16
 * (kernels.h: the [a] tensors); the float * ones are float32 always. */
struct ModuleActs {
    void *x;       /* [N, D] module input (blocks, head); owned, freed in backward */
    void *xn;      /* [N, D] first RMSNorm output */
    float *rstd1;  /* [N] */
    void *q;       /* [N, H*hd] after RoPE */
    void *k;       /* [N, KV*hd] after RoPE */
    void *v;       /* [N, KV*hd] */
    float *lse;    /* [B, H, T] each attention row's logsumexp (flash attention) */
    void *att;     /* [N, H*hd] attention output before wo */
    void *h;       /* [N, D] x + attention branch */
    void *hn;      /* [N, D] ffn RMSNorm output */
    float *rstd2;  /* [N] */
    void *a;       /* [N, F] hn W1^T */
    void *b;       /* [N, F] hn W3^T */
    void *g;       /* [N, F] silu(a) * b */
    float *logits; /* [N, V] (head; float32 for the loss, as torchtitan's .float()) */
    void *eager_w2; /* [N, D] --price-ops eager* under --ac-op: the w2 output torchtitan's policy saves (eager_hold) */
};

/* ---------------------------------------------------------------- structure */

static void set_param(Param *p, const char *name, int ndim, size_t d0, size_t d1) {
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "%s", name);
    p->ndim = ndim;
    p->shape[0] = d0;
    p->shape[1] = ndim == 2 ? d1 : 1;
    p->numel = d0 * p->shape[1];
}

/* Block parameter order (index into Module.params). */
enum { P_ATTN_NORM, P_WQ, P_WK, P_WV, P_WO, P_FFN_NORM, P_W1, P_W2, P_W3, P_BLOCK_COUNT };
enum { P_HEAD_NORM, P_OUTPUT, P_HEAD_COUNT };
/* per-module arrays (hw_fsdp.c's offsets, the driver's probes) hold MODULE_MAX_PARAMS entries */
_Static_assert(P_BLOCK_COUNT <= MODULE_MAX_PARAMS && P_HEAD_COUNT <= MODULE_MAX_PARAMS, "raise MODULE_MAX_PARAMS");

Model *model_create(const ModelConfig *cin) {
    Model *m = xcalloc(1, sizeof *m);
    m->cfg = *cin;
    model_config_finalize(&m->cfg);
    const ModelConfig *c = &m->cfg;
    size_t D = (size_t)c->dim, V = (size_t)c->vocab_size, F = (size_t)c->hidden_dim;
    size_t Hq = (size_t)c->n_heads * (size_t)c->head_dim, Hkv = (size_t)c->n_kv_heads * (size_t)c->head_dim;
    m->n_modules = c->n_layers + 2;
    m->modules = xcalloc((size_t)m->n_modules, sizeof(Module));
    char nm[64];
    for (int i = 0; i < m->n_modules; i++) {
        Module *mod = &m->modules[i];
        mod->index = i;
        mod->layer = -1;
        if (i == 0) {
            mod->kind = MOD_EMBEDDING;
            snprintf(mod->name, sizeof mod->name, "embedding");
            mod->n_params = 1;
            mod->params = xcalloc(1, sizeof(Param));
            set_param(&mod->params[0], "tok_embeddings.weight", 2, V, D);
        } else if (i == m->n_modules - 1) {
            mod->kind = MOD_HEAD;
            snprintf(mod->name, sizeof mod->name, "head");
            mod->n_params = P_HEAD_COUNT;
            mod->params = xcalloc(P_HEAD_COUNT, sizeof(Param));
            set_param(&mod->params[P_HEAD_NORM], "norm.weight", 1, D, 1);
            set_param(&mod->params[P_OUTPUT], "output.weight", 2, V, D);
        } else {
            int l = i - 1;
            mod->kind = MOD_BLOCK;
            mod->layer = l;
            snprintf(mod->name, sizeof mod->name, "block%d", l);
            mod->n_params = P_BLOCK_COUNT;
            mod->params = xcalloc(P_BLOCK_COUNT, sizeof(Param));
#define BP(idx, suffix, nd, a, b)                                 \
    snprintf(nm, sizeof nm, "layers.%d.%s", l, suffix);           \
    set_param(&mod->params[idx], nm, nd, a, b)
            BP(P_ATTN_NORM, "attention_norm.weight", 1, D, 1);
            BP(P_WQ, "attention.wq.weight", 2, Hq, D);
            BP(P_WK, "attention.wk.weight", 2, Hkv, D);
            BP(P_WV, "attention.wv.weight", 2, Hkv, D);
            BP(P_WO, "attention.wo.weight", 2, D, Hq);
            BP(P_FFN_NORM, "ffn_norm.weight", 1, D, 1);
            BP(P_W1, "feed_forward.w1.weight", 2, F, D);
            BP(P_W2, "feed_forward.w2.weight", 2, D, F);
            BP(P_W3, "feed_forward.w3.weight", 2, F, D);
#undef BP
        }
        mod->acts = xcalloc(1, sizeof(ModuleActs));
        for (int j = 0; j < mod->n_params; j++) m->n_params_total += mod->params[j].numel;
    }
    return m;
}

void model_destroy(Model *m) {
    if (!m) return;
    for (int i = 0; i < m->n_modules; i++) {
        free(m->modules[i].params);
        free(m->modules[i].acts);
    }
    free(m->modules);
    free(m);
}

Param *model_find_param(Model *m, const char *name) {
    for (int i = 0; i < m->n_modules; i++)
        for (int j = 0; j < m->modules[i].n_params; j++)
            if (strcmp(m->modules[i].params[j].name, name) == 0) return &m->modules[i].params[j];
    return NULL;
}

size_t model_param_offset(const Model *m, const Param *p) {
    size_t off = 0;
    for (int i = 0; i < m->n_modules; i++)
        for (int j = 0; j < m->modules[i].n_params; j++) {
            if (&m->modules[i].params[j] == p) return off;
            off += m->modules[i].params[j].numel;
        }
    fatal("model_param_offset: parameter not in model");
}

/* Truncated normal by rejection: N(0, std) restricted to [lo, hi]. */
static void trunc_normal(Rng *r, float *out, size_t n, float std, float lo, float hi) {
    for (size_t i = 0; i < n; i++) {
        float v;
        do v = rng_normal(r) * std;
        while (v < lo || v > hi);
        out[i] = v;
    }
}

void model_init_host(const Model *m, uint64_t seed, float *out) {
    /* torchtitan's init: embeddings N(0, 1); wq, wk, wv, w1 trunc N(0, 0.02);
     * wo, w2, w3 trunc N(0, 0.02 / sqrt(2 (layer + 1))) (depth init); norms 1;
     * output trunc N(0, dim^-0.5) cut at 3 std. Each parameter draws from its
     * own stream so the values do not depend on anything but (seed, name). */
    size_t off = 0;
    int pidx = 0;
    for (int i = 0; i < m->n_modules; i++) {
        const Module *mod = &m->modules[i];
        for (int j = 0; j < mod->n_params; j++, pidx++) {
            const Param *p = &mod->params[j];
            float *w = out + off;
            Rng r;
            rng_seed(&r, seed * 1000003ull + (uint64_t)pidx);
            if (p->ndim == 1) {
                for (size_t e = 0; e < p->numel; e++) w[e] = 1.0f;
            } else if (mod->kind == MOD_EMBEDDING) {
                for (size_t e = 0; e < p->numel; e++) w[e] = rng_normal(&r);
            } else if (mod->kind == MOD_HEAD) {
                float std = 1.0f / sqrtf((float)m->cfg.dim);
                trunc_normal(&r, w, p->numel, std, -3 * std, 3 * std);
            } else {
                float depth_std = 0.02f / sqrtf(2.0f * (float)(mod->layer + 1));
                float std = (j == P_WO || j == P_W2 || j == P_W3) ? depth_std : 0.02f;
                trunc_normal(&r, w, p->numel, std, -2.0f, 2.0f);
            }
            off += p->numel;
        }
    }
}

/* ----------------------------------------------------------- queued kernels */

/* Small helpers so the module code reads like the math. */
typedef struct {
    Dev *dev;
    Stream *s;
    const char *mod;
    int bf16; /* the run's activations are bfloat16 (--param-dtype bf16) */
} Q;

static DType act_dtype(const ModelRun *run) { return run->param_bf16 ? DTYPE_BF16 : DTYPE_F32; }
/* bytes of one activation element: 2 under bf16, else 4 */
static size_t elem_size(int bf16) { return bf16 ? sizeof(Bf16) : sizeof(float); }
static size_t act_size(const ModelRun *run) { return elem_size(run->param_bf16); }

static void *alloc_named(Q *q, size_t n, size_t esize, MemTag tag, const char *what) {
    char nm[64];
    snprintf(nm, sizeof nm, "%s.%s", q->mod, what);
    return dev_alloc(q->dev, n * esize, tag, nm);
}
/* an activation of n elements in the run's dtype */
static void *act(Q *q, size_t n, const char *what) {
    return alloc_named(q, n, elem_size(q->bf16), MEM_ACTIVATION, what);
}
/* a float32 activation (rstd, lse, logits, the loss, the RoPE tables) */
static float *act_f32(Q *q, size_t n, const char *what) { return alloc_named(q, n, sizeof(float), MEM_ACTIVATION, what); }
static float *temp_f32(Q *q, size_t n, const char *what) { return alloc_named(q, n, sizeof(float), MEM_TEMP, what); }
/* a zeroed gradient of an activation (the run's dtype; bf16 zero is 0x0000) */
static void *zeros(Q *q, size_t n, const char *what) {
    size_t es = elem_size(q->bf16);
    void *p = alloc_named(q, n, es, MEM_TEMP, what);
    dev_memset_async(q->s, p, 0, n * es);
    return p;
}

/* The values an op reads for parameter p: Param.data (float32), or with
 * --param-dtype bf16 Param.data_bf16, the all-gathered bfloat16 words, read
 * directly, as cuBLAS reads bfloat16 inputs (the CPU kernels widen them in
 * their own working copy: cpu/kernels_cpu.c). The race detector sees the read. */
static const void *param_in(ModelRun *run, const Param *p) {
    if (!run->param_bf16) {
        dev_access(run->stream, p->data, p->numel * sizeof(float), 0, p->name);
        return p->data;
    }
    if (!p->data_bf16) fatal("%s: Param.data_bf16 is NULL when compute reads it (--param-dtype bf16)", p->name);
    dev_access(run->stream, p->data_bf16, p->numel * sizeof(Bf16), 0, p->name);
    return p->data_bf16;
}

/* A backward accumulates into p's grad: the race detector sees the write. */
static void grad_written(ModelRun *run, const Param *p) {
    dev_access(run->stream, p->grad, p->numel * sizeof(float), 1, NULL);
}

/* The ops on a parameter p read it through param_in; their backwards
 * accumulate its gradient into p->grad. Bytes: e per activation element. */
static void rmsnorm_q(Q *q, ModelRun *run, void *out, float *rstd, const void *in, const Param *p, size_t N,
                      size_t D, float eps) {
    NormArgs a = {out, rstd, in, param_in(run, p), N, D, eps, q->bf16};
    KernelCost c = kcost_rmsnorm_forward(N, D, act_dtype(run));
    dev_launch(q->s, "rmsnorm", &c, KERNEL(q->s, rmsnorm_forward), &a, sizeof a);
}
static void rmsnorm_bwd_q(Q *q, ModelRun *run, void *dinp, const void *dout, const void *in, const Param *p,
                          const float *rstd, size_t N, size_t D) {
    grad_written(run, p);
    NormBwdArgs a = {dinp, p->grad, dout, in, param_in(run, p), rstd, N, D, q->bf16};
    KernelCost c = kcost_rmsnorm_backward(N, D, act_dtype(run));
    dev_launch(q->s, "rmsnorm_bwd", &c, KERNEL(q->s, rmsnorm_backward), &a, sizeof a);
}
static void matmul_q(Q *q, ModelRun *run, const char *name, void *out, const void *in, const Param *p, size_t N,
                     size_t C, size_t OC) {
    MmArgs a = {out, in, param_in(run, p), N, C, OC, q->bf16};
    KernelCost c = kcost_matmul_forward(N, C, OC, act_dtype(run));
    dev_launch(q->s, name, &c, KERNEL(q->s, matmul_forward), &a, sizeof a);
}
static void matmul_bwd_q(Q *q, ModelRun *run, const char *name, void *dinp, const void *dout, const void *in,
                         const Param *p, size_t N, size_t C, size_t OC) {
    grad_written(run, p);
    MmBwdArgs a = {dinp, p->grad, dout, in, param_in(run, p), N, C, OC, q->bf16};
    KernelCost c = kcost_matmul_backward(N, C, OC, act_dtype(run));
    dev_launch(q->s, name, &c, KERNEL(q->s, matmul_backward), &a, sizeof a);
}
static void rope_q(Q *q, void *x, const ModelRun *run, size_t nh, size_t hd, int backward) {
    RopeArgs a = {x, run->rope_cos, run->rope_sin, run->B, run->T, nh, hd, backward, q->bf16};
    double n = (double)(run->B * run->T * nh * hd); /* a rotation: 6 FLOPs per pair */
    KernelCost c = kcost_elementwise(3.0 * n, 2.0 * (double)act_size(run) * n + 4.0 * (double)(run->T * hd));
    kcost_eager_rope(&c, (double)act_size(run), n);
    dev_launch(q->s, backward ? "rope_bwd" : "rope", &c, KERNEL(q->s, rope), &a, sizeof a);
}
static void add_q(Q *q, const ModelRun *run, void *out, const void *a_, const void *b_, size_t n) {
    AddArgs a = {out, a_, b_, n, q->bf16};
    KernelCost c = kcost_add(n, act_dtype(run));
    dev_launch(q->s, "residual_add", &c, KERNEL(q->s, add), &a, sizeof a);
}

/* The head's casts between its bf16 matmul and its float32 loss (named for
 * the model, apart from FSDP's copy-in casts): to_bf16 rounds f32 into bf16,
 * else widens bf16 into f32 (exact). */
static void cast_q(Q *q, const char *name, float *f32, Bf16 *bf16, size_t n, int to_bf16) {
    CastArgs a = {f32, bf16, n};
    dev_access(q->s, f32, n * sizeof(float), !to_bf16, NULL);
    dev_access(q->s, bf16, n * sizeof(Bf16), to_bf16, NULL);
    KernelCost c = kcost_elementwise((double)n, 6.0 * (double)n);
    dev_launch(q->s, name, &c, to_bf16 ? KERNEL(q->s, cast_to_bf16) : KERNEL(q->s, cast_from_bf16), &a, sizeof a);
}

/* eager_hold (--price-ops eager*, to compare memory with torchtitan's published runs): two buffers that hold
 * what torchtitan's eager program holds beyond this runtime, and are never read.
 *   - Under its per-op selective AC (torchtitan parallelize_llama.py at 9dec370a, _get_custom_policy) a block
 *     saves the output of every other matmul counting from its first: wq, wv, w1 and w2. This runtime's
 *     --ac-op needs no w2 output (its backward reads w2's input), so eager_w2 is that [N, D] tensor, held
 *     from the block's forward to its backward.
 *   - Eager cross-entropy (log_softmax, then nll_loss) has, in its backward, nll_loss's float32 gradient
 *     [N, V] and log_softmax's beside the saved log-probabilities; this runtime's fused loss writes its
 *     gradient at once: eager_nll_grad is the one more [N, V] float32 it lacks, during the loss's backward. */
static void free_acts(Dev *dev, ModuleActs *A, int keep_input) {
    void **all[] = {&A->xn, &A->q, &A->k, &A->v, &A->att, &A->h, &A->hn, &A->a, &A->b, &A->g, &A->eager_w2};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
        dev_free(dev, *all[i]);
        *all[i] = NULL;
    }
    float **f32[] = {&A->rstd1, &A->lse, &A->rstd2, &A->logits};
    for (size_t i = 0; i < sizeof f32 / sizeof f32[0]; i++) {
        dev_free(dev, *f32[i]);
        *f32[i] = NULL;
    }
    if (!keep_input) {
        dev_free(dev, A->x);
        A->x = NULL;
    }
}

/* ------------------------------------------------------------------- running */

void model_run_begin(Model *m, ModelRun *run) {
    size_t hd = (size_t)m->cfg.head_dim;
    Q q = {run->dev, run->stream, "rope", 0};
    run->rope_cos = act_f32(&q, run->T * hd / 2, "cos");
    run->rope_sin = act_f32(&q, run->T * hd / 2, "sin");
    const ModelConfig *cfg = &m->cfg; /* its RoPE: theta, and Llama 3.1's scaling (factor 0: none) */
    RopeTabArgs a = {run->rope_cos, run->rope_sin, run->T, hd, cfg->rope_theta,
                     {cfg->rope_factor, cfg->rope_low_freq_factor, cfg->rope_high_freq_factor, cfg->rope_old_context}};
    KernelCost c = kcost_elementwise(20.0 * (double)(run->T * hd / 2), 4.0 * (double)(run->T * hd)); /* a pow, a sin, a cos */
    dev_launch(run->stream, "rope_tables", &c, KERNEL(run->stream, rope_tables), &a, sizeof a);
    Q ql = {run->dev, run->stream, "head", 0};
    run->loss = act_f32(&ql, 1, "loss");
    run->h = run->dh = NULL;
}

void model_discard_activations(Model *m, ModelRun *run) {
    /* a block or the head owns its input, which may be run->h */
    int owned = 0;
    for (int i = 0; i < m->n_modules; i++)
        if (run->h && m->modules[i].acts->x == run->h) owned = 1;
    if (!owned) dev_free(run->dev, run->h);
    for (int i = 0; i < m->n_modules; i++) free_acts(run->dev, m->modules[i].acts, 0);
    dev_free(run->dev, run->dh);
    run->h = run->dh = NULL;
}

void model_run_end(Model *m, ModelRun *run) {
    model_discard_activations(m, run);
    dev_free(run->dev, run->rope_cos);
    dev_free(run->dev, run->rope_sin);
    dev_free(run->dev, run->loss);
    run->h = run->dh = NULL;
    run->rope_cos = run->rope_sin = run->loss = NULL;
}

/* ------------------------------------------------- activation checkpointing */

int ac_block_recomputes(AcPolicy ac, int layer) {
    switch (ac.mode) {
    case AC_FULL:
    case AC_OP: return 1;
    case AC_EVERY: return ac.every > 0 && (layer + 1) % ac.every == 0; /* torchtitan counts blocks from 1 */
    case AC_NONE: break;
    }
    return 0;
}

const char *ac_mode_name(AcMode mode) {
    static const char *const names[] = {[AC_NONE] = "none", [AC_FULL] = "full", [AC_EVERY] = "every", [AC_OP] = "op"};
    return (unsigned)mode < sizeof names / sizeof names[0] ? names[mode] : "none";
}

int module_recomputes(const ModelRun *run, const Module *mod) {
    return mod->kind == MOD_BLOCK && ac_block_recomputes(run->ac, mod->layer);
}

/* After a checkpointed block's forward: free what its recompute rebuilds.
 * AC_OP keeps x, q, v, att, lse and a (torchtitan's saved matmul and attention
 * outputs); the other modes keep x alone. */
static void drop_recomputed(Dev *dev, ModuleActs *A, AcMode mode) {
    if (mode != AC_OP) {
        free_acts(dev, A, 1);
        return;
    }
    void **rebuilt[] = {&A->xn, &A->k, &A->h, &A->hn, &A->b, &A->g};
    for (size_t i = 0; i < sizeof rebuilt / sizeof rebuilt[0]; i++) {
        dev_free(dev, *rebuilt[i]);
        *rebuilt[i] = NULL;
    }
    dev_free(dev, A->rstd1);
    dev_free(dev, A->rstd2);
    A->rstd1 = A->rstd2 = NULL;
}

/* The block forward up to g (everything the backward needs). With `kept`
 * (an AC_OP recompute) q, v, att, lse and a are the forward's, kept: only the
 * rest runs again, the same kernels on the same inputs, so the same bits. */
static void block_forward_saved(Model *m, Module *mod, ModelRun *run, Q *q, int kept) {
    const ModelConfig *c = &m->cfg;
    size_t N = run->B * run->T, D = (size_t)c->dim, F = (size_t)c->hidden_dim, hd = (size_t)c->head_dim;
    size_t H = (size_t)c->n_heads, KV = (size_t)c->n_kv_heads;
    ModuleActs *A = mod->acts;
    Param *P = mod->params;
    A->xn = act(q, N * D, "xn");
    A->rstd1 = act_f32(q, N, "rstd1");
    dev_access(run->stream, A->x, N * D * act_size(run), 0, "input");
    rmsnorm_q(q, run, A->xn, A->rstd1, A->x, &P[P_ATTN_NORM], N, D, c->norm_eps);
    if (!kept) {
        A->q = act(q, N * H * hd, "q");
        matmul_q(q, run, "wq", A->q, A->xn, &P[P_WQ], N, D, H * hd); /* matmul 1: kept by AC_OP */
    }
    A->k = act(q, N * KV * hd, "k");
    matmul_q(q, run, "wk", A->k, A->xn, &P[P_WK], N, D, KV * hd); /* matmul 2: recomputed by AC_OP */
    if (!kept) {
        A->v = act(q, N * KV * hd, "v");
        matmul_q(q, run, "wv", A->v, A->xn, &P[P_WV], N, D, KV * hd); /* matmul 3: kept */
        rope_q(q, A->q, run, H, hd, 0);
    }
    rope_q(q, A->k, run, KV, hd, 0);
    if (!kept) { /* the attention's outputs: kept */
        A->lse = act_f32(q, run->B * H * run->T, "lse");
        A->att = act(q, N * H * hd, "att");
        AttArgs aa = {A->att, A->lse, A->q, A->k, A->v, run->B, run->T, H, KV, hd, q->bf16};
        KernelCost ca = kcost_attention_forward(run->B, run->T, H, KV, hd, act_dtype(run));
        kcost_eager_attention(&ca, (double)act_size(run), (double)N, (double)H, (double)KV, (double)hd);
        dev_launch(q->s, "attention", &ca, KERNEL(q->s, attention_forward), &aa, sizeof aa);
    }
    A->h = act(q, N * D, "h"); /* matmul 4 (wo) and the residual: recomputed */
    matmul_q(q, run, "wo", A->h, A->att, &P[P_WO], N, H * hd, D);
    add_q(q, run, A->h, A->h, A->x, N * D);
    A->hn = act(q, N * D, "hn");
    A->rstd2 = act_f32(q, N, "rstd2");
    rmsnorm_q(q, run, A->hn, A->rstd2, A->h, &P[P_FFN_NORM], N, D, c->norm_eps);
    if (!kept) {
        A->a = act(q, N * F, "w1_out");
        matmul_q(q, run, "w1", A->a, A->hn, &P[P_W1], N, D, F); /* matmul 5: kept */
    }
    A->b = act(q, N * F, "w3_out");
    matmul_q(q, run, "w3", A->b, A->hn, &P[P_W3], N, D, F); /* matmul 6: recomputed */
    A->g = act(q, N * F, "swiglu");
    SwiArgs sa = {A->g, A->a, A->b, N * F, q->bf16};
    KernelCost cs = kcost_swiglu_forward(N * F, act_dtype(run)); /* silu(a) * b */
    dev_launch(q->s, "swiglu", &cs, KERNEL(q->s, swiglu_forward), &sa, sizeof sa);
}

struct ActsSlots {
    Model *m;
    int n;
    ModuleActs **own; /* [n_modules] each module's own, restored at the end */
    ModuleActs *sets; /* [n_modules * n] module i's set k at i * n + k */
};

ActsSlots *model_acts_slots(Model *m, int n) {
    ActsSlots *a = xcalloc(1, sizeof *a);
    a->m = m;
    a->n = n;
    a->own = xmalloc((size_t)m->n_modules * sizeof *a->own);
    for (int i = 0; i < m->n_modules; i++) a->own[i] = m->modules[i].acts;
    a->sets = xcalloc((size_t)m->n_modules * (size_t)n, sizeof *a->sets);
    return a;
}

void model_acts_use(ActsSlots *a, int k) {
    if (k < 0 || k >= a->n) fatal("model_acts_use: set %d of %d", k, a->n);
    for (int i = 0; i < a->m->n_modules; i++) a->m->modules[i].acts = &a->sets[(size_t)i * (size_t)a->n + (size_t)k];
}

void model_acts_slots_free(ActsSlots *a) {
    if (!a) return;
    for (int i = 0; i < a->m->n_modules; i++) a->m->modules[i].acts = a->own[i];
    free(a->own);
    free(a->sets);
    free(a);
}

void module_forward(Model *m, Module *mod, ModelRun *run) {
    const ModelConfig *c = &m->cfg;
    size_t N = run->B * run->T, D = (size_t)c->dim, V = (size_t)c->vocab_size;
    Q q = {run->dev, run->stream, mod->name, run->param_bf16};
    ModuleActs *A = mod->acts;
    Param *P = mod->params;
    if (mod->kind == MOD_EMBEDDING) {
        void *out = act(&q, N * D, "out");
        EmbArgs a = {out, run->inputs, param_in(run, &P[0]), N, D, q.bf16};
        double e = (double)act_size(run);
        KernelCost c = kcost_elementwise(0, 2.0 * e * (double)(N * D) + 4.0 * (double)N); /* a row copied per token */
        dev_launch(run->stream, "embedding", &c, KERNEL(run->stream, embedding_forward), &a, sizeof a);
        run->h = out;
    } else if (mod->kind == MOD_BLOCK) {
        A->x = run->h; /* the block owns its input until its backward */
        block_forward_saved(m, mod, run, &q, 0);
        void *out = act(&q, N * D, "out");
        matmul_q(&q, run, "w2", out, A->g, &P[P_W2], N, (size_t)c->hidden_dim, D); /* matmul 7 */
        if (run->eager_memory && run->ac.mode == AC_OP && module_recomputes(run, mod))
            A->eager_w2 = act(&q, N * D, "eager_w2_saved"); /* eager_hold: held, never read */
        add_q(&q, run, out, out, A->h, N * D);
        if (module_recomputes(run, mod)) drop_recomputed(run->dev, A, run->ac.mode);
        run->h = out;
    } else {
        A->x = run->h;
        A->xn = act(&q, N * D, "xn");
        A->rstd1 = act_f32(&q, N, "rstd");
        dev_access(run->stream, A->x, N * D * act_size(run), 0, "input");
        rmsnorm_q(&q, run, A->xn, A->rstd1, A->x, &P[P_HEAD_NORM], N, D, c->norm_eps);
        A->logits = act_f32(&q, N * V, "logits");
        if (q.bf16) { /* the bf16 matmul's rounded output, widened for the loss (torchtitan: pred.float()) */
            Bf16 *l16 = act(&q, N * V, "logits_bf16");
            matmul_q(&q, run, "output", l16, A->xn, &P[P_OUTPUT], N, D, V);
            cast_q(&q, "logits_to_f32", A->logits, l16, N * V, 0);
            dev_free(run->dev, l16);
        } else {
            matmul_q(&q, run, "output", A->logits, A->xn, &P[P_OUTPUT], N, D, V);
        }
        CeArgs ce = {run->loss, NULL, A->logits, run->targets, N, V, N};
        KernelCost c = kcost_elementwise(5.0 * (double)(N * V), 4.0 * (double)(N * V + 2 * N)); /* log-sum-exp per row */
        dev_launch(run->stream, "cross_entropy", &c, KERNEL(run->stream, crossentropy_forward), &ce, sizeof ce);
        run->h = NULL;
    }
}

void module_recompute(Model *m, Module *mod, ModelRun *run) {
    if (!module_recomputes(run, mod) || !mod->acts->x)
        fatal("module_recompute: %s has no checkpointed input (not a block that --ac / --ac-every / --ac-op "
              "checkpoints, or no forward before)", mod->name);
    Q q = {run->dev, run->stream, mod->name, run->param_bf16};
    block_forward_saved(m, mod, run, &q, run->ac.mode == AC_OP);
}

void module_backward(Model *m, Module *mod, ModelRun *run) {
    const ModelConfig *c = &m->cfg;
    size_t N = run->B * run->T, D = (size_t)c->dim, V = (size_t)c->vocab_size, F = (size_t)c->hidden_dim;
    size_t H = (size_t)c->n_heads, KV = (size_t)c->n_kv_heads, hd = (size_t)c->head_dim;
    Q q = {run->dev, run->stream, mod->name, run->param_bf16};
    ModuleActs *A = mod->acts;
    Param *P = mod->params;
    for (int j = 0; j < mod->n_params; j++)
        if (!P[j].grad) fatal("module_backward: %s has no grad buffer for %s", mod->name, P[j].name);
    if (mod->kind == MOD_HEAD) {
        float *dlogits = temp_f32(&q, N * V, "dlogits");
        dev_memset_async(run->stream, dlogits, 0, N * V * sizeof(float));
        size_t mean_over = N * (run->microbatches > 1 ? (size_t)run->microbatches : 1); /* loss / K */
        CeArgs ce = {NULL, dlogits, A->logits, run->targets, N, V, mean_over};
        KernelCost c = kcost_elementwise(5.0 * (double)(N * V), 4.0 * (double)(3 * N * V + N)); /* softmax - onehot */
        float *nll_grad = run->eager_memory ? temp_f32(&q, N * V, "eager_nll_grad") : NULL; /* eager_hold */
        dev_launch(run->stream, "cross_entropy_bwd", &c, KERNEL(run->stream, crossentropy_backward), &ce, sizeof ce);
        dev_free(run->dev, nll_grad);
        const void *dl = dlogits;
        if (q.bf16) { /* the grad of .float() is rounded to the bf16 logits' dtype */
            Bf16 *d16 = alloc_named(&q, N * V, sizeof(Bf16), MEM_TEMP, "dlogits_bf16");
            cast_q(&q, "dlogits_to_bf16", dlogits, d16, N * V, 1);
            dev_free(run->dev, dlogits);
            dlogits = NULL;
            dl = d16;
        }
        void *dxn = zeros(&q, N * D, "dxn");
        matmul_bwd_q(&q, run, "output_bwd", dxn, dl, A->xn, &P[P_OUTPUT], N, D, V);
        void *dx = zeros(&q, N * D, "dx");
        rmsnorm_bwd_q(&q, run, dx, dxn, A->x, &P[P_HEAD_NORM], A->rstd1, N, D);
        dev_free(run->dev, (void *)dl);
        dev_free(run->dev, dxn);
        free_acts(run->dev, A, 0);
        run->dh = dx;
    } else if (mod->kind == MOD_BLOCK) {
        void *dout = run->dh; /* [N, D]; becomes dL/dh below (the residual passes it through) */
        /* out = h + g W2^T */
        void *dg = zeros(&q, N * F, "dswiglu");
        matmul_bwd_q(&q, run, "w2_bwd", dg, dout, A->g, &P[P_W2], N, F, D);
        void *da = zeros(&q, N * F, "dw1_out"), *db = zeros(&q, N * F, "dw3_out");
        SwiBwdArgs sb = {da, db, dg, A->a, A->b, N * F, q.bf16};
        KernelCost cs = kcost_swiglu_backward(N * F, act_dtype(run)); /* da, db += */
        dev_launch(run->stream, "swiglu_bwd", &cs, KERNEL(run->stream, swiglu_backward), &sb, sizeof sb);
        void *dhn = zeros(&q, N * D, "dhn");
        matmul_bwd_q(&q, run, "w1_bwd", dhn, da, A->hn, &P[P_W1], N, D, F);
        matmul_bwd_q(&q, run, "w3_bwd", dhn, db, A->hn, &P[P_W3], N, D, F);
        void *dh = dout; /* dL/dh = dout (residual) + RMSNorm backward of dhn */
        rmsnorm_bwd_q(&q, run, dh, dhn, A->h, &P[P_FFN_NORM], A->rstd2, N, D);
        /* h = x + att Wo^T */
        void *datt = zeros(&q, N * H * hd, "datt");
        matmul_bwd_q(&q, run, "wo_bwd", datt, dh, A->att, &P[P_WO], N, H * hd, D);
        void *dq = zeros(&q, N * H * hd, "dq"), *dk = zeros(&q, N * KV * hd, "dk"), *dv = zeros(&q, N * KV * hd, "dv");
        float *scratch = temp_f32(&q, KERNEL(run->stream, attention_scratch_floats)(run->B, run->T, H), "att_scratch");
        AttBwdArgs ab = {dq, dk, dv, scratch, datt, A->q, A->k, A->v, A->att, A->lse, run->B, run->T, H, KV, hd, q.bf16};
        KernelCost ca = kcost_attention_backward(run->B, run->T, H, KV, hd, act_dtype(run));
        kcost_eager_attention(&ca, (double)act_size(run), (double)N, (double)H, (double)KV, (double)hd);
        dev_launch(run->stream, "attention_bwd", &ca, KERNEL(run->stream, attention_backward), &ab, sizeof ab);
        rope_q(&q, dq, run, H, hd, 1);
        rope_q(&q, dk, run, KV, hd, 1);
        void *dxn = zeros(&q, N * D, "dxn");
        matmul_bwd_q(&q, run, "wq_bwd", dxn, dq, A->xn, &P[P_WQ], N, D, H * hd);
        matmul_bwd_q(&q, run, "wk_bwd", dxn, dk, A->xn, &P[P_WK], N, D, KV * hd);
        matmul_bwd_q(&q, run, "wv_bwd", dxn, dv, A->xn, &P[P_WV], N, D, KV * hd);
        /* x feeds both the residual (dh) and the attention norm (dxn) */
        rmsnorm_bwd_q(&q, run, dh, dxn, A->x, &P[P_ATTN_NORM], A->rstd1, N, D);
        void *frees[] = {dg, da, db, dhn, datt, dq, dk, dv, scratch, dxn};
        for (size_t i = 0; i < sizeof frees / sizeof frees[0]; i++) dev_free(run->dev, frees[i]);
        free_acts(run->dev, A, 0);
        run->dh = dh; /* now dL/dx */
    } else {
        grad_written(run, &P[0]);
        EmbArgs a = {P[0].grad, run->inputs, run->dh, N, D, q.bf16};
        KernelCost c = kcost_elementwise((double)(N * D), (8.0 + (double)act_size(run)) * (double)(N * D) + 4.0 * (double)N); /* rows += */
        dev_launch(run->stream, "embedding_bwd", &c, KERNEL(run->stream, embedding_backward), &a, sizeof a);
        dev_free(run->dev, run->dh);
        run->dh = NULL;
    }
}
