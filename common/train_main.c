/* train_main.c — the training driver every FSDP implementation links with.
 *
 * It owns the loop (data, forward, backward, optimizer, logging) and calls
 * the hooks of hw_fsdp.h around every module exactly as PyTorch autograd
 * calls FSDP2's. It also records, for the grader, what was still allocated
 * right after each hook ("hook checks" in the memory snapshot) and dumps the
 * DTensors built by fsdp_init (dtensors_rank<r>.json).
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "data.h"
#include "device.h"
#include "hw_fsdp.h"
#include "model.h"
#include "optim.h"
#include "safetensors.h"
#include "util.h"

#define EXIT_NAN 4

typedef struct {
    ModelConfig model;
    char flavor[32];
    size_t seq_len, batch_size;
    int steps;
    AdamWConfig optim;
    uint64_t seed;
    const char *data_path, *load_path, *save_path, *save_init_path, *out_dir;
    int ac, reshard_after_forward, forward_only;
    int profile_steps;
    int save_every;
    int quiet;
    WorldConfig world;
} Options;

typedef struct {
    const Options *opt;
    const float *init;        /* [n_params_total] host copy of the initial weights */
    const float *init_exp_avg, *init_exp_avg_sq; /* [n_params_total] AdamW state when resuming, else NULL */
    int start_step;           /* 0, or the step a resumed checkpoint was saved at */
    const TokenData *data;
    int exit_code;            /* set by rank 0: 0 or EXIT_NAN */
} Shared;

/* ------------------------------------------------------------------ flags */

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
            "\nworld and runtime\n"
            "  --world N                number of ranks (default 1)\n"
            "  --backend B              local: ranks as threads (default; CUDA build: all on one GPU)\n"
            "                           mpi: one process per rank under mpirun (CPU build)\n"
            "                           nccl: threads, one GPU per rank; nccl-mpi: mpirun, NCCL (CUDA build)\n"
            "  --link-gbps X            link model for local collectives, Gbit/s (0 = off, default)\n"
            "  --link-latency-us X      link model latency per ring hop (default 0)\n"
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

