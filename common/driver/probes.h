/* probes.h — what the training driver records for the grader, around the
 * student's hooks:
 *   - after fsdp_pre_forward / fsdp_pre_backward: every Param.data (with
 *     --param-dtype bf16: Param.data_bf16) is set (else one line naming the
 *     hook), its rows of this rank hold the current shard (the params check;
 *     bf16: rounded to nearest even), and which allocations hold them (a
 *     "hook_check" note: their bytes and the params' elements);
 *   - after fsdp_post_forward / fsdp_post_backward: how many of those bytes
 *     (and of the module's unsharded grads) are still allocated, as
 *     "hook_check" notes in the memory snapshot;
 *   - around every hook: its memory (entry, high-water, by tag at the
 *     high-water and at exit) as "hook_memory" notes;
 *   - after fsdp_finish_backward with --grad-accum: the gradient state the
 *     next microbatch or the optimizer reads, as a "grad_state" note;
 *   - after fsdp_init: the DTensors, as dtensors_rank<r>.json.
 * In a dry run (dev_dry_run) the probes that read values are off: the params
 * check, the grad-state note's figures (the note says "dry_run": true), and the
 * DTensors' local_matches_init and padding_is_zero (null); the memory notes are
 * written as in a real run. */
#ifndef HWFSDP_PROBES_H
#define HWFSDP_PROBES_H

#include <stdint.h>

#include "model/model.h"

/* The allocations a module's params (or grads) live in, captured when the
 * module runs. Identities, not addresses: a freed buffer's address may be
 * handed to a new allocation before the hook's check. */
typedef struct {
    int n;
    const void *ptr[MODULE_MAX_PARAMS];
    uint64_t id[MODULE_MAX_PARAMS];
} Captured;

/* The params check's memory of each shard (compute stream worker only):
 * its hash at the latest step's first check, and at the step before. */
typedef struct {
    int step;
    uint64_t now, before;
} ShardHistory;

/* The grad-state probe's copy of one param's gradient state (host memory,
 * outside the allocator): what it held after the previous microbatch. */
typedef enum { GRAD_NONE = 0, GRAD_KEPT, GRAD_SHARD } GradKind;
typedef struct {
    float *now, *before;      /* [cap] each: read now, and after the previous microbatch */
    size_t cap, before_n;
    GradKind before_kind;     /* what `before` holds (GRAD_NONE: nothing to compare with) */
} GradCopy;

typedef struct {
    Captured params;          /* the module's Param.data */
    Captured grads;           /* the module's Param.grad */
    size_t hook_entry_bytes;  /* allocated when the current hook began */
    const Model *model;
    ShardHistory *history;    /* [n_modules * MODULE_MAX_PARAMS] */
    uint64_t *last_data;      /* [n_modules * MODULE_MAX_PARAMS] the allocation (id) of each param's unsharded
                               * data when a check last saw it set: who freed it, if the backward finds none */
    int param_bf16;           /* --param-dtype bf16: the params are Param.data_bf16 */
    AcPolicy ac;              /* which blocks recompute (model.h): a message's hint */
    GradCopy *grad_state;     /* [n_modules * MODULE_MAX_PARAMS] the grad-state probe's copies */
    float *spare;             /* [spare_cap] the grad-state probe's scratch */
    size_t spare_cap;
} Probes;

void probes_init(Probes *p, const Model *m, int param_bf16, AcPolicy ac);
void probes_free(Probes *p);

/* Around every hook: a "hook_memory" note with the bytes allocated at entry,
 * the hook's high-water mark (and by tag then) and the bytes by tag at exit. */
void probe_hook_begin(Dev *dev, Probes *p);
void probe_hook_end(Dev *dev, const Probes *p, int step, const char *module, const char *hook);

/* After fsdp_pre_forward (backward = 0) or fsdp_pre_backward (backward = 1):
 * every Param.data is set, and (CPU backend) a check queued on the compute
 * stream right before the module's compute: this rank's rows of each
 * Param.data equal its current shard, else one line naming the module, the
 * hook, the param and what it holds instead (NaN: never written; last step's
 * shard: stale; a neighbouring param's shard: mixed up). A flat param
 * (device.h, PLACEMENT_FLAT): its elements [row_offset, +local_rows) as its
 * flat_offset and S place them, against its DTensor.local. */
void probe_params_ready(Dev *dev, Probes *p, const Module *mod, int step, const char *hook, int backward);
/* After the runtime allocated the module's unsharded grads. */
void probe_grads_allocated(Dev *dev, Probes *p, const Module *mod);
/* After fsdp_post_forward / fsdp_post_backward: the hook_check notes. */
void probe_after_post_forward(Dev *dev, const Probes *p, int step, const Module *mod);
void probe_after_post_backward(Dev *dev, const Probes *p, int step, const Module *mod);
/* After fsdp_finish_backward of a microbatch (--grad-accum K > 1, CPU
 * backend; nothing otherwise): a "grad_state" note of the gradient state the
 * next microbatch or the optimizer reads, as sums of squares in float64: the
 * unsharded Param.grad the loop kept for the next backward
 * (unsharded_grad_sumsq, over unsharded_grads params) and every
 * DTensor.grad's local rows (grad_shard_sumsq, over grad_shards params; a
 * DTensor.grad outside a live allocation counts in grad_shards_unreadable,
 * not in the sum); dot_previous, the dot product of the state with the
 * previous microbatch's over the dot_params params holding the same kind of
 * state in both (null at microbatch 0, or when none does: it tells what the
 * earlier microbatches left from what this one added); per module
 * [unsharded, shards, dot_previous] (null: none). Read once every stream has
 * run what was queued (dev_probe_read), at no cost on the modelled clock or
 * the memory counts. */
void probe_grad_state(Dev *dev, Probes *p, int step);
/* Before the optimizer step (CPU backend, not a dry run): every DTensor.grad's padding rows hold zeros, as FSDP2
 * keeps them; if not, a "grad_padding" note (the first such param, its rows, how many of its padding values are
 * nonzero and NaN, and how many params share the fault). Nothing is noted when all are zero. A flat unit's [S] grad
 * shard is judged as one: its elements outside every piece (the note names the unit's first param, and "flat_unit"
 * its first module). */
void probe_grad_padding(Dev *dev, const Probes *p, int step);
/* After fsdp_init on a 2-D mesh (--mesh R,S): fatal, naming the first param,
 * if a DTensor is not split over the shard group (a pre-09 stage splits over
 * the world). */
void probes_check_mesh(const Model *m, const DeviceMesh *mesh);
/* After fsdp_init with --offload-params: fatal, naming the first param, if a
 * DTensor's shard is not in pinned host memory (a pre-10 stage keeps it on the device). */
void probes_check_offload(Dev *dev, const Model *m);
/* dtensors_rank<r>.json in dir: every DTensor's geometry, mesh, placement and
 * whether its shard holds exactly its rows of the initial weights `init`. A
 * flat param adds flat_offset, flat_shard_numel and flat_unit, and its
 * padding_is_zero is its unit's; with flat params the file adds "flat_units":
 * per unit its S, its flat size, whether the views sit in one [S] shard and
 * whether that shard's elements outside every piece are zero. */
void probes_write_dtensors(Dev *dev, Model *m, const float *init, const char *dir, const DeviceMesh *mesh);

#endif
