/* test_flat.c — the driver's reading of flat parameters (device.h,
 * PLACEMENT_FLAT; stage 13), on layouts built here by hand (no student file):
 *   - the piece formula: every element of a unit's flat buffer held by exactly
 *     one rank at its place, empty pieces at 0 or numel, a world that does not
 *     divide the flat size;
 *   - the params check (probes.c) passes Param.data views at flat_offset of the
 *     unsharded flat buffer and stops a run whose view holds other elements;
 *   - the DTensors dump's flat fields and the unit's padding;
 *   - --save of a flat layout writes the same checkpoint as the per-param
 *     (Shard(0)) layout, and --load's restore gives one zeroed [S] state
 *     allocation per unit with per-param views, which saves the same again.
 *
 *   ./test_flat                  every unit test (a fatal line checked in a child process)
 *   ./test_flat NAME             one test
 *   ./test_flat --mode KIND      run one scenario in this process
 *
 * Links the driver's probes.o and checkpoint.o (the Makefile). */
#include "check.h"
#include "local_world.h"
#include "runtime/runtime.h"
#include "runtime/util.h"

#include "driver/checkpoint.h"
#include "driver/flat.h"
#include "driver/probes.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

/* ------------------------------------------------------ the piece formula */

/* Every element e of every param lies on rank (fo + e) / S at (fo + e) % S of its shard, in exactly one piece;
 * the pieces of a rank do not overlap; an empty piece sits at 0 (param after the rank's elements) or numel. */
static void check_layout(const size_t *numel, const size_t *fo, int n, size_t S, int W) {
    for (int k = 0; k < n; k++) {
        size_t held = 0;
        for (int r = 0; r < W; r++) {
            FlatPiece q = flat_piece(numel[k], fo[k], S, (size_t)r);
            CHECK(q.start + q.count <= numel[k] && q.at + q.count <= S, "param %d rank %d: [%zu, +%zu) at %zu", k, r,
                  q.start, q.count, q.at);
            if (!q.count) {
                int after = fo[k] >= (size_t)(r + 1) * S, before = fo[k] + numel[k] <= (size_t)r * S;
                CHECK((after && q.start == 0 && q.at == S) || (before && q.start == numel[k] && q.at == 0),
                      "param %d rank %d: empty piece at %zu (at %zu)", k, r, q.start, q.at);
                continue;
            }
            for (size_t e = q.start; e < q.start + q.count; e++) {
                size_t g = fo[k] + e;
                CHECK(g / S == (size_t)r && g % S == q.at + (e - q.start), "param %d element %zu: rank %d at %zu", k,
                      e, r, q.at + (e - q.start));
            }
            held += q.count;
            for (int k2 = 0; k2 < k; k2++) { /* disjoint from the earlier params' pieces on this rank */
                FlatPiece o = flat_piece(numel[k2], fo[k2], S, (size_t)r);
                CHECK(!o.count || o.at + o.count <= q.at || q.at + q.count <= o.at, "params %d and %d overlap on rank %d",
                      k2, k, r);
            }
        }
        CHECK(held == numel[k], "param %d: %zu of %zu elements held", k, held, numel[k]);
    }
}

TEST(piece_formula_examples) {
    /* 15 elements at 0, 3 at 16 (a gap of one), 10 at 20: 30; world 4: S = 8 (tail padding 2) */
    FlatPiece q = flat_piece(15, 0, 8, 1);
    CHECK(q.start == 8 && q.count == 7 && q.at == 0, "p0 on rank 1: [%zu, +%zu) at %zu", q.start, q.count, q.at);
    q = flat_piece(3, 16, 8, 1); /* after rank 1's elements [8, 16): empty at 0, placed at S */
    CHECK(q.start == 0 && q.count == 0 && q.at == 8, "p1 on rank 1: [%zu, +%zu) at %zu", q.start, q.count, q.at);
    q = flat_piece(3, 16, 8, 2);
    CHECK(q.start == 0 && q.count == 3 && q.at == 0, "p1 on rank 2: [%zu, +%zu) at %zu", q.start, q.count, q.at);
    q = flat_piece(10, 20, 8, 2); /* the head of output.weight */
    CHECK(q.start == 0 && q.count == 4 && q.at == 4, "p2 on rank 2: [%zu, +%zu) at %zu", q.start, q.count, q.at);
    q = flat_piece(10, 20, 8, 3); /* its tail, then 2 padding elements */
    CHECK(q.start == 4 && q.count == 6 && q.at == 0, "p2 on rank 3: [%zu, +%zu) at %zu", q.start, q.count, q.at);
    q = flat_piece(15, 0, 8, 3); /* before rank 3's elements: empty at numel, placed at 0 */
    CHECK(q.start == 15 && q.count == 0 && q.at == 0, "p0 on rank 3: [%zu, +%zu) at %zu", q.start, q.count, q.at);
    q = flat_piece(10, 20, 3, 9); /* world 10, S = 3: rank 9 holds [27, 30) */
    CHECK(q.start == 7 && q.count == 3 && q.at == 0, "p2 on rank 9 of 10: [%zu, +%zu) at %zu", q.start, q.count, q.at);
}

