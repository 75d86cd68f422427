/* internal.h — the runtime's private structures: Dev, Stream, Event, World
 * and the queued Op. Only the runtime's own files (runtime/, cuda/) and its
 * white-box tests include it. Each unit's own state and functions are in its
 * header: alloc.h (allocator), race.h (race detector), coll.h (collectives,
 * flight recorder), trace.h (trace buffer). */
#ifndef HWFSDP_INTERNAL_H
#define HWFSDP_INTERNAL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "runtime/alloc.h"
#include "runtime/coll.h"
#include "runtime/race.h"
#include "runtime/runtime.h"
#include "runtime/trace.h"

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
void intern_free(InternTable *t);

/* ----------------------------------------------------------------- ops */

typedef enum { OP_LAUNCH = 0, OP_COPY, OP_MEMSET, OP_RECORD, OP_WAIT, OP_COLL } OpKind;

struct Op {
    OpKind kind;
    int traced;                 /* tracing was on when it was enqueued */
    void (*fn)(void *args);
    void (*exec)(Stream *s, const Op *op); /* collective: runs it on the worker (set by its backend's enqueue) */
    const char *name;           /* interned */
    const char *module, *phase; /* interned scope at enqueue */
    int step, micro;            /* micro: the scope's microbatch (-1: none) */
    size_t bytes;               /* copies / collectives, for the trace */
    Event *event;               /* record / wait */
    uint64_t record_no;
    void *dst;                  /* copy / memset / collective recv */
    const void *src;            /* copy / collective send */
    int fill;
    int pcie;                   /* copy: 1 host -> device, 2 device -> host (the PCIe model), 0 neither */
    uint64_t coll_seq;          /* per-stream collective number */
    CollDesc coll;
    const char *label;          /* collective: interned label (trace name prefix) */
    ProcessGroup *pg;           /* collective: its group */
    CollChannel *chan;          /* collective, local backend: the (stream, group) rendezvous */
    union {
        max_align_t align_;
        unsigned char args[DEV_ARGS_MAX];
    };
};

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
    CollChannel *pg_chans[PG_MAX];  /* local backend: rendezvous per group id (host thread fills them) */
    /* race detector (host thread) */
    uint64_t *vc;                   /* [dev->race_width] vector clock: what this stream's next op is ordered after */
    RaceAccess *pending;            /* dev_access annotations for the next op */
    int npending, pending_cap;
#ifdef HAVE_MPI
    MPI_Comm comm;                  /* mpi backend: a dup of MPI_COMM_WORLD per stream index */
    MPI_Comm pg_comms[PG_MAX];      /* mpi backend: group id >= 1: its split of the world, per stream */
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
    int waiting;          /* stream workers blocked in a wait on it now (tests wait for one to block) */
    int destroyed;
    uint64_t *vc;         /* race detector (host thread): the recording stream's clock at the latest record */
    int vc_n;
    void *cuda_event;     /* CUDA backend: the cudaEvent_t; NULL on the CPU */
};

/* What the host is doing now (world.c: dev_set_scope). */
typedef struct {
    int step;
    int micro;                          /* microbatch of the step (--grad-accum), -1: none */
    const char *module, *phase;         /* interned */
    int tracing;
} DevScope;

/* A process group (device.h). Every rank creates the same groups in the same
 * order (group.c: dev_group_new), so a group id names the same split on every
 * rank; the ranks with the same (id, color) are one group. */
struct ProcessGroup {
    Dev *dev;
    int id;                          /* creation index, the same on every rank; 0 = the world */
    int color;                       /* which of the id's groups */
    int rank, size;                  /* this rank's group rank; members */
    int members[WORLD_MAX_RANKS];    /* world ranks, in group-rank order */
    int spans_nodes;                 /* link model: members on more than one node */
    char name[24];
#ifdef HAVE_MPI
    MPI_Comm host_comm;              /* multi-process backends: the host's communicator of the group */
#endif
};

