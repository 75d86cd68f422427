/* runtime_cuda.c — the CUDA backend of device.h (its table of operations,
 * cuda_backend, is at the end): streams, events, launches, copies, op timings
 * for the trace, and the caching allocator's storage.
 *
 * What is shared with the CPU backend (world.c, alloc.c, artifacts.c):
 * ranks, scopes, host exchange, allocation accounting in host order, memory
 * snapshots and the trace writer. What is here:
 *   - a Stream is a cudaStream_t (non-blocking) with its own cuBLAS handle;
 *   - dev_launch runs the kernel function ON THE HOST THREAD with
 *     cuda_current_stream() set: it only enqueues CUDA work (kernels.h);
 *   - an Event is a cudaEvent_t; waits are cudaStreamWaitEvent;
 *   - the host waits for the GPU through cuda_wait only (nccl backends:
 *     polled, watching NCCL for errors and hangs);
 *   - traced ops are bracketed by two timing events and become trace
 *     records once both completed (resolved at synchronisations);
 *   - storage comes from cudaMalloc'd segments, cached per stream as
 *     PyTorch's caching allocator does: a freed block goes back to the pool
 *     of the stream it was allocated on at once and serves that stream's next
 *     request of its rounded size (reuse in stream order); a block marked with
 *     dev_record_stream waits for events recorded on those streams first.
 * Built only by `make cuda`. */
#include "cuda/cuda_internal.h"
#include "model/kernels.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* The launch context: which stream the kernel function being run on this
 * host thread enqueues on. Set only around the call in dev_launch. */
static __thread cudaStream_t tls_stream;
static __thread cublasHandle_t tls_blas;
static __thread int tls_tf32;

cudaStream_t cuda_current_stream(void) { return tls_stream; }
cublasHandle_t cuda_current_cublas(void) { return tls_blas; }
int cuda_tf32_enabled(void) { return tls_tf32; }

/* cudaEventQuery / cudaStreamQuery: 1 = completed, 0 = not yet. "Not ready"
 * is not an error, but it would linger as the last error and fail the next
 * launch check. */
static int query_done(cudaError_t r, const char *call) {
    if (r == cudaSuccess) return 1;
    if (r == cudaErrorNotReady) {
        (void)cudaGetLastError();
        return 0;
    }
    fatal("%s failed: %s (%s)", call, cudaGetErrorString(r), cudaGetErrorName(r));
}

int cuda_event_done(cudaEvent_t e) { return query_done(cudaEventQuery(e), "cudaEventQuery"); }
static int event_done(cudaEvent_t e) { return cuda_event_done(e); }

/* Every place the host waits for the GPU comes here. local: the blocking
 * call (ranks share one GPU and never wait inside it for each other). nccl
 * backends: a NCCL kernel waiting for a peer that never comes blocks forever,
 * and so would cudaStreamSynchronize behind it; instead the host polls
 * (50 us naps) and, between polls, asks NCCL for an asynchronous error and
 * checks the world's collective_timeout_s (cuda_nccl_watch: abort, one line). */
void cuda_wait(Dev *d, cudaEvent_t e, cudaStream_t st, const char *what, const char *name) {
    if (!cuda_is_nccl(d->world)) {
        if (e) CUDA_CHECK(cudaEventSynchronize(e));
        else CUDA_CHECK(cudaStreamSynchronize(st));
        return;
    }
    const double t0 = now_us();
    const struct timespec nap = {0, 50 * 1000};
    for (;;) {
        if (e ? query_done(cudaEventQuery(e), "cudaEventQuery") : query_done(cudaStreamQuery(st), "cudaStreamQuery"))
            return;
        cuda_nccl_watch(d, what, name, (now_us() - t0) / 1e6);
        nanosleep(&nap, NULL);
    }
}

/* ------------------------------------------------------------------ world */