TEST(piece_formula_covers_every_layout) {
    const size_t sizes[][4] = {{15, 3, 10, 0}, {1, 1, 1, 1}, {7, 64, 5, 33}, {100, 1, 2, 9}};
    for (int a = 0; a < 4; a++)
        for (size_t align = 1; align <= 16; align *= 4)
            for (int W = 1; W <= 11; W++) {
                size_t numel[4], fo[4], end = 0;
                int n = 0;
                for (int k = 0; k < 4 && sizes[a][k]; k++, n++) {
                    fo[k] = (end + align - 1) / align * align; /* alignment gaps between params */
                    numel[k] = sizes[a][k];
                    end = fo[k] + numel[k];
                }
                size_t S = (end + (size_t)W - 1) / (size_t)W; /* a world that does not divide: padding at the tail */
                check_layout(numel, fo, n, S, W);
                check_layout(numel, fo, n, S + 5, W); /* a larger S: trailing ranks hold padding only */
            }
}

/* ---------------------------------------------------- a hand-built model */

/* Two modules: "embedding" (tok_embeddings.weight [5, 3]) and "head" (norm.weight [3], output.weight [2, 5]);
 * 28 elements, init[i] = 1 + i / 4 (every value nonzero and distinct). */
#define N_PARAMS 3
#define N_TOTAL 28
static const size_t SHAPES[N_PARAMS][2] = {{5, 3}, {3, 0}, {2, 5}};
static const char *NAMES[N_PARAMS] = {"tok_embeddings.weight", "norm.weight", "output.weight"};

typedef enum { LAYOUT_SHARD0, LAYOUT_BUCKET, LAYOUT_PER_MODULE } Layout;
/* flat offsets: one unit (a gap after p0, so norm.weight starts at 16), or one unit per module */
static const size_t FO[2][N_PARAMS] = {{0, 16, 20}, {0, 0, 3}};
static const int UNIT[2][N_PARAMS] = {{0, 0, 0}, {0, 1, 1}};

typedef struct {
    Model m;
    Module mods[2];
    Param params[N_PARAMS];
    DeviceMesh mesh;
    float *full[2], *shard[2], *state[2][2]; /* per unit: [N x S] unsharded flat buffer, [S] shard, AdamW state */
    size_t S[2];
} Net;

static float init_value(size_t i) { return 1.0f + (float)i / 4; }
static float avg_value(size_t i, int sq) { return sq ? 1000.0f + (float)i : 100.0f + (float)i; }

static void net_model(Net *n) {
    memset(n, 0, sizeof *n);
    const char *mod_names[2] = {"embedding", "head"};
    for (int k = 0; k < N_PARAMS; k++) {
        Param *p = &n->params[k];
        snprintf(p->name, sizeof p->name, "%s", NAMES[k]);
        p->ndim = SHAPES[k][1] ? 2 : 1;
        p->shape[0] = SHAPES[k][0];
        p->shape[1] = SHAPES[k][1];
        p->numel = SHAPES[k][0] * (SHAPES[k][1] ? SHAPES[k][1] : 1);
    }
    for (int i = 0; i < 2; i++) {
        Module *mod = &n->mods[i];
        mod->kind = i ? MOD_HEAD : MOD_EMBEDDING;
        mod->index = i;
        mod->layer = -1;
        snprintf(mod->name, sizeof mod->name, "%s", mod_names[i]);
        mod->n_params = i ? 2 : 1;
        mod->params = &n->params[i ? 1 : 0];
        mod->requires_gradient_sync = mod->reshard_after_backward = 1;
    }
    n->m.n_modules = 2;
    n->m.modules = n->mods;
    n->m.n_params_total = N_TOTAL;
}

