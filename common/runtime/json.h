/* json.h — the one JSON writer of the runtime and the driver: run.json,
 * metrics.jsonl, dtensors_rank<r>.json, the traces and the memory snapshots
 * (with the notes the driver adds to them) are all written through it.
 *
 *   Json j = {0};
 *   json_object_begin(&j);
 *   json_key(&j, "data"); json_string(&j, path);   escaped: any path is valid JSON
 *   json_key(&j, "lr"); json_g(&j, lr, 6);         printf's %.6g, as the files always had
 *   json_object_end(&j);
 *   json_line_end(&j);                             files end with a newline
 *   json_write_file(&j, "out/run.json");           atomic; frees the text
 *
 * The buffer grows as needed (no length limit); commas between items are the
 * writer's. Numbers keep the printf format the caller names, so the files stay
 * byte for byte what they were; a number that is not finite is written null
 * (JSON has no NaN or infinity). Misuse (a value in an object without its key,
 * an end that does not match its begin) is a bug in the caller: fatal. */
#ifndef HWFSDP_JSON_H
#define HWFSDP_JSON_H

#include <stddef.h>

#define JSON_WRITE_MAX_DEPTH 16

typedef struct {
    char *p;                 /* the text, NUL-terminated (NULL before anything is written) */
    size_t len, cap;
    int depth;               /* open objects and arrays */
    int after_key;           /* a key was written: its value comes next, without a comma */
    struct {
        size_t items;        /* written so far: a comma goes before the next */
        char close;          /* '}' or ']'; 0: members_begin's object, whose braces are not ours */
        int lines;           /* json_array_begin_lines: each item, and the close, on a new line */
    } level[JSON_WRITE_MAX_DEPTH];
} Json;

void json_object_begin(Json *j);
void json_object_end(Json *j);
void json_array_begin(Json *j);
/* An array with one item per line: "[\n<a>,\n<b>\n]" (traces and snapshot
 * event lists, so that a diff or grep sees one event per line). */
void json_array_begin_lines(Json *j);
void json_array_end(Json *j);

/* An object's key (escaped); its value is the next thing written. */
void json_key(Json *j, const char *key);

/* A string (escaped: quote, backslash and control characters; NULL is ""). */
void json_string(Json *j, const char *s);
/* A string formatted by printf, then escaped. */
void json_stringf(Json *j, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void json_int(Json *j, long long v);
void json_uint(Json *j, unsigned long long v);
/* printf's %.<precision>g (%g is precision 6) and %.<decimals>f; null if not finite. */
void json_g(Json *j, double v, int precision);
void json_fixed(Json *j, double v, int decimals);
void json_bool(Json *j, int v);
void json_null(Json *j);
/* json_key then the value: the members most objects are made of. */
void json_key_string(Json *j, const char *key, const char *s);
void json_key_int(Json *j, const char *key, long long v);

/* The members of an object whose braces someone else writes: dev_mem_note
 * takes a note's fields as such a text ("\"step\":1,\"module\":\"head\""),
 * and the snapshot writer puts it inside the note's object with json_members.
 * begin/end bracket the writing of the text; json_members inserts one (the
 * caller's text is inserted as it is: it must be members written this way). */
void json_members_begin(Json *j);
void json_members_end(Json *j);
void json_members(Json *j, const char *members);

/* A newline after a top-level value: a file's last byte, a JSONL line's end. */
void json_line_end(Json *j);

/* The text so far ("" when empty) and its length. */
const char *json_text(const Json *j);
size_t json_len(const Json *j);
/* Start over (the buffer is kept for the next document). */
void json_reset(Json *j);
void json_free(Json *j);
/* Write the text to path atomically (util.h write_file_atomic), then free it.
 * Every object and array must be closed. */
void json_write_file(Json *j, const char *path);

#endif
