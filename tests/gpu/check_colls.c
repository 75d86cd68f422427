/* check_colls.c — `make gpu-check`, the collectives: every collective the
 * runtime offers (device.h), run through the public API on a world of ranks,
 * each result checked against a float64 reference formed on the host from the
 * known inputs and, with --ref, against another run's result bits.
 *
 *   check_colls [--backend local|mpi|nccl|nccl-mpi] [--world N] [--ref FILE] [--out FILE]
 *
 * Built twice from this file: against the CPU runtime (build/tests/check_colls,
 * part of `make`) and against the CUDA runtime (build-cuda/tests/check_colls,
 * `make cuda`). The GPU check: run the CPU build, keep its output, run the CUDA
 * build with --ref on it (tools/gpu_check.sh):
 *   build/tests/check_colls --world 4 --out cpu.txt
 *   build-cuda/tests/check_colls --world 4 --ref cpu.txt --out gpu.txt                 (4 ranks on one GPU)
 *   build-cuda/tests/check_colls --backend nccl --world 4 --ref cpu.txt --out nccl.txt  (one GPU per rank)
 *   mpirun -np 4 build/tests/check_colls --backend mpi --ref cpu.txt --out mpi.txt      (CPU, multi-process)
 * --world defaults to mpirun's -np under mpi / nccl-mpi, else 4. The case
 * lines go to stdout, or with --out to FILE (rank by rank: under mpirun the
 * processes' stdout interleaves, so use --out there); --ref reads either.
 *
 * The cases: all_gather, reduce_scatter (sum, avg), all_reduce (sum, avg),
 * broadcast (root 0 and the last rank) and barrier; float32 and bfloat16
 * where the API takes either (all-gather, reduce-scatter); in place and out of
 * place where the API allows both; counts 1, 7, 1001 and a few MB of buffer;
 * on the world group and on groups made by dev_mesh_build (a 2 x W/2 mesh's
 * shard and replicate groups, W even >= 4) and dev_group_new (ranks of equal
 * parity). Inputs are a function of (world rank, element index, case number):
 * +-(1 + m/2^23) * 2^e with 23 random mantissa bits and e in [-4, 10], so most
 * float32 sums of two ranks round and another reduction order shows in the
 * bits (the float64 sums stay exact: 24 bits over 15 binades). bfloat16
 * inputs (8 bits) add exactly in float32: there the order shows only where a
 * backend rounds to bfloat16 before the end (NCCL, per hop). An out-of-place output starts as NaN (an element not written fails),
 * an out-of-place input must come back unchanged, a broadcast's non-roots
 * start with their own data.
 *
 * Output, one line per case and rank (the first 8 fields are what --ref reads):
 *   coll <name> <dtype> <place> <group> n<count> rank<r> <fnv64 of the result bytes>
 *        max_rel_err E bound B [ref bitwise|ref differs|ref missing] [send-modified] OK|FAIL
 * then, on stdout, "N collectives passed, M failed" (every rank's cases), exit
 * status 1 on any failure.
 *
 * The error. Copies (all_gather, broadcast): E = max|got - ref| / max|ref|,
 * and the bits must equal the input's. Reductions: per element
 * e_i = |got_i - ref_i| / S_i, S_i = sum over ranks |x_r,i| (divided by n for
 * avg), E = max e_i: the classic bound for a sum in any order,
 * |got - ref| / |ref| <= (n-1) u * sum|x| / |sum x|, multiplied through by
 * |sum x| (so it stays finite where the sum cancels to 0).
 *
 * The bounds (bound_of below), n = the group's size, u = 2^-24 (float32) or
 * 2^-8 (bfloat16, 8 significant bits):
 *   op                    float32      bfloat16     why
 *   all_gather            0            0            a copy of every rank's block
 *   broadcast             0            -            a copy of the root's buffer
 *   barrier               -            -            moves no data: it must return (hash of no bytes)
 *   reduce_scatter sum    (n+1) u      (n+1) u      n-1 float adds, each off by <= u * (partial sum) <= u * S_i,
 *   reduce_scatter avg    (n+1) u      (n+1) u      in any order (rank order on local/mpi, NCCL's ring or tree);
 *   all_reduce sum/avg    (n+1) u      -            + 1 u for avg's division (CPU/local) or NCCL's premultiply by
 *                                                   1/n, + 1 u for 1/n's own rounding (NCCL). bfloat16: the
 *                                                   CPU backends add in float32 and round once (<= 2^-8 |sum|);
 *                                                   NCCL rounds to bfloat16 at every hop: n-1 roundings + the last
 * ((n+1) u exactly: gamma_{n+1} = (n+1) u / (1 - (n+1) u), Higham's bound with
 * its second-order terms; at world 4: 2.98e-7 for float32, 1.95e-2 for bfloat16.
 * The CPU backend's largest at world 4 is ~1.7e-7 (float32 avg), ~3.9e-3 (bfloat16).)
 * Backends that claim bitwise results (local, CPU or CUDA; mpi: sums in rank
 * order) must in addition give the --ref run's bits in every case; on nccl
 * and nccl-mpi only the copies must (NCCL reduces in its own order: "ref
 * differs" is then said, not failed). A case missing from the ref fails (the
 * ref was made at another world size, or a case went missing). */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/bf16.h" /* bf16_from_f32 / bf16_to_f32: the runtime's own rounding, on the host */