/* nccl-mpi: the ranks are MPI processes first (mpi_world.c), then one GPU each. */
static void cuda_world_init(World *w, long *cores) {
    struct CudaWorld *cw = xcalloc(1, sizeof *cw);
    chan_registry_init(&cw->chans, sizeof(CudaChan), offsetof(CudaChan, rv.mu), offsetof(CudaChan, rv.cv));
    w->backend = cw;
    cuda_p2p_world_init(w);
    if (w->cfg.backend == BACKEND_NCCL_MPI) {
        cw->mpi = mpi_world_create(w, cores);
        cw->node_rank = mpi_world_node_rank(cw->mpi);
        cw->node_size = mpi_world_node_size(cw->mpi);
    }
    cudaError_t r = cudaGetDeviceCount(&cw->ndevices);
    if (r != cudaSuccess || cw->ndevices < 1)
        fatal("no CUDA device is visible (%s); the CPU build (make) runs without one",
              r != cudaSuccess ? cudaGetErrorString(r) : "0 devices");
    int world = w->cfg.world_size;
    if (w->cfg.backend == BACKEND_NCCL && world > cw->ndevices)
        fatal("--backend nccl needs one GPU per rank: --world %d but %d GPU%s visible (--backend local lets ranks "
              "share one GPU)", world, cw->ndevices, cw->ndevices == 1 ? " is" : "s are");
    /* nccl-mpi: either every GPU of the node is visible to every process (rank on the node
     * picks its own), or the launcher gave each process one (CUDA_VISIBLE_DEVICES per rank,
     * e.g. SLURM --gpus-per-task=1): it sees one GPU, device 0. Two processes handed the
     * same GPU stop in ncclCommInitRank (NCCL reports the duplicate GPU). */
    if (w->cfg.backend == BACKEND_NCCL_MPI && cw->node_size > cw->ndevices && cw->ndevices != 1)
        fatal("--backend nccl-mpi needs one GPU per rank: %d ranks on this node but %d GPUs are visible to each "
              "(make all of the node's GPUs visible to every rank, or exactly one per rank)",
              cw->node_size, cw->ndevices);
}

static void cuda_world_fini(World *w) {
    struct CudaWorld *cw = cuda_world(w);
    if (!cw) return;
    chan_registry_fini(&cw->chans);
    cuda_p2p_world_fini(w);
    mpi_world_destroy(cw->mpi);
    free(cw);
    w->backend = NULL;
}

/* Ranks as threads (local, nccl) or as MPI processes (nccl-mpi). */
static void cuda_host_exchange(Dev *d, double value, double *out) {
    struct CudaWorld *cw = cuda_world(d->world);
    if (cw->mpi) mpi_world_exchange(cw->mpi, value, out);
    else threads_host_exchange(d, value, out);
}

static void cuda_group_init(ProcessGroup *g) {
    struct CudaWorld *cw = cuda_world(g->dev->world);
    if (cw->mpi) mpi_world_group_init(cw->mpi, g);
    cuda_coll_group_init(g); /* nccl backends: the group's communicator and NCCL stream */
}

static void cuda_group_fini(ProcessGroup *g) {
    struct CudaWorld *cw = cuda_world(g->dev->world);
    if (cw->mpi) mpi_world_group_fini(cw->mpi, g);
}

CudaChan *cuda_world_channel(World *w, int stream_index, int pg_id, int color) {
    return chan_registry_get(&cuda_world(w)->chans, stream_index, pg_id, color);
}

/* -------------------------------------------------------------------- Dev */

static cudaEvent_t pool_get(cudaEvent_t **pool, size_t *n, unsigned flags) {
    if (*n) return (*pool)[--*n];
    cudaEvent_t e;
    CUDA_CHECK(cudaEventCreateWithFlags(&e, flags));
    return e;
}

static void pool_put(cudaEvent_t **pool, size_t *n, size_t *cap, cudaEvent_t e) {
    if (*n == *cap) {
        *cap = *cap ? *cap * 2 : 64;
        *pool = xrealloc(*pool, *cap * sizeof **pool);
    }
    (*pool)[(*n)++] = e;
}

