/* options.c — the training binary's flags: one table (FLAGS) says, for every
 * flag, its kind, where its value goes, its default, its --help text and its
 * run.json key; the usage, the parsing, the one-line error for a bad value
 * and run.json all read it. */
#include "driver/options.h"
#include "driver/pipe_split.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/facts.h"
#include "runtime/profile.h"
#include "runtime/util.h"

typedef enum {
    FLAG_SET,    /* no value: the int becomes 1 (default 0) */
    FLAG_CLEAR,  /* no value: the int becomes 0 (default 1) */
    FLAG_BOOL,   /* int: =true|false (or 1|0); by itself true */
    FLAG_INT,    /* int in [lo, hi] */
    FLAG_SIZE,   /* size_t in [lo, hi] */
    FLAG_U64,    /* uint64_t in [lo, hi] */
    FLAG_DOUBLE, /* double in [lo, hi] */
    FLAG_FLOAT,  /* float in [lo, hi] */
    FLAG_STRING, /* const char *: the argument itself */
    FLAG_ENUM,   /* an enum (int-sized): one of choices */
    FLAG_CUSTOM, /* parse does it all; run.json needs json_value */
    FLAG_HELP,   /* --help */
} FlagKind;

/* An enum flag's accepted values, in the order its error lists them; {NULL} ends them. */
typedef struct {
    const char *name;
    int value;
} FlagChoice;

typedef struct Flag Flag;
struct Flag {
    const char *name;           /* "--seq-len" */
    FlagKind kind;
    size_t at;                  /* offsetof(Options, ...): where the value goes */
    double lo, hi;              /* numbers: the accepted range */
    const FlagChoice *choices;  /* FLAG_ENUM */
    const char *def;            /* default, spelled as on the command line; NULL: zero */
    /* A value the kind alone cannot parse (or more to do than store it); NULL: the kind's */
    void (*parse)(const Flag *f, const char *val, Options *o);
    const char *arg;            /* --help: what the value looks like ("N", "=true|false") */
    const char *help;           /* --help: its text, lines split by \n (usage() adds the .def default:
                                   the text never repeats it); NULL: listed with the
                                   flags around it on one line (they share the next row's text) */
    const char *section;        /* --help: a heading before this flag */
    const char *json;           /* run.json key (NULL: not in run.json) */
    /* run.json's value where it is not the stored value in the kind's format; NULL: that */
    void (*json_value)(Json *j, const Options *o);
    int json_with_pp;           /* in run.json only with --pp (a pipeline run's keys) */
    int json_with_dry_run;      /* in run.json only with --dry-run (a dry run's keys) */
    int json_unless_zero;       /* in run.json only when its value is not 0 (an enum's first choice: the default;
                                   an int-sized or a FLAG_DOUBLE field) */
};

/* Enum flags are stored through an int. */
_Static_assert(sizeof(CollBackend) == sizeof(int), "CollBackend is stored as an int");
_Static_assert(sizeof(DType) == sizeof(int), "DType is stored as an int");
_Static_assert(sizeof(BackwardPrefetch) == sizeof(int), "BackwardPrefetch is stored as an int");
_Static_assert(sizeof(PipeSchedule) == sizeof(int), "PipeSchedule is stored as an int");

static const FlagChoice BACKENDS[] = {
    {"local", BACKEND_LOCAL}, {"mpi", BACKEND_MPI}, {"nccl", BACKEND_NCCL}, {"nccl-mpi", BACKEND_NCCL_MPI}, {NULL, 0}};
static const FlagChoice PRICE_OPS[] = {
    {"fused", PRICE_FUSED}, {"eager", PRICE_EAGER}, {"eager-fused-norm", PRICE_EAGER_FUSED_NORM}, {NULL, 0}};
static const FlagChoice PP_SCHEDULES[] = {{"gpipe", PIPE_GPIPE}, {"1f1b", PIPE_1F1B}, {NULL, 0}};
static const FlagChoice GRAD_SYNC[] = {{"every", 1}, {"last", 0}, {NULL, 0}};
static const FlagChoice DTYPES[] = {{"fp32", DTYPE_F32}, {"bf16", DTYPE_BF16}, {NULL, 0}};
static const FlagChoice DRY_RANKS[] = {
    {"all", DRY_RANKS_ALL}, {"representative", DRY_RANKS_REPRESENTATIVE}, {NULL, 0}};
static const FlagChoice PREFETCH[] = {
    {"pre", BACKWARD_PREFETCH_PRE}, {"post", BACKWARD_PREFETCH_POST}, {"none", BACKWARD_PREFETCH_NONE}, {NULL, 0}};

/* ------------------------------------------------------------- values */

static void *field(Options *o, const Flag *f) { return (char *)o + f->at; }
static const void *cfield(const Options *o, const Flag *f) { return (const char *)o + f->at; }

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

/* "a, b or c" */
static void choices_text(const FlagChoice *c, char *out, size_t cap) {
    size_t n = 0, len = 0;
    while (c[n].name) n++;
    out[0] = 0;
    for (size_t i = 0; i < n && len < cap; i++)
        len += (size_t)snprintf(out + len, cap - len, "%s%s", i == 0 ? "" : i + 1 == n ? " or " : ", ", c[i].name);
}

static void parse_enum(const Flag *f, const char *val, Options *o) {
    for (const FlagChoice *c = f->choices; c->name; c++)
        if (!strcmp(val, c->name)) {
            *(int *)field(o, f) = c->value;
            return;
        }
    char expects[256];
    choices_text(f->choices, expects, sizeof expects);
    fatal("%s expects %s, got '%s'", f->name, expects, val);
}