#include "runtime/runtime.h"
#include "runtime/util.h"

typedef enum { OP_ALL_GATHER, OP_REDUCE_SCATTER, OP_ALL_REDUCE, OP_BROADCAST, OP_BARRIER } OpKind;

/* The ref file's cases: key (fields 2..7 of a line) -> hash. */
typedef struct {
    char *key;
    uint64_t hash;
} RefEntry;

typedef struct {
    CollBackend backend;
    int world;
    int bitwise;             /* the backend claims the CPU backend's bits for reductions too */
    const char *ref_path;    /* NULL: no --ref */
    const char *out_path;    /* --out: the case lines go there (NULL: stdout) */
    RefEntry *ref;
    size_t nref;
    int passed[WORLD_MAX_RANKS], failed[WORLD_MAX_RANKS]; /* per world rank (each rank thread its own slot) */
    int total_passed[WORLD_MAX_RANKS], total_failed[WORLD_MAX_RANKS]; /* every rank's cases, as rank r counted them */
} Ctx;

/* A group the cases run on, with its members worked out here from how the
 * runtime documents it builds them (device.h, runtime.h), not read from it. */
typedef struct {
    ProcessGroup *pg;
    int members[WORLD_MAX_RANKS]; /* world ranks, in group-rank order */
    int n, me;
} Group;

typedef struct {
    OpKind kind;
    RedOp op;
    int root;    /* broadcast: a group rank */
    DType dtype;
    int inplace;
    const Group *g;
    size_t count; /* all_gather: send count; reduce_scatter: recv count; else the buffer's */
    int id;       /* the case's number: the same on every rank */
} Case;

/* A rank's output, printed in rank order at the end. */
typedef struct {
    char *text;
    size_t len, cap;
} Out;

