/* data.c — token files (.npy or byte-level text) and the batch order contract. */
#include "model/data.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/util.h"

static const char NPY_MAGIC[6] = {'\x93', 'N', 'U', 'M', 'P', 'Y'};

static const char *data_name(const TokenData *d) { return d->path ? d->path : "the token data"; }

/* ------------------------------------------------------------ .npy header */

/* A cursor over the header text, a Python dict literal such as
 * {'descr': '<u2', 'fortran_order': False, 'shape': (300,), }            */
typedef struct {
    const char *s;
    size_t len, pos;
    const char *path;
} Hdr;

static void hdr_fail(const Hdr *h, const char *what) {
    fatal("%s: malformed .npy header (%s at header byte %zu)", h->path, what, h->pos);
}

static void hdr_ws(Hdr *h) {
    while (h->pos < h->len && (h->s[h->pos] == ' ' || h->s[h->pos] == '\t' || h->s[h->pos] == '\n' ||
                               h->s[h->pos] == '\r'))
        h->pos++;
}

static int hdr_peek(const Hdr *h) { return h->pos < h->len ? (unsigned char)h->s[h->pos] : -1; }

static void hdr_expect(Hdr *h, char c) {
    hdr_ws(h);
    if (hdr_peek(h) != (unsigned char)c) {
        char what[32];
        snprintf(what, sizeof what, "expected '%c'", c);
        hdr_fail(h, what);
    }
    h->pos++;
}

/* A quoted string ('...' or "...", no escapes needed for the keys and
 * dtypes numpy writes) into out[cap]. */
static void hdr_string(Hdr *h, char *out, size_t cap) {
    hdr_ws(h);
    int q = hdr_peek(h);
    if (q != '\'' && q != '"') hdr_fail(h, "expected a quoted string");
    h->pos++;
    size_t k = 0;
    while (h->pos < h->len && h->s[h->pos] != (char)q) {
        char c = h->s[h->pos];
        if (c == '\\' || c < 0x20 || c > 0x7e || k + 1 >= cap) hdr_fail(h, "unexpected string");
        out[k++] = h->s[h->pos++];
    }
    if (h->pos >= h->len) hdr_fail(h, "unterminated string");
    h->pos++;
    out[k] = 0;
}

static int hdr_bool(Hdr *h) {
    hdr_ws(h);
    if (h->len - h->pos >= 4 && !memcmp(h->s + h->pos, "True", 4)) {
        h->pos += 4;
        return 1;
    }
    if (h->len - h->pos >= 5 && !memcmp(h->s + h->pos, "False", 5)) {
        h->pos += 5;
        return 0;
    }
    hdr_fail(h, "expected True or False");
    return 0;
}

/* (a, b, ...) of non-negative integers; returns ndim (at most max). */
static int hdr_shape(Hdr *h, size_t *shape, int max) {
    hdr_expect(h, '(');
    int nd = 0;
    for (;;) {
        hdr_ws(h);
        if (hdr_peek(h) == ')') {
            h->pos++;
            return nd;
        }
        if (hdr_peek(h) < '0' || hdr_peek(h) > '9') hdr_fail(h, "expected a dimension");
        size_t v = 0;
        while (hdr_peek(h) >= '0' && hdr_peek(h) <= '9') {
            size_t digit = (size_t)(hdr_peek(h) - '0');
            if (v > (SIZE_MAX - digit) / 10) hdr_fail(h, "dimension too large");
            v = v * 10 + digit;
            h->pos++;
        }
        if (nd >= max) hdr_fail(h, "too many dimensions");
        shape[nd++] = v;
        hdr_ws(h);
        if (hdr_peek(h) == ',') h->pos++;
        else if (hdr_peek(h) != ')') hdr_fail(h, "expected ',' or ')'");
    }
}

typedef struct {
    char descr[16];
    int fortran_order;
    int ndim;
    size_t shape[8];
} NpyHeader;