/* Store val (NULL: a switch, or a boolean by itself) as f's kind says. */
static void store(const Flag *f, const char *val, Options *o) {
    switch (f->kind) {
    case FLAG_SET: *(int *)field(o, f) = 1; break;
    case FLAG_CLEAR: *(int *)field(o, f) = 0; break;
    case FLAG_BOOL:
        if (!val || !strcmp(val, "true") || !strcmp(val, "1")) *(int *)field(o, f) = 1;
        else if (!strcmp(val, "false") || !strcmp(val, "0")) *(int *)field(o, f) = 0;
        else fatal("%s expects true or false, got '%s'", f->name, val);
        break;
    case FLAG_INT: *(int *)field(o, f) = (int)parse_int(f->name, val, (long)f->lo, (long)f->hi); break;
    case FLAG_SIZE: *(size_t *)field(o, f) = (size_t)parse_int(f->name, val, (long)f->lo, (long)f->hi); break;
    case FLAG_U64: *(uint64_t *)field(o, f) = (uint64_t)parse_int(f->name, val, (long)f->lo, (long)f->hi); break;
    case FLAG_DOUBLE: *(double *)field(o, f) = parse_num(f->name, val, f->lo, f->hi); break;
    case FLAG_FLOAT: *(float *)field(o, f) = (float)parse_num(f->name, val, f->lo, f->hi); break;
    case FLAG_STRING: *(const char **)field(o, f) = val; break;
    case FLAG_ENUM: parse_enum(f, val, o); break;
    case FLAG_CUSTOM:
    case FLAG_HELP: break;
    }
}

static void parse_mesh(const Flag *f, const char *val, Options *o) {
    char tail;
    int r = 0, s = 0;
    if ((sscanf(val, "%d,%d%c", &r, &s, &tail) != 2 && sscanf(val, "%dx%d%c", &r, &s, &tail) != 2) || r < 1 || s < 1)
        fatal("%s expects R,S or RxS (replicas, shards: two positive integers), got '%s'", f->name, val);
    o->mesh_replicas = r;
    o->mesh_shards = s;
}

/* --grad-sync and --reshard-after-backward: a pipeline's schedule sets what they set (hw_pipe.h) */
static void parse_sync_flag(const Flag *f, const char *val, Options *o) {
    if (f->kind == FLAG_ENUM) parse_enum(f, val, o);
    else store(f, val, o);
    o->sync_flags_given = 1;
}

/* --ac, --ac-every N, --ac-op: one activation-checkpointing mode (model.h, AcMode); a second one is refused */
static void parse_ac(const Flag *f, const char *val, Options *o) {
    AcMode mode = !strcmp(f->name, "--ac-every") ? AC_EVERY : !strcmp(f->name, "--ac-op") ? AC_OP : AC_FULL;
    if (o->ac_flag && strcmp(o->ac_flag, f->name))
        fatal("%s and %s are two activation-checkpointing modes: give one (--ac every block, --ac-every N every "
              "N-th block, --ac-op per op)", o->ac_flag, f->name);
    if (mode == AC_EVERY) store(f, val, o); /* N into ac.every, checked against the row's range */
    o->ac.mode = mode;
    o->ac_flag = f->name;
}

static void json_ac(Json *j, const Options *o) { json_string(j, ac_mode_name(o->ac.mode)); }

static void parse_dry_run_ranks(const Flag *f, const char *val, Options *o) {
    parse_enum(f, val, o);
    o->dry_run_ranks_given = 1; /* else the world size decides (parse_options) */
}

static void parse_backward_prefetch(const Flag *f, const char *val, Options *o) {
    parse_enum(f, val, o);
    o->backward_prefetch_given = 1; /* a stage that ignores it stops (flag_check.h) */
}

static void parse_bucket_mb(const Flag *f, const char *val, Options *o) {
    store(f, val, o);
    o->bucket_mb_given = 1; /* a stage without flat params stops (train_step.c) */
}

/* run.json values that are not the flag's own: the model's final sizes (the
 * flavour's unless overridden), the resolved link model, the mesh */
#define MODEL_JSON(field_)                                                                                     \
    static void json_model_##field_(Json *j, const Options *o) { json_int(j, o->model.field_); }
MODEL_JSON(dim)
MODEL_JSON(n_layers)
MODEL_JSON(n_heads)
MODEL_JSON(n_kv_heads)
MODEL_JSON(vocab_size)
MODEL_JSON(multiple_of)
#undef MODEL_JSON

static void json_ranks_per_node(Json *j, const Options *o) {
    json_int(j, o->world.ranks_per_node ? o->world.ranks_per_node : o->world.world_size);
}

static void parse_device_profile(const Flag *f, const char *val, Options *o) {
    if (strcmp(val, "list") == 0) { /* every profile's constants, and exit */
        device_profile_table(stdout);
        exit(0);
    }
    const DeviceProfile *p = device_profile_find(val);
    if (!p) fatal("%s: no profile '%s' (profiles: %s)", f->name, val, device_profile_names());
    o->world.profile = p;
}

static void json_device_profile(Json *j, const Options *o) { json_string(j, o->world.profile->name); }

static void json_mesh(Json *j, const Options *o) {
    if (!o->mesh_replicas) {
        json_null(j);
        return;
    }
    json_array_begin(j);
    json_int(j, o->mesh_replicas);
    json_int(j, o->mesh_shards);
    json_array_end(j);
}

/* ------------------------------------------------------------ the table */

#define AT(member) offsetof(Options, member)
#define MAXRANKS ((double)WORLD_MAX_RANKS)
#define MAXDRYRANKS ((double)WORLD_MAX_DRY_RANKS)

