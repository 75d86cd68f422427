#include "runtime/util.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* The one process-wide setting of the runtime (util.h: fuzz targets only). */
static FatalHook fatal_hook;

/* The first fatal error (or TODO) of the process is the one reported: ranks
 * running as threads often hit the same error at once, and a second line
 * would repeat or muddle it. Later callers wait here until _exit ends the
 * process; recursive, so an error while reporting one still gets out. */
static pthread_mutex_t exit_mu = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP;

void report_lock(void) { pthread_mutex_lock(&exit_mu); }

void fatal_set_hook(FatalHook hook) { fatal_hook = hook; }

/* The LastWords (util.h): 0 not run yet, 1 running (an error raised inside it jumps back out), 2 done. Only
 * the thread holding report_lock touches these. */
static LastWords last_words;
static int last_words_state;
static jmp_buf last_words_jump;

void fatal_set_last_words(LastWords fn) { last_words = fn; }

void report_last_words(const char *line) {
    if (!last_words || last_words_state) return;
    last_words_state = 1;
    if (!setjmp(last_words_jump)) last_words(line);
    last_words_state = 2;
}

void cond_init_monotonic(pthread_cond_t *cv) {
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(cv, &attr);
    pthread_condattr_destroy(&attr);
}

void fatal(const char *fmt, ...) {
    char line[2048];
    va_list ap, again;
    va_start(ap, fmt);
    va_copy(again, ap);
    int n = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    char *full = n >= (int)sizeof line ? malloc((size_t)n + 1) : NULL;
    if (full) { /* too long (a path near PATH_MAX): keep the head and the tail, where the reason is */
        vsnprintf(full, (size_t)n + 1, fmt, again);
        const int keep = ((int)sizeof line - 8) / 2;
        snprintf(line, sizeof line, "%.*s ... %s", keep, full, full + n - keep);
        free(full);
    }
    va_end(again);
    if (fatal_hook) fatal_hook(line);
    report_lock(); /* never released: the process ends below */
    if (last_words_state == 1) longjmp(last_words_jump, 1); /* raised while writing the last words: drop them */
    report_last_words(line);
    fflush(stdout);
    fprintf(stderr, "error: %s\n", line);
    /* _exit, not exit: other threads (stream workers, BLAS) may still be running,
     * and exit()'s library teardown under their feet can crash the process
     * instead of reporting the error. Flush our own files first. */
    fflush(NULL);
    _exit(EXIT_FATAL);
}

void hw_todo(const char *what, const char *where) {
    report_lock(); /* never released: the process ends below */
    fflush(stdout);
    fprintf(stderr, "TODO not implemented: %s (see %s)\n", what, where);
    fflush(NULL);
    _exit(EXIT_TODO); /* not exit(): see fatal() */
}

void *xmalloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) fatal("out of host memory allocating %zu bytes", bytes);
    return p;
}
void *xcalloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) fatal("out of host memory allocating %zu x %zu bytes", n, size);
    return p;
}
void *xrealloc(void *p, size_t bytes) {
    void *q = realloc(p, bytes ? bytes : 1);
    if (!q) fatal("out of host memory reallocating %zu bytes", bytes);
    return q;
}
void *xgrow(void *p, size_t *cap, size_t need, size_t initial) {
    if (need <= *cap) return p;
    size_t c = *cap ? *cap : initial;
    while (c < need) c *= 2;
    *cap = c;
    return xrealloc(p, c);
}
char *xstrdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = xmalloc(n);
    memcpy(d, s, n);
    return d;
}

char *xvasprintf(const char *fmt, va_list ap) {
    va_list again;
    va_copy(again, ap);
    int n = vsnprintf(NULL, 0, fmt, ap);
    if (n < 0) fatal("cannot format '%s'", fmt);
    char *s = xmalloc((size_t)n + 1);
    vsnprintf(s, (size_t)n + 1, fmt, again);
    va_end(again);
    return s;
}

char *xasprintf(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char *s = xvasprintf(fmt, ap);
    va_end(ap);
    return s;
}

double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}

void rng_seed(Rng *r, uint64_t seed) {
    /* splitmix64 scrambles the seed so that seeds 0, 1, 2 give unrelated streams */
    uint64_t z = seed + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    r->s = (z ^ (z >> 31)) | 1ull;
}
uint64_t rng_u64(Rng *r) {
    r->s ^= r->s >> 12;
    r->s ^= r->s << 25;
    r->s ^= r->s >> 27;
    return r->s * 0x2545F4914F6CDD1Dull;
}
float rng_uniform(Rng *r) { return (float)(rng_u64(r) >> 40) / 16777216.0f; }
float rng_normal(Rng *r) {
    double u1 = ((double)(rng_u64(r) >> 11) + 0.5) / 9007199254740992.0;
    double u2 = (double)(rng_u64(r) >> 11) / 9007199254740992.0;
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

void write_file_atomic(const char *path, const void *data, size_t bytes) {
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) fatal("cannot write %s: %s", tmp, strerror(errno));
    const char *p = data;
    size_t left = bytes;
    while (left > 0) {
        ssize_t w = write(fd, p, left);
        if (w < 0) {
            if (errno == EINTR) continue;
            close(fd);
            unlink(tmp);
            fatal("cannot write %s: %s", tmp, strerror(errno));
        }
        p += w;
        left -= (size_t)w;
    }
    if (fsync(fd) != 0 || close(fd) != 0) {
        unlink(tmp);
        fatal("cannot flush %s: %s", tmp, strerror(errno));
    }
    if (rename(tmp, path) != 0) {
        unlink(tmp);
        fatal("cannot rename %s to %s: %s", tmp, path, strerror(errno));
    }
}

void *read_file_all(const char *path, size_t *bytes_out) {
    FILE *f = fopen(path, "rb");
    if (!f) fatal("cannot open %s: %s", path, strerror(errno));
    /* fopen takes a directory, and its "size" would then be a bogus huge allocation */
    struct stat st;
    if (fstat(fileno(f), &st) == 0 && S_ISDIR(st.st_mode)) fatal("cannot read %s: %s", path, strerror(EISDIR));
    if (fseek(f, 0, SEEK_END) != 0) fatal("cannot seek in %s", path);
    long n = ftell(f);
    if (n < 0) fatal("cannot size %s", path);
    rewind(f);
    char *buf = xmalloc((size_t)n + 1);
    if (n > 0 && fread(buf, 1, (size_t)n, f) != (size_t)n) fatal("cannot read %s", path);
    fclose(f);
    buf[n] = 0;
    *bytes_out = (size_t)n;
    return buf;
}

void make_dirs(const char *path) {
    char buf[4096];
    size_t n = strlen(path);
    if (n == 0 || n >= sizeof buf) fatal("bad directory path '%s'", path);
    memcpy(buf, path, n + 1);
    for (size_t i = 1; i <= n; i++) {
        if (buf[i] == '/' || buf[i] == 0) {
            char c = buf[i];
            buf[i] = 0;
            if (mkdir(buf, 0755) != 0 && errno != EEXIST) fatal("cannot create directory %s: %s", buf, strerror(errno));
            buf[i] = c;
        }
    }
}
