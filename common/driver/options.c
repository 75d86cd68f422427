/* options.c — parsing the training binary's flags: every value checked, one
 * clear line for a bad one. */
#include "driver/options.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/util.h"

static void usage(FILE *f, const char *prog) {
    fprintf(f,
            "usage: %s [flags]\n"
            "Trains torchtitan's Llama 3 with the FSDP implementation linked into this binary.\n"
            "\nmodel\n"
            "  --flavor NAME            tiny | debugmodel | 1B (default tiny)\n"
            "  --dim N --n-layers N --n-heads N --n-kv-heads N --vocab-size N --multiple-of N\n"
            "  --ffn-dim-multiplier X   override the flavour's dimensions\n"
            "\ntraining\n"
            "  --seq-len T              sequence length (default 64)\n"
            "  --batch-size B           sequences per rank per step (default 2)\n"
            "  --steps S                optimizer steps (default 10)\n"
            "  --lr X                   peak learning rate (default 8e-4)\n"
            "  --warmup-steps N         linear warmup steps (default 2)\n"
            "  --weight-decay X         AdamW decoupled weight decay (default 0.1)\n"
            "  --max-norm X             clip grads to this global norm, 0 = off (default 1.0)\n"
            "  --seed N                 init seed (default 0)\n"
            "  --data FILE              .npy tokens (uint16/int32) or text (bytes) (default data/corpus.txt)\n"
            "  --load FILE              start from these weights (safetensors) instead of --seed; a checkpoint\n"
            "                           written by --save also restores the optimizer and continues its steps\n"
            "  --save FILE              write a checkpoint at the end: weights (torchtitan names), AdamW state,\n"
            "                           step (safetensors, atomic); --load FILE resumes from it bitwise\n"
            "  --save-every N           also write the --save checkpoint every N steps\n"
            "  --save-init FILE         write the initial weights and exit\n"
            "  --ac                     activation checkpointing: blocks recompute their forward in backward\n"
            "  --reshard-after-forward=true|false   false = ZeRO-2 (keep params unsharded until backward)\n"
            "  --forward-only           no backward or optimizer: losses of the initial weights\n"
            "  --grad-accum K           split each rank's batch into K microbatches, one optimizer step per K\n"
            "                           (K divides --batch-size; default 1)\n"
            "  --grad-sync every|last   with --grad-accum: reduce-scatter every microbatch (default), or only\n"
            "                           the last (FSDP2's set_requires_gradient_sync(False) on the others)\n"
            "  --reshard-after-backward=true|false   with --grad-accum: false keeps params unsharded between\n"
            "                           microbatches (FSDP2's set_reshard_after_backward(False) on all but the last)\n"
            "  --param-dtype fp32|bf16  what the all-gather moves and compute reads (FSDP2's MixedPrecisionPolicy\n"
            "                           param_dtype; bf16 is stage 08's); shards and optimizer stay fp32\n"
            "  --reduce-dtype fp32|bf16 what the reduce-scatter moves (reduce_dtype; default fp32)\n"
            "  --mesh R,S               HSDP (stage 09): a 2-D mesh of R replicas x S shards (R*S = --world; or RxS);\n"
            "                           params are split over S ranks and replicated R times\n"
            "  --backward-prefetch P    stage 10: when the backward issues module i-1's all-gather: pre (at module\n"
            "                           i's pre_backward, default), post (after module i's reduce-scatter), none\n"
            "  --single-comm-stream     stage 10: all-gathers and reduce-scatters share one stream\n"
            "  --offload-params         stage 10: shards, grad shards and optimizer state in pinned host memory\n"
            "\nworld and runtime\n"
            "  --world N                number of ranks (default 1)\n"
            "  --backend B              local: ranks as threads (default; CUDA build: all on one GPU)\n"
            "                           mpi: one process per rank under mpirun (CPU build)\n"
            "                           nccl: threads, one GPU per rank; nccl-mpi: mpirun, NCCL (CUDA build)\n"
            "  --link-gbps X            link model for local collectives, Gbit/s (0 = off, default)\n"
            "  --link-latency-us X      link model latency per ring hop (default 0)\n"
            "  --ranks-per-node N       link model: ranks 0..N-1 share node 0, N..2N-1 node 1, ... (default: S of\n"
            "                           --mesh, else all ranks on one node)\n"
            "  --inter-link-gbps X      link model: a collective whose ranks span nodes runs at this bandwidth\n"
            "                           (default: --link-gbps)\n"
            "  --inter-link-latency-us X  ... and this latency per hop (default: --link-latency-us)\n"
            "  --pcie-gbps X            PCIe model for host <-> device copies (pinned host memory), GB/s (0 = off)\n"
            "  --pcie-latency-us X      PCIe model latency per copy (default 0)\n"
            "  --blas-threads N         OpenBLAS threads per rank (default cores / ranks)\n"
            "  --no-poison              do not fill fresh allocations with NaN\n"
            "  --no-race-check          do not check streams for missing event waits (on by default, CPU build)\n"
            "  --tf32                   CUDA build: matmuls may use TF32 tensor cores (default exact fp32)\n"
            "  --collective-timeout-s X stop when a collective waits longer than X s for its peers (default 30, 0 = off)\n"
            "\noutput\n"
            "  --out DIR                run directory: metrics.jsonl, run.json, traces, memory snapshots\n"
            "  --profile-steps N        record op timings for the first N steps (default 3)\n"
            "  --quiet                  no progress lines\n"
            "  --help                   this text\n",
            prog);
}