static void cuda_dev_init(Dev *d) {
    World *w = d->world;
    struct CudaDev *c = xcalloc(1, sizeof *c);
    d->backend = c; /* cuda_wait reads it */
    switch (w->cfg.backend) {
    case BACKEND_NCCL: c->device = d->rank; break;                   /* one GPU per rank */
    case BACKEND_NCCL_MPI: /* rank on its node, or the one GPU this process was given (cuda_world_init) */
        c->device = cuda_world(w)->ndevices == 1 ? 0 : cuda_world(w)->node_rank;
        break;
    default: c->device = 0; break;                                   /* local: all ranks share GPU 0 */
    }
    CUDA_CHECK(cudaSetDevice(c->device));
    CUDA_CHECK(cudaStreamCreateWithFlags(&c->side, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreate(&c->epoch));
    CUDA_CHECK(cudaEventRecord(c->epoch, c->side));
    cuda_wait(d, c->epoch, NULL, "the clock's epoch event", NULL);
    c->epoch_host_us = now_us() - w->epoch_us;
    c->anchors_cap = 16;
    c->anchors = xmalloc((size_t)c->anchors_cap * sizeof *c->anchors);
    c->anchor_us = xmalloc((size_t)c->anchors_cap * sizeof *c->anchor_us);
    c->anchors[0] = c->epoch;
    c->anchor_us[0] = c->epoch_host_us;
    c->n_anchors = 1;
    c->anchor_host_us = now_us();
}

static void timing_resolve(Dev *d, int wait_all);

static void *cuda_probe_alloc(Dev *d, size_t bytes) {
    void *p = NULL;
    CUDA_CHECK(cudaMalloc(&p, bytes));
    /* zeroed before any stream can write a slot: cudaMemset would queue on the legacy
     * default stream, which the non-blocking streams do not wait for */
    CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, cuda_dev(d)->side));
    cuda_wait(d, NULL, cuda_dev(d)->side, "dev_probe_alloc: the side stream", NULL);
    return p;
}
static void cuda_probe_free(Dev *d, void *p) {
    (void)d;
    CUDA_CHECK(cudaFree(p));
}
static void cuda_probe_read(Dev *d, void *host, const void *probe, size_t bytes) {
    for (int i = 0; i < d->nstreams; i++)
        cuda_wait(d, NULL, cuda_stream(d->streams[i])->st, "dev_probe_read: stream", d->streams[i]->name);
    CUDA_CHECK(cudaMemcpy(host, probe, bytes, cudaMemcpyDeviceToHost));
}

static void cuda_dev_fini(Dev *d) {
    struct CudaDev *c = cuda_dev(d);
    if (!c) return;
    timing_resolve(d, 1);
    cuda_coll_groups_fini(d); /* NCCL streams drained, communicators destroyed (splits first) */
    for (size_t i = 0; i < c->n_cache; i++) CUDA_CHECK(cudaFree(c->cache[i].p));
    d->mem.reserved -= c->cache_bytes;
    for (size_t i = 0; i < c->n_timing_pool; i++) CUDA_CHECK(cudaEventDestroy(c->timing_pool[i]));
    for (size_t i = 0; i < c->n_fence_pool; i++) CUDA_CHECK(cudaEventDestroy(c->fence_pool[i]));
    for (int i = 0; i < c->n_anchors; i++) CUDA_CHECK(cudaEventDestroy(c->anchors[i])); /* [0] is the epoch */
    free(c->anchors);
    free(c->anchor_us);
    CUDA_CHECK(cudaStreamDestroy(c->side));
    free(c->timing);
    free(c->timing_pool);
    free(c->fence_pool);
    free(c->cache);
    free(c);
    d->backend = NULL;
}

/* ----------------------------------------------------------------- timing */

/* The host's wall clock since the world's epoch (the device's events are on the same line: epoch_host_us). */
static double cuda_host_time_us(const Dev *d) { return now_us() - d->world->epoch_us; }