static void parse_args(int argc, char **argv, Options *o) {
    memset(o, 0, sizeof *o);
    snprintf(o->flavor, sizeof o->flavor, "tiny");
    o->seq_len = 64;
    o->batch_size = 2;
    o->steps = 10;
    o->optim = adamw_default_config();
    o->data_path = "data/corpus.txt";
    o->reshard_after_forward = 1;
    o->profile_steps = 3;
    o->world.world_size = 1;
    o->world.backend = BACKEND_LOCAL;
    o->world.poison = 1;
    o->world.trace = 1;
    o->world.collective_timeout_s = 30.0;
    /* model overrides are applied after the flavour */
    long ov_dim = -1, ov_layers = -1, ov_heads = -1, ov_kv = -1, ov_vocab = -1, ov_mult = -1;
    double ov_ffn = -1;
    for (int i = 1; i < argc; i++) {
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
        /* boolean flags */
        if (!strcmp(flag, "--help")) { usage(stdout, argv[0]); exit(0); }
        if (!strcmp(flag, "--ac")) { o->ac = 1; continue; }
        if (!strcmp(flag, "--forward-only")) { o->forward_only = 1; continue; }
        if (!strcmp(flag, "--no-poison")) { o->world.poison = 0; continue; }
        if (!strcmp(flag, "--tf32")) { o->world.tf32 = 1; continue; }
        if (!strcmp(flag, "--no-race-check")) { o->world.no_race_check = 1; continue; }
        if (!strcmp(flag, "--quiet")) { o->quiet = 1; continue; }
        if (!strcmp(flag, "--reshard-after-forward")) {
            if (!val && i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0) val = argv[++i];
            if (!val || !strcmp(val, "true") || !strcmp(val, "1")) o->reshard_after_forward = 1;
            else if (!strcmp(val, "false") || !strcmp(val, "0")) o->reshard_after_forward = 0;
            else fatal("--reshard-after-forward expects true or false, got '%s'", val);
            continue;
        }
        static const char *const value_flags[] = {
            "--flavor", "--dim", "--n-layers", "--n-heads", "--n-kv-heads", "--vocab-size", "--multiple-of",
            "--ffn-dim-multiplier", "--seq-len", "--batch-size", "--steps", "--lr", "--warmup-steps",
            "--weight-decay", "--max-norm", "--seed", "--data", "--load", "--save", "--save-init", "--out",
            "--profile-steps", "--save-every", "--world", "--backend", "--link-gbps", "--link-latency-us", "--blas-threads", "--collective-timeout-s"};
        int known = 0;
        for (size_t k = 0; k < sizeof value_flags / sizeof value_flags[0]; k++) known |= !strcmp(flag, value_flags[k]);
        if (!known) fatal("unknown flag '%s' (see --help)", flag);
        if (!val) {
            if (i + 1 >= argc) fatal("flag %s needs a value (see --help)", flag);
            val = argv[++i];
        }
        if (!strcmp(flag, "--flavor")) {
            if (strlen(val) >= sizeof o->flavor) fatal("unknown flavor '%s' (tiny, debugmodel, 1B)", val);
            snprintf(o->flavor, sizeof o->flavor, "%s", val);
        } else if (!strcmp(flag, "--dim")) ov_dim = parse_int(flag, val, 1, 1 << 16);
        else if (!strcmp(flag, "--n-layers")) ov_layers = parse_int(flag, val, 1, 1024);
        else if (!strcmp(flag, "--n-heads")) ov_heads = parse_int(flag, val, 1, 1024);
        else if (!strcmp(flag, "--n-kv-heads")) ov_kv = parse_int(flag, val, 1, 1024);
        else if (!strcmp(flag, "--vocab-size")) ov_vocab = parse_int(flag, val, 1, 1 << 24);
        else if (!strcmp(flag, "--multiple-of")) ov_mult = parse_int(flag, val, 1, 1 << 16);
        else if (!strcmp(flag, "--ffn-dim-multiplier")) ov_ffn = parse_num(flag, val, 0.01, 100);
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
        else if (!strcmp(flag, "--collective-timeout-s")) o->world.collective_timeout_s = parse_num(flag, val, 0, 1e7);
        else if (!strcmp(flag, "--blas-threads")) o->world.blas_threads = (int)parse_int(flag, val, 0, 1024);
        else fatal("unknown flag '%s' (see --help)", flag);
    }
    if (o->save_every && !o->save_path) fatal("--save-every needs --save FILE");
    if (!model_flavor(&o->model, o->flavor)) fatal("unknown flavor '%s' (tiny, debugmodel, 1B)", o->flavor);
    if (ov_dim > 0) o->model.dim = (int)ov_dim;
    if (ov_layers > 0) o->model.n_layers = (int)ov_layers;
    if (ov_heads > 0) {
        o->model.n_heads = (int)ov_heads;
        if (ov_kv < 0) o->model.n_kv_heads = 0; /* default: kv heads = heads */
    }
    if (ov_kv > 0) o->model.n_kv_heads = (int)ov_kv;
    if (ov_vocab > 0) o->model.vocab_size = (int)ov_vocab;
    if (ov_mult > 0) o->model.multiple_of = (int)ov_mult;
    if (ov_ffn > 0) o->model.ffn_dim_multiplier = (float)ov_ffn;
    model_config_finalize(&o->model);
}

/* ------------------------------------------------------- weights on disk */

#define OPTIM_PREFIX "optim."

/* Weights (and, from a checkpoint written by --save, the AdamW state and the
 * step) into host arrays. Returns the step to continue from (0 for plain
 * weights). */
static int load_checkpoint(const Model *m, const char *path, float *w, float **exp_avg, float **exp_avg_sq) {
    StFile f = st_read(path);
    char name[128];
    int step = 0;
    snprintf(name, sizeof name, OPTIM_PREFIX "%s.exp_avg", m->modules[0].params[0].name);
    int has_optim = st_has(&f, name);
    if (has_optim) {
        *exp_avg = xmalloc(m->n_params_total * sizeof(float));
        *exp_avg_sq = xmalloc(m->n_params_total * sizeof(float));
        const char *st = st_meta(&f, "step");
        char *end = NULL;
        long v = st ? strtol(st, &end, 10) : -1;
        if (!st || end == st || *end || v < 0 || v > 100000000)
            fatal("%s: has optimizer state but no valid \"step\" in its metadata", path);
        step = (int)v;
    }
    for (int i = 0; i < m->n_modules; i++)
        for (int j = 0; j < m->modules[i].n_params; j++) {
            const Param *p = &m->modules[i].params[j];
            size_t off = model_param_offset(m, p);
            const StTensor *t = st_get(&f, p->name, path);
            st_expect_shape(t, p->ndim, p->shape, path);
            memcpy(w + off, t->data, p->numel * sizeof(float));
            if (!has_optim) continue;
            const char *kinds[2] = {"exp_avg", "exp_avg_sq"};
            float *dst[2] = {*exp_avg + off, *exp_avg_sq + off};
            for (int k = 0; k < 2; k++) {
                snprintf(name, sizeof name, OPTIM_PREFIX "%s.%s", p->name, kinds[k]);
                t = st_get(&f, name, path);
                st_expect_shape(t, p->ndim, p->shape, path);
                memcpy(dst[k], t->data, p->numel * sizeof(float));
            }
        }
    st_free(&f);
    return step;
}

