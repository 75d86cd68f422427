/* cpu_internal.h — what the two CPU backends ("local": backend_local.c, "mpi":
 * backend_mpi.c) share: streams as worker threads, events, storage from the
 * C heap (runtime_cpu.c), the modelled clock (modelled_clock.c), the rank-order
 * reduction (coll_cpu.c) and the kernels (kernels_cpu.c). Each CPU backend's
 * table of operations starts from CPU_BACKEND_OPS and adds its own world,
 * host exchange, groups and collectives. */
#ifndef HWFSDP_CPU_INTERNAL_H
#define HWFSDP_CPU_INTERNAL_H

#include <pthread.h>
#include <stdint.h>

#include "runtime/internal.h"

/* A CPU stream (Stream.backend): a worker thread running a FIFO of ops. */
typedef struct {
    pthread_t thread;
    pthread_mutex_t mu;             /* guards the ring, the counts (Stream.enqueued too) and stop */
    pthread_cond_t cv_work, cv_done;
    Op *ring;
    size_t ring_cap, head, count;   /* count includes the op being executed */
    uint64_t completed;             /* ops finished so far (worker) */
    double end_us;                  /* the modelled end of the last op finished (worker; the host reads it under mu) */
    int stop;
    uint64_t colls_done;            /* collectives finished so far (worker; a dry run's host throttle reads it) */
    void *coll;                     /* the collective backend's own (local: channels; mpi: communicators) */
    double sm_debt_us;              /* compute time its collectives still take from other streams (host;
                                     * modelled_clock.c: clock_overlap) */
} CpuStream;

/* A CPU event (Event.backend): when each record completed on the modelled clock. */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    double *times;        /* [ntimes] record n's modelled time at times[n-1]; < 0: not reached yet (workers) */
    size_t ntimes;
    int refs;             /* queued ops still pointing at this event */
    int waiting;          /* stream workers blocked in a wait on it now (tests wait for one to block) */
    int destroyed;
    int rec_stream;       /* the stream index of its latest record (host), -1 before one */
} CpuEvent;

static inline CpuStream *cpu_stream(const Stream *s) { return s->backend; }
static inline CpuEvent *cpu_event(const Event *e) { return e->backend; }

/* The local backend's rendezvous channel (Op.chan): one per (stream index,
 * group), shared by the group's executed ranks; posts[] is indexed by
 * ProcessGroup.live (the group rank when every rank executes). */
typedef struct CollChannel {
    CollRendezvous rv;               /* its mutex guards posts too */
    CollPost posts[WORLD_MAX_RANKS];
} CollChannel;

/* Queue op (op_init'd; a collective: coll_op_describe'd, its exec set) on s; the worker runs it. */
void cpu_enqueue_op(Stream *s, Op *op);

/* coll_cpu.c. recv[i] = op over the n inputs of element `off + i` (rank
 * order, in float32), stored in the collective's dtype; parts[r] is group
 * rank r's buffer: the sum both CPU backends reduce with. */
void coll_reduce_ranks(void *recv, const void *const *parts, int n, size_t off, size_t cnt, int dtype, int op);
/* The local backend's Op.exec: a collective through its rendezvous channel. */
double local_coll_execute(Stream *s, const Op *op, double ready_us);
/* The local backend's Op.exec of a p2p op through the world's mailboxes;
 * returns the modelled start: the latest ready time of this rank and every
 * peer of the group. */
double p2p_local_execute(Stream *s, const Op *op, double ready_us);

/* runtime_cpu.c: the entries of CPU_BACKEND_OPS */
void cpu_dev_init(Dev *d);
void cpu_dev_fini(Dev *d);
Stream *cpu_stream_create(Dev *d, const char *name);
void cpu_stream_destroy(Stream *s);
void cpu_launch(Stream *s, const char *name, const KernelCost *cost, void (*fn)(void *args), const void *args,
                size_t args_size, const void *list, size_t list_bytes);
