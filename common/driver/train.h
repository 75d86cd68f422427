/* train.h — one training job and the rank function that runs it. */
#ifndef HWFSDP_TRAIN_H
#define HWFSDP_TRAIN_H

#include "driver/options.h"
#include "model/data.h"

#define EXIT_NAN 4            /* the loss or the grad norm stopped being finite */

typedef struct {
    const Options *opt;
    const float *init;        /* [n_params_total] host copy of the initial weights */
    const float *init_exp_avg, *init_exp_avg_sq; /* [n_params_total] AdamW state when resuming, else NULL */
    int start_step;           /* 0, or the step a resumed checkpoint was saved at */
    const TokenData *data;
    int exit_code;            /* set by rank 0: 0, EXIT_NAN or EXIT_OVER_CAPACITY (step_log.h) */
    int over_capacity;        /* set by rank 0: a rank's allocations went past the device's memory (run.json "fits") */
    int flat;                 /* set by rank 0 after fsdp_init: some param is Flat (run.json "flat_units") */
} TrainJob;

/* world_run's rank function: set the rank up, train job->opt->steps steps
 * through the hooks of hw_fsdp.h, write the run's artifacts. arg: TrainJob. */
void train_rank(Dev *dev, void *arg);

#endif
