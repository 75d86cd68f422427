/* fuzz_support.h — what every libFuzzer target here shares (header-only: each
 * target is one executable).
 *
 * 1. The input as a file. The readers take a path, so the input is written to
 *    a memfd and read back through /proc/self/fd/N (no disk traffic), or to a
 *    temp file where memfds are missing.
 *
 * 2. fatal() as an outcome. The readers report bad input with fatal(), which
 *    exits. FUZZ_TRY() installs a fatal hook (util.h) that longjmps back, so a
 *    clean "error: ..." is just one more input handled. A fatal() outside
 *    FUZZ_TRY (during a target's own consistency checks) is a finding: abort().
 *
 * 3. No leak reports for the longjmp path. A reader stopped by fatal() never
 *    frees what it had allocated (the process exits, so it does not need to).
 *    Under the fuzzer that would be a leak per bad input, so the target links
 *    with -Wl,--wrap=malloc,calloc,realloc,free (mk/fuzz.mk) and records every
 *    allocation made between FUZZ_TRY and fuzz_end(): after a fatal() those are
 *    freed; after a clean read there must be none left (the target has called
 *    st_free / data_free), otherwise the reader leaks and the target aborts.
 *    LeakSanitizer stays on for everything else.
 *
 * 4. CHECK(cond, printf args): a target's own check of what a reader gave
 *    back. Failing, it prints "<FUZZ_TARGET>: check failed: <message>" and
 *    aborts (a finding); a target defines FUZZ_TARGET, its name, before
 *    including this header. */
#ifndef HWFSDP_FUZZ_SUPPORT_H
#define HWFSDP_FUZZ_SUPPORT_H

#include <dirent.h>
#include <fcntl.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "runtime/util.h"

/* ------------------------------------------------------ allocation tracker */

void *__real_malloc(size_t n);
void *__real_calloc(size_t n, size_t size);
void *__real_realloc(void *p, size_t n);
void __real_free(void *p);

/* The tracker is no part of what is fuzzed: no coverage feedback from it (its
 * hash probes would only add noise, and cost most of the time). */
#define FUZZ_NOCOV __attribute__((no_sanitize("coverage")))

/* open addressing; far more slots than a reader of a max_len input allocates */
#define FUZZ_SLOTS (1u << 17)
#define FUZZ_TOMB ((void *)1)
static void *fuzz_slot[FUZZ_SLOTS];
static uint32_t fuzz_touched[FUZZ_SLOTS / 2]; /* slots used since the last release */
static size_t fuzz_live, fuzz_used;           /* live pointers; slots touched */
static int fuzz_tracking;

FUZZ_NOCOV static size_t fuzz_hash(const void *p) {
    uint64_t x = (uint64_t)(uintptr_t)p;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return (size_t)x & (FUZZ_SLOTS - 1);
}

FUZZ_NOCOV static void fuzz_track(void *p) {
    if (!p) return;
    if (fuzz_used + 1 > FUZZ_SLOTS / 2) {
        fprintf(stderr, "fuzz_support: more than %u allocations in one input\n", FUZZ_SLOTS / 2);
        abort();
    }
    size_t i = fuzz_hash(p);
    while (fuzz_slot[i] && fuzz_slot[i] != FUZZ_TOMB) i = (i + 1) & (FUZZ_SLOTS - 1);
    if (!fuzz_slot[i]) fuzz_touched[fuzz_used++] = (uint32_t)i;
    fuzz_slot[i] = p;
    fuzz_live++;
}

FUZZ_NOCOV static void fuzz_untrack(void *p) {
    if (!p) return;
    for (size_t i = fuzz_hash(p); fuzz_slot[i]; i = (i + 1) & (FUZZ_SLOTS - 1))
        if (fuzz_slot[i] == p) {
            fuzz_slot[i] = FUZZ_TOMB;
            fuzz_live--;
            return;
        }
}

FUZZ_NOCOV void *__wrap_malloc(size_t n) {
    void *p = __real_malloc(n);
    if (fuzz_tracking) fuzz_track(p);
    return p;
}
FUZZ_NOCOV void *__wrap_calloc(size_t n, size_t size) {
    void *p = __real_calloc(n, size);
    if (fuzz_tracking) fuzz_track(p);
    return p;
}
FUZZ_NOCOV void *__wrap_realloc(void *p, size_t n) {
    void *q = __real_realloc(p, n);
    if (fuzz_tracking && q) {
        fuzz_untrack(p);
        fuzz_track(q);
    }
    return q;
}
FUZZ_NOCOV void __wrap_free(void *p) {
    if (fuzz_tracking) fuzz_untrack(p);
    __real_free(p);
}

/* Free everything still tracked; returns how many there were. */
FUZZ_NOCOV static size_t fuzz_release_all(void) {
    size_t n = fuzz_live;
    fuzz_tracking = 0;
    for (size_t k = 0; k < fuzz_used; k++) {
        void **slot = &fuzz_slot[fuzz_touched[k]];
        if (*slot != FUZZ_TOMB) __real_free(*slot);
        *slot = NULL;
    }
    fuzz_live = fuzz_used = 0;
    return n;
}

/* -------------------------------------------------- fatal() as an outcome */

