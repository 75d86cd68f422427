/* device.h — what your hw_fsdp.c may call: the device of one rank.
 *
 * The mental model is CUDA + NCCL, running anywhere:
 *   - Each rank owns a Dev: its streams, its allocator, its trace.
 *   - A Stream is an in-order queue of work. The host only ENQUEUES
 *     (every *_async call and every collective returns at once, like a CUDA
 *     kernel launch); the work runs later, in order, on the stream.
 *   - Events order streams: dev_event_record(e, s) marks the work queued on s
 *     so far; dev_stream_wait_event(t, e) makes later work on t wait for that
 *     point. As in CUDA, a wait uses e's most recent record made *before* the
 *     wait was enqueued.
 *   - Collectives run on a stream, asynchronously, NCCL-style: every rank must
 *     issue the same collectives in the same order on each stream.
 *
 * What the runtime guarantees and checks:
 *   - Memory follows PyTorch's CUDA caching allocator. Every allocation
 *     belongs to a stream (dev_alloc: the compute stream; dev_alloc_on: the
 *     one you name). dev_free gives the block back to that stream's pool AT
 *     ONCE: the stream's next allocation may reuse it, which is safe for that
 *     stream (stream order) and for nothing else. So before freeing a buffer
 *     another stream used, make its stream wait for an event recorded after
 *     that use (FSDP2 keeps such buffers in an AllGatherState or a
 *     ReduceScatterState until then), or call dev_record_stream.
 *   - Memory is counted in HOST CALL ORDER (like torch.cuda.memory_allocated):
 *     dev_alloc adds its bytes, dev_free removes them, at the call. So the
 *     peak is a property of your program, the same on every run (unless you
 *     use dev_record_stream: see there).
 *   - Fresh allocations are filled with NaN: reading memory nobody wrote
 *     shows up as a NaN loss.
 *   - The race detector (on by default) stops the run with one line naming the
 *     buffer, both streams and the missing wait when a stream reads what
 *     another stream writes (or writes what it reads) without an event wait or
 *     a host sync in between, touches a block of another stream's pool before
 *     waiting for that stream, frees a buffer another stream may still use,
 *     or touches a buffer after its dev_free. It decides in host order: the
 *     same verdict on every run.
 *   - Collectives that differ across ranks stop with every rank's call named;
 *     a collective whose peers never come stops after --collective-timeout-s
 *     with a flight recorder of every rank's last collectives.
 * Misuse (double free, waiting on an event never recorded, ...) is one line
 * "error: ..." and exit status 2.
 */
#ifndef HWFSDP_DEVICE_H
#define HWFSDP_DEVICE_H

#include <stddef.h>
#include <stdint.h>

typedef struct Dev Dev;
typedef struct Stream Stream;
typedef struct Event Event;

/* ---------------------------------------------------------------- the rank */

int dev_rank(const Dev *d);         /* 0 .. world_size-1 */
int dev_world_size(const Dev *d);

/* ----------------------------------------------------------------- streams */

/* The compute stream every rank has ("compute"): module forward and backward
 * run on it. */
Stream *dev_compute_stream(Dev *d);
/* A new stream, destroyed with the rank. Create your streams in the same
 * order on every rank (collectives match by stream); at most DEV_MAX_STREAMS
 * per rank, the compute stream included. */
#define DEV_MAX_STREAMS 64 /* a stream is one bit of the allocator's 64-bit masks */
Stream *dev_stream_create(Dev *d, const char *name);
/* Enqueue a copy / a byte fill on s (traced as "copy" / "memset"). */
void dev_memcpy_async(Stream *s, void *dst, const void *src, size_t bytes);
void dev_memset_async(Stream *s, void *dst, int byte, size_t bytes);
/* Many copies as ONE launch (FSDP2's fused copy-in, copy-out and chunk-cat:
 * torch._foreach_copy_, split_with_sizes_copy, _chunk_cat). Each copy of the
 * list costs what its bytes cost, but the launch overhead is paid once: at
 * world 64 a copy-out of 9 params is 576 copies, and 576 launches cost more
 * than the bytes. Traced as one "copy" slice "<module>.<name>" (name: what it
 * is, e.g. "copy_in"; a batch between host and device memory adds its
 * direction: "copy_in.h2d"). The list is read at the call (reuse it at once).
 * No two destinations may overlap, nor any destination any source; every
 * copy goes the same way (device/device, host->device or device->host). */