/* One rank. Each unit owns its part: the allocator (alloc.c) Dev.mem, the
 * race detector (race.c) Dev.race, the flight recorder (coll_common.c)
 * Dev.flight, the trace (artifacts.c) Dev.trace; world.c the rest. */
struct Dev {
    World *world;
    int rank, world_size;
    struct CudaDev *cuda;               /* CUDA backend state; NULL on the CPU */
    DevScope scope;                     /* host thread */
    InternTable strings;                /* host thread */
    /* streams and events (host thread) */
    Stream **streams;
    int nstreams, streams_cap;
    Event **events;
    int nevents, events_cap;
    DevMem mem;
    RaceDetector race;
    FlightRecorder flight;
    TraceBuffer trace;
    ProcessGroup *pgs[PG_MAX];          /* [npgs] groups by id; pgs[0] = the world */
    int npgs;
    /* the clip probe (clip_probe.c): device floats launch_adamw's kernels write */
    float *clip_slots;                  /* [CLIP_PROBE_SLOTS], allocated at the first launch */
    int clip_n;                         /* slots handed out since the last collect */
    /* dev_watch_collectives (host thread) */
    void (*coll_watch)(void *ctx, const CollIssue *c);
    void *coll_watch_ctx;
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
 * What differs between the CPU backend (stream.c) and the CUDA one
 * (cuda/runtime_cuda.c); everything else (accounting, snapshots, traces,
 * world, host exchange) is shared. Storage and fences: alloc.h. */
void backend_world_init(World *w);            /* end of world_create */
void backend_world_fini(World *w);            /* start of world_destroy */
void backend_dev_init(Dev *d);                /* rank thread, before the compute stream exists */
void backend_dev_fini(Dev *d);                /* last: streams, events and the allocator are gone */
void backend_event_fini(Event *e);            /* an event is being freed */
void backend_stream_join_group(Stream *s, ProcessGroup *g); /* host thread, same order on every rank */
/* Probe memory (uncounted, outside the allocator): the clip probe's slots. probe_read first
 * waits for every stream of d without telling the race detector (a probe must not order
 * the student's work), then copies device -> host. */
void *backend_probe_alloc(Dev *d, size_t bytes);
void backend_probe_free(Dev *d, void *p);
void backend_probe_read(Dev *d, void *host, const void *probe, size_t bytes);
void dev_clip_probe_free(Dev *d); /* clip_probe.c: at dev_destroy, before backend_dev_fini */

/* world.c: a new Event (name, mutex, condvar) in d's list of events; its
 * removal from that list; and freeing it (the one place an Event is freed:
 * race state, backend state, name). */
Event *event_register_new(Dev *d, const char *name);
void event_unregister(Event *e);
void event_free(Event *e);
/* dev_launch's argument checks (world.c; both backends) */
void dev_launch_check(const char *name, void (*fn)(void *), size_t args_size);
/* the local backend's rendezvous of (stream index, group id, color) */
CollChannel *world_channel(World *w, int stream_index, int pg_id, int color);
/* group.c: the world group (dev_create), s's channel for g (local backend) */
void dev_groups_init(Dev *d);
void dev_groups_fini(Dev *d);
CollChannel *stream_pg_channel(Stream *s, ProcessGroup *g);
/* group.c, both CPU backends' dev_stream_create: s joins every group made so far (mpi: one split each) */
void stream_join_groups(Stream *s);
/* world.c: one fatal report for the whole world; ranks below `rank` that hit
 * the same verdict win, so the message is the same on every run */
void world_report_race(World *w, int rank, const char *msg) __attribute__((noreturn));

/* world.c, for both backends' dev_stream_create: a Stream with its dev,
 * index (the next in d's list), name and mutex; and appending it to d's list */
Stream *stream_new(Dev *d, const char *name);
void dev_add_stream(Dev *d, Stream *s);

/* streams (stream.c; CUDA: cuda/runtime_cuda.c) */
void stream_destroy(Stream *s);
void stream_op_init(Stream *s, Op *op, int kind, const char *name);
void stream_enqueue_op(Stream *s, const Op *op);

#endif