static const Flag FLAGS[] = {
    /* model */
    {.name = "--flavor", .kind = FLAG_STRING, .at = AT(flavor), .def = "tiny", .arg = "NAME",
     .help = "tiny | debugmodel | 1B | 8B | 70B | llama2-7B | llama2-13B |\n"
             "llama2-70B | llama3.1-8B | llama3.1-70B | llama3.1-405B\n"
             "(8B and 70B: Llama 3's; the published ones for --dry-run)", .section = "model", .json = "flavor"},
    {.name = "--dim", .kind = FLAG_INT, .at = AT(overrides.dim), .lo = 1, .hi = 1 << 16, .arg = "N",
     .json = "dim", .json_value = json_model_dim},
    {.name = "--n-layers", .kind = FLAG_INT, .at = AT(overrides.n_layers), .lo = 1, .hi = 1024, .arg = "N",
     .json = "n_layers", .json_value = json_model_n_layers},
    {.name = "--n-heads", .kind = FLAG_INT, .at = AT(overrides.n_heads), .lo = 1, .hi = 1024, .arg = "N",
     .json = "n_heads", .json_value = json_model_n_heads},
    {.name = "--n-kv-heads", .kind = FLAG_INT, .at = AT(overrides.n_kv_heads), .lo = 1, .hi = 1024, .arg = "N",
     .json = "n_kv_heads", .json_value = json_model_n_kv_heads},
    {.name = "--vocab-size", .kind = FLAG_INT, .at = AT(overrides.vocab_size), .lo = 1, .hi = 1 << 24, .arg = "N",
     .json = "vocab_size", .json_value = json_model_vocab_size},
    {.name = "--multiple-of", .kind = FLAG_INT, .at = AT(overrides.multiple_of), .lo = 1, .hi = 1 << 16, .arg = "N",
     .json = "multiple_of", .json_value = json_model_multiple_of},
    {.name = "--ffn-dim-multiplier", .kind = FLAG_DOUBLE, .at = AT(overrides.ffn_dim_multiplier), .lo = 0.01,
     .hi = 100, .arg = "X", .help = "override the flavour's dimensions"},

    /* training */
    {.name = "--seq-len", .kind = FLAG_SIZE, .at = AT(seq_len), .lo = 1, .hi = 1 << 20, .def = "64", .arg = "T",
     .help = "sequence length", .section = "training", .json = "seq_len"},
    {.name = "--batch-size", .kind = FLAG_SIZE, .at = AT(batch_size), .lo = 1, .hi = 1 << 20, .def = "2", .arg = "B",
     .help = "sequences per rank per step", .json = "batch_size"},
    {.name = "--steps", .kind = FLAG_INT, .at = AT(steps), .lo = 0, .hi = 100000000, .def = "10", .arg = "S",
     .help = "optimizer steps", .json = "steps"},
    {.name = "--lr", .kind = FLAG_FLOAT, .at = AT(optim.lr), .lo = 0, .hi = 10, .def = "8e-4", .arg = "X",
     .help = "peak learning rate", .json = "lr"},
    {.name = "--warmup-steps", .kind = FLAG_INT, .at = AT(optim.warmup_steps), .lo = 0, .hi = 100000000, .def = "2",
     .arg = "N", .help = "linear warmup steps", .json = "warmup_steps"},
    {.name = "--weight-decay", .kind = FLAG_FLOAT, .at = AT(optim.weight_decay), .lo = 0, .hi = 10, .def = "0.1",
     .arg = "X", .help = "AdamW decoupled weight decay", .json = "weight_decay"},
    {.name = "--max-norm", .kind = FLAG_FLOAT, .at = AT(optim.max_norm), .lo = 0, .hi = 1e30, .def = "1.0",
     .arg = "X", .help = "clip grads to this global norm, 0 = off", .json = "max_norm"},
    {.name = "--seed", .kind = FLAG_U64, .at = AT(seed), .lo = 0, .hi = 0x7fffffff, .def = "0", .arg = "N",
     .help = "init seed", .json = "seed"},
    {.name = "--data", .kind = FLAG_STRING, .at = AT(data_path), .def = "data/corpus.txt", .arg = "FILE",
     .help = ".npy tokens (uint16/int32) or text (bytes)", .json = "data"},
    {.name = "--load", .kind = FLAG_STRING, .at = AT(load_path), .arg = "FILE",
     .help = "start from these weights (safetensors) instead of --seed; a checkpoint\n"
             "written by --save also restores the optimizer and continues its steps"},
    {.name = "--save", .kind = FLAG_STRING, .at = AT(save_path), .arg = "FILE",
     .help = "write a checkpoint at the end: weights (torchtitan names), AdamW state,\n"
             "step (safetensors, atomic); --load FILE resumes from it bitwise"},
    {.name = "--save-every", .kind = FLAG_INT, .at = AT(save_every), .lo = 1, .hi = 100000000, .arg = "N",
     .help = "also write the --save checkpoint every N steps"},
    {.name = "--save-init", .kind = FLAG_STRING, .at = AT(save_init_path), .arg = "FILE",
     .help = "write the initial weights and exit"},
    {.name = "--ac", .kind = FLAG_SET, .at = AT(ac.mode), .parse = parse_ac,
     .help = "full activation checkpointing: every block keeps only its input and\n"
             "recomputes its forward (and its forward hooks) in backward",
     .json = "ac", .json_value = json_ac},
    {.name = "--ac-every", .kind = FLAG_INT, .at = AT(ac.every), .lo = 1, .hi = 1 << 20, .parse = parse_ac,
     .arg = "N",
     .help = "selective activation checkpointing by block: blocks N, 2N, ... (counting\n"
             "from 1) do as --ac, the others keep everything and recompute nothing",
     .json = "ac_every"},
    {.name = "--ac-op", .kind = FLAG_SET, .at = AT(ac.mode), .parse = parse_ac,
     .help = "selective activation checkpointing per op: every block keeps its matmul\n"
             "outputs wq, wv, w1 and the attention's, and recomputes the rest in backward"},
    {.name = "--reshard-after-forward", .kind = FLAG_BOOL, .at = AT(reshard_after_forward), .def = "true",
     .arg = "=true|false", .help = "false = ZeRO-2 (keep params unsharded until backward)",
     .json = "reshard_after_forward"},
    {.name = "--forward-only", .kind = FLAG_SET, .at = AT(forward_only),
     .help = "no backward or optimizer: losses of the initial weights", .json = "forward_only"},
    {.name = "--grad-accum", .kind = FLAG_INT, .at = AT(grad_accum), .lo = 1, .hi = 1 << 20, .def = "1", .arg = "K",
     .help = "split each rank's batch into K microbatches, one optimizer step per K\n"
             "(K divides --batch-size)",
     .json = "grad_accum"},
    {.name = "--grad-sync", .kind = FLAG_ENUM, .at = AT(grad_sync_every), .choices = GRAD_SYNC, .parse = parse_sync_flag, .def = "every",
     .arg = "every|last",
     .help = "with --grad-accum: reduce-scatter every microbatch (every), or only\n"
             "the last (last: FSDP2's set_requires_gradient_sync(False) on the others)",
     .json = "grad_sync"},
    {.name = "--reshard-after-backward", .kind = FLAG_BOOL, .at = AT(reshard_after_backward), .def = "true", .parse = parse_sync_flag,
     .arg = "=true|false",
     .help = "with --grad-accum: false keeps params unsharded between\n"
             "microbatches (FSDP2's set_reshard_after_backward(False) on all but the last)",
     .json = "reshard_after_backward"},
    {.name = "--param-dtype", .kind = FLAG_ENUM, .at = AT(mp.param_dtype), .choices = DTYPES, .def = "fp32",
     .arg = "fp32|bf16",
     .help = "what the all-gather moves and compute reads (FSDP2's MixedPrecisionPolicy\n"
             "param_dtype); shards and optimizer stay fp32",
     .json = "param_dtype"},
    {.name = "--reduce-dtype", .kind = FLAG_ENUM, .at = AT(mp.reduce_dtype), .choices = DTYPES, .def = "fp32",
     .arg = "fp32|bf16", .help = "what the reduce-scatter moves (reduce_dtype)", .json = "reduce_dtype"},
    {.name = "--mesh", .kind = FLAG_CUSTOM, .parse = parse_mesh, .arg = "R,S",
     .help = "HSDP: a 2-D mesh of R replicas x S shards (R*S = --world; or RxS);\n"
             "params are split over S ranks and replicated R times",
     .json = "mesh", .json_value = json_mesh},
    {.name = "--backward-prefetch", .kind = FLAG_ENUM, .at = AT(backward_prefetch), .choices = PREFETCH, .def = "pre",
     .parse = parse_backward_prefetch, .arg = "P",
     .help = "when the backward issues module i-1's all-gather: pre (at module\n"
             "i's pre_backward), post (after module i's reduce-scatter), none",
     .json = "backward_prefetch"},
    {.name = "--single-comm-stream", .kind = FLAG_SET, .at = AT(single_comm_stream),
     .help = "all-gathers and reduce-scatters share one stream", .json = "single_comm_stream"},
    {.name = "--offload-params", .kind = FLAG_SET, .at = AT(offload_params),
     .help = "shards, grad shards and optimizer state in pinned host memory", .json = "offload_params"},
    {.name = "--bucket-mb", .kind = FLAG_DOUBLE, .at = AT(bucket_mb), .lo = 0, .hi = 1 << 20, .parse = parse_bucket_mb,
     .arg = "MB",
     .help = "flat parameters (stage 13): a flat unit takes consecutive modules until\n"
             "their float32 params hold at least MB x 2^20 bytes (0: one unit per module)",
     .json = "bucket_mb", .json_unless_zero = 1},

    /* world and runtime */
    {.name = "--pp", .kind = FLAG_INT, .at = AT(pp), .lo = 1, .hi = MAXRANKS, .arg = "P",
     .help = "pipeline parallelism (hw_pipe.h): P stages of world / P ranks\n"
             "each; the modules split into P contiguous runs; your pipe_schedule runs them",
     .section = "pipeline", .json = "pp", .json_with_pp = 1},
    {.name = "--microbatches", .kind = FLAG_INT, .at = AT(microbatches), .lo = 1, .hi = 1 << 20, .arg = "M",
     .help = "with --pp: microbatches per step (M divides --batch-size; default P)", .json = "microbatches",
     .json_with_pp = 1},
    {.name = "--pp-schedule", .kind = FLAG_ENUM, .at = AT(pp_schedule), .choices = PP_SCHEDULES, .def = "1f1b",
     .arg = "gpipe|1f1b",
     .help = "with --pp: all forwards then all backwards (gpipe), or one forward one\n"
             "backward after a warm-up (1f1b); PipeInfo.schedule",
     .json = "pp_schedule", .json_with_pp = 1},
    {.name = "--world", .kind = FLAG_INT, .at = AT(world.world_size), .lo = 1, .hi = MAXDRYRANKS, .def = "1",
     .arg = "N", .help = "number of ranks (at most 64; a --dry-run's, 16384)", .section = "world and runtime",
     .json = "world_size"},
    {.name = "--backend", .kind = FLAG_ENUM, .at = AT(world.backend), .choices = BACKENDS, .def = "local", .arg = "B",
     .help = "local: ranks as threads (CUDA build: all on one GPU)\n"
             "mpi: one process per rank under mpirun (CPU build)\n"
             "nccl: threads, one GPU per rank; nccl-mpi: mpirun, NCCL (CUDA build)",
     .json = "backend"},
    {.name = "--device-profile", .kind = FLAG_CUSTOM, .parse = parse_device_profile, .arg = "NAME",
     .help = "what the modelled clock prices every op on (HANDOUT: Time): teach\n"
             "(default, the grader's), a100-80g, h100-sxm, h100-gt; list: every\n"
             "profile's constants and their sources",
     .json = "device_profile", .json_value = json_device_profile},
    {.name = "--link-gbps", .kind = FLAG_DOUBLE, .at = AT(world.link_gbps), .lo = 0, .hi = 1e6, .arg = "X",
     .help = "link model for collectives: a rank's bus bandwidth in a node, Gbit/s each way\n"
             "(0 = free; default: the profile's)", .json = "link_gbps"},
    {.name = "--link-latency-us", .kind = FLAG_DOUBLE, .at = AT(world.link_latency_us), .lo = 0, .hi = 1e7,
     .arg = "X", .help = "link model latency per ring hop (default: the profile's)", .json = "link_latency_us"},
    {.name = "--ranks-per-node", .kind = FLAG_INT, .at = AT(world.ranks_per_node), .lo = 1, .hi = MAXDRYRANKS,
     .arg = "N",
     .help = "link model: ranks 0..N-1 share node 0, N..2N-1 node 1, ... (default: S of\n"
             "--mesh, else all ranks on one node)",
     .json = "ranks_per_node", .json_value = json_ranks_per_node},
    {.name = "--inter-link-gbps", .kind = FLAG_DOUBLE, .at = AT(world.inter_link_gbps), .lo = 0, .hi = 1e6,
     .arg = "X",
     .help = "link model: one NIC's bandwidth between nodes, Gbit/s each way; a collective\n"
             "whose group has m ranks on each of its nodes crosses on m NICs at once, at most\n"
             "at --link-gbps (default: the profile's)",
     .json = "inter_link_gbps"},
    {.name = "--inter-link-latency-us", .kind = FLAG_DOUBLE, .at = AT(world.inter_link_latency_us), .lo = 0,
     .hi = 1e7, .arg = "X", .help = "... and this latency per ring step that crosses nodes (default: the profile's)",
     .json = "inter_link_latency_us"},
    {.name = "--pcie-gbps", .kind = FLAG_DOUBLE, .at = AT(world.pcie_gbps), .lo = 0, .hi = 1e6, .arg = "X",
     .help = "PCIe model for host <-> device copies (pinned host memory), GB/s each way\n"
             "(0 = off: priced as device copies; default: the profile's)",
     .json = "pcie_gbps"},
    {.name = "--pcie-latency-us", .kind = FLAG_DOUBLE, .at = AT(world.pcie_latency_us), .lo = 0, .hi = 1e7,
     .arg = "X", .help = "PCIe model latency per copy (default: the profile's)", .json = "pcie_latency_us"},
    {.name = "--blas-threads", .kind = FLAG_INT, .at = AT(world.blas_threads), .lo = 0, .hi = 1024, .arg = "N",
     .help = "OpenBLAS threads per rank (default cores / ranks)"},
    {.name = "--no-poison", .kind = FLAG_CLEAR, .at = AT(world.poison),
     .help = "do not fill fresh allocations with NaN"},
    {.name = "--no-race-check", .kind = FLAG_SET, .at = AT(world.no_race_check),
     .help = "do not check streams for missing event waits (on by default, CPU build)"},
    {.name = "--guard-device-memory", .kind = FLAG_SET, .at = AT(world.guard_device),
     .help = "debug: host code that reads or writes device memory stops the run, naming\n"
             "the buffer and the function (CPU build, x86 protection keys; or\n"
             "HWFSDP_GUARD_DEVICE=1)"},
    {.name = "--dry-run", .kind = FLAG_SET, .at = AT(world.dry_run),
     .help = "price every op on the modelled clock and count every allocation, but\n"
             "execute nothing and back no memory: your hooks on up to 16384 modelled\n"
             "GPUs at 8B/70B (no loss or grad norm; host code touching a buffer stops\n"
             "the run)",
     .json = "dry_run"},
    {.name = "--price-ops", .kind = FLAG_ENUM, .at = AT(world.price_ops), .choices = PRICE_OPS, .def = "fused",
     .arg = "=fused|eager|eager-fused-norm",
     .help = "what the modelled clock prices element-wise math as: this runtime's fused\n"
             "kernels, or the kernels eager PyTorch launches for it in torchtitan's Llama\n"
             "(eager-fused-norm: with its fused RMSNorm), to compare with published runs;\n"
             "the math is this runtime's either way; memory adds the two tensors torchtitan's\n"
             "program holds beyond it (common/model/kernels.h, model.c: eager_hold)",
     .json = "price_ops", .json_unless_zero = 1},
    {.name = "--dry-run-ranks", .kind = FLAG_ENUM, .at = AT(dry_run_ranks), .choices = DRY_RANKS,
     .parse = parse_dry_run_ranks, .arg = "all|representative",
     .help = "with --dry-run: which ranks execute:\n"
             "all (a thread each; the default up to 64 ranks), or representative\n"
             "(the default above 64, up to 16384): one rank per class of symmetric\n"
             "ranks (rank 0 for FSDP and HSDP, each pipeline stage's first rank),\n"
             "every collective priced on its full group",
     .json = "dry_run_ranks", .json_with_dry_run = 1},
    {.name = "--tf32", .kind = FLAG_SET, .at = AT(world.tf32),
     .help = "matmuls may use TF32 tensor cores (CUDA build; the modelled clock prices\n"
             "float32 matmuls at the profile's TF32 peak; default exact fp32)",
     .json = "tf32"},
    {.name = "--collective-timeout-s", .kind = FLAG_DOUBLE, .at = AT(world.collective_timeout_s), .lo = 0,
     .hi = 1e7, .def = "30", .arg = "X",
     .help = "stop when a collective waits longer than X s for its peers (0 = off)"},

    /* output */
    {.name = "--out", .kind = FLAG_STRING, .at = AT(out_dir), .arg = "DIR",
     .help = "run directory: metrics.jsonl, run.json, traces, memory snapshots", .section = "output"},
    {.name = "--profile-steps", .kind = FLAG_INT, .at = AT(profile_steps), .lo = 0, .hi = 100000000, .def = "3",
     .arg = "N", .help = "record op timings for the first N steps", .json = "profile_steps"},
    {.name = "--trace-ranks", .kind = FLAG_INT, .at = AT(world.trace_ranks), .lo = 0, .hi = MAXDRYRANKS, .arg = "N",
     .help = "only ranks 0..N-1 record op timings and write traces and memory\n"
             "snapshots (default 0: every rank; a 64-rank --dry-run's are gigabytes)",
     .json = "trace_ranks"},
    {.name = "--quiet", .kind = FLAG_SET, .at = AT(quiet), .help = "no progress lines"},
    {.name = "--help", .kind = FLAG_HELP, .help = "this text"},
};
#define N_FLAGS (sizeof FLAGS / sizeof FLAGS[0])
#undef AT
#undef MAXRANKS
#undef MAXDRYRANKS