/* Write weights (+ AdamW state when given) with torchtitan's names, atomically. */
static void save_checkpoint(const Model *m, const char *path, const float *w, const float *exp_avg,
                            const float *exp_avg_sq, int step) {
    int per = exp_avg ? 3 : 1;
    StTensor *ts = xcalloc(m->n_params_total ? (size_t)m->n_modules * 16 * (size_t)per : 1, sizeof(StTensor));
    char **names = xcalloc((size_t)m->n_modules * 16 * (size_t)per, sizeof(char *));
    int n = 0;
    for (int k = 0; k < per; k++)
        for (int i = 0; i < m->n_modules; i++)
            for (int j = 0; j < m->modules[i].n_params; j++) {
                const Param *p = &m->modules[i].params[j];
                const float *src = k == 0 ? w : k == 1 ? exp_avg : exp_avg_sq;
                char name[128];
                if (k == 0) snprintf(name, sizeof name, "%s", p->name);
                else snprintf(name, sizeof name, OPTIM_PREFIX "%s.%s", p->name, k == 1 ? "exp_avg" : "exp_avg_sq");
                names[n] = xstrdup(name);
                StTensor *t = &ts[n++];
                t->name = names[n - 1];
                t->ndim = p->ndim;
                t->shape[0] = p->shape[0];
                t->shape[1] = p->shape[1];
                t->numel = p->numel;
                t->data = (float *)src + model_param_offset(m, p);
            }
    char meta[128];
    snprintf(meta, sizeof meta, "\"format\":\"pt\",\"step\":\"%d\"", step);
    st_write(path, ts, n, meta);
    for (int i = 0; i < n; i++) free(names[i]);
    free(names);
    free(ts);
}

typedef enum { FULL_PARAM, FULL_EXP_AVG, FULL_EXP_AVG_SQ } FullWhat;

/* Gather the full value of every parameter (or of its AdamW state) from the
 * DTensors into host memory `out` (every rank takes part in the all-gathers).
 * Shards are the first local_rows rows of their storage; rank r's rows start
 * at r * padded_rows (torch.chunk). */
static void gather_full(Dev *dev, Model *m, FullWhat what, float *out) {
    Stream *s = dev_compute_stream(dev);
    int W = dev_world_size(dev), rank = dev_rank(dev);
    for (int i = 0; i < m->n_modules; i++)
        for (int j = 0; j < m->modules[i].n_params; j++) {
            Param *p = &m->modules[i].params[j];
            DTensor *dt = &p->dt;
            const float *src = what == FULL_PARAM ? dt->local : what == FULL_EXP_AVG ? dt->exp_avg : dt->exp_avg_sq;
            float *dst = out + model_param_offset(m, p);
            if (dt->placement == PLACEMENT_REPLICATE) {
                dev_memcpy_async(s, dst, src, p->numel * sizeof(float));
                continue;
            }
            size_t rn = dt->row_numel, chunk = dt->padded_rows * rn;
            float *flat = dev_alloc_f32(dev, chunk * (size_t)W, MEM_TEMP, "checkpoint.gather");
            float *mine = flat + (size_t)rank * chunk;
            dev_memset_async(s, mine, 0, chunk * sizeof(float));
            dev_memcpy_async(s, mine, src, dt->local_rows * rn * sizeof(float));
            coll_all_gather(dev, mine, flat, chunk, s, "checkpoint");
            for (int r = 0; r < W; r++) {
                size_t off = dt->padded_rows * (size_t)r;
                if (off >= p->shape[0]) break;
                size_t rows = p->shape[0] - off < dt->padded_rows ? p->shape[0] - off : dt->padded_rows;
                dev_memcpy_async(s, dst + off * rn, flat + (size_t)r * chunk, rows * rn * sizeof(float));
            }
            dev_free(dev, flat);
        }
    dev_synchronize(dev);
}

