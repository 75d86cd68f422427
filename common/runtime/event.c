/* event.c — what both backends' streams share: the rank's list of events
 * (created, unregistered, freed in one place) and dev_launch's argument
 * checks. */
#include <pthread.h>
#include <stdlib.h>

#include "runtime/internal.h"
#include "runtime/util.h"

void dev_launch_check(const char *name, void (*fn)(void *), size_t args_size) {
    if (!fn) fatal("dev_launch('%s'): no function", name ? name : "?");
    if (args_size > DEV_ARGS_MAX)
        fatal("dev_launch('%s'): %zu bytes of arguments, at most %d allowed", name ? name : "?", args_size, DEV_ARGS_MAX);
}

/* ---------------------------------------------------------------- events */

Event *event_register_new(Dev *d, const char *name) {
    Event *e = xcalloc(1, sizeof *e);
    e->dev = d;
    e->name = xstrdup(name ? name : "event");
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    if (d->nevents == d->events_cap) {
        d->events_cap = d->events_cap ? d->events_cap * 2 : 16;
        d->events = xrealloc(d->events, (size_t)d->events_cap * sizeof *d->events);
    }
    d->events[d->nevents++] = e;
    return e;
}

void event_free(Event *e) {
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->cv);
    race_event_free(e);
    backend_event_fini(e);
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
