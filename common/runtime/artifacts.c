/* artifacts.c — Chrome trace JSON, memory snapshot JSON, and a memory_viz
 * pickle written by hand with only the opcodes memory_viz's unpickler accepts.
 * The trace timestamps of every rank are relative to the World's epoch. */
#include "runtime/facts.h"
#include "runtime/internal.h"
#include "runtime/profile.h"
#include "runtime/json.h"
#include "runtime/util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- buffer */

typedef struct {
    char *p;
    size_t len, cap;
} Buf;

static void buf_put(Buf *b, const void *data, size_t n) {
    b->p = xgrow(b->p, &b->cap, b->len + n, 4096);
    memcpy(b->p + b->len, data, n);
    b->len += n;
}

static void buf_byte(Buf *b, unsigned char c) { buf_put(b, &c, 1); }

static void write_buf(const char *dir, const char *file, Buf *b) {
    char *path = xasprintf("%s/%s", dir, file);
    write_file_atomic(path, b->p ? b->p : "", b->len);
    free(path);
    free(b->p);
    memset(b, 0, sizeof *b);
}

static void write_json(const char *dir, const char *file, Json *j) {
    char *path = xasprintf("%s/%s", dir, file);
    json_write_file(j, path);
    free(path);
}

/* ----------------------------------------------------------------- trace */

/* A metadata event ("M") naming or ordering a track: args {arg_key: name, or index if name is NULL}. */
static void trace_meta(Json *j, const char *what, int pid, int tid, const char *arg_key, const char *name, int index) {
    json_object_begin(j);
    json_key(j, "ph");
    json_string(j, "M");
    json_key(j, "name");
    json_string(j, what);
    json_key(j, "pid");
    json_int(j, pid);
    json_key(j, "tid");
    json_int(j, tid);
    json_key(j, "args");
    json_object_begin(j);
    json_key(j, arg_key);
    if (name) json_string(j, name);
    else json_int(j, index);
    json_object_end(j);
    json_object_end(j);
}

/* Records by track, each track in the order it ran (stable by the order they
 * were added): the workers of the streams append concurrently, so the file is
 * the same on every run only once sorted. */
static pthread_mutex_t sort_mu = PTHREAD_MUTEX_INITIALIZER; /* ranks write their traces at once */
static const TraceRec *sort_base;
static int by_track(const void *a, const void *b) {
    size_t i = *(const size_t *)a, k = *(const size_t *)b;
    int ti = sort_base[i].stream, tk = sort_base[k].stream;
    if (ti != tk) return ti < tk ? -1 : 1;
    return i < k ? -1 : i > k;
}

/* One slice ("X") of rank d's trace. */
static void trace_rec_json(Json *j, const Dev *d, const TraceRec *r) {
    json_object_begin(j);
    json_key(j, "ph");
    json_string(j, "X");
    json_key(j, "name");
    if (r->prefix && *r->prefix) json_stringf(j, "%s.%s", r->prefix, r->name);
    else json_string(j, r->name);
    json_key(j, "cat");
    json_string(j, r->cat);
    json_key(j, "pid");
    json_int(j, d->rank);
    json_key(j, "tid");
    json_int(j, r->stream);
    json_key(j, "ts");
    json_fixed(j, r->ts, 3);
    json_key(j, "dur");
    json_fixed(j, r->dur, 3);
    json_key(j, "args");
    json_object_begin(j);
    json_key_int(j, "step", r->step);
    json_key_string(j, "phase", r->phase);
    json_key_string(j, "module", r->module);
    if (r->bytes) {
        json_key(j, "bytes");
        json_uint(j, r->bytes);
    }
    if (r->micro >= 0) {
        json_key(j, "microbatch");
        json_int(j, r->micro);
    }
    if (r->dtype) {
        json_key(j, "dtype");
        json_string(j, r->dtype);
    }
    if (r->group) {
        json_key(j, "group");
        json_string(j, r->group);
    }
    if (r->op) {
        json_key(j, "op");
        json_string(j, r->op);
    }
    if (r->p2p) {
        json_key(j, "p2p");
        json_string(j, r->p2p);
    }
    if (r->flops > 0) {
        json_key(j, "flops");
        json_fixed(j, r->flops, 0);
    }
    if (r->kclass) {
        json_key(j, TRACE_ARG_CLASS);
        json_string(j, r->kclass);
        json_key(j, TRACE_ARG_MATH);
        json_string(j, r->math);
    }
    if (r->wall) {
        json_key(j, TRACE_ARG_WALL_TS);
        json_fixed(j, r->wall_ts, 3);
        json_key(j, TRACE_ARG_WALL_DUR);
        json_fixed(j, r->wall_dur, 3);
    }
    json_object_end(j);
    json_object_end(j);
}

