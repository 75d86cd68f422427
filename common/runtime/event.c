/* event.c — what every backend's events share: the rank's list of events
 * (created, unregistered, freed in one place). */
#include <stdlib.h>

#include "runtime/internal.h"
#include "runtime/util.h"

Event *event_register_new(Dev *d, const char *name) {
    Event *e = xcalloc(1, sizeof *e);
    e->dev = d;
    e->name = xstrdup(name ? name : "event");
    if (d->nevents == d->events_cap) {
        d->events_cap = d->events_cap ? d->events_cap * 2 : 16;
        d->events = xrealloc(d->events, (size_t)d->events_cap * sizeof *d->events);
    }
    d->events[d->nevents++] = e;
    return e;
}

void event_free(Event *e) {
    race_event_free(e);
    dev_ops(e->dev)->event_fini(e);
    free(e->name);
    free(e);
}

void event_unregister(Event *e) {
    Dev *d = e->dev;
    for (int i = 0; i < d->nevents; i++)
        if (d->events[i] == e) {
            d->events[i] = d->events[--d->nevents];
            break;
        }
}
