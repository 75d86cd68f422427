/* hw_fsdp.h — THE CONTRACT. Read this first, then device.h: together they are
 * everything your code may use.
 *
 * You write ONE file: stages/NN_name/hw_fsdp.c. It implements the hooks
 * below. The training loop (common/driver/train_step.c, each module run by
 * trainer.c) calls them exactly as PyTorch autograd calls FSDP2's:
 *
 *   fsdp_init                          once: shard the model into DTensors
 *   for each step:
 *    for each microbatch (one, unless --grad-accum K; stage 07):
 *     for mod in modules (embedding, block0..block{L-1}, head):
 *       fsdp_pre_forward(mod)          -> make mod's Param.data valid (unshard;
 *                                         Param.data_bf16 with --param-dtype bf16)
 *       <mod forward on the compute stream>
 *       fsdp_post_forward(mod)         -> reshard (free Param.data)
 *     for mod in reverse order:
 *       fsdp_pre_backward(mod)         -> make mod's Param.data valid again
 *       if mod is a block that recomputes (activation checkpointing: every
 *       block with --ac or --ac-op, blocks N, 2N, ... counting from 1 with
 *       --ac-every N; run.json's recompute_blocks):
 *         fsdp_pre_forward(mod); <recompute forward>; fsdp_post_forward(mod)
 *       (a block that does not recompute sees no forward hook here)
 *       <runtime allocates and zeroes mod's Param.grad left NULL (unsharded grads)>
 *       <mod backward on the compute stream, accumulates into Param.grad>
 *       fsdp_post_backward(mod)        -> reduce-scatter Param.grad into
 *                                         DTensor.grad, free Param.grad, reshard
 *     fsdp_finish_backward()           -> end of a backward: reductions queued
 *   grad_norm = fsdp_optimizer_step()    (global norm, clip, AdamW on shards)
 *
 * Per-rank state: the ranks are threads of one process (the CPU runtime and
 * the one-GPU CUDA runtime), so a writable file-scope or function-static
 * variable in your file is ONE copy every rank reads and writes; the build
 * refuses one, naming it. Keep what a rank owns in your struct Fsdp
 * (fsdp_init returns it, every hook gets it) or per module in mod->fsdp.
 * static const tables are fine.
 *
 * What the runtime guarantees:
 *   - At fsdp_init every Param.data holds the full initial value (its own
 *     allocation, tag MEM_PARAM); fsdp_init must copy out this rank's shard and
 *     dev_free() it.
 *   - Module compute runs on dev_compute_stream(dev) and reads Param.data when
 *     that work runs, not when it is queued: make the compute stream wait
 *     (events) for whatever produces Param.data.
 *   - Param.grad is a fresh zeroed allocation (tag MEM_UNSHARDED_GRAD) per
 *     backward; after fsdp_post_backward the runtime never touches it again,
 *     unless mod->requires_gradient_sync was 0 (below): then the grads
 *     post_backward left in Param.grad are what the next backward adds to.
 *     A Param.grad a hook leaves set (non-NULL) when the module's backward
 *     starts is neither allocated nor zeroed by the runtime: the backward
 *     adds into it (FSDP1's .grad views into a flat gradient, stage 13:
 *     zero it yourself).
 *   - Param.data and Param.grad may be views into a larger allocation (a
 *     flat buffer, stage 13); the runtime never frees either.
 *   - With --param-dtype bf16 (stage 08) compute reads Param.data_bf16 and
 *     never Param.data: its rows must hold this rank's shard rounded to
 *     bfloat16 (launch_cast_to_bf16, or launch_cast_batch_to_bf16 for a
 *     list of shards in one launch). The grads stay float32.
 *   - Buffers, FSDP2's rule: allocate a buffer on the stream that fills it
 *     (dev_alloc_on; dev_alloc is the compute stream's pool) and dev_free it
 *     once the last op that uses it is queued. dev_free gives the block back
 *     to its stream's pool at once (PyTorch's caching allocator), so before
 *     that stream touches blocks of its pool again it must have waited for an
 *     event recorded after any other stream's use of the freed one. Hence the
 *     all-gather output and the reduce-scatter input are kept (AllGatherState,
 *     ReduceScatterState) until their owner waited, while the grad shards (the
 *     reduce-scatter output, read by AdamW on compute) are freed right after
 *     their AdamW is queued: the rs stream waits for compute before its next
 *     reduce-scatter. HANDOUT.md#the-mental-model ("Memory") says more.
 *   - The same calls, in the same order, on every rank.
 *   - Resuming (--load of a --save checkpoint): DTensor.exp_avg/exp_avg_sq are
 *     already allocated and filled after fsdp_init (beside the shard: in pinned
 *     host memory when DTensor.local is; a Flat param's are views into one
 *     zeroed [S] allocation per unit, device.h); create optimizer state only
 *     where they are NULL.
 * What the grader checks, per stage: see HANDOUT.md.
 */
