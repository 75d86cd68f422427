/* fsdp_support.c — runtime helpers declared in hw_fsdp.h. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "hw_fsdp.h"
#include "kernels.h"
#include "util.h"

void hw_todo(const char *what, const char *where) {
    fflush(stdout);
    fprintf(stderr, "TODO not implemented: %s (see %s)\n", what, where);
    fflush(NULL);
    _exit(EXIT_TODO); /* not exit(): see fatal() in util.c */
}

void launch_adamw(Stream *s, float *param, const float *grad, float *exp_avg, float *exp_avg_sq, size_t n,
                  const AdamWConfig *c, float lr, int t, const float *total_sumsq) {
    AdamArgs a = {param, grad, exp_avg, exp_avg_sq, n, *c, lr, t, total_sumsq};
    dev_access(s, grad, n * sizeof(float), 0, NULL); /* for the race detector */
    dev_access(s, total_sumsq, sizeof(float), 0, NULL);
    dev_access(s, param, n * sizeof(float), 1, NULL);
    dev_access(s, exp_avg, n * sizeof(float), 1, NULL);
    dev_access(s, exp_avg_sq, n * sizeof(float), 1, NULL);
    dev_launch(s, "adamw", KERNEL(adamw), &a, sizeof a);
}
