/* race.h — the stream race detector (race.c): per-allocation access stamps,
 * per-stream vector clocks, and the quarantine of freed allocations that
 * turns a late access into a named use-after-free. See runtime.h for what it
 * checks. Everything here is touched only by the rank's host thread. */
#ifndef HWFSDP_RACE_H
#define HWFSDP_RACE_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "runtime/runtime.h"

typedef struct Alloc Alloc;
typedef struct Op Op;

/* Who accessed a buffer last: an op of one stream at that stream's clock.
 * Everything here is touched only by the rank's host thread (race.c). */
typedef struct {
    uint64_t clock;              /* the op's number on its stream (1-based); 0 = none */
    const char *module, *name;   /* interned: "<module>.<name>" names the op */
    const char *what;            /* interned dev_access label, or NULL */
} RaceStamp;

/* A use of a freed block by a stream other than its owner that nothing had
 * ordered before the dev_free: the block went back to the owner's pool, so
 * whatever that pool hands out next may be this memory. Every later access to
 * a block allocated from that pool must be ordered after the use. */
typedef struct {
    int stream;                  /* the stream whose use is pending */
    RaceStamp use;               /* its op (clock on that stream) */
    int wrote;                   /* it writes (else reads) */
    const char *freed;           /* interned name of the freed block */
    int freed_tag;               /* its MemTag */
    const char *alloc_module, *alloc_phase; /* interned: the scope of its allocation */
    const char *free_module, *free_phase;   /* interned: the scope of the dev_free */
    const char *filled_by;       /* interned op name of the block's last write before the free ("all_gather":
                                    an all-gather output), or NULL: what the block was, for the message */
} PoolDebt;

typedef struct {
    int owner;                   /* the stream whose pool the block came from */
    uint64_t born;               /* owner's clock at the allocation: its earlier work may still use the block */
    int writer;                  /* stream index of the last write; -1 = none yet */
    RaceStamp write;
    RaceStamp *reads;            /* [nreads] per stream index: latest read since the last write */
    int nreads;
    PoolDebt *debts;             /* [ndebts] the owner pool's debts not yet ordered at the allocation */
    int ndebts;
} RaceState;

typedef struct {
    const void *p;
    size_t bytes;
    int write;
    const char *what;            /* interned */
} RaceAccess;

/* An allocation's stamps die with it (alloc.c). */
static inline void race_state_free(RaceState *r) {
    free(r->reads);
    r->reads = NULL;
    free(r->debts);
    r->debts = NULL;
    r->ndebts = 0;
}

/* The rank's detector (Dev.race). */
typedef struct {
    int on;
    int width;                          /* length of every vector clock (= streams so far) */
    uint64_t *host_vc;                  /* what the host has waited for */
    Alloc *dead_root;                   /* freed allocations whose storage is held back (use-after-free) */
    Alloc **quarantine;                 /* FIFO ring of those allocations, in host order */
    size_t quar_head, quar_count, quar_cap, quar_bytes;
} RaceDetector;

void race_on_enqueue(Stream *s, const Op *op);
/* An allocation on stream index `stream`: other streams must be ordered
 * after the owner's work queued so far before they touch it. */
void race_on_alloc(Dev *d, Alloc *a);
/* dev_free: a stream other than the owner (and not recorded with
 * dev_record_stream) that has queued work on the block which the owner's
 * stream and the host are not ordered after leaves a debt on the owner's pool:
 * every block that pool hands out from now on is checked against it (a "free
 * while in use" is a race with whatever reuses the memory, as on a GPU). */
void race_on_free(Dev *d, const Alloc *a);
void race_stream_created(Dev *d, Stream *s);
void race_stream_destroy(Stream *s);
void race_host_waited_stream(Stream *s);
void race_host_waited_all(Dev *d);
void race_host_waited_event(Event *e);
void race_event_free(Event *e);

#endif
