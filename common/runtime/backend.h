/* backend.h — the seam between the shared runtime and its backends.
 *
 * The shared runtime (world.c, group.c, event.c, alloc.c, clip_probe.c,
 * race.c, coll_common.c, artifacts.c, backend.c) keeps ranks, scopes, process
 * groups, allocation accounting, the race detector, traces and snapshots.
 * Whatever touches a device goes through the world's table of operations
 * (World.ops), picked in world_create from cfg->backend among the backends
 * this build has (backend_ops below). Each backend keeps its own state behind
 * one pointer in World, Dev, Stream and Event (`backend`), read only by its
 * own files.
 *
 *   make       cpu/backends_cpu.c      local: cpu/backend_local.c + cpu/coll_cpu.c (ranks as threads, memcpy)
 *                                      mpi:   cpu/backend_mpi.c + mpi_world.c (one process per rank)
 *              both CPU backends share cpu/runtime_cpu.c (streams as worker threads,
 *              events, C-heap storage), cpu/modelled_clock.c (the modelled clock) and
 *              cpu/kernels_cpu.c (the kernels); cpu/cpu_internal.h declares what they share
 *   make cuda  cuda/backends_cuda.c    local, nccl, nccl-mpi: cuda/runtime_cuda.c + cuda/coll_cuda.c
 *                                      (nccl-mpi stands on mpi_world.c too)
 */
#ifndef HWFSDP_BACKEND_H
#define HWFSDP_BACKEND_H

#include <pthread.h>
#include <stddef.h>

#include "runtime/alloc.h"
#include "runtime/coll.h"
#include "runtime/runtime.h"
#include "runtime/trace.h"

struct KernelTable; /* model/kernels.h */