static NpyHeader parse_npy_header(const char *text, size_t len, const char *path) {
    Hdr h = {text, len, 0, path};
    NpyHeader out;
    memset(&out, 0, sizeof out);
    int have_descr = 0, have_fortran = 0, have_shape = 0;
    hdr_expect(&h, '{');
    for (;;) {
        hdr_ws(&h);
        if (hdr_peek(&h) == '}') {
            h.pos++;
            break;
        }
        char key[32];
        hdr_string(&h, key, sizeof key);
        hdr_expect(&h, ':');
        if (!strcmp(key, "descr") && !have_descr) {
            hdr_string(&h, out.descr, sizeof out.descr);
            have_descr = 1;
        } else if (!strcmp(key, "fortran_order") && !have_fortran) {
            out.fortran_order = hdr_bool(&h);
            have_fortran = 1;
        } else if (!strcmp(key, "shape") && !have_shape) {
            out.ndim = hdr_shape(&h, out.shape, 8);
            have_shape = 1;
        } else if (!strcmp(key, "descr") || !strcmp(key, "fortran_order") || !strcmp(key, "shape")) {
            fatal("%s: malformed .npy header (duplicate key '%s')", path, key);
        } else {
            fatal("%s: malformed .npy header (unexpected key '%s')", path, key);
        }
        hdr_ws(&h);
        if (hdr_peek(&h) == ',') h.pos++;
        else if (hdr_peek(&h) != '}') hdr_fail(&h, "expected ',' or '}'");
    }
    hdr_ws(&h);
    if (h.pos != h.len) hdr_fail(&h, "trailing characters");
    if (!have_descr || !have_fortran || !have_shape)
        fatal("%s: malformed .npy header (missing '%s')", path,
              !have_descr ? "descr" : !have_fortran ? "fortran_order" : "shape");
    return out;
}

static void format_shape(char *buf, size_t cap, const size_t *shape, int nd) {
    size_t k = 0;
    k += (size_t)snprintf(buf + k, cap - k, "(");
    for (int i = 0; i < nd && k < cap; i++)
        k += (size_t)snprintf(buf + k, cap - k, i ? ", %zu" : "%zu", shape[i]);
    if (k < cap) snprintf(buf + k, cap - k, nd == 1 ? ",)" : ")");
}

static uint32_t rd_u16(const unsigned char *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8; }
static uint32_t rd_u32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void load_npy(TokenData *d, const unsigned char *buf, size_t bytes, const char *path) {
    if (bytes < 10) fatal("%s: truncated .npy header (%zu bytes)", path, bytes);
    unsigned major = buf[6], minor = buf[7];
    size_t hlen, hstart;
    if (major == 1 && minor == 0) {
        hlen = rd_u16(buf + 8);
        hstart = 10;
    } else if ((major == 2 || major == 3) && minor == 0) {
        if (bytes < 12) fatal("%s: truncated .npy header (%zu bytes)", path, bytes);
        hlen = rd_u32(buf + 8);
        hstart = 12;
    } else {
        fatal("%s: unsupported .npy format version %u.%u", path, major, minor);
    }
    if (hlen > bytes - hstart)
        fatal("%s: truncated .npy header (header says %zu bytes, file has %zu after the preamble)", path, hlen,
              bytes - hstart);
    NpyHeader h = parse_npy_header((const char *)buf + hstart, hlen, path);

    size_t item;
    if (!strcmp(h.descr, "<u2")) item = 2;
    else if (!strcmp(h.descr, "<i4")) item = 4;
    else fatal("%s: unsupported dtype '%s' (want uint16 or int32 .npy)", path, h.descr);
    char shape[256];
    format_shape(shape, sizeof shape, h.shape, h.ndim);
    if (h.fortran_order && h.ndim > 1)
        fatal("%s: .npy array is in Fortran order; only C order is supported", path);
    if (h.ndim != 1) fatal("%s: .npy array has shape %s; only 1-D token arrays are supported", path, shape);

    size_t n = h.shape[0];
    if (n == 0) fatal("%s: .npy array has no tokens", path);
    if (n > SIZE_MAX / item) fatal("%s: .npy shape %s is too large", path, shape);
    size_t need = n * item, have = bytes - hstart - hlen;
    if (have < need)
        fatal("%s: truncated .npy data: shape %s of '%s' needs %zu bytes, the file has %zu", path, shape, h.descr,
              need, have);
    if (have > need)
        fatal("%s: .npy file has %zu unexpected bytes after the %zu data bytes", path, have - need, need);

    const unsigned char *p = buf + hstart + hlen;
    d->tokens = xmalloc(n * sizeof(int32_t));
    d->n = n;
    for (size_t i = 0; i < n; i++) {
        int32_t t = item == 2 ? (int32_t)rd_u16(p + 2 * i) : (int32_t)rd_u32(p + 4 * i);
        if (t < 0) fatal("%s: negative token %d at index %zu", path, (int)t, i);
        d->tokens[i] = t;
    }
}

/* ----------------------------------------------------------------- API */