/* --save: gather weights and optimizer state; rank 0 writes. */
static void write_checkpoint(Dev *dev, Model *m, const char *path, int step) {
    int have_optim = 1;
    for (int i = 0; i < m->n_modules; i++)
        for (int j = 0; j < m->modules[i].n_params; j++) have_optim &= m->modules[i].params[j].dt.exp_avg != NULL;
    float *w = xcalloc(m->n_params_total, sizeof(float)), *ea = NULL, *eas = NULL;
    gather_full(dev, m, FULL_PARAM, w);
    if (have_optim) {
        ea = xcalloc(m->n_params_total, sizeof(float));
        eas = xcalloc(m->n_params_total, sizeof(float));
        gather_full(dev, m, FULL_EXP_AVG, ea);
        gather_full(dev, m, FULL_EXP_AVG_SQ, eas);
    }
    if (dev_rank(dev) == 0) save_checkpoint(m, path, w, ea, eas, step);
    free(w);
    free(ea);
    free(eas);
}

/* Resuming: give every DTensor its rows of the saved AdamW state, as the
 * optimizer would have created them (hw_fsdp.h: the optimizer creates state
 * only where DTensor.exp_avg is NULL). */
static void restore_optimizer_state(Dev *dev, Model *m, const float *exp_avg, const float *exp_avg_sq) {
    Stream *s = dev_compute_stream(dev);
    for (int i = 0; i < m->n_modules; i++)
        for (int j = 0; j < m->modules[i].n_params; j++) {
            Param *p = &m->modules[i].params[j];
            DTensor *dt = &p->dt;
            size_t n = dt->local_rows * dt->row_numel, off = model_param_offset(m, p) + dt->row_offset * dt->row_numel;
            if (dt->row_offset + dt->local_rows > p->shape[0] && dt->local_rows)
                fatal("%s: DTensor rows [%zu, %zu) are outside the parameter's %zu rows", p->name, dt->row_offset,
                      dt->row_offset + dt->local_rows, p->shape[0]);
            dt->exp_avg = dev_alloc_f32(dev, n, MEM_OPTIM_STATE, p->name);
            dt->exp_avg_sq = dev_alloc_f32(dev, n, MEM_OPTIM_STATE, p->name);
            dev_memcpy_async(s, dt->exp_avg, exp_avg + off, n * sizeof(float));
            dev_memcpy_async(s, dt->exp_avg_sq, exp_avg_sq + off, n * sizeof(float));
        }
}

/* ------------------------------------------------------------- checks */

/* The allocations a module's params (or grads) live in, captured when the
 * module runs, so that right after a hook we can say how many of those bytes
 * are still allocated. Identities, not addresses: a freed buffer's address
 * may be handed to a new allocation in the meantime. */
typedef struct {
    int n;
    const void *ptr[16];
    uint64_t id[16];
} Captured;

static void capture(Dev *dev, Captured *c, float *const *ptrs, int n) {
    c->n = n;
    for (int i = 0; i < n; i++) {
        c->ptr[i] = ptrs[i];
        c->id[i] = ptrs[i] ? dev_mem_live_id_containing(dev, ptrs[i]) : 0;
    }
}

static size_t still_live_bytes(Dev *dev, const Captured *c) {
    size_t total = 0;
    for (int i = 0; i < c->n; i++) {
        if (!c->id[i] || dev_mem_live_id_containing(dev, c->ptr[i]) != c->id[i]) continue;
        int dup = 0; /* several params may be views into one buffer: count it once */
        for (int k = 0; k < i; k++) dup |= c->id[k] == c->id[i];
        if (!dup) total += dev_mem_live_size_containing(dev, c->ptr[i]);
    }
    return total;
}

static void hook_note(Dev *dev, int step, const Module *mod, const char *hook, const char *what, size_t bytes) {
    char f[256];
    snprintf(f, sizeof f, "\"step\":%d,\"module\":\"%s\",\"hook\":\"%s\",\"%s\":%zu", step, mod->name, hook, what,
             bytes);
    dev_mem_note(dev, "hook_check", f);
}

