/* internal.h — the runtime's private structures: Dev, Stream, Event, World
 * and the queued Op. Only the runtime's own files (runtime/, cuda/) and its
 * white-box tests include it. Each unit's own state and functions are in its
 * header: alloc.h (allocator), race.h (race detector), coll.h (collectives,
 * flight recorder), trace.h (trace buffer), backend.h (the backends' table of
 * operations; each backend's state hangs off the `backend` pointers here). */
#ifndef HWFSDP_INTERNAL_H
#define HWFSDP_INTERNAL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "runtime/alloc.h"
#include "runtime/backend.h"
#include "runtime/coll.h"
#include "runtime/race.h"
#include "runtime/runtime.h"
#include "runtime/trace.h"

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

/* OP_MARK: the CPU's own (cpu/runtime_cpu.c), a timed fence's marker: not the program's work, never traced or raced */
typedef enum { OP_LAUNCH = 0, OP_COPY, OP_MEMSET, OP_RECORD, OP_WAIT, OP_COLL, OP_MARK } OpKind;

struct Op {
    OpKind kind;
    int traced;                 /* tracing was on when it was enqueued */
    void (*fn)(void *args);
    /* collective: runs it on the worker (set by its backend's enqueue); ready_us: when this rank's
     * stream could start it on the modelled clock; returns when the group could (the latest of theirs) */
    double (*exec)(Stream *s, const Op *op, double ready_us);
    const char *name;           /* interned */
    const char *module, *phase; /* interned scope at enqueue */
    int step, micro;            /* micro: the scope's microbatch (-1: none) */
    size_t bytes;               /* copies / collectives, for the trace */
    Event *event;               /* record / wait */
    uint64_t record_no;
    void *dst;                  /* copy / memset / collective recv; a marker's double */
    const void *src;            /* copy / collective send */
    int fill;
    int pcie;                   /* copy: 1 host -> device, 2 device -> host (the PCIe model), 0 neither */
    DevCopy *copies;            /* a batch copy (dev_memcpy_batch_async): its own list of ncopies (the worker frees it) */
    size_t ncopies;
    void *list;                 /* a launch's own copy of its list (dev_launch_list): the worker frees it */
    /* the modelled clock (CPU backends, cpu/modelled_clock.c) */
    double host_us;             /* the host's modelled time once it had enqueued this op */
    double cost_us;             /* how long it runs once started */
    double flops;               /* a kernel's declared FLOPs (the trace's "flops" arg) */
    CostClass cls;              /* a kernel's class and math (the trace's "class" and "math" args) */
    DType math;
    uint64_t coll_seq;          /* per-stream collective number */
    CollDesc coll;
    const char *label;          /* collective: interned label (trace name prefix) */
    ProcessGroup *pg;           /* collective: its group (a p2p group: NULL, its peers are its items') */
    struct CollChannel *chan;   /* collective, CPU local backend: the (stream, group) rendezvous (cpu/cpu_internal.h) */
    struct P2PBatch *p2p;       /* a point-to-point group (coll.kind COLL_P2P): its items; the worker frees it */
    union {
        max_align_t align_;
        unsigned char args[DEV_ARGS_MAX];
    };
};

struct Stream {
    Dev *dev;
    void *backend;                  /* the backend's own (CPU: cpu/'s CpuStream; CUDA: struct CudaStream) */
    int index;
    char *name;
    uint64_t enqueued;              /* ops enqueued so far (host) */
    uint64_t coll_seq;              /* collectives enqueued (host) */
    /* race detector (host thread) */
    uint64_t *vc;                   /* [dev->race_width] vector clock: what this stream's next op is ordered after */
    RaceAccess *pending;            /* dev_access annotations for the next op */
    int npending, pending_cap;
    PoolDebt *debts;                /* this stream's pool: uses of freed blocks not yet ordered (race.c) */
    int ndebts, debts_cap;
};