/* A new anchor once a second (CudaDev.anchors): recorded on the idle side
 * stream, so it completes at once and its gap from the last one is known. */
static void anchor_refresh(Dev *d, struct CudaDev *c) {
    double now = now_us();
    if (now - c->anchor_host_us < 1e6) return;
    if (c->n_anchors == c->anchors_cap) {
        c->anchors_cap *= 2;
        c->anchors = xrealloc(c->anchors, (size_t)c->anchors_cap * sizeof *c->anchors);
        c->anchor_us = xrealloc(c->anchor_us, (size_t)c->anchors_cap * sizeof *c->anchor_us);
    }
    cudaEvent_t e;
    CUDA_CHECK(cudaEventCreate(&e));
    CUDA_CHECK(cudaEventRecord(e, c->side));
    cuda_wait(d, e, NULL, "a clock anchor on the side stream", NULL);
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, c->anchors[c->n_anchors - 1], e));
    c->anchors[c->n_anchors] = e;
    c->anchor_us[c->n_anchors] = c->anchor_us[c->n_anchors - 1] + 1000.0 * ms;
    c->n_anchors++;
    c->anchor_host_us = now;
}

void cuda_span_begin(Dev *d, Stream *s, OpSpan *span) {
    cuda_span_begin_on(d, s ? cuda_stream(s)->st : NULL, span); /* s NULL: the host's waits are not traced here */
}

void cuda_span_end(Dev *d, Stream *s, OpSpan *span, const TraceRec *rec, double min_us) {
    cuda_span_end_on(d, s ? cuda_stream(s)->st : NULL, span, rec, min_us);
}

void cuda_span_begin_on(Dev *d, cudaStream_t st, OpSpan *span) {
    span->start = span->end = NULL;
    if (!st) return;
    struct CudaDev *c = cuda_dev(d);
    anchor_refresh(d, c);
    cudaEvent_t e = pool_get(&c->timing_pool, &c->n_timing_pool, cudaEventDefault);
    CUDA_CHECK(cudaEventRecord(e, st));
    span->start = e;
}

void cuda_span_end_on(Dev *d, cudaStream_t st, OpSpan *span, const TraceRec *rec, double min_us) {
    (void)min_us;
    struct CudaDev *c = cuda_dev(d);
    if (!span->start) return;
    if (!rec) { /* not traced: the start event goes back to the pool */
        pool_put(&c->timing_pool, &c->n_timing_pool, &c->timing_pool_cap, (cudaEvent_t)span->start);
        return;
    }
    PendingTiming t = {(cudaEvent_t)span->start, pool_get(&c->timing_pool, &c->n_timing_pool, cudaEventDefault),
                       c->n_anchors - 1, *rec};
    CUDA_CHECK(cudaEventRecord(t.end, st));
    if (c->n_timing == c->timing_cap) {
        c->timing_cap = c->timing_cap ? c->timing_cap * 2 : 1024;
        c->timing = xrealloc(c->timing, c->timing_cap * sizeof *c->timing);
    }
    c->timing[c->n_timing++] = t;
    if (c->n_timing >= 8192) timing_resolve(d, 1); /* bound the events in flight */
}

TraceRec cuda_trace_rec(Stream *s, const char *prefix, const char *name, const char *cat, size_t bytes,
                        const char *dtype, const char *group) {
    Dev *d = s->dev;
    return (TraceRec){.prefix = prefix, .name = dev_intern(d, name), .module = d->scope.module,
                      .phase = d->scope.phase, .cat = cat, .stream = s->index, .step = d->scope.step, .bytes = bytes,
                      .micro = d->scope.micro, .dtype = dtype, .group = group};
}

