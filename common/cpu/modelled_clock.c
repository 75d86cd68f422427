/* modelled_clock.c — the CPU backends' clock: modelled time (HANDOUT: "Time").
 *
 * Every op gets a modelled start and end from program order alone, never from
 * the wall clock, the threads' interleaving or the machine's load:
 *   - the host enqueues it at its own modelled time, which each op it enqueues
 *     moves on by the profile's host_launch_us (clock_enqueue);
 *   - it starts at the latest of: the end of its stream's previous op, the
 *     host's time when it was enqueued, the time of the event record it waits
 *     for, and, for a collective, the same over every rank of its group;
 *   - it ends its cost later: the profile's roofline for a kernel (the work
 *     its launch declared), bytes for a copy or memset (PCIe for host <->
 *     device), the ring model of coll_common.c for a collective.
 * A host wait (synchronize a stream or the device, an event) moves the host to
 * the modelled end of what it waited for, shown as a "sync:" slice on the
 * host's track. The stream workers run the ops for real in the meantime (the
 * math, the copies, the rendezvous); the model only reads their order. The
 * wall-clock times of each op stay in its trace args, for performance work. */
#include "runtime/profile.h"
#include "cpu/cpu_internal.h"
#include "runtime/util.h"

#include <stdio.h>

static const DeviceProfile *profile(const Dev *d) { return d->world->cfg.profile; }

double cpu_host_time_us(const Dev *d) { return d->host_us; }

void clock_host_call(Dev *d) { d->host_us += profile(d)->host_launch_us; }

void clock_enqueue(Dev *d, Op *op, int charged) {
    if (charged) clock_host_call(d);
    op->host_us = d->host_us;
}

double clock_kernel_cost(const Dev *d, const KernelCost *c) { return kernel_time_us(profile(d), c, d->world->cfg.tf32, d->world->cfg.price_ops); }

/* The overlap slowdown. A collective of c us slows compute that overlaps it by
 * 1 + s (s = overlap_slowdown): in c us of overlap the compute does c / (1 + s)
 * us of its work and loses c s / (1 + s), the debt a collective leaves. The
 * kernels queued on other streams after it pay it off, each at most s times
 * its own cost (it cannot be slowed more than that), until a wait for an event
 * recorded on the collective's stream says it is over: what is left then was
 * not overlapped, so nobody pays it. Program order only: the same on every run. */
void clock_coll_queued(Stream *s, double cost_us) {
    double slow = profile(s->dev)->overlap_slowdown;
    if (slow > 0) cpu_stream(s)->sm_debt_us += cost_us * slow / (1 + slow);
}

double clock_overlap(Stream *s, double cost_us) {
    const Dev *d = s->dev;
    double slow = profile(d)->overlap_slowdown, room = cost_us * slow, paid = 0;
    if (!(slow > 0)) return cost_us;
    for (int i = 0; i < d->nstreams && room > paid; i++) {
        CpuStream *o = cpu_stream(d->streams[i]);
        if (d->streams[i] == s || !(o->sm_debt_us > 0)) continue;
        double take = o->sm_debt_us < room - paid ? o->sm_debt_us : room - paid;
        o->sm_debt_us -= take;
        paid += take;
    }
    return cost_us + paid;
}

void clock_overlap_ends(Stream *s, int rec) {
    const Dev *d = s->dev;
    if (rec >= 0 && rec < d->nstreams && d->streams[rec] != s) cpu_stream(d->streams[rec])->sm_debt_us = 0;
}

/* Host <-> device (pcie 1 or 2) over the PCIe model; device -> device reads and writes its bytes. */
double clock_copy_cost(const Dev *d, size_t bytes, int pcie) {
    const WorldConfig *cfg = &d->world->cfg;
    if (pcie && cfg->pcie_gbps > 0) return cfg->pcie_latency_us + (double)bytes / (cfg->pcie_gbps * 1e9) * 1e6;
    const DeviceProfile *p = profile(d);
    return p->kernel_latency_us + 2.0 * (double)bytes / (p->hbm_bytes_s * p->eff_memory) * 1e6;
}

