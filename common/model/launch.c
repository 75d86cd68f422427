/* launch.c — the launch helpers device.h offers student code: the
 * squared-norm accumulation, an element-wise add (accumulating grad shards),
 * the bfloat16 casts (mixed precision: one range, or a list of them in one
 * launch) and the AdamW update of a shard, as
 * stream kernels with their race-detector annotations and their costs on the
 * modelled clock. */
#include <stdio.h>
#include <stdlib.h>

#include "model/costs.h"
#include "model/kernels.h"
#include "runtime/runtime.h"
#include "runtime/util.h"

void launch_sumsq_accumulate(Stream *s, float *acc, const float *x, size_t n) {
    SumsqArgs a = {acc, x, n};
    dev_access(s, x, n * sizeof(float), 0, NULL);
    dev_access(s, acc, sizeof(float), 1, NULL);
    KernelCost c = kcost_elementwise(2.0 * (double)n, 4.0 * (double)n);
    dev_launch(s, "grad_sumsq", &c, KERNEL(s, sumsq_accumulate), &a, sizeof a);
}

void launch_add(Stream *s, float *out, const float *a, const float *b, size_t n) {
    AddArgs x = {out, a, b, n, 0};
    dev_access(s, a, n * sizeof(float), 0, NULL);
    dev_access(s, b, n * sizeof(float), 0, NULL);
    dev_access(s, out, n * sizeof(float), 1, NULL);
    KernelCost c = kcost_elementwise((double)n, 12.0 * (double)n);
    dev_launch(s, "add", &c, KERNEL(s, add), &x, sizeof x);
}

void launch_cast_to_bf16(Stream *s, Bf16 *out, const float *in, size_t n) {
    CastArgs x = {(float *)in, out, n};
    dev_access(s, in, n * sizeof(float), 0, NULL);
    dev_access(s, out, n * sizeof(Bf16), 1, NULL);
    KernelCost c = kcost_elementwise((double)n, 6.0 * (double)n);
    dev_launch(s, "cast_to_bf16", &c, KERNEL(s, cast_to_bf16), &x, sizeof x);
}

/* One kernel over the whole list: checked here (one line each), every range
 * told to the race detector, the list handed to dev_launch_list (read now). */
void launch_cast_batch_to_bf16(Stream *s, const char *name, const CastCopy *list, size_t n) {
    check_batch_call("launch_cast_batch_to_bf16", s, name, list, n, "casts");
    size_t total = 0; /* elements of all the casts */
    for (size_t i = 0; i < n; i++) {
        const CastCopy *c = &list[i];
        if (!c->n) continue;
        if (!c->dst || !c->src)
            fatal("launch_cast_batch_to_bf16('%s'): cast %zu has a NULL %s with %zu elements", name, i,
                  c->dst ? "source" : "destination", c->n);
        if (c->n > (SIZE_MAX / sizeof(float)) - total)
            fatal("launch_cast_batch_to_bf16('%s'): the casts' elements overflow", name);
        total += c->n;
    }
    if (!n) return; /* nothing to launch, as an empty foreach */
    BatchRange *r = xmalloc(2 * n * sizeof *r); /* what each cast reads and writes, for the overlap check */
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        if (!list[i].n) continue;
        r[m++] = (BatchRange){(uintptr_t)list[i].dst, (uintptr_t)(list[i].dst + list[i].n), i, 1};
        r[m++] = (BatchRange){(uintptr_t)list[i].src, (uintptr_t)(list[i].src + list[i].n), i, 0};
    }
    char who[96];
    snprintf(who, sizeof who, "launch_cast_batch_to_bf16('%s')", name);
    check_batch_disjoint(who, "cast", "casts", r, m);
    free(r);
    for (size_t i = 0; i < n; i++) dev_access(s, list[i].src, list[i].n * sizeof(float), 0, NULL);
    for (size_t i = 0; i < n; i++) dev_access(s, list[i].dst, list[i].n * sizeof(Bf16), 1, NULL);
    CastBatchArgs x = {list, n};
    KernelCost c = kcost_elementwise((double)total, 6.0 * (double)total); /* launch_cast_to_bf16's, once */
    dev_launch_list(s, name, &c, KERNEL(s, cast_batch_to_bf16), &x, sizeof x, list, n * sizeof *list);
}

void launch_cast_from_bf16(Stream *s, float *out, const Bf16 *in, size_t n) {
    CastArgs x = {out, (Bf16 *)in, n};
    dev_access(s, in, n * sizeof(Bf16), 0, NULL);
    dev_access(s, out, n * sizeof(float), 1, NULL);
    KernelCost c = kcost_elementwise((double)n, 6.0 * (double)n);
    dev_launch(s, "cast_from_bf16", &c, KERNEL(s, cast_from_bf16), &x, sizeof x);
}

void launch_adamw(Stream *s, float *param, const float *grad, float *exp_avg, float *exp_avg_sq, size_t n,
                  const AdamWConfig *c, float lr, int t, const float *total_sumsq) {
    AdamArgs a = {param, grad, exp_avg, exp_avg_sq, n, *c, lr, t, total_sumsq, stream_clip_slot(s)};
    dev_access(s, grad, n * sizeof(float), 0, NULL); /* for the race detector */
    dev_access(s, total_sumsq, sizeof(float), 0, NULL);
    dev_access(s, param, n * sizeof(float), 1, NULL);
    dev_access(s, exp_avg, n * sizeof(float), 1, NULL);
    dev_access(s, exp_avg_sq, n * sizeof(float), 1, NULL);
    KernelCost cost = kcost_adamw(n); /* param, m, v read and written; grad read */
    dev_launch(s, "adamw", &cost, KERNEL(s, adamw), &a, sizeof a);
}