static double parse_num(const char *flag, const char *v, double lo, double hi) {
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (errno || end == v || *end) fatal("%s expects a number, got '%s'", flag, v);
    if (!(x >= lo && x <= hi)) fatal("%s must be in [%g, %g], got %s", flag, lo, hi, v);
    return x;
}
static long parse_int(const char *flag, const char *v, long lo, long hi) {
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || end == v || *end) fatal("%s expects an integer, got '%s'", flag, v);
    if (x < lo || x > hi) fatal("%s must be in [%ld, %ld], got %s", flag, lo, hi, v);
    return x;
}

/* Flags that take a value, checked before the value is read. */
static const char *const VALUE_FLAGS[] = {
    "--flavor", "--dim", "--n-layers", "--n-heads", "--n-kv-heads", "--vocab-size", "--multiple-of",
    "--ffn-dim-multiplier", "--seq-len", "--batch-size", "--steps", "--lr", "--warmup-steps", "--weight-decay",
    "--max-norm", "--seed", "--data", "--load", "--save", "--save-init", "--out", "--profile-steps", "--save-every",
    "--world", "--backend", "--link-gbps", "--link-latency-us", "--blas-threads", "--collective-timeout-s", "--grad-accum", "--grad-sync",
    "--param-dtype", "--reduce-dtype", "--mesh", "--ranks-per-node", "--inter-link-gbps", "--inter-link-latency-us",
    "--backward-prefetch", "--pcie-gbps", "--pcie-latency-us"};

/* Model overrides, applied after the flavour (-1: not given). */
typedef struct {
    long dim, layers, heads, kv, vocab, mult;
    double ffn;
} ModelOverrides;

static void set_defaults(Options *o) {
    memset(o, 0, sizeof *o);
    snprintf(o->flavor, sizeof o->flavor, "tiny");
    o->seq_len = 64;
    o->batch_size = 2;
    o->steps = 10;
    o->optim = adamw_default_config();
    o->data_path = "data/corpus.txt";
    o->reshard_after_forward = 1;
    o->reshard_after_backward = 1;
    o->grad_accum = 1;
    o->grad_sync_every = 1;
    o->profile_steps = 3;
    o->world.world_size = 1;
    o->world.backend = BACKEND_LOCAL;
    o->world.poison = 1;
    o->world.trace = 1;
    o->world.collective_timeout_s = 30.0;
}

