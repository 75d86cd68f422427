/* train_main.c — the training binary every FSDP implementation links with:
 * flags, initial weights (seed or --load), the token data and the world;
 * then every rank runs train_rank (train_step.c), which calls the hooks of
 * hw_fsdp.h exactly as PyTorch autograd calls FSDP2's. */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "driver/checkpoint.h"
#include "driver/options.h"
#include "driver/train.h"
#include "model/data.h"
#include "model/model.h"
#include "runtime/runtime.h"
#include "runtime/util.h"

/* run.json: the run's configuration, for plots, the grader and references. */
static const char *dtype_flag(DType t) { return t == DTYPE_BF16 ? "bf16" : "fp32"; }

static void write_run_json(const Options *o, const Model *m) {
    char path[4096];
    snprintf(path, sizeof path, "%s/run.json", o->out_dir);
    char host[256] = "unknown";
    gethostname(host, sizeof host - 1);
    char buf[4096], mesh[48] = "null";
    if (o->mesh_replicas) snprintf(mesh, sizeof mesh, "[%d,%d]", o->mesh_replicas, o->mesh_shards);
    const ModelConfig *c = &m->cfg;
    int n = snprintf(buf, sizeof buf,
                     "{\"flavor\":\"%s\",\"dim\":%d,\"n_layers\":%d,\"n_heads\":%d,\"n_kv_heads\":%d,"
                     "\"vocab_size\":%d,\"hidden_dim\":%d,\"multiple_of\":%d,\"n_params\":%zu,"
                     "\"seq_len\":%zu,\"batch_size\":%zu,\"steps\":%d,\"world_size\":%d,\"backend\":\"%s\","
                     "\"device\":\"%s\",\"lr\":%g,\"warmup_steps\":%d,\"weight_decay\":%g,\"max_norm\":%g,"
                     "\"seed\":%llu,\"data\":\"%s\",\"ac\":%s,\"reshard_after_forward\":%s,\"forward_only\":%s,"
                     "\"grad_accum\":%d,\"grad_sync\":\"%s\",\"reshard_after_backward\":%s,"
                     "\"param_dtype\":\"%s\",\"reduce_dtype\":\"%s\",\"mesh\":%s,"
                     "\"link_gbps\":%g,\"link_latency_us\":%g,\"ranks_per_node\":%d,\"inter_link_gbps\":%g,"
                     "\"inter_link_latency_us\":%g,\"backward_prefetch\":\"%s\",\"single_comm_stream\":%s,"
                     "\"offload_params\":%s,\"pcie_gbps\":%g,\"pcie_latency_us\":%g,\"profile_steps\":%d,\"host\":\"%s\"}\n",
                     o->flavor, c->dim, c->n_layers, c->n_heads, c->n_kv_heads, c->vocab_size, c->hidden_dim,
                     c->multiple_of, m->n_params_total, o->seq_len, o->batch_size, o->steps, o->world.world_size,
                     backend_name(o->world.backend), dev_is_cuda_build() ? "cuda" : "cpu", (double)o->optim.lr, o->optim.warmup_steps,
                     (double)o->optim.weight_decay, (double)o->optim.max_norm, (unsigned long long)o->seed,
                     o->data_path, o->ac ? "true" : "false", o->reshard_after_forward ? "true" : "false",
                     o->forward_only ? "true" : "false", o->grad_accum, o->grad_sync_every ? "every" : "last",
                     o->reshard_after_backward ? "true" : "false", dtype_flag(o->mp.param_dtype),
                     dtype_flag(o->mp.reduce_dtype), mesh, o->world.link_gbps, o->world.link_latency_us,
                     o->world.ranks_per_node ? o->world.ranks_per_node : o->world.world_size, o->world.inter_link_gbps,
                     o->world.inter_link_latency_us,
                     backward_prefetch_name(o->backward_prefetch),
                     o->single_comm_stream ? "true" : "false", o->offload_params ? "true" : "false", o->world.pcie_gbps,
                     o->world.pcie_latency_us, o->profile_steps, host);
    write_file_atomic(path, buf, (size_t)n);
}

int main(int argc, char **argv) {
    Options o;
    parse_options(argc, argv, &o);
    Model *m = model_create(&o.model);
    float *init = xmalloc(m->n_params_total * sizeof(float)), *exp_avg = NULL, *exp_avg_sq = NULL;
    int start_step = 0;
    if (o.load_path) start_step = checkpoint_load(m, o.load_path, init, &exp_avg, &exp_avg_sq);
    else model_init_host(m, o.seed, init);
    if (o.save_init_path) {
        checkpoint_save(m, o.save_init_path, init, NULL, NULL, 0);
        printf("wrote initial weights (%zu parameters) to %s\n", m->n_params_total, o.save_init_path);
        free(init);
        model_destroy(m);
        return 0;
    }
    TokenData data = data_load(o.data_path);
    data_check(&data, o.seq_len, o.model.vocab_size);
    World *w = world_create(&o.world);
    if (o.out_dir) {
        make_dirs(o.out_dir);
        if (world_first_local_rank(w) == 0) write_run_json(&o, m);
    }
    if (start_step > 0 && !o.quiet)
        printf("resuming from %s at step %d (optimizer state restored)\n", o.load_path, start_step);
    TrainJob job = {&o, init, exp_avg, exp_avg_sq, start_step, &data, 0};
    world_run(w, train_rank, &job);
    world_destroy(w);
    data_free(&data);
    free(init);
    free(exp_avg);
    free(exp_avg_sq);
    model_destroy(m);
    return job.exit_code;
}