typedef struct BackendOps {
    int race_checked;     /* the race detector models these streams (the CPU's worker threads) */
    /* 1 if freed storage must wait until every stream of the rank finished
     * the work queued before the free (the CPU: its storage is the C heap,
     * shared by every stream and the host, so even a program run with
     * --no-race-check never has its memory handed to another owner early);
     * 0 if it goes back to its stream's pool at once (CUDA, as PyTorch's
     * caching allocator: reuse there is in stream order). */
    int storage_fenced;
    const struct KernelTable *kernels; /* what dev_launch runs (model/kernels.h) */
    const char *clock;    /* what trace times are (dev_clock_name): "model" (CPU), "gpu" (CUDA) */

    /* ---- world and ranks */
    /* world_create, before the epoch is taken: the processes (w->local_ranks,
     * w->first_local_rank) and devices; *cores is this host's, divided among
     * the processes that share it. world_fini: at the start of world_destroy. */
    void (*world_init)(World *w, long *cores);
    void (*world_fini)(World *w);
    void (*dev_init)(Dev *d);     /* the rank's thread, before its compute stream exists */
    void (*dev_fini)(Dev *d);     /* last: streams, events and the allocator are gone */

    /* ---- host exchange (dev_host_allgather_f64, dev_host_barrier), outside
     * streams: every rank passes value, out[r] gets rank r's; out NULL: a barrier */
    void (*host_exchange)(Dev *d, double value, double *out);

    /* ---- streams. stream_create makes the Stream (stream_new), joins the
     * groups made so far and appends it to d's list; launch, copy,
     * copy_batch and fill come after the shared argument checks (backend.c). */
    Stream *(*stream_create)(Dev *d, const char *name);
    void (*stream_destroy)(Stream *s);
    /* launch: fn(args) queued; with a list (dev_launch_list, list_bytes > 0) the args' first member, a
     * pointer, is set to a list of those bytes that stays readable until fn ran: CPU, its own copy (the
     * worker frees it, dry run or not); CUDA, the caller's (fn runs at once, on the host, and uploads it) */
    void (*launch)(Stream *s, const char *name, const KernelCost *cost, void (*fn)(void *args), const void *args,
                   size_t args_size, const void *list, size_t list_bytes);
    void (*copy)(Stream *s, void *dst, const void *src, size_t bytes);
    /* dev_memcpy_batch_async, checked (backend.c): the n > 0 copies of `copies` (the caller's list: copy
     * it) as one launch of `bytes` in all, every copy in direction dir, traced as one copy slice "name" */
    void (*copy_batch)(Stream *s, const char *name, const DevCopy *copies, size_t n, size_t bytes, CopyDir dir);
    void (*fill)(Stream *s, void *dst, int byte, size_t bytes);
    void (*stream_synchronize)(Stream *s);
    void (*synchronize)(Dev *d);

    /* ---- events. event_init after event_register_new; event_fini from
     * event_free (the one place an Event is freed); event_destroy after
     * event_unregister (CPU: queued ops may still point at it). wait,
     * synchronize and query come after the never-recorded check. */
    void (*event_init)(Event *e);
    void (*event_fini)(Event *e);
    void (*event_destroy)(Event *e);
    void (*event_record)(Event *e, Stream *s);
    void (*event_wait)(Stream *s, Event *e);
    void (*event_synchronize)(Event *e);
    int (*event_query)(Event *e);

    /* ---- memory. Storage for an allocation of `bytes` (dev_storage_bytes: a
     * multiple of DEV_ALLOC_ALIGN, > 0) from stream `stream`'s pool, fatal
     * when out of memory; storage_free gives it back to that pool; both keep
     * d->mem.reserved. Pinned host storage (dev_alloc_host): its free waits
     * until every stream finished the work queued before it, on every
     * backend. Fences mark the work queued so far on the streams of pf->mask;
     * fence_create returns 1 if one of them was busy. Probe memory (the clip probe's slots) is uncounted, outside
     * the allocator; probe_read first waits for every stream of d without
     * telling the race detector (a probe must not order the student's work). */
    void *(*storage_alloc)(Dev *d, size_t bytes, int stream, const char *name);
    void (*storage_free)(Dev *d, void *p, size_t bytes, int stream);
    void *(*host_alloc)(Dev *d, size_t bytes, const char *name);
    void (*host_free)(Dev *d, void *p, size_t bytes);
    int (*fence_create)(Dev *d, PendingFree *pf);
    int (*fence_ready)(Dev *d, const PendingFree *pf);
    void (*fence_release)(Dev *d, PendingFree *pf);
    void *(*probe_alloc)(Dev *d, size_t bytes);
    void (*probe_free)(Dev *d, void *p);
    void (*probe_read)(Dev *d, void *host, const void *probe, size_t bytes);

    /* ---- collectives. group_init/fini: the host's side of a process group
     * (multi-process: its communicator; nccl: its NCCL communicator and
     * NCCL stream), every rank in the same order.
     * coll_stream_init/fini: a new stream's own way to its peers (mpi: a
     * communicator per stream index; collective: every rank creates the
     * same streams in the same order); stream_join_group: a stream's way to
     * one group's peers, for every (stream, group id >= 1) pair in creation
     * order. coll_enqueue: a collective that coll_enqueue (coll_common.c)
     * validated and described, to run in s's order. */
    void (*group_init)(ProcessGroup *g);
    void (*group_fini)(ProcessGroup *g);
    void (*coll_stream_init)(Stream *s);
    void (*coll_stream_fini)(Stream *s);
    void (*stream_join_group)(Stream *s, ProcessGroup *g);
    void (*coll_enqueue)(Stream *s, Op *op);

    /* ---- the host's time on the backend's clock (dev_host_time_us) */
    double (*host_time_us)(const Dev *d);
} BackendOps;

/* The backend b among those this build has; one fatal line naming the build
 * that has it otherwise (cpu/backends_cpu.c; cuda/backends_cuda.c). */
const BackendOps *backend_ops(CollBackend b);

/* The host exchange of ranks that are threads of this process (backend.c):
 * the CPU's local backend and the CUDA build's local and nccl. */
void threads_host_exchange(Dev *d, double value, double *out);

/* The rendezvous channels of ranks that are threads of this process (backend.c),
 * for the same backends: one per (stream index, group id, color), made by the
 * first rank to ask, zeroed, with its mutex and (monotonic) condition variable
 * ready. A backend's channel type is named by its size and where those two sit. */
typedef struct {
    size_t size, mu_at, cv_at;  /* sizeof the channel type, offsetof its mutex and its condition variable */
    pthread_mutex_t lock;       /* guards the list */
    struct ChanSlot *slots;
    int n, cap;
} ChanRegistry;
void chan_registry_init(ChanRegistry *r, size_t size, size_t mu_at, size_t cv_at);
void *chan_registry_get(ChanRegistry *r, int stream_index, int pg_id, int color);
void *chan_registry_slot(ChanRegistry *r, int i); /* the i-th channel made (0 .. r->n-1) */
void chan_registry_fini(ChanRegistry *r);

#endif