/* Turn completed timings into trace records (all of them if wait_all). */
static void timing_resolve(Dev *d, int wait_all) {
    struct CudaDev *c = cuda_dev(d);
    size_t keep = 0;
    for (size_t i = 0; i < c->n_timing; i++) {
        PendingTiming *t = &c->timing[i];
        if (wait_all) cuda_wait(d, t->end, NULL, "a trace timing event of", t->rec.name);
        else if (!event_done(t->end)) {
            c->timing[keep++] = *t;
            continue;
        }
        float ms0 = 0, ms1 = 0;
        CUDA_CHECK(cudaEventElapsedTime(&ms0, c->anchors[t->anchor], t->start));
        CUDA_CHECK(cudaEventElapsedTime(&ms1, c->anchors[t->anchor], t->end));
        t->rec.ts = c->anchor_us[t->anchor] + 1000.0 * ms0;
        t->rec.dur = 1000.0 * (ms1 - ms0);
        dev_trace_add(d, &t->rec);
        pool_put(&c->timing_pool, &c->n_timing_pool, &c->timing_pool_cap, t->start);
        pool_put(&c->timing_pool, &c->n_timing_pool, &c->timing_pool_cap, t->end);
    }
    c->n_timing = keep;
}

/* ---------------------------------------------------------------- storage */

/* Requests are rounded up to 512 bytes; a freed segment serves the next
 * request of exactly its size (training repeats the same sizes every step). */
static size_t round_storage(size_t bytes) { return (bytes + 511) / 512 * 512; }

static void cache_trim(Dev *d) {
    struct CudaDev *c = cuda_dev(d);
    for (size_t i = 0; i < c->n_cache; i++) CUDA_CHECK(cudaFree(c->cache[i].p));
    d->mem.reserved -= c->cache_bytes;
    c->n_cache = 0;
    c->cache_bytes = 0;
}

static void *cuda_storage_alloc(Dev *d, size_t bytes, int stream, const char *name) {
    struct CudaDev *c = cuda_dev(d);
    size_t r = round_storage(bytes);
    void *p = NULL;
    for (size_t i = c->n_cache; i-- > 0;)
        if (c->cache[i].bytes == r && c->cache[i].stream == stream) {
            p = c->cache[i].p;
            c->cache[i] = c->cache[--c->n_cache];
            c->cache_bytes -= r;
            c->cache_hits++;
            break;
        }
    if (!p) {
        cudaError_t e = cudaMalloc(&p, r);
        if (e == cudaErrorMemoryAllocation) {
            /* give back what is cached, wait for this rank's frees in flight, retry */
            (void)cudaGetLastError();
            dev_synchronize(d);
            dev_complete_held_frees(d, 1);
            dev_release_pending_frees(d, 1);
            cache_trim(d);
            e = cudaMalloc(&p, r);
        }
        if (e == cudaErrorMemoryAllocation) {
            (void)cudaGetLastError();
            size_t free_b = 0, total_b = 0;
            cudaMemGetInfo(&free_b, &total_b);
            fatal("rank %d: CUDA out of memory allocating %zu bytes for '%s' (%zu bytes allocated, %zu reserved by this "
                  "rank; %zu of %zu bytes free on GPU %d)", d->rank, bytes, name ? name : "?", d->mem.current, d->mem.reserved,
                  free_b, total_b, c->device);
        }
        CUDA_CHECK(e);
        d->mem.reserved += r;
        c->cuda_mallocs++;
    }
    if (d->world->cfg.poison) { /* all-ones bytes are a NaN in every float */
        /* On the owner stream: a block from the cache may still be in use by kernels queued
         * there before its dev_free (the caching allocator hands it on at once), so the fill
         * must queue behind them. Any other stream is ordered after the fill by the allocation
         * contract (wait for an event recorded on the owner after dev_alloc), which the race
         * detector checks on every backend. A side stream would race the owner's queue. */
        cudaStream_t owner = stream >= 0 && stream < d->nstreams ? cuda_stream(d->streams[stream])->st : c->side;
        CUDA_CHECK(cudaMemsetAsync(p, 0xff, r, owner));
        if (owner == c->side) /* before the streams exist */
            cuda_wait(d, NULL, c->side, "poisoning on the side stream for", name ? name : "?");
    }
    return p;
}