static void out_printf(Out *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void out_printf(Out *o, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char *s = xvasprintf(fmt, ap);
    va_end(ap);
    size_t n = strlen(s);
    o->text = xgrow(o->text, &o->cap, o->len + n + 1, 1 << 16);
    memcpy(o->text + o->len, s, n + 1);
    o->len += n;
    free(s);
}

/* ------------------------------------------------------------------ inputs */

static uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* The stream of world rank r's inputs in case id. */
static uint64_t input_seed(int id, int r) { return splitmix64(splitmix64((uint64_t)id) ^ (uint64_t)r); }

/* Element i of a rank's input (seed: input_seed): +-(1 + m/2^23) * 2^e, 23 random mantissa bits, e in [-4, 10],
 * built from its bits (exact). */
static float input_f32(uint64_t seed, size_t i) {
    uint64_t h = splitmix64(seed ^ (uint64_t)i);
    uint32_t bits = (uint32_t)(h & 1) << 31 | (uint32_t)(127 - 4 + (int)((h >> 8) % 15)) << 23 | (uint32_t)(h >> 41);
    return f32_from_bits(bits);
}

/* The input as the case's dtype sees it (bfloat16: rounded by the runtime's rule), widened. */
static double input(DType t, uint64_t seed, size_t i) {
    float v = input_f32(seed, i);
    return t == DTYPE_BF16 ? (double)bf16_to_f32(bf16_from_f32(v)) : (double)v;
}

static size_t esize(DType t) { return t == DTYPE_BF16 ? sizeof(Bf16) : sizeof(float); }

/* Element i of buffer p (of type t) set from / read as a double. */
static void put(void *p, DType t, size_t i, double v) {
    if (t == DTYPE_BF16) ((Bf16 *)p)[i] = bf16_from_f32((float)v);
    else ((float *)p)[i] = (float)v;
}
static double get(const void *p, DType t, size_t i) {
    return t == DTYPE_BF16 ? (double)bf16_to_f32(((const Bf16 *)p)[i]) : (double)((const float *)p)[i];
}

static void fill_input(void *p, const Case *c, int r, size_t n) {
    uint64_t seed = input_seed(c->id, r);
    for (size_t i = 0; i < n; i++) put(p, c->dtype, i, input(c->dtype, seed, i));
}
static void fill_nan(void *p, DType t, size_t n) {
    for (size_t i = 0; i < n; i++) put(p, t, i, NAN);
}

/* 64-bit FNV-1a of the result bytes. */
static uint64_t fnv64(const void *p, size_t bytes) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < bytes; i++) h = (h ^ ((const unsigned char *)p)[i]) * 0x100000001b3ull;
    return h;
}

/* ------------------------------------------------------------------ bounds */

static const char *op_name(const Case *c, char *buf, size_t cap) {
    switch (c->kind) {
    case OP_ALL_GATHER: return "all_gather";
    case OP_REDUCE_SCATTER: return c->op == RED_AVG ? "reduce_scatter_avg" : "reduce_scatter_sum";
    case OP_ALL_REDUCE: return c->op == RED_AVG ? "all_reduce_avg" : "all_reduce_sum";
    case OP_BROADCAST: snprintf(buf, cap, "broadcast_root%d", c->root); return buf;
    case OP_BARRIER: return "barrier";
    }
    return "?";
}

static int is_copy(OpKind k) { return k == OP_ALL_GATHER || k == OP_BROADCAST || k == OP_BARRIER; }

/* The table in the header comment: copies exact; a reduction over n ranks
 * gamma_{n+1} = (n+1) u / (1 - (n+1) u) of its dtype, relative to sum|x|. */
static double bound_of(const Case *c) {
    if (is_copy(c->kind)) return 0;
    double nu = (c->g->n + 1) * (c->dtype == DTYPE_BF16 ? 0x1p-8 : 0x1p-24);
    return nu / (1 - nu); /* Higham's gamma_{n+1}: (n+1) u and the second-order terms of the partial sums' errors */
}

/* --------------------------------------------------------------- the ref */

static int ref_cmp(const void *a, const void *b) {
    return strcmp(((const RefEntry *)a)->key, ((const RefEntry *)b)->key);
}

/* Every "coll" line of a previous run's output: fields 2..7 the key, field 8 the hash. */
static void ref_load(Ctx *x) {
    size_t bytes;
    char *text = read_file_all(x->ref_path, &bytes); /* fatal if it cannot */
    size_t cap = 0;
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        if (strncmp(line, "coll ", 5)) continue;
        char f[7][64];
        char hash[32];
        if (sscanf(line, "coll %63s %63s %63s %63s %63s %63s %31s", f[0], f[1], f[2], f[3], f[4], f[5], hash) != 7)
            fatal("check_colls: --ref %s: cannot read the line '%s'", x->ref_path, line);
        char *end;
        uint64_t h = strtoull(hash, &end, 16);
        if (*end || strlen(hash) != 16) fatal("check_colls: --ref %s: '%s' is not a 64-bit hash", x->ref_path, hash);
        x->ref = xgrow(x->ref, &cap, (x->nref + 1) * sizeof *x->ref, 1024 * sizeof *x->ref);
        x->ref[x->nref++] = (RefEntry){xasprintf("%s %s %s %s %s %s", f[0], f[1], f[2], f[3], f[4], f[5]), h};
    }
    free(text);
    if (!x->nref) fatal("check_colls: --ref %s holds no 'coll' line (a check_colls output?)", x->ref_path);
    qsort(x->ref, x->nref, sizeof *x->ref, ref_cmp);
}