static void write_dtensors(Dev *dev, Model *m, const float *init, const char *dir, const DeviceMesh *mesh) {
    dev_synchronize(dev);
    char path[4096];
    snprintf(path, sizeof path, "%s/dtensors_rank%d.json", dir, dev_rank(dev));
    size_t cap = 1 << 16, len = 0;
    char *buf = xmalloc(cap);
#define EMIT(...)                                                                  \
    do {                                                                           \
        int need_ = snprintf(NULL, 0, __VA_ARGS__);                                \
        while (len + (size_t)need_ + 1 > cap) buf = xrealloc(buf, cap *= 2);       \
        len += (size_t)snprintf(buf + len, cap - len, __VA_ARGS__);                \
    } while (0)
    EMIT("{\"rank\":%d,\"world_size\":%d,\"params\":[", dev_rank(dev), dev_world_size(dev));
    int first = 1;
    for (int i = 0; i < m->n_modules; i++)
        for (int j = 0; j < m->modules[i].n_params; j++) {
            const Param *p = &m->modules[i].params[j];
            const DTensor *dt = &p->dt;
            /* the DTensor's own mesh, compared by value with the world's (a copy is fine) */
            const DeviceMesh *dm = dt->mesh;
            int mesh_ok = dm && dm->size == mesh->size;
            for (int r = 0; mesh_ok && r < mesh->size; r++) mesh_ok = dm->ranks[r] == mesh->ranks[r];
            const char *pl = dt->placement == PLACEMENT_SHARD0 ? "Shard(0)"
                             : dt->placement == PLACEMENT_REPLICATE ? "Replicate()" : "none";
            /* does the local shard hold exactly the rows [row_offset, +local_rows) of the init? */
            int matches = -1, pad_zero = -1;
            if (dt->local && dt->row_offset + dt->local_rows <= p->shape[0] && dt->row_numel == p->numel / p->shape[0]) {
                const float *want = init + model_param_offset(m, p) + dt->row_offset * dt->row_numel;
                matches = memcmp(dt->local, want, dt->local_rows * dt->row_numel * sizeof(float)) == 0;
                pad_zero = 1;
                if (dt->padded_rows >= dt->local_rows && dt->placement == PLACEMENT_SHARD0)
                    for (size_t e = dt->local_rows * dt->row_numel; e < dt->padded_rows * dt->row_numel; e++)
                        if (dt->local[e] != 0.0f) pad_zero = 0;
            }
            EMIT("%s{\"name\":\"%s\",\"module\":\"%s\",\"global_shape\":[%zu%s", first ? "" : ",", p->name,
                 m->modules[i].name, p->shape[0], p->ndim == 2 ? "," : "");
            if (p->ndim == 2) EMIT("%zu", p->shape[1]);
            EMIT("],\"mesh\":[");
            for (int r = 0; dm && r < dm->size && r < WORLD_MAX_RANKS; r++) EMIT("%s%d", r ? "," : "", dm->ranks[r]);
            EMIT("],\"mesh_is_world\":%s,\"placement\":\"%s\",\"local_rows\":%zu,\"padded_rows\":%zu,"
                 "\"row_offset\":%zu,\"row_numel\":%zu,\"global_rows\":%zu,\"has_local\":%s,"
                 "\"local_matches_init\":%s,\"padding_is_zero\":%s}",
                 mesh_ok ? "true" : "false", pl, dt->local_rows, dt->padded_rows, dt->row_offset, dt->row_numel,
                 dt->global_rows, dt->local ? "true" : "false",
                 matches < 0 ? "null" : matches ? "true" : "false", pad_zero < 0 ? "null" : pad_zero ? "true" : "false");
            first = 0;
        }
    EMIT("]}\n");
#undef EMIT
    write_file_atomic(path, buf, len);
    free(buf);
}

/* ------------------------------------------------------------------ the loop */

