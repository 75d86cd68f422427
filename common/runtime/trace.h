/* trace.h — the rank's op/collective timings for the Chrome trace
 * (artifacts.c writes them). Stream workers append; guarded by a mutex. */
#ifndef HWFSDP_TRACE_H
#define HWFSDP_TRACE_H

#include <pthread.h>
#include <stddef.h>

#include "runtime/runtime.h"

typedef struct {
    const char *prefix, *name;          /* interned; full name "<prefix>.<name>" (no prefix: "<name>") */
    const char *module, *phase;         /* interned scope at enqueue */
    const char *cat;                    /* static string */
    int stream, step;
    double ts, dur;                     /* µs on the world's clock (dev_clock_name), ts from its start */
    size_t bytes;                       /* 0 = not shown */
    int micro;                          /* microbatch (--grad-accum), -1 = not shown */
    const char *dtype;                  /* collectives: "f32" / "bf16" (static); NULL = not shown */
    const char *group;                  /* collectives: the process group's name; NULL = not shown */
    const char *op;                     /* reducing collectives: "sum" / "avg" (static); NULL = not shown */
    const char *p2p;                    /* p2p groups: "send|recv peer microbatch label" per item, ';' between
                                           (interned); NULL = not shown */
    double flops;                       /* kernels: the FLOPs their launch declared (CPU backends); 0 = not shown */
    const char *kclass, *math;          /* kernels: cost_class_name and "f32" / "bf16" (CPU backends); NULL = not shown */
    int wall;                           /* 1: wall_ts and wall_dur hold its wall-clock times (CPU backends) */
    double wall_ts, wall_dur;           /* µs of wall time since the world's epoch: performance work, never grading */
} TraceRec;

/* The rank's trace buffer (Dev.trace). */
typedef struct {
    pthread_mutex_t mu;
    TraceRec *recs;
    size_t n, cap;
} TraceBuffer;

void dev_trace_add(Dev *d, const TraceRec *r);

/* The rank's traced work in host enqueue order (Dev.enqueued; host thread only), kept while a partial record
 * is asked for (dev_record_partial): what the partial record of a run stopped by a runtime error holds. Each
 * record is its op's, timed at the host's modelled time when it enqueued it (dur 0): which of them had run when
 * the error came depends on the threads, their order does not. The CPU backends fill it (modelled_clock.c). */
typedef struct {
    TraceRec *recs;
    size_t n, cap;                      /* records; capacity in bytes (xgrow) */
} EnqueueLog;

void dev_enqueued_add(Dev *d, const TraceRec *r);

/* The categories (TraceRec.cat, the trace's "cat") every backend files its
 * slices under: one table, so the grader (grader/trace_names.py CATEGORIES,
 * checked against this by tests/test_trace_names.py) reads the same words from
 * the CPU and the CUDA backends. A backend passes one of these, never a
 * string of its own. */
#define TRACE_CAT_COMPUTE "compute"       /* a kernel */
#define TRACE_CAT_COPY "copy"             /* a copy (the CPU backends file a memset here too) */
#define TRACE_CAT_COLLECTIVE "collective"
#define TRACE_CAT_EVENT "event"           /* an event recorded on a stream */
#define TRACE_CAT_WAIT "wait"             /* a stream stalled on an event */
#define TRACE_CAT_HOST_SYNC "host_sync"   /* the host waited (its own track) */
#define TRACE_CAT_MEMSET "memset"         /* a memset on the CUDA backend */
/* All of them, as an array's initializer (tools/trace_names.c prints them for grader/trace_names.py). */
#define TRACE_CATEGORIES                                                                                    \
    {TRACE_CAT_COMPUTE, TRACE_CAT_COPY, TRACE_CAT_COLLECTIVE, TRACE_CAT_EVENT, TRACE_CAT_WAIT, TRACE_CAT_HOST_SYNC, \
     TRACE_CAT_MEMSET}

/* The host's own track (TraceRec.stream): its blocking waits, "sync:<what>"
 * slices of category "host_sync", so a trace shows where a hook stalled the
 * host instead of making a stream wait. */
#define TRACE_HOST_TID 1000
/* The compute stream's track: each rank's first stream (world.c makes it first). */
#define TRACE_COMPUTE_TID 0

/* The args of a slice that hold wall-clock times (CPU backends): for performance work, never for grading. */
#define TRACE_ARG_WALL_TS "wall_ts_us"
#define TRACE_ARG_WALL_DUR "wall_dur_us"
/* The args of a kernel's slice that say what it computes (CPU backends): its cost class and its math. */
#define TRACE_ARG_CLASS "class"
#define TRACE_ARG_MATH "math"

#endif