typedef struct {
    void *dst;
    const void *src;
    size_t bytes;
} DevCopy;
void dev_memcpy_batch_async(Stream *s, const char *name, const DevCopy *copies, size_t n);
/* Block the host until the work enqueued on s (or on every stream) finished. */
void dev_stream_synchronize(Stream *s);
void dev_synchronize(Dev *d);

/* ------------------------------------------------------------------ events */

Event *dev_event_create(Dev *d, const char *name);
void dev_event_destroy(Event *e);
void dev_event_record(Event *e, Stream *s);
/* Later work on s waits for e's most recent record (as of now). Fatal if e
 * was never recorded. In the trace: a "wait" slice on s when it had to wait. */
void dev_stream_wait_event(Stream *s, Event *e);
/* Block the host until e's most recent record completed (fatal if never
 * recorded); dev_event_query: 1 if it has, 0 if not yet. On the CPU both
 * follow the modelled clock (HANDOUT: "Time"): query answers whether the
 * record's modelled time is past the host's, the same on every run. */
void dev_event_synchronize(Event *e);
int dev_event_query(Event *e);

/* ------------------------------------------------------------ data types */

/* Element types of the mixed-precision policy (stage 08). A bfloat16 is
 * stored as its 16 bits, the top half of the float32 with the same value:
 * 1 sign bit, 8 exponent bits (float32's range), 7 mantissa bits (about 3
 * significant digits). Convert only with the launch_cast_* helpers below
 * (round to nearest, ties to even), never by shifting bits yourself. */
typedef uint16_t Bf16;
typedef enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 } DType;

/* ------------------------------------------------------------------ memory */

/* Every allocation carries a tag: the snapshots and the grader group bytes by it. */
typedef enum {
    MEM_PARAM = 0,          /* full (never sharded) parameter, e.g. model init */
    MEM_PARAM_SHARD,        /* a DTensor's local shard */
    MEM_UNSHARDED_PARAM,    /* all-gathered parameters of a module */
    MEM_GRAD_SHARD,         /* sharded gradient */
    MEM_UNSHARDED_GRAD,     /* a module's full gradients, before reduce-scatter */
    MEM_ACTIVATION,         /* saved activations and module outputs */
    MEM_OPTIM_STATE,        /* AdamW exp_avg / exp_avg_sq */
    MEM_COMM_BUFFER,        /* flat all-gather / reduce-scatter buffers */
    MEM_TEMP,               /* scratch */
    MEM_TAG_COUNT
} MemTag;

/* Every allocation's address is a multiple of this, and its storage a
 * multiple of it in size (at least one). */
#define DEV_ALLOC_ALIGN 64

/* A new allocation of `bytes` (DEV_ALLOC_ALIGN-aligned), tagged and named (the name
 * is copied; it shows in snapshots and race messages), from the compute
 * stream's pool. Counted at once. bytes may be 0 (a unique non-NULL pointer). */
void *dev_alloc(Dev *d, size_t bytes, MemTag tag, const char *name);
float *dev_alloc_f32(Dev *d, size_t count, MemTag tag, const char *name);
/* The same from stream s's pool: allocate a buffer on the stream that fills
 * it (another stream may touch it only after waiting for s). */
void *dev_alloc_on(Stream *s, size_t bytes, MemTag tag, const char *name);
float *dev_alloc_f32_on(Stream *s, size_t count, MemTag tag, const char *name);
/* count bfloat16 elements (2 bytes each), from the compute stream's / s's pool. */
Bf16 *dev_alloc_bf16(Dev *d, size_t count, MemTag tag, const char *name);
Bf16 *dev_alloc_bf16_on(Stream *s, size_t count, MemTag tag, const char *name);
/* Release an allocation (NULL is ignored): uncounted, and back to its
 * stream's pool, at once. Fatal if p is not the start of a live allocation
 * of this rank. */
void dev_free(Dev *d, void *p);
/* PyTorch's tensor.record_stream(s): when p is freed, its block stays held
 * (and counted; "active_pending_free" in the snapshot) until s finished the
 * work queued before the free. Memory then depends on how far the streams
 * got, not on your program, which is why FSDP2 avoids it. */
void dev_record_stream(void *p, Stream *s);
/* Pinned host memory, as cudaHostAlloc (stage 10's CPU offload keeps the
 * shards there; stage 02 on may copy a value back into it, as the grad norm
 * fsdp_optimizer_step returns, before a dev_stream_synchronize): a pool of its
 * own, counted apart from device memory (dev_mem_host_*; "host_events" in the
 * snapshot), NaN-filled like device memory. A stream copies between it and
 * device memory with dev_memcpy_async (traced "h2d" / "d2h", as long as the
 * PCIe model says: --pcie-gbps, --pcie-latency-us), and kernels may read and
 * write it, as a GPU kernel reads mapped pinned memory. The race detector
 * orders streams on it as on device memory; dev_free gives a block back once
 * every stream is past the free (PyTorch's pinned allocator waits for the
 * streams that used a block the same way). */
