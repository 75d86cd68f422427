/* race.c — the stream race detector (see device.h).
 *
 * Decided at ENQUEUE time on the rank's host thread, so the verdict depends
 * only on the order in which the host enqueued work, never on thread timing.
 *
 * Happens-before as vector clocks over the rank's streams:
 *   - stream s's clock counts the ops enqueued on it; VC_s[t] is the latest op
 *     of stream t that s's next op is ordered after (VC_s[s] = s's own clock);
 *   - enqueueing an op on s first merges the host's clock (the host orders
 *     its later enqueues after whatever it synchronized with), then ticks s;
 *   - dev_event_record(e, s) snapshots VC_s into e; dev_stream_wait_event(t, e)
 *     merges that snapshot into VC_t;
 *   - dev_stream_synchronize / dev_synchronize / dev_event_synchronize (and a
 *     dev_event_query that returns 1) merge into the host's clock.
 * Access sets per allocation (coarse but simple: not per byte): the last write
 * (stream, clock, op) and, per stream, the latest read since that write. An op
 * of stream s at VC_s races with a write of stream w at clock c if
 * VC_s[w] < c; a write also races with any read not ordered before it.
 * The caching allocator's rules (alloc.h): a block belongs to the stream it
 * was allocated on and goes back to that stream's pool at dev_free, so
 *   - a stream other than the owner that touches a block must be ordered
 *     after the owner's work queued before the allocation (that work may still
 *     use the memory under its previous owner): VC_s[owner] >= born;
 *   - at dev_free, an access by another stream that is not ordered before the
 *     owner's position (VC_owner merged with the host's clock), unless that
 *     stream was recorded with dev_record_stream, leaves a debt on the owner's
 *     pool: every block the pool hands out afterwards may be that memory, so
 *     every op touching such a block must be ordered after the access ("free
 *     while in use", reported at that op). The debt is paid once the owner is
 *     ordered after it: blocks allocated from then on carry none. This is the
 *     caching allocator's real hazard, and it accepts FSDP2's reduce-scatter
 *     output, freed after the optimizer queued its read on compute, because
 *     the reduce-scatter stream waits for compute before it uses its pool.
 * Every range must end inside the allocation it starts in (an overrun is
 * named with its op, buffer, size and excess instead of corrupting a neighbour).
 * Ops enqueued on a buffer after its dev_free are a use after free: the
 * allocator keeps recently freed allocations (and holds their storage, so no
 * new allocation or host malloc can take the address meanwhile) to tell.
 */
#include "runtime/internal.h"
#include "runtime/util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>


static void vc_merge(uint64_t *dst, const uint64_t *src, int n) {
    for (int i = 0; i < n; i++)
        if (src[i] > dst[i]) dst[i] = src[i];
}

static uint64_t *vc_grow(uint64_t *vc, int old_n, int new_n) {
    vc = xrealloc(vc, (size_t)new_n * sizeof *vc);
    memset(vc + old_n, 0, (size_t)(new_n - old_n) * sizeof *vc);
    return vc;
}

/* d->streams already holds s. Every vector clock gets one more entry. */
void race_stream_created(Dev *d, Stream *s) {
    int w = d->nstreams;
    if (w > d->race.width) {
        for (int i = 0; i < d->nstreams; i++)
            if (d->streams[i] != s) d->streams[i]->vc = vc_grow(d->streams[i]->vc, d->race.width, w);
        d->race.host_vc = vc_grow(d->race.host_vc, d->race.width, w);
        d->race.width = w;
    }
    s->vc = xcalloc((size_t)w, sizeof *s->vc);
}

void race_stream_destroy(Stream *s) {
    free(s->vc);
    free(s->pending);
    free(s->debts);
    s->vc = NULL;
    s->pending = NULL;
    s->debts = NULL;
    s->ndebts = s->debts_cap = 0;
}

