/* json.c — the JSON writer (json.h). */
#include "runtime/json.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/util.h"

#define JSON_INITIAL_CAP 256

static void reserve(Json *j, size_t more) {
    j->p = xgrow(j->p, &j->cap, j->len + more + 1, JSON_INITIAL_CAP); /* +1: the text stays NUL-terminated */
}

static void put(Json *j, const char *s, size_t n) {
    reserve(j, n);
    memcpy(j->p + j->len, s, n);
    j->len += n;
    j->p[j->len] = 0;
}

static void put_char(Json *j, char c) { put(j, &c, 1); }

/* Formatted straight into the buffer (numbers: one vsnprintf); longer text
 * than the room left is formatted again once the buffer has grown. */
static void put_vfmt(Json *j, const char *fmt, va_list ap) {
    va_list again;
    va_copy(again, ap);
    reserve(j, 32);
    size_t room = j->cap - j->len;
    int n = vsnprintf(j->p + j->len, room, fmt, ap);
    if (n < 0) fatal("json: formatting '%s' failed", fmt);
    if ((size_t)n >= room) {
        reserve(j, (size_t)n);
        vsnprintf(j->p + j->len, (size_t)n + 1, fmt, again);
    }
    va_end(again);
    j->len += (size_t)n;
}

static void put_fmt(Json *j, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put_fmt(Json *j, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    put_vfmt(j, fmt, ap);
    va_end(ap);
}

/* Before any value: the comma (and newline) that separates it from the item
 * before; an object's value must follow its key. */
static void before_value(Json *j) {
    if (j->after_key) {
        j->after_key = 0;
        return;
    }
    if (!j->depth) return;
    if (j->level[j->depth - 1].close != ']') fatal("json: a value inside an object needs its key first");
    if (j->level[j->depth - 1].items++) put_char(j, ',');
    if (j->level[j->depth - 1].lines) put_char(j, '\n');
}

static void open_level(Json *j, char open, char close, int lines) {
    if (j->depth == JSON_WRITE_MAX_DEPTH) fatal("json: more than %d nested objects and arrays", JSON_WRITE_MAX_DEPTH);
    if (open) {
        before_value(j);
        put_char(j, open);
    }
    j->level[j->depth].items = 0;
    j->level[j->depth].close = close;
    j->level[j->depth].lines = lines;
    j->depth++;
}

static void close_level(Json *j, char close) {
    if (!j->depth || j->level[j->depth - 1].close != close || j->after_key)
        fatal("json: %s does not close what is open",
              close == '}' ? "json_object_end" : close == ']' ? "json_array_end" : "json_members_end");
    j->depth--;
    if (j->level[j->depth].lines) put_char(j, '\n');
    if (close) put_char(j, close);
}

void json_object_begin(Json *j) { open_level(j, '{', '}', 0); }
void json_object_end(Json *j) { close_level(j, '}'); }
void json_array_begin(Json *j) { open_level(j, '[', ']', 0); }
void json_array_begin_lines(Json *j) { open_level(j, '[', ']', 1); }
void json_array_end(Json *j) { close_level(j, ']'); }

/* In an object: a comma before every member but the first. */
static void before_member(Json *j) {
    char close = j->depth ? j->level[j->depth - 1].close : ']';
    if (close == ']' || j->after_key) fatal("json: a key outside an object, or after another key");
    if (j->level[j->depth - 1].items++) put_char(j, ',');
}

static void put_string(Json *j, const char *s) {
    put_char(j, '"');
    const char *run = s ? s : ""; /* copy runs of plain bytes at once */
    for (const char *c = run;; c++) {
        unsigned char u = (unsigned char)*c;
        if (u && u != '"' && u != '\\' && u >= 0x20) continue;
        put(j, run, (size_t)(c - run));
        if (!u) break;
        if (u == '"' || u == '\\') {
            char esc[2] = {'\\', (char)u};
            put(j, esc, 2);
        } else {
            put_fmt(j, "\\u%04x", u);
        }
        run = c + 1;
    }
    put_char(j, '"');
}

void json_key(Json *j, const char *key) {
    before_member(j);
    put_string(j, key);
    put_char(j, ':');
    j->after_key = 1;
}

void json_string(Json *j, const char *s) {
    before_value(j);
    put_string(j, s);
}

void json_stringf(Json *j, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char *s = xvasprintf(fmt, ap);
    va_end(ap);
    json_string(j, s);
    free(s);
}

void json_int(Json *j, long long v) {
    before_value(j);
    put_fmt(j, "%lld", v);
}

void json_key_string(Json *j, const char *key, const char *s) {
    json_key(j, key);
    json_string(j, s);
}

void json_key_int(Json *j, const char *key, long long v) {
    json_key(j, key);
    json_int(j, v);
}

void json_uint(Json *j, unsigned long long v) {
    before_value(j);
    put_fmt(j, "%llu", v);
}

void json_g(Json *j, double v, int precision) {
    before_value(j);
    if (isfinite(v)) put_fmt(j, "%.*g", precision, v);
    else put(j, "null", 4);
}

void json_fixed(Json *j, double v, int decimals) {
    before_value(j);
    if (isfinite(v)) put_fmt(j, "%.*f", decimals, v);
    else put(j, "null", 4);
}

void json_bool(Json *j, int v) {
    before_value(j);
    if (v) put(j, "true", 4);
    else put(j, "false", 5);
}

void json_null(Json *j) {
    before_value(j);
    put(j, "null", 4);
}

void json_members_begin(Json *j) { open_level(j, 0, 0, 0); }
void json_members_end(Json *j) { close_level(j, 0); }

void json_members(Json *j, const char *members) {
    if (!members || !*members) return;
    before_member(j);
    put(j, members, strlen(members));
}

void json_line_end(Json *j) {
    if (j->depth || j->after_key) fatal("json: a line ends inside an object or array");
    put_char(j, '\n');
}

const char *json_text(const Json *j) { return j->p ? j->p : ""; }
size_t json_len(const Json *j) { return j->len; }

void json_reset(Json *j) {
    j->len = 0;
    if (j->p) j->p[0] = 0;
    j->depth = 0;
    j->after_key = 0;
}

void json_free(Json *j) {
    free(j->p);
    memset(j, 0, sizeof *j);
}

void json_write_file(Json *j, const char *path) {
    if (j->depth || j->after_key) fatal("json: %s written with an object or array still open", path);
    write_file_atomic(path, json_text(j), j->len);
    json_free(j);
}
