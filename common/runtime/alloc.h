/* alloc.h — the tagged allocator (alloc.c), with the rules of PyTorch's CUDA
 * caching allocator: every allocation belongs to a stream; dev_free gives the
 * block back to that stream's pool at once (counted bytes drop at the call);
 * a block marked with dev_record_stream is held, and counted, until those
 * streams finished the work queued before the free. Live allocations in a
 * treap by address, counts (current, peak, by tag) in host call order, and
 * the memory-event log the snapshots are written from. */
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
    int stream;                         /* index of the stream whose pool the block belongs to */
    uint64_t recorded;                  /* dev_record_stream: bit i = stream index i */
    RaceState race;                     /* race detector (host thread) */
    const char *free_module, *free_phase; /* scope of dev_free (use-after-free messages) */
    int quarantined, released;          /* race detector: storage held back / storage release done */
    int host;                           /* pinned host memory (dev_alloc_host), not device memory */
} Alloc;

/* MEV_FREE: a plain free, bytes uncounted at the call. A free of a block
 * marked with dev_record_stream is MEV_FREE_REQUESTED at the call (still
 * counted: "active_pending_free") and MEV_FREE_COMPLETED once the recorded
 * streams are past it (uncounted then). */
typedef enum { MEV_ALLOC = 0, MEV_FREE, MEV_FREE_REQUESTED, MEV_FREE_COMPLETED, MEV_NOTE } MemEventKind;

typedef struct {
    MemEventKind kind;
    uint64_t seq;           /* shared by every event (host order) */
    uintptr_t addr;
    size_t size;
    int stream;             /* the block's stream index */
    MemTag tag;
    const char *name, *module, *phase;  /* interned; for notes: name = kind */
    char *json;                         /* notes: owned copy of the fields */
    int step;
    double time_us;
    size_t current_bytes;   /* device bytes (host bytes for a host event) */
    int host;               /* an event of the host pool: "host_events" in the snapshot */
} MemEvent;

/* A freed block waiting for streams: held for dev_record_stream (counted), or
 * (CPU emulator) its storage waiting to go back to the C heap. The fence marks
 * the work queued so far on the streams of `mask`. */
typedef struct {
    Alloc *alloc;           /* detached from the live tree */
    uint64_t mask;          /* the streams the fence covers (bit i = stream index i) */
    void *fence;            /* the backend's mark of their work at free time (CPU: ops enqueued; CUDA: events) */
    /* 1: the count follows the world's clock (dev_record_stream's hold): on the CPU the fence
     * is ready once the host's modelled time passed the modelled end of that work, so the
     * memory count is the same on every run; 0: once that work really ran (storage) */
    int timed;
} PendingFree;

/* The rank's allocator (Dev.mem). Touched only by the rank's host thread. */
typedef struct {
    Alloc *live_root;
    size_t n_live;
    size_t current, peak, by_tag[MEM_TAG_COUNT];
    size_t window_peak, window_by_tag[MEM_TAG_COUNT]; /* the most since dev_mem_window_begin, and by tag then */
    size_t reserved;                    /* storage held (the backend's storage_alloc; CUDA: cudaMalloc'd segments) */
    uint64_t mem_seq;
    uint64_t prio_state;
    MemEvent *mev;
    size_t n_mev, mev_cap;
    PendingFree *held;                  /* blocks freed with dev_record_stream streams still busy */
    size_t n_held, held_cap;
    PendingFree *pending;               /* CPU: FIFO ring of storage waiting for every stream */
    size_t pend_head, pend_count, pend_cap;
    uint64_t frees_deferred;            /* frees whose storage had to wait for a stream */
    uint64_t frees_released;            /* storage actually returned to the system */
    /* the pinned host pool (dev_alloc_host): its own live tree and counts */
    Alloc *host_root;
    size_t host_current, host_peak, host_by_tag[MEM_TAG_COUNT];
    /* the device's memory (dev_mem_watch_capacity): the profile's bytes on the modelled clock (0: no limit),
     * whether allocations are held to it now, and the first one that went over, as one line (NULL: none) */
    size_t capacity;
    int watch_capacity;
    char *over_capacity;
} DevMem;

/* Complete the held (dev_record_stream) frees whose streams are past them:
 * uncounted, "free_completed". Called by dev_alloc and dev_free (as PyTorch's
 * allocator processes its events in malloc and free), so a snapshot taken
 * after a sync may still show them pending. wait_all: all of them. */
void dev_complete_held_frees(Dev *d, int wait_all);
/* Return the storage whose streams are done (wait_all: all of it, streams
 * idle). Called by the allocator and at every host synchronization. */
void dev_release_pending_frees(Dev *d, int wait_all);
void dev_alloc_destroy(Dev *d);
/* The storage behind an allocation of `bytes`: rounded up to DEV_ALLOC_ALIGN,
 * at least that (0 bytes still get a unique address); what a backend is asked
 * for and what the snapshots show as its segment. */
size_t dev_storage_bytes(size_t bytes);
Alloc *dev_live_alloc_containing(const Dev *d, uintptr_t p);
/* A copy's direction across the PCIe link (0: neither, both device, both host,
 * or memory the allocator does not know); clock_copy_cost prices a nonzero one on the link. */
typedef enum { COPY_SAME_SIDE = 0, COPY_H2D, COPY_D2H, COPY_DIR_COUNT } CopyDir;
CopyDir dev_copy_direction(const Dev *d, const void *dst, const void *src);
const char *copy_direction_name(CopyDir dir); /* "copy", "h2d", "d2h": a copy op's name */
Alloc *dev_dead_alloc_containing(const Dev *d, uintptr_t p);
/* The memory event that freed the allocation of id `id` (dev_mem_live_id_containing's: its
 * MEV_FREE, or MEV_FREE_REQUESTED for a held block), from the event log, or of the latest
 * allocation made after it with the same name, size and pool (the same buffer made again);
 * NULL while that one is live, or for an id the log does not hold. Its module, phase and
 * step are the dev_free's scope: who freed it (the driver's messages name that hook). */
const MemEvent *dev_mem_free_event(const Dev *d, uint64_t id);

/* Storage, pinned host storage and fences come from the world's backend
 * (backend.h: storage_alloc ... fence_release). */

#endif
