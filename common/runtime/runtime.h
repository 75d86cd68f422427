/* runtime.h — the runtime as the training driver, the model and the tools
 * use it: worlds of ranks, scopes, kernel launches with their race-detector
 * annotations, memory introspection, traces and snapshots. Student code needs
 * none of it (device.h is the student's part).
 *
 * A World has N ranks. Default: threads of one process (backend "local").
 * Under mpirun: one process per rank ("mpi"; CUDA build: "nccl-mpi").
 *
 * Race detector (CPU backend, on unless WorldConfig.no_race_check): every op
 * is checked when it is ENQUEUED, in host order, against a happens-before
 * model of streams, events and host syncs (vector clocks), so the verdict is
 * the same on every run whatever the thread timing. Copies, memsets and
 * collectives declare what they read and write; kernels declare it with
 * dev_access. Tracking is per allocation (not per byte): two streams touching
 * disjoint halves of one allocation without ordering count as a race. An op
 * that reads a buffer whose last write (on another stream) is not ordered
 * before it by an event wait or a host sync, or that writes a buffer another
 * stream read or wrote without such ordering, or that touches a buffer after
 * its dev_free, stops the run with one line naming the buffer, both ops and
 * streams, and the missing wait (exit status 2). Pointers outside device
 * allocations (host memory) are not tracked. Ordering facts: same stream;
 * dev_event_record + dev_stream_wait_event; dev_stream_synchronize,
 * dev_synchronize, dev_event_synchronize and dev_event_query returning 1 order
 * every op enqueued afterwards (on any stream) after what the host waited for.
 *
 * Watchdog (WorldConfig.collective_timeout_s > 0): a collective that waits
 * longer for its peers (a rank skipped it, issued it on a stream others never
 * created, or is stuck behind a wait that cannot complete) stops the run with
 * "collective timeout on rank R: ..." and a flight recorder (the last 16
 * collectives of every stream of every rank, with their state), exit status 2.
 *
 * Device-memory guard (CPU backends, WorldConfig.guard_device, --guard-device-memory
 * or HWFSDP_GUARD_DEVICE=1 in the environment; runtime/guard.h): device storage is
 * pages only the stream workers may touch (x86 protection keys); host code reading or
 * writing it stops the run with one line naming the buffer, the offset and the
 * function (exit status 2), as a GPU would crash there. Without protection keys one
 * line says the guard is unavailable and the run goes on unguarded.
 *
 * The CUDA build's nccl backends also watch the GPU while the host waits for
 * it: a NCCL error, or a wait past the timeout with a collective unfinished,
 * aborts the rank's communicators and stops with one line (coll_cuda.c).
 */
#ifndef HWFSDP_RUNTIME_H
#define HWFSDP_RUNTIME_H

#include <stddef.h>
#include <stdint.h>

#include "device.h"

typedef struct World World;
struct KernelTable; /* model/kernels.h */
struct DeviceProfile; /* runtime/profile.h */

/* ------------------------------------------------------------------ world */

/* How ranks are hosted and how collectives move data.
 *   local     threads of one process; CPU: memcpy; CUDA build: N ranks share
 *             one GPU (device copies and reduction kernels on their streams)
 *   mpi       one process per rank under mpirun (CPU build), MPI collectives
 *   nccl      CUDA build: threads of one process, one GPU per rank, NCCL
 *   nccl-mpi  CUDA build: one process per rank under mpirun (any number of
 *             nodes), GPU = rank on its node, NCCL id broadcast over MPI */
typedef enum { BACKEND_LOCAL = 0, BACKEND_MPI = 1, BACKEND_NCCL = 2, BACKEND_NCCL_MPI = 3 } CollBackend;
/* "local", "mpi", "nccl", "nccl-mpi" */
const char *backend_name(CollBackend b);
/* 1 if this runtime was built with the CUDA backend (make cuda). */
int dev_is_cuda_build(void);

