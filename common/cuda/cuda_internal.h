/* cuda_internal.h — private state of the CUDA backend (runtime_cuda.c,
 * coll_cuda.c, coll_kernels.cu): what hangs off the runtime's `backend`
 * pointers (backend.h) and the functions its table of operations points to.
 * Plain C over the CUDA runtime API; only the kernels are CUDA C++. */
#ifndef HWFSDP_CUDA_INTERNAL_H
#define HWFSDP_CUDA_INTERNAL_H

#include "cuda/cuda_check.h"
#include "runtime/internal.h"
#include "runtime/mpi_world.h"

#include <nccl.h>

#define NCCL_CHECK(call)                                                                                               \
    do {                                                                                                               \
        ncclResult_t r_ = (call);                                                                                      \
        if (r_ != ncclSuccess) fatal("%s:%d: %s failed: %s", __FILE__, __LINE__, #call, ncclGetErrorString(r_));      \
    } while (0)

/* An op whose duration is measured by two timing events on its stream (the
 * clock's OpSpan); it becomes a TraceRec once both completed. */
typedef struct {
    cudaEvent_t start, end;
    int anchor;   /* CudaDev.anchors index its times are measured from */
    TraceRec rec; /* ts/dur filled at resolution */
} PendingTiming;

/* A free storage block of the caching allocator: it belongs to the pool of
 * the stream it was allocated on and serves that stream's next request of
 * exactly its size. */
typedef struct {
    void *p;
    size_t bytes;
    int stream;
} CachedBlock;

/* nccl backends: one process group's NCCL state on this rank (CudaDev.groups[g->id]),
 * as PyTorch's ProcessGroupNCCL keeps it: ONE communicator (the world's from
 * ncclCommInitRank, every other group's an ncclCommSplit of it, made when the
 * group is) and ONE NCCL stream that every collective of the group runs on, in
 * the order the host issued them (coll_cuda.c says why). */
typedef struct {
    ncclComm_t comm;             /* NULL: no such group, or not a nccl backend */
    cudaStream_t st;             /* the group's NCCL stream (non-blocking) */
    cudaEvent_t in, out;         /* in: the calling stream's point a collective follows; out: its end, which the
                                  * calling stream waits for */
    float *one;                  /* the barrier's device float (an all-reduce sums it): zeroed at creation */
    char name[PG_NAME_MAX];      /* the group's name (hang reports; the ProcessGroup goes after dev_fini) */
    /* the last collective issued on the group (hang reports); issued == 0: none yet */
    uint64_t issued, last_seq;   /* last_seq: its number on its calling stream (Op.coll_seq) */
    int last_kind;
    const char *last_label;      /* interned */
    char last_stream[32];        /* the calling stream's name */
} CudaGroup;

/* Dev.backend */
struct CudaDev {
    int device;                  /* cudaSetDevice index of this rank */
    cudaStream_t side;           /* poisoning fresh storage (synchronous) */
    cudaEvent_t epoch;           /* recorded at init; trace times count from it */
    double epoch_host_us;        /* the same instant on the world's host clock */
    /* cudaEventElapsedTime gives float milliseconds: from one epoch a trace
     * would lose resolution as a run goes on (8 us after 130 s). Spans are
     * measured from the latest anchor instead, a new one a second after the
     * last, each placed on the epoch's line by the float gap from its
     * predecessor (sub-microsecond over a second). anchors[0] is the epoch. */
    cudaEvent_t *anchors;
    double *anchor_us;           /* anchors[i] on the world's host clock (double) */
    int n_anchors, anchors_cap;
    double anchor_host_us;       /* host time the latest anchor was recorded */
    PendingTiming *timing;       /* ops waiting for their timing events */
    size_t n_timing, timing_cap;
    cudaEvent_t *timing_pool;    /* timing events ready for reuse */
    size_t n_timing_pool, timing_pool_cap;
    cudaEvent_t *fence_pool;     /* non-timing events for frees */
    size_t n_fence_pool, fence_pool_cap;
    CachedBlock *cache;          /* free segments, reused for requests of the same rounded size */
    size_t n_cache, cache_cap, cache_bytes;
    uint64_t cuda_mallocs, cache_hits;
    CudaGroup groups[PG_MAX];    /* nccl backends: by group id ([0]: the world) */
};

/* One collective as a rank posts it to its peers (threads share one GPU or
 * one process): what it asks for, its buffers and an event marking a point
 * of its stream. */
typedef struct {
    CollPost post;
    cudaEvent_t ev;
} CudaPost;

/* Host rendezvous of a group's ranks (threads of this process) for one
 * stream index; slots (by group rank) are double-buffered by generation parity. */
typedef struct {
    CollRendezvous rv;           /* its mutex guards slots and nccl_id too */
    CudaPost slots[2][WORLD_MAX_RANKS];
    ncclUniqueId nccl_id;        /* nccl backend, channel (0, 0, 0): rank 0's id for the world's communicator */
} CudaChan;

/* World.backend */
struct CudaWorld {
    int ndevices;                /* visible GPUs */
    MpiWorld *mpi;               /* nccl-mpi: the ranks are MPI processes (mpi_world.c); NULL: threads */
    int node_rank, node_size;    /* nccl-mpi: this process among the ranks of its node */
    ChanRegistry chans;          /* CudaChan, for ranks that are threads */
    /* local backend, point to point (World.p2p's mailboxes carry their events): events ready for
     * reuse (cudaEventDisableTiming), shared by the ranks' host threads */
    pthread_mutex_t p2p_mu;
    cudaEvent_t *p2p_pool;
    size_t n_pool, pool_cap;
};

/* Stream.backend (Event.backend is the cudaEvent_t itself) */
struct CudaStream {
    cudaStream_t st;
    cublasHandle_t blas;
    cudaEvent_t ready, reduced, done; /* local collectives: posted to the peers */
    float *scratch;              /* local all_reduce: this rank's reduced chunk, read by peers */
    size_t scratch_floats;
    void **retired;              /* outgrown scratch buffers (peers may still read them) */
    int n_retired;
    CudaChan *pg_chans[PG_MAX];  /* thread backends: rendezvous per group id ([0]: the world) */
};

static inline struct CudaWorld *cuda_world(const World *w) { return (struct CudaWorld *)w->backend; }
static inline struct CudaDev *cuda_dev(const Dev *d) { return (struct CudaDev *)d->backend; }
static inline struct CudaStream *cuda_stream(const Stream *s) { return (struct CudaStream *)s->backend; }
static inline cudaEvent_t cuda_event(const Event *e) { return (cudaEvent_t)e->backend; }

/* runtime_cuda.c. The clock: the GPU's own. An op's span is two timing
 * events on its stream, turned into its trace record at a synchronization;
 * host waits (s NULL) are not traced, nor are stream waits (min_us unused). */
typedef struct {
    void *start, *end;    /* the two timing events on the stream */
} OpSpan;
/* span_end's min_us for a slice kept whatever its length. */
#define SPAN_ANY_LENGTH (-1.0)
void cuda_span_begin(Dev *d, Stream *s, OpSpan *span);
void cuda_span_end(Dev *d, Stream *s, OpSpan *span, const TraceRec *rec, double min_us);
/* The same on a raw CUDA stream (a group's NCCL stream): rec says which runtime stream it is filed under. */
void cuda_span_begin_on(Dev *d, cudaStream_t st, OpSpan *span);
void cuda_span_end_on(Dev *d, cudaStream_t st, OpSpan *span, const TraceRec *rec, double min_us);
/* cudaEventQuery: 1 = completed, 0 = not yet; any other answer is fatal. */
int cuda_event_done(cudaEvent_t e);
/* The host waiting for the GPU: for an event (st unused) or, e NULL, for a
 * stream. local: cudaEventSynchronize / cudaStreamSynchronize. nccl backends:
 * polled, watching the rank's communicators (cuda_nccl_watch); what and name
 * say what is waited for in a hang report ("dev_synchronize: stream", "compute"). */
void cuda_wait(Dev *d, cudaEvent_t e, cudaStream_t st, const char *what, const char *name);
/* 1 for the backends with one GPU per rank and NCCL between them */
static inline int cuda_is_nccl(const World *w) {
    return w->cfg.backend == BACKEND_NCCL || w->cfg.backend == BACKEND_NCCL_MPI;
}
/* The trace record of an op enqueued now on s, in the host's scope. */
TraceRec cuda_trace_rec(Stream *s, const char *prefix, const char *name, const char *cat, size_t bytes,
                        const char *dtype, const char *group);
CudaChan *cuda_world_channel(World *w, int stream_index, int pg_id, int color);
extern const BackendOps cuda_backend; /* local, nccl and nccl-mpi (backends_cuda.c) */
/* coll_cuda.c: the collective entries of cuda_backend */
void cuda_coll_stream_created(Stream *s);
void cuda_coll_stream_destroy(Stream *s);
void cuda_stream_join_group(Stream *s, ProcessGroup *g);
void cuda_coll_enqueue(Stream *s, Op *o);
/* the local backend's point-to-point events (CudaWorld.p2p_pool, and those a
 * send left in World.p2p's mailboxes): made with the world, destroyed with it */
void cuda_p2p_world_init(World *w);
void cuda_p2p_world_fini(World *w);
/* nccl backends: group g's communicator and NCCL stream (at its creation, in
 * the same order on every rank); all of them torn down (at dev_fini). */
void cuda_coll_group_init(ProcessGroup *g);
void cuda_coll_groups_fini(Dev *d);
/* nccl backends, while the host polls the GPU (cuda_wait): an asynchronous
 * NCCL error on any of the rank's communicators, or a wait past the world's
 * collective_timeout_s with a collective unfinished, aborts them all and stops
 * with one line (fatal). */
void cuda_nccl_watch(Dev *d, const char *what, const char *name, double waited_s);
/* coll_kernels.cu: out[i] = sum over r in rank order of in[r][offset + i] (divided by n if avg), in
 * float32; the buffers hold float32, or bfloat16 words when bf16 (summed widened, rounded once) */
void cuda_reduce_ranks(void *out, const void *const *in, int n, size_t offset, size_t count, int avg, int bf16,
                       cudaStream_t st);
/* copy_kernels.cu: the n copies of a host list (read at the call) as one kernel launch on st; bytes: their sum */
void cuda_copy_batch(const DevCopy *copies, size_t n, size_t bytes, cudaStream_t st);

#endif
