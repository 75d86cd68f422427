/* alloc.c — the per-rank tagged allocator: counts in host call order, a treap
 * of live allocations keyed by address (exact and "containing" lookups in
 * O(log n)), stream-safe deferred frees, poison, and the memory event log. */
#include "runtime/internal.h"
#include "runtime/util.h"

#include <stdlib.h>
#include <string.h>

static const char *const TAG_NAMES[MEM_TAG_COUNT] = {
    "param", "param_shard", "unsharded_param", "grad_shard", "unsharded_grad",
    "activation", "optim_state", "comm_buffer", "temp",
};

const char *mem_tag_name(MemTag tag) {
    if ((int)tag < 0 || tag >= MEM_TAG_COUNT) return "unknown";
    return TAG_NAMES[tag];
}

/* ----------------------------------------------------------------- treap */

static Alloc *treap_merge(Alloc *a, Alloc *b) { /* every key of a < every key of b */
    if (!a) return b;
    if (!b) return a;
    if (a->prio > b->prio) {
        a->right = treap_merge(a->right, b);
        return a;
    }
    b->left = treap_merge(a, b->left);
    return b;
}

static void treap_split(Alloc *t, uintptr_t key, Alloc **lo, Alloc **hi) { /* lo: < key */
    if (!t) {
        *lo = *hi = NULL;
    } else if (t->addr < key) {
        treap_split(t->right, key, &t->right, hi);
        *lo = t;
    } else {
        treap_split(t->left, key, lo, &t->left);
        *hi = t;
    }
}

static Alloc *treap_remove(Alloc *t, uintptr_t key) {
    if (!t) return NULL;
    if (t->addr == key) return treap_merge(t->left, t->right);
    if (key < t->addr) t->left = treap_remove(t->left, key);
    else t->right = treap_remove(t->right, key);
    return t;
}

/* The live allocation with the largest address <= key. */
static Alloc *treap_floor(Alloc *t, uintptr_t key) {
    Alloc *best = NULL;
    while (t) {
        if (t->addr == key) return t;
        if (t->addr < key) {
            best = t;
            t = t->right;
        } else {
            t = t->left;
        }
    }
    return best;
}

/* ------------------------------------------------------------ event log */

static MemEvent *mev_push(Dev *d) {
    if (d->n_mev == d->mev_cap) {
        d->mev_cap = d->mev_cap ? d->mev_cap * 2 : 1024;
        d->mev = xrealloc(d->mev, d->mev_cap * sizeof *d->mev);
    }
    MemEvent *e = &d->mev[d->n_mev++];
    memset(e, 0, sizeof *e);
    return e;
}

static void mev_from_alloc(MemEvent *e, const Alloc *a) {
    e->addr = a->addr;
    e->size = a->size;
    e->tag = a->tag;
    e->name = a->name;
}

/* -------------------------------------------------------- deferred frees */

#ifndef HWFSDP_CUDA
/* CPU backend: storage is the C heap; a fence is each stream's count of ops
 * enqueued at free time, ready when every stream's worker has passed it. */
void *backend_storage_alloc(Dev *d, size_t bytes, const char *name) {
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes) != 0 || !p)
        fatal("rank %d: out of memory allocating %zu bytes for '%s' (%zu bytes allocated now)", d->rank, bytes,
              name ? name : "?", d->current);
    if (d->world->cfg.poison) {
        uint32_t nan_bits = 0x7fc00000u;
        size_t nf = bytes / 4;
        uint32_t *w = p;
        for (size_t i = 0; i < nf; i++) w[i] = nan_bits;
    }
    d->reserved += bytes;
    return p;
}

void backend_storage_free(Dev *d, void *p, size_t bytes) {
    free(p);
    d->reserved -= bytes;
}

int backend_fence_create(Dev *d, PendingFree *pf) {
    pf->snapshot = xmalloc((size_t)(d->nstreams ? d->nstreams : 1) * sizeof(uint64_t));
    pf->nstreams = d->nstreams;
    int busy = 0;
    for (int i = 0; i < d->nstreams; i++) {
        Stream *s = d->streams[i];
        pthread_mutex_lock(&s->mu);
        pf->snapshot[i] = s->enqueued;
        busy |= s->completed < s->enqueued;
        pthread_mutex_unlock(&s->mu);
    }
    return busy;
}

int backend_fence_ready(Dev *d, const PendingFree *p) {
    for (int i = 0; i < p->nstreams; i++)
        if (stream_completed(d->streams[i]) < p->snapshot[i]) return 0;
    return 1;
}

void backend_fence_release(Dev *d, PendingFree *pf) {
    (void)d;
    free(pf->snapshot);
    pf->snapshot = NULL;
}
#endif

static size_t storage_bytes(size_t bytes) { return bytes ? (bytes + 63) / 64 * 64 : 64; }

static void free_storage(Dev *d, Alloc *a) {
    backend_storage_free(d, (void *)a->addr, storage_bytes(a->size));
    race_alloc_free(a);
    free(a);
}

