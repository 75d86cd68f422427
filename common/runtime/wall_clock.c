/* wall_clock.c — the CPU backends' clock (backend.h: span_begin/span_end):
 * an op starts and ends when its stream's worker (or the waiting host) reads
 * the monotonic wall clock around its execution; the trace gets the slice at
 * once, relative to the world's epoch. */
#include "runtime/stream.h"
#include "runtime/util.h"

void wall_span_begin(Dev *d, Stream *s, OpSpan *span) {
    (void)d, (void)s;
    span->start_us = now_us();
}

void wall_span_end(Dev *d, Stream *s, OpSpan *span, const TraceRec *rec, double min_us) {
    (void)s;
    if (!rec) return;
    double end_us = now_us();
    if (end_us - span->start_us <= min_us) return;
    TraceRec r = *rec;
    r.ts = span->start_us - d->world->epoch_us;
    r.dur = end_us - span->start_us;
    dev_trace_add(d, &r);
}
