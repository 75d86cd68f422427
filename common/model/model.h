/* model.h — the Llama model (torchtitan's Llama 3) as modules with explicit
 * forward and backward, no autograd. The types (ModelConfig, Model, Module,
 * Param) are the contract's: hw_fsdp.h. This header is what the training
 * driver and the tests use to build and run them.
 *
 * A module's forward reads its parameters through Param.data and its backward
 * accumulates parameter gradients into Param.grad. Both are plain pointers
 * the caller sets (FSDP points them into all-gathered buffers).
 */
#ifndef HWFSDP_MODEL_H
#define HWFSDP_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "hw_fsdp.h"

/* Fill c with a named flavour (MODEL_FLAVORS). Returns 0 if the name is
 * unknown. tiny, debugmodel and 1B are this project's; the others are the
 * published models as their configs define them: 8B and 70B are Llama 3's,
 * as torchtitan defines them, llama2-* Llama 2's and llama3.1-* Llama 3.1's
 * (with its RoPE scaling: ops.h). At those sizes the CPU trains nothing, but
 * --dry-run prices and counts a step. */
#define MODEL_FLAVORS \
    "tiny, debugmodel, 1B, 8B, 70B, llama2-7B, llama2-13B, llama2-70B, llama3.1-8B, llama3.1-70B, llama3.1-405B"
int model_flavor(ModelConfig *c, const char *name);
/* The longest sequence the flavour allows (its model's context: Llama 3's
 * 8192, Llama 2's 4096, Llama 3.1's 131072), 0 if any. */
size_t model_flavor_max_seq_len(const char *name);
/* "Llama 3", "Llama 2" or "Llama 3.1" for a published model's flavour, NULL
 * for this project's own. */
const char *model_flavor_family(const char *name);
/* Derive head_dim and hidden_dim; fatal with one line on an impossible config
 * (dim not divisible by heads, heads not divisible by kv heads, odd head dim,
 * non-positive sizes, a RoPE scaling whose bands do not order). */
void model_config_finalize(ModelConfig *c);

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

/* --- activation checkpointing (torchtitan's three modes) ------------------- */

/* Which blocks re-run their forward inside their backward, and what each keeps:
 *   AC_FULL   every block keeps only its input x; the backward recomputes all
 *             of block_forward_saved (torchtitan mode = "full").
 *   AC_EVERY  blocks 1-based numbers k with k % every == 0 do as AC_FULL; the
 *             others keep every activation and do not recompute (torchtitan
 *             selective_ac_option = "<every>").
 *   AC_OP     every block keeps x and the outputs torchtitan's per-op policy
 *             saves (the odd-numbered matmuls in forward order, wq 1, wv 3,
 *             w1 5, and the attention: q, v, att, lse) and recomputes the rest:
 *             the norms, wk + RoPE, wo + residual, w3, SwiGLU (selective_ac_option
 *             = "op"; w2, matmul 7, feeds no saved tensor here). */
typedef enum { AC_NONE = 0, AC_FULL, AC_EVERY, AC_OP } AcMode;
typedef struct {
    AcMode mode;
    int every; /* AC_EVERY's N (>= 1) */
} AcPolicy;

/* THE predicate: does block `layer` (0-based, the model's numbering, also
 * under --pp) re-run its forward, and so its forward hooks, in its backward?
 * The model (what a forward keeps), the training loop (the recompute and its
 * hooks) and run.json (recompute_blocks, read by the grader) all ask it. */
int ac_block_recomputes(AcPolicy ac, int layer);
/* "none", "full", "every", "op" */
const char *ac_mode_name(AcMode mode);

/* --- running modules (used by the training loop, not by FSDP code) --------- */

typedef struct {
    Dev *dev;
    Stream *stream;           /* compute stream */
    size_t B, T;              /* per-rank batch, sequence length */
    AcPolicy ac;              /* --ac, --ac-every N, --ac-op: which blocks recompute, what they keep */
    int microbatches;         /* K of --grad-accum (B is then one microbatch): the backward is loss / K's */
    int param_bf16;           /* --param-dtype bf16: ops read Param.data_bf16, and the activations are
                                 bfloat16 (kernels.h: which tensors; model.c: ModuleActs) */
    const int32_t *inputs;    /* [B*T] device memory */
    const int32_t *targets;   /* [B*T] */
    float *rope_cos, *rope_sin; /* [T, hd/2] */
    void *h;                  /* forward: output of the last module run, [B*T, D] (float32, or bf16 words) */
    void *dh;                 /* backward: grad w.r.t. the output of the module about to run backward (same dtype) */
    float *loss;              /* [1] this rank's mean loss, written by the head's forward */
    int eager_memory;         /* --price-ops eager*: also hold what torchtitan's eager program holds beyond this
                                 runtime (model.c: eager_hold), to compare memory with its published runs */
} ModelRun;

/* Allocate rope tables and the loss slot; run->inputs/targets set by caller. */
void model_run_begin(Model *m, ModelRun *run);
void model_run_end(Model *m, ModelRun *run);
/* Free every module's saved activations and run->h/dh (after a forward-only
 * step, or to drop a step's state). */
void model_discard_activations(Model *m, ModelRun *run);
/* Pipeline schedules (hw_pipe.h) keep several microbatches' activations at
 * once: n sets of every module's saved activations; model_acts_use points
 * each module of m at set k; model_acts_slots_free gives the modules their
 * own back (every set must be empty by then). */
typedef struct ActsSlots ActsSlots;
ActsSlots *model_acts_slots(Model *m, int n);
void model_acts_use(ActsSlots *a, int k);
void model_acts_slots_free(ActsSlots *a);
/* Queue the module's forward on run->stream. Reads its Param.data. */
void module_forward(Model *m, Module *mod, ModelRun *run);
/* 1 if mod is a block that ac_block_recomputes (run->ac): the loop then calls
 * module_recompute (between the forward hooks) before its backward. */
int module_recomputes(const ModelRun *run, const Module *mod);
/* Activation checkpointing: re-run a block's forward inside backward to
 * rebuild the saved activations its forward dropped (all but the input, or
 * with AC_OP what the per-op policy does not keep). Only for a block that
 * module_recomputes, after its forward. */
void module_recompute(Model *m, Module *mod, ModelRun *run);
/* Queue the module's backward: accumulates into Param.grad (allocated and
 * zeroed by the caller), turns run->dh into the grad of the module's input. */
void module_backward(Model *m, Module *mod, ModelRun *run);

#endif
