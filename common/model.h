/* model.h — the Llama model (torchtitan's Llama 3) as modules with explicit
 * forward and backward, no autograd.
 *
 * Modules, in forward order (as torchtitan wraps them with FSDP):
 *   modules[0]            "embedding"  tok_embeddings.weight
 *   modules[1 .. L]       "block<i>"   one transformer block each
 *   modules[L + 1]        "head"       norm.weight, output.weight (+ the loss)
 *
 * A module's forward reads its parameters through Param.data and its backward
 * accumulates parameter gradients into Param.grad. Both are plain pointers
 * the caller sets (FSDP points them into all-gathered buffers).
 */
#ifndef HWFSDP_MODEL_H
#define HWFSDP_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "device.h"

typedef struct {
    int dim;                  /* D */
    int n_layers;             /* L */
    int n_heads;              /* H */
    int n_kv_heads;           /* KV (GQA when < H; 0 means = H) */
    int vocab_size;           /* V */
    int multiple_of;          /* FFN hidden rounded up to a multiple of this */
    float ffn_dim_multiplier; /* 0 = none */
    float norm_eps;           /* 1e-5 */
    float rope_theta;         /* 500000 */
    /* derived by model_config_finalize */
    int head_dim;             /* hd = D / H */
    int hidden_dim;           /* F = multiple_of * ceil(m * (2 * 4D / 3) / multiple_of) */
} ModelConfig;

/* Fill c with a named flavour: "tiny", "debugmodel", "1B". Returns 0 if the
 * name is unknown. */
int model_flavor(ModelConfig *c, const char *name);
/* Derive head_dim and hidden_dim; fatal with one line on an impossible config
 * (dim not divisible by heads, heads not divisible by kv heads, odd head dim,
 * non-positive sizes). */
void model_config_finalize(ModelConfig *c);

/* --- DTensor: a sharded parameter (filled by the FSDP implementation) ------ */

typedef enum { PLACEMENT_NONE = 0, PLACEMENT_SHARD0 = 1, PLACEMENT_REPLICATE = 2 } Placement;

/* The world as a 1-D device mesh: ranks 0..size-1. */
typedef struct {
    int size;
    int ranks[WORLD_MAX_RANKS];
} DeviceMesh;

typedef struct {
    /* Dim 0 split as torch.chunk splits it: every rank gets
     * padded_rows = ceil(global_rows / world) rows except the trailing ranks,
     * which get fewer or none; every local shard is stored padded to
     * padded_rows rows (padding rows are zeros). */
    float *local;             /* [padded_rows, row_numel] this rank's shard */
    float *grad;              /* [padded_rows, row_numel] sharded grad (NULL when none) */
    float *exp_avg;           /* [local_rows * row_numel] AdamW state of the shard */
    float *exp_avg_sq;        /* [local_rows * row_numel] */
    size_t global_rows;       /* global shape[0] */
    size_t row_numel;         /* product of the other global dims (1 for 1-D) */
    size_t local_rows;        /* rows this rank owns (may be 0) */
    size_t padded_rows;       /* rows stored: ceil(global_rows / world) */
    size_t row_offset;        /* first global row this rank owns */
    const DeviceMesh *mesh;   /* the world's mesh */
    Placement placement;      /* Shard(0) for FSDP */
} DTensor;

typedef struct {
    char name[64];            /* torchtitan name, e.g. "layers.2.attention.wq.weight" */
    int ndim;                 /* 1 (norm weights) or 2 */
    size_t shape[2];          /* global shape; Linear weights are [out, in] */
    size_t numel;
    float *data;              /* [numel] unsharded values the forward reads */
    float *grad;              /* [numel] unsharded grad the backward accumulates into */
    DTensor dt;               /* the sharded parameter */
} Param;

typedef enum { MOD_EMBEDDING = 0, MOD_BLOCK = 1, MOD_HEAD = 2 } ModuleKind;

typedef struct ModuleActs ModuleActs; /* saved activations (runtime-private) */

typedef struct {
    ModuleKind kind;
    int index;                /* position in forward order: 0 .. n_modules-1 */
    int layer;                /* block number (blocks only; -1 otherwise) */
    char name[24];            /* "embedding", "block3", "head" */
    int n_params;
    Param *params;            /* [n_params] */
    void *fsdp;               /* free for the FSDP implementation's per-module state */
    ModuleActs *acts;         /* runtime-private */
} Module;

typedef struct {
    ModelConfig cfg;
    int n_modules;            /* L + 2 */
    Module *modules;          /* [n_modules] in forward order */
    size_t n_params_total;    /* elements over all parameters */
} Model;

/* Build the module/param structure (no parameter memory: every data/grad NULL). */
Model *model_create(const ModelConfig *c);
void model_destroy(Model *m);
/* Param by torchtitan name, or NULL. */
Param *model_find_param(Model *m, const char *name);

/* Deterministic torchtitan-style init into host memory: out gets, for every
 * parameter in module order, its values at offset model_param_offset(). Same
 * values for every world size and rank. */
void model_init_host(const Model *m, uint64_t seed, float *out /* [n_params_total] */);
size_t model_param_offset(const Model *m, const Param *p);

/* --- running modules (used by the training loop, not by FSDP code) --------- */

typedef struct {
    Dev *dev;
    Stream *stream;           /* compute stream */
    size_t B, T;              /* per-rank batch, sequence length */
    int recompute;            /* --ac: blocks keep only their input in forward */
    const int32_t *inputs;    /* [B*T] device memory */
    const int32_t *targets;   /* [B*T] */
    float *rope_cos, *rope_sin; /* [T, hd/2] */
    float *h;                 /* forward: output of the last module run, [B*T, D] */
    float *dh;                /* backward: grad w.r.t. the output of the module about to run backward */
    float *loss;              /* [1] this rank's mean loss, written by the head's forward */
} ModelRun;

/* Allocate rope tables and the loss slot; run->inputs/targets set by caller. */
void model_run_begin(Model *m, ModelRun *run);
void model_run_end(Model *m, ModelRun *run);
/* Free every module's saved activations and run->h/dh (after a forward-only
 * step, or to drop a step's state). */
void model_discard_activations(Model *m, ModelRun *run);
/* Queue the module's forward on run->stream. Reads its Param.data. */
void module_forward(Model *m, Module *mod, ModelRun *run);
/* Activation checkpointing: re-run a block's forward inside backward to
 * rebuild its saved activations (needs run->recompute and a prior forward). */
void module_recompute(Model *m, Module *mod, ModelRun *run);
/* Queue the module's backward: accumulates into Param.grad (allocated and
 * zeroed by the caller), turns run->dh into the grad of the module's input. */
void module_backward(Model *m, Module *mod, ModelRun *run);

/* Kernels the optimizer step may queue (work on shards or full tensors). */
/* *acc += sum of x[i]^2 */
void launch_sumsq_accumulate(Stream *s, float *acc, const float *x, size_t n);

#endif
