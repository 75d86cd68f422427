/* bench_sgemm.c — the machine's fp32 matmul ceiling for tools/bench.py.
 *
 *   bench_sgemm [n] [threads] [repeats]      (default 2048 2 5)
 *
 * Times C = A B for square n x n float32 matrices through OpenBLAS with the
 * given thread count and prints one JSON line:
 *   {"n":2048,"threads":2,"repeats":5,"best_s":..,"median_s":..,"gflops_best":..,"gflops_median":..}
 * A warm-up call runs first (page faults, thread start-up) and is not counted. */
#define _POSIX_C_SOURCE 200809L
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

void openblas_set_num_threads(int num_threads); /* OpenBLAS extension */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 2048;
    int threads = argc > 2 ? atoi(argv[2]) : 2;
    int repeats = argc > 3 ? atoi(argv[3]) : 5;
    if (n <= 0 || threads <= 0 || repeats <= 0 || repeats > 100) {
        fprintf(stderr, "usage: %s [n>0] [threads>0] [repeats 1..100]\n", argv[0]);
        return 2;
    }
    openblas_set_num_threads(threads);
    size_t nn = (size_t)n * (size_t)n;
    float *a = malloc(nn * sizeof *a), *b = malloc(nn * sizeof *b), *c = malloc(nn * sizeof *c);
    if (!a || !b || !c) {
        fprintf(stderr, "bench_sgemm: out of memory for n=%d\n", n);
        return 1;
    }
    unsigned s = 12345u; /* small deterministic values: no denormals, no overflow */
    for (size_t i = 0; i < nn; i++) {
        s = s * 1103515245u + 12345u;
        a[i] = (float)((s >> 16) & 0xff) / 256.0f - 0.5f;
        s = s * 1103515245u + 12345u;
        b[i] = (float)((s >> 16) & 0xff) / 256.0f - 0.5f;
        c[i] = 0.0f;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a, n, b, n, 0.0f, c, n);
    double t[100];
    for (int r = 0; r < repeats; r++) {
        double t0 = now_s();
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a, n, b, n, 0.0f, c, n);
        t[r] = now_s() - t0;
    }
    qsort(t, (size_t)repeats, sizeof t[0], cmp_double);
    double flops = 2.0 * (double)n * (double)n * (double)n;
    double med = repeats % 2 ? t[repeats / 2] : 0.5 * (t[repeats / 2 - 1] + t[repeats / 2]);
    printf("{\"n\":%d,\"threads\":%d,\"repeats\":%d,\"best_s\":%.6f,\"median_s\":%.6f,"
           "\"gflops_best\":%.3f,\"gflops_median\":%.3f,\"checksum\":%.6g}\n",
           n, threads, repeats, t[0], med, flops / t[0] * 1e-9, flops / med * 1e-9, (double)c[nn / 2 + 7]);
    free(a);
    free(b);
    free(c);
    return 0;
}
