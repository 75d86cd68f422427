/* alloc.h — the tagged allocator (alloc.c): live allocations in a treap by
 * address, counted bytes (current, peak, by tag) in host call order, the
 * memory-event log the snapshots are written from, and stream-safe frees
 * (storage released once the streams are past the free). */
#ifndef HWFSDP_ALLOC_H
#define HWFSDP_ALLOC_H

#include <stddef.h>
#include <stdint.h>

#include "runtime/race.h"

typedef struct Alloc {
    uintptr_t addr;
    size_t size;
    MemTag tag;
    const char *name, *module, *phase;  /* interned */
    int step;
    uint64_t seq;
    double time_us;
    uint32_t prio;                      /* treap */
    struct Alloc *left, *right;
    RaceState race;                     /* race detector (host thread) */
    const char *free_module, *free_phase; /* scope of dev_free (use-after-free messages) */
    int quarantined, released;          /* race detector: storage held back / stream-safe release done */
} Alloc;

typedef enum { MEV_ALLOC = 0, MEV_FREE, MEV_FREE_DONE, MEV_NOTE } MemEventKind;

typedef struct {
    MemEventKind kind;
    uint64_t seq;           /* shared by allocs, frees and notes (host order); 0 for MEV_FREE_DONE */
    uintptr_t addr;
    size_t size;
    MemTag tag;
    const char *name, *module, *phase;  /* interned; for notes: name = kind */
    char *json;                         /* notes: owned copy of the fields */
    int step;
    double time_us;
    size_t current_bytes;
} MemEvent;

typedef struct {
    Alloc *alloc;           /* detached from the live tree */
    uint64_t *snapshot;     /* CPU: per stream, ops enqueued at free time */
    int nstreams;
    void *fence;            /* CUDA: events recorded on the streams at free time */
} PendingFree;

/* The rank's allocator (Dev.mem). Touched only by the rank's host thread. */
typedef struct {
    Alloc *live_root;
    size_t n_live;
    size_t current, peak, by_tag[MEM_TAG_COUNT];
    size_t reserved;                    /* storage held (backend_storage_*; CUDA: cudaMalloc'd segments) */
    uint64_t mem_seq;
    uint64_t prio_state;
    MemEvent *mev;
    size_t n_mev, mev_cap;
    PendingFree *pending;               /* FIFO ring */
    size_t pend_head, pend_count, pend_cap;
    uint64_t frees_deferred;            /* dev_free calls whose release had to wait */
    uint64_t frees_released;            /* storage actually returned to the system */
} DevMem;

void dev_release_pending_frees(Dev *d, int wait_all);
void dev_alloc_destroy(Dev *d);
Alloc *dev_live_alloc_containing(const Dev *d, uintptr_t p);
Alloc *dev_dead_alloc_containing(const Dev *d, uintptr_t p);

/* Backend hooks (CPU: stream.c; CUDA: cuda/runtime_cuda.c).
 * Storage for an allocation of `bytes` (a multiple of 64, > 0), fatal when
 * out of memory; backend_storage_free returns it. Both keep d->mem.reserved. */
void *backend_storage_alloc(Dev *d, size_t bytes, const char *name);
void backend_storage_free(Dev *d, void *p, size_t bytes);
/* Stream-safe frees: at dev_free the fence marks the work queued so far on
 * every stream of the rank; the storage is released once the fence is ready.
 * backend_fence_create returns 1 if some stream was still busy. */
int backend_fence_create(Dev *d, PendingFree *pf);
int backend_fence_ready(Dev *d, const PendingFree *pf);
void backend_fence_release(Dev *d, PendingFree *pf);

#endif