typedef struct {
    int world_size;           /* N ranks (1..WORLD_MAX_RANKS; 1..WORLD_MAX_DRY_RANKS with rep_stride) */
    CollBackend backend;      /* local: threads; mpi: one process per rank */
    int price_ops;            /* PriceOps: element-wise kernels priced as our own (0) or as eager PyTorch's */
    double link_gbps;         /* link model for local collectives; 0 = off */
    double link_latency_us;   /* per ring hop */
    int ranks_per_node;       /* link model: ranks r / ranks_per_node share a node (0 = one node) */
    double inter_link_gbps;   /* a group spanning nodes: its ring crosses this link (0 = link_gbps) */
    double inter_link_latency_us; /* per hop across nodes (used when inter_link_gbps > 0) */
    double pcie_gbps;         /* PCIe model for host <-> device copies (pinned host memory), GB/s; 0 = off */
    double pcie_latency_us;   /* per copy */
    int poison;               /* fill fresh allocations with NaN */
    int trace;                /* record op/collective timings for the trace */
    int trace_ranks;          /* only ranks 0 .. trace_ranks-1 record them and write artifacts (0: every rank) */
    int blas_threads;         /* OpenBLAS threads per rank (0 = cores / ranks) */
    int no_race_check;        /* 1 = turn the stream race detector off (on by default) */
    double collective_timeout_s; /* watchdog: a collective waiting longer stops the run; 0 = off */
    int guard_device;         /* CPU backends: host code faults on device memory (guard.h; also HWFSDP_GUARD_DEVICE=1) */
    int tf32;                 /* matmuls may use TF32 tensor cores (CUDA build; the modelled clock prices them so) */
    const struct DeviceProfile *profile; /* what the modelled clock prices ops on (NULL: "teach") */
    int dry_run;              /* CPU backends: price and count every op, execute none, back no memory (dry.h) */
    /* Representative ranks (a dry run of the local backend only): 0 = every rank executes, one thread each;
     * K > 0 = only ranks 0, K, 2K, ... execute (world_size / K <= WORLD_MAX_RANKS of them), rank r standing
     * for the K symmetric ranks r .. r+K-1 (its class: plain FSDP and HSDP, K = world_size, rank 0 alone;
     * --pp P, K = world_size / P, each stage's lowest rank). A group keeps its full size, members and node
     * span, which price its collectives (coll_link_time_us); its executed members alone meet (ProcessGroup:
     * nlive), and a collective starts when the last of them is ready, as the full world's would by symmetry.
     * A send to or a receive from a rank that does not execute is fatal (the classes were not symmetric). */
    int rep_stride;
} WorldConfig;

/* Create the world. With BACKEND_MPI this calls MPI_Init_thread and checks that
 * mpirun's -np equals cfg->world_size (fatal otherwise). */
World *world_create(const WorldConfig *cfg);
/* Run rank_main once per rank of this process: one thread per rank (local),
 * or once on the calling thread (mpi). Returns after all ranks returned. */
void world_run(World *w, void (*rank_main)(Dev *dev, void *arg), void *arg);
void world_destroy(World *w);
int world_first_local_rank(const World *w);

/* The ranks that execute: every rank, or with WorldConfig.rep_stride one
 * representative per class: dev_executed_count of them, the i-th (in rank
 * order) world rank dev_executed_rank(d, i). */
int dev_executed_count(const Dev *d);
int dev_executed_rank(const Dev *d, int i);

/* Host-side exchange between ranks, outside streams, traces and the
 * collective sequence: every executed rank passes `value`, all get theirs in
 * rank order (out[i]: dev_executed_rank(d, i)'s; every rank's, in a world
 * whose every rank executes). Blocks until every executed rank called it. For
 * logging only. */
void dev_host_allgather_f64(Dev *d, double value, double *out /* [dev_executed_count] */);
/* Host-side barrier (all executed ranks), outside streams and traces. */
void dev_host_barrier(Dev *d);

/* The most process groups a rank may create, the world included. */
#define PG_MAX 16
/* The room for a process group's name, its NUL included (longer names are cut). */
#define PG_NAME_MAX 24

/* A new process group (device.h): every rank calls it, in the same order; the
 * ranks passing the same color (>= 0) form one group, numbered in world-rank
 * order; name is this rank's group's name ("shard0"). At most PG_MAX per rank.
 * A world whose every rank executes only: with representative ranks the
 * members that do not execute pass no color (fatal: use dev_group_new_of). */
ProcessGroup *dev_group_new(Dev *d, int color, const char *name);
/* The same, of a kind ("shard", "replicate", "stage"), named "<kind><color>" (facts.h records the kind), whose
 * members are known from their structure: the `size` world ranks first, first + stride, ... (stride >= 1),
 * this rank among them. The executed ranks' colors must say the same (fatal otherwise): what lets a dry run
 * with representative ranks know every group in full. */