static const RefEntry *ref_find(const Ctx *x, const char *key) {
    RefEntry k = {(char *)key, 0};
    return bsearch(&k, x->ref, x->nref, sizeof *x->ref, ref_cmp);
}

/* ------------------------------------------------------------- one case */

typedef struct {
    Ctx *x;
    Dev *d;
    Stream *s;
    Out out;
} Rank;

/* Run c on this rank, check it, print its line. */
static void run_case(Rank *rk, const Case *c) {
    Dev *d = rk->d;
    Stream *s = rk->s;
    const Group *g = c->g;
    const int n = g->n, me = g->me, wr = dev_rank(d);
    const DType t = c->dtype;
    const size_t es = esize(t), cnt = c->count;
    char nbuf[32];
    const char *name = op_name(c, nbuf, sizeof nbuf);

    /* the buffers' sizes (elements); the result is recv (nres elements) */
    size_t nsend = 0, nrecv = 0, nres = 0;
    switch (c->kind) {
    case OP_ALL_GATHER: nsend = cnt, nrecv = cnt * (size_t)n, nres = nrecv; break;
    case OP_REDUCE_SCATTER: nsend = cnt * (size_t)n, nrecv = cnt, nres = cnt; break;
    case OP_ALL_REDUCE: nsend = cnt, nrecv = cnt, nres = cnt; break;
    case OP_BROADCAST: nrecv = cnt, nres = cnt; break; /* one buffer, in place */
    case OP_BARRIER: break;
    }

    /* host images; in place, one device buffer holds both, send at its documented place in recv */
    void *hsend = NULL, *hrecv = NULL, *hres = xmalloc(nres * es + 1), *hback = NULL;
    void *dsend = NULL, *drecv = NULL, *dbuf = NULL; /* dbuf: the in-place buffer */
    if (c->kind == OP_BROADCAST) {
        hrecv = xmalloc(nrecv * es);
        fill_input(hrecv, c, wr, nrecv); /* non-roots start with their own data: it must be overwritten */
        drecv = dbuf = dev_alloc(d, nrecv * es, MEM_COMM_BUFFER, "buf");
        dev_memcpy_async(s, dbuf, hrecv, nrecv * es);
    } else if (c->kind != OP_BARRIER) {
        hsend = xmalloc(nsend * es);
        fill_input(hsend, c, wr, nsend);
        if (c->inplace) {
            /* all_gather: send is my block of recv; reduce_scatter: recv is my block of send; all_reduce: one */
            size_t whole = c->kind == OP_ALL_GATHER ? nrecv : nsend;
            size_t at = c->kind == OP_ALL_GATHER ? (size_t)me * cnt : 0;
            hrecv = xmalloc(whole * es);
            fill_nan(hrecv, t, whole);
            memcpy((char *)hrecv + at * es, hsend, nsend * es);
            dbuf = dev_alloc(d, whole * es, MEM_COMM_BUFFER, "inplace");
            dev_memcpy_async(s, dbuf, hrecv, whole * es);
            dsend = (char *)dbuf + at * es;
            drecv = c->kind == OP_REDUCE_SCATTER ? (char *)dbuf + (size_t)me * cnt * es : dbuf;
        } else {
            hrecv = xmalloc(nrecv * es);
            fill_nan(hrecv, t, nrecv);
            dsend = dev_alloc(d, nsend * es, MEM_COMM_BUFFER, "send");
            drecv = dev_alloc(d, nrecv * es, MEM_COMM_BUFFER, "recv");
            dev_memcpy_async(s, dsend, hsend, nsend * es);
            dev_memcpy_async(s, drecv, hrecv, nrecv * es);
        }
    }

    ProcessGroup *pg = g->pg;
    switch (c->kind) {
    case OP_ALL_GATHER:
        if (t == DTYPE_BF16) pg_all_gather_bf16(pg, dsend, drecv, cnt, s, name);
        else pg_all_gather(pg, dsend, drecv, cnt, s, name);
        break;
    case OP_REDUCE_SCATTER:
        if (t == DTYPE_BF16) pg_reduce_scatter_bf16(pg, dsend, drecv, cnt, c->op, s, name);
        else pg_reduce_scatter(pg, dsend, drecv, cnt, c->op, s, name);
        break;
    case OP_ALL_REDUCE: pg_all_reduce(pg, dsend, drecv, cnt, c->op, s, name); break;
    case OP_BROADCAST: coll_broadcast(d, drecv, cnt, c->root, s, name); break; /* the world's only */
    case OP_BARRIER: coll_barrier(d, s, name); break;                          /* the world's only */
    }
    if (nres) dev_memcpy_async(s, hres, drecv, nres * es);
    int check_send = !c->inplace && (c->kind == OP_ALL_GATHER || c->kind == OP_REDUCE_SCATTER ||
                                     c->kind == OP_ALL_REDUCE);
    if (check_send) {
        hback = xmalloc(nsend * es);
        dev_memcpy_async(s, hback, dsend, nsend * es);
    }
    dev_stream_synchronize(s);
    if (dbuf) dev_free(d, dbuf);
    else {
        dev_free(d, dsend);
        dev_free(d, drecv);
    }

    /* the float64 reference, element by element, from every member's inputs */
    double worst = 0, scale = 0;
    int exact = 1;
    uint64_t seeds[WORLD_MAX_RANKS]; /* the group's members' inputs */
    for (int q = 0; q < n; q++) seeds[q] = input_seed(c->id, g->members[q]);
    for (size_t i = 0; i < nres; i++) {
        double got = get(hres, t, i);
        if (c->kind == OP_ALL_GATHER || c->kind == OP_BROADCAST) {
            double ref = c->kind == OP_ALL_GATHER ? input(t, seeds[i / cnt], i % cnt) : input(t, seeds[c->root], i);
            if (t == DTYPE_BF16) exact &= ((const Bf16 *)hres)[i] == bf16_from_f32((float)ref);
            else exact &= f32_bits(((const float *)hres)[i]) == f32_bits((float)ref);
            double e = fabs(got - ref);
            if (!(e <= worst)) worst = e; /* NaN stays NaN: fails */
            if (fabs(ref) > scale) scale = fabs(ref);
        } else {
            size_t at = c->kind == OP_REDUCE_SCATTER ? (size_t)me * cnt + i : i;
            double sum = 0, abs_sum = 0;
            for (int q = 0; q < n; q++) {
                double v = input(t, seeds[q], at);
                sum += v; /* exact: 24-bit mantissas over 15 binades and <= 64 terms fit in 53 bits */
                abs_sum += fabs(v);
            }
            if (c->op == RED_AVG) sum /= n, abs_sum /= n;
            double e = abs_sum > 0 ? fabs(got - sum) / abs_sum : (got == sum ? 0 : INFINITY);
            if (!(e <= worst)) worst = e;
        }
    }
    if (is_copy(c->kind)) worst = worst / (scale > 0 ? scale : 1);
    double bound = bound_of(c);
    int ok = worst <= bound && exact;
    int send_modified = check_send && memcmp(hback, hsend, nsend * es) != 0;
    ok &= !send_modified;

    uint64_t hash = fnv64(hres, nres * es);
    char key[160];
    snprintf(key, sizeof key, "%s %s %s %s n%zu rank%d", name,
             c->kind == OP_BARRIER ? "-" : t == DTYPE_BF16 ? "bf16" : "f32",
             c->kind == OP_BARRIER ? "-" : c->inplace ? "inplace" : "outofplace", pg_name(pg), cnt, wr);
    const char *ref_word = "";
    if (rk->x->ref_path) {
        const RefEntry *e = ref_find(rk->x, key);
        if (!e) ref_word = " ref missing", ok = 0;
        else if (e->hash == hash) ref_word = " ref bitwise";
        else {
            ref_word = " ref differs";
            if (rk->x->bitwise || is_copy(c->kind)) ok = 0;
        }
    }
    out_printf(&rk->out, "coll %s %016llx max_rel_err %.2e bound %.2e%s%s %s\n", key, (unsigned long long)hash,
               worst, bound, ref_word, send_modified ? " send-modified" : "", ok ? "OK" : "FAIL");
    if (ok) rk->x->passed[wr]++;
    else rk->x->failed[wr]++;
    free(hsend), free(hrecv), free(hres), free(hback);
}

