/* step_log.h — the per-step metrics: one JSON line per step in
 * <out>/metrics.jsonl (rank 0) and a progress line on stdout. */
#ifndef HWFSDP_STEP_LOG_H
#define HWFSDP_STEP_LOG_H

#include <stdio.h>

#include "driver/options.h"
#include "model/model.h"

typedef struct {
    FILE *metrics;            /* rank 0 with --out; NULL otherwise */
    double *all;              /* [world] scratch for the host exchange */
} StepLog;

void step_log_open(StepLog *l, Dev *dev, const char *out_dir);
/* Mean loss over the ranks (loss_local: this rank's), the highest peak
 * memory and step time, on the wall clock (step_us) and on the world's clock
 * (model_step_us: dev_host_time_us; modelled on the CPU), a host exchange
 * every rank takes part in, outside the program's collectives; rank 0 writes
 * them (and stderr says which is not finite). Returns 1 if the loss or the
 * grad norm is not finite. */
int step_log_write(StepLog *l, Dev *dev, const Options *o, const ModelRun *run, int step, double loss_local,
                   float grad_norm, double step_us, double model_step_us);
void step_log_close(StepLog *l);

#endif