void race_host_waited_stream(Stream *s) { vc_merge(s->dev->race.host_vc, s->vc, s->dev->race.width); }

void race_host_waited_all(Dev *d) {
    for (int i = 0; i < d->nstreams; i++) vc_merge(d->race.host_vc, d->streams[i]->vc, d->race.width);
}

void race_host_waited_event(Event *e) {
    if (e->vc) vc_merge(e->dev->race.host_vc, e->vc, e->vc_n);
}

void race_event_free(Event *e) {
    free(e->vc);
    e->vc = NULL;
}


void dev_access(Stream *s, const void *p, size_t bytes, int write, const char *what) {
    Dev *d = s->dev;
    if (!d->race.on || !p || !bytes) return;
    if (s->npending == s->pending_cap) {
        s->pending_cap = s->pending_cap ? s->pending_cap * 2 : 16;
        s->pending = xrealloc(s->pending, (size_t)s->pending_cap * sizeof *s->pending);
    }
    s->pending[s->npending++] = (RaceAccess){p, bytes, write != 0, what && *what ? dev_intern(d, what) : NULL};
}

/* ------------------------------------------------------------- messages */

static void op_text(char *buf, size_t cap, const RaceStamp *st) {
    if (st->module && *st->module) snprintf(buf, cap, "%s.%s", st->module, st->name);
    else snprintf(buf, cap, "%s", st->name);
}

static void scope_text(char *buf, size_t cap, const char *module, const char *phase) {
    if (module && *module && phase && *phase) snprintf(buf, cap, "%s.%s", module, phase);
    else if (module && *module) snprintf(buf, cap, "%s", module);
    else if (phase && *phase) snprintf(buf, cap, "%s", phase);
    else snprintf(buf, cap, "the runtime");
}

/* "'name' (tag, allocated in m.p[, freed in m.p])[ at byte offset N][ as what]" */
static void buffer_text(char *buf, size_t cap, const Alloc *a, const void *p, const char *what, int freed) {
    char where[160], freed_at[180] = "", offset[48] = "", as[160] = "";
    scope_text(where, sizeof where, a->module, a->phase);
    if (freed) {
        char f[160];
        scope_text(f, sizeof f, a->free_module, a->free_phase);
        snprintf(freed_at, sizeof freed_at, ", freed in %s", f);
    }
    size_t off = (size_t)((uintptr_t)p - a->addr);
    if (off) snprintf(offset, sizeof offset, " at byte offset %zu", off);
    if (what && strcmp(what, a->name) != 0) snprintf(as, sizeof as, " as %s", what);
    snprintf(buf, cap, "'%s' (%s, allocated in %s%s)%s%s", a->name, mem_tag_name(a->tag), where, freed_at, offset, as);
}

static void report(Dev *d, const char *msg) __attribute__((noreturn));
static void report(Dev *d, const char *msg) {
    world_report_race(d->world, d->rank, msg); /* mpi: this process's rank speaks for itself */
}

static void report_race(Stream *s, const RaceStamp *me, int write, const Alloc *a, const void *p, const char *what,
                        int other, const RaceStamp *them, int them_wrote) __attribute__((noreturn));
static void report_race(Stream *s, const RaceStamp *me, int write, const Alloc *a, const void *p, const char *what,
                        int other, const RaceStamp *them, int them_wrote) {
    Dev *d = s->dev;
    char mine[200], theirs[200], bufdesc[600], msg[1600];
    op_text(mine, sizeof mine, me);
    op_text(theirs, sizeof theirs, them);
    buffer_text(bufdesc, sizeof bufdesc, a, p, what, 0);
    const char *os = d->streams[other]->name;
    if (!write)
        snprintf(msg, sizeof msg,
                 "race on rank %d: %s stream's '%s' reads %s written by %s stream's '%s' with no event wait ordering it "
                 "(record an event on %s after the write and make %s wait for it)",
                 d->rank, s->name, mine, bufdesc, os, theirs, os, s->name);
    else if (them_wrote)
        snprintf(msg, sizeof msg,
                 "race on rank %d: %s stream's '%s' writes %s also written by %s stream's '%s' with no event wait "
                 "ordering them (record an event on %s after its write and make %s wait for it)",
                 d->rank, s->name, mine, bufdesc, os, theirs, os, s->name);
    else
        snprintf(msg, sizeof msg,
                 "race on rank %d: %s stream's '%s' writes %s while %s stream's '%s' may still read it: no event wait "
                 "orders the read before the write (record an event on %s after the read and make %s wait for it)",
                 d->rank, s->name, mine, bufdesc, os, theirs, os, s->name);
    report(d, msg);
}