/* Device buffer of `count` floats filled from host values. */
static float *dev_filled(Dev *d, const float *host, size_t count, MemTag tag, const char *name) {
    float *p = dev_alloc_f32(d, count, tag, name);
    dev_memcpy_async(dev_compute_stream(d), p, host, count * sizeof(float));
    dev_synchronize(d); /* host is the caller's stack */
    return p;
}

/* The model on this rank in a layout: Shard(0) per param (torch.chunk), or flat (FO, UNIT). With optim, AdamW
 * state avg_value at every element (zero in any padding). Param.data: views into the unsharded flat buffer
 * (flat), NULL otherwise. */
static void net_build(Dev *d, Net *n, Layout layout, int optim) {
    net_model(n);
    dev_mesh_build(d, &n->mesh, 0, 0);
    int W = dev_world_size(d), r = dev_rank(d);
    size_t off[N_PARAMS];
    for (int k = 0, o = 0; k < N_PARAMS; o += (int)n->params[k].numel, k++) off[k] = (size_t)o;
    if (layout == LAYOUT_SHARD0) {
        for (int k = 0; k < N_PARAMS; k++) {
            Param *p = &n->params[k];
            DTensor *dt = &p->dt;
            size_t rows = p->shape[0], rn = p->numel / rows, pr = (rows + (size_t)W - 1) / (size_t)W;
            size_t ro = pr * (size_t)r < rows ? pr * (size_t)r : rows, lr = rows - ro < pr ? rows - ro : pr;
            *dt = (DTensor){.global_rows = rows, .row_numel = rn, .local_rows = lr, .padded_rows = pr, .row_offset = ro,
                            .mesh = &n->mesh, .placement = PLACEMENT_SHARD0};
            float host[64] = {0}, avg[2][64] = {{0}};
            for (size_t e = 0; e < lr * rn; e++) {
                host[e] = init_value(off[k] + ro * rn + e);
                for (int s = 0; s < 2; s++) avg[s][e] = avg_value(off[k] + ro * rn + e, s);
            }
            dt->local = dev_filled(d, host, pr * rn, MEM_PARAM_SHARD, p->name);
            if (optim) {
                size_t cnt = lr * rn > 0 ? lr * rn : 1;
                dt->exp_avg = dev_filled(d, avg[0], cnt, MEM_OPTIM_STATE, p->name);
                dt->exp_avg_sq = dev_filled(d, avg[1], cnt, MEM_OPTIM_STATE, p->name);
            }
        }
        return;
    }
    int L = layout == LAYOUT_BUCKET ? 0 : 1;
    for (int u = 0; u < 2; u++) {
        size_t end = 0;
        for (int k = 0; k < N_PARAMS; k++)
            if (UNIT[L][k] == u && FO[L][k] + n->params[k].numel > end) end = FO[L][k] + n->params[k].numel;
        if (!end) continue; /* the bucket has one unit */
        size_t S = (end + (size_t)W - 1) / (size_t)W;
        n->S[u] = S;
        float full[64] = {0}, avg[2][64] = {{0}}; /* N x S <= 40 here */
        for (int k = 0; k < N_PARAMS; k++)
            if (UNIT[L][k] == u)
                for (size_t e = 0; e < n->params[k].numel; e++) {
                    full[FO[L][k] + e] = init_value(off[k] + e);
                    for (int s = 0; s < 2; s++) avg[s][FO[L][k] + e] = avg_value(off[k] + e, s);
                }
        n->full[u] = dev_filled(d, full, S * (size_t)W, MEM_UNSHARDED_PARAM, u ? "head.flat" : "embedding.flat");
        n->shard[u] = dev_filled(d, full + (size_t)r * S, S, MEM_PARAM_SHARD, "flat_shard");
        for (int s = 0; s < 2 && optim; s++)
            n->state[u][s] = dev_filled(d, avg[s] + (size_t)r * S, S, MEM_OPTIM_STATE, "flat_state");
    }
    for (int k = 0; k < N_PARAMS; k++) {
        Param *p = &n->params[k];
        int u = UNIT[L][k];
        FlatPiece q = flat_piece(p->numel, FO[L][k], n->S[u], (size_t)r);
        p->dt = (DTensor){.local = n->shard[u] + q.at, .global_rows = p->numel, .row_numel = 1, .local_rows = q.count,
                          .padded_rows = q.count, .row_offset = q.start, .mesh = &n->mesh,
                          .placement = PLACEMENT_FLAT, .flat_offset = FO[L][k], .flat_shard_numel = n->S[u],
                          .flat_unit = u};
        if (optim) {
            p->dt.exp_avg = n->state[u][0] + q.at;
            p->dt.exp_avg_sq = n->state[u][1] + q.at;
        }
        p->data = n->full[u] + FO[L][k];
    }
}