ProcessGroup *dev_group_new_of(Dev *d, int color, const char *kind, int first, int stride, int size);
/* The device mesh of --mesh replicas,shards (replicas <= 0: 1-D, the world):
 * its shape, and this rank's shard and replicate groups (dev_group_new). */
void dev_mesh_build(Dev *d, DeviceMesh *m, int replicas, int shards);

/* Scope: what the host is doing now (module and phase, e.g. "block3",
 * "pre_forward"), attached to every op, collective, allocation and free made
 * from now on, for traces and snapshots. step < 0 before training starts. */
void dev_set_scope(Dev *d, int step, const char *module, const char *phase);
const char *dev_scope_module(const Dev *d);
const char *dev_scope_phase(const Dev *d);
int dev_scope_step(const Dev *d);
/* The microbatch of the step from now on (--grad-accum), shown as
 * "microbatch" in trace args; -1 (the default): a step has one batch. */
void dev_set_microbatch(Dev *d, int micro);
int dev_scope_microbatch(const Dev *d);
/* Turn op/collective trace recording on or off from now on (e.g. after the
 * first few steps). Memory events are always recorded. */
void dev_set_tracing(Dev *d, int on);
int dev_tracing(const Dev *d);

/* ---------------------------------------------------------------- streams */

int stream_index(const Stream *s);      /* 0 = compute, then creation order */
const char *stream_name(const Stream *s);

/* What a kernel costs: every launch declares its work where it is launched,
 * and the modelled clock (CPU backends) prices it on the device profile
 * (runtime/profile.h): the FLOPs it does, in which math, and the bytes it
 * reads and writes in device memory. */
typedef enum {
    COST_MATMUL = 0,   /* a GEMM (tensor cores where its math has them) */
    COST_ATTENTION,    /* softmax(Q K^T) V and its backward */
    COST_ELEMENTWISE,  /* norms, RoPE, SwiGLU, adds, casts, AdamW, sums: bound by bandwidth */
    COST_FREE,         /* not the program's work (the driver's probes): no time on any clock */
    COST_CLASS_COUNT
} CostClass;
/* The class's name ("matmul", "attention", "elementwise", "free"): a kernel's trace slice carries it as
 * args.class, and its math ("f32" / "bf16") as args.math, so a report can split compute by class. */
const char *cost_class_name(CostClass c);
typedef struct {
    CostClass cls;
    DType math;        /* what its FLOPs run in: DTYPE_F32 (TF32 for a matmul under --tf32) or DTYPE_BF16 */
    double flops;
    double bytes;      /* read + written */
    double gemm[2][3]; /* a matmul's GEMMs, {M, N, K} each (out[M,N] += a[M,K] b[K,N]); {0,0,0}: none */
    double seq;        /* an attention kernel's sequence length (its measured efficiency depends on it) */
    /* eager PyTorch's kernels for the same math (kernels.h: kcost_eager), priced instead under --price-ops eager */
    double eager_bytes;
    int eager_kernels; /* 0: none declared (priced as itself) */
    int eager_norm;    /* an RMSNorm's (under --price-ops eager-fused-norm, priced as itself) */
} KernelCost;
/* What the modelled clock prices element-wise math as (--price-ops): this runtime's own fused kernels, or the
 * kernels eager PyTorch launches for the same math in torchtitan's Llama (to compare with published runs). */
typedef enum { PRICE_FUSED, PRICE_EAGER, PRICE_EAGER_FUSED_NORM } PriceOps;

/* Enqueue fn(args) on s, costing *cost (NULL: fatal, naming the kernel).
 * args (at most DEV_ARGS_MAX bytes) is copied, so the caller's struct may go
 * out of scope. name appears in the trace as "<scope module>.<name>". */
#define DEV_ARGS_MAX 256
void dev_launch(Stream *s, const char *name, const KernelCost *cost, void (*fn)(void *args), const void *args,
                size_t args_size);
/* dev_launch of a kernel that reads a list too long for its args (a fused
 * cast over hundreds of ranges): args begins with a `const void *` member,
 * which the launch points at a list of the list_bytes of `list` (host
 * memory) that stays readable until the kernel ran: on the CPU a copy the
 * runtime made and frees, on CUDA the caller's own list, which the kernel's
 * host side reads (and uploads) before the launch returns. Either way the
 * list is read at the call: the caller may reuse it at once. */
void dev_launch_list(Stream *s, const char *name, const KernelCost *cost, void (*fn)(void *args), const void *args,
                     size_t args_size, const void *list, size_t list_bytes);
