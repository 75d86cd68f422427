/* alloc.c — the per-rank tagged allocator: counts in host call order, a treap
 * of live allocations keyed by address (exact and "containing" lookups in
 * O(log n)), per-stream frees and record_stream holds (the rules of PyTorch's
 * caching allocator), poison, and the memory event log. */
#include "runtime/internal.h"
#include "runtime/profile.h"
#include "runtime/util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Each tag's name (the snapshots' and the trace's word for it), by the tag itself: no order to keep in step. */
static const char *const TAG_NAMES[MEM_TAG_COUNT] = {
    [MEM_PARAM] = "param",
    [MEM_PARAM_SHARD] = "param_shard",
    [MEM_UNSHARDED_PARAM] = "unsharded_param",
    [MEM_GRAD_SHARD] = "grad_shard",
    [MEM_UNSHARDED_GRAD] = "unsharded_grad",
    [MEM_ACTIVATION] = "activation",
    [MEM_OPTIM_STATE] = "optim_state",
    [MEM_COMM_BUFFER] = "comm_buffer",
    [MEM_TEMP] = "temp",
};

const char *mem_tag_name(MemTag tag) {
    if ((int)tag < 0 || tag >= MEM_TAG_COUNT || !TAG_NAMES[tag]) return "unknown"; /* a tag added without a name */
    return TAG_NAMES[tag];
}

/* ----------------------------------------------------------------- treap */

static Alloc *treap_merge(Alloc *a, Alloc *b) { /* every key of a < every key of b */
    if (!a) return b;
    if (!b) return a;
    if (a->prio > b->prio) {
        a->right = treap_merge(a->right, b);
        return a;
    }
    b->left = treap_merge(a, b->left);
    return b;
}

static void treap_split(Alloc *t, uintptr_t key, Alloc **lo, Alloc **hi) { /* lo: < key */
    if (!t) {
        *lo = *hi = NULL;
    } else if (t->addr < key) {
        treap_split(t->right, key, &t->right, hi);
        *lo = t;
    } else {
        treap_split(t->left, key, lo, &t->left);
        *hi = t;
    }
}

static Alloc *treap_remove(Alloc *t, uintptr_t key) {
    if (!t) return NULL;
    if (t->addr == key) return treap_merge(t->left, t->right);
    if (key < t->addr) t->left = treap_remove(t->left, key);
    else t->right = treap_remove(t->right, key);
    return t;
}

/* The live allocation with the largest address <= key. */
static Alloc *treap_floor(Alloc *t, uintptr_t key) {
    Alloc *best = NULL;
    while (t) {
        if (t->addr == key) return t;
        if (t->addr < key) {
            best = t;
            t = t->right;
        } else {
            t = t->left;
        }
    }
    return best;
}

/* ------------------------------------------------------------ event log */

static MemEvent *mev_push(Dev *d) {
    if (d->mem.n_mev == d->mem.mev_cap) {
        d->mem.mev_cap = d->mem.mev_cap ? d->mem.mev_cap * 2 : 1024;
        d->mem.mev = xrealloc(d->mem.mev, d->mem.mev_cap * sizeof *d->mem.mev);
    }
    MemEvent *e = &d->mem.mev[d->mem.n_mev++];
    memset(e, 0, sizeof *e);
    return e;
}

static void mev_from_alloc(MemEvent *e, const Alloc *a) {
    e->addr = a->addr;
    e->size = a->size;
    e->stream = a->stream;
    e->tag = a->tag;
    e->name = a->name;
}

/* ------------------------------------------------------------ freed blocks */

size_t dev_storage_bytes(size_t bytes) {
    return bytes ? (bytes + DEV_ALLOC_ALIGN - 1) / DEV_ALLOC_ALIGN * DEV_ALLOC_ALIGN : DEV_ALLOC_ALIGN;
}