/* ------------------------------------------------------ the params check */

typedef struct {
    Layout layout;
    int shift;       /* output.weight's Param.data this many elements off its place */
    int other_param; /* norm.weight's Param.data at output.weight's place */
} ParamsScenario;

static void rank_params_check(Dev *d, void *arg) {
    const ParamsScenario *sc = arg;
    Net n;
    net_build(d, &n, sc->layout, 0);
    n.params[2].data += sc->shift;
    if (sc->other_param) n.params[1].data = n.params[2].data;
    Probes pr = {0};
    probes_init(&pr, &n.m, 0, (AcPolicy){AC_NONE, 0});
    for (int i = 0; i < 2; i++) {
        dev_set_scope(d, 0, n.mods[i].name, "pre_forward");
        probe_params_ready(d, &pr, &n.mods[i], 0, "pre_forward", 0);
    }
    dev_synchronize(d);
    probes_free(&pr);
}

/* ---------------------------------------------------------- the DTensors */

typedef struct {
    const char *dir;
    Layout layout;
    int dirty_padding; /* a nonzero value in the bucket's tail padding on the last rank */
} DumpScenario;

static void rank_dump(Dev *d, void *arg) {
    const DumpScenario *sc = arg;
    Net n;
    net_build(d, &n, sc->layout, 0);
    if (sc->dirty_padding && dev_rank(d) == dev_world_size(d) - 1) {
        float one = 1.0f;
        dev_memcpy_async(dev_compute_stream(d), n.shard[0] + n.S[0] - 1, &one, sizeof one);
        dev_synchronize(d);
    }
    float init[N_TOTAL];
    for (size_t i = 0; i < N_TOTAL; i++) init[i] = init_value(i);
    probes_write_dtensors(d, &n.m, init, sc->dir, &n.mesh);
}

/* ------------------------------------------------ the grad padding probe */

typedef struct {
    const char *dir;
    int dirty; /* a NaN in the bucket's tail padding of the grad shard on the last rank */
} GradScenario;

/* The bucket's grad shard: 0.5 in every piece, zero padding (or the NaN); the probe before the optimizer; the
 * memory snapshot with its notes. */
static void rank_grad_padding(Dev *d, void *arg) {
    const GradScenario *sc = arg;
    Net n;
    net_build(d, &n, LAYOUT_BUCKET, 0);
    int r = dev_rank(d), W = dev_world_size(d);
    size_t S = n.S[0];
    float host[64] = {0};
    for (int k = 0; k < N_PARAMS; k++) {
        FlatPiece q = flat_piece_of(&n.params[k], (size_t)r);
        for (size_t e = 0; e < q.count; e++) host[q.at + e] = 0.5f;
    }
    if (sc->dirty && r == W - 1) host[S - 1] = NAN;
    float *g = dev_filled(d, host, S, MEM_GRAD_SHARD, "flat_grad");
    for (int k = 0; k < N_PARAMS; k++) n.params[k].dt.grad = g + flat_piece_of(&n.params[k], (size_t)r).at;
    Probes pr = {0};
    probes_init(&pr, &n.m, 0, (AcPolicy){AC_NONE, 0});
    dev_set_scope(d, 0, "optimizer", "optimizer");
    probe_grad_padding(d, &pr, 0);
    probes_free(&pr);
    dev_write_artifacts(d, sc->dir);
}

/* ---------------------------------------------------------- checkpoints */

typedef struct {
    const char *path;
    Layout layout;
    int restore; /* build without AdamW state, restore it as --load does, check it, then save */
    int wrong_piece; /* rank 1's tok_embeddings.weight says row_offset 0 */
} SaveScenario;

