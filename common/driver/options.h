/* options.h — the training binary's command line (--help lists it). */
#ifndef HWFSDP_OPTIONS_H
#define HWFSDP_OPTIONS_H

#include <stddef.h>
#include <stdint.h>

#include "hw_fsdp.h"
#include "model/model.h"
#include "model/optim.h"
#include "runtime/runtime.h"

typedef struct {
    ModelConfig model;
    char flavor[32];
    size_t seq_len, batch_size;
    int steps;
    AdamWConfig optim;
    uint64_t seed;
    const char *data_path, *load_path, *save_path, *save_init_path, *out_dir;
    int ac, reshard_after_forward, forward_only;
    int grad_accum;             /* K microbatches per step (1: none) */
    int grad_sync_every;        /* 1: reduce-scatter every microbatch; 0: only the last */
    int reshard_after_backward; /* 0: keep params unsharded between microbatches */
    MixedPrecision mp;          /* --param-dtype / --reduce-dtype (stage 08) */
    int mesh_replicas, mesh_shards; /* --mesh R,S (stage 09); 0, 0: 1-D (the world) */
    BackwardPrefetch backward_prefetch; /* --backward-prefetch (stage 10) */
    int backward_prefetch_given;        /* it was on the command line (a stage ignoring it stops) */
    int single_comm_stream, offload_params; /* --single-comm-stream, --offload-params (stage 10) */
    int profile_steps;
    int save_every;
    int quiet;
    WorldConfig world;
} Options;

/* Fill o from argv (defaults first); --help prints the usage and exits 0, a
 * bad flag or value is one line and exit status 2. */
void parse_options(int argc, char **argv, Options *o);
/* "pre", "post", "none": the --backward-prefetch value of p */
const char *backward_prefetch_name(BackwardPrefetch p);

#endif