/* A flag without a value; 0 if `flag` is not one. */
static int apply_switch(Options *o, const char *flag) {
    if (!strcmp(flag, "--ac")) o->ac = 1;
    else if (!strcmp(flag, "--forward-only")) o->forward_only = 1;
    else if (!strcmp(flag, "--no-poison")) o->world.poison = 0;
    else if (!strcmp(flag, "--tf32")) o->world.tf32 = 1;
    else if (!strcmp(flag, "--no-race-check")) o->world.no_race_check = 1;
    else if (!strcmp(flag, "--quiet")) o->quiet = 1;
    else if (!strcmp(flag, "--single-comm-stream")) o->single_comm_stream = 1;
    else if (!strcmp(flag, "--offload-params")) o->offload_params = 1;
    else return 0;
    return 1;
}

/* One of VALUE_FLAGS with its value. */
static void apply_value(Options *o, ModelOverrides *ov, const char *flag, const char *val) {
    if (!strcmp(flag, "--flavor")) {
        if (strlen(val) >= sizeof o->flavor) fatal("unknown flavor '%s' (tiny, debugmodel, 1B)", val);
        snprintf(o->flavor, sizeof o->flavor, "%s", val);
    } else if (!strcmp(flag, "--dim")) ov->dim = parse_int(flag, val, 1, 1 << 16);
    else if (!strcmp(flag, "--n-layers")) ov->layers = parse_int(flag, val, 1, 1024);
    else if (!strcmp(flag, "--n-heads")) ov->heads = parse_int(flag, val, 1, 1024);
    else if (!strcmp(flag, "--n-kv-heads")) ov->kv = parse_int(flag, val, 1, 1024);
    else if (!strcmp(flag, "--vocab-size")) ov->vocab = parse_int(flag, val, 1, 1 << 24);
    else if (!strcmp(flag, "--multiple-of")) ov->mult = parse_int(flag, val, 1, 1 << 16);
    else if (!strcmp(flag, "--ffn-dim-multiplier")) ov->ffn = parse_num(flag, val, 0.01, 100);
    else if (!strcmp(flag, "--seq-len")) o->seq_len = (size_t)parse_int(flag, val, 1, 1 << 20);
    else if (!strcmp(flag, "--batch-size")) o->batch_size = (size_t)parse_int(flag, val, 1, 1 << 20);
    else if (!strcmp(flag, "--steps")) o->steps = (int)parse_int(flag, val, 0, 100000000);
    else if (!strcmp(flag, "--lr")) o->optim.lr = (float)parse_num(flag, val, 0, 10);
    else if (!strcmp(flag, "--warmup-steps")) o->optim.warmup_steps = (int)parse_int(flag, val, 0, 100000000);
    else if (!strcmp(flag, "--weight-decay")) o->optim.weight_decay = (float)parse_num(flag, val, 0, 10);
    else if (!strcmp(flag, "--max-norm")) o->optim.max_norm = (float)parse_num(flag, val, 0, 1e30);
    else if (!strcmp(flag, "--seed")) o->seed = (uint64_t)parse_int(flag, val, 0, 0x7fffffffL);
    else if (!strcmp(flag, "--data")) o->data_path = val;
    else if (!strcmp(flag, "--load")) o->load_path = val;
    else if (!strcmp(flag, "--save")) o->save_path = val;
    else if (!strcmp(flag, "--save-init")) o->save_init_path = val;
    else if (!strcmp(flag, "--out")) o->out_dir = val;
    else if (!strcmp(flag, "--profile-steps")) o->profile_steps = (int)parse_int(flag, val, 0, 100000000);
    else if (!strcmp(flag, "--save-every")) o->save_every = (int)parse_int(flag, val, 1, 100000000);
    else if (!strcmp(flag, "--world")) o->world.world_size = (int)parse_int(flag, val, 1, WORLD_MAX_RANKS);
    else if (!strcmp(flag, "--backend")) {
        if (!strcmp(val, "local")) o->world.backend = BACKEND_LOCAL;
        else if (!strcmp(val, "mpi")) o->world.backend = BACKEND_MPI;
        else if (!strcmp(val, "nccl")) o->world.backend = BACKEND_NCCL;
        else if (!strcmp(val, "nccl-mpi")) o->world.backend = BACKEND_NCCL_MPI;
        else fatal("--backend expects local, mpi, nccl or nccl-mpi, got '%s'", val);
    } else if (!strcmp(flag, "--link-gbps")) o->world.link_gbps = parse_num(flag, val, 0, 1e6);
    else if (!strcmp(flag, "--link-latency-us")) o->world.link_latency_us = parse_num(flag, val, 0, 1e7);
    else if (!strcmp(flag, "--pcie-gbps")) o->world.pcie_gbps = parse_num(flag, val, 0, 1e6);
    else if (!strcmp(flag, "--pcie-latency-us")) o->world.pcie_latency_us = parse_num(flag, val, 0, 1e7);
    else if (!strcmp(flag, "--backward-prefetch")) {
        if (!strcmp(val, "pre")) o->backward_prefetch = BACKWARD_PREFETCH_PRE;
        else if (!strcmp(val, "post")) o->backward_prefetch = BACKWARD_PREFETCH_POST;
        else if (!strcmp(val, "none")) o->backward_prefetch = BACKWARD_PREFETCH_NONE;
        else fatal("--backward-prefetch expects pre, post or none, got '%s'", val);
        o->backward_prefetch_given = 1;
    } else if (!strcmp(flag, "--ranks-per-node")) o->world.ranks_per_node = (int)parse_int(flag, val, 1, WORLD_MAX_RANKS);
    else if (!strcmp(flag, "--inter-link-gbps")) o->world.inter_link_gbps = parse_num(flag, val, 0, 1e6);
    else if (!strcmp(flag, "--inter-link-latency-us")) o->world.inter_link_latency_us = parse_num(flag, val, 0, 1e7);
    else if (!strcmp(flag, "--mesh")) {
        char tail;
        int r = 0, sh = 0;
        if ((sscanf(val, "%d,%d%c", &r, &sh, &tail) != 2 && sscanf(val, "%dx%d%c", &r, &sh, &tail) != 2) || r < 1 ||
            sh < 1)
            fatal("--mesh expects R,S or RxS (replicas, shards: two positive integers), got '%s'", val);
        o->mesh_replicas = r;
        o->mesh_shards = sh;
    } else if (!strcmp(flag, "--collective-timeout-s")) o->world.collective_timeout_s = parse_num(flag, val, 0, 1e7);
    else if (!strcmp(flag, "--grad-accum")) o->grad_accum = (int)parse_int(flag, val, 1, 1 << 20);
    else if (!strcmp(flag, "--grad-sync")) {
        if (!strcmp(val, "every")) o->grad_sync_every = 1;
        else if (!strcmp(val, "last")) o->grad_sync_every = 0;
        else fatal("--grad-sync expects every or last, got '%s'", val);
    } else if (!strcmp(flag, "--param-dtype") || !strcmp(flag, "--reduce-dtype")) {
        DType *dst = !strcmp(flag, "--param-dtype") ? &o->mp.param_dtype : &o->mp.reduce_dtype;
        if (!strcmp(val, "fp32")) *dst = DTYPE_F32;
        else if (!strcmp(val, "bf16")) *dst = DTYPE_BF16;
        else fatal("%s expects fp32 or bf16, got '%s'", flag, val);
    } else if (!strcmp(flag, "--blas-threads")) o->world.blas_threads = (int)parse_int(flag, val, 0, 1024);
    else fatal("unknown flag '%s' (see --help)", flag);
}

