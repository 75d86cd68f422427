/* util.h — small helpers shared by every part of the runtime.
 *
 * Errors: the runtime never crashes on bad input; it prints one line
 * "error: <what went wrong>" to stderr and exits with status 2 (fatal).
 * Student TODO stubs exit with status 3 (see hw_todo in hw_fsdp.h). */
#ifndef HWFSDP_UTIL_H
#define HWFSDP_UTIL_H

#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#define EXIT_FATAL 2   /* bad input or misuse of the runtime */
#define EXIT_TODO 3    /* a student TODO stub was reached */

/* Print "error: ..." and exit(EXIT_FATAL). Safe to call from any thread. */
void fatal(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
/* Taken before printing a report that ends the process (fatal, hw_todo, the
 * race detector, the watchdog) and never released: ranks running as threads
 * often fail together, and the process reports only the first. */
void report_lock(void);

/* For fuzz targets (fuzz/) only: fatal() first calls the hook with its message
 * (without "error: "). A hook that longjmps out turns a fatal error into an
 * outcome the caller can inspect; a hook that returns changes nothing (the line
 * is printed and the process exits as usual). NULL (the default) removes it.
 * Process-wide: set it before any thread starts. */
typedef void (*FatalHook)(const char *message);
void fatal_set_hook(FatalHook hook);

/* What the process writes before it reports a runtime error and exits (the runtime's partial record:
 * runtime.h, dev_record_partial). fatal() and the race detector's report call it once, on the reporting
 * thread, after report_lock and before the "error:" line, with that line (without "error: "). An error
 * raised while it runs (a file it cannot write) ends it early, silently: the original line is still the one
 * reported. NULL (the default) writes nothing. Process-wide: set it before any thread starts. */
typedef void (*LastWords)(const char *line);
void fatal_set_last_words(LastWords fn);
/* For the runtime's own reports that end the process (race.c): call the LastWords once; after report_lock. */
void report_last_words(const char *line);

/* A starter's TODO stub (hw_fsdp.h): one line naming the TODO, exit(EXIT_TODO). */
void hw_todo(const char *what, const char *where) __attribute__((noreturn));

/* malloc/calloc that never return NULL (fatal on failure). Host memory that is
 * NOT counted by the device allocator: use only for runtime bookkeeping. */
void *xmalloc(size_t bytes);
void *xcalloc(size_t n, size_t size);
void *xrealloc(void *p, size_t bytes);
/* A growing buffer p of capacity *cap made to hold need bytes: the capacity
 * doubles (from initial when *cap is 0); returns the buffer, maybe moved. */
void *xgrow(void *p, size_t *cap, size_t need, size_t initial);
char *xstrdup(const char *s);
/* A new string formatted by printf, as long as it needs (file paths under any --out). */
char *xasprintf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
char *xvasprintf(const char *fmt, va_list ap) __attribute__((format(printf, 1, 0)));

/* Monotonic wall clock in microseconds (CLOCK_MONOTONIC; common to all threads). */
double now_us(void);
/* A condition variable whose timed waits count on CLOCK_MONOTONIC (the
 * watchdog's deadlines come from now_us, which never jumps). */
void cond_init_monotonic(pthread_cond_t *cv);

/* Deterministic random numbers (xorshift64*; no global state). */
typedef struct { uint64_t s; } Rng;
void rng_seed(Rng *r, uint64_t seed);
uint64_t rng_u64(Rng *r);
float rng_uniform(Rng *r);                     /* in [0, 1) */
float rng_normal(Rng *r);                      /* standard normal (Box-Muller) */

/* Write a whole file atomically: write to "<path>.tmp.<pid>", fsync, rename.
 * A crash mid-write leaves any previous file at <path> intact. */
void write_file_atomic(const char *path, const void *data, size_t bytes);
/* Read a whole file; fatal with a clear message if it cannot. */
void *read_file_all(const char *path, size_t *bytes_out);
/* mkdir -p */
void make_dirs(const char *path);

#endif