static void free_storage(Dev *d, Alloc *a) {
    if (a->host) dev_ops(d)->host_free(d, (void *)a->addr, dev_storage_bytes(a->size));
    else dev_ops(d)->storage_free(d, (void *)a->addr, dev_storage_bytes(a->size), a->stream);
    race_state_free(&a->race);
    free(a);
}

/* The storage goes back (to its stream's pool; the quarantine may hold it longer). */
static void release_storage(Dev *d, Alloc *a) {
    d->mem.frees_released++;
    if (a->quarantined) a->released = 1; /* storage held until it leaves the quarantine */
    else free_storage(d, a);
}

/* Room for one more element in a FIFO ring (`count` elements of `elem` bytes
 * from index *head of buf, capacity *cap): when full, a ring twice the size
 * with the elements moved to its front. Returns the ring's (new) storage. */
static void *ring_reserve(void *buf, size_t *cap, size_t *head, size_t count, size_t elem) {
    if (count < *cap) return buf;
    size_t ncap = *cap ? *cap * 2 : 64;
    char *nb = xmalloc(ncap * elem);
    for (size_t i = 0; i < count; i++) memcpy(nb + i * elem, (char *)buf + ((*head + i) % *cap) * elem, elem);
    free(buf);
    *cap = ncap;
    *head = 0;
    return nb;
}

static uint64_t all_streams(const Dev *d) { return d->nstreams >= DEV_MAX_STREAMS ? ~0ull : (1ull << d->nstreams) - 1; }

/* A block no longer counted: its storage goes back to its stream's pool now
 * (CUDA; and a dry run's, which no op ever touches: dry.h), or once every
 * stream is past this point (the CPU emulator). */
static void retire_storage(Dev *d, Alloc *a) {
    if (d->world->cfg.dry_run || (!dev_ops(d)->storage_fenced && !a->host)) {
        release_storage(d, a);
        return;
    }
    PendingFree pf = {a, all_streams(d), NULL, 0};
    if (dev_ops(d)->fence_create(d, &pf)) d->mem.frees_deferred++;
    d->mem.pending = ring_reserve(d->mem.pending, &d->mem.pend_cap, &d->mem.pend_head, d->mem.pend_count,
                                  sizeof *d->mem.pending);
    d->mem.pending[(d->mem.pend_head + d->mem.pend_count++) % d->mem.pend_cap] = pf;
}

/* A free event (kind MEV_FREE*) of a, in the current scope, after the counts changed. */
static void log_free(Dev *d, MemEventKind kind, const Alloc *a) {
    MemEvent *e = mev_push(d);
    e->kind = kind;
    e->seq = ++d->mem.mem_seq;
    mev_from_alloc(e, a);
    e->module = d->scope.module;
    e->phase = d->scope.phase;
    e->step = d->scope.step;
    e->time_us = dev_host_time_us(d);
    e->host = a->host;
    e->current_bytes = a->host ? d->mem.host_current : d->mem.current;
}

static void uncount(Dev *d, const Alloc *a) {
    if (a->host) {
        d->mem.host_current -= a->size;
        d->mem.host_by_tag[a->tag] -= a->size;
        return;
    }
    d->mem.current -= a->size;
    d->mem.by_tag[a->tag] -= a->size;
}

void dev_complete_held_frees(Dev *d, int wait_all) {
    size_t kept = 0;
    for (size_t i = 0; i < d->mem.n_held; i++) {
        PendingFree *p = &d->mem.held[i];
        if (wait_all || dev_ops(d)->fence_ready(d, p)) {
            dev_ops(d)->fence_release(d, p);
            uncount(d, p->alloc);
            log_free(d, MEV_FREE_COMPLETED, p->alloc);
            retire_storage(d, p->alloc);
        } else {
            d->mem.held[kept++] = *p;
        }
    }
    d->mem.n_held = kept;
}