double clock_fill_cost(const Dev *d, size_t bytes) {
    const DeviceProfile *p = profile(d);
    return p->kernel_latency_us + (double)bytes / (p->hbm_bytes_s * p->eff_memory) * 1e6;
}

void clock_host_wait(Dev *d, double until_us, const char *what, const char *name) {
    if (!(until_us > d->host_us)) until_us = d->host_us; /* nothing to wait for: traced all the same (a hook that syncs) */
    if (d->scope.tracing) {
        char full[160];
        snprintf(full, sizeof full, "sync:%s%s", what, name ? name : "");
        TraceRec r = {.prefix = "", .name = dev_intern(d, full), .module = d->scope.module, .phase = d->scope.phase,
                      .cat = TRACE_CAT_HOST_SYNC, .stream = TRACE_HOST_TID, .step = d->scope.step, .ts = d->host_us,
                      .dur = until_us - d->host_us, .micro = d->scope.micro};
        dev_trace_add(d, &r);
        dev_enqueued_add(d, &r); /* the host's own: its time is already host order */
    }
    d->host_us = until_us;
}

/* op's trace record on s, under prefix and cat, from start_us to end_us (no wall-clock times). */
static TraceRec op_rec(const Stream *s, const Op *op, const char *prefix, const char *cat, double start_us,
                       double end_us) {
    return (TraceRec){.prefix = prefix, .name = op->name, .module = op->module, .phase = op->phase, .cat = cat,
                      .stream = s->index, .step = op->step, .ts = start_us, .dur = end_us - start_us,
                      .bytes = op->bytes, .micro = op->micro,
                      .dtype = op->kind == OP_COLL ? coll_dtype_name(op->coll.dtype) : NULL,
                      .group = op->kind == OP_COLL && op->pg ? op->pg->name : NULL,
                      .p2p = op->kind == OP_COLL && op->coll.kind == COLL_P2P ? op->label : NULL,
                      .op = op->kind == OP_COLL ? coll_op_name(op->coll.kind, op->coll.op) : NULL,
                      .flops = op->flops,
                      .kclass = op->kind == OP_LAUNCH && op->cls != COST_FREE ? cost_class_name(op->cls) : NULL,
                      .math = op->kind == OP_LAUNCH && op->cls != COST_FREE ? coll_dtype_name(op->math) : NULL};
}

void clock_trace_op(Stream *s, const Op *op, const char *prefix, const char *cat, double start_us, double end_us,
                    double wall0_us) {
    if (!op->traced) return;
    double wall1_us = now_us(), epoch = s->dev->world->epoch_us;
    TraceRec r = op_rec(s, op, prefix, cat, start_us, end_us);
    r.wall = 1;
    r.wall_ts = wall0_us - epoch;
    r.wall_dur = wall1_us - wall0_us;
    dev_trace_add(s->dev, &r);
}

void clock_log_enqueued(Stream *s, const Op *op) {
    if (!op->traced || !s->dev->partial_dir) return;
    const char *prefix = op->module, *cat = NULL;
    switch (op->kind) {
    case OP_LAUNCH: cat = TRACE_CAT_COMPUTE; break;
    case OP_COPY:
    case OP_MEMSET: cat = TRACE_CAT_COPY; break;
    case OP_RECORD: cat = TRACE_CAT_EVENT; break;
    case OP_COLL: /* as the worker names it (runtime_cpu.c: execute) */
        cat = TRACE_CAT_COLLECTIVE;
        prefix = op->coll.kind == COLL_P2P ? NULL : op->label;
        break;
    case OP_WAIT: /* traced only if it stalls, which the order alone does not tell */
    case OP_MARK: return;
    }
    TraceRec r = op_rec(s, op, prefix, cat, op->host_us, op->host_us);
    dev_enqueued_add(s->dev, &r);
}
