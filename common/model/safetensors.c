/* safetensors.c — strict reader and atomic writer for F32 .safetensors files,
 * with a small JSON parser of its own (no library dependency). */
#include "model/safetensors.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/json.h"
#include "runtime/util.h"

/* ------------------------------------------------------------------ JSON */

typedef enum { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ } JType;

typedef struct JVal {
    JType type;
    char *str;            /* J_STR: decoded, NUL-terminated */
    int is_uint;          /* J_NUM: a non-negative integer that fits in u */
    uint64_t u;
    size_t n;             /* J_ARR / J_OBJ: number of items */
    struct JVal *items;   /* [n] */
    char **keys;          /* J_OBJ: [n] */
} JVal;

typedef struct {
    const char *s;
    size_t len, pos;
    const char *path;
    int depth;
} JParser;

#define JSON_MAX_DEPTH 64

static void jfail(const JParser *p, const char *what) {
    fatal("%s: header is not valid JSON (%s at header byte %zu)", p->path, what, p->pos);
}

static void jws(JParser *p) {
    while (p->pos < p->len &&
           (p->s[p->pos] == ' ' || p->s[p->pos] == '\t' || p->s[p->pos] == '\n' || p->s[p->pos] == '\r'))
        p->pos++;
}

static int jpeek(const JParser *p) { return p->pos < p->len ? (unsigned char)p->s[p->pos] : -1; }

static void jfree(JVal *v) {
    free(v->str);
    for (size_t i = 0; i < v->n; i++) {
        jfree(&v->items[i]);
        if (v->keys) free(v->keys[i]);
    }
    free(v->items);
    free(v->keys);
    memset(v, 0, sizeof *v);
}

static unsigned jhex4(JParser *p) {
    if (p->len - p->pos < 4) jfail(p, "truncated \\u escape");
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        char c = p->s[p->pos++];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (unsigned)(c - 'A' + 10);
        else jfail(p, "bad \\u escape");
    }
    return v;
}

/* One raw UTF-8 sequence whose lead byte c was just read, into enc; rejects
 * malformed ones (overlongs, surrogates, above U+10FFFF). Returns its length. */
static size_t jutf8(JParser *p, unsigned char c, unsigned char enc[4]) {
    /* lead bytes: C2..DF, E0..EF, F0..F4 (F5..FF are never UTF-8) */
    size_t len = c >= 0xF0 ? (c <= 0xF4 ? 4 : 0) : c >= 0xE0 ? 3 : c >= 0xC2 ? 2 : 0;
    p->pos--; /* errors point at the lead byte */
    if (len == 0 || p->len - p->pos < len) jfail(p, "invalid UTF-8 in string");
    enc[0] = c;
    for (size_t i = 1; i < len; i++) {
        enc[i] = (unsigned char)p->s[p->pos + i];
        if ((enc[i] & 0xC0) != 0x80) jfail(p, "invalid UTF-8 in string");
    }
    if ((len == 3 && c == 0xE0 && enc[1] < 0xA0) || (len == 3 && c == 0xED && enc[1] >= 0xA0) ||
        (len == 4 && c == 0xF0 && enc[1] < 0x90) || (len == 4 && c == 0xF4 && enc[1] >= 0x90))
        jfail(p, "invalid UTF-8 in string");
    p->pos += len;
    return len;
}

