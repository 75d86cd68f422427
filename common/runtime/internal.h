/* device_internal.h — private structures of the CPU runtime (device.h).
 * Only the runtime's own files (world.c, stream.c, alloc.c, collectives.c,
 * artifacts.c) and its white-box tests include this. */
#ifndef HWFSDP_DEVICE_INTERNAL_H
#define HWFSDP_DEVICE_INTERNAL_H

#include "runtime/runtime.h"

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
    uint64_t seq;        /* the poster's per-stream collective number (watchdog messages) */
    const float *send;
    float *recv;
    float *scratch;      /* all_reduce: this rank's reduced chunk, read by peers */
} CollPost;

/* Local backend: one rendezvous channel per stream index, shared by all ranks. */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int arrived;
    uint8_t here[WORLD_MAX_RANKS]; /* ranks waiting in the current barrier (watchdog) */
    uint64_t generation;       /* bumped each time all ranks arrived */
    double t_last_arrival;     /* now_us() when the last rank reached the first barrier */
    CollPost posts[WORLD_MAX_RANKS];
} CollChannel;

/* ------------------------------------------------------- race detector */

/* Who accessed a buffer last: an op of one stream at that stream's clock.
 * Everything here is touched only by the rank's host thread (race.c). */
typedef struct {
    uint64_t clock;              /* the op's number on its stream (1-based); 0 = none */
    const char *module, *name;   /* interned: "<module>.<name>" names the op */
    const char *what;            /* interned dev_access label, or NULL */
} RaceStamp;

typedef struct {
    int writer;                  /* stream index of the last write; -1 = none yet */
    RaceStamp write;
    RaceStamp *reads;            /* [nreads] per stream index: latest read since the last write */
    int nreads;
} RaceState;

typedef struct {
    const void *p;
    size_t bytes;
    int write;
    const char *what;            /* interned */
} RaceAccess;

/* --------------------------------------------------- flight recorder */

#define FLIGHT_DEPTH 16
typedef enum { FLIGHT_ISSUED = 1, FLIGHT_STARTED, FLIGHT_COMPLETED } FlightState;
typedef struct {
    uint64_t seq, count;
    int kind, state;             /* state 0 = slot unused */
    const char *label;           /* interned */
} FlightEntry;
typedef struct {
    const char *stream;          /* the stream's name (lives as long as the Dev) */
    FlightEntry e[FLIGHT_DEPTH]; /* slot seq % FLIGHT_DEPTH */
} FlightRing;

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

struct CudaStream;
struct CudaDev;
struct CudaWorld;

struct Stream {
    Dev *dev;
    struct CudaStream *cuda;        /* CUDA backend state; NULL on the CPU */
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
    /* race detector (host thread) */
    uint64_t *vc;                   /* [dev->race_width] vector clock: what this stream's next op is ordered after */
    RaceAccess *pending;            /* dev_access annotations for the next op */
    int npending, pending_cap;
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
    uint64_t *vc;         /* race detector (host thread): the recording stream's clock at the latest record */
    int vc_n;
    void *cuda_event;     /* CUDA backend: the cudaEvent_t; NULL on the CPU */
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
    struct CudaDev *cuda;               /* CUDA backend state; NULL on the CPU */
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
    size_t reserved;                    /* storage held (backend_storage_*; CUDA: cudaMalloc'd segments) */
    uint64_t mem_seq;
    uint64_t prio_state;
    MemEvent *mev;
    size_t n_mev, mev_cap;
    PendingFree *pending;               /* FIFO ring */
    size_t pend_head, pend_count, pend_cap;
    uint64_t frees_deferred;            /* dev_free calls whose release had to wait */
    uint64_t frees_released;            /* storage actually returned to the system */
    /* race detector (host thread) */
    int race_on;
    int race_width;                     /* length of every vector clock (= streams so far) */
    uint64_t *host_vc;                  /* what the host has waited for */
    Alloc *dead_root;                   /* freed allocations whose storage is held back (use-after-free) */
    Alloc **quarantine;                 /* FIFO ring of those allocations, in host order */
    size_t quar_head, quar_count, quar_cap, quar_bytes;
    /* flight recorder (host issues, workers update, the watchdog reads) */
    pthread_mutex_t flight_mu;
    FlightRing *flight;                 /* [flight_n] per stream index */
    int flight_n;
    /* trace (workers append) */
    pthread_mutex_t trace_mu;
    TraceRec *trace;
    size_t n_trace, trace_cap;
};

struct World {
    WorldConfig cfg;
    struct CudaWorld *cuda;             /* CUDA backend state; NULL on the CPU */
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
    Dev *devs[WORLD_MAX_RANKS];         /* local ranks' Devs, for trace.json and the flight recorder */
    /* one report for the whole world (race detector, watchdog); guards devs[] updates */
    pthread_mutex_t report_mu;
    pthread_cond_t report_cv;
    char *race_msg[WORLD_MAX_RANKS];    /* a rank's race verdict, waiting for lower ranks' */
    uint8_t rank_done[WORLD_MAX_RANKS]; /* rank_main returned */
    int reporting;                      /* a watchdog report is being printed */
#ifdef HAVE_MPI
    MPI_Comm host_comm;
    int mpi_initialized_here;
#endif
};