/* ---------------------------------------------------------------- groups */

/* A group made by the runtime, checked against the members expected here. */
static void group_set(Group *g, ProcessGroup *pg, int rank, int world, int (*color)(int r, int world)) {
    g->pg = pg;
    g->n = 0;
    for (int r = 0; r < world; r++)
        if (color(r, world) == color(rank, world)) {
            if (r == rank) g->me = g->n;
            g->members[g->n++] = r;
        }
    if (pg_size(pg) != g->n || pg_rank(pg) != g->me)
        fatal("check_colls: rank %d: group %s has size %d and rank %d, expected %d and %d", rank, pg_name(pg),
              pg_size(pg), pg_rank(pg), g->n, g->me);
}
static int color_world(int r, int world) { return (void)r, (void)world, 0; }
static int color_row(int r, int world) { return r / (world / 2); }    /* the 2 x W/2 mesh's shard groups */
static int color_column(int r, int world) { return r % (world / 2); } /* its replicate groups */
static int color_parity(int r, int world) { return (void)world, r % 2; }

/* ---------------------------------------------------------------- a rank */

static void rank_main(Dev *d, void *arg) {
    Ctx *x = arg;
    const int w = dev_world_size(d), me = dev_rank(d);
    Rank rk = {x, d, NULL, {0}};

    /* the groups first (every rank, same order), then the stream that carries every case */
    Group groups[4];
    int ng = 0;
    group_set(&groups[ng++], dev_world_group(d), me, w, color_world);
    if (w >= 4 && w % 2 == 0) {
        DeviceMesh mesh;
        dev_mesh_build(d, &mesh, 2, w / 2);
        group_set(&groups[ng++], mesh.shard_group, me, w, color_row);
        group_set(&groups[ng++], mesh.replicate_group, me, w, color_column);
    }
    if (w >= 2) {
        char name[24];
        snprintf(name, sizeof name, "parity%d", me % 2);
        group_set(&groups[ng++], dev_group_new(d, me % 2, name), me, w, color_parity);
    }
    rk.s = dev_stream_create(d, "colls");

    int id = 0;
    for (int gi = 0; gi < ng; gi++) {
        const Group *g = &groups[gi];
        /* 1, odd, and a few MB: 262147 floats = 1 MB a block, 4 MB of all-gather output at world 4 */
        const size_t counts[] = {1, 7, 1001, gi == 0 ? 262147 : 65537};
        for (size_t k = 0; k < sizeof counts / sizeof counts[0]; k++) {
            for (int dt = 0; dt < 2; dt++) {
                DType t = dt ? DTYPE_BF16 : DTYPE_F32;
                for (int inplace = 0; inplace < 2; inplace++) {
                    run_case(&rk, &(Case){OP_ALL_GATHER, RED_SUM, 0, t, inplace, g, counts[k], id++});
                    for (int op = RED_SUM; op <= RED_AVG; op++) {
                        run_case(&rk, &(Case){OP_REDUCE_SCATTER, (RedOp)op, 0, t, inplace, g, counts[k], id++});
                        if (t == DTYPE_F32) /* all_reduce takes float32 only */
                            run_case(&rk, &(Case){OP_ALL_REDUCE, (RedOp)op, 0, t, inplace, g, counts[k], id++});
                    }
                }
            }
            if (gi == 0) /* broadcast: the world's, from the first and the last rank */
                for (int root = 0; root < w; root += (w > 1 ? w - 1 : 1))
                    run_case(&rk, &(Case){OP_BROADCAST, RED_SUM, root, DTYPE_F32, 1, g, counts[k], id++});
        }
    }
    run_case(&rk, &(Case){OP_BARRIER, RED_SUM, 0, DTYPE_F32, 1, &groups[0], 0, id++});

    /* print rank by rank (--out: rank 0 starts the file, the others append in turn, so processes under
     * mpirun cannot interleave), then every rank's totals (host exchange: any backend) */
    for (int r = 0; r < w; r++) {
        if (r == me) {
            FILE *f = x->out_path ? fopen(x->out_path, r == 0 ? "w" : "a") : stdout;
            if (!f) fatal("check_colls: cannot write --out %s", x->out_path);
            if (rk.out.len) fputs(rk.out.text, f);
            if (f == stdout) fflush(f);
            else if (fclose(f)) fatal("check_colls: cannot write --out %s", x->out_path);
        }
        dev_host_barrier(d);
    }
    double passed[WORLD_MAX_RANKS], failed[WORLD_MAX_RANKS];
    dev_host_allgather_f64(d, x->passed[me], passed);
    dev_host_allgather_f64(d, x->failed[me], failed);
    for (int r = 0; r < w; r++) x->total_passed[me] += (int)passed[r], x->total_failed[me] += (int)failed[r];
    free(rk.out.text);
}

