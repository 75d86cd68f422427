/* trace.c — the rank's trace buffer (trace.h): what ran, where and when.
 * artifacts.c turns it into the Chrome trace. */
#include <pthread.h>

#include "runtime/internal.h"
#include "runtime/util.h"

/* A finished op or collective (stream workers on the CPU, the host on CUDA). */
void dev_trace_add(Dev *d, const TraceRec *r) {
    pthread_mutex_lock(&d->trace.mu);
    if (d->trace.n == d->trace.cap) {
        d->trace.cap = d->trace.cap ? d->trace.cap * 2 : 1024;
        d->trace.recs = xrealloc(d->trace.recs, d->trace.cap * sizeof *d->trace.recs);
    }
    d->trace.recs[d->trace.n++] = *r;
    pthread_mutex_unlock(&d->trace.mu);
}

/* An op the host just enqueued (host thread), or a host wait it just made: only while a partial record is asked
 * for (runtime.h, dev_record_partial). */
void dev_enqueued_add(Dev *d, const TraceRec *r) {
    if (!d->partial_dir) return;
    d->enqueued.recs = xgrow(d->enqueued.recs, &d->enqueued.cap, (d->enqueued.n + 1) * sizeof *r, 1024 * sizeof *r);
    d->enqueued.recs[d->enqueued.n++] = *r;
}