void dev_release_pending_frees(Dev *d, int wait_all) {
    /* fences only grow in FIFO order, so stop at the first not ready */
    while (d->mem.pend_count) {
        PendingFree *p = &d->mem.pending[d->mem.pend_head];
        if (!wait_all && !dev_ops(d)->fence_ready(d, p)) break;
        dev_ops(d)->fence_release(d, p);
        release_storage(d, p->alloc);
        d->mem.pend_head = (d->mem.pend_head + 1) % d->mem.pend_cap;
        d->mem.pend_count--;
    }
}

/* ------------------------------------------------ use-after-free quarantine */

/* With the race detector on, a freed allocation stays findable (dead tree)
 * and its storage is held back for the next QUARANTINE_FREES frees or
 * QUARANTINE_BYTES bytes (host order, so deterministic): no new allocation or
 * host malloc can take the address meanwhile. The release (counts,
 * memory events) is unchanged; only the storage's return to the system waits
 * for both the release and the end of the quarantine. */
#define QUARANTINE_FREES 256
#define QUARANTINE_BYTES ((size_t)32 << 20)

static void quarantine_evict_one(Dev *d) {
    Alloc *a = d->race.quarantine[d->race.quar_head];
    d->race.quar_head = (d->race.quar_head + 1) % d->race.quar_cap;
    d->race.quar_count--;
    d->race.quar_bytes -= a->size;
    d->race.dead_root = treap_remove(d->race.dead_root, a->addr);
    a->left = a->right = NULL;
    a->quarantined = 0;
    if (a->released) free_storage(d, a);
}

static void quarantine(Dev *d, Alloc *a) {
    d->race.quarantine = ring_reserve(d->race.quarantine, &d->race.quar_cap, &d->race.quar_head, d->race.quar_count,
                                      sizeof *d->race.quarantine);
    d->race.quarantine[(d->race.quar_head + d->race.quar_count++) % d->race.quar_cap] = a;
    d->race.quar_bytes += a->size;
    a->quarantined = 1;
    Alloc *lo, *hi;
    treap_split(d->race.dead_root, a->addr, &lo, &hi);
    d->race.dead_root = treap_merge(treap_merge(lo, a), hi);
    while (d->race.quar_count > QUARANTINE_FREES || (d->race.quar_count && d->race.quar_bytes > QUARANTINE_BYTES))
        quarantine_evict_one(d);
}

static Alloc *containing(Alloc *root, uintptr_t p) {
    Alloc *a = treap_floor(root, p);
    if (!a || p - a->addr >= a->size) return NULL;
    return a;
}
Alloc *dev_live_alloc_containing(const Dev *d, uintptr_t p) {
    Alloc *a = containing(d->mem.live_root, p);
    return a ? a : containing(d->mem.host_root, p);
}
Alloc *dev_dead_alloc_containing(const Dev *d, uintptr_t p) { return containing(d->race.dead_root, p); }

/* ------------------------------------------------------- device capacity */

/* bytes as the capacity line says them: GiB from 1 GiB up, MiB below */
static void size_text(char *buf, size_t n, size_t bytes) {
    if (bytes >= ((size_t)1 << 30)) snprintf(buf, n, "%.2f GiB", (double)bytes / 1073741824.0);
    else snprintf(buf, n, "%.2f MiB", (double)bytes / 1048576.0);
}

/* Allocation a (device memory, counted) took this rank past its capacity: the line CUDA's out-of-memory error
 * would print, once per rank: what was asked for and where, the capacity, what was allocated before it
 * (allocated = capacity - free) and the three tags holding the most of that. */