/* 1 for the backends with one process per rank (under mpirun) */
static inline int backend_is_multiprocess(CollBackend b) { return b == BACKEND_MPI || b == BACKEND_NCCL_MPI; }

/* ------------------------------------------------------ backend hooks
 * What differs between the CPU backend (stream.c, alloc.c) and the CUDA one
 * (cuda/runtime_cuda.c); everything else (accounting, snapshots, traces,
 * world, host exchange) is shared. */
void backend_world_init(World *w);            /* end of world_create */
void backend_world_fini(World *w);            /* start of world_destroy */
void backend_dev_init(Dev *d);                /* rank thread, before the compute stream exists */
void backend_dev_fini(Dev *d);                /* last: streams, events and the allocator are gone */
void backend_event_fini(Event *e);            /* an event is being freed */
/* world.c: a new Event (name, mutex, condvar) in d's list of events; and its
 * removal from that list (the caller frees it). */
Event *event_register_new(Dev *d, const char *name);
void event_unregister(Event *e);
/* Storage for an allocation of `bytes` (a multiple of 64, > 0), fatal when
 * out of memory; backend_storage_free returns it. Both keep d->reserved. */
void *backend_storage_alloc(Dev *d, size_t bytes, const char *name);
void backend_storage_free(Dev *d, void *p, size_t bytes);
/* Stream-safe frees: at dev_free the fence marks the work queued so far on
 * every stream of the rank; the storage is released once the fence is ready.
 * backend_fence_create returns 1 if some stream was still busy. */
int backend_fence_create(Dev *d, PendingFree *pf);
int backend_fence_ready(Dev *d, const PendingFree *pf);
void backend_fence_release(Dev *d, PendingFree *pf);
/* collectives (coll_common.c): names and the agreement check */
const char *coll_kind_name(int kind);
int coll_same_call(const CollDesc *a, const CollDesc *b);
/* Fatal naming every rank's call if they differ (descs in rank order). */
void coll_check_agreement(Stream *s, uint64_t seq, const CollDesc *descs, int n);
/* Fatal on a bad argument (other rank's stream, NULL buffer, unknown op). */
void coll_validate(Dev *d, Stream *s, int kind, const float *send, const float *recv, size_t count, int op,
                   const char *label);

/* Fill o's collective fields (label, desc, bytes), give it s's next sequence
 * number and mark it issued in the flight recorder (both backends' coll_enqueue). */
void coll_op_describe(Dev *d, Stream *s, Op *o, CollKind kind, RedOp op, int root, size_t count, size_t bytes,
                      const char *label);
/* Enqueue one collective on s (collectives.c on the CPU, cuda/coll_cuda.c on CUDA);
 * bytes = what it moves, for the trace. The coll_* calls of device.h lead here. */
void coll_enqueue(Dev *d, Stream *s, CollKind kind, const float *send, float *recv, size_t count, RedOp op, int root,
                  size_t bytes, const char *label);
/* dev_launch's argument checks (world.c; both backends) */
void dev_launch_check(const char *name, void (*fn)(void *), size_t args_size);
/* Wait (mu held) until *generation moves past gen; with timeout_s > 0, return
 * 1 (mu still held) if it has not after timeout_s seconds, else 0. */
int coll_wait_generation(pthread_cond_t *cv, pthread_mutex_t *mu, const uint64_t *generation, uint64_t gen,
                         double timeout_s);

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
/* race detector (race.c) */
void race_on_enqueue(Stream *s, const Op *op);
void race_stream_created(Dev *d, Stream *s);
void race_stream_destroy(Stream *s);
void race_host_waited_stream(Stream *s);
void race_host_waited_all(Dev *d);
void race_host_waited_event(Event *e);
void race_event_free(Event *e);
void race_alloc_free(Alloc *a);
Alloc *dev_live_alloc_containing(const Dev *d, uintptr_t p);
Alloc *dev_dead_alloc_containing(const Dev *d, uintptr_t p);
/* world.c: one fatal report for the whole world; ranks below `rank` that hit
 * the same verdict win, so the message is the same on every run */
void world_report_race(World *w, int rank, const char *msg) __attribute__((noreturn));
/* flight recorder and watchdog (coll_common.c) */
void flight_stream_created(Dev *d, Stream *s);
void flight_set(Stream *s, const Op *op, int state); /* FlightState */
void watchdog_timeout(Stream *s, const Op *op, const CollPost *lowest, int lowest_rank, const uint8_t *here,
                      int n) __attribute__((noreturn));

#endif