static void apply_model_overrides(ModelConfig *m, const ModelOverrides *ov) {
    if (ov->dim > 0) m->dim = (int)ov->dim;
    if (ov->layers > 0) m->n_layers = (int)ov->layers;
    if (ov->heads > 0) {
        m->n_heads = (int)ov->heads;
        if (ov->kv < 0) m->n_kv_heads = 0; /* default: kv heads = heads */
    }
    if (ov->kv > 0) m->n_kv_heads = (int)ov->kv;
    if (ov->vocab > 0) m->vocab_size = (int)ov->vocab;
    if (ov->mult > 0) m->multiple_of = (int)ov->mult;
    if (ov->ffn > 0) m->ffn_dim_multiplier = (float)ov->ffn;
}

void parse_options(int argc, char **argv, Options *o) {
    set_defaults(o);
    ModelOverrides ov = {-1, -1, -1, -1, -1, -1, -1};
    for (int i = 1; i < argc; i++) {
        /* "--flag", "--flag=value" or "--flag value" */
        const char *a = argv[i];
        const char *eq = strchr(a, '=');
        char flag[64];
        const char *val = NULL;
        if (strncmp(a, "--", 2) != 0) fatal("unexpected argument '%s' (see --help)", a);
        if (eq) {
            size_t n = (size_t)(eq - a);
            if (n >= sizeof flag) fatal("unknown flag '%s' (see --help)", a);
            memcpy(flag, a, n);
            flag[n] = 0;
            val = eq + 1;
        } else {
            snprintf(flag, sizeof flag, "%s", a);
        }
        if (!strcmp(flag, "--help")) {
            usage(stdout, argv[0]);
            exit(0);
        }
        if (apply_switch(o, flag)) continue;
        if (!strcmp(flag, "--reshard-after-forward") || !strcmp(flag, "--reshard-after-backward")) {
            /* a value is optional: true by itself */
            if (!val && i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0) val = argv[++i];
            int *dst = !strcmp(flag, "--reshard-after-forward") ? &o->reshard_after_forward : &o->reshard_after_backward;
            if (!val || !strcmp(val, "true") || !strcmp(val, "1")) *dst = 1;
            else if (!strcmp(val, "false") || !strcmp(val, "0")) *dst = 0;
            else fatal("%s expects true or false, got '%s'", flag, val);
            continue;
        }
        int known = 0;
        for (size_t k = 0; k < sizeof VALUE_FLAGS / sizeof VALUE_FLAGS[0]; k++) known |= !strcmp(flag, VALUE_FLAGS[k]);
        if (!known) fatal("unknown flag '%s' (see --help)", flag);
        if (!val) {
            if (i + 1 >= argc) fatal("flag %s needs a value (see --help)", flag);
            val = argv[++i];
        }
        apply_value(o, &ov, flag, val);
    }
    if (o->save_every && !o->save_path) fatal("--save-every needs --save FILE");
    if (o->batch_size % (size_t)o->grad_accum)
        fatal("--grad-accum %d must divide --batch-size %zu (each microbatch holds batch-size / K sequences)",
              o->grad_accum, o->batch_size);
    if (o->grad_accum > 1 && o->forward_only) fatal("--grad-accum needs a backward: it cannot go with --forward-only");
    if (o->mesh_replicas && o->mesh_replicas * o->mesh_shards != o->world.world_size)
        fatal("--mesh %d,%d holds %d ranks but --world is %d (R*S must equal the world)", o->mesh_replicas,
              o->mesh_shards, o->mesh_replicas * o->mesh_shards, o->world.world_size);
    if (o->mesh_replicas && !o->world.ranks_per_node) o->world.ranks_per_node = o->mesh_shards; /* a row per node */
    if (o->world.ranks_per_node && o->world.world_size % o->world.ranks_per_node)
        fatal("--ranks-per-node %d must divide --world %d", o->world.ranks_per_node, o->world.world_size);
    if (!o->world.inter_link_gbps) o->world.inter_link_gbps = o->world.link_gbps;
    if (o->world.inter_link_latency_us < o->world.link_latency_us) o->world.inter_link_latency_us = o->world.link_latency_us;
    if (!model_flavor(&o->model, o->flavor)) fatal("unknown flavor '%s' (tiny, debugmodel, 1B)", o->flavor);
    apply_model_overrides(&o->model, &ov);
    model_config_finalize(&o->model);
}

const char *backward_prefetch_name(BackwardPrefetch p) {
    return p == BACKWARD_PREFETCH_POST ? "post" : p == BACKWARD_PREFETCH_NONE ? "none" : "pre";
}