static void note_over_capacity(Dev *d, const Alloc *a) {
    size_t before = d->mem.current - a->size, held[MEM_TAG_COUNT];
    memcpy(held, d->mem.by_tag, sizeof held);
    held[a->tag] -= a->size; /* by tag, before a */
    char tags[256] = "", ask[32], cap[32], had[32], free_[32], one[32];
    size_t len = 0;
    for (int k = 0; k < 3; k++) {
        int best = -1; /* the largest tag not listed yet (ties: the tag order) */
        for (int t = 0; t < MEM_TAG_COUNT; t++)
            if (held[t] && (best < 0 || held[t] > held[best])) best = t;
        if (best < 0) break;
        size_text(one, sizeof one, held[best]);
        len += (size_t)snprintf(tags + len, sizeof tags - len, "%s%s %s", k ? ", " : "", mem_tag_name((MemTag)best),
                                one);
        held[best] = 0;
    }
    size_text(ask, sizeof ask, a->size);
    size_text(cap, sizeof cap, d->mem.capacity);
    size_text(had, sizeof had, before);
    size_text(free_, sizeof free_, before < d->mem.capacity ? d->mem.capacity - before : 0);
    char micro[32] = "";
    if (d->scope.micro >= 0) snprintf(micro, sizeof micro, ", microbatch %d", d->scope.micro);
    d->mem.over_capacity =
        xasprintf("out of device memory on rank %d in step %d (%s%s%s%s): tried to allocate %s for '%s' (%s); the "
                  "%s profile's device has %s, of which %s is allocated (%s) and %s is free",
                  d->rank, d->scope.step + 1, a->module, *a->module ? " " : "", a->phase, micro, ask, a->name,
                  mem_tag_name(a->tag), d->world->cfg.profile->name, cap, had, *tags ? tags : "nothing", free_);
}

size_t dev_mem_capacity(const Dev *d) { return d->mem.capacity; }
void dev_mem_watch_capacity(Dev *d, int on) { d->mem.watch_capacity = on != 0; }
const char *dev_mem_over_capacity(const Dev *d) { return d->mem.over_capacity; }

/* --------------------------------------------------------------- alloc */

/* A new allocation: device memory from stream s's pool, or (host) pinned host memory. */
static void *alloc_block(Dev *d, Stream *s, int host, size_t bytes, MemTag tag, const char *name) {
    const char *fn = host ? "dev_alloc_host" : "dev_alloc";
    if ((int)tag < 0 || tag >= MEM_TAG_COUNT) fatal("%s('%s'): bad memory tag %d", fn, name ? name : "?", (int)tag);
    dev_complete_held_frees(d, 0);
    dev_release_pending_frees(d, 0);
    size_t real = dev_storage_bytes(bytes); /* 0 bytes still get a unique address */
    if (real < bytes) fatal("%s('%s'): %zu bytes is too large", fn, name ? name : "?", bytes);
    void *p = host ? dev_ops(d)->host_alloc(d, real, name) : dev_ops(d)->storage_alloc(d, real, s->index, name);
    Alloc *a = xcalloc(1, sizeof *a);
    a->addr = (uintptr_t)p;
    a->size = bytes;
    a->tag = tag;
    a->host = host;
    a->stream = host ? 0 : s->index;
    a->name = dev_intern(d, name ? name : "");
    a->module = d->scope.module;
    a->phase = d->scope.phase;
    a->step = d->scope.step;
    a->seq = ++d->mem.mem_seq;
    race_on_alloc(d, a);
    a->time_us = dev_host_time_us(d);
    /* xorshift priorities: deterministic, balanced in expectation */
    d->mem.prio_state ^= d->mem.prio_state << 13;
    d->mem.prio_state ^= d->mem.prio_state >> 7;
    d->mem.prio_state ^= d->mem.prio_state << 17;
    a->prio = (uint32_t)(d->mem.prio_state >> 16);
    Alloc **root = host ? &d->mem.host_root : &d->mem.live_root;
    Alloc *lo, *hi;
    treap_split(*root, a->addr, &lo, &hi);
    *root = treap_merge(treap_merge(lo, a), hi);
    d->mem.n_live++;

    if (host) {
        d->mem.host_current += bytes;
        d->mem.host_by_tag[tag] += bytes;
        if (d->mem.host_current > d->mem.host_peak) d->mem.host_peak = d->mem.host_current;
    } else {
        d->mem.current += bytes;
        d->mem.by_tag[tag] += bytes;
        if (d->mem.current > d->mem.peak) d->mem.peak = d->mem.current;
        if (d->mem.current > d->mem.window_peak) {
            d->mem.window_peak = d->mem.current;
            memcpy(d->mem.window_by_tag, d->mem.by_tag, sizeof d->mem.window_by_tag);
        }
        if (d->mem.watch_capacity && d->mem.capacity && d->mem.current > d->mem.capacity && !d->mem.over_capacity)
            note_over_capacity(d, a); /* counted all the same: the run goes on (driver/step_log.h) */
    }

    MemEvent *e = mev_push(d);
    e->kind = MEV_ALLOC;
    e->seq = a->seq;
    mev_from_alloc(e, a);
    e->module = a->module;
    e->phase = a->phase;
    e->step = a->step;
    e->time_us = a->time_us;
    e->host = host;
    e->current_bytes = host ? d->mem.host_current : d->mem.current;
    return p;
}