/* One range a batch of copies or casts reads (dst = 0) or writes (dst = 1):
 * [lo, hi), item i of the list. check_batch_disjoint (which sorts r) is fatal,
 * one line "<who>: <item> 3's destination overlaps <item> 5's source (the
 * <items> of a batch run in no set order: ...)", if a written range overlaps
 * any other range; read ranges may share bytes. */
typedef struct {
    uintptr_t lo, hi;
    size_t i;
    int dst;
} BatchRange;
void check_batch_disjoint(const char *who, const char *item, const char *items, BatchRange *r, size_t m);
/* A batch call's own arguments, one fatal line each: a stream, a name without a dot (the trace adds
 * "<module>."), a list when n > 0 (items: "copies", "casts"). */
void check_batch_call(const char *who, const Stream *s, const char *name, const void *list, size_t n,
                      const char *items);
/* The kernels of s's backend (model/kernels.h: KERNEL(s, name)). */
const struct KernelTable *stream_kernels(const Stream *s);
/* Race-detector annotation for kernels: the NEXT op enqueued on s (normally
 * the dev_launch that follows) reads (write = 0) or writes (write = 1, which
 * also covers read-modify-write) [p, p + bytes). `what` names the data for
 * messages (e.g. a parameter's name). Cheap; a no-op with the detector off or
 * for memory that is not a device allocation. Call it once per buffer a
 * kernel touches that another stream may produce or consume. */
void dev_access(Stream *s, const void *p, size_t bytes, int write, const char *what);

/* The clip probe (what the grader's clip check reads): launch_adamw gives each
 * launch a device float where its kernel writes the clip coefficient it applied;
 * the step log collects a step's coefficients. stream_clip_slot returns NULL once
 * a step has used CLIP_PROBE_SLOTS slots (dev_clip_collect then says so). */
#define CLIP_PROBE_SLOTS 4096
float *stream_clip_slot(Stream *s);
/* Waits for every stream (invisibly to the race detector), copies the step's
 * coefficients into host[0..n) (n <= cap), forgets them; returns n, or -1 if
 * the step launched more than CLIP_PROBE_SLOTS. */
int dev_clip_collect(Dev *d, float *host, int cap);

/* The driver's probes read device memory: copy `bytes` at src (device or
 * pinned host memory) into host once every stream of d has run what was
 * queued so far. A wait in wall time only: not ordered for the race detector
 * (a probe must not order the student's work), nothing on the modelled clock,
 * the memory counts or the trace. */
void dev_probe_read(Dev *d, void *host, const void *src, size_t bytes);

/* The collective kinds. A kind is its row of coll_kinds (coll_common.c: what
 * it moves, its checks, its link cost) plus one execute case per backend
 * (cpu/coll_cpu.c: local; cpu/backend_mpi.c: mpi; cuda/coll_cuda.c: local and nccl). */
typedef enum {
    COLL_ALL_GATHER = 0,
    COLL_REDUCE_SCATTER,
    COLL_ALL_REDUCE,
    COLL_BROADCAST,
    COLL_BARRIER,
    COLL_P2P,          /* a group of point-to-point sends and receives (p2p.c: dev_send / dev_recv) */
    COLL_KIND_COUNT /* keep last: the number of kinds (rows of coll_kinds) */
} CollKind;

/* Every collective this rank issues, as the host queues it (host thread):
 * what the training driver checks the student's schedule with (a flag the
 * hooks ignore, e.g. --backward-prefetch before stage 10). */
typedef struct {
    CollKind kind;            /* what to compare (COLL_ALL_GATHER, ...) */
    const char *kind_name;    /* its name in the trace (coll_kind_name): "all_gather", ... */
    const char *label;        /* the label passed ("" for NULL) */
    const char *module, *phase; /* the scope it was issued in (dev_set_scope) */
    int step, micro;          /* dev_scope_step, dev_scope_microbatch */
    int stream;               /* stream_index of the stream it was queued on */
    const char *stream_name;
} CollIssue;
/* Call fn(ctx, c) for every collective this rank issues from now on; fn NULL:
 * stop. One watcher per rank; fn runs on the issuing (host) thread. */
void dev_watch_collectives(Dev *d, void (*fn)(void *ctx, const CollIssue *c), void *ctx);

/* ----------------------------------------------------------------- memory */