static void report_use_after_free(Stream *s, const RaceStamp *me, int write, const Alloc *a, const void *p,
                                  const char *what) __attribute__((noreturn));
static void report_use_after_free(Stream *s, const RaceStamp *me, int write, const Alloc *a, const void *p,
                                  const char *what) {
    char mine[200], bufdesc[600], msg[1200];
    op_text(mine, sizeof mine, me);
    buffer_text(bufdesc, sizeof bufdesc, a, p, what, 1);
    snprintf(msg, sizeof msg,
             "use after free on rank %d: %s stream's '%s' %s %s after its dev_free (free a buffer only after "
             "enqueuing the last op that uses it)",
             s->dev->rank, s->name, mine, write ? "writes" : "reads", bufdesc);
    report(s->dev, msg);
}

static void report_overrun(Stream *s, const RaceStamp *me, int write, const Alloc *a, const void *p, size_t bytes,
                           const char *what) __attribute__((noreturn));
static void report_overrun(Stream *s, const RaceStamp *me, int write, const Alloc *a, const void *p, size_t bytes,
                           const char *what) {
    char mine[200], where[160], as[160] = "", msg[1200];
    op_text(mine, sizeof mine, me);
    scope_text(where, sizeof where, a->module, a->phase);
    if (what && strcmp(what, a->name) != 0) snprintf(as, sizeof as, " (as %s)", what);
    size_t off = (size_t)((uintptr_t)p - a->addr);
    snprintf(msg, sizeof msg,
             "out of bounds on rank %d: %s stream's '%s' %s bytes [%zu, %zu) of '%s'%s (%s, allocated in %s), which "
             "has %zu bytes: %zu bytes past its end (check the count or the offset of this op)",
             s->dev->rank, s->name, mine, write ? "writes" : "reads", off, off + bytes, a->name, as,
             mem_tag_name(a->tag), where, a->size, off + bytes - a->size);
    report(s->dev, msg);
}

static void report_alloc_race(Stream *s, const RaceStamp *me, int write, const Alloc *a, const void *p,
                              const char *what) __attribute__((noreturn));
/* s touches a block of another stream's pool (the owner) without being ordered after the owner's work queued
 * before the allocation. (A write by another stream that s does not wait for is reported instead, as the race
 * it is: check_access.) The remedy depends on who fills the block:
 *   - s writes it first: s fills it, so it may come from s's own pool, or s waits for the owner's allocation;
 *   - another stream w wrote it and s waits for that write, but w is not the owner: s must also be ordered
 *     after the owner's earlier work (an event recorded on the owner after the allocation);
 *   - s reads a block nothing has written: a read of memory no op filled. */