void *dev_alloc_host(Dev *d, size_t bytes, MemTag tag, const char *name);
float *dev_alloc_host_f32(Dev *d, size_t count, MemTag tag, const char *name);
size_t dev_mem_host_current(const Dev *d);
size_t dev_mem_host_peak(const Dev *d);
size_t dev_mem_current(const Dev *d);   /* bytes allocated now */
size_t dev_mem_peak(const Dev *d);      /* most bytes allocated at once this step */

/* ------------------------------------------------------------- collectives */

typedef enum { RED_SUM = 0, RED_AVG = 1 } RedOp;

/* All float32, counts in elements, NCCL semantics, enqueued on s; `label`
 * names the module served (trace: "<label>.all_gather").
 * all_gather:     recv[r*send_count + i] = send of rank r [i]
 *                 (in place allowed: send == recv + rank*send_count)
 * reduce_scatter: recv[i] = op over r of (send of rank r)[rank*recv_count + i]
 *                 (in place allowed: recv == send + rank*recv_count)
 * all_reduce:     recv[i] = op over r of (send of rank r)[i]  (send == recv allowed)
 * Send and recv that overlap any other way stop the run with one line.
 * broadcast:      buf of every rank := buf of root
 * Sums add in rank order 0, 1, ..., N-1 (bitwise reproducible); RED_AVG
 * divides the sum by N. */
void coll_all_gather(Dev *d, const float *send, float *recv, size_t send_count, Stream *s, const char *label);
void coll_reduce_scatter(Dev *d, const float *send, float *recv, size_t recv_count, RedOp op, Stream *s,
                         const char *label);
void coll_all_reduce(Dev *d, const float *send, float *recv, size_t count, RedOp op, Stream *s, const char *label);
void coll_broadcast(Dev *d, float *buf, size_t count, int root, Stream *s, const char *label);
void coll_barrier(Dev *d, Stream *s, const char *label);
/* The same on bfloat16 words: half the bytes on the wire. The reduce-scatter
 * widens every rank's value to float32, sums in rank order in float32 (then
 * divides, for RED_AVG) and rounds the result to bfloat16 once. */
void coll_all_gather_bf16(Dev *d, const Bf16 *send, Bf16 *recv, size_t send_count, Stream *s, const char *label);
void coll_reduce_scatter_bf16(Dev *d, const Bf16 *send, Bf16 *recv, size_t recv_count, RedOp op, Stream *s,
                              const char *label);

/* ---------------------------------------------------------- process groups */

/* A process group: some of the ranks, with collectives among them only
 * (stage 09). The coll_* calls above are those of the world group. A group's
 * ranks are numbered 0 .. pg_size-1 in world-rank order; its collectives use
 * that order (all-gather segments, reduce-scatter chunks, sums). One stream
 * may carry several groups' collectives: the members of a group must issue
 * its collectives in the same order, on the same stream. The groups of a
 * --mesh come with the mesh (DeviceMesh below). */
typedef struct ProcessGroup ProcessGroup;
ProcessGroup *dev_world_group(Dev *d);
int pg_rank(const ProcessGroup *g);         /* this rank's number in g */
int pg_size(const ProcessGroup *g);
const char *pg_name(const ProcessGroup *g); /* "world", "shard0", "replicate1", ... */
void pg_all_gather(ProcessGroup *g, const float *send, float *recv, size_t send_count, Stream *s, const char *label);
void pg_reduce_scatter(ProcessGroup *g, const float *send, float *recv, size_t recv_count, RedOp op, Stream *s,
                       const char *label);
void pg_all_reduce(ProcessGroup *g, const float *send, float *recv, size_t count, RedOp op, Stream *s,
                   const char *label);
void pg_all_gather_bf16(ProcessGroup *g, const Bf16 *send, Bf16 *recv, size_t send_count, Stream *s,
                        const char *label);
void pg_reduce_scatter_bf16(ProcessGroup *g, const Bf16 *send, Bf16 *recv, size_t recv_count, RedOp op, Stream *s,
                            const char *label);

/* ---------------------------------------------------- point to point (11-12) */