static void cuda_storage_free(Dev *d, void *p, size_t bytes, int stream) {
    struct CudaDev *c = cuda_dev(d);
    if (c->n_cache == c->cache_cap) {
        c->cache_cap = c->cache_cap ? c->cache_cap * 2 : 256;
        c->cache = xrealloc(c->cache, c->cache_cap * sizeof *c->cache);
    }
    size_t r = round_storage(bytes);
    c->cache[c->n_cache++] = (CachedBlock){p, r, stream};
    c->cache_bytes += r;
}

/* Pinned host memory (dev_alloc_host): cudaHostAlloc, NaN-filled by the host
 * when poisoning; freed once every stream passed its free (alloc.c fences it). */
static void *cuda_host_alloc(Dev *d, size_t bytes, const char *name) {
    void *p = NULL;
    /* mapped: kernels read it (the optimizer on offloaded shards); portable: any context */
    if (cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess || !p) {
        (void)cudaGetLastError();
        fatal("rank %d: out of pinned host memory allocating %zu bytes for '%s'", d->rank, bytes, name ? name : "?");
    }
    if (d->world->cfg.poison) {
        uint32_t *w = p;
        for (size_t i = 0; i < bytes / 4; i++) w[i] = 0x7fc00000u;
    }
    return p;
}

static void cuda_host_free(Dev *d, void *p, size_t bytes) {
    (void)d, (void)bytes;
    CUDA_CHECK(cudaFreeHost(p));
}

/* ----------------------------------------------------------------- fences */

typedef struct {
    int n;
    cudaEvent_t ev[];
} Fence;

static int cuda_fence_create(Dev *d, PendingFree *pf) {
    struct CudaDev *c = cuda_dev(d);
    Fence *f = xmalloc(sizeof *f + (size_t)d->nstreams * sizeof(cudaEvent_t));
    f->n = 0;
    int busy = 0;
    for (int i = 0; i < d->nstreams && i < DEV_MAX_STREAMS; i++) {
        if (!(pf->mask >> i & 1)) continue;
        cudaEvent_t e = pool_get(&c->fence_pool, &c->n_fence_pool, cudaEventDisableTiming);
        CUDA_CHECK(cudaEventRecord(e, cuda_stream(d->streams[i])->st));
        busy |= !event_done(e);
        f->ev[f->n++] = e;
    }
    pf->fence = f;
    return busy;
}

static int cuda_fence_ready(Dev *d, const PendingFree *pf) {
    (void)d;
    const Fence *f = pf->fence;
    for (int i = 0; i < f->n; i++)
        if (!event_done(f->ev[i])) return 0;
    return 1;
}

static void cuda_fence_release(Dev *d, PendingFree *pf) {
    struct CudaDev *c = cuda_dev(d);
    Fence *f = pf->fence;
    if (!f) return;
    for (int i = 0; i < f->n; i++) pool_put(&c->fence_pool, &c->n_fence_pool, &c->fence_pool_cap, f->ev[i]);
    free(f);
    pf->fence = NULL;
}

/* ---------------------------------------------------------------- streams */

static Stream *cuda_stream_create(Dev *d, const char *name) {
    Stream *s = stream_new(d, name);
    struct CudaStream *cs = xcalloc(1, sizeof *cs);
    s->backend = cs;
    CUDA_CHECK(cudaStreamCreateWithFlags(&cs->st, cudaStreamNonBlocking));
    CUBLAS_CHECK(cublasCreate(&cs->blas));
    CUBLAS_CHECK(cublasSetStream(cs->blas, cs->st));
    dev_add_stream(d, s);
    flight_stream_created(d, s);
    cuda_coll_stream_created(s); /* communicators: every rank creates the same streams in the same order */
    stream_join_groups(s);
    return s;
}

