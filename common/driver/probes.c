/* probes.c — the driver's records for the grader (probes.h). */
#include "driver/probes.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/alloc.h" /* dev_mem_free_event: who freed the params the backward finds missing */
#include "runtime/bf16.h" /* bf16_from_f32: what the params check expects with --param-dtype bf16 */
#include "runtime/json.h"
#include "runtime/phase.h"
#include "runtime/runtime.h"
#include "runtime/util.h"

#include "driver/flat.h" /* a flat DTensor's pieces (device.h, PLACEMENT_FLAT) */

static void capture(Dev *dev, Captured *c, const void *const *ptrs, int n) {
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

/* A note's first fields: the step, the module and the hook (json.h: a
 * note's fields are members of an object the snapshot writes). */
static void note_begin(Json *f, int step, const char *module, const char *hook) {
    json_members_begin(f);
    json_key(f, "step");
    json_int(f, step);
    json_key(f, "module");
    json_string(f, module);
    json_key(f, "hook");
    json_string(f, hook);
}

static void note_end(Dev *dev, Json *f, const char *kind) {
    json_members_end(f);
    dev_mem_note(dev, kind, json_text(f));
    json_free(f);
}

static void size_field(Json *f, const char *key, size_t v) {
    json_key(f, key);
    json_uint(f, v);
}

/* With --grad-accum: the microbatch (and, for a module, the flags the loop set on it); else nothing. */
static void micro_fields(Json *f, const Dev *dev, const Module *mod) {
    int k = dev_scope_microbatch(dev);
    if (k < 0) return;
    json_key(f, "microbatch");
    json_int(f, k);
    if (!mod) return;
    json_key(f, "requires_gradient_sync");
    json_int(f, mod->requires_gradient_sync);
    json_key(f, "reshard_after_backward");
    json_int(f, mod->reshard_after_backward);
}

/* A "hook_check" note of a module's hook holding one count of bytes. */
static void hook_check_bytes(Dev *dev, int step, const Module *mod, const char *hook, const char *key, size_t bytes) {
    Json f = {0};
    note_begin(&f, step, mod->name, hook);
    size_field(&f, key, bytes);
    micro_fields(&f, dev, mod);
    note_end(dev, &f, "hook_check");
}

void probe_hook_begin(Dev *dev, Probes *p) {
    p->hook_entry_bytes = dev_mem_current(dev);
    dev_mem_window_begin(dev);
}

/* key: {"tag":bytes,...} over the nonzero tags of by_tag */
static void tag_fields(Json *f, const char *key, const size_t *by_tag) {
    json_key(f, key);
    json_object_begin(f);
    for (int t = 0; t < MEM_TAG_COUNT; t++)
        if (by_tag[t]) size_field(f, mem_tag_name((MemTag)t), by_tag[t]);
    json_object_end(f);
}

void probe_hook_end(Dev *dev, const Probes *p, int step, const char *module, const char *hook) {
    size_t high_by_tag[MEM_TAG_COUNT], exit_by_tag[MEM_TAG_COUNT], host_by_tag[MEM_TAG_COUNT];
    size_t high = dev_mem_window_peak(dev, high_by_tag);
    for (int t = 0; t < MEM_TAG_COUNT; t++) {
        exit_by_tag[t] = dev_mem_current_by_tag(dev, (MemTag)t);
        host_by_tag[t] = dev_mem_host_current_by_tag(dev, (MemTag)t);
    }
    Json f = {0};
    note_begin(&f, step, module, hook);
    micro_fields(&f, dev, NULL);
    size_field(&f, "entry_bytes", p->hook_entry_bytes);
    size_field(&f, "high_water_bytes", high);
    tag_fields(&f, "high_water_by_tag", high_by_tag);
    tag_fields(&f, "exit_by_tag", exit_by_tag);
    /* the pinned host pool at exit (stage 10's offloaded shards), when it holds anything */
    if (dev_mem_host_current(dev)) tag_fields(&f, "host_exit_by_tag", host_by_tag);
    note_end(dev, &f, "hook_memory");
}

void probes_check_mesh(const Model *m, const DeviceMesh *mesh) {
    if (mesh->ndim != 2) return;
    size_t S = (size_t)pg_size(mesh->shard_group);
    for (int i = 0; i < m->n_modules; i++)
        for (int j = 0; j < m->modules[i].n_params; j++) {
            const Param *p = &m->modules[i].params[j];
            size_t want = (p->shape[0] + S - 1) / S;
            if (p->dt.padded_rows != want)
                fatal("--mesh %d,%d: %s's DTensor %s holds %zu padded rows of %zu, not ceil(%zu / %zu) = %zu: on a 2-D "
                      "mesh params are split over the %zu ranks of the shard group (FsdpConfig.mesh->shard_group; "
                      "HANDOUT.md, HSDP)",
                      mesh->shape[0], mesh->shape[1], m->modules[i].name, p->name, p->dt.padded_rows, p->shape[0],
                      p->shape[0], S, want, S);
        }
}

void probes_check_offload(Dev *dev, const Model *m) {
    for (int i = 0; i < m->n_modules; i++)
        for (int j = 0; j < m->modules[i].n_params; j++) {
            const Param *p = &m->modules[i].params[j];
            if (!dev_mem_is_host(dev, p->dt.local))
                fatal("--offload-params: %s's DTensor %s keeps its shard in device memory: with --offload-params the "
                      "shards live in pinned host memory (dev_alloc_host; HANDOUT.md, "
                      "--offload-params)",
                      m->modules[i].name, p->name);
        }
}

/* true, false, or null for -1 (not known) */
static void bool_or_null(Json *j, int v) {
    if (v < 0) json_null(j);
    else json_bool(j, v);
}

/* A mesh's shape: [S] or [R, S]. */
static void mesh_shape(Json *j, const DeviceMesh *m) {
    json_array_begin(j);
    json_int(j, m->shape[0]);
    if (m->ndim == 2) json_int(j, m->shape[1]);
    json_array_end(j);
}

/* Does [p, p + bytes) lie in one live allocation (device, or pinned host)? A
 * DTensor.grad left pointing into freed memory is not read. */
static int readable(Dev *dev, const void *p, size_t bytes) {
    const char *last = (const char *)p + bytes - 1;
    uint64_t id = dev_mem_live_id_containing(dev, p);
    if (id) return dev_mem_live_id_containing(dev, last) == id;
    return dev_mem_is_host(dev, p) && dev_mem_is_host(dev, last);
}

/* A flat unit's [S] shard on rank r, as its params' views give it (device.h,
 * PLACEMENT_FLAT): grad 0 reads DTensor.local, 1 DTensor.grad. The shard is
 * read (not in a dry run) only when every view sits where its piece says, in
 * one live allocation of S floats. */
typedef struct {
    int unit;                 /* flat_unit: Module.index of the unit's first module */
    int n_params;             /* params with placement Flat and this flat_unit */
    const Param *first;       /* the first of them in module order, and its module */
    const Module *first_mod;
    size_t S, end;            /* the shard's elements; the flat buffer's, up to its last param's end */
    const char *base;         /* the [S] shard (bytes), from the first view (NULL: none) */
    int views_ok;             /* one S, and every view at base + its piece's place */
    int in_alloc;             /* [base, base + S) in one live allocation (-1: not known) */
    int read;                 /* read: the counts below hold */
    size_t covered, nonzero, nan; /* the pieces' elements; of the others, nonzero (NaN too) and NaN */
} FlatUnit;

static const float *flat_view(const Param *q, int grad) { return grad ? q->dt.grad : q->dt.local; }

static void flat_unit_scan(Dev *dev, const Model *m, int unit, int r, int grad, FlatUnit *u) {
    memset(u, 0, sizeof *u);
    u->unit = unit;
    u->views_ok = 1;
    u->in_alloc = -1;
    for (int i = 0; i < m->n_modules; i++)
        for (int j = 0; j < m->modules[i].n_params; j++) {
            const Param *q = &m->modules[i].params[j];
            if (q->dt.placement != PLACEMENT_FLAT || q->dt.flat_unit != unit) continue;
            if (!u->n_params++) {
                u->first = q;
                u->first_mod = &m->modules[i];
                u->S = q->dt.flat_shard_numel;
            }
            if (q->dt.flat_offset + q->numel > u->end) u->end = q->dt.flat_offset + q->numel;
            const char *v = (const char *)flat_view(q, grad);
            FlatPiece pc = flat_piece_of(q, (size_t)r);
            if (!v || q->dt.flat_shard_numel != u->S) u->views_ok = 0;
            else if (!u->base) u->base = v - pc.at * sizeof(float);
            else if (v != u->base + pc.at * sizeof(float)) u->views_ok = 0;
        }
    if (!u->base || !u->views_ok || !u->S) return;
    u->in_alloc = readable(dev, u->base, u->S * sizeof(float));
    if (!u->in_alloc || dev_dry_run(dev)) return;
    float *buf = xmalloc(u->S * sizeof(float));
    unsigned char *piece = xcalloc(u->S, 1); /* 1: an element of some param's piece */
    dev_probe_read(dev, buf, u->base, u->S * sizeof(float));
    for (int i = 0; i < m->n_modules; i++)
        for (int j = 0; j < m->modules[i].n_params; j++) {
            const Param *q = &m->modules[i].params[j];
            if (q->dt.placement != PLACEMENT_FLAT || q->dt.flat_unit != unit) continue;
            FlatPiece pc = flat_piece_of(q, (size_t)r); /* at + count <= S by the formula */
            memset(piece + pc.at, 1, pc.count);
        }
    for (size_t e = 0; e < u->S; e++) {
        if (piece[e]) u->covered++;
        else {
            u->nonzero += buf[e] != 0.0f; /* NaN too */
            u->nan += isnan(buf[e]) != 0;
        }
    }
    u->read = 1;
    free(piece);
    free(buf);
}

/* The flat units of the model in module order of their first param (n_out of them; NULL when none). */
static FlatUnit *flat_units(Dev *dev, const Model *m, int r, int grad, int *n_out) {
    FlatUnit *units = NULL;
    int n = 0, cap = 0;
    for (int i = 0; i < m->n_modules; i++)
        for (int j = 0; j < m->modules[i].n_params; j++) {
            const DTensor *dt = &m->modules[i].params[j].dt;
            if (dt->placement != PLACEMENT_FLAT) continue;
            int seen = 0;
            for (int k = 0; k < n && !seen; k++) seen = units[k].unit == dt->flat_unit;
            if (seen) continue;
            if (n == cap) {
                cap = cap ? 2 * cap : 8;
                FlatUnit *grown = xcalloc((size_t)cap, sizeof *grown);
                if (n) memcpy(grown, units, (size_t)n * sizeof *grown);
                free(units);
                units = grown;
            }
            flat_unit_scan(dev, m, dt->flat_unit, r, grad, &units[n++]);
        }
    *n_out = n;
    return units;
}

/* One param's DTensor; mesh: the world's (or --mesh's) mesh. The local shard is
 * device memory on a GPU (or pinned host memory, stage 10): it is read through
 * dev_probe_read into a host copy, never dereferenced here. */
static void dtensor_json(Json *j, Dev *dev, const Model *m, const Module *mod, const Param *p, const float *init,
                         const DeviceMesh *mesh, const FlatUnit *unit) {
    const DTensor *dt = &p->dt;
    /* the DTensor's own mesh, compared by value with the world's (a copy is fine) */
    const DeviceMesh *dm = dt->mesh;
    int mesh_ok = dm && dm->size == mesh->size && dm->ndim == mesh->ndim && dm->shape[0] == mesh->shape[0] &&
                  dm->shape[1] == mesh->shape[1];
    for (int r = 0; mesh_ok && r < mesh->size && r < WORLD_MAX_RANKS; r++) mesh_ok = dm->ranks[r] == mesh->ranks[r];
    int flat = dt->placement == PLACEMENT_FLAT; /* 1-D: elements are its rows (device.h) */
    const char *pl = dt->placement == PLACEMENT_SHARD0 ? "Shard(0)"
                     : dt->placement == PLACEMENT_REPLICATE ? "Replicate()" : flat ? "Flat" : "none";
    /* FSDP2's placements, one per mesh dim: a 2-D mesh replicates along its first */
    int two_d = dm && dm->ndim == 2;
    /* does the local shard hold exactly the rows [row_offset, +local_rows) of the init? */
    int matches = -1, pad_zero = -1, in_alloc = -1;
    size_t rows = flat ? p->numel : p->shape[0];
    if (dt->local && dt->row_offset + dt->local_rows <= rows && dt->row_numel == p->numel / rows) {
        size_t n = dt->local_rows * dt->row_numel, total = n;
        if (dt->padded_rows >= dt->local_rows && dt->placement == PLACEMENT_SHARD0)
            total = dt->padded_rows * dt->row_numel;
        /* only memory the runtime's kernels can use (dev_alloc / dev_alloc_host) is read:
         * a malloc'd shard, or one that overruns its allocation, is reported instead */
        in_alloc = total == 0 || readable(dev, dt->local, total * sizeof(float));
        if (in_alloc && !dev_dry_run(dev)) { /* a dry run has no values: matches and padding stay null */
            float *local = xmalloc((total ? total : 1) * sizeof(float));
            dev_probe_read(dev, local, dt->local, total * sizeof(float));
            const float *want = init + model_param_offset(m, p) + dt->row_offset * dt->row_numel;
            matches = memcmp(local, want, n * sizeof(float)) == 0;
            pad_zero = 1;
            for (size_t e = n; e < total; e++)
                if (local[e] != 0.0f) pad_zero = 0;
            /* a flat param's padding is its unit's: the [S] shard's elements outside every piece */
            if (flat) pad_zero = unit && unit->read ? unit->nonzero == 0 : -1;
            free(local);
        }
    }
    json_object_begin(j);
    json_key_string(j, "name", p->name);
    json_key_string(j, "module", mod->name);
    json_key(j, "global_shape");
    json_array_begin(j);
    for (int d = 0; d < p->ndim && d < 2; d++) json_uint(j, p->shape[d]);
    json_array_end(j);
    json_key(j, "mesh");
    json_array_begin(j);
    for (int r = 0; dm && r < dm->size && r < WORLD_MAX_RANKS; r++) json_int(j, dm->ranks[r]);
    json_array_end(j);
    json_key(j, "mesh_shape");
    if (dm) mesh_shape(j, dm);
    else {
        json_array_begin(j);
        json_array_end(j);
    }
    json_key(j, "mesh_dim_names");
    json_array_begin(j);
    if (two_d) json_string(j, "replicate");
    json_string(j, "shard");
    json_array_end(j);
    json_key(j, "placements");
    json_array_begin(j);
    if (two_d && dt->placement == PLACEMENT_SHARD0) json_string(j, "Replicate()");
    json_string(j, pl);
    json_array_end(j);
    json_key(j, "mesh_is_world");
    json_bool(j, mesh_ok);
    json_key_string(j, "placement", pl);
    size_field(j, "local_rows", dt->local_rows);
    size_field(j, "padded_rows", dt->padded_rows);
    size_field(j, "row_offset", dt->row_offset);
    size_field(j, "row_numel", dt->row_numel);
    size_field(j, "global_rows", dt->global_rows);
    json_key(j, "has_local");
    json_bool(j, dt->local != NULL);
    json_key(j, "local_in_allocation");
    bool_or_null(j, in_alloc);
    json_key(j, "local_matches_init");
    bool_or_null(j, matches);
    json_key(j, "padding_is_zero");
    bool_or_null(j, pad_zero);
    if (flat) { /* only a flat param has these: the dumps of the other placements are unchanged */
        size_field(j, "flat_offset", dt->flat_offset);
        size_field(j, "flat_shard_numel", dt->flat_shard_numel);
        json_key_int(j, "flat_unit", dt->flat_unit);
    }
    json_object_end(j);
}

/* The flat units (dtensors_rank<r>.json's "flat_units"): each unit's shard as this rank holds it. */
static void flat_units_json(Json *j, const Model *m, const FlatUnit *units, int n) {
    json_key(j, "flat_units");
    json_array_begin(j);
    for (int k = 0; k < n; k++) {
        const FlatUnit *u = &units[k];
        json_object_begin(j);
        json_key_int(j, "flat_unit", u->unit);
        json_key(j, "module"); /* the unit's first module, when flat_unit names one */
        if (u->unit >= 0 && u->unit < m->n_modules) json_string(j, m->modules[u->unit].name);
        else json_null(j);
        json_key_int(j, "params", u->n_params);
        size_field(j, "shard_numel", u->S);
        size_field(j, "flat_numel", u->end);
        json_key(j, "views_in_shard");
        json_bool(j, u->views_ok && u->base);
        json_key(j, "shard_in_allocation");
        bool_or_null(j, u->in_alloc);
        json_key(j, "padding_is_zero");
        bool_or_null(j, u->read ? u->nonzero == 0 : -1);
        json_object_end(j);
    }
    json_array_end(j);
}

void probes_write_dtensors(Dev *dev, Model *m, const float *init, const char *dir, const DeviceMesh *mesh) {
    dev_synchronize(dev);
    Json j = {0};
    json_object_begin(&j);
    json_key_int(&j, "rank", dev_rank(dev));
    json_key_int(&j, "world_size", dev_world_size(dev));
    json_key(&j, "mesh_shape");
    mesh_shape(&j, mesh);
    json_key_int(&j, "shard_rank", pg_rank(mesh->shard_group));
    json_key_int(&j, "shard_size", pg_size(mesh->shard_group));
    int n_units = 0;
    FlatUnit *units = flat_units(dev, m, pg_rank(mesh->shard_group), 0, &n_units);
    json_key(&j, "params");
    json_array_begin(&j);
    for (int i = 0; i < m->n_modules; i++)
        for (int k = 0; k < m->modules[i].n_params; k++) {
            const Param *p = &m->modules[i].params[k];
            const FlatUnit *unit = NULL;
            for (int u = 0; u < n_units && p->dt.placement == PLACEMENT_FLAT; u++)
                if (units[u].unit == p->dt.flat_unit) unit = &units[u];
            dtensor_json(&j, dev, m, &m->modules[i], p, init, mesh, unit);
        }
    json_array_end(&j);
    if (n_units) flat_units_json(&j, m, units, n_units);
    free(units);
    json_object_end(&j);
    json_line_end(&j);
    char *path = xasprintf("%s/dtensors_rank%d.json", dir, dev_rank(dev));
    json_write_file(&j, path);
    free(path);
    /* every rank's file exists before any rank starts step 1: a run that fails later still
     * leaves all of them (the grader's DTensors check reads them), whichever rank fails first */
    dev_host_barrier(dev);
}

void probes_init(Probes *p, const Model *m, int param_bf16, AcPolicy ac) {
    p->model = m;
    p->param_bf16 = param_bf16;
    p->ac = ac;
    p->history = xcalloc((size_t)m->n_modules * MODULE_MAX_PARAMS, sizeof *p->history);
    for (int i = 0; i < m->n_modules * MODULE_MAX_PARAMS; i++) p->history[i].step = -1;
    p->grad_state = xcalloc((size_t)m->n_modules * MODULE_MAX_PARAMS, sizeof *p->grad_state);
    p->last_data = xcalloc((size_t)m->n_modules * MODULE_MAX_PARAMS, sizeof *p->last_data);
}

void probes_free(Probes *p) {
    free(p->history);
    p->history = NULL;
    free(p->last_data);
    p->last_data = NULL;
    for (int i = 0; p->grad_state && i < p->model->n_modules * MODULE_MAX_PARAMS; i++) {
        free(p->grad_state[i].now);
        free(p->grad_state[i].before);
    }
    free(p->grad_state);
    p->grad_state = NULL;
    free(p->spare);
    p->spare = NULL;
}

/* ------------------------------------------------------- the params check */

typedef struct {
    const Module *mod;
    Probes *probes;
    const char *hook;
    int step, rank, world;
    int flat_rank;                        /* this rank in a flat param's shard group (device.h, PLACEMENT_FLAT) */
    int bf16;                             /* --param-dtype bf16: data are Param.data_bf16 */
    const void *data[MODULE_MAX_PARAMS];  /* Param.data (or data_bf16) as the hook left them */
} ParamsCheck;

/* This rank's rows of a param as torch.chunk splits dim 0 (not the DTensor's
 * own fields: a wrong row_offset is the DTensors check's to report). A flat
 * param's (flat 1): its elements, as its flat_offset and S place them. */
typedef struct { size_t start, rows, row_numel; int flat; } OwnRows;
static OwnRows own_rows(const Param *p, int rank, int world) {
    size_t rows = p->shape[0], chunk = (rows + (size_t)world - 1) / (size_t)world, start = chunk * (size_t)rank;
    OwnRows o = {start, start >= rows ? 0 : (rows - start < chunk ? rows - start : chunk), p->numel / rows, 0};
    return o;
}
static OwnRows own_of(const ParamsCheck *c, const Param *p) {
    if (p->dt.placement != PLACEMENT_FLAT) return own_rows(p, c->rank, c->world);
    FlatPiece q = flat_piece_of(p, (size_t)c->flat_rank);
    OwnRows o = {q.start, q.count, 1, 1};
    return o;
}

/* How sampled_hash reads a row: the stored words (float32 or bfloat16), or a
 * float32 shard as it should look in bfloat16 (rounded to nearest even). */
typedef enum { WORDS_F32 = 0, WORDS_BF16, SHARD_AS_BF16 } HashAs;

static uint32_t word_at(const void *rows, size_t i, HashAs as) {
    switch (as) {
    case WORDS_BF16: return ((const uint16_t *)rows)[i];
    case SHARD_AS_BF16: return bf16_from_f32(((const float *)rows)[i]);
    default: return ((const uint32_t *)rows)[i];
    }
}

/* A shard as the unsharded params should hold it, and where this rank's rows
 * start in the unsharded params the hook left. */
static HashAs shard_as(const ParamsCheck *c) { return c->bf16 ? SHARD_AS_BF16 : WORDS_F32; }
static const void *own_data(const ParamsCheck *c, int j, OwnRows own) {
    return (const char *)c->data[j] + own.start * own.row_numel * (c->bf16 ? sizeof(uint16_t) : sizeof(float));
}

/* FNV-1a over the words of sampled rows of a rank's block (`rows` points at
 * its first row): the first two, the middle and the last. Sampled so the check
 * costs little next to the module's compute it runs before (a copy-out offset
 * or count bug moves every row, and the first and last catch an off-by-one). */
#define FLAT_RUN 32 /* a flat piece is sampled as runs of this many elements */
static uint64_t sampled_hash(const void *rows, OwnRows o, HashAs as) {
    size_t pick[4] = {0, 1, o.rows / 2, o.rows - 1};
    uint64_t h = 1469598103934665603ull;
    if (o.flat) { /* 1-D: runs at its start, middle and end (a wrong view moves every element) */
        size_t run = o.rows < FLAT_RUN ? o.rows : FLAT_RUN, from[3] = {0, (o.rows - run) / 2, o.rows - run};
        for (int k = 0; k < 3; k++)
            for (size_t i = 0; i < run; i++) h = (h ^ word_at(rows, from[k] + i, as)) * 1099511628211ull;
        return h;
    }
    for (int k = 0; k < 4; k++) {
        if (pick[k] >= o.rows || (k && pick[k] == pick[k - 1])) continue;
        for (size_t i = 0; i < o.row_numel; i++) h = (h ^ word_at(rows, pick[k] * o.row_numel + i, as)) * 1099511628211ull;
    }
    return h;
}

/* What the rows hold instead of the shard, as the object of "they hold ..." in the message. */
static void what_instead(const ParamsCheck *c, int j, uint64_t got, const ShardHistory *h, char *buf, size_t cap) {
    const Param *p = &c->mod->params[j];
    OwnRows own = own_of(c, p);
    const void *rows = own_data(c, j, own);
    size_t n = own.rows * own.row_numel, nan = 0;
    for (size_t i = 0; i < n; i++) {
        float v = c->bf16 ? bf16_to_f32(((const uint16_t *)rows)[i]) : ((const float *)rows)[i];
        nan += v != v;
    }
    if (nan) {
        snprintf(buf, cap, "NaN in %zu of their %zu values, which were never written (fresh memory is NaN-filled): "
                 "%s, or compute read them before the all-gather filled them", nan, n,
                 own.flat ? "the all-gather into the unit's flat buffer did not reach these elements"
                          : "the copy-out did not reach these rows");
        return;
    }
    if (h->step >= 0 && h->before != h->now && got == h->before) {
        snprintf(buf, cap, "last step's shard, stale values from before the optimizer's update (params kept from "
                 "the last step instead of resharded after backward and gathered again, or an all-gather that read "
                 "the shards before the optimizer wrote them)");
        return;
    }
    const Model *m = c->probes->model;
    for (int i = c->mod->index - 1; i <= c->mod->index + 1; i++) {
        if (i < 0 || i >= m->n_modules) continue;
        for (int k = 0; k < m->modules[i].n_params; k++) {
            const Param *q = &m->modules[i].params[k];
            OwnRows oq = own_of(c, q);
            if ((i != c->mod->index || k != j) && oq.rows == own.rows && oq.row_numel == own.row_numel &&
                oq.flat == own.flat && q->dt.local && sampled_hash(q->dt.local, oq, shard_as(c)) == got) {
                if (own.flat)
                    snprintf(buf, cap, "%s's piece instead: Param.data is a view at another param's place in the "
                             "unit's flat buffer (a wrong flat_offset, or another unit's buffer)",
                             m->modules[i].params[k].name);
                else
                    snprintf(buf, cap, "%s's shard instead: the copy-out took another param's segment (a wrong "
                             "offset in the flat buffer, or another module's all-gather output)",
                             m->modules[i].params[k].name);
                return;
            }
        }
    }
    if (own.flat)
        snprintf(buf, cap, "other values: Param.data is not the view at flat_offset (%zu) of the unit's unsharded "
                 "flat buffer, whose elements [r x S, (r+1) x S) are rank r's flat shard (S = %zu%s)",
                 p->dt.flat_offset, p->dt.flat_shard_numel,
                 c->bf16 ? "; in bfloat16 elements of 2 bytes, not sizeof(float)" : "");
    else
        snprintf(buf, cap, "other values: the copy-out's offsets or counts are wrong (rank r's rows of param j start "
                 "at r x S + offset(j) of the all-gather output%s)",
                 c->bf16 ? "; in bfloat16 elements of 2 bytes, not sizeof(float)" : "");
}

/* The params check as a kernel on the compute stream (CPU backend only: it
 * reads device memory on the host), hence kcpu_ as in model/kernels.h. */
static void kcpu_params_check(void *arg) {
    ParamsCheck *c = arg;
    for (int j = 0; j < c->mod->n_params; j++) {
        const Param *p = &c->mod->params[j];
        const DTensor *dt = &p->dt;
        OwnRows own = own_of(c, p); /* a flat param: its piece, by the formula (device.h, PLACEMENT_FLAT) */
        size_t n = own.rows * own.row_numel;
        if (!n || !dt->local || dt->local_rows * dt->row_numel != n) continue; /* a wrong shard: DTensors says so */
        ShardHistory *h = &c->probes->history[c->mod->index * MODULE_MAX_PARAMS + j];
        uint64_t shard = sampled_hash(dt->local, own, shard_as(c));
        if (h->step != c->step) { /* the first check of a step sees the shard the optimizer left */
            h->before = h->step >= 0 ? h->now : shard;
            h->now = shard;
            h->step = c->step;
        }
        uint64_t got = sampled_hash(own_data(c, j, own), own, c->bf16 ? WORDS_BF16 : WORDS_F32);
        if (got == shard) continue;
        char why[600];
        what_instead(c, j, got, h, why, sizeof why);
        fatal("params check on rank %d: before %s's compute (after its %s, step %d), %s [%zu, %zu) of %s's "
              "Param.%s should hold this rank's current shard%s%s; they hold %s", c->rank, c->mod->name, c->hook,
              c->step + 1, own.flat ? "elements" : "rows", own.start, own.start + own.rows, p->name,
              c->bf16 ? "data_bf16" : "data", own.flat ? " (its piece of the unit's flat shard)" : "",
              c->bf16 ? " rounded to bfloat16" : "", why);
    }
}

/* The hook a scope's phase names, as the student wrote it ("block1's fsdp_post_forward during the
 * backward's recompute"); other_step: the step (1-based) when not the current one, else 0. */
static void hook_of_phase(const char *module, const char *phase, int other_step, char *buf, size_t cap) {
    char whose[32] = "the ", in_step[32] = ""; /* "the forward" / "step 2's forward"; " in step 2" */
    if (other_step) {
        snprintf(whose, sizeof whose, "step %d's ", other_step);
        snprintf(in_step, sizeof in_step, " in step %d", other_step);
    }
    for (Phase k = 0; k < PHASE_COUNT; k++) {
        const PhaseInfo *info = phase_info(k);
        if (!info || !info->hook || strcmp(phase, info->name)) continue;
        /* the forward's hooks say which forward (the --ac recompute's runs inside the backward) */
        const char *during = k == PHASE_PRE_FORWARD || k == PHASE_POST_FORWARD ? "forward"
                             : k == PHASE_RECOMPUTE_PRE_FORWARD || k == PHASE_RECOMPUTE_POST_FORWARD
                                 ? "backward's recompute"
                                 : NULL;
        if (during)
            snprintf(buf, cap, "%s's %s during %s%s", module, info->hook, whose, during);
        else if (k == PHASE_FINISH_BACKWARD || k == PHASE_OPTIMIZER) /* once per backward / step: no module of its own */
            snprintf(buf, cap, "%s%s", info->hook, in_step);
        else
            snprintf(buf, cap, "%s's %s%s", module, info->hook, in_step);
        return;
    }
    snprintf(buf, cap, "%s's %s%s", module, phase, in_step);
}

/* Param j of mod has no unsharded data for the backward: one line saying who freed the
 * buffer it last had (the allocator's event log), or, without that evidence, that it is NULL. */
static void no_data_for_backward(Dev *dev, const Probes *p, const Module *mod, int j, int step, const char *field,
                                 const char *why) {
    const Param *q = &mod->params[j];
    uint64_t id = p->last_data ? p->last_data[mod->index * MODULE_MAX_PARAMS + j] : 0;
    const MemEvent *e = id ? dev_mem_free_event(dev, id) : NULL;
    /* a block that does not recompute under selective checkpointing: no forward hook comes between its
     * pre_backward and its backward (a state machine that waits for one leaves it without params) */
    char not_recomputed[160] = "";
    if (mod->kind == MOD_BLOCK && p->ac.mode != AC_NONE && !ac_block_recomputes(p->ac, mod->layer))
        snprintf(not_recomputed, sizeof not_recomputed,
                 " (%s does not recompute with --ac-every %d: no forward hook runs in its backward, so "
                 "fsdp_pre_backward alone must unshard it)", mod->name, p->ac.every);
    if (!e || !e->phase || !e->module)
        fatal("%s: %s has no unsharded data for the backward (%s is NULL after fsdp_pre_backward)%s%s", mod->name,
              q->name, field, not_recomputed, why);
    char who[200];
    hook_of_phase(e->module, e->phase, e->step != step && e->step >= 0 ? e->step + 1 : 0, who, sizeof who);
    /* freed in this module's backward (by its fsdp_pre_backward, or in the recompute after it), or before it */
    int mine = e->step == step && !strcmp(e->module, mod->name);
    const char *then = !mine ? ", and fsdp_pre_backward did not all-gather it again"
                       : phase_is(e->phase, PHASE_PRE_BACKWARD) ? " itself"
                       : phase_is(e->phase, PHASE_RECOMPUTE_PRE_FORWARD) || phase_is(e->phase, PHASE_RECOMPUTE_POST_FORWARD)
                           ? ", after fsdp_pre_backward, and nothing gathered it again"
                       : ", and fsdp_pre_backward did not all-gather it again";
    fatal("%s: %s has no unsharded data for the backward (%s is NULL): its unsharded buffer '%s' was freed in %s%s%s%s",
          mod->name, q->name, field, e->name ? e->name : "?", who, then, not_recomputed, why);
}

void probe_params_ready(Dev *dev, Probes *p, const Module *mod, int step, const char *hook, int backward) {
    const void *ptrs[MODULE_MAX_PARAMS];
    const char *field = p->param_bf16 ? "Param.data_bf16" : "Param.data";
    const char *why = p->param_bf16 ? " (--param-dtype bf16: compute reads Param.data_bf16; a stage before 08 "
                                      "sets only Param.data)" : "";
    size_t elems = 0;
    for (int j = 0; j < mod->n_params; j++) {
        const Param *q = &mod->params[j];
        ptrs[j] = p->param_bf16 ? (const void *)q->data_bf16 : (const void *)q->data;
        if (!ptrs[j]) {
            if (backward) no_data_for_backward(dev, p, mod, j, step, field, why);
            fatal("%s: %s has no unsharded data after fsdp_pre_forward (%s is NULL)%s", mod->name, q->name, field,
                  why);
        }
        elems += q->numel;
    }
    capture(dev, &p->params, ptrs, mod->n_params);
    for (int j = 0; p->last_data && j < mod->n_params; j++)
        if (p->params.id[j]) p->last_data[mod->index * MODULE_MAX_PARAMS + j] = p->params.id[j];
    Json f = {0};
    note_begin(&f, step, mod->name, hook);
    size_field(&f, "unsharded_param_bytes", still_live_bytes(dev, &p->params));
    size_field(&f, "unsharded_param_elems", elems);
    /* what holds the unsharded params, for the mixed-precision check: their bytes per element, and
     * with bf16 any float32 Param.data kept beside them */
    if (p->param_bf16) {
        Captured f32;
        const void *data[MODULE_MAX_PARAMS];
        for (int j = 0; j < mod->n_params; j++) data[j] = mod->params[j].data;
        capture(dev, &f32, data, mod->n_params);
        size_field(&f, "unsharded_f32_bytes", still_live_bytes(dev, &f32));
    }
    micro_fields(&f, dev, mod);
    note_end(dev, &f, "hook_check");
    /* the check reads device memory on the host; a dry run has no values to check */
    if (dev_is_cuda_build() || dev_dry_run(dev) || !p->history) return;
    ParamsCheck c = {mod, p, hook, step, dev_rank(dev), dev_world_size(dev), dev_rank(dev), p->param_bf16, {0}};
    for (int j = 0; j < mod->n_params; j++)
        if (mod->params[j].dt.placement == PLACEMENT_FLAT) {
            c.flat_rank = flat_rank(&mod->params[j].dt, c.rank);
            break;
        }
    for (int j = 0; j < mod->n_params; j++) c.data[j] = ptrs[j];
    Stream *cs = dev_compute_stream(dev);
    int tracing = dev_tracing(dev);
    dev_set_tracing(dev, 0); /* not the student's compute: kept out of the trace and its overlap figures */
    KernelCost free_ = {.cls = COST_FREE}; /* nor on the modelled clock */
    dev_launch(cs, "params_check", &free_, kcpu_params_check, &c, sizeof c);
    dev_set_tracing(dev, tracing);
}

void probe_grads_allocated(Dev *dev, Probes *p, const Module *mod) {
    const void *grads[MODULE_MAX_PARAMS];
    for (int j = 0; j < mod->n_params; j++) grads[j] = mod->params[j].grad;
    capture(dev, &p->grads, grads, mod->n_params);
}

void probe_after_post_forward(Dev *dev, const Probes *p, int step, const Module *mod) {
    hook_check_bytes(dev, step, mod, phase_name(PHASE_POST_FORWARD), "unsharded_param_live_bytes", still_live_bytes(dev, &p->params));
}

void probe_after_post_backward(Dev *dev, const Probes *p, int step, const Module *mod) {
    hook_check_bytes(dev, step, mod, phase_name(PHASE_POST_BACKWARD), "unsharded_grad_live_bytes", still_live_bytes(dev, &p->grads));
    hook_check_bytes(dev, step, mod, phase_name(PHASE_POST_BACKWARD), "unsharded_param_live_bytes", still_live_bytes(dev, &p->params));
}

/* ------------------------------------------------- the grad-state probe */

/* n floats at src into *buf (grown to cap): their sum of squares in float64, in index order. */
static double read_sumsq(Dev *dev, const float *src, size_t n, float **buf, size_t *cap) {
    if (n > *cap) {
        free(*buf);
        *buf = xmalloc(n * sizeof(float));
        *cap = n;
    }
    dev_probe_read(dev, *buf, src, n * sizeof(float));
    double s = 0;
    for (size_t i = 0; i < n; i++) s += (double)(*buf)[i] * (double)(*buf)[i];
    return s;
}

/* A param's gradient state now (kind GRAD_KEPT: its unsharded Param.grad;
 * GRAD_SHARD: its DTensor.grad's local rows), n floats at src: adds its sum of
 * squares to *sumsq and, if c->before holds the same kind of state of the
 * same length (the previous microbatch's), its dot product with it to *dot
 * (and 1 to *n_dot), in float64; the state becomes c->before for the next one. */
static void track_state(Dev *dev, GradCopy *c, GradKind kind, const float *src, size_t n, double *sumsq, double *dot,
                        int *n_dot) {
    size_t cap = c->cap;
    *sumsq += read_sumsq(dev, src, n, &c->now, &cap);
    if (cap != c->cap) { /* grown: `before` no longer fits this param's state */
        free(c->before);
        c->before = xmalloc(cap * sizeof(float));
        c->cap = cap;
        c->before_kind = GRAD_NONE;
    }
    if (c->before_kind == kind && c->before_n == n) {
        double d = 0;
        for (size_t i = 0; i < n; i++) d += (double)c->now[i] * (double)c->before[i];
        *dot += d;
        (*n_dot)++;
    }
    float *t = c->before;
    c->before = c->now;
    c->now = t;
    c->before_kind = kind;
    c->before_n = n;
}

/* JSON number, or null when `has` is 0 */
static void g_or_null(Json *f, int has, double v) {
    if (has) json_g(f, v, 17);
    else json_null(f);
}

/* Before the optimizer: each DTensor.grad's padding rows [local_rows, padded_rows) read back (CPU backend, not a
 * dry run). FSDP2 keeps them zero, as the shards' own: the reduce-scatter input's padding rows are zeroed, so the
 * padding of its output is too. Nothing is noted when every one is zero (a correct run's log is unchanged); else
 * one "grad_padding" note names the first param whose padding is not, what it holds, and how many params share
 * the fault. A DTensor.grad outside one live allocation is not read (the grad-state probe says so). A flat unit
 * (device.h, PLACEMENT_FLAT) is judged once, at its first param: its [S] grad shard's elements outside every
 * piece (local_rows: the pieces' elements, padded_rows: S, and "flat_unit": the unit's first module). */
void probe_grad_padding(Dev *dev, const Probes *p, int step) {
    if (dev_is_cuda_build() || dev_dry_run(dev)) return;
    const Model *m = p->model;
    const Module *first_mod = NULL;
    const Param *first = NULL;
    size_t first_nan = 0, first_nonzero = 0, first_local = 0, first_padded = 0;
    int bad = 0, first_unit = -1;
    float *buf = NULL;
    size_t cap = 0;
    int n_units = 0;
    FlatUnit *units = NULL; /* scanned when the first flat param is met */
    for (int i = 0; i < m->n_modules; i++)
        for (int j = 0; j < m->modules[i].n_params; j++) {
            const Param *q = &m->modules[i].params[j];
            const DTensor *dt = &q->dt;
            if (dt->placement == PLACEMENT_FLAT) {
                if (!units && !n_units) units = flat_units(dev, m, flat_rank(dt, dev_rank(dev)), 1, &n_units);
                for (int u = 0; u < n_units; u++) {
                    const FlatUnit *fu = &units[u];
                    if (fu->first != q || !fu->read || !fu->nonzero) continue; /* judged at its first param */
                    if (!bad++) {
                        first_mod = &m->modules[i];
                        first = q;
                        first_nan = fu->nan;
                        first_nonzero = fu->nonzero;
                        first_local = fu->covered;
                        first_padded = fu->S;
                        first_unit = fu->unit;
                    }
                }
                continue;
            }
            if (!dt->grad || dt->padded_rows <= dt->local_rows) continue;
            size_t lo = dt->local_rows * dt->row_numel, hi = dt->padded_rows * dt->row_numel; /* padding: [lo, hi) */
            if (!readable(dev, dt->grad, hi * sizeof(float))) continue;
            if (hi - lo > cap) {
                free(buf);
                cap = hi - lo;
                buf = xmalloc(cap * sizeof(float));
            }
            dev_probe_read(dev, buf, dt->grad + lo, (hi - lo) * sizeof(float));
            size_t nan = 0, nonzero = 0;
            for (size_t e = 0; e < hi - lo; e++) {
                nan += isnan(buf[e]) != 0;
                nonzero += buf[e] != 0.0f; /* NaN too */
            }
            if (!nonzero) continue;
            if (!bad++) {
                first_mod = &m->modules[i];
                first = q;
                first_nan = nan;
                first_nonzero = nonzero;
                first_local = dt->local_rows;
                first_padded = dt->padded_rows;
            }
        }
    free(buf);
    free(units);
    if (!bad) return;
    size_t row_numel = first_unit >= 0 ? 1 : first->dt.row_numel;
    Json f = {0};
    note_begin(&f, step, first_mod->name, phase_name(PHASE_OPTIMIZER));
    json_key_string(&f, "param", first->name);
    size_field(&f, "local_rows", first_local);
    size_field(&f, "padded_rows", first_padded);
    size_field(&f, "padding_values", (first_padded - first_local) * row_numel);
    size_field(&f, "nonzero", first_nonzero);
    size_field(&f, "nan", first_nan);
    json_key_int(&f, "params", bad);
    if (first_unit >= 0) { /* a flat unit's shard: named by its first module */
        json_key(&f, "flat_unit");
        if (first_unit < m->n_modules) json_string(&f, m->modules[first_unit].name);
        else json_int(&f, first_unit);
    }
    note_end(dev, &f, "grad_padding");
}

void probe_grad_state(Dev *dev, Probes *p, int step) {
    int k = dev_scope_microbatch(dev);
    if (k < 0 || dev_is_cuda_build() || !p->grad_state) return; /* one batch per step; the CPU backend only */
    Json f = {0};
    note_begin(&f, step, "root", phase_name(PHASE_FINISH_BACKWARD));
    micro_fields(&f, dev, NULL);
    if (dev_dry_run(dev)) { /* no gradient values: the note says so, and keeps its place in the event log */
        json_key(&f, "dry_run");
        json_bool(&f, 1);
        note_end(dev, &f, "grad_state");
        return;
    }
    const Model *m = p->model;
    double total[2] = {0, 0}, total_dot = 0;
    int count[2] = {0, 0}, unreadable = 0, dot_params = 0;
    json_key(&f, "by_module");
    json_object_begin(&f);
    for (int i = 0; i < m->n_modules; i++) {
        const Module *mod = &m->modules[i];
        double sum[2] = {0, 0}, dot = 0;
        int has[2] = {0, 0}, n_dot = 0;
        for (int j = 0; j < mod->n_params; j++) {
            const Param *q = &mod->params[j];
            const DTensor *dt = &q->dt;
            GradCopy *c = &p->grad_state[i * MODULE_MAX_PARAMS + j];
            size_t n = dt->local_rows * dt->row_numel;
            if (k == 0) c->before_kind = GRAD_NONE; /* the optimizer consumed the last step's */
            int shard_ok = dt->grad && (!n || readable(dev, dt->grad, n * sizeof(float)));
            if (dt->grad) {
                has[1] = 1;
                count[1]++;
                unreadable += !shard_ok;
            }
            if (q->grad) { /* kept by the loop (after_post_backward): a live allocation of numel floats */
                has[0] = 1;
                count[0]++;
            }
            /* the state compared across microbatches: the grad shard, else the kept Param.grad */
            if (shard_ok) track_state(dev, c, GRAD_SHARD, dt->grad, n, &sum[1], &dot, &n_dot);
            else if (q->grad) track_state(dev, c, GRAD_KEPT, q->grad, q->numel, &sum[0], &dot, &n_dot);
            else c->before_kind = GRAD_NONE;
            if (shard_ok && q->grad) sum[0] += read_sumsq(dev, q->grad, q->numel, &p->spare, &p->spare_cap);
        }
        total[0] += sum[0];
        total[1] += sum[1];
        total_dot += dot;
        dot_params += n_dot;
        json_key(&f, mod->name);
        json_array_begin(&f);
        g_or_null(&f, has[0], sum[0]);
        g_or_null(&f, has[1], sum[1]);
        g_or_null(&f, n_dot > 0, dot);
        json_array_end(&f);
    }
    json_object_end(&f);
    json_key(&f, "unsharded_grad_sumsq");
    json_g(&f, total[0], 17);
    json_key_int(&f, "unsharded_grads", count[0]);
    json_key(&f, "grad_shard_sumsq");
    json_g(&f, total[1], 17);
    json_key_int(&f, "grad_shards", count[1]);
    json_key_int(&f, "grad_shards_unreadable", unreadable);
    json_key(&f, "dot_previous");
    g_or_null(&f, dot_params > 0, total_dot);
    json_key_int(&f, "dot_params", dot_params);
    note_end(dev, &f, "grad_state");
}