static void report_alloc_race(Stream *s, const RaceStamp *me, int write, const Alloc *a, const void *p,
                              const char *what) {
    Dev *d = s->dev;
    const RaceState *r = &a->race;
    char mine[200], bufdesc[600], head[1200], msg[2000];
    op_text(mine, sizeof mine, me);
    buffer_text(bufdesc, sizeof bufdesc, a, p, what, 0);
    const char *os = d->streams[a->stream]->name;
    snprintf(head, sizeof head,
             "race on rank %d: %s stream's '%s' %s %s, a block of the %s stream's pool, with no event wait ordering it "
             "after the %s work queued before the allocation, which may still use that memory (a freed block goes "
             "to the next allocation on its stream at once)",
             d->rank, s->name, mine, write ? "writes" : "reads", bufdesc, os, os);
    if (r->writer >= 0 && r->writer != s->index) {
        char theirs[200];
        op_text(theirs, sizeof theirs, &r->write);
        const char *ws = d->streams[r->writer]->name;
        snprintf(msg, sizeof msg,
                 "%s. The %s stream waits for %s stream's write ('%s') but not for the %s stream: make %s also wait for "
                 "an event recorded on %s after the allocation",
                 head, s->name, ws, theirs, os, s->name, os);
    } else if (write) {
        snprintf(msg, sizeof msg,
                 "%s. The %s stream fills it: allocate it on that stream (dev_alloc_on(%s stream, ...)), or make %s wait "
                 "for an event recorded on %s after the allocation",
                 head, s->name, s->name, s->name, os);
    } else {
        snprintf(msg, sizeof msg,
                 "%s. Nothing has written it yet: fill it first, and make %s wait for an event recorded on the stream "
                 "that fills it after its writes",
                 head, s->name);
    }
    report(d, msg);
}

/* What the freed block of a pool debt was, told by the ops that used it, for the FSDP2 parallel of the remedy:
 * FSDP2 keeps a reduce-scatter input alive in its ReduceScatterState until compute waited for the reduce-scatter,
 * and an all-gather output in its AllGatherState until the all-gather stream waited for the copy-out. */
typedef enum { FREED_OTHER, FREED_RS_INPUT, FREED_AG_OUTPUT, FREED_RS_OUTPUT } FreedRole;

static int named(const char *name, const char *want) { return name && strcmp(name, want) == 0; }

static FreedRole freed_role(const PoolDebt *debt) {
    if (!debt->wrote && named(debt->use.name, "reduce_scatter")) return FREED_RS_INPUT;
    if (named(debt->filled_by, "all_gather") || (debt->wrote && named(debt->use.name, "all_gather")))
        return FREED_AG_OUTPUT;
    if (named(debt->filled_by, "reduce_scatter")) return FREED_RS_OUTPUT;
    return FREED_OTHER;
}

static void report_free_race(Stream *s, const RaceStamp *me, int write, const Alloc *a, const void *p,
                             const char *what, const PoolDebt *debt) __attribute__((noreturn));
