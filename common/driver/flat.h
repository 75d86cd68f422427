/* flat.h — the driver's reading of a flat DTensor (device.h, PLACEMENT_FLAT;
 * stage 13, FSDP1's FlatParameter): which elements of a param a rank holds,
 * and where they sit in the unit's [S] shard. Used by the probes and the
 * checkpoint code, which judge the student's DTensors against it. */
#ifndef HWFSDP_FLAT_H
#define HWFSDP_FLAT_H

#include <stddef.h>

#include "hw_fsdp.h"

/* clamp(a - b, 0, hi) without going below zero in size_t */
static inline size_t flat_clamp_diff(size_t a, size_t b, size_t hi) {
    return a <= b ? 0 : (a - b < hi ? a - b : hi);
}

/* Rank r's piece of a flat param: its elements [start, start + count) of the
 * param's numel, stored at element `at` of the rank's [S] shard of the unit. */
typedef struct {
    size_t start; /* row_offset = clamp(r*S - flat_offset, 0, numel) */
    size_t count; /* local_rows = clamp((r+1)*S - flat_offset, 0, numel) - start */
    size_t at;    /* clamp(flat_offset + start - r*S, 0, S): S for a piece past this rank's, 0 before */
} FlatPiece;

static inline FlatPiece flat_piece(size_t numel, size_t flat_offset, size_t S, size_t r) {
    size_t lo = flat_clamp_diff(r * S, flat_offset, numel), hi = flat_clamp_diff((r + 1) * S, flat_offset, numel);
    FlatPiece p = {lo, hi - lo, flat_clamp_diff(flat_offset + lo, r * S, S)};
    return p;
}

/* The piece a flat param's DTensor fields say this rank holds: rank r's by the formula. */
static inline FlatPiece flat_piece_of(const Param *p, size_t r) {
    return flat_piece(p->numel, p->dt.flat_offset, p->dt.flat_shard_numel, r);
}

/* Do the DTensor's own fields describe rank r's piece (row_offset, local_rows, the 1-D view)? */
static inline int flat_fields_agree(const Param *p, size_t r) {
    const DTensor *dt = &p->dt;
    FlatPiece q = flat_piece_of(p, r);
    return dt->flat_shard_numel > 0 && dt->row_numel == 1 && dt->global_rows == p->numel &&
           dt->row_offset == q.start && dt->local_rows == q.count && dt->padded_rows == q.count;
}

/* This rank's number in a flat DTensor's shard group (the world without a mesh). */
static inline int flat_rank(const DTensor *dt, int dev_rank) {
    return dt->mesh && dt->mesh->shard_group ? pg_rank(dt->mesh->shard_group) : dev_rank;
}

/* --bucket-mb's rule (FsdpConfig.bucket_bytes; run.json's "flat_units"): greedy over the modules in forward
 * order, a unit takes consecutive modules until their float32 params hold at least bucket_bytes (0: every
 * module is a unit of its own; the last unit may hold less). unit_of[i] = Module.index of the first module of
 * module i's unit; returns the number of units. */
static inline int flat_bucket_units(const Model *m, size_t bucket_bytes, int *unit_of) {
    int n = 0, first = 0;
    size_t bytes = 0;
    for (int i = 0; i < m->n_modules; i++) {
        if (i == 0 || bytes >= bucket_bytes) { /* the previous unit is full: module i opens the next */
            first = i;
            bytes = 0;
            n++;
        }
        unit_of[i] = first;
        for (int j = 0; j < m->modules[i].n_params; j++) bytes += m->modules[i].params[j].numel * sizeof(float);
    }
    return n;
}

/* Does any param of m have a flat placement (a stage 13 layout)? */
static inline int flat_any(const Model *m) {
    for (int i = 0; i < m->n_modules; i++)
        for (int j = 0; j < m->modules[i].n_params; j++)
            if (m->modules[i].params[j].dt.placement == PLACEMENT_FLAT) return 1;
    return 0;
}

#endif