#ifndef HWFSDP_HW_FSDP_H
#define HWFSDP_HW_FSDP_H

#include <stddef.h>

#include "device.h"

/* ------------------------------------------------ the model your hooks see */

typedef struct {
    int dim;                  /* D */
    int n_layers;             /* L */
    int n_heads;              /* H */
    int n_kv_heads;           /* KV (GQA when < H; 0 means = H) */
    int vocab_size;           /* V */
    int multiple_of;          /* FFN hidden rounded up to a multiple of this */
    float ffn_dim_multiplier; /* 0 = none */
    float norm_eps;           /* 1e-5 */
    float rope_theta;         /* 500000 (Llama 2: 10000) */
    float rope_factor, rope_low_freq_factor, rope_high_freq_factor, rope_old_context; /* Llama 3.1 (0: none; ops.h) */
    /* derived */
    int head_dim;             /* hd = D / H */
    int hidden_dim;           /* F = multiple_of * ceil(m * (2 * 4D / 3) / multiple_of) */
} ModelConfig;

typedef struct {
    char name[64];            /* torchtitan name, e.g. "layers.2.attention.wq.weight" */
    int ndim;                 /* 1 (norm weights) or 2 */
    size_t shape[2];          /* global shape; Linear weights are [out, in] */
    size_t numel;
    float *data;              /* [numel] unsharded values the forward reads */
    Bf16 *data_bf16;          /* [numel] the same in bfloat16: with --param-dtype bf16
                                 (stage 08) the forward reads this instead of data */
    float *grad;              /* [numel] unsharded grad the backward accumulates into */
    DTensor dt;               /* the sharded parameter (device.h) */
} Param;

/* The most parameters a module has (a block has 9); the runtime checks it, so
 * per-module arrays of this size never overflow. */
#define MODULE_MAX_PARAMS 16

typedef enum { MOD_EMBEDDING = 0, MOD_BLOCK = 1, MOD_HEAD = 2 } ModuleKind;

typedef struct ModuleActs ModuleActs; /* saved activations (runtime-private) */

/* Modules, in forward order (as torchtitan wraps them with fully_shard):
 *   modules[0]        "embedding"  tok_embeddings.weight
 *   modules[1 .. L]   "block<i>"   attention_norm, wq, wk, wv, wo, ffn_norm, w1, w2, w3
 *   modules[L + 1]    "head"       norm.weight, output.weight (+ the loss)
 * With --pp (stages 11-12, hw_pipe.h) the Model holds only this rank's
 * pipeline stage: a contiguous run of them, `index` counting from 0 there. */