static void cuda_stream_destroy(Stream *s) {
    struct CudaStream *cs = cuda_stream(s);
    cuda_wait(s->dev, NULL, cs->st, "the teardown of stream", s->name);
    cuda_coll_stream_destroy(s);
    CUBLAS_CHECK(cublasDestroy(cs->blas));
    CUDA_CHECK(cudaStreamDestroy(cs->st));
    free(cs);
    free(s->name);
    free(s);
}

/* The cost is the modelled clock's (CPU backends): the GPU times itself. */
static void cuda_launch(Stream *s, const char *name, const KernelCost *cost, void (*fn)(void *args), const void *args,
                        size_t args_size, const void *list, size_t list_bytes) {
    (void)cost;
    union {
        max_align_t align_;
        unsigned char b[DEV_ARGS_MAX];
    } copy;
    if (args_size) memcpy(copy.b, args, args_size);
    if (list_bytes) memcpy(copy.b, &list, sizeof list); /* dev_launch_list: fn reads (uploads) it before we return */
    Dev *d = s->dev;
    OpSpan span;
    if (d->scope.tracing) cuda_span_begin(d, s, &span);
    tls_stream = cuda_stream(s)->st;
    tls_blas = cuda_stream(s)->blas;
    tls_tf32 = d->world->cfg.tf32;
    fn(copy.b);
    tls_stream = NULL;
    tls_blas = NULL;
    if (d->scope.tracing) {
        TraceRec rec = cuda_trace_rec(s, d->scope.module, name ? name : "kernel", TRACE_CAT_COMPUTE, 0, NULL, NULL);
        cuda_span_end(d, s, &span, &rec, SPAN_ANY_LENGTH);
    }
    s->enqueued++;
}

static void cuda_copy(Stream *s, void *dst, const void *src, size_t bytes) {
    if (!bytes) return;
    Dev *d = s->dev;
    OpSpan span;
    if (d->scope.tracing) cuda_span_begin(d, s, &span);
    /* cudaMemcpyDefault: unified addressing tells host from device memory */
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cuda_stream(s)->st));
    const char *name = copy_direction_name(dev_copy_direction(d, dst, src)); /* the real PCIe link times it */
    if (d->scope.tracing) {
        TraceRec rec = cuda_trace_rec(s, d->scope.module, name, TRACE_CAT_COPY, bytes, NULL, NULL);
        cuda_span_end(d, s, &span, &rec, SPAN_ANY_LENGTH);
    }
    s->enqueued++;
}

/* One kernel over the whole list (copy_kernels.cu), timed as one copy slice; the real PCIe link times a batch
 * between host and device. */
static void cuda_copy_batch_op(Stream *s, const char *name, const DevCopy *copies, size_t n, size_t bytes,
                               CopyDir dir) {
    (void)dir; /* the name says it already ("copy_in.h2d") */
    Dev *d = s->dev;
    OpSpan span;
    if (d->scope.tracing) cuda_span_begin(d, s, &span);
    cuda_copy_batch(copies, n, bytes, cuda_stream(s)->st);
    if (d->scope.tracing) {
        TraceRec rec = cuda_trace_rec(s, d->scope.module, name, TRACE_CAT_COPY, bytes, NULL, NULL);
        cuda_span_end(d, s, &span, &rec, SPAN_ANY_LENGTH);
    }
    s->enqueued++;
}

static void cuda_fill(Stream *s, void *dst, int byte, size_t bytes) {
    if (!bytes) return;
    Dev *d = s->dev;
    OpSpan span;
    if (d->scope.tracing) cuda_span_begin(d, s, &span);
    CUDA_CHECK(cudaMemsetAsync(dst, byte, bytes, cuda_stream(s)->st));
    if (d->scope.tracing) {
        TraceRec rec = cuda_trace_rec(s, d->scope.module, "memset", TRACE_CAT_MEMSET, bytes, NULL, NULL);
        cuda_span_end(d, s, &span, &rec, SPAN_ANY_LENGTH);
    }
    s->enqueued++;
}

