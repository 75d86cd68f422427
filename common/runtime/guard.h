/* guard.h — the device-memory guard (guard.c): a debug mode of the CPU
 * backends in which host code cannot touch device memory, as on a GPU.
 *
 * On (WorldConfig.guard_device: --guard-device-memory, or HWFSDP_GUARD_DEVICE=1
 * for any binary) and where the machine has x86 memory protection keys, the
 * CPU backends' device storage (and probe memory) is mmap'd pages tagged with
 * one pkey. The main thread and the ranks' host threads run with that key
 * access-disabled; the stream workers, which run kernels, copies and
 * collectives, with it enabled (each sets it when it starts). Runtime code
 * that touches device storage on the host by design (the NaN poison of fresh
 * storage, probe_read) opens the key just around that access. A host access
 * anywhere else faults, and the SIGSEGV handler stops the run with one line
 * naming the buffer (the allocator's record of the address), the offset, the
 * function that touched it and whether it read or wrote (exit status 2).
 * Without pkeys (pkey_alloc fails) one line says why and the run goes on
 * unguarded. OpenBLAS runs one thread per call in this mode: its pool threads
 * were started before the key existed, with it disabled.
 *
 * A dry run (--dry-run, dry.h) needs no key: its buffers are PROT_NONE address
 * space, so any touch faults, on any machine. The same handler names the
 * buffer and the code, with the dry run's own sentence. */
#ifndef HWFSDP_GUARD_H
#define HWFSDP_GUARD_H

#include <stddef.h>

typedef struct World World;
typedef struct Dev Dev;

/* world_create, once cfg.guard_device is final: the key (once per process),
 * the signal handler; the calling (main) thread loses access. 1 if the guard
 * is active for w, 0 if unavailable (said in one line) or off. */
int guard_install(World *w);
/* world_destroy: w no longer names buffers in the handler's messages. */
void guard_world_gone(World *w);
/* 1 if w's device storage is guarded (guard_install succeeded for it). */
int guard_active(const World *w);

/* The thread's role, set at its start: a rank's host thread (d may be NULL
 * until its Dev exists), or a stream worker (access enabled). No-ops unguarded. */
void guard_thread_host(Dev *d);
void guard_thread_device(void);

/* Runtime code that touches device storage on the host by design: access on
 * between open and close (close restores what open found, so they nest). */
unsigned guard_open(void);
void guard_close(unsigned saved);

/* Guarded storage: bytes rounded up to pages, tagged with the key; NULL when
 * out of memory. Only while the guard is installed. */
void *guard_storage_alloc(size_t bytes);
void guard_storage_free(void *p, size_t bytes);

#endif