static void rank_main(Dev *dev, void *arg) {
    Shared *sh = arg;
    const Options *o = sh->opt;
    int rank = dev_rank(dev), W = dev_world_size(dev);
    Stream *cs = dev_compute_stream(dev);
    Model *m = model_create(&o->model);
    size_t B = o->batch_size, T = o->seq_len, N = B * T;

    /* The full model on every rank, as a module materialized before fully_shard. */
    dev_set_scope(dev, -1, "init", "init");
    for (int i = 0; i < m->n_modules; i++)
        for (int j = 0; j < m->modules[i].n_params; j++) {
            Param *p = &m->modules[i].params[j];
            p->data = dev_alloc_f32(dev, p->numel, MEM_PARAM, p->name);
            dev_memcpy_async(cs, p->data, sh->init + model_param_offset(m, p), p->numel * sizeof(float));
        }
    DeviceMesh mesh;
    mesh.size = W;
    for (int r = 0; r < W; r++) mesh.ranks[r] = r;
    FsdpConfig fc = {dev, m, &mesh, o->reshard_after_forward, o->optim};
    dev_set_scope(dev, -1, "fsdp", "init");
    Fsdp *f = fsdp_init(&fc);
    if (o->out_dir) write_dtensors(dev, m, sh->init, o->out_dir, &mesh);
    if (sh->init_exp_avg && !o->forward_only) restore_optimizer_state(dev, m, sh->init_exp_avg, sh->init_exp_avg_sq);

    ModelRun run = {0};
    run.dev = dev;
    run.stream = cs;
    run.B = B;
    run.T = T;
    run.recompute = o->ac;
    dev_set_scope(dev, -1, "init", "init");
    int32_t *inputs = dev_alloc(dev, N * sizeof(int32_t), MEM_ACTIVATION, "inputs");
    int32_t *targets = dev_alloc(dev, N * sizeof(int32_t), MEM_ACTIVATION, "targets");
    run.inputs = inputs;
    run.targets = targets;
    model_run_begin(m, &run);
    int32_t *host_in = xmalloc(N * sizeof(int32_t)), *host_tgt = xmalloc(N * sizeof(int32_t));

    FILE *metrics = NULL;
    if (rank == 0 && o->out_dir) {
        char path[4096];
        snprintf(path, sizeof path, "%s/metrics.jsonl", o->out_dir);
        metrics = fopen(path, "w");
        if (!metrics) fatal("cannot write %s: %s", path, strerror(errno));
    }
    Captured params_seen, grads_seen;
    double *all = xcalloc((size_t)W, sizeof(double));
    int stop_nan = 0;

    for (int s = sh->start_step; s < o->steps && !stop_nan; s++) {
        dev_synchronize(dev);
        dev_set_tracing(dev, s < o->profile_steps);
        dev_mem_reset_peak(dev);
        double t0 = now_us();
        dev_set_scope(dev, s, "data", "data");
        data_batch(sh->data, s, rank, W, B, T, host_in, host_tgt);
        dev_memcpy_async(cs, inputs, host_in, N * sizeof(int32_t));
        dev_memcpy_async(cs, targets, host_tgt, N * sizeof(int32_t));

        /* forward */
        for (int i = 0; i < m->n_modules; i++) {
            Module *mod = &m->modules[i];
            dev_set_scope(dev, s, mod->name, "pre_forward");
            fsdp_pre_forward(f, mod);
            float *ptrs[16];
            for (int j = 0; j < mod->n_params; j++) {
                if (!mod->params[j].data)
                    fatal("%s: %s has no unsharded data after fsdp_pre_forward (Param.data is NULL)", mod->name,
                          mod->params[j].name);
                ptrs[j] = mod->params[j].data;
            }
            capture(dev, &params_seen, ptrs, mod->n_params);
            dev_set_scope(dev, s, mod->name, "forward");
            module_forward(m, mod, &run);
            dev_set_scope(dev, s, mod->name, "post_forward");
            fsdp_post_forward(f, mod);
            hook_note(dev, s, mod, "post_forward", "unsharded_param_live_bytes", still_live_bytes(dev, &params_seen));
        }

        float grad_norm = NAN;
        if (o->forward_only) {
            dev_set_scope(dev, s, "step", "discard");
            model_discard_activations(m, &run);
        } else {
            for (int i = m->n_modules - 1; i >= 0; i--) {
                Module *mod = &m->modules[i];
                dev_set_scope(dev, s, mod->name, "pre_backward");
                fsdp_pre_backward(f, mod);
                if (o->ac && mod->kind == MOD_BLOCK) {
                    dev_set_scope(dev, s, mod->name, "recompute.pre_forward");
                    fsdp_pre_forward(f, mod);
                    dev_set_scope(dev, s, mod->name, "recompute");
                    module_recompute(m, mod, &run);
                    dev_set_scope(dev, s, mod->name, "recompute.post_forward");
                    fsdp_post_forward(f, mod);
                }
                dev_set_scope(dev, s, mod->name, "backward");
                float *ptrs[16], *grads[16];
                for (int j = 0; j < mod->n_params; j++) {
                    Param *p = &mod->params[j];
                    if (!p->data)
                        fatal("%s: %s has no unsharded data for the backward (Param.data is NULL after "
                              "fsdp_pre_backward)", mod->name, p->name);
                    ptrs[j] = p->data;
                    char nm[96];
                    snprintf(nm, sizeof nm, "%s.grad", p->name);
                    p->grad = dev_alloc_f32(dev, p->numel, MEM_UNSHARDED_GRAD, nm);
                    dev_memset_async(cs, p->grad, 0, p->numel * sizeof(float));
                }
                for (int j = 0; j < mod->n_params; j++) grads[j] = mod->params[j].grad;
                capture(dev, &params_seen, ptrs, mod->n_params);
                capture(dev, &grads_seen, grads, mod->n_params);
                module_backward(m, mod, &run);
                dev_set_scope(dev, s, mod->name, "post_backward");
                fsdp_post_backward(f, mod);
                hook_note(dev, s, mod, "post_backward", "unsharded_grad_live_bytes", still_live_bytes(dev, &grads_seen));
                hook_note(dev, s, mod, "post_backward", "unsharded_param_live_bytes", still_live_bytes(dev, &params_seen));
                for (int j = 0; j < mod->n_params; j++) mod->params[j].grad = NULL;
            }
            dev_set_scope(dev, s, "root", "finish_backward");
            fsdp_finish_backward(f);
            dev_set_scope(dev, s, "optimizer", "optimizer");
            grad_norm = fsdp_optimizer_step(f, lr_at_step(&o->optim, s), s + 1);
        }
        dev_synchronize(dev);
        double step_us = now_us() - t0;

        /* logging (host-side exchange: not a collective of the program) */
        float loss_local = 0;
        dev_memcpy_async(dev_compute_stream(dev), &loss_local, run.loss, sizeof loss_local); /* device -> host */
        dev_stream_synchronize(dev_compute_stream(dev));
        dev_host_allgather_f64(dev, (double)loss_local, all);
        double loss = 0;
        for (int r = 0; r < W; r++) loss += all[r];
        loss /= W;
        dev_host_allgather_f64(dev, (double)dev_mem_peak(dev), all);
        double peak_max = 0;
        for (int r = 0; r < W; r++) peak_max = all[r] > peak_max ? all[r] : peak_max;
        double *peaks = xmalloc((size_t)W * sizeof(double));
        memcpy(peaks, all, (size_t)W * sizeof(double));
        dev_host_allgather_f64(dev, step_us, all);
        double step_max = 0;
        for (int r = 0; r < W; r++) step_max = all[r] > step_max ? all[r] : step_max;
        int bad = !isfinite(loss) || (!o->forward_only && !isfinite(grad_norm));
        if (rank == 0) {
            double tps = (double)(N * (size_t)W) / (step_max * 1e-6);
            float lr = lr_at_step(&o->optim, s);
            if (metrics) {
                fprintf(metrics, "{\"step\":%d,", s + 1);
                if (isfinite(loss)) fprintf(metrics, "\"loss\":%.9g,", loss);
                else fprintf(metrics, "\"loss\":null,");
                if (isfinite(grad_norm)) fprintf(metrics, "\"grad_norm\":%.9g,", (double)grad_norm);
                else fprintf(metrics, "\"grad_norm\":null,");
                fprintf(metrics, "\"lr\":%.9g,\"peak_mem_bytes\":%.0f,\"peak_mem_bytes_per_rank\":[", (double)lr, peak_max);
                for (int r = 0; r < W; r++) fprintf(metrics, "%s%.0f", r ? "," : "", peaks[r]);
                fprintf(metrics, "],\"step_ms\":%.3f,\"tokens_per_s\":%.1f%s}\n", step_max / 1000.0, tps,
                        bad ? ",\"nan\":true" : "");
                fflush(metrics);
            }
            if (!o->quiet)
                printf("step: %3d  loss: %8.4f  grad_norm: %8.4f  memory: %7.2fMiB  tps: %9.0f  lr: %.2e\n", s + 1,
                       loss, (double)grad_norm, peak_max / 1048576.0, tps, (double)lr);
            fflush(stdout);
        }
        free(peaks);
        if (o->save_every && (s + 1) % o->save_every == 0 && !bad) write_checkpoint(dev, m, o->save_path, s + 1);
        if (bad) {
            if (rank == 0)
                fprintf(stderr, "error: %s is not finite at step %d (loss %g, grad_norm %g)\n",
                        isfinite(loss) ? "grad_norm" : "loss", s + 1, loss, (double)grad_norm);
            stop_nan = 1;
            if (rank == 0) sh->exit_code = EXIT_NAN;
        }
    }
    if (metrics) fclose(metrics);

    dev_set_scope(dev, o->steps, "end", "end");
    if (o->save_path && !stop_nan) write_checkpoint(dev, m, o->save_path, o->steps > sh->start_step ? o->steps : sh->start_step);
    model_run_end(m, &run);
    dev_free(dev, inputs);
    dev_free(dev, targets);
    dev_synchronize(dev);
    if (o->out_dir) dev_write_artifacts(dev, o->out_dir);
    fsdp_destroy(f);
    free(host_in);
    free(host_tgt);
    free(all);
    model_destroy(m);
}