void *dev_alloc_on(Stream *s, size_t bytes, MemTag tag, const char *name) {
    if (!s) fatal("dev_alloc_on('%s'): NULL stream", name ? name : "?");
    return alloc_block(s->dev, s, 0, bytes, tag, name);
}

void *dev_alloc_host(Dev *d, size_t bytes, MemTag tag, const char *name) {
    return alloc_block(d, NULL, 1, bytes, tag, name);
}

void *dev_alloc(Dev *d, size_t bytes, MemTag tag, const char *name) {
    return dev_alloc_on(d->streams[0], bytes, tag, name) /* the compute stream */;
}

static size_t elem_bytes(size_t count, size_t size, const char *fn, const char *name) {
    if (count > SIZE_MAX / size) fatal("%s('%s'): %zu elements is too large", fn, name ? name : "?", count);
    return count * size;
}

float *dev_alloc_f32(Dev *d, size_t count, MemTag tag, const char *name) {
    return dev_alloc(d, elem_bytes(count, sizeof(float), "dev_alloc_f32", name), tag, name);
}

float *dev_alloc_f32_on(Stream *s, size_t count, MemTag tag, const char *name) {
    return dev_alloc_on(s, elem_bytes(count, sizeof(float), "dev_alloc_f32_on", name), tag, name);
}

Bf16 *dev_alloc_bf16(Dev *d, size_t count, MemTag tag, const char *name) {
    return dev_alloc(d, elem_bytes(count, sizeof(Bf16), "dev_alloc_bf16", name), tag, name);
}

Bf16 *dev_alloc_bf16_on(Stream *s, size_t count, MemTag tag, const char *name) {
    return dev_alloc_on(s, elem_bytes(count, sizeof(Bf16), "dev_alloc_bf16_on", name), tag, name);
}

float *dev_alloc_host_f32(Dev *d, size_t count, MemTag tag, const char *name) {
    return dev_alloc_host(d, elem_bytes(count, sizeof(float), "dev_alloc_host_f32", name), tag, name);
}

CopyDir dev_copy_direction(const Dev *d, const void *dst, const void *src) {
    const Alloc *a = dev_live_alloc_containing(d, (uintptr_t)dst), *b = dev_live_alloc_containing(d, (uintptr_t)src);
    if (!a || !b || a->host == b->host) return COPY_SAME_SIDE;
    return b->host ? COPY_H2D : COPY_D2H;
}

int dev_mem_is_host(const Dev *d, const void *p) {
    const Alloc *a = dev_live_alloc_containing(d, (uintptr_t)p);
    return a && a->host;
}

/* Each direction's name (a copy op's, and so the last part of its trace name "<module>.h2d"), by the direction. */
static const char *const COPY_DIR_NAMES[COPY_DIR_COUNT] = {
    [COPY_SAME_SIDE] = "copy",
    [COPY_H2D] = "h2d",
    [COPY_D2H] = "d2h",
};