/* "param", "param_shard", "unsharded_param", ... (stable names used in snapshots) */
const char *mem_tag_name(MemTag tag);
void dev_mem_reset_peak(Dev *d);                      /* peak := current */
size_t dev_mem_current_by_tag(const Dev *d, MemTag tag);
size_t dev_mem_host_current_by_tag(const Dev *d, MemTag tag); /* the pinned host pool (dev_alloc_host) */
/* 1 if p lies in a live pinned host allocation (dev_alloc_host), 0 otherwise. */
int dev_mem_is_host(const Dev *d, const void *p);
/* Size of the live allocation that contains address p, or 0 if none does. */
size_t dev_mem_live_size_containing(const Dev *d, const void *p);
/* Identity (allocation sequence number, never reused) of the live allocation
 * containing p, or 0 if none does: tells a buffer apart from a later one that
 * happens to get the same address. */
uint64_t dev_mem_live_id_containing(const Dev *d, const void *p);

/* Append a named record to the memory snapshot's event list (used by the
 * training loop for per-hook checks the grader reads, e.g. after post_forward:
 * {"kind":"hook_check","module":"block2","hook":"post_forward",
 *  "live_unsharded_param_bytes":0,...}). json_fields is a JSON object body
 * without braces, e.g. "\"live_bytes\":0". */
void dev_mem_note(Dev *d, const char *kind, const char *json_fields);

/* A high-water mark over a window of host calls (the driver's per-hook memory
 * record): begin sets it to the bytes allocated now; peak returns the most
 * allocated at once since, and by_tag[MEM_TAG_COUNT] (if not NULL) the bytes by
 * tag at that moment. */
void dev_mem_window_begin(Dev *d);
size_t dev_mem_window_peak(const Dev *d, size_t *by_tag);

/* The device's memory: the profile's hbm_capacity_bytes on the modelled clock
 * (runtime/profile.h), 0 for no limit (the "teach" profile; the CUDA build,
 * whose GPU enforces its own). While watched (on = 1), the first device
 * allocation that takes the bytes this rank has allocated past the capacity
 * is recorded as one line, as CUDA's out-of-memory error would say it (what
 * was asked for, step, module and phase, the capacity, what was allocated and
 * its largest tags); the allocation is made and counted all the same.
 * dev_mem_over_capacity: that line (no "error:", no newline), NULL while none. */
size_t dev_mem_capacity(const Dev *d);
void dev_mem_watch_capacity(Dev *d, int on);
const char *dev_mem_over_capacity(const Dev *d);

/* ------------------------------------------------------------------ clock */

/* The host's time now on the world's clock, us since the world began: the
 * modelled clock on the CPU backends (what every op the host enqueued so far
 * cost it, and where its waits moved it: the same on every run), the wall
 * clock on CUDA. Traces, memory events and the modelled step time read it. */
double dev_host_time_us(const Dev *d);
/* "model" (CPU backends: the profile's modelled clock) or "gpu" (CUDA: the device's own). */
const char *dev_clock_name(const Dev *d);
/* 1 in a dry run (WorldConfig.dry_run, --dry-run): every op is priced on the
 * modelled clock and every allocation counted, but no kernel, copy or
 * collective runs and no memory backs the buffers (runtime/dry.h), so nothing
 * has a value: whatever reads values (the driver's params check, loss, grad
 * norm, clip probe) is off. */
int dev_dry_run(const Dev *d);

/* ------------------------------------------------------- traces, snapshots */

/* Write this rank's Chrome trace (trace_rank<r>.json) and memory snapshot
 * (memory_rank<r>.json and memory_rank<r>.pickle for pytorch.org/memory_viz)
 * into dir. Synchronizes the rank first. With the local backend, rank 0 also
 * writes trace.json holding every rank (call after all ranks wrote theirs:
 * dev_write_artifacts does a host barrier). */
void dev_write_artifacts(Dev *d, const char *dir);
/* Ask for a partial record (dir NULL: no more): when a runtime error (exit status 2: a fatal line, a race)
 * stops the run on this rank's host thread, partial_rank<r>.json goes into dir before the error line, marked
 * "partial": true with the error line: the ops this rank's host had enqueued, in host order, at the host's
 * modelled time of each enqueue (CPU backends; the CUDA build writes none of them), and the memory
 * snapshot's notes so far. The grader judges what it can of a failed run from it. The host order makes it the
 * same file on every run that stops at the same point. */
void dev_record_partial(Dev *d, const char *dir);

#endif