static void report_free_race(Stream *s, const RaceStamp *me, int write, const Alloc *a, const void *p,
                             const char *what, const PoolDebt *debt) {
    Dev *d = s->dev;
    char mine[200], theirs[200], bufdesc[600], born[160], freed_in[160], aside[300] = "", state[80] = "", msg[2600];
    op_text(mine, sizeof mine, me);
    op_text(theirs, sizeof theirs, &debt->use);
    buffer_text(bufdesc, sizeof bufdesc, a, p, what, 0);
    scope_text(born, sizeof born, debt->alloc_module, debt->alloc_phase);
    scope_text(freed_in, sizeof freed_in, debt->free_module, debt->free_phase);
    const char *ts = d->streams[debt->stream]->name, *owner = d->streams[a->stream]->name;
    const char *use = debt->wrote ? "write" : "read";
    /* the FSDP2 parallel, only where s reuses its own pool: then s waits for ts as the FSDP2 stream of the same
     * role does (a reduce-scatter input: compute for the reduce-scatter; an all-gather output: the all-gather
     * stream for the copy-out, or compute for the all-gather; a reduce-scatter output: its stream for compute) */
    const int own = s->index == a->stream;
    switch (freed_role(debt)) {
    case FREED_RS_INPUT:
        if (own)
            snprintf(aside, sizeof aside, " (as FSDP2's next post_backward makes compute wait for the previous "
                     "reduce-scatter's event)");
        snprintf(state, sizeof state, " (as FSDP2's ReduceScatterState does for a reduce-scatter input)");
        break;
    case FREED_AG_OUTPUT:
        if (own && debt->wrote)
            snprintf(aside, sizeof aside, " (as FSDP2 makes compute wait for the all-gather's event before the "
                     "copy-out)");
        else if (own)
            snprintf(aside, sizeof aside, " (as FSDP2 makes the all-gather stream wait for the copy-out's event "
                     "before the next all-gather)");
        snprintf(state, sizeof state, " (as FSDP2's AllGatherState does for an all-gather output)");
        break;
    case FREED_RS_OUTPUT:
        if (own)
            snprintf(aside, sizeof aside, " (as FSDP2 makes the reduce-scatter stream wait for compute before each "
                     "reduce-scatter)");
        break;
    case FREED_OTHER: break;
    }
    snprintf(msg, sizeof msg,
             "free while in use on rank %d: dev_free of '%s' (%s, allocated in %s) in %s gave it back to the %s "
             "stream's pool while %s stream's '%s' still %s it; now %s stream's '%s' %s %s, allocated from that pool "
             "after the free (so possibly the same memory), with nothing ordering that %s before it. Make %s wait for "
             "an event recorded on %s after that %s before it touches blocks of the %s stream's pool again%s, keep "
             "'%s' alive until then%s, or call dev_record_stream(buf, %s stream) before dev_free",
             d->rank, debt->freed, mem_tag_name((MemTag)debt->freed_tag), born, freed_in, owner, ts, theirs,
             debt->wrote ? "writes" : "reads", s->name, mine, write ? "writes" : "reads", bufdesc, use, s->name, ts,
             use, owner, aside, debt->freed, state, ts);
    report(d, msg);
}

/* ---------------------------------------------------------------- checks */

/* Is stream t's op at `clock` ordered before the next op of stream o? */
static int ordered_for(const Dev *d, const Stream *o, int t, uint64_t clock) {
    const uint64_t *ovc = o->vc, *hvc = d->race.host_vc;
    return ovc[t] >= clock || hvc[t] >= clock;
}

void race_on_alloc(Dev *d, Alloc *a) {
    a->race.writer = -1;
    a->race.owner = a->host ? -1 : a->stream; /* pinned host memory belongs to no stream's pool */
    a->race.born = d->race.on && !a->host ? d->streams[a->stream]->vc[a->stream] : 0;
    a->race.debts = NULL;
    a->race.ndebts = 0;
    if (!d->race.on || a->host) return;
    /* the pool's debts its stream is ordered after are paid: no block it hands out from now on needs them
     * (another stream touching the block is ordered after the owner's work so far: the `born` rule) */
    Stream *o = d->streams[a->stream];
    int n = 0;
    for (int i = 0; i < o->ndebts; i++)
        if (!ordered_for(d, o, o->debts[i].stream, o->debts[i].use.clock)) o->debts[n++] = o->debts[i];
    o->ndebts = n;
    if (n) {
        a->race.debts = xmalloc((size_t)n * sizeof *a->race.debts);
        memcpy(a->race.debts, o->debts, (size_t)n * sizeof *a->race.debts);
        a->race.ndebts = n;
    }
}

static void add_debt(Dev *d, Stream *o, const Alloc *a, int t, const RaceStamp *use, int wrote) {
    for (int i = 0; i < o->ndebts; i++) /* one per stream: the latest use covers the earlier ones */
        if (o->debts[i].stream == t) {
            if (o->debts[i].use.clock >= use->clock) return;
            o->debts[i] = o->debts[--o->ndebts];
            break;
        }
    if (o->ndebts == o->debts_cap) {
        o->debts_cap = o->debts_cap ? o->debts_cap * 2 : 4;
        o->debts = xrealloc(o->debts, (size_t)o->debts_cap * sizeof *o->debts);
    }
    o->debts[o->ndebts++] = (PoolDebt){t, *use, wrote, a->name, (int)a->tag, a->module, a->phase,
                                       d->scope.module, d->scope.phase,
                                       a->race.writer >= 0 ? a->race.write.name : NULL};
}