/* ----------------------------------------------------------------- usage */

#define USAGE_COLUMN 25 /* where the flags' texts start, after two spaces */

static void usage(FILE *f, const char *prog) {
    fprintf(f, "usage: %s [flags]\n"
               "Trains torchtitan's Llama 3 with the FSDP implementation linked into this binary.\n", prog);
    int open_line = 0; /* a line of flags without a text of their own is being written */
    for (size_t i = 0; i < N_FLAGS; i++) {
        const Flag *g = &FLAGS[i];
        if (open_line && (g->help || g->section)) {
            fputc('\n', f);
            open_line = 0;
        }
        if (g->section) fprintf(f, "\n%s\n", g->section);
        char left[96];
        snprintf(left, sizeof left, "%s%s%s", g->name, g->arg && g->arg[0] != '=' ? " " : "", g->arg ? g->arg : "");
        if (!g->help) { /* the text of the next row with one is also its: on one line with its neighbours */
            fprintf(f, "%s%s", open_line ? " " : "  ", left);
            open_line = 1;
            continue;
        }
        size_t width = strlen(left);
        fprintf(f, "  %s%*s", left, width < USAGE_COLUMN ? (int)(USAGE_COLUMN - width) : 2, "");
        /* the text's lines, the second and later under the first */
        for (const char *t = g->help;;) {
            const char *nl = strchr(t, '\n');
            if (!nl) { /* the last line ends with the default, from the table (.def), said nowhere else */
                if (g->def) fprintf(f, "%s (default %s)\n", t, g->def);
                else fprintf(f, "%s\n", t);
                break;
            }
            fprintf(f, "%.*s\n%*s", (int)(nl - t), t, USAGE_COLUMN + 2, "");
            t = nl + 1;
        }
    }
    if (open_line) fputc('\n', f);
}

