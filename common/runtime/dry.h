/* dry.h — the dry run's memory (dry.c): address space with nothing behind it.
 *
 * Under --dry-run (WorldConfig.dry_run) the CPU backends price every op on the
 * modelled clock and count every allocation exactly as in a real run, but
 * execute nothing: device storage, pinned host storage and probe memory are
 * addresses carved out of PROT_NONE reservations (mmap with MAP_NORESERVE: no
 * page, no swap, no commit charge), so a world of 64 ranks of Llama 3 70B fits
 * in a laptop's address space. Nothing may touch them: the stream workers run
 * no kernel, copy or collective, and host code that reads or writes one faults;
 * the SIGSEGV handler (guard.c) stops the run with one line naming the buffer
 * and the code that touched it.
 *
 * Each rank's arena (Dev.dry) hands out DEV_ALLOC_ALIGN-aligned ranges, first fit over
 * address-ordered free extents that merge on free; it grows by one reservation
 * of at least DRY_CHUNK_BYTES whenever nothing fits. Touched only by the rank's
 * host thread. The reservations are also listed process-wide (lock-free for the
 * handler), with what each holds. */
#ifndef HWFSDP_DRY_H
#define HWFSDP_DRY_H

#include <stddef.h>
#include <stdint.h>

#define DRY_CHUNK_BYTES ((size_t)64 << 30) /* 64 GiB of address space per reservation */

typedef struct DryArena DryArena;

DryArena *dry_arena_new(int rank);
/* bytes > 0; NULL when the address space is exhausted */
void *dry_arena_alloc(DryArena *a, size_t bytes);
void dry_arena_free(DryArena *a, void *p, size_t bytes);
void dry_arena_destroy(DryArena *a);

/* A reservation of bytes outside any arena (the driver's host copy of the
 * initial weights in a dry run), named `what` in the handler's messages; NULL
 * when the address space is exhausted. dry_release gives it back. */
void *dry_reserve(size_t bytes, const char *what);
void dry_release(void *p, size_t bytes);

/* For the SIGSEGV handler (async-signal-safe): 1 if addr lies in a live
 * reservation; *what is NULL for an arena's (the allocator names the buffer)
 * or dry_reserve's name. */
int dry_contains(uintptr_t addr, const char **what);

#endif
