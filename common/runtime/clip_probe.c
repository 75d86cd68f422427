/* clip_probe.c — the clip probe (runtime.h): one device float per AdamW
 * launch, where the kernel writes the clip coefficient it applied, so the
 * grader can compare every launch's coefficient with the reference. Probe
 * memory is outside the allocator: it never shows in counts or snapshots.
 * Also dev_probe_read, the driver's probes' read of device memory. */
#include "runtime/internal.h"
#include "runtime/util.h"

#include <string.h>

float *stream_clip_slot(Stream *s) {
    Dev *d = s->dev;
    if (!d->clip_slots) d->clip_slots = dev_ops(d)->probe_alloc(d, CLIP_PROBE_SLOTS * sizeof(float));
    if (d->clip_n >= CLIP_PROBE_SLOTS) {
        d->clip_n = CLIP_PROBE_SLOTS + 1; /* overflowed: the collect says so */
        return NULL;
    }
    return d->clip_slots + d->clip_n++;
}

int dev_clip_collect(Dev *d, float *host, int cap) {
    int n = d->clip_n;
    d->clip_n = 0;
    if (n > CLIP_PROBE_SLOTS) return -1;
    if (n > cap) n = cap;
    if (n > 0) dev_ops(d)->probe_read(d, host, d->clip_slots, (size_t)n * sizeof(float));
    return n;
}

void dev_probe_read(Dev *d, void *host, const void *src, size_t bytes) {
    if (bytes) dev_ops(d)->probe_read(d, host, src, bytes);
}

void dev_clip_probe_free(Dev *d) {
    if (d->clip_slots) dev_ops(d)->probe_free(d, d->clip_slots);
    d->clip_slots = NULL;
}