struct Event {
    Dev *dev;
    void *backend;        /* the backend's own (CPU: cpu/'s CpuEvent; CUDA: the cudaEvent_t) */
    char *name;
    uint64_t recorded;    /* records enqueued (host) */
    uint64_t *vc;         /* race detector (host thread): the recording stream's clock at the latest record */
    int vc_n;
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
 * rank; the ranks with the same (id, color) are one group.
 * size, rank and spans_nodes are the full group's, executed or not: what the
 * collectives' buffers hold and what the link model prices. Its executed
 * members (all of them, unless WorldConfig.rep_stride) are what meets: nlive of
 * them, listed in members[], this rank the live-th. */
struct ProcessGroup {
    Dev *dev;
    int id;                          /* creation index, the same on every rank; 0 = the world */
    int color;                       /* which of the id's groups */
    int rank, size;                  /* this rank's group rank; members, executed or not */
    int first, stride;               /* group rank i is world rank first + i * stride; stride 0: no such
                                        structure (dev_group_new's colors), members[] lists them all */
    int nlive, live;                 /* executed members; this rank's index among them */
    int members[WORLD_MAX_RANKS];    /* the executed members' world ranks, in group-rank order */
    int spans_nodes;                 /* link model: members on more than one node */
    int nodes;                       /* link model: the nodes its members sit on */
    char name[PG_NAME_MAX];
};

/* The world rank of g's group rank i. */
static inline int pg_member(const ProcessGroup *g, int i) { return g->stride ? g->first + i * g->stride : g->members[i]; }

/* One rank. Each unit owns its part: the allocator (alloc.c) Dev.mem, the
 * race detector (race.c) Dev.race, the flight recorder (coll_common.c)
 * Dev.flight, the trace (artifacts.c) Dev.trace; world.c the rest. */
struct Dev {
    World *world;
    int rank, world_size;
    void *backend;                      /* the backend's own (CPU: none; CUDA: struct CudaDev) */
    DevScope scope;                     /* host thread */
    double host_us;                     /* the host's modelled time (CPU backends, cpu/modelled_clock.c; host thread) */
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
    EnqueueLog enqueued;                /* host thread: its traced work in enqueue order (trace.h) */
    char *partial_dir;                  /* where the partial record goes at a runtime error (dev_record_partial) */
    ProcessGroup *pgs[PG_MAX];          /* [npgs] groups by id; pgs[0] = the world */
    int npgs;
    /* the clip probe (clip_probe.c): device floats launch_adamw's kernels write */
    float *clip_slots;                  /* [CLIP_PROBE_SLOTS], allocated at the first launch */
    int clip_n;                         /* slots handed out since the last collect */
    struct DryArena *dry;               /* --dry-run: the rank's address space (dry.h; host thread) */
    struct P2PBatch *p2p_group;         /* dev_group_start .. dev_group_end: the group being built (host thread) */
    uint64_t *p2p_sent, *p2p_recvd;     /* [world] sends to / receives from each rank so far (host thread; p2p.c) */
    /* dev_watch_collectives (host thread) */
    void (*coll_watch)(void *ctx, const CollIssue *c);
    void *coll_watch_ctx;
};

struct World {
    WorldConfig cfg;
    const BackendOps *ops;              /* cfg.backend's (backend.h) */
    void *backend;                      /* the backend's own (local: its channels; mpi: MpiWorld; CUDA: struct CudaWorld) */
    int local_ranks, first_local_rank;  /* the ranks this process executes: slots 0 .. local_ranks-1 (world_slot_rank) */
    double epoch_us;
    /* host barrier / allgather of ranks that are threads (threads_host_exchange) */
    pthread_mutex_t host_mu;
    pthread_cond_t host_cv;
    int host_arrived;
    uint64_t host_gen;
    double host_vals[2][WORLD_MAX_RANKS]; /* by slot */
    Dev *devs[WORLD_MAX_RANKS];         /* local ranks' Devs by slot, for trace.json and the flight recorder */
    /* one report for the whole world (race detector, watchdog); guards devs[] updates */
    pthread_mutex_t report_mu;
    pthread_cond_t report_cv;
    char *race_msg[WORLD_MAX_RANKS];    /* a rank's race verdict, waiting for lower ranks' (by slot) */
    uint8_t rank_done[WORLD_MAX_RANKS]; /* rank_main returned (by slot) */
    int reporting;                      /* a watchdog report is being printed */
    int guarded;                        /* device storage under the guard (guard.h: --guard-device-memory) */
    void *p2p;                          /* point-to-point mailboxes of ranks that are threads (p2p.c) */
    struct WorldFacts *facts;           /* what the run used (facts.c) */
};

/* The ranks this process executes (WorldConfig.rep_stride): slot i of World.devs (and of the other
 * arrays by slot) is world rank world_slot_rank(w, i); world_executes: whether rank runs at all, in
 * this process or another. */
static inline int world_stride(const World *w) { return w->cfg.rep_stride > 0 ? w->cfg.rep_stride : 1; }
static inline int world_slot_rank(const World *w, int slot) { return w->first_local_rank + slot * world_stride(w); }
static inline int world_rank_slot(const World *w, int rank) { return (rank - w->first_local_rank) / world_stride(w); }
static inline int world_executes(const World *w, int rank) { return rank % world_stride(w) == 0; }

/* facts.c: the world's record of what the run used (facts.h); group.c records each group a rank makes
 * (all its members, from its structure or from g->members when every rank executes). */
typedef struct WorldFacts WorldFacts;
WorldFacts *world_facts_create(void);
void world_facts_free(WorldFacts *f);
void facts_group(World *w, const ProcessGroup *g, const char *kind);

/* 1 for the backends with one process per rank (under mpirun) */
static inline int backend_is_multiprocess(CollBackend b) { return b == BACKEND_MPI || b == BACKEND_NCCL_MPI; }

static inline const BackendOps *dev_ops(const Dev *d) { return d->world->ops; }

void dev_clip_probe_free(Dev *d); /* clip_probe.c: at dev_destroy, before the backend's dev_fini */

/* event.c: a new Event (name) in d's list of events; its removal from that
 * list; and freeing it (the one place an Event is freed: race state, backend
 * state, name). */
Event *event_register_new(Dev *d, const char *name);
void event_unregister(Event *e);
void event_free(Event *e);
/* group.c: the world group (dev_create) */
void dev_groups_init(Dev *d);
void dev_groups_fini(Dev *d);

/* world.c: the Dev of the rank whose host thread calls it (NULL on any other thread: a stream worker, main).
 * artifacts.c: the runtime's LastWords (util.h), set by world_create: the calling rank's partial record. */
Dev *world_thread_dev(void);
void runtime_last_words(const char *line);

/* race.c: one fatal report for the whole world; ranks below `rank` that hit
 * the same verdict win, so the message is the same on every run */
void world_report_race(World *w, int rank, const char *msg) __attribute__((noreturn));

/* backend.c, for the backends' stream_create: a Stream with its dev, index
 * (the next in d's list) and name; s joining every group made so far
 * (stream_join_group); appending it to d's list */
Stream *stream_new(Dev *d, const char *name);
void stream_join_groups(Stream *s);
void dev_add_stream(Dev *d, Stream *s);

/* An Op of `kind` named `name` with the host's current scope (inline: the
 * stream and collective code that queue ops then need no other file). */
static inline void op_init(Stream *s, Op *op, OpKind kind, const char *name) {
    Dev *d = s->dev;
    memset(op, 0, offsetof(Op, args));
    op->kind = kind;
    op->traced = d->scope.tracing;
    op->name = dev_intern(d, name ? name : "op");
    op->module = d->scope.module;
    op->phase = d->scope.phase;
    op->step = d->scope.step;
    op->micro = d->scope.micro;
}

#endif
