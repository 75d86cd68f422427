/* check.h — a minimal test harness for the C unit tests.
 *
 *   TEST(name) { CHECK(cond, "fmt", ...); CHECK_CLOSE(a, b, rtol, atol, "what"); }
 *   int main(int argc, char **argv) { return check_main(argc, argv); }
 *
 * TEST registers its test (a constructor, before main); check_main runs them
 * in the order they are defined in the file (a negative control that vouches
 * for the tests after it is defined before them). Each test prints
 * "== name == OK" or "== name == FAIL" with the failed checks; the last line
 * is "N passed, N failed". `./test_x NAME` runs one test; a NAME no TEST
 * defines stops with one line (exit 2) instead of running nothing. */
#ifndef HWFSDP_CHECK_H
#define HWFSDP_CHECK_H

#include <pthread.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static int check_failed_in_test, check_passed_tests, check_failed_tests;

#define CHECK_MAX_TESTS 128
typedef struct {
    const char *name;
    void (*fn)(void);
    int line; /* where TEST stands: the run order */
} CheckTest;
static struct {
    CheckTest tests[CHECK_MAX_TESTS];
    int n;
} check_registry;

static inline void check_register(const char *name, void (*fn)(void), int line) {
    if (check_registry.n == CHECK_MAX_TESTS) {
        fprintf(stderr, "error: check.h: more than %d TESTs in one file (raise CHECK_MAX_TESTS)\n", CHECK_MAX_TESTS);
        exit(2);
    }
    check_registry.tests[check_registry.n++] = (CheckTest){name, fn, line};
}

#define TEST(name)                                                                                                     \
    static void test_##name(void);                                                                                     \
    __attribute__((constructor)) static void check_register_##name(void) {                                             \
        check_register(#name, test_##name, __LINE__);                                                                  \
    }                                                                                                                  \
    static void test_##name(void)

#define CHECK(cond, ...)                                                       \
    do {                                                                       \
        if (!(cond)) {                                                         \
            check_failed_in_test++;                                            \
            fprintf(stderr, "  %s:%d: check failed: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                      \
            fprintf(stderr, "\n");                                             \
        }                                                                      \
    } while (0)
/* CHECK from the ranks' threads or stream workers: one at a time */
static pthread_mutex_t check_thread_mu __attribute__((unused)) = PTHREAD_MUTEX_INITIALIZER;
#define TCHECK(...)                                                            \
    do {                                                                       \
        pthread_mutex_lock(&check_thread_mu);                                  \
        CHECK(__VA_ARGS__);                                                    \
        pthread_mutex_unlock(&check_thread_mu);                                \
    } while (0)
#define CHECK_CLOSE(a, b, rtol, atol, what)                                    \
    do {                                                                       \
        double ca_ = (double)(a), cb_ = (double)(b);                           \
        CHECK(fabs(ca_ - cb_) <= (atol) + (rtol) * fabs(cb_) && !isnan(ca_) && !isnan(cb_), \
              "%s: %.9g vs %.9g", (what), ca_, cb_);                            \
    } while (0)

static inline int check_summary(void) {
    printf("%d passed, %d failed\n", check_passed_tests, check_failed_tests);
    return check_failed_tests ? 1 : (check_passed_tests ? 0 : 1);
}

static inline void check_run(const CheckTest *t) {
    check_failed_in_test = 0;
    t->fn();
    printf("== %s == %s\n", t->name, check_failed_in_test ? "FAIL" : "OK");
    fflush(stdout);
    if (check_failed_in_test) check_failed_tests++;
    else check_passed_tests++;
}

/* Every test in definition order, or only argv[1]'s; the exit status of the run. */
static inline int check_main(int argc, char **argv) {
    CheckTest *t = check_registry.tests;
    const int n = check_registry.n;
    /* sorted by line: the order constructors run in is the toolchain's to choose */
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && t[j - 1].line > t[j].line; j--) {
            CheckTest tmp = t[j];
            t[j] = t[j - 1];
            t[j - 1] = tmp;
        }
    const char *only = argc > 1 ? argv[1] : NULL;
    if (only) {
        for (int i = 0; i < n; i++)
            if (!strcmp(t[i].name, only)) {
                check_run(&t[i]);
                return check_summary();
            }
        fprintf(stderr, "error: %s has no test '%s'; its tests:", argv[0], only);
        for (int i = 0; i < n; i++) fprintf(stderr, " %s", t[i].name);
        fprintf(stderr, "\n");
        return 2;
    }
    for (int i = 0; i < n; i++) check_run(&t[i]);
    return check_summary();
}

/* A test that watches a runtime error end a process runs itself as a child: check_child_init(argv[0]) in main,
 * then check_child("kind", err, cap) runs `<this binary> --mode kind` and returns its exit status (128 + the
 * signal of a killed one), its stderr in err (stdout dropped). */
static inline char *check_self_path(void) {
    static char path[4096];
    return path;
}

static inline void check_child_init(const char *argv0) {
    char *self = check_self_path();
    ssize_t n = readlink("/proc/self/exe", self, 4095);
    if (n <= 0) snprintf(self, 4096, "%s", argv0);
    else self[n] = 0;
}

static inline int check_child(const char *kind, char *err, size_t cap) {
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "'%s' --mode %s 2>&1 >/dev/null", check_self_path(), kind);
    FILE *f = popen(cmd, "r");
    if (!f) return -1;
    size_t n = fread(err, 1, cap - 1, f);
    err[n] = 0;
    int st = pclose(f);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
}

#endif
