/* checkpoint.c — checkpoint I/O of the training driver (checkpoint.h). */
#include "driver/checkpoint.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/safetensors.h"
#include "runtime/json.h"
#include "runtime/runtime.h"
#include "runtime/util.h"

#include "driver/flat.h"

#define OPTIM_PREFIX "optim."

/* Weights (and, from a checkpoint written by --save, the AdamW state and the
 * step) into host arrays. Returns the step to continue from (0 for plain
 * weights). */
int checkpoint_load(const Model *m, const char *path, float *w, float **exp_avg, float **exp_avg_sq) {
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
void checkpoint_save(const Model *m, const char *path, const float *w, const float *exp_avg,
                            const float *exp_avg_sq, int step) {
    int per = exp_avg ? 3 : 1;
    StTensor *ts = xcalloc(m->n_params_total ? (size_t)m->n_modules * MODULE_MAX_PARAMS * (size_t)per : 1, sizeof(StTensor));
    char **names = xcalloc((size_t)m->n_modules * MODULE_MAX_PARAMS * (size_t)per, sizeof(char *));
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
    /* safetensors metadata: string values only (torch's "format", and the step to resume from) */
    Json meta = {0};
    json_members_begin(&meta);
    json_key(&meta, "format");
    json_string(&meta, "pt");
    json_key(&meta, "step");
    json_stringf(&meta, "%d", step);
    json_members_end(&meta);
    st_write(path, ts, n, json_text(&meta));
    json_free(&meta);
    for (int i = 0; i < n; i++) free(names[i]);
    free(names);
    free(ts);
}

typedef enum { FULL_PARAM, FULL_EXP_AVG, FULL_EXP_AVG_SQ } FullWhat;

/* A flat DTensor (device.h, PLACEMENT_FLAT) the checkpoint can read: S > 0, its unit's N x S elements cover the
 * param, and its fields describe rank r's piece; else one line naming what is wrong. */
static void flat_check(const Param *p, int r, int N, const char *what) {
    const DTensor *dt = &p->dt;
    size_t S = dt->flat_shard_numel;
    if (!S || dt->flat_offset + p->numel > S * (size_t)N)
        fatal("%s: %s's flat DTensor puts its %zu elements at flat_offset %zu, outside the unit's %d x %zu "
              "sharded elements (flat_shard_numel; device.h, PLACEMENT_FLAT)", what, p->name, p->numel,
              dt->flat_offset, N, S);
    if (!flat_fields_agree(p, (size_t)r)) {
        FlatPiece q = flat_piece_of(p, (size_t)r);
        fatal("%s: %s's flat DTensor on rank %d says it holds elements [%zu, %zu) (row_numel %zu, global_rows %zu, "
              "padded_rows %zu); flat_offset %zu and S = %zu give [%zu, %zu) (row_numel 1, global_rows = numel "
              "%zu, padded_rows = local_rows; device.h, PLACEMENT_FLAT)", what, p->name, r, dt->row_offset,
              dt->row_offset + dt->local_rows, dt->row_numel, dt->global_rows, dt->padded_rows, dt->flat_offset,
              S, q.start, q.start + q.count, p->numel);
    }
}

/* A flat param's full value into dst [numel]: every rank's piece (the formula, device.h) padded to
 * c = min(S, numel) elements and all-gathered over the world, [c] from rank r at r * c. Ranks 0 .. N-1 are
 * shard ranks 0 .. N-1 (the first row of a 2-D mesh, which holds every piece): each puts its piece in place. */
static void gather_flat(Dev *dev, Stream *s, const Param *p, const float *src, float *dst) {
    const DTensor *dt = &p->dt;
    int W = dev_world_size(dev), rank = dev_rank(dev), r_shard = flat_rank(dt, rank);
    int N = dt->mesh && dt->mesh->shard_group ? pg_size(dt->mesh->shard_group) : W;
    flat_check(p, r_shard, N, "--save");
    size_t c = dt->flat_shard_numel < p->numel ? dt->flat_shard_numel : p->numel;
    float *all = dev_alloc_f32(dev, c * (size_t)W, MEM_TEMP, "checkpoint.gather"); /* [W, c] */
    float *mine = all + (size_t)rank * c;
    dev_memset_async(s, mine, 0, c * sizeof(float));
    if (dt->local_rows) dev_memcpy_async(s, mine, src, dt->local_rows * sizeof(float));
    coll_all_gather(dev, mine, all, c, s, "checkpoint");
    for (int r = 0; r < N && r < W; r++) {
        FlatPiece q = flat_piece_of(p, (size_t)r);
        if (q.count) dev_memcpy_async(s, dst + q.start, all + (size_t)r * c, q.count * sizeof(float));
    }
    dev_free(dev, all);
}

/* Gather the full value of every parameter (or of its AdamW state) from the
 * DTensors into host memory `out` (every rank takes part in the all-gathers).
 * Shards are the first local_rows rows of their storage; rank r's rows start
 * at r * padded_rows (torch.chunk); a flat param's pieces are gather_flat's. */
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
            if (dt->placement == PLACEMENT_FLAT) {
                gather_flat(dev, s, p, src, dst);
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
void checkpoint_write(Dev *dev, Model *m, const char *path, int step) {
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
    if (dev_rank(dev) == 0) checkpoint_save(m, path, w, ea, eas, step);
    free(w);
    free(ea);
    free(eas);
}

/* A flat unit's AdamW state on resume: one zeroed [S] allocation each for exp_avg and exp_avg_sq (beside the
 * shard: pinned host memory when DTensor.local is), every param of the unit a view at its piece's place
 * holding its elements of the saved state (device.h, PLACEMENT_FLAT). */
static void restore_flat_unit(Dev *dev, Model *m, const Param *first, const Module *first_mod, const float *exp_avg,
                              const float *exp_avg_sq) {
    Stream *s = dev_compute_stream(dev);
    int unit = first->dt.flat_unit, r = flat_rank(&first->dt, dev_rank(dev));
    int N = first->dt.mesh && first->dt.mesh->shard_group ? pg_size(first->dt.mesh->shard_group) : dev_world_size(dev);
    size_t S = first->dt.flat_shard_numel;
    int host = dev_mem_is_host(dev, first->dt.local);
    char name[2][64];
    snprintf(name[0], sizeof name[0], "%s.flat_exp_avg", first_mod->name);
    snprintf(name[1], sizeof name[1], "%s.flat_exp_avg_sq", first_mod->name);
    float *state[2];
    for (int k = 0; k < 2; k++) {
        state[k] = host ? dev_alloc_host_f32(dev, S ? S : 1, MEM_OPTIM_STATE, name[k])
                        : dev_alloc_f32(dev, S ? S : 1, MEM_OPTIM_STATE, name[k]);
        dev_memset_async(s, state[k], 0, S * sizeof(float));
    }
    for (int i = 0; i < m->n_modules; i++)
        for (int j = 0; j < m->modules[i].n_params; j++) {
            Param *p = &m->modules[i].params[j];
            DTensor *dt = &p->dt;
            if (dt->placement != PLACEMENT_FLAT || dt->flat_unit != unit) continue;
            flat_check(p, r, N, "--load");
            if (dt->flat_shard_numel != S)
                fatal("--load: %s's flat DTensor has flat_shard_numel %zu, %s's (the same unit, flat_unit %d) %zu: "
                      "a unit has one S (device.h, PLACEMENT_FLAT)", p->name, dt->flat_shard_numel, first->name,
                      unit, S);
            FlatPiece q = flat_piece_of(p, (size_t)r); /* at + count <= S */
            size_t off = model_param_offset(m, p) + q.start;
            dt->exp_avg = state[0] + q.at;
            dt->exp_avg_sq = state[1] + q.at;
            if (!q.count) continue;
            dev_memcpy_async(s, dt->exp_avg, exp_avg + off, q.count * sizeof(float));
            dev_memcpy_async(s, dt->exp_avg_sq, exp_avg_sq + off, q.count * sizeof(float));
        }
}

/* Resuming: give every DTensor its rows of the saved AdamW state, as the
 * optimizer would have created them (hw_fsdp.h: the optimizer creates state
 * only where DTensor.exp_avg is NULL); a flat unit's, restore_flat_unit's. */
void checkpoint_restore_optimizer(Dev *dev, Model *m, const float *exp_avg, const float *exp_avg_sq) {
    Stream *s = dev_compute_stream(dev);
    int *units = xcalloc((size_t)m->n_modules * MODULE_MAX_PARAMS + 1, sizeof(int)), n_units = 0;
    for (int i = 0; i < m->n_modules; i++)
        for (int j = 0; j < m->modules[i].n_params; j++) {
            Param *p = &m->modules[i].params[j];
            DTensor *dt = &p->dt;
            if (dt->placement == PLACEMENT_FLAT) { /* the unit's state, once, at its first param */
                int seen = 0;
                for (int k = 0; k < n_units && !seen; k++) seen = units[k] == dt->flat_unit;
                if (!seen) {
                    units[n_units++] = dt->flat_unit;
                    restore_flat_unit(dev, m, p, &m->modules[i], exp_avg, exp_avg_sq);
                }
                continue;
            }
            size_t n = dt->local_rows * dt->row_numel, off = model_param_offset(m, p) + dt->row_offset * dt->row_numel;
            if (dt->row_offset + dt->local_rows > p->shape[0] && dt->local_rows)
                fatal("%s: DTensor rows [%zu, %zu) are outside the parameter's %zu rows", p->name, dt->row_offset,
                      dt->row_offset + dt->local_rows, p->shape[0]);
            /* beside the shard: pinned host memory when the stage offloads it (--offload-params) */
            int host = dev_mem_is_host(dev, dt->local);
            dt->exp_avg = host ? dev_alloc_host_f32(dev, n, MEM_OPTIM_STATE, p->name)
                               : dev_alloc_f32(dev, n, MEM_OPTIM_STATE, p->name);
            dt->exp_avg_sq = host ? dev_alloc_host_f32(dev, n, MEM_OPTIM_STATE, p->name)
                                  : dev_alloc_f32(dev, n, MEM_OPTIM_STATE, p->name);
            dev_memcpy_async(s, dt->exp_avg, exp_avg + off, n * sizeof(float));
            dev_memcpy_async(s, dt->exp_avg_sq, exp_avg_sq + off, n * sizeof(float));
        }
    free(units);
}