static void rank_save(Dev *d, void *arg) {
    const SaveScenario *sc = arg;
    Net n;
    net_build(d, &n, sc->layout, !sc->restore);
    if (sc->wrong_piece && dev_rank(d) == 1) n.params[0].dt.row_offset = 0; /* rank 1 holds [8, 15) */
    if (sc->restore) {
        float ea[N_TOTAL], eas[N_TOTAL];
        for (size_t i = 0; i < N_TOTAL; i++) ea[i] = avg_value(i, 0), eas[i] = avg_value(i, 1);
        checkpoint_restore_optimizer(d, &n.m, ea, eas);
        dev_synchronize(d);
        int L = sc->layout == LAYOUT_BUCKET ? 0 : 1, r = dev_rank(d);
        for (int k = 0; k < N_PARAMS; k++) { /* every param of a unit: a view into the first one's allocation */
            const DTensor *dt = &n.params[k].dt, *first = &n.params[L ? (k ? 1 : 0) : 0].dt;
            FlatPiece q = flat_piece_of(&n.params[k], (size_t)r);
            const float *base = first->exp_avg - flat_piece_of(&n.params[L ? (k ? 1 : 0) : 0], (size_t)r).at;
            TCHECK(dt->exp_avg == base + q.at, "rank %d %s: exp_avg not at its piece's place", r, n.params[k].name);
            TCHECK(!q.count || (dev_mem_live_id_containing(d, base) == dev_mem_live_id_containing(d, dt->exp_avg) &&
                                dev_mem_live_id_containing(d, base)),
                   "rank %d %s: exp_avg not in its unit's allocation", r, n.params[k].name);
        }
        for (int u = 0; u < 2; u++) { /* the [S] state: the pieces' saved values, zero elsewhere */
            if (!n.S[u]) continue;
            int k0 = u ? 1 : 0;
            const DTensor *dt = &n.params[k0].dt;
            size_t S = n.S[u];
            const float *base = dt->exp_avg_sq - flat_piece_of(&n.params[k0], (size_t)r).at;
            float got[64], want[64] = {0};
            for (int k = 0; k < N_PARAMS; k++) {
                if (UNIT[L][k] != u) continue;
                FlatPiece q = flat_piece_of(&n.params[k], (size_t)r);
                size_t off = 0;
                for (int j = 0; j < k; j++) off += n.params[j].numel;
                for (size_t e = 0; e < q.count; e++) want[q.at + e] = avg_value(off + q.start + e, 1);
            }
            dev_probe_read(d, got, base, S * sizeof(float));
            TCHECK(memcmp(got, want, S * sizeof(float)) == 0, "rank %d unit %d: restored exp_avg_sq differs", r, u);
        }
    }
    checkpoint_write(d, &n.m, sc->path, 3);
}

/* ------------------------------------------------------------ scenarios */

static int run_mode(const char *kind) {
    static ParamsScenario ps;
    if (!strcmp(kind, "params_bucket")) ps = (ParamsScenario){LAYOUT_BUCKET, 0, 0};
    else if (!strcmp(kind, "params_per_module")) ps = (ParamsScenario){LAYOUT_PER_MODULE, 0, 0};
    else if (!strcmp(kind, "params_shifted")) ps = (ParamsScenario){LAYOUT_BUCKET, 1, 0};
    else if (!strcmp(kind, "params_other_param")) ps = (ParamsScenario){LAYOUT_PER_MODULE, 0, 1};
    else if (!strcmp(kind, "save_wrong_piece")) {
        SaveScenario sc = {"/dev/null", LAYOUT_BUCKET, 0, 1};
        run_world(local_config(4), rank_save, &sc);
        return 0;
    } else {
        fprintf(stderr, "unknown mode %s\n", kind);
        return 1;
    }
    run_world(poisoned(local_config(4)), rank_params_check, &ps);
    return 0;
}


TEST(params_check_passes_flat_views) {
    const char *kinds[2] = {"params_bucket", "params_per_module"};
    for (int i = 0; i < 2; i++) {
        char err[4096];
        int rc = check_child(kinds[i], err, sizeof err);
        CHECK(rc == 0 && err[0] == 0, "%s: exit %d, stderr: %s", kinds[i], rc, err);
    }
}

TEST(params_check_stops_a_wrong_view) {
    char err[4096];
    int rc = check_child("params_shifted", err, sizeof err);
    CHECK(rc != 0 && strstr(err, "error: params check on rank ") &&
              strstr(err, "before head's compute (after its pre_forward, step 1), elements [") &&
              strstr(err, "of output.weight's Param.data should hold this rank's current shard (its piece of the "
                          "unit's flat shard); they hold other values: Param.data is not the view at flat_offset (20) "
                          "of the unit's unsharded flat buffer"),
          "exit %d, stderr:\n%s", rc, err);
    rc = check_child("params_other_param", err, sizeof err); /* norm.weight's data at output.weight's place */
    CHECK(rc != 0 && strstr(err, "of norm.weight's Param.data should hold this rank's current shard (its piece"),
          "exit %d, stderr:\n%s", rc, err);
}