void cpu_copy(Stream *s, void *dst, const void *src, size_t bytes);
void cpu_copy_batch(Stream *s, const char *name, const DevCopy *copies, size_t n, size_t bytes, CopyDir dir);
void cpu_fill(Stream *s, void *dst, int byte, size_t bytes);
void cpu_stream_synchronize(Stream *s);
void cpu_synchronize(Dev *d);
void cpu_event_init(Event *e);
void cpu_event_fini(Event *e);
void cpu_event_destroy(Event *e);
void cpu_event_record(Event *e, Stream *s);
void cpu_event_wait(Stream *s, Event *e);
void cpu_event_synchronize(Event *e);
int cpu_event_query(Event *e);
void *cpu_storage_alloc(Dev *d, size_t bytes, int stream, const char *name);
void cpu_storage_free(Dev *d, void *p, size_t bytes, int stream);
void *cpu_host_alloc(Dev *d, size_t bytes, const char *name);
void cpu_host_free(Dev *d, void *p, size_t bytes);
int cpu_fence_create(Dev *d, PendingFree *pf);
int cpu_fence_ready(Dev *d, const PendingFree *pf);
void cpu_fence_release(Dev *d, PendingFree *pf);
void *cpu_probe_alloc(Dev *d, size_t bytes);
void cpu_probe_free(Dev *d, void *p);
void cpu_probe_read(Dev *d, void *host, const void *probe, size_t bytes);
/* modelled_clock.c: the host's modelled time (BackendOps.host_time_us); a host
 * call that costs the host a launch; the host enqueuing op (its host_us; the
 * host moves on by a launch if charged); the
 * costs of a kernel, a copy (pcie: copy_direction) and a memset, us; the host
 * waiting until until_us (a "sync:<what><name>" slice on its track, of length
 * 0 if it did not stall); a finished op's trace record (if traced), started
 * at wall0_us. */
double cpu_host_time_us(const Dev *d);
void clock_host_call(Dev *d);
void clock_enqueue(Dev *d, Op *op, int charged);
double clock_kernel_cost(const Dev *d, const KernelCost *c);
/* The overlap slowdown (profile.h: overlap_slowdown): a collective queued on s leaves a debt on the other
 * streams' compute (clock_coll_queued); a kernel of cost_us queued on s pays from it, and returns its cost with
 * what it paid (clock_overlap); a wait of s for an event recorded on stream `rec` ends rec's debt (the
 * collectives before it are over: clock_overlap_ends). All on the host thread, in program order. */
void clock_coll_queued(Stream *s, double cost_us);
double clock_overlap(Stream *s, double cost_us);
void clock_overlap_ends(Stream *s, int rec);
double clock_copy_cost(const Dev *d, size_t bytes, int pcie);
double clock_fill_cost(const Dev *d, size_t bytes);
void clock_host_wait(Dev *d, double until_us, const char *what, const char *name);
void clock_trace_op(Stream *s, const Op *op, const char *prefix, const char *cat, double start_us, double end_us,
                    double wall0_us);
/* The host just enqueued op on s: its record, timed at its enqueue, in the rank's enqueue log (trace.h). */
void clock_log_enqueued(Stream *s, const Op *op);

extern const struct KernelTable kcpu_kernels; /* kernels_cpu.c */

/* The two CPU backends (backends_cpu.c offers them). */
extern const BackendOps cpu_local_backend;     /* backend_local.c */
const BackendOps *cpu_mpi_backend_ops(void);   /* backend_mpi.c; one fatal line in a build without MPI */

/* The entries both CPU backends share, for their tables' initializers. */
#define CPU_BACKEND_OPS                                                                                                \
    .race_checked = 1, .storage_fenced = 1, .kernels = &kcpu_kernels, .dev_init = cpu_dev_init,                        \
    .dev_fini = cpu_dev_fini, .stream_create = cpu_stream_create, .stream_destroy = cpu_stream_destroy,                \
    .launch = cpu_launch, .copy = cpu_copy, .copy_batch = cpu_copy_batch, .fill = cpu_fill, .stream_synchronize = cpu_stream_synchronize,             \
    .synchronize = cpu_synchronize, .event_init = cpu_event_init, .event_fini = cpu_event_fini,                         \
    .event_destroy = cpu_event_destroy, .event_record = cpu_event_record, .event_wait = cpu_event_wait,                 \
    .event_synchronize = cpu_event_synchronize, .event_query = cpu_event_query, .storage_alloc = cpu_storage_alloc,     \
    .storage_free = cpu_storage_free, .host_alloc = cpu_host_alloc, .host_free = cpu_host_free,                         \
    .fence_create = cpu_fence_create, .fence_ready = cpu_fence_ready, .fence_release = cpu_fence_release,               \
    .probe_alloc = cpu_probe_alloc, .probe_free = cpu_probe_free, .probe_read = cpu_probe_read,                         \
    .clock = "model", .host_time_us = cpu_host_time_us

#endif