static void release(Dev *d, PendingFree *p) {
    MemEvent *e = mev_push(d);
    e->kind = MEV_FREE_DONE;
    mev_from_alloc(e, p->alloc);
    e->module = p->alloc->module;
    e->phase = p->alloc->phase;
    e->step = p->alloc->step;
    e->time_us = now_us() - d->world->epoch_us;
    e->current_bytes = d->current;
    backend_fence_release(d, p);
    d->frees_released++;
    if (p->alloc->quarantined) p->alloc->released = 1; /* storage held until it leaves the quarantine */
    else free_storage(d, p->alloc);
}

/* Return to the system every deferred free whose streams have moved past it.
 * Snapshots only grow in FIFO order, so stop at the first one not ready. */
void dev_release_pending_frees(Dev *d, int wait_all) {
    while (d->pend_count) {
        PendingFree *p = &d->pending[d->pend_head];
        if (!wait_all && !backend_fence_ready(d, p)) break;
        release(d, p);
        d->pend_head = (d->pend_head + 1) % d->pend_cap;
        d->pend_count--;
    }
}

static void push_pending(Dev *d, PendingFree pf) {
    if (d->pend_count == d->pend_cap) {
        size_t ncap = d->pend_cap ? d->pend_cap * 2 : 64;
        PendingFree *np = xmalloc(ncap * sizeof *np);
        for (size_t i = 0; i < d->pend_count; i++) np[i] = d->pending[(d->pend_head + i) % d->pend_cap];
        free(d->pending);
        d->pending = np;
        d->pend_cap = ncap;
        d->pend_head = 0;
    }
    d->pending[(d->pend_head + d->pend_count++) % d->pend_cap] = pf;
}

/* ------------------------------------------------ use-after-free quarantine */

/* With the race detector on, a freed allocation stays findable (dead tree)
 * and its storage is held back for the next QUARANTINE_FREES frees or
 * QUARANTINE_BYTES bytes (host order, so deterministic): no new allocation or
 * host malloc can take the address meanwhile. The stream-safe release (counts,
 * memory events) is unchanged; only the storage's return to the system waits
 * for both the release and the end of the quarantine. */
#define QUARANTINE_FREES 256
#define QUARANTINE_BYTES ((size_t)32 << 20)

static void quarantine_evict_one(Dev *d) {
    Alloc *a = d->quarantine[d->quar_head];
    d->quar_head = (d->quar_head + 1) % d->quar_cap;
    d->quar_count--;
    d->quar_bytes -= a->size;
    d->dead_root = treap_remove(d->dead_root, a->addr);
    a->left = a->right = NULL;
    a->quarantined = 0;
    if (a->released) free_storage(d, a);
}

static void quarantine(Dev *d, Alloc *a) {
    if (d->quar_count == d->quar_cap) {
        size_t ncap = d->quar_cap ? d->quar_cap * 2 : 64;
        Alloc **nq = xmalloc(ncap * sizeof *nq);
        for (size_t i = 0; i < d->quar_count; i++) nq[i] = d->quarantine[(d->quar_head + i) % d->quar_cap];
        free(d->quarantine);
        d->quarantine = nq;
        d->quar_cap = ncap;
        d->quar_head = 0;
    }
    d->quarantine[(d->quar_head + d->quar_count++) % d->quar_cap] = a;
    d->quar_bytes += a->size;
    a->quarantined = 1;
    Alloc *lo, *hi;
    treap_split(d->dead_root, a->addr, &lo, &hi);
    d->dead_root = treap_merge(treap_merge(lo, a), hi);
    while (d->quar_count > QUARANTINE_FREES || (d->quar_count && d->quar_bytes > QUARANTINE_BYTES))
        quarantine_evict_one(d);
}

static Alloc *containing(Alloc *root, uintptr_t p) {
    Alloc *a = treap_floor(root, p);
    if (!a || p - a->addr >= a->size) return NULL;
    return a;
}
Alloc *dev_live_alloc_containing(const Dev *d, uintptr_t p) { return containing(d->live_root, p); }
Alloc *dev_dead_alloc_containing(const Dev *d, uintptr_t p) { return containing(d->dead_root, p); }

/* --------------------------------------------------------------- alloc */

