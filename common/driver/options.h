/* options.h — the training binary's command line (--help lists it). Every
 * flag is one row of the flag table in options.c: its name, kind, where its
 * value goes, its default, its --help text and its run.json key. */
#ifndef HWFSDP_OPTIONS_H
#define HWFSDP_OPTIONS_H

#include <stddef.h>
#include <stdint.h>

#include "hw_fsdp.h"
#include "hw_pipe.h"
#include "model/model.h"
#include "model/optim.h"
#include "runtime/json.h"
#include "runtime/runtime.h"

/* The model flags as given (0: not given), applied over the flavour's sizes. */
typedef struct {
    int dim, n_layers, n_heads, n_kv_heads, vocab_size, multiple_of;
    double ffn_dim_multiplier;
} ModelOverrides;

typedef struct {
    ModelConfig model;          /* the flavour with the overrides, finalized */
    const char *flavor;
    ModelOverrides overrides;
    size_t seq_len, batch_size;
    int steps;
    AdamWConfig optim;
    uint64_t seed;
    const char *data_path, *load_path, *save_path, *save_init_path, *out_dir;
    AcPolicy ac;                /* --ac, --ac-every N or --ac-op (model.h: ac_block_recomputes) */
    const char *ac_flag;        /* the one of them given (a second mode is refused) */
    int reshard_after_forward, forward_only;
    int grad_accum;             /* K microbatches per step (1: none) */
    int grad_sync_every;        /* 1: reduce-scatter every microbatch; 0: only the last */
    int reshard_after_backward; /* 0: keep params unsharded between microbatches */
    MixedPrecision mp;          /* --param-dtype / --reduce-dtype (stage 08) */
    int mesh_replicas, mesh_shards; /* --mesh R,S (stage 09); 0, 0: 1-D (the world) */
    BackwardPrefetch backward_prefetch; /* --backward-prefetch (stage 10) */
    int backward_prefetch_given;        /* it was on the command line (a stage ignoring it stops) */
    int single_comm_stream, offload_params; /* --single-comm-stream, --offload-params (stage 10) */
    double bucket_mb;           /* --bucket-mb MB (stage 13): FsdpConfig.bucket_bytes = MB x 2^20 */
    int bucket_mb_given;        /* it was on the command line (a stage without flat params stops) */
    int pp;                     /* --pp P pipeline stages (stages 11-12); 0: no pipeline */
    int sync_flags_given;       /* --grad-sync or --reshard-after-backward was on the command line */
    int microbatches;           /* --microbatches M (default P) */
    PipeSchedule pp_schedule;   /* --pp-schedule */
    int dry_run_ranks;          /* --dry-run-ranks: DRY_RANKS_ALL or DRY_RANKS_REPRESENTATIVE (world.rep_stride) */
    int dry_run_ranks_given;    /* it was on the command line */
    int profile_steps;
    int save_every;
    int quiet;
    WorldConfig world;
} Options;

/* Which ranks a dry run executes (--dry-run-ranks): every one, a thread each, or one representative per
 * class of symmetric ranks (runtime.h: WorldConfig.rep_stride), the default above WORLD_MAX_RANKS. */
enum { DRY_RANKS_ALL = 0, DRY_RANKS_REPRESENTATIVE = 1 };

/* Fill o from argv (defaults first); --help prints the usage and exits 0, a
 * bad flag or value is one line and exit status 2. */
void parse_options(int argc, char **argv, Options *o);
/* "pre", "post", "none": the --backward-prefetch value of p */
const char *backward_prefetch_name(BackwardPrefetch p);

/* What run.json holds besides the flags. */
typedef struct {
    size_t n_params;            /* elements over all parameters */
    const char *device;         /* "cpu" or "cuda" */
    const char *host;
    World *world;               /* after the run: its facts (runtime/facts.h) end the object; NULL before */
    size_t hbm_capacity_bytes;  /* the device profile's memory the run is held to (0: none, and no key) */
    int fits;                   /* after the run: 1 if every rank stayed within it, 0 if not; -1 before */
    /* rules the run followed, stated once where they are defined (e.g. the
     * backward-prefetch schedule, flag_check.c): written before the facts */
    void (*rules)(Json *j, const Options *o, const void *ctx);
    const void *rules_ctx;
} RunFacts;

/* run.json's object: the run's configuration (the flags with a run.json key,
 * in the file's order) and the facts, for plots, the grader and references. */
void options_run_json(Json *j, const Options *o, const RunFacts *facts);

#endif
