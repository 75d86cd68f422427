/* facts.h — what a run used, stated once (facts.c): the process groups, the mesh, the pipeline's stage map
 * and the vocabularies, as trace.json's otherData and run.json carry them (keys "groups", "device_mesh",
 * "pipeline", "vocab"). The groups are recorded as ranks make them (group.c); the driver states the mesh
 * and each rank's pipeline stage. */
#ifndef HWFSDP_FACTS_H
#define HWFSDP_FACTS_H

#include "runtime/json.h"
#include "runtime/runtime.h"

/* The mesh this rank built: ndim dims of shape[i] ranks, named dim_names[i] ("replicate", "shard"). */
void dev_fact_mesh(Dev *d, int ndim, const int *shape, const char *const *dim_names);
/* --pp: this rank holds stage `stage` of `stages`: the n_modules modules named modules[] (forward order), held
 * by the nranks ranks from first_rank (executed or not). */
void dev_fact_pipe_stage(Dev *d, int stage, int stages, const char *const *modules, int n_modules, int first_rank,
                         int nranks);
/* The facts as keys of an open JSON object: "groups" [{name, kind, ranks}], "device_mesh" {shape, dims}
 * or null ("mesh" is the --mesh flag's own run.json key), "pipeline" [{stage, modules: [name, ...],
 * ranks}] or null, "vocab" {phases, mem_tags, collective_kinds}. */
void world_facts_json(World *w, Json *j);

#endif