/* The metadata of rank d's tracks: the process (rank) and its streams' and host's names and order. */
static void trace_tracks_of(Json *j, const Dev *d) {
    char rank_name[32];
    snprintf(rank_name, sizeof rank_name, "rank %d", d->rank);
    trace_meta(j, "process_name", d->rank, 0, "name", rank_name, 0);
    trace_meta(j, "process_sort_index", d->rank, 0, "sort_index", NULL, d->rank);
    for (int i = 0; i < d->nstreams; i++) {
        trace_meta(j, "thread_name", d->rank, i, "name", d->streams[i]->name, 0);
        trace_meta(j, "thread_sort_index", d->rank, i, "sort_index", NULL, i);
    }
    trace_meta(j, "thread_name", d->rank, TRACE_HOST_TID, "name", "host", 0);
    trace_meta(j, "thread_sort_index", d->rank, TRACE_HOST_TID, "sort_index", NULL, -1);
}

static void trace_events_of(Json *j, Dev *d) {
    trace_tracks_of(j, d);
    pthread_mutex_lock(&d->trace.mu);
    size_t *order = xmalloc((d->trace.n ? d->trace.n : 1) * sizeof *order);
    for (size_t i = 0; i < d->trace.n; i++) order[i] = i;
    pthread_mutex_lock(&sort_mu);
    sort_base = d->trace.recs;
    qsort(order, d->trace.n, sizeof *order, by_track);
    pthread_mutex_unlock(&sort_mu);
    for (size_t i = 0; i < d->trace.n; i++) trace_rec_json(j, d, &d->trace.recs[order[i]]);
    free(order);
    pthread_mutex_unlock(&d->trace.mu);
}

static void write_trace(const char *dir, const char *file, Dev **devs, int n) {
    Json j = {0};
    json_object_begin(&j);
    json_key(&j, "traceEvents");
    json_array_begin_lines(&j);
    for (int i = 0; i < n; i++) trace_events_of(&j, devs[i]);
    json_array_end(&j);
    json_key(&j, "displayTimeUnit");
    json_string(&j, "ms");
    /* which clock ts and dur are on (HANDOUT: "Time"); the wall clock is in each event's args (CPU) */
    json_key(&j, "otherData");
    json_object_begin(&j);
    json_key_string(&j, "clock", dev_clock_name(devs[0]));
    const DeviceProfile *p = devs[0]->world->cfg.profile;
    if (p && strcmp(dev_clock_name(devs[0]), "model") == 0) { /* what the modelled times were priced on */
        json_key_string(&j, "device_profile", p->name);
        json_key(&j, "peak_flops");
        json_object_begin(&j);
        json_key(&j, "f32");
        json_g(&j, p->peak_f32, 6);
        json_key(&j, "tf32");
        json_g(&j, p->peak_tf32, 6);
        json_key(&j, "bf16");
        json_g(&j, p->peak_bf16, 6);
        json_object_end(&j);
        json_key(&j, "hbm_bytes_per_s");
        json_g(&j, p->hbm_bytes_s, 6);
    }
    world_facts_json(devs[0]->world, &j); /* the groups, mesh, stage map and vocabularies the run used */
    json_object_end(&j);
    json_object_end(&j);
    json_line_end(&j);
    write_json(dir, file, &j);
}

/* ------------------------------------------------------ memory snapshot */

