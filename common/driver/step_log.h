/* step_log.h — the per-step metrics: one JSON line per step in
 * <out>/metrics.jsonl (rank 0) and a progress line on stdout. */
#ifndef HWFSDP_STEP_LOG_H
#define HWFSDP_STEP_LOG_H

#include <stdio.h>

#include "driver/options.h"
#include "model/model.h"

/* A run priced on a device profile with a memory capacity (in practice a --dry-run with --device-profile
 * a100-80g or h100-sxm) whose allocations on a rank went past it during a step (dev_mem_watch_capacity; init is
 * not held to it: the driver materializes the whole model on every rank before fsdp_init shards it, where
 * torchtitan builds it on the meta device and materializes only the shards). A GPU would have stopped at that
 * allocation with CUDA's out-of-memory error; the run goes on instead, because a dry run's purpose is its report:
 * a configuration that does not fit still has a step time and a peak worth reading, and tools/simulate.py prints
 * them marked as not fitting. The lowest rank that went over says so in one line at the end of that step, once
 * for the run (step_log_write); metrics.jsonl's lines ("fits", this step) and run.json ("fits", the run) record it
 * beside "hbm_capacity_bytes". The exit status is then EXIT_OVER_CAPACITY: not 0, since the configuration cannot
 * train on that device and a script must not read the run as a go; not EXIT_FATAL (2: bad input, nothing
 * priced) either, so a caller tells "priced, does not fit" (every artifact written) from "failed". */
#define EXIT_OVER_CAPACITY 5

typedef struct {
    FILE *metrics;            /* rank 0 with --out; NULL otherwise */
    double *all;              /* [world] scratch for the host exchange */
    int over_capacity;        /* a rank went past the device's memory (dev_mem_over_capacity), said once */
} StepLog;

void step_log_open(StepLog *l, Dev *dev, const char *out_dir);
/* Mean loss over the ranks (loss_local: this rank's), the highest peak
 * memory and step time, on the wall clock (step_us) and on the world's clock
 * (model_step_us: dev_host_time_us; modelled on the CPU), a host exchange
 * every rank takes part in, outside the program's collectives; rank 0 writes
 * them (and stderr says which is not finite). On a profile with a memory
 * capacity, whether each rank stayed within it: the lowest rank that first
 * went past it prints its line (EXIT_OVER_CAPACITY) and
 * l->over_capacity is set on every rank. Returns 1 if the loss or the
 * grad norm is not finite. */
int step_log_write(StepLog *l, Dev *dev, const Options *o, const ModelRun *run, int step, double loss_local,
                   float grad_norm, double step_us, double model_step_us);
void step_log_close(StepLog *l);

#endif