/* --------------------------------------------------------------- parsing */

static const Flag *find_flag(const char *name) {
    for (size_t i = 0; i < N_FLAGS; i++)
        if (!strcmp(FLAGS[i].name, name)) return &FLAGS[i];
    return NULL;
}

/* A row that misses what its kind needs is a bug in the table: said at once
 * rather than left to write into Options' first field (offset 0, the model). */
static void check_row(const Flag *g) {
    int stores = g->kind != FLAG_CUSTOM && g->kind != FLAG_HELP;
    if ((stores && g->at == 0) || (g->kind == FLAG_ENUM && !g->choices) || (g->kind == FLAG_CUSTOM && !g->parse) ||
        (g->kind == FLAG_CUSTOM && g->json && !g->json_value))
        fatal("options.c: the row of %s lacks what a flag of its kind needs (at, choices, parse or json_value)",
              g->name);
}

static void set_defaults(Options *o) {
    memset(o, 0, sizeof *o);
    o->optim = adamw_default_config(); /* betas and eps: no flags */
    o->world.trace = 1;
    o->world.profile = device_profile_find(DEVICE_PROFILE_DEFAULT);
    /* the links: the profile's unless a flag gives them (resolve_links) */
    o->world.link_gbps = o->world.link_latency_us = NAN;
    o->world.inter_link_gbps = o->world.inter_link_latency_us = NAN;
    o->world.pcie_gbps = o->world.pcie_latency_us = NAN;
    for (size_t i = 0; i < N_FLAGS; i++) {
        const Flag *g = &FLAGS[i];
        check_row(g);
        if (g->kind == FLAG_CLEAR) *(int *)field(o, g) = 1; /* a --no-... switch: on unless given */
        else if (g->def) store(g, g->def, o);
    }
}