const char *copy_direction_name(CopyDir dir) {
    return (int)dir >= 0 && dir < COPY_DIR_COUNT && COPY_DIR_NAMES[dir] ? COPY_DIR_NAMES[dir] : "copy";
}

static Alloc *live_alloc(const Dev *d, const void *p) {
    Alloc *a = treap_floor(d->mem.live_root, (uintptr_t)p);
    if (a && a->addr == (uintptr_t)p) return a;
    a = treap_floor(d->mem.host_root, (uintptr_t)p);
    return a && a->addr == (uintptr_t)p ? a : NULL;
}

void dev_record_stream(void *p, Stream *s) {
    if (!s) fatal("dev_record_stream: NULL stream");
    Alloc *a = live_alloc(s->dev, p);
    if (!a) fatal("dev_record_stream: %p is not a live allocation of rank %d (record before dev_free)", p, s->dev->rank);
    if (a->host) return; /* pinned host memory: its free waits for every stream anyway */
    if (s->index >= DEV_MAX_STREAMS)
        fatal("dev_record_stream: stream '%s' is the rank's stream %d (at most %d)", s->name, s->index + 1, DEV_MAX_STREAMS);
    if (s->index != a->stream) a->recorded |= 1ull << s->index; /* the owner's own work is ordered anyway */
}

void dev_free(Dev *d, void *p) {
    if (!p) return;
    Alloc *a = live_alloc(d, p);
    if (!a) fatal("dev_free: %p is not a live allocation of rank %d (double free?)", p, d->rank);
    dev_complete_held_frees(d, 0);
    race_on_free(d, a); /* another stream may still use it: stops the run with the fix */
    if (a->host) d->mem.host_root = treap_remove(d->mem.host_root, a->addr);
    else d->mem.live_root = treap_remove(d->mem.live_root, a->addr);
    a->left = a->right = NULL;
    d->mem.n_live--;
    a->free_module = d->scope.module;
    a->free_phase = d->scope.phase;
    if (d->race.on) quarantine(d, a);
    if (a->recorded) {
        /* record_stream: held and counted until the recorded streams finished the work queued so far */
        PendingFree pf = {a, a->recorded, NULL, 1};
        dev_ops(d)->fence_create(d, &pf);
        if (d->mem.n_held == d->mem.held_cap) {
            d->mem.held_cap = d->mem.held_cap ? d->mem.held_cap * 2 : 16;
            d->mem.held = xrealloc(d->mem.held, d->mem.held_cap * sizeof *d->mem.held);
        }
        d->mem.held[d->mem.n_held++] = pf;
        log_free(d, MEV_FREE_REQUESTED, a);
    } else {
        /* back to its stream's pool at once: that stream's later work is ordered after the free */
        uncount(d, a);
        log_free(d, MEV_FREE, a);
        retire_storage(d, a);
    }
    dev_release_pending_frees(d, 0);
}

size_t dev_mem_current(const Dev *d) { return d->mem.current; }
size_t dev_mem_host_current(const Dev *d) { return d->mem.host_current; }
size_t dev_mem_host_peak(const Dev *d) { return d->mem.host_peak; }
size_t dev_mem_host_current_by_tag(const Dev *d, MemTag tag) {
    if ((int)tag < 0 || tag >= MEM_TAG_COUNT) return 0;
    return d->mem.host_by_tag[tag];
}
size_t dev_mem_peak(const Dev *d) { return d->mem.peak; }
void dev_mem_reset_peak(Dev *d) {
    d->mem.peak = d->mem.current;
    d->mem.host_peak = d->mem.host_current;
}

