/* dry.c — the dry run's memory (dry.h): reservations of address space with
 * nothing behind them, and each rank's first-fit arena over them. */
#include "device.h" /* DEV_ALLOC_ALIGN */
#include "runtime/dry.h"
#include "runtime/util.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

/* ------------------------------------------------ the process's reservations */

#define DRY_MAX_RESERVATIONS 4096
typedef struct {
    _Atomic int live;     /* published last, so the handler never reads a half-written slot */
    uintptr_t lo, hi;
    const char *what;     /* NULL: an arena's */
} DrySlot;
static DrySlot g_slots[DRY_MAX_RESERVATIONS];
static _Atomic int g_nslots; /* slots ever used */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;

static void *reserve(size_t bytes, const char *what) {
    void *p = mmap(NULL, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return NULL;
    pthread_mutex_lock(&g_mu);
    int n = atomic_load(&g_nslots), i = 0;
    while (i < n && atomic_load(&g_slots[i].live)) i++;
    if (i == DRY_MAX_RESERVATIONS) {
        pthread_mutex_unlock(&g_mu);
        munmap(p, bytes);
        return NULL;
    }
    g_slots[i].lo = (uintptr_t)p;
    g_slots[i].hi = (uintptr_t)p + bytes;
    g_slots[i].what = what;
    atomic_store(&g_slots[i].live, 1);
    if (i == n) atomic_store(&g_nslots, n + 1);
    pthread_mutex_unlock(&g_mu);
    return p;
}

static void unreserve(void *p, size_t bytes) {
    pthread_mutex_lock(&g_mu);
    int n = atomic_load(&g_nslots);
    for (int i = 0; i < n; i++)
        if (atomic_load(&g_slots[i].live) && g_slots[i].lo == (uintptr_t)p) atomic_store(&g_slots[i].live, 0);
    pthread_mutex_unlock(&g_mu);
    munmap(p, bytes);
}

int dry_contains(uintptr_t addr, const char **what) {
    int n = atomic_load(&g_nslots);
    for (int i = 0; i < n; i++) {
        const DrySlot *s = &g_slots[i];
        if (atomic_load(&s->live) && addr >= s->lo && addr < s->hi) {
            *what = s->what;
            return 1;
        }
    }
    return 0;
}

void *dry_reserve(size_t bytes, const char *what) { return reserve(bytes ? bytes : 1, what); }

void dry_release(void *p, size_t bytes) {
    if (p) unreserve(p, bytes ? bytes : 1);
}

/* --------------------------------------------------------------- the arena */

typedef struct {
    uintptr_t lo;
    size_t len;
} Extent;

typedef struct {
    uintptr_t base;
    size_t size;
    Extent *free;         /* address-ordered, never adjacent (merged) */
    size_t nfree, cap;
} Chunk;

struct DryArena {
    int rank;
    Chunk *chunks;
    int n, cap;
};

DryArena *dry_arena_new(int rank) {
    DryArena *a = xcalloc(1, sizeof *a);
    a->rank = rank;
    return a;
}

/* A reservation of at least need bytes: DRY_CHUNK_BYTES, or less where the address space is short (an
 * address-space limit, a sanitizer's or valgrind's layout), down to need itself. */
static int add_chunk(DryArena *a, size_t need) {
    size_t size = need > DRY_CHUNK_BYTES ? (need + DRY_CHUNK_BYTES - 1) / DRY_CHUNK_BYTES * DRY_CHUNK_BYTES
                                         : DRY_CHUNK_BYTES;
    void *p;
    while (!(p = reserve(size, NULL)) && size / 2 >= need) size /= 2;
    if (!p && size != need) p = reserve(size = need, NULL);
    if (!p) return 0;
    if (a->n == a->cap) {
        a->cap = a->cap ? 2 * a->cap : 4;
        a->chunks = xrealloc(a->chunks, (size_t)a->cap * sizeof *a->chunks);
    }
    Chunk *c = &a->chunks[a->n++];
    *c = (Chunk){.base = (uintptr_t)p, .size = size, .cap = 16};
    c->free = xmalloc(c->cap * sizeof *c->free);
    c->free[0] = (Extent){(uintptr_t)p, size};
    c->nfree = 1;
    return 1;
}

/* len bytes from the first free extent of c that holds them; NULL if none does */
static void *carve(Chunk *c, size_t len) {
    for (size_t i = 0; i < c->nfree; i++) {
        Extent *e = &c->free[i];
        if (e->len < len) continue;
        uintptr_t p = e->lo;
        e->lo += len;
        e->len -= len;
        if (!e->len) {
            memmove(e, e + 1, (c->nfree - i - 1) * sizeof *e);
            c->nfree--;
        }
        return (void *)p;
    }
    return NULL;
}

static size_t aligned(size_t bytes) { return (bytes + DEV_ALLOC_ALIGN - 1) / DEV_ALLOC_ALIGN * DEV_ALLOC_ALIGN; }

void *dry_arena_alloc(DryArena *a, size_t bytes) {
    size_t len = aligned(bytes);
    if (len < bytes) return NULL;
    for (int k = 0; k < a->n; k++) {
        void *p = carve(&a->chunks[k], len);
        if (p) return p;
    }
    return add_chunk(a, len) ? carve(&a->chunks[a->n - 1], len) : NULL; /* a new chunk holds len */
}

void dry_arena_free(DryArena *a, void *p, size_t bytes) {
    uintptr_t lo = (uintptr_t)p;
    size_t len = aligned(bytes);
    for (int k = 0; k < a->n; k++) {
        Chunk *c = &a->chunks[k];
        if (lo < c->base || lo >= c->base + c->size) continue;
        size_t i = 0; /* the first free extent above p */
        while (i < c->nfree && c->free[i].lo < lo) i++;
        int join_prev = i > 0 && c->free[i - 1].lo + c->free[i - 1].len == lo;
        int join_next = i < c->nfree && lo + len == c->free[i].lo;
        if (join_prev && join_next) {
            c->free[i - 1].len += len + c->free[i].len;
            memmove(&c->free[i], &c->free[i + 1], (c->nfree - i - 1) * sizeof *c->free);
            c->nfree--;
        } else if (join_prev) {
            c->free[i - 1].len += len;
        } else if (join_next) {
            c->free[i].lo = lo;
            c->free[i].len += len;
        } else {
            if (c->nfree == c->cap) {
                c->cap *= 2;
                c->free = xrealloc(c->free, c->cap * sizeof *c->free);
            }
            memmove(&c->free[i + 1], &c->free[i], (c->nfree - i) * sizeof *c->free);
            c->free[i] = (Extent){lo, len};
            c->nfree++;
        }
        return;
    }
    fatal("dry run: rank %d freed %p, which its arena never handed out", a->rank, p);
}

void dry_arena_destroy(DryArena *a) {
    if (!a) return;
    for (int k = 0; k < a->n; k++) {
        unreserve((void *)a->chunks[k].base, a->chunks[k].size);
        free(a->chunks[k].free);
    }
    free(a->chunks);
    free(a);
}