static void cuda_stream_synchronize(Stream *s) {
    cuda_wait(s->dev, NULL, cuda_stream(s)->st, "dev_stream_synchronize: stream", s->name);
    timing_resolve(s->dev, 0);
    dev_release_pending_frees(s->dev, 0);
}

static void cuda_synchronize(Dev *d) {
    for (int i = 0; i < d->nstreams; i++)
        cuda_wait(d, NULL, cuda_stream(d->streams[i])->st, "dev_synchronize: stream", d->streams[i]->name);
    timing_resolve(d, 0);
    dev_release_pending_frees(d, 0);
}

/* ----------------------------------------------------------------- events */

static void cuda_event_init(Event *e) {
    cudaEvent_t ev;
    CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    e->backend = ev;
}

static void cuda_event_fini(Event *e) {
    if (e->backend) CUDA_CHECK(cudaEventDestroy(cuda_event(e))); /* deferred by CUDA if pending */
    e->backend = NULL;
}

/* CUDA keeps a recorded event alive for the work that still uses it. */
static void cuda_event_destroy(Event *e) { event_free(e); }

static void cuda_event_record(Event *e, Stream *s) {
    CUDA_CHECK(cudaEventRecord(cuda_event(e), cuda_stream(s)->st));
    e->recorded++;
}

static void cuda_event_wait(Stream *s, Event *e) { CUDA_CHECK(cudaStreamWaitEvent(cuda_stream(s)->st, cuda_event(e), 0)); }

static void cuda_event_synchronize(Event *e) {
    cuda_wait(e->dev, cuda_event(e), NULL, "dev_event_synchronize: event", e->name);
    dev_release_pending_frees(e->dev, 0);
}

static int cuda_event_query(Event *e) { return event_done(cuda_event(e)); }

/* ---------------------------------------------------- the table of operations */

#define KCUDA_ENTRY(name) .name = kcuda_##name,
const KernelTable kcuda_kernels = {HWFSDP_KERNEL_LIST(KCUDA_ENTRY).attention_scratch_floats = kcuda_attention_scratch_floats};
#undef KCUDA_ENTRY

const BackendOps cuda_backend = {
    .race_checked = 0, /* the detector models the CPU's streams */
    .storage_fenced = 0,
    .kernels = &kcuda_kernels,
    .world_init = cuda_world_init,
    .world_fini = cuda_world_fini,
    .dev_init = cuda_dev_init,
    .dev_fini = cuda_dev_fini,
    .host_exchange = cuda_host_exchange,
    .stream_create = cuda_stream_create,
    .stream_destroy = cuda_stream_destroy,
    .launch = cuda_launch,
    .copy = cuda_copy,
    .copy_batch = cuda_copy_batch_op,
    .fill = cuda_fill,
    .stream_synchronize = cuda_stream_synchronize,
    .synchronize = cuda_synchronize,
    .event_init = cuda_event_init,
    .event_fini = cuda_event_fini,
    .event_destroy = cuda_event_destroy,
    .event_record = cuda_event_record,
    .event_wait = cuda_event_wait,
    .event_synchronize = cuda_event_synchronize,
    .event_query = cuda_event_query,
    .storage_alloc = cuda_storage_alloc,
    .storage_free = cuda_storage_free,
    .host_alloc = cuda_host_alloc,
    .host_free = cuda_host_free,
    .fence_create = cuda_fence_create,
    .fence_ready = cuda_fence_ready,
    .fence_release = cuda_fence_release,
    .probe_alloc = cuda_probe_alloc,
    .probe_free = cuda_probe_free,
    .probe_read = cuda_probe_read,
    .group_init = cuda_group_init,
    .group_fini = cuda_group_fini,
    .coll_stream_init = cuda_coll_stream_created,
    .coll_stream_fini = cuda_coll_stream_destroy,
    .stream_join_group = cuda_stream_join_group,
    .coll_enqueue = cuda_coll_enqueue,
    .clock = "gpu",
    .host_time_us = cuda_host_time_us,
};
