/* local_world.h — a world of n ranks as threads (local backend, one BLAS
 * thread) for the runtime's C tests: local_config(n) to adjust, run_world to
 * create it, run fn on every rank and destroy it; and a gate that holds a
 * stream until the host opens it. */
#ifndef HWFSDP_LOCAL_WORLD_H
#define HWFSDP_LOCAL_WORLD_H

#include <pthread.h>

#include "runtime/runtime.h"

/* The declared cost of the tests' own kernels (runtime.h: every launch declares
 * one): a kernel's fixed time on the profile, no FLOPs, no bytes. */
#define TEST_COST (&(KernelCost){.cls = COST_ELEMENTWISE, .math = DTYPE_F32})
/* A kernel that lasts 1 ms on the modelled clock ("teach" profile: 100 MB at 100 GB/s). */
#define LONG_COST (&(KernelCost){.cls = COST_ELEMENTWISE, .math = DTYPE_F32, .bytes = 100e6})

static inline WorldConfig local_config(int n) {
    WorldConfig c = {0};
    c.world_size = n;
    c.backend = BACKEND_LOCAL;
    c.blas_threads = 1;
    return c;
}

/* c with tracing, or with fresh device memory poisoned (NaN), turned on. */
static inline WorldConfig traced(WorldConfig c) {
    c.trace = 1;
    return c;
}
static inline WorldConfig poisoned(WorldConfig c) {
    c.poison = 1;
    return c;
}

static inline void run_world(WorldConfig c, void (*fn)(Dev *, void *), void *arg) {
    World *w = world_create(&c);
    world_run(w, fn, arg);
    world_destroy(w);
}

/* A gate: a stream that runs k_gate_wait blocks until the host calls
 * gate_open. Tests wait for this event, never for a time. */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int open;
} Gate;
#define GATE_INIT {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0}

static inline void k_gate_wait(void *p) { /* dev_launch args: a Gate * */
    Gate *g = *(Gate **)p;
    pthread_mutex_lock(&g->mu);
    while (!g->open) pthread_cond_wait(&g->cv, &g->mu);
    pthread_mutex_unlock(&g->mu);
}

static inline void gate_open(Gate *g) {
    pthread_mutex_lock(&g->mu);
    g->open = 1;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

#endif