typedef struct {
    ModuleKind kind;
    int index;                /* position in forward order: 0 .. n_modules-1 */
    int layer;                /* block number (blocks only; -1 otherwise) */
    char name[24];            /* "embedding", "block3", "head" */
    int n_params;             /* <= MODULE_MAX_PARAMS */
    Param *params;            /* [n_params] */
    void *fsdp;               /* yours: per-module FSDP state */
    /* Set by the loop before each microbatch, as FSDP2's user calls
     * set_requires_gradient_sync / set_reshard_after_backward (stage 07;
     * both 1 without --grad-accum):
     *   requires_gradient_sync 0: post_backward keeps Param.grad (the next
     *     microbatch accumulates into it) and reduce-scatters nothing;
     *   reshard_after_backward 0: post_backward keeps Param.data unsharded. */
    int requires_gradient_sync;
    int reshard_after_backward;
    ModuleActs *acts;         /* runtime-private */
} Module;

typedef struct {
    ModelConfig cfg;
    int n_modules;            /* L + 2 */
    Module *modules;          /* [n_modules] in forward order */
    size_t n_params_total;    /* elements over all parameters */
} Model;

/* ---------------------------------------------------------------- the hooks */

/* FSDP2's MixedPrecisionPolicy (stage 08; both DTYPE_F32 without flags).
 * Shards, grads and optimizer state stay float32 either way. */
typedef struct {
    DType param_dtype;   /* --param-dtype: what the all-gather moves and compute reads */
    DType reduce_dtype;  /* --reduce-dtype: what the reduce-scatter moves */
} MixedPrecision;

/* When module i-1's all-gather is issued during the backward (stage 10):
 * PRE at the start of module i's backward (fsdp_pre_backward; FSDP2's default),
 * POST once module i's reduce-scatter is issued (fsdp_post_backward), NONE in
 * module i-1's own fsdp_pre_backward (no prefetch). */
typedef enum { BACKWARD_PREFETCH_PRE = 0, BACKWARD_PREFETCH_POST = 1, BACKWARD_PREFETCH_NONE = 2 } BackwardPrefetch;

typedef struct {
    Dev *dev;
    Model *model;
    const DeviceMesh *mesh;       /* the world, or a 2-D mesh with --mesh (stage 09) */
    int reshard_after_forward;    /* 0 with --reshard-after-forward=false (ZeRO-2) */
    MixedPrecision mp;            /* stage 08 */
    AdamWConfig optim;            /* lr, betas, eps, weight decay, max_norm */
    BackwardPrefetch backward_prefetch; /* --backward-prefetch pre|post|none (stage 10) */
    int single_comm_stream;       /* --single-comm-stream: all-gathers and reduce-scatters share one stream (stage 10) */
    int offload_params;           /* --offload-params: shards, grad shards and optimizer state in pinned host
                                     memory, the optimizer step on them (stage 10) */
    size_t bucket_bytes;          /* stage 13: a flat unit takes consecutive modules until their params hold at
                                     least this many bytes; 0: one unit per module */
} FsdpConfig;

typedef struct Fsdp Fsdp;         /* yours: define struct Fsdp in hw_fsdp.c */

Fsdp *fsdp_init(const FsdpConfig *cfg);
void fsdp_pre_forward(Fsdp *f, Module *mod);
void fsdp_post_forward(Fsdp *f, Module *mod);
void fsdp_pre_backward(Fsdp *f, Module *mod);
void fsdp_post_backward(Fsdp *f, Module *mod);
void fsdp_finish_backward(Fsdp *f);
/* Global grad norm over all ranks' sharded grads (before clipping), clip to
 * optim.max_norm, AdamW on this rank's shards with learning rate lr and
 * 1-based step t; free the sharded grads. Returns the grad norm. */
float fsdp_optimizer_step(Fsdp *f, float lr, int t);
void fsdp_destroy(Fsdp *f);

/* A TODO stub: prints "TODO not implemented: <what> (see <where>)" and exits
 * with status 3. The starters call it where your code goes. */
void hw_todo(const char *what, const char *where) __attribute__((noreturn));

/* Host memory for your bookkeeping (never NULL: out of memory is fatal).
 * Device buffers come from dev_alloc. */
void *xmalloc(size_t bytes);
void *xcalloc(size_t n, size_t size);

#endif