/* A link the flags did not give (NAN) is the device profile's. */
static void resolve_links(WorldConfig *w) {
    const DeviceProfile *p = w->profile;
    const struct {
        double *v, profile;
    } links[] = {{&w->link_gbps, p->link_gbps},
                 {&w->link_latency_us, p->link_latency_us},
                 {&w->inter_link_gbps, p->inter_link_gbps},
                 {&w->inter_link_latency_us, p->inter_link_latency_us},
                 {&w->pcie_gbps, p->pcie_gbs},
                 {&w->pcie_latency_us, p->pcie_latency_us}};
    for (size_t i = 0; i < sizeof links / sizeof links[0]; i++)
        if (isnan(*links[i].v)) *links[i].v = links[i].profile;
}

static void apply_model_overrides(ModelConfig *m, const ModelOverrides *ov) {
    if (ov->dim) m->dim = ov->dim;
    if (ov->n_layers) m->n_layers = ov->n_layers;
    if (ov->n_heads) {
        m->n_heads = ov->n_heads;
        if (!ov->n_kv_heads) m->n_kv_heads = 0; /* default: kv heads = heads */
    }
    if (ov->n_kv_heads) m->n_kv_heads = ov->n_kv_heads;
    if (ov->vocab_size) m->vocab_size = ov->vocab_size;
    if (ov->multiple_of) m->multiple_of = ov->multiple_of;
    if (ov->ffn_dim_multiplier > 0) m->ffn_dim_multiplier = (float)ov->ffn_dim_multiplier;
}

/* Which ranks execute (--dry-run-ranks, runtime.h: WorldConfig.rep_stride). A run that computes executes every
 * rank, one thread (or process) each: at most WORLD_MAX_RANKS. A dry run may model up to WORLD_MAX_DRY_RANKS by
 * executing one rank per class of symmetric ranks: FSDP's and HSDP's ranks are all alike (rank 0 stands for
 * the world); a pipeline's stages differ, each one's ranks are alike (its first rank, p * S, stands for the
 * stage: the same data shard in every stage, so each representative's sends and receives meet another). */
