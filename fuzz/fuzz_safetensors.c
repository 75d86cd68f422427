/* fuzz_safetensors.c — libFuzzer target for the safetensors reader (common/model/safetensors.c).
 *
 * Every input must end in exactly one of:
 *   - a clean fatal() (one line): bad input, reported;
 *   - a file that reads, and then is consistent: every tensor's data lies in
 *     the file and is float-aligned, st_get / st_has / st_meta find what the
 *     reader listed, every name is valid UTF-8, and writing it back with
 *     st_write and reading that again gives the same names, shapes, bits
 *     and metadata (a silent wrong result would show up here).
 * A crash, a sanitizer report, a leak or a fatal() during the checks is a finding.
 *   make fuzz-build && build-fuzz/fuzz_safetensors fuzz/corpus/safetensors */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define FUZZ_TARGET "fuzz_safetensors"
#include "fuzz_support.h"
#include "model/safetensors.h"

/* Strict UTF-8 (no overlongs, no surrogates, nothing above U+10FFFF). */
static int valid_utf8(const char *s) {
    const unsigned char *p = (const unsigned char *)s;
    while (*p) {
        unsigned c = *p;
        size_t n;
        unsigned cp;
        if (c < 0x80) {
            p++;
            continue;
        }
        if (c >= 0xC2 && c <= 0xDF) n = 1, cp = c & 0x1F;
        else if (c >= 0xE0 && c <= 0xEF) n = 2, cp = c & 0x0F;
        else if (c >= 0xF0 && c <= 0xF4) n = 3, cp = c & 0x07;
        else return 0;
        for (size_t i = 1; i <= n; i++) {
            if ((p[i] & 0xC0) != 0x80) return 0;
            cp = cp << 6 | (p[i] & 0x3F);
        }
        if ((n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000) || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            return 0;
        p += n + 1;
    }
    return 1;
}

/* Appends to a growing string: raw text, or s as a JSON string. */
static void put_raw(char **buf, size_t *len, size_t *cap, const char *s) {
    size_t n = strlen(s);
    if (*len + n + 1 > *cap) {
        *cap = 2 * (*len + n + 1);
        *buf = xrealloc(*buf, *cap);
    }
    memcpy(*buf + *len, s, n + 1);
    *len += n;
}

static void put_json_string(char **buf, size_t *len, size_t *cap, const char *s) {
    size_t need = *len + 6 * strlen(s) + 4;
    if (need > *cap) {
        *cap = 2 * need;
        *buf = xrealloc(*buf, *cap);
    }
    char *o = *buf + *len;
    *o++ = '"';
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') {
            *o++ = '\\';
            *o++ = (char)*p;
        } else if (*p < 0x20) {
            o += sprintf(o, "\\u%04x", *p);
        } else {
            *o++ = (char)*p;
        }
    }
    *o++ = '"';
    *o = 0;
    *len = (size_t)(o - *buf);
}

static void check_file(const StFile *f, size_t size) {
    const char *buf = f->buffer;
    for (int i = 0; i < f->n; i++) {
        const StTensor *t = &f->tensors[i];
        CHECK(t->name && valid_utf8(t->name), "tensor %d has a name that is not UTF-8", i);
        CHECK(t->ndim >= 0 && t->ndim <= 4, "tensor '%s' ndim %d", t->name, t->ndim);
        size_t numel = 1;
        for (int d = 0; d < t->ndim; d++) numel *= t->shape[d];
        CHECK(numel == t->numel, "tensor '%s' numel %zu, shape says %zu", t->name, t->numel, numel);
        CHECK(((uintptr_t)t->data & 3) == 0, "tensor '%s' data is not float-aligned", t->name);
        /* inside the file's bytes (the buffer holds the file, data moved down by < 4) */
        CHECK((const char *)t->data >= buf && (const char *)t->data + 4 * t->numel <= buf + size,
              "tensor '%s' data outside the file", t->name);
        uint32_t acc = 0;
        for (size_t k = 0; k < t->numel; k++) {
            uint32_t bits;
            memcpy(&bits, &t->data[k], 4);
            acc ^= bits;
        }
        (void)acc;
        CHECK(st_get(f, t->name, "input") == t, "st_get('%s') finds another tensor", t->name);
        CHECK(st_has(f, t->name), "st_has('%s') is 0", t->name);
        for (int j = 0; j < i; j++) CHECK(strcmp(f->tensors[j].name, t->name) != 0, "'%s' listed twice", t->name);
        CHECK(strcmp(t->name, "__metadata__") != 0, "a tensor called __metadata__");
    }
    for (int i = 0; i < f->n_meta; i++) {
        CHECK(valid_utf8(f->meta_keys[i]) && valid_utf8(f->meta_values[i]), "metadata %d is not UTF-8", i);
        CHECK(st_meta(f, f->meta_keys[i]) == f->meta_values[i], "st_meta('%s') finds another value",
              f->meta_keys[i]);
    }
}

/* Write the file back and read it again: the same tensors and metadata, bit for bit. */
static void round_trip(const StFile *f) {
    for (int i = 0; i < f->n; i++)
        if (!f->tensors[i].name[0]) return; /* the reader allows an empty name, st_write does not */
    char *meta = NULL;
    size_t len = 0, cap = 0;
    for (int i = 0; i < f->n_meta; i++) {
        if (i) put_raw(&meta, &len, &cap, ",");
        put_json_string(&meta, &len, &cap, f->meta_keys[i]);
        put_raw(&meta, &len, &cap, ":");
        put_json_string(&meta, &len, &cap, f->meta_values[i]);
    }
    const char *path = fuzz_scratch("round_trip.safetensors");
    st_write(path, f->tensors, f->n, meta);
    StFile g = st_read(path);
    CHECK(g.n == f->n, "round trip: %d tensors, wrote %d", g.n, f->n);
    for (int i = 0; i < f->n; i++) {
        const StTensor *a = &f->tensors[i], *b = &g.tensors[i];
        CHECK(!strcmp(a->name, b->name), "round trip: tensor %d '%s' came back as '%s'", i, a->name, b->name);
        CHECK(a->ndim == b->ndim && !memcmp(a->shape, b->shape, sizeof(size_t) * (size_t)a->ndim),
              "round trip: '%s' changed shape", a->name);
        CHECK(a->numel == b->numel && (a->numel == 0 || !memcmp(a->data, b->data, 4 * a->numel)),
              "round trip: '%s' changed data", a->name);
    }
    CHECK(g.n_meta == f->n_meta, "round trip: %d metadata entries, wrote %d", g.n_meta, f->n_meta);
    for (int i = 0; i < f->n_meta; i++) {
        const char *v = st_meta(&g, f->meta_keys[i]);
        CHECK(v && !strcmp(v, f->meta_values[i]), "round trip: metadata '%s' changed", f->meta_keys[i]);
    }
    st_free(&g);
    free(meta);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *path = fuzz_input_file(data, size);
    volatile int clean = 0; /* read after a longjmp */
    if (FUZZ_TRY()) {
        StFile f = st_read(path);
        fuzz_no_fatal_from_here();
        check_file(&f, size);
        round_trip(&f);
        st_free(&f);
        clean = 1;
    }
    fuzz_end(clean, "st_read");
    return 0;
}