void *dev_alloc(Dev *d, size_t bytes, MemTag tag, const char *name) {
    if ((int)tag < 0 || tag >= MEM_TAG_COUNT) fatal("dev_alloc('%s'): bad memory tag %d", name ? name : "?", (int)tag);
    dev_release_pending_frees(d, 0);
    size_t real = storage_bytes(bytes); /* 0 bytes still get a unique address */
    if (real < bytes) fatal("dev_alloc('%s'): %zu bytes is too large", name ? name : "?", bytes);
    void *p = backend_storage_alloc(d, real, name);
    Alloc *a = xcalloc(1, sizeof *a);
    a->addr = (uintptr_t)p;
    a->size = bytes;
    a->tag = tag;
    a->name = dev_intern(d, name ? name : "");
    a->module = d->module;
    a->phase = d->phase;
    a->step = d->step;
    a->seq = ++d->mem_seq;
    a->race.writer = -1;
    a->time_us = now_us() - d->world->epoch_us;
    /* xorshift priorities: deterministic, balanced in expectation */
    d->prio_state ^= d->prio_state << 13;
    d->prio_state ^= d->prio_state >> 7;
    d->prio_state ^= d->prio_state << 17;
    a->prio = (uint32_t)(d->prio_state >> 16);
    Alloc *lo, *hi;
    treap_split(d->live_root, a->addr, &lo, &hi);
    d->live_root = treap_merge(treap_merge(lo, a), hi);
    d->n_live++;

    d->current += bytes;
    d->by_tag[tag] += bytes;
    if (d->current > d->peak) d->peak = d->current;

    MemEvent *e = mev_push(d);
    e->kind = MEV_ALLOC;
    e->seq = a->seq;
    mev_from_alloc(e, a);
    e->module = a->module;
    e->phase = a->phase;
    e->step = a->step;
    e->time_us = a->time_us;
    e->current_bytes = d->current;
    return p;
}

float *dev_alloc_f32(Dev *d, size_t count, MemTag tag, const char *name) {
    if (count > SIZE_MAX / sizeof(float)) fatal("dev_alloc_f32('%s'): %zu floats is too large", name ? name : "?", count);
    return dev_alloc(d, count * sizeof(float), tag, name);
}

void dev_free(Dev *d, void *p) {
    if (!p) return;
    Alloc *a = treap_floor(d->live_root, (uintptr_t)p);
    if (!a || a->addr != (uintptr_t)p) fatal("dev_free: %p is not a live allocation of rank %d (double free?)", p, d->rank);
    d->live_root = treap_remove(d->live_root, a->addr);
    a->left = a->right = NULL;
    d->n_live--;
    d->current -= a->size;
    d->by_tag[a->tag] -= a->size;

    MemEvent *e = mev_push(d);
    e->kind = MEV_FREE;
    e->seq = ++d->mem_seq;
    mev_from_alloc(e, a);
    e->module = d->module;
    e->phase = d->phase;
    e->step = d->step;
    e->time_us = now_us() - d->world->epoch_us;
    e->current_bytes = d->current;

    /* Stream-safe: the storage may be in use by any op enqueued so far. */
    PendingFree pf = {a, NULL, 0, NULL};
    if (backend_fence_create(d, &pf)) d->frees_deferred++;
    a->free_module = d->module;
    a->free_phase = d->phase;
    push_pending(d, pf);
    if (d->race_on) quarantine(d, a);
    dev_release_pending_frees(d, 0);
}

size_t dev_mem_current(const Dev *d) { return d->current; }
size_t dev_mem_peak(const Dev *d) { return d->peak; }
size_t dev_mem_reserved(const Dev *d) { return d->reserved; }
void dev_mem_reset_peak(Dev *d) { d->peak = d->current; }
size_t dev_mem_current_by_tag(const Dev *d, MemTag tag) {
    if ((int)tag < 0 || tag >= MEM_TAG_COUNT) return 0;
    return d->by_tag[tag];
}

size_t dev_mem_live_size_containing(const Dev *d, const void *p) {
    Alloc *a = treap_floor(d->live_root, (uintptr_t)p);
    if (!a || (uintptr_t)p - a->addr >= a->size) return 0;
    return a->size;
}

uint64_t dev_mem_live_id_containing(const Dev *d, const void *p) {
    Alloc *a = treap_floor(d->live_root, (uintptr_t)p);
    if (!a || (uintptr_t)p - a->addr >= a->size) return 0;
    return a->seq;
}

void dev_mem_note(Dev *d, const char *kind, const char *json_fields) {
    MemEvent *e = mev_push(d);
    e->kind = MEV_NOTE;
    e->seq = ++d->mem_seq;
    e->name = dev_intern(d, kind ? kind : "note");
    e->json = xstrdup(json_fields ? json_fields : "");
    e->module = d->module;
    e->phase = d->phase;
    e->step = d->step;
    e->time_us = now_us() - d->world->epoch_us;
    e->current_bytes = d->current;
}

static void free_tree(Dev *d, Alloc *t) {
    if (!t) return;
    free_tree(d, t->left);
    free_tree(d, t->right);
    free_storage(d, t);
}

/* At Dev destroy (streams already idle and joined). */
void dev_alloc_destroy(Dev *d) {
    while (d->pend_count) {
        PendingFree *p = &d->pending[d->pend_head];
        if (p->alloc->quarantined) p->alloc->released = 1;
        else free_storage(d, p->alloc);
        backend_fence_release(d, p);
        d->pend_head = (d->pend_head + 1) % d->pend_cap;
        d->pend_count--;
    }
    free(d->pending);
    while (d->quar_count) quarantine_evict_one(d);
    free(d->quarantine);
    free_tree(d, d->live_root);
    for (size_t i = 0; i < d->n_mev; i++) free(d->mev[i].json);
    free(d->mev);
}