void race_on_free(Dev *d, const Alloc *a) {
    if (!d->race.on || a->host) return; /* a host block's storage waits for every stream (alloc.c) */
    const RaceState *r = &a->race;
    Stream *o = d->streams[a->stream];
    for (int t = 0; t < d->nstreams; t++) {
        if (t == a->stream || (a->recorded >> t & 1)) continue;
        if (r->writer == t && !ordered_for(d, o, t, r->write.clock)) add_debt(d, o, a, t, &r->write, 1);
        if (t < r->nreads && r->reads[t].clock && !ordered_for(d, o, t, r->reads[t].clock))
            add_debt(d, o, a, t, &r->reads[t], 0);
    }
}

static void check_access(Stream *s, const RaceStamp *me, const void *p, size_t bytes, int write, const char *what) {
    if (!p || !bytes) return;
    Dev *d = s->dev;
    Alloc *a = dev_live_alloc_containing(d, (uintptr_t)p);
    if (!a) {
        Alloc *dead = dev_dead_alloc_containing(d, (uintptr_t)p);
        if (dead) report_use_after_free(s, me, write, dead, p, what);
        return; /* host memory: not tracked */
    }
    RaceState *r = &a->race;
    const int si = s->index;
    RaceStamp stamp = *me;
    stamp.what = what;
    if (bytes > a->size - ((uintptr_t)p - a->addr)) report_overrun(s, &stamp, write, a, p, bytes, what);
    const int unordered_write = r->writer >= 0 && r->writer != si && s->vc[r->writer] < r->write.clock;
    if (r->owner >= 0 && si != r->owner && s->vc[r->owner] < r->born) {
        /* another stream filled the block and s does not wait for it: that race names who wrote, and an event
         * recorded after that write is the remedy (the writer being the owner, it also orders s after the
         * owner's work before the allocation) */
        if (unordered_write) report_race(s, &stamp, write, a, p, what, r->writer, &r->write, 1);
        report_alloc_race(s, &stamp, write, a, p, what);
    }
    for (int i = 0; i < r->ndebts; i++) {
        const PoolDebt *dt = &r->debts[i];
        if (dt->stream != si && s->vc[dt->stream] < dt->use.clock) report_free_race(s, &stamp, write, a, p, what, dt);
    }
    if (unordered_write) report_race(s, &stamp, write, a, p, what, r->writer, &r->write, 1);
    if (write) {
        for (int t = 0; t < r->nreads; t++)
            if (t != si && r->reads[t].clock && s->vc[t] < r->reads[t].clock)
                report_race(s, &stamp, 1, a, p, what, t, &r->reads[t], 0);
        r->writer = si;
        r->write = stamp;
        for (int t = 0; t < r->nreads; t++) r->reads[t].clock = 0;
    } else {
        if (r->nreads <= si) {
            int n = d->race.width > si ? d->race.width : si + 1;
            r->reads = xrealloc(r->reads, (size_t)n * sizeof *r->reads);
            memset(r->reads + r->nreads, 0, (size_t)(n - r->nreads) * sizeof *r->reads);
            r->nreads = n;
        }
        r->reads[si] = stamp;
    }
}