static void resolve_dry_run_ranks(Options *o) {
    const int W = o->world.world_size;
    if (o->dry_run_ranks_given && !o->world.dry_run)
        fatal("--dry-run-ranks picks the ranks a dry run executes: it needs --dry-run (a run that computes "
              "executes every rank)");
    if (!o->world.dry_run && W > WORLD_MAX_RANKS)
        fatal("--world %d: a run that computes executes every rank, one thread each, at most %d; a dry run "
              "(--dry-run) models up to %d by executing one rank per class of symmetric ranks", W, WORLD_MAX_RANKS,
              WORLD_MAX_DRY_RANKS);
    if (!o->dry_run_ranks_given)
        o->dry_run_ranks = W > WORLD_MAX_RANKS ? DRY_RANKS_REPRESENTATIVE : DRY_RANKS_ALL;
    if (o->dry_run_ranks == DRY_RANKS_ALL && W > WORLD_MAX_RANKS)
        fatal("--dry-run-ranks all executes every rank, one thread each: at most %d, and --world is %d (representative, "
              "the default above %d, executes one rank per class of symmetric ranks)", WORLD_MAX_RANKS, W,
              WORLD_MAX_RANKS);
    if (o->dry_run_ranks != DRY_RANKS_REPRESENTATIVE) return;
    if (o->world.backend != BACKEND_LOCAL)
        fatal("--dry-run-ranks representative runs its ranks as threads of one process: it needs --backend local "
              "(--world %d)", W);
    o->world.rep_stride = o->pp ? W / o->pp : W;
}

void parse_options(int argc, char **argv, Options *o) {
    set_defaults(o);
    for (int i = 1; i < argc; i++) {
        /* "--flag", "--flag=value" or "--flag value" */
        const char *a = argv[i];
        const char *eq = strchr(a, '=');
        char name[64];
        const char *val = NULL;
        if (strncmp(a, "--", 2) != 0) fatal("unexpected argument '%s' (see --help)", a);
        if (eq) {
            size_t n = (size_t)(eq - a);
            if (n >= sizeof name) fatal("unknown flag '%s' (see --help)", a);
            memcpy(name, a, n);
            name[n] = 0;
            val = eq + 1;
        } else {
            snprintf(name, sizeof name, "%s", a);
        }
        const Flag *f = find_flag(name);
        if (!f) fatal("unknown flag '%s' (see --help)", name);
        switch (f->kind) {
        case FLAG_HELP:
            usage(stdout, argv[0]);
            exit(0);
        case FLAG_SET:
        case FLAG_CLEAR: /* a switch: a value after = is ignored */
            if (f->parse) f->parse(f, NULL, o);
            else store(f, NULL, o);
            continue;
        case FLAG_BOOL: /* a value is optional: true by itself */
            if (!val && i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0) val = argv[++i];
            if (f->parse) f->parse(f, val, o);
            else store(f, val, o);
            continue;
        default:
            break;
        }
        if (!val) {
            if (i + 1 >= argc) fatal("flag %s needs a value (see --help)", f->name);
            val = argv[++i];
        }
        if (f->parse) f->parse(f, val, o);
        else store(f, val, o);
    }
    /* what one flag's value says about another's */
    if (o->save_every && !o->save_path) fatal("--save-every needs --save FILE");
    if (o->batch_size % (size_t)o->grad_accum)
        fatal("--grad-accum %d must divide --batch-size %zu (each microbatch holds batch-size / K sequences)",
              o->grad_accum, o->batch_size);
    if (o->grad_accum > 1 && o->forward_only) fatal("--grad-accum needs a backward: it cannot go with --forward-only");
    if (o->mesh_replicas && o->mesh_replicas * o->mesh_shards != o->world.world_size)
        fatal("--mesh %d,%d holds %d ranks but --world is %d (R*S must equal the world)", o->mesh_replicas,
              o->mesh_shards, o->mesh_replicas * o->mesh_shards, o->world.world_size);
    if (o->mesh_replicas && !o->world.ranks_per_node) o->world.ranks_per_node = o->mesh_shards; /* a row per node */
    if (o->mesh_replicas && o->bucket_mb_given)
        fatal("--mesh cannot go with --bucket-mb: flat parameters (stage 13) shard over the 1-D world");
    if (o->world.ranks_per_node && o->world.world_size % o->world.ranks_per_node)
        fatal("--ranks-per-node %d must divide --world %d", o->world.ranks_per_node, o->world.world_size);
    resolve_links(&o->world);
    if (!model_flavor(&o->model, o->flavor)) fatal("unknown flavor '%s' (%s)", o->flavor, MODEL_FLAVORS);
    apply_model_overrides(&o->model, &o->overrides);
    model_config_finalize(&o->model);
    size_t max_seq = model_flavor_max_seq_len(o->flavor);
    if (max_seq && o->seq_len > max_seq) {
        const char *family = model_flavor_family(o->flavor);
        fatal("--seq-len %zu exceeds the %s flavour's context of %zu tokens (%s's%s)", o->seq_len, o->flavor, max_seq,
              family, strcmp(family, "Llama 3") == 0 ? "; the llama3.1-* flavours, with Llama 3.1's RoPE scaling, "
                                                       "take 131072" : "");
    }
    if (o->pp) {
        const int W = o->world.world_size, P = o->pp, L = o->model.n_layers;
        if (!o->microbatches) o->microbatches = P;
        if (W % P) fatal("--pp %d must divide --world %d (each stage has world / P ranks)", P, W);
        const int empty = pipe_split_empty_stage(L, P);
        if (empty >= 0)
            fatal("--pp %d needs at least %d blocks: the blocks go L / P to a stage, one more to the first L %% P "
                  "stages, so with %d (--n-layers) stage %d would hold no module (hw_pipe.h)", P, P - 1, L, empty);
        if (o->batch_size % (size_t)o->microbatches)
            fatal("--microbatches %d must divide --batch-size %zu (each microbatch holds batch-size / M sequences)",
                  o->microbatches, o->batch_size);
        if (o->grad_accum > 1) fatal("--pp splits the batch into --microbatches itself: it cannot go with --grad-accum");
        if (o->sync_flags_given)
            fatal("--pp: your pipe_schedule decides which backward syncs and reshards (hw_pipe.h); --grad-sync and "
                  "--reshard-after-backward do not apply");
        if (o->mesh_replicas) fatal("--pp makes its own mesh (stages x shards): it cannot go with --mesh");
        if (o->forward_only) fatal("--pp runs forward and backward through pipe_schedule: it cannot go with --forward-only");
        if (o->load_path || o->save_path || o->save_init_path)
            fatal("--pp keeps each stage's parameters on its own ranks: it cannot go with %s",
                  o->load_path ? "--load" : o->save_path ? "--save" : "--save-init");
        if (o->offload_params) fatal("--pp cannot go with --offload-params");
        if (o->bucket_mb_given) fatal("--pp cannot go with --bucket-mb: flat parameters (stage 13) shard the whole model");
        if (o->mp.param_dtype == DTYPE_BF16)
            fatal("--pp cannot go with --param-dtype bf16: the stages hand over float32 activations (hw_pipe.h: "
                  "act_numel floats), and under bf16 the model's activations are bfloat16");
    } else if (o->microbatches) {
        fatal("--microbatches splits a pipeline's batch: it needs --pp (for plain accumulation: --grad-accum)");
    }
    if (o->world.dry_run && (o->load_path || o->save_path || o->save_init_path))
        fatal("--dry-run computes no values: it cannot go with %s", o->load_path ? "--load" : o->save_path ? "--save"
                                                                                                  : "--save-init");
    resolve_dry_run_ranks(o);
}