static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = xmalloc((size_t)n + 1);
    s[fread(s, 1, (size_t)n, f)] = 0;
    fclose(f);
    return s;
}

static char tmp_dir[256];

TEST(save_refuses_a_flat_dtensor_off_its_piece) {
    char err[4096];
    int rc = check_child("save_wrong_piece", err, sizeof err);
    CHECK(rc == 2 && !strcmp(err, "error: --save: tok_embeddings.weight's flat DTensor on rank 1 says it holds elements "
                                  "[0, 7) (row_numel 1, global_rows 15, padded_rows 7); flat_offset 0 and S = 8 give "
                                  "[8, 15) (row_numel 1, global_rows = numel 15, padded_rows = local_rows; device.h, "
                                  "PLACEMENT_FLAT)\n"),
          "exit %d, stderr:\n%s", rc, err);
}

TEST(dtensors_dump_has_flat_fields) {
    DumpScenario sc = {tmp_dir, LAYOUT_BUCKET, 0};
    run_world(poisoned(local_config(4)), rank_dump, &sc);
    char path[512];
    snprintf(path, sizeof path, "%s/dtensors_rank3.json", tmp_dir);
    char *s = slurp(path);
    CHECK(s, "no %s", path);
    if (!s) return;
    /* rank 3 of 4, S = 8: output.weight's elements [4, 10) at 0; tail padding [6, 8) */
    CHECK(strstr(s, "{\"name\":\"output.weight\",\"module\":\"head\",\"global_shape\":[2,5],\"mesh\":[0,1,2,3],"
                    "\"mesh_shape\":[4],\"mesh_dim_names\":[\"shard\"],\"placements\":[\"Flat\"],\"mesh_is_world\":"
                    "true,\"placement\":\"Flat\",\"local_rows\":6,\"padded_rows\":6,\"row_offset\":4,\"row_numel\":1,"
                    "\"global_rows\":10,\"has_local\":true,\"local_in_allocation\":true,\"local_matches_init\":true,"
                    "\"padding_is_zero\":true,\"flat_offset\":20,\"flat_shard_numel\":8,\"flat_unit\":0}"),
          "output.weight on rank 3:\n%s", s);
    CHECK(strstr(s, "\"flat_units\":[{\"flat_unit\":0,\"module\":\"embedding\",\"params\":3,\"shard_numel\":8,"
                    "\"flat_numel\":30,\"views_in_shard\":true,\"shard_in_allocation\":true,\"padding_is_zero\":true}]"),
          "flat_units on rank 3:\n%s", s);
    free(s);
    sc.dirty_padding = 1;
    run_world(poisoned(local_config(4)), rank_dump, &sc);
    s = slurp(path);
    CHECK(s && strstr(s, "\"padding_is_zero\":false,\"flat_offset\":20") &&
              strstr(s, "\"views_in_shard\":true,\"shard_in_allocation\":true,\"padding_is_zero\":false}"),
          "a nonzero padding element on rank 3:\n%s", s ? s : "");
    free(s);
    snprintf(path, sizeof path, "%s/dtensors_rank2.json", tmp_dir); /* rank 2's padding is zero */
    s = slurp(path);
    CHECK(s && !strstr(s, "\"padding_is_zero\":false"), "rank 2:\n%s", s ? s : "");
    free(s);
}

TEST(dtensors_dump_of_shard0_has_no_flat_keys) {
    DumpScenario sc = {tmp_dir, LAYOUT_SHARD0, 0};
    run_world(poisoned(local_config(4)), rank_dump, &sc);
    char path[512];
    snprintf(path, sizeof path, "%s/dtensors_rank1.json", tmp_dir);
    char *s = slurp(path);
    CHECK(s && !strstr(s, "flat") && strstr(s, "\"placement\":\"Shard(0)\""), "%s", s ? s : "no file");
    free(s);
}