/* Code point cp (1..U+10FFFF, no surrogate) as UTF-8 into enc; its length. */
static size_t utf8_encode(unsigned cp, unsigned char enc[4]) {
    if (cp < 0x80) {
        enc[0] = (unsigned char)cp;
        return 1;
    }
    if (cp < 0x800) {
        enc[0] = (unsigned char)(0xC0 | cp >> 6);
        enc[1] = (unsigned char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        enc[0] = (unsigned char)(0xE0 | cp >> 12);
        enc[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        enc[2] = (unsigned char)(0x80 | (cp & 0x3F));
        return 3;
    }
    enc[0] = (unsigned char)(0xF0 | cp >> 18);
    enc[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
    enc[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
    enc[3] = (unsigned char)(0x80 | (cp & 0x3F));
    return 4;
}

/* One escape after its backslash (\" \\ \/ \b \f \n \r \t \uXXXX, a
 * surrogate pair as two \u) as UTF-8 into enc; its length. */
static size_t jescape(JParser *p, unsigned char enc[4]) {
    if (p->pos >= p->len) jfail(p, "unterminated string");
    char e = p->s[p->pos++];
    switch (e) {
    case '"': enc[0] = '"'; return 1;
    case '\\': enc[0] = '\\'; return 1;
    case '/': enc[0] = '/'; return 1;
    case 'b': enc[0] = '\b'; return 1;
    case 'f': enc[0] = '\f'; return 1;
    case 'n': enc[0] = '\n'; return 1;
    case 'r': enc[0] = '\r'; return 1;
    case 't': enc[0] = '\t'; return 1;
    case 'u': break;
    default: p->pos--; jfail(p, "bad escape in string");
    }
    unsigned cp = jhex4(p);
    if (cp >= 0xD800 && cp <= 0xDBFF) {
        if (p->len - p->pos < 6 || p->s[p->pos] != '\\' || p->s[p->pos + 1] != 'u')
            jfail(p, "unpaired surrogate in \\u escape");
        p->pos += 2;
        unsigned lo = jhex4(p);
        if (lo < 0xDC00 || lo > 0xDFFF) jfail(p, "unpaired surrogate in \\u escape");
        cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
    } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
        jfail(p, "unpaired surrogate in \\u escape");
    }
    if (cp == 0) jfail(p, "\\u0000 in string");
    return utf8_encode(cp, enc);
}

static char *jstring(JParser *p) {
    if (jpeek(p) != '"') jfail(p, "expected a string");
    p->pos++;
    size_t cap = 16, k = 0;
    char *out = xmalloc(cap);
    for (;;) {
        if (p->pos >= p->len) jfail(p, "unterminated string");
        unsigned char c = (unsigned char)p->s[p->pos++];
        unsigned char enc[4] = {c};
        size_t ne = 1;
        if (c == '"') break;
        if (c < 0x20) {
            p->pos--;
            jfail(p, "control character in string");
        }
        if (c >= 0x80) ne = jutf8(p, c, enc);
        else if (c == '\\') ne = jescape(p, enc);
        if (k + ne + 1 > cap) {
            cap = 2 * cap + ne;
            out = xrealloc(out, cap);
        }
        memcpy(out + k, enc, ne);
        k += ne;
    }
    out[k] = 0;
    return out;
}

static void jnumber(JParser *p, JVal *v) {
    size_t start = p->pos;
    int neg = 0, integral = 1;
    if (jpeek(p) == '-') {
        neg = 1;
        p->pos++;
    }
    if (jpeek(p) == '0') {
        p->pos++;
    } else if (jpeek(p) >= '1' && jpeek(p) <= '9') {
        while (jpeek(p) >= '0' && jpeek(p) <= '9') p->pos++;
    } else {
        jfail(p, "bad number");
    }
    size_t int_end = p->pos;
    if (jpeek(p) == '.') {
        integral = 0;
        p->pos++;
        if (!(jpeek(p) >= '0' && jpeek(p) <= '9')) jfail(p, "bad number");
        while (jpeek(p) >= '0' && jpeek(p) <= '9') p->pos++;
    }
    if (jpeek(p) == 'e' || jpeek(p) == 'E') {
        integral = 0;
        p->pos++;
        if (jpeek(p) == '+' || jpeek(p) == '-') p->pos++;
        if (!(jpeek(p) >= '0' && jpeek(p) <= '9')) jfail(p, "bad number");
        while (jpeek(p) >= '0' && jpeek(p) <= '9') p->pos++;
    }
    v->type = J_NUM;
    v->is_uint = 0;
    if (!neg && integral) {
        uint64_t u = 0;
        int ok = 1;
        for (size_t i = start; i < int_end; i++) {
            uint64_t d = (uint64_t)(p->s[i] - '0');
            if (u > (UINT64_MAX - d) / 10) {
                ok = 0;
                break;
            }
            u = u * 10 + d;
        }
        v->is_uint = ok;
        v->u = u;
    }
}

static int jliteral(JParser *p, const char *word) {
    size_t n = strlen(word);
    if (p->len - p->pos >= n && !memcmp(p->s + p->pos, word, n)) {
        p->pos += n;
        return 1;
    }
    return 0;
}

static void jvalue(JParser *p, JVal *v) {
    memset(v, 0, sizeof *v);
    jws(p);
    int c = jpeek(p);
    if (c == '{' || c == '[') {
        if (++p->depth > JSON_MAX_DEPTH) jfail(p, "nesting too deep");
        int obj = c == '{';
        v->type = obj ? J_OBJ : J_ARR;
        p->pos++;
        size_t cap = 0;
        jws(p);
        if (jpeek(p) == (obj ? '}' : ']')) {
            p->pos++;
            p->depth--;
            return;
        }
        for (;;) {
            if (v->n == cap) {
                cap = cap ? 2 * cap : 8;
                v->items = xrealloc(v->items, cap * sizeof(JVal));
                if (obj) v->keys = xrealloc(v->keys, cap * sizeof(char *));
            }
            if (obj) {
                jws(p);
                size_t key_at = p->pos;
                char *key = jstring(p);
                for (const char *q = key; *q; q++)
                    if ((unsigned char)*q < 0x20 || *q == 0x7f) {
                        p->pos = key_at;
                        jfail(p, "control character in a key");
                    }
                for (size_t i = 0; i < v->n; i++)
                    if (!strcmp(v->keys[i], key)) {
                        p->pos = key_at;
                        char what[160];
                        snprintf(what, sizeof what, "duplicate key '%.100s'", key);
                        jfail(p, what);
                    }
                v->keys[v->n] = key;
                jws(p);
                if (jpeek(p) != ':') jfail(p, "expected ':'");
                p->pos++;
            }
            jvalue(p, &v->items[v->n]);
            v->n++;
            jws(p);
            if (jpeek(p) == ',') {
                p->pos++;
                continue;
            }
            if (jpeek(p) == (obj ? '}' : ']')) {
                p->pos++;
                break;
            }
            jfail(p, obj ? "expected ',' or '}'" : "expected ',' or ']'");
        }
        p->depth--;
    } else if (c == '"') {
        v->type = J_STR;
        v->str = jstring(p);
    } else if (c == '-' || (c >= '0' && c <= '9')) {
        jnumber(p, v);
    } else if (jliteral(p, "true") || jliteral(p, "false")) {
        v->type = J_BOOL;
    } else if (jliteral(p, "null")) {
        v->type = J_NULL;
    } else {
        jfail(p, c < 0 ? "unexpected end" : "unexpected character");
    }
}

static JVal json_parse(const char *text, size_t len, const char *path) {
    JParser p = {text, len, 0, path, 0};
    JVal v;
    jvalue(&p, &v);
    jws(&p);
    if (p.pos != p.len) jfail(&p, "trailing characters after the header object");
    return v;
}

static const JVal *jget(const JVal *obj, const char *key) {
    for (size_t i = 0; i < obj->n; i++)
        if (!strcmp(obj->keys[i], key)) return &obj->items[i];
    return NULL;
}

/* ---------------------------------------------------------------- helpers */

static void format_dims(char *buf, size_t cap, const size_t *shape, int ndim) {
    size_t k = 0;
    buf[0] = 0;
    k += (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < ndim && k < cap; i++) k += (size_t)snprintf(buf + k, cap - k, i ? ", %zu" : "%zu", shape[i]);
    if (k < cap) snprintf(buf + k, cap - k, "]");
}

static uint64_t rd_u64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

typedef struct {
    size_t begin, end;
    int index;
} Span;

static int span_cmp(const void *a, const void *b) {
    const Span *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return x->index - y->index;
}

/* ------------------------------------------------------------------ read */

/* The header's "__metadata__" object (string values only) into f. */
static void read_metadata(StFile *f, const JVal *e, const char *path) {
    if (e->type != J_OBJ) fatal("%s: __metadata__ is not a JSON object", path);
    for (size_t i = 0; i < e->n; i++)
        if (e->items[i].type != J_STR) fatal("%s: __metadata__ value '%s' is not a string", path, e->keys[i]);
    f->n_meta = (int)e->n;
    f->meta_keys = xcalloc(e->n ? e->n : 1, sizeof(char *));
    f->meta_values = xcalloc(e->n ? e->n : 1, sizeof(char *));
    for (size_t i = 0; i < e->n; i++) {
        f->meta_keys[i] = xstrdup(e->keys[i]);
        f->meta_values[i] = xstrdup(e->items[i].str);
    }
}

/* One tensor entry {dtype: "F32", shape: [...], data_offsets: [b, e]} into t
 * (name, ndim, shape, numel; data is set once the data section is placed) and
 * its byte span in the data section (data_size bytes), every field checked. */
static void read_tensor_entry(StTensor *t, Span *span, const char *name, const JVal *e, size_t data_size,
                              const char *path) {
    if (e->type != J_OBJ) fatal("%s: tensor '%s' is not a JSON object", path, name);
    const JVal *dtype = jget(e, "dtype"), *shape = jget(e, "shape"), *offs = jget(e, "data_offsets");
    if (!dtype) fatal("%s: tensor '%s' has no dtype", path, name);
    if (!shape) fatal("%s: tensor '%s' has no shape", path, name);
    if (!offs) fatal("%s: tensor '%s' has no data_offsets", path, name);
    if (dtype->type != J_STR) fatal("%s: tensor '%s' has a dtype that is not a string", path, name);
    if (strcmp(dtype->str, "F32") != 0)
        fatal("%s: tensor '%s' has dtype %s, only F32 is supported", path, name, dtype->str);
    if (shape->type != J_ARR) fatal("%s: tensor '%s' has a shape that is not a list", path, name);
    if (shape->n > 4) fatal("%s: tensor '%s' has %zu dimensions, at most 4 are supported", path, name, shape->n);
    t->ndim = (int)shape->n;
    size_t numel = 1;
    int too_big = 0;
    for (size_t i = 0; i < shape->n; i++) {
        const JVal *d = &shape->items[i];
        if (d->type != J_NUM || !d->is_uint || d->u > (uint64_t)SIZE_MAX)
            fatal("%s: tensor '%s' has a shape entry that is not a non-negative integer", path, name);
        t->shape[i] = (size_t)d->u;
        if (t->shape[i] != 0 && numel > SIZE_MAX / 4 / t->shape[i]) too_big = 1;
        else numel *= t->shape[i];
    }
    char dims[160];
    format_dims(dims, sizeof dims, t->shape, t->ndim);
    if (too_big) fatal("%s: tensor '%s' shape %s is too large", path, name, dims);
    if (offs->type != J_ARR || offs->n != 2 || offs->items[0].type != J_NUM || !offs->items[0].is_uint ||
        offs->items[1].type != J_NUM || !offs->items[1].is_uint)
        fatal("%s: tensor '%s' has data_offsets that are not a pair of non-negative integers", path, name);
    uint64_t b = offs->items[0].u, en = offs->items[1].u;
    if (b > en)
        fatal("%s: tensor '%s' has data_offsets [%llu, %llu] with begin after end", path, name,
              (unsigned long long)b, (unsigned long long)en);
    if (en > (uint64_t)data_size)
        fatal("%s: tensor '%s' has data_offsets [%llu, %llu] outside the data section (%zu bytes)", path, name,
              (unsigned long long)b, (unsigned long long)en, data_size);
    if (en - b != (uint64_t)numel * 4)
        fatal("%s: tensor '%s' has shape %s (%zu bytes of F32) but data_offsets [%llu, %llu] span %llu bytes",
              path, name, dims, numel * 4, (unsigned long long)b, (unsigned long long)en,
              (unsigned long long)(en - b));
    if (b % 4 != 0) fatal("%s: tensor '%s' data offset %llu is not a multiple of 4", path, name, (unsigned long long)b);
    t->name = xstrdup(name);
    t->numel = numel;
    span->begin = (size_t)b;
    span->end = (size_t)en;
}

/* No two tensors' bytes overlap: sort the spans by begin; empty tensors
 * occupy nothing. Sorts spans. */
static void check_no_overlap(const StFile *f, Span *spans, const char *path) {
    qsort(spans, (size_t)f->n, sizeof(Span), span_cmp);
    int prev = -1;
    for (int i = 0; i < f->n; i++) {
        if (spans[i].begin == spans[i].end) continue;
        if (prev >= 0 && spans[i].begin < spans[prev].end) {
            const Span *a = &spans[prev], *b = &spans[i];
            fatal("%s: tensors '%s' and '%s' overlap (data_offsets [%zu, %zu] and [%zu, %zu])", path,
                  f->tensors[a->index].name, f->tensors[b->index].name, a->begin, a->end, b->begin, b->end);
        }
        if (prev < 0 || spans[i].end > spans[prev].end) prev = i;
    }
}

StFile st_read(const char *path) {
    size_t bytes = 0;
    unsigned char *buf = read_file_all(path, &bytes);
    if (bytes < 8)
        fatal("%s: file is %zu bytes, too short for a safetensors file (needs an 8-byte header length)", path,
              bytes);
    uint64_t hlen64 = rd_u64(buf);
    if (hlen64 > (uint64_t)(bytes - 8))
        fatal("%s: header length %llu is larger than the file (%zu bytes after the 8-byte length)", path,
              (unsigned long long)hlen64, bytes - 8);
    size_t hlen = (size_t)hlen64;
    size_t data_start = 8 + hlen, data_size = bytes - data_start;

    JVal root = json_parse((const char *)buf + 8, hlen, path);
    if (root.type != J_OBJ) fatal("%s: header is not a JSON object", path);

    StFile f;
    memset(&f, 0, sizeof f);
    f.tensors = xcalloc(root.n ? root.n : 1, sizeof(StTensor));
    Span *spans = xcalloc(root.n ? root.n : 1, sizeof(Span));
    for (size_t k = 0; k < root.n; k++) {
        if (!strcmp(root.keys[k], "__metadata__")) {
            read_metadata(&f, &root.items[k], path);
            continue;
        }
        read_tensor_entry(&f.tensors[f.n], &spans[f.n], root.keys[k], &root.items[k], data_size, path);
        spans[f.n].index = f.n;
        f.n++;
    }
    check_no_overlap(&f, spans, path);
    jfree(&root);

    /* floats must be 4-byte aligned: the buffer is malloc-aligned, so move the
     * data section down over the (already parsed) header if needed */
    size_t aligned = data_start & ~(size_t)3;
    if (aligned != data_start) memmove(buf + aligned, buf + data_start, data_size);
    for (int i = 0; i < f.n; i++) f.tensors[spans[i].index].data = (float *)(void *)(buf + aligned + spans[i].begin);
    free(spans);
    f.buffer = buf;
    return f;
}

const StTensor *st_get(const StFile *f, const char *name, const char *path) {
    for (int i = 0; i < f->n; i++)
        if (!strcmp(f->tensors[i].name, name)) return &f->tensors[i];
    fatal("tensor '%s' missing from %s", name, path);
}

void st_expect_shape(const StTensor *t, int ndim, const size_t *shape, const char *path) {
    int same = t->ndim == ndim;
    for (int i = 0; same && i < ndim; i++) same = t->shape[i] == shape[i];
    if (!same) {
        char have[160], want[160];
        format_dims(have, sizeof have, t->shape, t->ndim);
        format_dims(want, sizeof want, shape, ndim);
        fatal("tensor '%s' in %s has shape %s, expected %s", t->name, path, have, want);
    }
}

const char *st_meta(const StFile *f, const char *key) {
    for (int i = 0; i < f->n_meta; i++)
        if (!strcmp(f->meta_keys[i], key)) return f->meta_values[i];
    return NULL;
}

int st_has(const StFile *f, const char *name) {
    for (int i = 0; i < f->n; i++)
        if (!strcmp(f->tensors[i].name, name)) return 1;
    return 0;
}

void st_free(StFile *f) {
    for (int i = 0; i < f->n_meta; i++) {
        free(f->meta_keys[i]);
        free(f->meta_values[i]);
    }
    free(f->meta_keys);
    free(f->meta_values);
    for (int i = 0; i < f->n; i++) free(f->tensors[i].name);
    free(f->tensors);
    free(f->buffer);
    memset(f, 0, sizeof *f);
}

/* ----------------------------------------------------------------- write */

void st_write(const char *path, const StTensor *t, int n, const char *metadata_json) {
    Json h = {0};
    size_t offset = 0;
    json_object_begin(&h);
    if (metadata_json && metadata_json[0]) {
        json_key(&h, "__metadata__");
        json_object_begin(&h);
        json_members(&h, metadata_json);
        json_object_end(&h);
    }
    for (int i = 0; i < n; i++) {
        if (!t[i].name || !t[i].name[0]) fatal("st_write %s: tensor %d has no name", path, i);
        if (!strcmp(t[i].name, "__metadata__")) fatal("st_write %s: a tensor cannot be called __metadata__", path);
        for (int j = 0; j < i; j++)
            if (!strcmp(t[i].name, t[j].name)) fatal("st_write %s: tensor '%s' appears twice", path, t[i].name);
        if (t[i].ndim < 0 || t[i].ndim > 4)
            fatal("st_write %s: tensor '%s' has %d dimensions (0..4 supported)", path, t[i].name, t[i].ndim);
        size_t numel = 1;
        for (int d = 0; d < t[i].ndim; d++) numel *= t[i].shape[d];
        if (numel != t[i].numel)
            fatal("st_write %s: tensor '%s' numel %zu does not match its shape", path, t[i].name, t[i].numel);
        if (numel && !t[i].data) fatal("st_write %s: tensor '%s' has no data", path, t[i].name);
        json_key(&h, t[i].name);
        json_object_begin(&h);
        json_key(&h, "dtype");
        json_string(&h, "F32");
        json_key(&h, "shape");
        json_array_begin(&h);
        for (int d = 0; d < t[i].ndim; d++) json_uint(&h, t[i].shape[d]);
        json_array_end(&h);
        json_key(&h, "data_offsets");
        json_array_begin(&h);
        json_uint(&h, offset);
        json_uint(&h, offset + numel * 4);
        json_array_end(&h);
        json_object_end(&h);
        offset += numel * 4;
    }
    json_object_end(&h);
    /* the caller's metadata must keep the header valid */
    JVal check = json_parse(json_text(&h), json_len(&h), path);
    const JVal *meta = jget(&check, "__metadata__");
    if (meta && meta->type != J_OBJ) fatal("st_write %s: bad metadata", path);
    for (size_t i = 0; meta && i < meta->n; i++)
        if (meta->items[i].type != J_STR) fatal("st_write %s: metadata value '%s' is not a string", path, meta->keys[i]);
    jfree(&check);
    size_t header = (json_len(&h) + 7) / 8 * 8; /* padded with spaces to 8 bytes: the data stay aligned */

    size_t total = 8 + header + offset;
    unsigned char *out = xmalloc(total);
    for (int i = 0; i < 8; i++) out[i] = (unsigned char)((uint64_t)header >> (8 * i));
    memcpy(out + 8, json_text(&h), json_len(&h));
    memset(out + 8 + json_len(&h), ' ', header - json_len(&h));
    size_t pos = 8 + header;
    for (int i = 0; i < n; i++) {
        if (t[i].numel) memcpy(out + pos, t[i].data, t[i].numel * sizeof(float));
        pos += t[i].numel * sizeof(float);
    }
    write_file_atomic(path, out, total);
    free(out);
    json_free(&h);
}