static void write_run_json(const Options *o, const Model *m) {
    char path[4096];
    snprintf(path, sizeof path, "%s/run.json", o->out_dir);
    char host[256] = "unknown";
    gethostname(host, sizeof host - 1);
    char buf[4096];
    const ModelConfig *c = &m->cfg;
    int n = snprintf(buf, sizeof buf,
                     "{\"flavor\":\"%s\",\"dim\":%d,\"n_layers\":%d,\"n_heads\":%d,\"n_kv_heads\":%d,"
                     "\"vocab_size\":%d,\"hidden_dim\":%d,\"multiple_of\":%d,\"n_params\":%zu,"
                     "\"seq_len\":%zu,\"batch_size\":%zu,\"steps\":%d,\"world_size\":%d,\"backend\":\"%s\","
                     "\"device\":\"%s\",\"lr\":%g,\"warmup_steps\":%d,\"weight_decay\":%g,\"max_norm\":%g,"
                     "\"seed\":%llu,\"data\":\"%s\",\"ac\":%s,\"reshard_after_forward\":%s,\"forward_only\":%s,"
                     "\"link_gbps\":%g,\"link_latency_us\":%g,\"profile_steps\":%d,\"host\":\"%s\"}\n",
                     o->flavor, c->dim, c->n_layers, c->n_heads, c->n_kv_heads, c->vocab_size, c->hidden_dim,
                     c->multiple_of, m->n_params_total, o->seq_len, o->batch_size, o->steps, o->world.world_size,
                     backend_name(o->world.backend), dev_is_cuda_build() ? "cuda" : "cpu", (double)o->optim.lr, o->optim.warmup_steps,
                     (double)o->optim.weight_decay, (double)o->optim.max_norm, (unsigned long long)o->seed,
                     o->data_path, o->ac ? "true" : "false", o->reshard_after_forward ? "true" : "false",
                     o->forward_only ? "true" : "false", o->world.link_gbps, o->world.link_latency_us,
                     o->profile_steps, host);
    write_file_atomic(path, buf, (size_t)n);
}