const char *backward_prefetch_name(BackwardPrefetch p) {
    for (const FlagChoice *c = PREFETCH; c->name; c++)
        if (c->value == (int)p) return c->name;
    return "pre";
}

/* -------------------------------------------------------------- run.json */

/* A flag's value in run.json, in its kind's format. */

/* The fewest significant digits, at least 6, that read back as v: run.json states the value that ran (a
 * --bucket-mb of 0.251220703125 is not 0.251221, whose 2^20 x B bytes would draw another unit boundary). */
static int round_trip_digits(double v) {
    char buf[40];
    for (int p = 6; p < 17; p++) {
        snprintf(buf, sizeof buf, "%.*g", p, v);
        if (strtod(buf, NULL) == v) return p;
    }
    return 17;
}
static void flag_json(Json *j, const Flag *f, const Options *o) {
    if (f->json_value) {
        f->json_value(j, o);
        return;
    }
    const void *v = cfield(o, f);
    switch (f->kind) {
    case FLAG_SET:
    case FLAG_CLEAR:
    case FLAG_BOOL: json_bool(j, *(const int *)v); break;
    case FLAG_INT: json_int(j, *(const int *)v); break;
    case FLAG_SIZE: json_uint(j, *(const size_t *)v); break;
    case FLAG_U64: json_uint(j, *(const uint64_t *)v); break;
    case FLAG_DOUBLE: json_g(j, *(const double *)v, round_trip_digits(*(const double *)v)); break;
    case FLAG_FLOAT: json_g(j, (double)*(const float *)v, 6); break;
    case FLAG_STRING: json_string(j, *(const char *const *)v); break;
    case FLAG_ENUM: {
        const FlagChoice *c = f->choices;
        while (c->name && c->value != *(const int *)v) c++;
        json_string(j, c->name);
        break;
    }
    case FLAG_CUSTOM: /* check_row: it has a json_value */
    case FLAG_HELP: break;
    }
}

/* Is a json_unless_zero flag's value 0? (a double is read as a double, the others as int) */
static int flag_is_zero(const Flag *f, const Options *o) {
    const void *v = cfield(o, f);
    return f->kind == FLAG_DOUBLE ? *(const double *)v == 0 : *(const int *)v == 0;
}

void options_run_json(Json *j, const Options *o, const RunFacts *facts) {
    json_object_begin(j);
    /* every flag with a run.json key, in the table's order (a --pp-only key only with --pp, a dry run's only
     * with --dry-run) */
    for (size_t i = 0; i < N_FLAGS; i++)
        if (FLAGS[i].json && (!FLAGS[i].json_with_pp || o->pp) && (!FLAGS[i].json_with_dry_run || o->world.dry_run) &&
            (!FLAGS[i].json_unless_zero || !flag_is_zero(&FLAGS[i], o))) {
            json_key(j, FLAGS[i].json);
            flag_json(j, &FLAGS[i], o);
        }
    if (o->world.dry_run) { /* the ranks that ran (--dry-run-ranks): per-rank files and figures are theirs */
        const int W = o->world.world_size, every = o->world.rep_stride ? o->world.rep_stride : 1;
        json_key(j, "executed_ranks");
        json_array_begin(j);
        for (int r = 0; r < W; r += every) json_int(j, r);
        json_array_end(j);
    }
    /* what the flags imply, and where the run ran */
    json_key(j, "hidden_dim");
    json_int(j, o->model.hidden_dim);
    json_key(j, "n_params");
    json_uint(j, facts->n_params);
    json_key(j, "device");
    json_string(j, facts->device);
    json_key(j, "host");
    json_string(j, facts->host);
    if (facts->hbm_capacity_bytes) { /* a profile with a memory capacity (step_log.h: EXIT_OVER_CAPACITY) */
        json_key(j, "hbm_capacity_bytes");
        json_uint(j, facts->hbm_capacity_bytes);
        json_key(j, "fits");
        if (facts->fits < 0) json_null(j);
        else json_bool(j, facts->fits);
    }
    if (facts->rules) facts->rules(j, o, facts->rules_ctx);
    if (facts->world) world_facts_json(facts->world, j);
    json_object_end(j);
}