void dev_mem_window_begin(Dev *d) {
    d->mem.window_peak = d->mem.current;
    memcpy(d->mem.window_by_tag, d->mem.by_tag, sizeof d->mem.window_by_tag);
}
size_t dev_mem_window_peak(const Dev *d, size_t *by_tag) {
    if (by_tag) memcpy(by_tag, d->mem.window_by_tag, sizeof d->mem.window_by_tag);
    return d->mem.window_peak;
}
size_t dev_mem_current_by_tag(const Dev *d, MemTag tag) {
    if ((int)tag < 0 || tag >= MEM_TAG_COUNT) return 0;
    return d->mem.by_tag[tag];
}

size_t dev_mem_live_size_containing(const Dev *d, const void *p) {
    Alloc *a = containing(d->mem.live_root, (uintptr_t)p);
    return a ? a->size : 0;
}

uint64_t dev_mem_live_id_containing(const Dev *d, const void *p) {
    Alloc *a = containing(d->mem.live_root, (uintptr_t)p);
    return a ? a->seq : 0;
}

const MemEvent *dev_mem_free_event(const Dev *d, uint64_t id) {
    /* the log is in seq order and an allocation's id is its MEV_ALLOC's seq */
    size_t lo = 0, hi = d->mem.n_mev;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (d->mem.mev[mid].seq < id) lo = mid + 1;
        else hi = mid;
    }
    if (!id || lo == d->mem.n_mev || d->mem.mev[lo].seq != id || d->mem.mev[lo].kind != MEV_ALLOC) return NULL;
    /* the latest allocation after it of the same name, size and pool: the same buffer made again (a
     * param gathered again whose new data no probe saw before it was freed) */
    const MemEvent *a = &d->mem.mev[lo];
    for (size_t i = lo + 1; i < d->mem.n_mev; i++) {
        const MemEvent *e = &d->mem.mev[i];
        if (e->kind == MEV_ALLOC && e->size == a->size && e->host == a->host && e->name && a->name &&
            !strcmp(e->name, a->name))
            a = e, lo = i;
    }
    /* its address is its own until its free: the first free event at the address after it */
    for (size_t i = lo + 1; i < d->mem.n_mev; i++) {
        const MemEvent *e = &d->mem.mev[i];
        if ((e->kind == MEV_FREE || e->kind == MEV_FREE_REQUESTED) && e->addr == a->addr && e->host == a->host)
            return e;
    }
    return NULL;
}

void dev_mem_note(Dev *d, const char *kind, const char *json_fields) {
    MemEvent *e = mev_push(d);
    e->kind = MEV_NOTE;
    e->seq = ++d->mem.mem_seq;
    e->name = dev_intern(d, kind ? kind : "note");
    e->json = xstrdup(json_fields ? json_fields : "");
    e->module = d->scope.module;
    e->phase = d->scope.phase;
    e->step = d->scope.step;
    e->time_us = dev_host_time_us(d);
    e->current_bytes = d->mem.current;
}

static void free_tree(Dev *d, Alloc *t) {
    if (!t) return;
    free_tree(d, t->left);
    free_tree(d, t->right);
    free_storage(d, t);
}

/* At Dev destroy (streams already idle and joined). */
void dev_alloc_destroy(Dev *d) {
    for (size_t i = 0; i < d->mem.n_held; i++) {
        dev_ops(d)->fence_release(d, &d->mem.held[i]);
        release_storage(d, d->mem.held[i].alloc);
    }
    free(d->mem.held);
    while (d->mem.pend_count) {
        PendingFree *p = &d->mem.pending[d->mem.pend_head];
        dev_ops(d)->fence_release(d, p);
        release_storage(d, p->alloc);
        d->mem.pend_head = (d->mem.pend_head + 1) % d->mem.pend_cap;
        d->mem.pend_count--;
    }
    free(d->mem.pending);
    while (d->race.quar_count) quarantine_evict_one(d);
    free(d->race.quarantine);
    free_tree(d, d->mem.live_root);
    free_tree(d, d->mem.host_root);
    for (size_t i = 0; i < d->mem.n_mev; i++) free(d->mem.mev[i].json);
    free(d->mem.mev);
    free(d->mem.over_capacity);
}