int main(int argc, char **argv) {
    Options o;
    parse_args(argc, argv, &o);
    Model *m = model_create(&o.model);
    float *init = xmalloc(m->n_params_total * sizeof(float)), *exp_avg = NULL, *exp_avg_sq = NULL;
    int start_step = 0;
    if (o.load_path) start_step = load_checkpoint(m, o.load_path, init, &exp_avg, &exp_avg_sq);
    else model_init_host(m, o.seed, init);
    if (o.save_init_path) {
        save_checkpoint(m, o.save_init_path, init, NULL, NULL, 0);
        printf("wrote initial weights (%zu parameters) to %s\n", m->n_params_total, o.save_init_path);
        free(init);
        model_destroy(m);
        return 0;
    }
    TokenData data = data_load(o.data_path);
    data_check(&data, o.seq_len, o.model.vocab_size);
    World *w = world_create(&o.world);
    if (o.out_dir) {
        make_dirs(o.out_dir);
        if (world_first_local_rank(w) == 0) write_run_json(&o, m);
    }
    if (start_step > 0 && !o.quiet)
        printf("resuming from %s at step %d (optimizer state restored)\n", o.load_path, start_step);
    Shared sh = {&o, init, exp_avg, exp_avg_sq, start_step, &data, 0};
    world_run(w, rank_main, &sh);
    world_destroy(w);
    data_free(&data);
    free(init);
    free(exp_avg);
    free(exp_avg_sq);
    model_destroy(m);
    return sh.exit_code;
}