int main(int argc, char **argv) {
    static Ctx x; /* zeroed; big enough to keep off the stack */
    const char *usage = "usage: check_colls [--backend local|mpi|nccl|nccl-mpi] [--world N] [--ref FILE] [--out FILE]";
    int backend = -1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--backend") && i + 1 < argc) {
            const char *b = argv[++i];
            for (int k = BACKEND_LOCAL; k <= BACKEND_NCCL_MPI; k++)
                if (!strcmp(b, backend_name((CollBackend)k))) backend = k;
            if (backend < 0) fatal("%s (unknown backend '%s')", usage, b);
        } else if (!strcmp(argv[i], "--world") && i + 1 < argc) {
            char *end;
            long v = strtol(argv[++i], &end, 10);
            if (*end || v < 1 || v > WORLD_MAX_RANKS)
                fatal("--world must be in [1, %d], got %s", WORLD_MAX_RANKS, argv[i]);
            x.world = (int)v;
        } else if (!strcmp(argv[i], "--ref") && i + 1 < argc) x.ref_path = argv[++i];
        else if (!strcmp(argv[i], "--out") && i + 1 < argc) x.out_path = argv[++i];
        else fatal("%s (unknown argument '%s')", usage, argv[i]);
    }
    x.backend = backend < 0 ? BACKEND_LOCAL : (CollBackend)backend;
    int multiprocess = x.backend == BACKEND_MPI || x.backend == BACKEND_NCCL_MPI;
    if (!x.world) { /* mpirun's -np under the multi-process backends (world_create checks it) */
        const char *np = getenv("OMPI_COMM_WORLD_SIZE");
        x.world = multiprocess && np ? atoi(np) : multiprocess ? 1 : 4;
    }
    /* local and mpi add in rank order (CPU, and the CUDA build's local); NCCL in its own */
    x.bitwise = x.backend == BACKEND_LOCAL || x.backend == BACKEND_MPI;
    if (x.ref_path) ref_load(&x);

    WorldConfig cfg = {0};
    cfg.world_size = x.world;
    cfg.backend = x.backend;
    cfg.blas_threads = 1;
    cfg.poison = 1;
    cfg.collective_timeout_s = 120; /* a collective that never completes stops the run with a flight recorder */
    World *w = world_create(&cfg);
    int first = world_first_local_rank(w);
    if (first == 0)
        printf("check_colls: %s backend (%s build), world %d: every collective vs a float64 reference%s\n",
               backend_name(x.backend), dev_is_cuda_build() ? "CUDA" : "CPU", x.world,
               x.ref_path ? (x.bitwise ? ", and bitwise vs --ref" : ", copies bitwise vs --ref") : "");
    fflush(stdout);
    world_run(w, rank_main, &x);
    world_destroy(w);
    for (size_t i = 0; i < x.nref; i++) free(x.ref[i].key);
    free(x.ref);
    if (first == 0) {
        int failed = x.total_failed[0];
        if (x.out_path && failed) printf("failed cases: grep FAIL %s\n", x.out_path);
        printf("%d collectives passed, %d failed\n", x.total_passed[0], failed);
    }
    return x.total_failed[first] ? 1 : 0;
}