static void json_size_field(Json *j, const char *key, size_t v) {
    json_key(j, key);
    json_uint(j, v);
}

static void json_alloc_fields(Json *j, uintptr_t addr, size_t size, MemTag tag, const char *name, int step,
                              const char *module, const char *phase) {
    json_key(j, "addr");
    json_uint(j, addr);
    json_size_field(j, "size", size);
    json_key(j, "tag");
    json_string(j, mem_tag_name(tag));
    json_key(j, "name");
    json_string(j, name);
    json_key(j, "step");
    json_int(j, step);
    json_key(j, "module");
    json_string(j, module);
    json_key(j, "phase");
    json_string(j, phase);
}

static void json_live(Json *j, const Alloc *a) {
    if (!a) return;
    json_live(j, a->left);
    json_object_begin(j);
    json_key(j, "seq");
    json_uint(j, a->seq);
    json_alloc_fields(j, a->addr, a->size, a->tag, a->name, a->step, a->module, a->phase);
    json_key(j, "time_us");
    json_fixed(j, a->time_us, 3);
    json_object_end(j);
    json_live(j, a->right);
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

/* One event of the log (device or host) as a JSON object; a note
 * (dev_mem_note) is its kind and the fields its writer gave. */
static void json_mem_event(Json *j, Dev *d, const MemEvent *e) {
    json_object_begin(j);
    json_key(j, "seq");
    json_uint(j, e->seq);
    if (e->kind == MEV_NOTE) {
        json_key(j, "kind");
        json_string(j, e->name);
        json_members(j, e->json);
        json_object_end(j);
        return;
    }
    json_key(j, "action");
    json_string(j, mev_action(e->kind));
    json_alloc_fields(j, e->addr, e->size, e->tag, e->name, e->step, e->module, e->phase);
    if (!e->host) {
        json_key(j, "stream");
        json_string(j, d->streams[e->stream]->name);
    }
    json_key(j, "time_us");
    json_fixed(j, e->time_us, 3);
    json_size_field(j, "current_bytes", e->current_bytes);
    json_object_end(j);
}

/* The events of the device (host = 0) or of the pinned host pool (host = 1). */
static void json_mem_events(Json *j, Dev *d, const char *key, int host) {
    json_key(j, key);
    json_array_begin_lines(j);
    for (size_t i = 0; i < d->mem.n_mev; i++)
        if ((d->mem.mev[i].host != 0) == host) json_mem_event(j, d, &d->mem.mev[i]);
    json_array_end(j);
}

static void write_memory_json(const char *dir, Dev *d) {
    Json j = {0};
    json_object_begin(&j);
    json_key(&j, "rank");
    json_int(&j, d->rank);
    json_key(&j, "world_size");
    json_int(&j, d->world_size);
    json_size_field(&j, "peak_bytes", d->mem.peak);
    json_size_field(&j, "current_bytes", d->mem.current);
    json_size_field(&j, "reserved_bytes", d->mem.reserved);
    json_size_field(&j, "host_peak_bytes", d->mem.host_peak);
    json_size_field(&j, "host_current_bytes", d->mem.host_current);
    json_key(&j, "tags");
    json_array_begin(&j);
    for (int t = 0; t < MEM_TAG_COUNT; t++) json_string(&j, mem_tag_name((MemTag)t));
    json_array_end(&j);
    json_mem_events(&j, d, "events", 0);
    /* the pinned host pool (dev_alloc_host): its own events, current_bytes counting host bytes */
    json_mem_events(&j, d, "host_events", 1);
    json_key(&j, "live_at_end");
    json_array_begin_lines(&j);
    json_live(&j, d->mem.live_root);
    json_array_end(&j);
    json_key(&j, "host_live_at_end");
    json_array_begin_lines(&j);
    json_live(&j, d->mem.host_root);
    json_array_end(&j);
    json_object_end(&j);
    json_line_end(&j);
    char file[64];
    snprintf(file, sizeof file, "memory_rank%d.json", d->rank);
    write_json(dir, file, &j);
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
    size_t real = dev_storage_bytes(a->size);
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
            pk_trace_entry(&b, e, "segment_alloc", dev_storage_bytes(e->size), &n);
            pk_trace_entry(&b, e, "alloc", e->size, &n);
        }
        if (e->kind == MEV_FREE || e->kind == MEV_FREE_REQUESTED) pk_trace_entry(&b, e, "free_requested", e->size, &n);
        if (e->kind == MEV_FREE || e->kind == MEV_FREE_COMPLETED) {
            pk_trace_entry(&b, e, "free_completed", e->size, &n);
            pk_trace_entry(&b, e, "segment_free", dev_storage_bytes(e->size), &n);
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

/* --------------------------------------------------------- partial record */

void dev_record_partial(Dev *d, const char *dir) {
    free(d->partial_dir);
    d->partial_dir = dir ? xstrdup(dir) : NULL;
}

/* partial_rank<r>.json: rank d's record up to the runtime error `line` (the host thread that reports it):
 * traceEvents, the ops its host had enqueued, in that order, each at the host's modelled time when it enqueued
 * it (dur 0; trace.h, EnqueueLog), and events, the memory snapshot's notes so far. Host order only, so the
 * same file on every run that stops at the same error. */
static void write_partial(Dev *d, const char *line) {
    make_dirs(d->partial_dir);
    Json j = {0};
    json_object_begin(&j);
    json_key(&j, "partial");
    json_bool(&j, 1);
    json_key_int(&j, "rank", d->rank);
    json_key_string(&j, "error", line);
    json_key_string(&j, "about", "this rank's record up to the runtime error: traceEvents, the ops its host had "
                                 "enqueued, in that order, each at the host's modelled time when it enqueued it "
                                 "(dur 0); events, the memory snapshot's notes so far");
    json_key(&j, "traceEvents");
    json_array_begin_lines(&j);
    trace_tracks_of(&j, d);
    for (size_t i = 0; i < d->enqueued.n; i++) trace_rec_json(&j, d, &d->enqueued.recs[i]);
    json_array_end(&j);
    json_key(&j, "events");
    json_array_begin_lines(&j);
    for (size_t i = 0; i < d->mem.n_mev; i++)
        if (d->mem.mev[i].kind == MEV_NOTE) json_mem_event(&j, d, &d->mem.mev[i]);
    json_array_end(&j);
    json_object_end(&j);
    json_line_end(&j);
    char file[64];
    snprintf(file, sizeof file, "partial_rank%d.json", d->rank);
    write_json(d->partial_dir, file, &j);
}

void runtime_last_words(const char *line) {
    Dev *d = world_thread_dev();
    if (d && d->partial_dir) write_partial(d, line);
}

/* ------------------------------------------------------------------ all */

void dev_write_artifacts(Dev *d, const char *dir) {
    make_dirs(dir);
    dev_synchronize(d);
    World *w = d->world;
    /* --trace-ranks N: the other ranks write nothing (a 64-rank dry run's snapshots are gigabytes) */
    const int traced = w->cfg.trace_ranks > 0 && w->cfg.trace_ranks < w->cfg.world_size ? w->cfg.trace_ranks
                                                                                          : w->cfg.world_size;
    if (d->rank < traced) {
        char file[64];
        snprintf(file, sizeof file, "trace_rank%d.json", d->rank);
        write_trace(dir, file, &d, 1);
        write_memory_json(dir, d);
        write_memory_pickle(dir, d);
    }
    if (!backend_is_multiprocess(w->cfg.backend) && w->local_ranks > 1) {
        dev_host_barrier(d); /* every rank's trace is complete */
        int n = 0; /* the executed ranks below `traced` (slots run in rank order) */
        while (n < w->local_ranks && world_slot_rank(w, n) < traced) n++;
        if (d->rank == 0) write_trace(dir, "trace.json", w->devs, n);
        dev_host_barrier(d); /* nobody records more or exits while rank 0 reads */
    } else if (!backend_is_multiprocess(w->cfg.backend)) {
        write_trace(dir, "trace.json", &d, 1);
    } else {
        dev_host_barrier(d);
    }
}