static jmp_buf fuzz_jmp;
static int fuzz_in_try;
static char fuzz_message[2048]; /* the last fatal message (to look at in a debugger) */

static void fuzz_on_fatal(const char *message) {
    snprintf(fuzz_message, sizeof fuzz_message, "%s", message);
    /* FUZZ_VERBOSE=1 build-fuzz/fuzz_X FILE...: what the reader says about each input */
    if (getenv("FUZZ_VERBOSE")) fprintf(stderr, "error: %s\n", message);
    if (strchr(message, '\n')) {
        /* the contract is ONE line on stderr */
        fprintf(stderr, "fuzz: fatal message spans several lines: %s\n", message);
        abort();
    }
    if (!fuzz_in_try) {
        fprintf(stderr, "fuzz: unexpected fatal() outside FUZZ_TRY: %s\n", message);
        abort();
    }
    fuzz_in_try = 0;
    longjmp(fuzz_jmp, 1);
}

/* if (FUZZ_TRY()) { read; check; free; } fuzz_end();
 * The body runs once; a fatal() inside jumps back here and FUZZ_TRY() is false. */
#define FUZZ_TRY() (fuzz_begin(), setjmp(fuzz_jmp) == 0)

static void fuzz_begin(void) {
    fatal_set_hook(fuzz_on_fatal);
    fuzz_in_try = 1;
    fuzz_tracking = 1;
}

/* Inside FUZZ_TRY, after the read: from here on a fatal() is a finding (the
 * target's own checks and round trips must not fail on input the reader took). */
static inline void fuzz_no_fatal_from_here(void) { fuzz_in_try = 0; }
/* ... and back to a fatal() being an accepted outcome (e.g. a later validation step). */
static inline void fuzz_fatal_ok_from_here(void) { fuzz_in_try = 1; }

/* Call after the FUZZ_TRY block. clean: the body ran to its end (no fatal). */
static void fuzz_end(int clean, const char *what) {
    fuzz_in_try = 0;
    size_t left = fuzz_release_all();
    if (clean && left) {
        fprintf(stderr, "fuzz: %s leaked %zu allocations on a successful read\n", what, left);
        abort();
    }
}

/* ------------------------------------------------------- the input as file */

static int fuzz_fd = -1;
static char fuzz_path[256];
static char fuzz_dir[256]; /* a private directory for files a target writes */

static void fuzz_remove_dir(void) {
    DIR *d = opendir(fuzz_dir);
    if (!d) return;
    struct dirent *e;
    char path[600];
    while ((e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(path, sizeof path, "%s/%s", fuzz_dir, e->d_name);
        unlink(path);
    }
    closedir(d);
    rmdir(fuzz_dir);
}

static void fuzz_setup(void) {
    if (fuzz_fd >= 0) return;
    fuzz_fd = memfd_create("fuzz-input", 0);
    if (fuzz_fd >= 0) {
        snprintf(fuzz_path, sizeof fuzz_path, "/proc/self/fd/%d", fuzz_fd);
        if (access(fuzz_path, R_OK) != 0) {
            close(fuzz_fd);
            fuzz_fd = -1;
        }
    }
    /* tmpfs when there is one: the round trips write with fsync */
    const char *tmp = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : getenv("TMPDIR");
    snprintf(fuzz_dir, sizeof fuzz_dir, "%s/hwfsdp-fuzz-XXXXXX", tmp && tmp[0] ? tmp : "/tmp");
    if (!mkdtemp(fuzz_dir)) {
        perror("fuzz: mkdtemp");
        abort();
    }
    atexit(fuzz_remove_dir);
    if (fuzz_fd < 0) {
        snprintf(fuzz_path, sizeof fuzz_path, "%s/input", fuzz_dir);
        fuzz_fd = open(fuzz_path, O_RDWR | O_CREAT | O_TRUNC, 0600);
        if (fuzz_fd < 0) {
            perror("fuzz: open");
            abort();
        }
    }
}

/* The input's path, holding exactly data[0..size). */
static const char *fuzz_input_file(const uint8_t *data, size_t size) {
    fuzz_setup();
    if (ftruncate(fuzz_fd, 0) != 0) abort();
    size_t done = 0;
    while (done < size) {
        ssize_t w = pwrite(fuzz_fd, data + done, size - done, (off_t)done);
        if (w <= 0) abort();
        done += (size_t)w;
    }
    return fuzz_path;
}

/* A path in the private directory. */
static inline const char *fuzz_scratch(const char *name) {
    static char buf[512];
    fuzz_setup();
    snprintf(buf, sizeof buf, "%s/%s", fuzz_dir, name);
    return buf;
}

/* ------------------------------------------------------ consistency checks */

#ifndef FUZZ_TARGET
#error "define FUZZ_TARGET (the target's name) before including fuzz_support.h"
#endif
#define CHECK(cond, ...)                                                   \
    do {                                                                   \
        if (!(cond)) {                                                     \
            fprintf(stderr, FUZZ_TARGET ": check failed: " __VA_ARGS__);   \
            fprintf(stderr, "\n");                                         \
            abort();                                                       \
        }                                                                  \
    } while (0)

#endif
