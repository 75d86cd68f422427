/* artifacts.c — Chrome trace JSON, memory snapshot JSON, and a memory_viz
 * pickle written by hand with only the opcodes memory_viz's unpickler accepts.
 * The trace timestamps of every rank are relative to the World's epoch. */
#include "runtime/internal.h"
#include "runtime/util.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- buffer */

typedef struct {
    char *p;
    size_t len, cap;
} Buf;

static void buf_reserve(Buf *b, size_t more) {
    if (b->len + more <= b->cap) return;
    size_t ncap = b->cap ? b->cap : 4096;
    while (ncap < b->len + more) ncap *= 2;
    b->p = xrealloc(b->p, ncap);
    b->cap = ncap;
}

static void buf_put(Buf *b, const void *data, size_t n) {
    buf_reserve(b, n);
    memcpy(b->p + b->len, data, n);
    b->len += n;
}

static void buf_byte(Buf *b, unsigned char c) { buf_put(b, &c, 1); }

static void buf_printf(Buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void buf_printf(Buf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) fatal("artifacts: formatting failed");
    buf_reserve(b, (size_t)n + 1);
    va_start(ap, fmt);
    vsnprintf(b->p + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

/* A JSON string literal (quotes included). */
static void json_str(Buf *b, const char *s) {
    buf_byte(b, '"');
    for (const unsigned char *c = (const unsigned char *)(s ? s : ""); *c; c++) {
        if (*c == '"' || *c == '\\') {
            buf_byte(b, '\\');
            buf_byte(b, *c);
        } else if (*c < 0x20) {
            buf_printf(b, "\\u%04x", *c);
        } else {
            buf_byte(b, *c);
        }
    }
    buf_byte(b, '"');
}

static void write_buf(const char *dir, const char *file, Buf *b) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    write_file_atomic(path, b->p ? b->p : "", b->len);
    free(b->p);
    memset(b, 0, sizeof *b);
}

/* ----------------------------------------------------------------- trace */

static void trace_events_of(Buf *b, Dev *d, int *first) {
#define SEP() (*first ? (void)(*first = 0) : buf_byte(b, ','))
    SEP();
    buf_printf(b, "\n{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":%d,\"tid\":0,\"args\":{\"name\":\"rank %d\"}}", d->rank,
               d->rank);
    SEP();
    buf_printf(b, "\n{\"ph\":\"M\",\"name\":\"process_sort_index\",\"pid\":%d,\"tid\":0,\"args\":{\"sort_index\":%d}}",
               d->rank, d->rank);
    for (int i = 0; i < d->nstreams; i++) {
        SEP();
        buf_printf(b, "\n{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":", d->rank, i);
        json_str(b, d->streams[i]->name);
        buf_printf(b, "}}");
        SEP();
        buf_printf(b, "\n{\"ph\":\"M\",\"name\":\"thread_sort_index\",\"pid\":%d,\"tid\":%d,\"args\":{\"sort_index\":%d}}",
                   d->rank, i, i);
    }
    SEP();
    buf_printf(b, "\n{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":\"host\"}}",
               d->rank, TRACE_HOST_TID);
    SEP();
    buf_printf(b, "\n{\"ph\":\"M\",\"name\":\"thread_sort_index\",\"pid\":%d,\"tid\":%d,\"args\":{\"sort_index\":-1}}",
               d->rank, TRACE_HOST_TID);
    pthread_mutex_lock(&d->trace.mu);
    char name[512];
    for (size_t i = 0; i < d->trace.n; i++) {
        const TraceRec *r = &d->trace.recs[i];
        if (r->prefix && *r->prefix) snprintf(name, sizeof name, "%s.%s", r->prefix, r->name);
        else snprintf(name, sizeof name, "%s", r->name);
        SEP();
        buf_printf(b, "\n{\"ph\":\"X\",\"name\":");
        json_str(b, name);
        buf_printf(b, ",\"cat\":\"%s\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f,\"args\":{\"step\":%d,\"phase\":",
                   r->cat, d->rank, r->stream, r->ts, r->dur, r->step);
        json_str(b, r->phase);
        buf_printf(b, ",\"module\":");
        json_str(b, r->module);
        if (r->bytes) buf_printf(b, ",\"bytes\":%zu", r->bytes);
        if (r->micro >= 0) buf_printf(b, ",\"microbatch\":%d", r->micro);
        if (r->dtype) buf_printf(b, ",\"dtype\":\"%s\"", r->dtype);
        if (r->group) {
            buf_printf(b, ",\"group\":");
            json_str(b, r->group);
        }
        buf_printf(b, "}}");
    }
    pthread_mutex_unlock(&d->trace.mu);
#undef SEP
}

static void write_trace(const char *dir, const char *file, Dev **devs, int n) {
    Buf b = {0};
    int first = 1;
    buf_printf(&b, "{\"traceEvents\":[");
    for (int i = 0; i < n; i++) trace_events_of(&b, devs[i], &first);
    buf_printf(&b, "\n],\"displayTimeUnit\":\"ms\"}\n");
    write_buf(dir, file, &b);
}

/* ------------------------------------------------------ memory snapshot */

static void json_alloc_fields(Buf *b, uintptr_t addr, size_t size, MemTag tag, const char *name, int step,
                              const char *module, const char *phase) {
    buf_printf(b, "\"addr\":%llu,\"size\":%zu,\"tag\":\"%s\",\"name\":", (unsigned long long)addr, size, mem_tag_name(tag));
    json_str(b, name);
    buf_printf(b, ",\"step\":%d,\"module\":", step);
    json_str(b, module);
    buf_printf(b, ",\"phase\":");
    json_str(b, phase);
}

static void json_live(Buf *b, const Alloc *a, int *first) {
    if (!a) return;
    json_live(b, a->left, first);
    buf_printf(b, "%s\n{\"seq\":%llu,", *first ? "" : ",", (unsigned long long)a->seq);
    *first = 0;
    json_alloc_fields(b, a->addr, a->size, a->tag, a->name, a->step, a->module, a->phase);
    buf_printf(b, ",\"time_us\":%.3f}", a->time_us);
    json_live(b, a->right, first);
}

/* "free": uncounted at the call; a dev_record_stream block: "free_requested"
 * (still counted), then "free_completed" (uncounted). */
static const char *mev_action(MemEventKind k) {
    switch (k) {
    case MEV_ALLOC: return "alloc";
    case MEV_FREE: return "free";
    case MEV_FREE_REQUESTED: return "free_requested";
    case MEV_FREE_COMPLETED: return "free_completed";
    case MEV_NOTE: break;
    }
    return "note";
}

/* One allocation event of the log (device or host), as a JSON object. */
static void json_mem_event(Buf *b, Dev *d, const MemEvent *e) {
    buf_printf(b, "\"action\":\"%s\",", mev_action(e->kind));
    json_alloc_fields(b, e->addr, e->size, e->tag, e->name, e->step, e->module, e->phase);
    if (!e->host) {
        buf_printf(b, ",\"stream\":");
        json_str(b, d->streams[e->stream]->name);
    }
    buf_printf(b, ",\"time_us\":%.3f,\"current_bytes\":%zu}", e->time_us, e->current_bytes);
}

static void write_memory_json(const char *dir, Dev *d) {
    Buf b = {0};
    buf_printf(&b, "{\"rank\":%d,\"world_size\":%d,\"peak_bytes\":%zu,\"current_bytes\":%zu,\"reserved_bytes\":%zu,"
               "\"host_peak_bytes\":%zu,\"host_current_bytes\":%zu,\"tags\":[", d->rank, d->world_size, d->mem.peak,
               d->mem.current, d->mem.reserved, d->mem.host_peak, d->mem.host_current);
    for (int t = 0; t < MEM_TAG_COUNT; t++) buf_printf(&b, "%s\"%s\"", t ? "," : "", mem_tag_name((MemTag)t));
    buf_printf(&b, "],\"events\":[");
    int first = 1;
    for (size_t i = 0; i < d->mem.n_mev; i++) {
        const MemEvent *e = &d->mem.mev[i];
        if (e->host) continue;
        buf_printf(&b, "%s\n{\"seq\":%llu,", first ? "" : ",", (unsigned long long)e->seq);
        first = 0;
        if (e->kind == MEV_NOTE) {
            buf_printf(&b, "\"kind\":");
            json_str(&b, e->name);
            if (e->json && *e->json) buf_printf(&b, ",%s", e->json);
            buf_printf(&b, "}");
            continue;
        }
        json_mem_event(&b, d, e);
    }
    /* the pinned host pool (dev_alloc_host): its own events, current_bytes counting host bytes */
    buf_printf(&b, "\n],\"host_events\":[");
    first = 1;
    for (size_t i = 0; i < d->mem.n_mev; i++) {
        const MemEvent *e = &d->mem.mev[i];
        if (!e->host) continue;
        buf_printf(&b, "%s\n{\"seq\":%llu,", first ? "" : ",", (unsigned long long)e->seq);
        first = 0;
        json_mem_event(&b, d, e);
    }
    buf_printf(&b, "\n],\"live_at_end\":[");
    first = 1;
    json_live(&b, d->mem.live_root, &first);
    buf_printf(&b, "\n],\"host_live_at_end\":[");
    first = 1;
    json_live(&b, d->mem.host_root, &first);
    buf_printf(&b, "\n]}\n");
    char file[64];
    snprintf(file, sizeof file, "memory_rank%d.json", d->rank);
    write_buf(dir, file, &b);
}

/* ---------------------------------------------------------------- pickle */
/* Protocol 2, no memo. Opcodes used: PROTO EMPTY_DICT MARK SETITEMS EMPTY_LIST
 * APPENDS TUPLE2 BININT BININT1 BININT2 LONG1 BINFLOAT BINUNICODE NONE NEWTRUE
 * NEWFALSE STOP — all in memory_viz's whitelist. */

enum {
    PK_PROTO = 0x80, PK_EMPTY_DICT = '}', PK_MARK = '(', PK_SETITEMS = 'u', PK_EMPTY_LIST = ']', PK_APPENDS = 'e',
    PK_TUPLE2 = 0x86, PK_BININT = 'J', PK_BININT1 = 'K', PK_BININT2 = 'M', PK_LONG1 = 0x8a, PK_BINFLOAT = 'G',
    PK_BINUNICODE = 'X', PK_NONE = 'N', PK_NEWTRUE = 0x88, PK_NEWFALSE = 0x89, PK_STOP = '.'
};

static void pk_int(Buf *b, int64_t v) {
    if (v >= 0 && v < 256) {
        buf_byte(b, PK_BININT1);
        buf_byte(b, (unsigned char)v);
    } else if (v >= 0 && v < 65536) {
        buf_byte(b, PK_BININT2);
        buf_byte(b, (unsigned char)(v & 0xff));
        buf_byte(b, (unsigned char)(v >> 8));
    } else if (v >= INT32_MIN && v <= INT32_MAX) {
        uint32_t u = (uint32_t)(int32_t)v;
        buf_byte(b, PK_BININT);
        for (int i = 0; i < 4; i++) buf_byte(b, (unsigned char)(u >> (8 * i)));
    } else {
        /* LONG1: minimal little-endian two's complement */
        unsigned char bytes[9];
        int n = 0;
        int64_t x = v;
        for (;;) {
            bytes[n++] = (unsigned char)(x & 0xff);
            int64_t rest = x >> 8; /* arithmetic shift on gcc/clang */
            int sign = bytes[n - 1] & 0x80;
            if ((rest == 0 && !sign) || (rest == -1 && sign)) break;
            x = rest;
        }
        buf_byte(b, PK_LONG1);
        buf_byte(b, (unsigned char)n);
        buf_put(b, bytes, (size_t)n);
    }
}

static void pk_uint(Buf *b, uint64_t v) {
    if (v <= (uint64_t)INT64_MAX) {
        pk_int(b, (int64_t)v);
        return;
    }
    unsigned char bytes[9];
    for (int i = 0; i < 8; i++) bytes[i] = (unsigned char)(v >> (8 * i));
    bytes[8] = 0;
    buf_byte(b, PK_LONG1);
    buf_byte(b, 9);
    buf_put(b, bytes, 9);
}

static void pk_str(Buf *b, const char *s) {
    if (!s) s = "";
    size_t n = strlen(s);
    buf_byte(b, PK_BINUNICODE);
    for (int i = 0; i < 4; i++) buf_byte(b, (unsigned char)(n >> (8 * i)));
    buf_put(b, s, n);
}

static void pk_bool(Buf *b, int v) { buf_byte(b, v ? PK_NEWTRUE : PK_NEWFALSE); }

/* Dicts/lists: open with EMPTY_* + MARK, close with SETITEMS/APPENDS (an empty
 * MARK ... SETITEMS is legal and keeps the writer simple). */
static void pk_dict_open(Buf *b) { buf_byte(b, PK_EMPTY_DICT); buf_byte(b, PK_MARK); }
static void pk_dict_close(Buf *b) { buf_byte(b, PK_SETITEMS); }
static void pk_list_open(Buf *b) { buf_byte(b, PK_EMPTY_LIST); buf_byte(b, PK_MARK); }
static void pk_list_close(Buf *b) { buf_byte(b, PK_APPENDS); }
/* After each item of a long list: memory_viz appends a batch with JS spread
 * syntax, which overflows for huge batches, so flush every 1000 items (as
 * Python's pickler does). */
static void pk_list_item(Buf *b, size_t *n) {
    if (++*n % 1000 == 0) {
        buf_byte(b, PK_APPENDS);
        buf_byte(b, PK_MARK);
    }
}

/* Storage behind an allocation of `bytes`: rounded up to 64, at least 64 (see dev_alloc). */
static size_t real_size(size_t bytes) { return bytes ? (bytes + 63) / 64 * 64 : 64; }

static void pk_key_str(Buf *b, const char *k, const char *v) { pk_str(b, k); pk_str(b, v); }
static void pk_key_int(Buf *b, const char *k, int64_t v) { pk_str(b, k); pk_int(b, v); }
static void pk_key_uint(Buf *b, const char *k, uint64_t v) { pk_str(b, k); pk_uint(b, v); }

/* Frames carry what memory_viz can show per block: tag + name, then module.phase @ step. */
static void pk_frames(Buf *b, MemTag tag, const char *name, int step, const char *module, const char *phase) {
    char where[512];
    snprintf(where, sizeof where, "%s%s%s", module && *module ? module : "(no module)", phase && *phase ? "." : "",
             phase ? phase : "");
    pk_list_open(b);
    pk_dict_open(b);
    pk_key_str(b, "filename", mem_tag_name(tag));
    pk_key_int(b, "line", 0);
    pk_key_str(b, "name", name && *name ? name : "(unnamed)");
    pk_dict_close(b);
    pk_dict_open(b);
    pk_key_str(b, "filename", "step");
    pk_key_int(b, "line", step);
    pk_key_str(b, "name", where);
    pk_dict_close(b);
    pk_list_close(b);
}

/* One segment holding one block (every allocation is its own segment). */
static void pk_segment(Buf *b, const Alloc *a, const char *state, size_t *n) {
    size_t real = real_size(a->size);
    pk_dict_open(b);
    pk_key_int(b, "device", 0);
    pk_key_uint(b, "address", a->addr);
    pk_key_uint(b, "total_size", real);
    pk_key_uint(b, "allocated_size", real);
    pk_key_uint(b, "active_size", real);
    pk_key_uint(b, "requested_size", a->size);
    pk_key_int(b, "stream", a->stream);
    pk_key_str(b, "segment_type", a->size < (1u << 20) ? "small" : "large");
    pk_str(b, "segment_pool_id");
    pk_int(b, 0);
    pk_int(b, 0);
    buf_byte(b, PK_TUPLE2);
    pk_str(b, "is_expandable");
    pk_bool(b, 0);
    pk_str(b, "frames");
    pk_frames(b, a->tag, a->name, a->step, a->module, a->phase);
    pk_str(b, "blocks");
    pk_list_open(b);
    pk_dict_open(b);
    pk_key_uint(b, "address", a->addr);
    pk_key_uint(b, "size", real);
    pk_key_uint(b, "requested_size", a->size);
    pk_key_str(b, "state", state);
    pk_str(b, "frames");
    pk_frames(b, a->tag, a->name, a->step, a->module, a->phase);
    pk_dict_close(b);
    pk_list_close(b);
    pk_dict_close(b);
    pk_list_item(b, n);
}

static void pk_segments(Buf *b, const Alloc *a, size_t *n) {
    if (!a) return;
    pk_segments(b, a->left, n);
    pk_segment(b, a, "active_allocated", n);
    pk_segments(b, a->right, n);
}

/* One device_traces entry. */
static void pk_trace_entry(Buf *b, const MemEvent *e, const char *action, size_t size, size_t *n) {
    pk_dict_open(b);
    pk_key_str(b, "action", action);
    pk_key_uint(b, "addr", e->addr);
    pk_key_uint(b, "size", size);
    pk_key_int(b, "stream", e->stream);
    pk_key_int(b, "time_us", (int64_t)e->time_us);
    pk_str(b, "frames");
    pk_frames(b, e->tag, e->name, e->step, e->module, e->phase);
    pk_dict_close(b);
    pk_list_item(b, n);
}

static void write_memory_pickle(const char *dir, Dev *d) {
    Buf b = {0};
    buf_byte(&b, PK_PROTO);
    buf_byte(&b, 2);
    pk_dict_open(&b);
    pk_str(&b, "segments");
    size_t n = 0;
    pk_list_open(&b);
    pk_segments(&b, d->mem.live_root, &n);
    for (size_t i = 0; i < d->mem.n_held; i++) pk_segment(&b, d->mem.held[i].alloc, "active_pending_free", &n);
    pk_list_close(&b);
    pk_str(&b, "device_traces");
    pk_list_open(&b);
    pk_list_open(&b);
    /* Every allocation is its own segment (one aligned allocation each), so
     * the "Allocator State History" view can place every block. Sizes of
     * alloc/free entries are the requested bytes, as counted by dev_mem_*.
     * A plain free completes at once (the block is back in its stream's
     * pool); a dev_record_stream block completes when its streams got there. */
    n = 0;
    for (size_t i = 0; i < d->mem.n_mev; i++) {
        const MemEvent *e = &d->mem.mev[i];
        if (e->host) continue; /* the device's view: pinned host memory is in the json's host_events */
        if (e->kind == MEV_ALLOC) {
            pk_trace_entry(&b, e, "segment_alloc", real_size(e->size), &n);
            pk_trace_entry(&b, e, "alloc", e->size, &n);
        }
        if (e->kind == MEV_FREE || e->kind == MEV_FREE_REQUESTED) pk_trace_entry(&b, e, "free_requested", e->size, &n);
        if (e->kind == MEV_FREE || e->kind == MEV_FREE_COMPLETED) {
            pk_trace_entry(&b, e, "free_completed", e->size, &n);
            pk_trace_entry(&b, e, "segment_free", real_size(e->size), &n);
        }
    }
    pk_list_close(&b);
    pk_list_close(&b);
    pk_dict_close(&b);
    buf_byte(&b, PK_STOP);
    char file[64];
    snprintf(file, sizeof file, "memory_rank%d.pickle", d->rank);
    write_buf(dir, file, &b);
}

/* ------------------------------------------------------------------ all */

void dev_write_artifacts(Dev *d, const char *dir) {
    make_dirs(dir);
    dev_synchronize(d);
    char file[64];
    snprintf(file, sizeof file, "trace_rank%d.json", d->rank);
    write_trace(dir, file, &d, 1);
    write_memory_json(dir, d);
    write_memory_pickle(dir, d);
    World *w = d->world;
    if (!backend_is_multiprocess(w->cfg.backend) && w->local_ranks > 1) {
        dev_host_barrier(d); /* every rank's trace is complete */
        if (d->rank == 0) write_trace(dir, "trace.json", w->devs, w->local_ranks);
        dev_host_barrier(d); /* nobody records more or exits while rank 0 reads */
    } else if (!backend_is_multiprocess(w->cfg.backend)) {
        write_trace(dir, "trace.json", &d, 1);
    } else {
        dev_host_barrier(d);
    }
}