TokenData data_load(const char *path) {
    size_t bytes = 0;
    unsigned char *buf = read_file_all(path, &bytes);
    if (bytes == 0) fatal("%s: file is empty (no tokens)", path);
    TokenData d;
    memset(&d, 0, sizeof d);
    if (bytes >= sizeof NPY_MAGIC && !memcmp(buf, NPY_MAGIC, sizeof NPY_MAGIC)) {
        load_npy(&d, buf, bytes, path);
    } else {
        /* byte-level tokenizer: one token per byte */
        d.tokens = xmalloc(bytes * sizeof(int32_t));
        d.n = bytes;
        for (size_t i = 0; i < bytes; i++) d.tokens[i] = buf[i];
    }
    free(buf);
    d.max_token = 0;
    for (size_t i = 0; i < d.n; i++)
        if (d.tokens[i] > d.max_token) d.max_token = d.tokens[i];
    d.path = xstrdup(path);
    return d;
}

void data_free(TokenData *d) {
    free(d->tokens);
    free(d->path);
    memset(d, 0, sizeof *d);
}

void data_check(const TokenData *d, size_t T, int vocab_size) {
    if (T == 0) fatal("seq-len must be at least 1");
    if (vocab_size <= 0) fatal("vocab-size must be positive (got %d)", vocab_size);
    if (T > SIZE_MAX - 2 || d->n < T + 2)
        fatal("seq-len %zu needs at least %zu tokens but %s has %zu", T, T + 2, data_name(d), d->n);
    if (d->max_token >= vocab_size) {
        for (size_t i = 0; i < d->n; i++)
            if (d->tokens[i] >= vocab_size)
                fatal("%s: token %d at index %zu is outside the vocabulary (vocab-size %d)", data_name(d),
                      (int)d->tokens[i], i, vocab_size);
    }
}

void data_batch(const TokenData *d, int step, int rank, int world, size_t B, size_t T, int32_t *inputs,
                int32_t *targets) {
    if (step < 0 || world <= 0 || rank < 0 || rank >= world)
        fatal("data_batch: bad step %d / rank %d / world %d", step, rank, world);
    if (T == 0 || T > SIZE_MAX - 2 || d->n < T + 2)
        fatal("seq-len %zu needs at least %zu tokens but %s has %zu", T, T + 2, data_name(d), d->n);
    /* start = ((s*W + r)*B + i) * T  mod  (n - T - 1), exactly: reduced modulo span
     * after each product in 128 bits (the plain 64-bit product wraps once
     * s*W*B*T reaches 2^64, and then silently picks other tokens) */
    __extension__ typedef unsigned __int128 u128;
    const uint64_t span = (uint64_t)(d->n - T - 1);
    const uint64_t sample0 = (uint64_t)((((u128)step * (uint64_t)world + (uint64_t)rank) % span) * B % span);
    for (size_t i = 0; i < B; i++) {
        uint64_t start = (uint64_t)(((sample0 + (u128)i) % span) * T % span);
        const int32_t *src = d->tokens + (size_t)start;
        memcpy(inputs + i * T, src, T * sizeof(int32_t));
        memcpy(targets + i * T, src + 1, T * sizeof(int32_t));
    }
}

void data_save_npy(const char *path, const int32_t *tokens, size_t n) {
    /* numpy.save's format 1.0 layout: magic, version, u16 header length, a
     * dict literal padded with spaces (room to grow the shape) and '\n' so the
     * data starts at a multiple of 64 bytes. */
    char dict[256];
    int k = snprintf(dict, sizeof dict, "{'descr': '<i4', 'fortran_order': False, 'shape': (%zu,), }", n);
    char digits[32];
    int nd = snprintf(digits, sizeof digits, "%zu", n);
    size_t dlen = (size_t)k;
    for (int i = nd; i < 21; i++) dict[dlen++] = ' '; /* numpy's GROWTH_AXIS_MAX_DIGITS = 21 */
    size_t hlen = dlen + 1;                            /* + '\n' */
    size_t pad = 64 - (10 + hlen) % 64;
    hlen += pad;
    if (n > (SIZE_MAX - 10 - hlen) / 4) fatal("data_save_npy: %zu tokens is too many", n);
    size_t total = 10 + hlen + n * 4;
    unsigned char *out = xmalloc(total);
    memcpy(out, NPY_MAGIC, 6);
    out[6] = 1;
    out[7] = 0;
    out[8] = (unsigned char)(hlen & 0xff);
    out[9] = (unsigned char)(hlen >> 8);
    memcpy(out + 10, dict, dlen);
    memset(out + 10 + dlen, ' ', pad);
    out[10 + hlen - 1] = '\n';
    unsigned char *p = out + 10 + hlen;
    for (size_t i = 0; i < n; i++) {
        uint32_t v = (uint32_t)tokens[i];
        p[4 * i] = (unsigned char)v;
        p[4 * i + 1] = (unsigned char)(v >> 8);
        p[4 * i + 2] = (unsigned char)(v >> 16);
        p[4 * i + 3] = (unsigned char)(v >> 24);
    }
    write_file_atomic(path, out, total);
    free(out);
}
