/* check.h — a minimal test harness for the C unit tests.
 *
 *   TEST(name) { CHECK(cond, "fmt", ...); CHECK_CLOSE(a, b, rtol, atol, "what"); }
 *   int main(int argc, char **argv) { RUN(name); ...; return check_summary(); }
 *
 * Each test prints "== name == OK" or "== name == FAIL" with the failed checks;
 * the last line is "N passed, N failed". `./test_x NAME` runs one test. */
#ifndef HWFSDP_CHECK_H
#define HWFSDP_CHECK_H

#include <math.h>
#include <stdio.h>
#include <string.h>

static int check_failed_in_test, check_passed_tests, check_failed_tests;
static const char *check_only;

#define TEST(name) static void test_##name(void)
#define CHECK(cond, ...)                                                       \
    do {                                                                       \
        if (!(cond)) {                                                         \
            check_failed_in_test++;                                            \
            fprintf(stderr, "  %s:%d: check failed: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                      \
            fprintf(stderr, "\n");                                             \
        }                                                                      \
    } while (0)
#define CHECK_CLOSE(a, b, rtol, atol, what)                                    \
    do {                                                                       \
        double ca_ = (double)(a), cb_ = (double)(b);                           \
        CHECK(fabs(ca_ - cb_) <= (atol) + (rtol) * fabs(cb_) && !isnan(ca_) && !isnan(cb_), \
              "%s: %.9g vs %.9g", (what), ca_, cb_);                            \
    } while (0)
#define RUN(name)                                                              \
    do {                                                                       \
        if (check_only && strcmp(check_only, #name) != 0) break;               \
        check_failed_in_test = 0;                                              \
        test_##name();                                                         \
        printf("== %s == %s\n", #name, check_failed_in_test ? "FAIL" : "OK"); \
        fflush(stdout);                                                        \
        if (check_failed_in_test) check_failed_tests++; else check_passed_tests++; \
    } while (0)
#define CHECK_MAIN_ARGS(argc, argv) do { check_only = (argc) > 1 ? (argv)[1] : NULL; } while (0)

static inline int check_summary(void) {
    printf("%d passed, %d failed\n", check_passed_tests, check_failed_tests);
    return check_failed_tests ? 1 : (check_passed_tests ? 0 : 1);
}

#endif