TEST(grad_padding_probe_reads_a_flat_unit) {
    GradScenario sc = {tmp_dir, 0};
    run_world(poisoned(local_config(4)), rank_grad_padding, &sc);
    char path[512];
    snprintf(path, sizeof path, "%s/memory_rank3.json", tmp_dir);
    char *s = slurp(path);
    CHECK(s && !strstr(s, "grad_padding"), "zero padding, yet a note:\n%s", s ? s : "no file");
    free(s);
    sc.dirty = 1;
    run_world(poisoned(local_config(4)), rank_grad_padding, &sc);
    s = slurp(path);
    /* rank 3 of 4: output.weight's elements [4, 10) at 0, padding [6, 8), the NaN at 7 */
    CHECK(s && strstr(s, "\"kind\":\"grad_padding\",\"step\":0,\"module\":\"embedding\",\"hook\":\"optimizer\","
                         "\"param\":\"tok_embeddings.weight\",\"local_rows\":6,\"padded_rows\":8,"
                         "\"padding_values\":2,\"nonzero\":1,\"nan\":1,\"params\":1,\"flat_unit\":\"embedding\""),
          "the note on rank 3:\n%s", s ? s : "no file");
    free(s);
    snprintf(path, sizeof path, "%s/memory_rank2.json", tmp_dir);
    s = slurp(path);
    CHECK(s && !strstr(s, "grad_padding"), "rank 2's padding is zero, yet a note:\n%s", s ? s : "no file");
    free(s);
}

/* The same file, byte for byte. */
static int same_file(const char *a, const char *b) {
    FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
    int same = fa && fb;
    while (same) {
        int x = fgetc(fa), y = fgetc(fb);
        same = x == y;
        if (x == EOF) break;
    }
    if (fa) fclose(fa);
    if (fb) fclose(fb);
    return same;
}

TEST(checkpoint_of_flat_layout_is_the_per_param_one) {
    const int worlds[3] = {4, 3, 10}; /* 10: ranks holding only padding, and empty pieces */
    for (int w = 0; w < 3; w++) {
        char ref[512], flat[512], restored[512];
        snprintf(ref, sizeof ref, "%s/shard0.safetensors", tmp_dir);
        SaveScenario sc = {ref, LAYOUT_SHARD0, 0, 0};
        run_world(poisoned(local_config(worlds[w])), rank_save, &sc);
        /* what the per-param run saved: the init and the AdamW state, with torchtitan's names */
        Net n;
        net_model(&n);
        float wts[N_TOTAL], *ea = NULL, *eas = NULL;
        int step = checkpoint_load(&n.m, ref, wts, &ea, &eas);
        CHECK(step == 3 && ea && eas, "world %d: step %d", worlds[w], step);
        for (size_t i = 0; i < N_TOTAL && ea && eas; i++)
            CHECK(wts[i] == init_value(i) && ea[i] == avg_value(i, 0) && eas[i] == avg_value(i, 1),
                  "world %d element %zu: %g %g %g", worlds[w], i, wts[i], ea[i], eas[i]);
        free(ea);
        free(eas);
        for (Layout l = LAYOUT_BUCKET; l <= LAYOUT_PER_MODULE; l++) {
            snprintf(flat, sizeof flat, "%s/flat%d.safetensors", tmp_dir, (int)l);
            sc = (SaveScenario){flat, l, 0, 0};
            run_world(poisoned(local_config(worlds[w])), rank_save, &sc);
            CHECK(same_file(ref, flat), "world %d layout %d: the flat layout's checkpoint differs", worlds[w], (int)l);
            snprintf(restored, sizeof restored, "%s/restored%d.safetensors", tmp_dir, (int)l);
            sc = (SaveScenario){restored, l, 1, 0};
            run_world(poisoned(local_config(worlds[w])), rank_save, &sc);
            CHECK(same_file(ref, restored), "world %d layout %d: restored then saved, the checkpoint differs",
                  worlds[w], (int)l);
        }
    }
}

int main(int argc, char **argv) {
    if (argc > 2 && strcmp(argv[1], "--mode") == 0) return run_mode(argv[2]);
    check_child_init(argv[0]);
    snprintf(tmp_dir, sizeof tmp_dir, "/tmp/test_flat.XXXXXX");
    if (!mkdtemp(tmp_dir)) {
        fprintf(stderr, "error: test_flat: cannot make a directory under /tmp\n");
        return 2;
    }
    int rc = check_main(argc, argv);
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp_dir);
    if (system(cmd) != 0) fprintf(stderr, "warning: could not remove %s\n", tmp_dir);
    return rc;
}