/* NCCL's ncclSend / ncclRecv, for pipeline stages: `count` floats of buf to
 * (from) world rank `peer`, enqueued on s. A send and its receive meet: each
 * side's stream waits until the other side's is there, then both go on once
 * the data has crossed, as NCCL's do. They pair up in the order each side
 * issued them, on any streams: the k-th send from a to b meets b's k-th
 * receive from a.
 * `microbatch` is what the buffer carries: both sides must name the same
 * (a mismatch stops the run naming both ranks and both microbatches; the
 * trace shows it).
 * Two ranks that send to each other would each wait for the other's
 * receive: put the sends and receives that must progress together between
 * dev_group_start and dev_group_end (NCCL's ncclGroupStart / ncclGroupEnd),
 * all on one stream. The group is then one unit: every send is posted before
 * any receive waits. Outside a group each call is a group of its own. */
void dev_send(Stream *s, const float *buf, size_t count, int peer, int microbatch, const char *label);
void dev_recv(Stream *s, float *buf, size_t count, int peer, int microbatch, const char *label);
void dev_group_start(Dev *d);
void dev_group_end(Dev *d);

/* ----------------------------------------------------------------- DTensor */

/* The most ranks that execute: each is a thread of the process (or a process
 * under mpirun) with its own streams and allocator. */
#define WORLD_MAX_RANKS 64
/* The largest world a dry run (--dry-run) models: above WORLD_MAX_RANKS it
 * executes one representative rank per class of symmetric ranks (every rank
 * of plain FSDP or HSDP is one class; a pipeline stage's ranks are one) and
 * prices each collective on its group's full size. dev_rank and
 * dev_world_size are the modelled ones: your code sees rank 0 of 16,384. */
#define WORLD_MAX_DRY_RANKS 16384

/* The device mesh, as FSDP2's DeviceMesh. Without --mesh it is 1-D: the
 * world, every rank a shard. With --mesh R,S (HSDP, stage 09) it is 2-D,
 * R rows ("replicate" dim) of S ranks ("shard" dim), rank = i * S + j:
 *
 *              shard j:   0     1     2
 *   replicate i = 0:    [ r0    r1    r2 ]   <- shard group "shard0"
 *   replicate i = 1:    [ r3    r4    r5 ]   <- shard group "shard1"
 *                          ^ replicate group "replicate0" = {r0, r3}
 *
 * A parameter is split over the S ranks of a row and each row holds a full
 * copy: placements (Replicate(), Shard(0)). */
typedef struct {
    int size;                      /* every rank: the world */
    int ranks[WORLD_MAX_RANKS];    /* ranks[i] = i, row-major over shape; listed up to WORLD_MAX_RANKS
                                      (a dry run's world may be larger: its rank i is still i) */
    int ndim;                      /* 1, or 2 with --mesh */
    int shape[2];                  /* 1-D: {world, 1}; 2-D: {R, S} */
    ProcessGroup *shard_group;     /* this rank's row: the ranks its params are split over (1-D: the world) */
    ProcessGroup *replicate_group; /* this rank's column (same shard index in every row); NULL when 1-D */
} DeviceMesh;

typedef enum { PLACEMENT_NONE = 0, PLACEMENT_SHARD0 = 1, PLACEMENT_REPLICATE = 2, PLACEMENT_FLAT = 3 } Placement;

/* A sharded parameter, as FSDP2's DTensor with placement Shard(0).
 * Dim 0 is split over the shard group's N ranks (the world, or S with --mesh)
 * as torch.chunk splits it: every rank gets padded_rows = ceil(global_rows / N)
 * rows until they run out, so the trailing ranks get fewer or none (5 rows
 * on 4 ranks: 2, 2, 1, 0). Every local shard is stored padded to padded_rows
 * rows (padding rows are zeros), so every rank's piece of an all-gather has
 * the same size. row_offset is the first global row this rank owns:
 * pg_rank(shard group) * padded_rows. A
 * rank that owns no rows has row_offset = global_rows (its empty range starts
 * at the end of the tensor, as torch.chunk's missing chunks do), so
 * [row_offset, row_offset + local_rows) is always a valid range.
 *
 * PLACEMENT_FLAT (stage 13, FSDP1's FlatParameter): a unit's params (one
 * module, or a bucket of consecutive ones) lie in one 1-D buffer, param p at
 * elements [flat_offset, flat_offset + numel); the buffer, padded to N x S
 * elements (S = flat_shard_numel), is split evenly: rank r (pg_rank of the
 * shard group) holds flat[r*S, (r+1)*S). The param is seen as 1-D
 * (global_rows = numel, row_numel = 1, padded_rows = local_rows) and rank r
 * holds its elements [row_offset, row_offset + local_rows):
 *   row_offset                = clamp(r*S - flat_offset, 0, numel)
 *   row_offset + local_rows   = clamp((r+1)*S - flat_offset, 0, numel)
 * (an empty piece sits at 0 or at numel). local, grad, exp_avg and exp_avg_sq
 * point into the unit's [S] buffers at element
 * clamp(flat_offset + row_offset - r*S, 0, S), an empty piece too, and are
 * never freed one by one; the [S] elements outside every piece are zero. */
