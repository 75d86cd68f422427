/* intern.c — a rank's table of immutable strings (internal.h: InternTable):
 * module, phase, op and allocation names stored once, so ops, trace records
 * and memory events can keep plain pointers that live as long as the Dev. */
#include <stdlib.h>
#include <string.h>

#include "runtime/internal.h"
#include "runtime/util.h"

static uint64_t hash_str(const char *s) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

const char *dev_intern(Dev *d, const char *s) {
    InternTable *t = &d->strings;
    if (!s) s = "";
    if ((t->count + 1) * 2 > t->cap) {
        size_t ncap = t->cap ? t->cap * 2 : 256;
        char **slots = xcalloc(ncap, sizeof *slots);
        for (size_t i = 0; i < t->cap; i++) {
            if (!t->slots[i]) continue;
            size_t j = hash_str(t->slots[i]) & (ncap - 1);
            while (slots[j]) j = (j + 1) & (ncap - 1);
            slots[j] = t->slots[i];
        }
        free(t->slots);
        t->slots = slots;
        t->cap = ncap;
    }
    size_t j = hash_str(s) & (t->cap - 1);
    while (t->slots[j]) {
        if (strcmp(t->slots[j], s) == 0) return t->slots[j];
        j = (j + 1) & (t->cap - 1);
    }
    t->slots[j] = xstrdup(s);
    t->count++;
    return t->slots[j];
}

void intern_free(InternTable *t) {
    for (size_t i = 0; i < t->cap; i++) free(t->slots[i]);
    free(t->slots);
    memset(t, 0, sizeof *t);
}
