/* device_internal.h — private structures of the CPU runtime (device.h).
 * Only the runtime's own files (world.c, stream.c, alloc.c, collectives.c,
 * artifacts.c) and its white-box tests include this. */
#ifndef HWFSDP_DEVICE_INTERNAL_H
#define HWFSDP_DEVICE_INTERNAL_H

#include "device.h"

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#ifdef HAVE_MPI
#include <mpi.h>
#endif

/* ------------------------------------------------------------ interning */

/* Per-Dev table of immutable strings (module, phase, op and allocation names).
 * Touched only by the rank's host thread; the strings live until the Dev dies,
 * so ops, trace records and memory events can keep plain pointers. */
typedef struct {
    char **slots;   /* open addressing, NULL = empty */
    size_t cap, count;
} InternTable;

const char *dev_intern(Dev *d, const char *s);

/* ---------------------------------------------------------- collectives */

typedef enum { COLL_ALL_GATHER = 0, COLL_REDUCE_SCATTER, COLL_ALL_REDUCE, COLL_BROADCAST, COLL_BARRIER } CollKind;

/* What one rank asked for; ranks must agree on kind, count, op and root. */
typedef struct {
    int32_t kind, op, root, pad;
    uint64_t count;      /* all_gather: send count; reduce_scatter: recv count; else buffer count */
    char label[48];      /* for messages only (not compared) */
} CollDesc;

typedef struct {
    CollDesc desc;
    const float *send;
    float *recv;
    float *scratch;      /* all_reduce: this rank's reduced chunk, read by peers */
} CollPost;

/* Local backend: one rendezvous channel per stream index, shared by all ranks. */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int arrived;
    uint64_t generation;       /* bumped each time all ranks arrived */
    double t_last_arrival;     /* now_us() when the last rank reached the first barrier */
    CollPost posts[WORLD_MAX_RANKS];
} CollChannel;

/* ----------------------------------------------------------------- ops */

typedef enum { OP_LAUNCH = 0, OP_COPY, OP_MEMSET, OP_RECORD, OP_WAIT, OP_COLL } OpKind;

typedef struct {
    OpKind kind;
    int traced;                 /* tracing was on when it was enqueued */
    void (*fn)(void *args);
    const char *name;           /* interned */
    const char *module, *phase; /* interned scope at enqueue */
    int step;
    size_t bytes;               /* copies / collectives, for the trace */
    Event *event;               /* record / wait */
    uint64_t record_no;
    void *dst;                  /* copy / memset / collective recv */
    const void *src;            /* copy / collective send */
    int fill;
    uint64_t coll_seq;          /* per-stream collective number */
    CollDesc coll;
    const char *label;          /* collective: interned label (trace name prefix) */
    union {
        max_align_t align_;
        unsigned char args[DEV_ARGS_MAX];
    };
} Op;

struct Stream {
    Dev *dev;
    int index;
    char *name;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_done;
    Op *ring;
    size_t ring_cap, head, count;   /* count includes the op being executed */
    uint64_t enqueued;              /* ops enqueued so far (host) */
    uint64_t completed;             /* ops finished so far (worker) */
    int stop;
    uint64_t coll_seq;              /* collectives enqueued (host) */
    CollChannel *chan;              /* local backend */
#ifdef HAVE_MPI
    MPI_Comm comm;                  /* mpi backend: a dup of MPI_COMM_WORLD per stream index */
#endif
};

struct Event {
    Dev *dev;
    char *name;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t recorded;    /* records enqueued (host) */
    uint64_t completed;   /* highest record number reached (workers) */
    int refs;             /* queued ops still pointing at this event */
    int destroyed;
};

/* ---------------------------------------------------------------- memory */

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
    uint64_t *snapshot;     /* per stream: ops enqueued at free time */
    int nstreams;
} PendingFree;

/* ----------------------------------------------------------------- trace */

typedef struct {
    const char *prefix, *name;          /* interned; full name "<prefix>.<name>" (no prefix: "<name>") */
    const char *module, *phase;         /* interned scope at enqueue */
    const char *cat;                    /* static string */
    int stream, step;
    double ts, dur;                     /* µs, ts relative to the world epoch */
    size_t bytes;                       /* 0 = not shown */
} TraceRec;

struct Dev {
    World *world;
    int rank, world_size;
    /* scope (host thread) */
    int step;
    const char *module, *phase;
    int tracing;
    InternTable strings;
    /* streams and events (host thread) */
    Stream **streams;
    int nstreams, streams_cap;
    Event **events;
    int nevents, events_cap;
    /* allocator (host thread) */
    Alloc *live_root;
    size_t n_live;
    size_t current, peak, by_tag[MEM_TAG_COUNT];
    uint64_t mem_seq;
    uint64_t prio_state;
    MemEvent *mev;
    size_t n_mev, mev_cap;
    PendingFree *pending;               /* FIFO ring */
    size_t pend_head, pend_count, pend_cap;
    uint64_t frees_deferred;            /* dev_free calls whose release had to wait */
    uint64_t frees_released;            /* storage actually returned to the system */
    /* trace (workers append) */
    pthread_mutex_t trace_mu;
    TraceRec *trace;
    size_t n_trace, trace_cap;
};

struct World {
    WorldConfig cfg;
    int local_ranks, first_local_rank;
    double epoch_us;
    pthread_mutex_t mu;                 /* guards chans */
    CollChannel **chans;
    int nchans, chans_cap;
    /* host barrier / allgather (local backend) */
    pthread_mutex_t host_mu;
    pthread_cond_t host_cv;
    int host_arrived;
    uint64_t host_gen;
    double host_vals[2][WORLD_MAX_RANKS];
    Dev *devs[WORLD_MAX_RANKS];         /* local ranks' Devs, for trace.json */
#ifdef HAVE_MPI
    MPI_Comm host_comm;
    int mpi_initialized_here;
#endif
};

/* cross-file internals */
CollChannel *world_channel(World *w, int stream_index);
void dev_trace_add(Dev *d, const TraceRec *r);
void stream_destroy(Stream *s);
void dev_release_pending_frees(Dev *d, int wait_all);
void dev_alloc_destroy(Dev *d);
void coll_execute(Stream *s, const Op *op);
uint64_t stream_completed(Stream *s);
void stream_op_init(Stream *s, Op *op, int kind, const char *name);
void stream_enqueue_op(Stream *s, const Op *op);

#endif