typedef struct {
    float *local;             /* [padded_rows, row_numel] this rank's shard */
    float *grad;              /* [padded_rows, row_numel] sharded grad (NULL when none) */
    float *exp_avg;           /* [local_rows * row_numel] AdamW state of the shard */
    float *exp_avg_sq;        /* [local_rows * row_numel] */
    size_t global_rows;       /* global shape[0] */
    size_t row_numel;         /* product of the other global dims (1 for 1-D) */
    size_t local_rows;        /* rows this rank owns (may be 0) */
    size_t padded_rows;       /* rows stored: ceil(global_rows / N) */
    size_t row_offset;        /* first global row this rank owns (see above) */
    const DeviceMesh *mesh;   /* the mesh (FsdpConfig.mesh) */
    Placement placement;      /* Shard(0) for FSDP, on the mesh's shard dim (a 2-D
                                 mesh adds Replicate() on its replicate dim); Flat */
    size_t flat_offset;       /* Flat: the param's first element in its unit's flat buffer */
    size_t flat_shard_numel;  /* Flat: S, the elements of the unit every rank holds */
    int flat_unit;            /* Flat: Module.index of the unit's first module */
} DTensor;

/* ----------------------------------------------------------- launch helpers */

/* AdamW hyperparameters (torch.optim.AdamW semantics). */
typedef struct {
    float lr;            /* peak learning rate (torchtitan default 8e-4) */
    float beta1, beta2;  /* 0.9, 0.95 */
    float eps;           /* 1e-8 */
    float weight_decay;  /* 0.1, decoupled */
    int warmup_steps;    /* linear warmup length */
    float max_norm;      /* global-norm clipping threshold (<= 0: off) */
} AdamWConfig;

/* Queue *acc += sum of x[i]^2 on s (acc: one device float). */
void launch_sumsq_accumulate(Stream *s, float *acc, const float *x, size_t n);
/* Queue out[i] = a[i] + b[i] for n elements on s (out may be a or b). */
void launch_add(Stream *s, float *out, const float *a, const float *b, size_t n);
/* Queue out[i] = in[i] rounded to bfloat16 (nearest, ties to even; NaN
 * stays NaN, overflow gives inf) / widened back to float32 (exact), n
 * elements on s. */
void launch_cast_to_bf16(Stream *s, Bf16 *out, const float *in, size_t n);
void launch_cast_from_bf16(Stream *s, float *out, const Bf16 *in, size_t n);
/* Many casts to bfloat16 as ONE launch (FSDP2 casts inside its fused copies:
 * the _foreach_copy_ into the bfloat16 all-gather input, _chunk_cat into a
 * bfloat16 reduce-scatter input): dst[i] = src[i] rounded as
 * launch_cast_to_bf16 does, for each CastCopy of the list. One kernel slice
 * "<module>.<name>" (name: what it is, no dot, e.g. "copy_in"), costed as one
 * element-wise kernel over all the elements. The list is read at the call
 * (reuse it at once); no destination may overlap another cast's source or
 * destination. n == 0: nothing to launch. */
typedef struct {
    Bf16 *dst;        /* [n] bfloat16 */
    const float *src; /* [n] float32 */
    size_t n;         /* elements */
} CastCopy;
void launch_cast_batch_to_bf16(Stream *s, const char *name, const CastCopy *list, size_t n);
/* Queue one AdamW update of n elements of a shard on s, t = 1-based step. The
 * clip coefficient min(1, max_norm / (sqrt(*total_sumsq) + 1e-6)) is formed on
 * the stream from *total_sumsq (the global sum of squared grads, a device float). */
void launch_adamw(Stream *s, float *param, const float *grad, float *exp_avg, float *exp_avg_sq, size_t n,
                  const AdamWConfig *c, float lr, int t, const float *total_sumsq);

#endif