void race_on_enqueue(Stream *s, const Op *op) {
    Dev *d = s->dev;
    if (!d->race.on) return;
    const int w = d->race.width;
    vc_merge(s->vc, d->race.host_vc, w);
    RaceStamp me = {++s->vc[s->index], op->module, op->name, NULL};
    switch (op->kind) {
    case OP_COPY:
        check_access(s, &me, op->src, op->bytes, 0, NULL);
        check_access(s, &me, op->dst, op->bytes, 1, NULL);
        break;
    case OP_MEMSET: check_access(s, &me, op->dst, op->bytes, 1, NULL); break;
    case OP_RECORD: {
        Event *e = op->event;
        if (e->vc_n < w) {
            e->vc = vc_grow(e->vc, e->vc_n, w);
            e->vc_n = w;
        }
        memcpy(e->vc, s->vc, (size_t)w * sizeof *e->vc);
        break;
    }
    case OP_WAIT:
        if (op->event->vc) vc_merge(s->vc, op->event->vc, op->event->vc_n);
        break;
    case OP_COLL: { /* its kind says what it reads (send) and writes (recv); a p2p group, each item */
        const CollKindInfo *k = coll_kind(op->coll.kind);
        if (k->p2p) {
            for (int i = 0; i < op->p2p->n; i++) {
                const P2PItem *it = &op->p2p->items[i];
                me.module = it->label;
                me.name = it->send ? "send" : "recv";
                check_access(s, &me, it->buf, it->count * sizeof(float), !it->send, NULL);
            }
            break;
        }
        const size_t cnt = (size_t)op->coll.count, f = coll_dtype_size(op->coll.dtype);
        if (op->label && *op->label) me.module = op->label;
        me.name = k->name;
        check_access(s, &me, op->src, coll_buf_elems(k->send, cnt, op->pg->size) * f, 0, NULL);
        check_access(s, &me, op->dst, coll_buf_elems(k->recv, cnt, op->pg->size) * f, 1, NULL);
        break;
    }
    case OP_LAUNCH: break;
    case OP_MARK: break; /* never enqueued through here */
    }
    /* dev_access annotations describe this op (reads first: a kernel may read and write one buffer) */
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < s->npending; i++)
            if (s->pending[i].write == pass)
                check_access(s, &me, s->pending[i].p, s->pending[i].bytes, pass, s->pending[i].what);
    s->npending = 0;
}

/* Every rank runs the same program, so usually every rank finds the same race
 * at the same point of its host order, at slightly different times. Report
 * the lowest such rank: a rank waits (briefly) for each lower rank to either
 * report too (then that one speaks) or finish. The fallback deadline covers
 * a race only some ranks have (lower ranks may then be stuck in a collective
 * waiting for this one). */
void world_report_race(World *w, int rank, const char *msg) {
    int me = world_rank_slot(w, rank); /* the slots run in rank order */
    pthread_mutex_lock(&w->report_mu);
    if (!w->race_msg[me]) w->race_msg[me] = xstrdup(msg);
    pthread_cond_broadcast(&w->report_cv);
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += 2;
    for (;;) {
        int lower_reported = 0, lower_running = 0;
        for (int q = 0; q < me; q++) {
            lower_reported |= w->race_msg[q] != NULL;
            lower_running |= !w->rank_done[q];
        }
        if (lower_reported) {
            /* a lower rank reports (and exits the process); wait for that */
            for (;;) pthread_cond_wait(&w->report_cv, &w->report_mu);
        }
        if (!lower_running || w->reporting) break;
        if (pthread_cond_timedwait(&w->report_cv, &w->report_mu, &deadline) != 0) break;
    }
    while (w->reporting) pthread_cond_wait(&w->report_cv, &w->report_mu); /* the watchdog speaks first */
    w->reporting = 1;
    pthread_mutex_unlock(&w->report_mu);
    report_lock(); /* a plain fatal() of another thread may be speaking */
    report_last_words(msg); /* this rank's partial record (runtime.h, dev_record_partial) */
    /* _exit, not exit: the streams are still running kernels (BLAS) that
     * atexit teardown would pull the rug from under */
    fflush(stdout);
    fprintf(stderr, "error: %s\n", msg);
    fflush(stderr);
    _exit(EXIT_FATAL);
}
