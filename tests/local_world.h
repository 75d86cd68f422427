/* local_world.h — a world of n ranks as threads (local backend, one BLAS
 * thread) for the runtime's C tests: local_config(n) to adjust, run_world to
 * create it, run fn on every rank and destroy it. */
#ifndef HWFSDP_LOCAL_WORLD_H
#define HWFSDP_LOCAL_WORLD_H

#include "runtime/runtime.h"

static inline WorldConfig local_config(int n) {
    WorldConfig c = {0};
    c.world_size = n;
    c.backend = BACKEND_LOCAL;
    c.blas_threads = 1;
    return c;
}

static inline void run_world(WorldConfig c, void (*fn)(Dev *, void *), void *arg) {
    World *w = world_create(&c);
    world_run(w, fn, arg);
    world_destroy(w);
}

#endif
