/* profile.h — device profiles: what the modelled clock (cpu/modelled_clock.c) prices
 * every op on. One row per device in profile.c, each number with its source;
 * --device-profile NAME picks one ("teach", the grader's, by default).
 *
 *   kernel   kernel_latency_us + max(flops / (peak of its math x efficiency of
 *            its class), bytes / (HBM bandwidth x memory efficiency))
 *   copy     device -> device: read + write at the HBM roofline; host <->
 *            device: the PCIe link (pcie_latency_us + bytes / pcie_gbs)
 *   memset   its bytes written at the HBM roofline
 *   collective  the ring model of its kind on the group's link (coll_common.c)
 *   host     host_launch_us per op it enqueues; a host wait moves it to the
 *            modelled end of what it waited for
 * and what the allocator holds it to: hbm_capacity_bytes, the device memory
 * a rank's allocations may take (alloc.c: dev_mem_watch_capacity). */
#ifndef HWFSDP_PROFILE_H
#define HWFSDP_PROFILE_H

#include <stddef.h>
#include <stdio.h>

#include "runtime/runtime.h"

typedef struct DeviceProfile {
    const char *name;          /* --device-profile NAME */
    const char *about;         /* one line: what it is */
    /* dense peaks, FLOP/s (the sparsity figures of datasheets are never used) */
    double peak_f32;           /* FP32 on CUDA cores */
    double peak_tf32;          /* TF32 tensor cores (a float32 matmul under --tf32) */
    double peak_bf16;          /* BF16 tensor cores */
    double hbm_bytes_s;        /* device memory bandwidth, bytes/s */
    size_t hbm_capacity_bytes; /* device memory, bytes: what a rank's allocations may hold at once (0: no limit) */
    /* the share of a peak a kernel of each class reaches (COST_MATMUL, COST_ATTENTION,
     * COST_ELEMENTWISE; COST_FREE takes no time), and of the HBM bandwidth */
    double eff[3];
    double eff_memory;
    /* a GEMM's efficiency by its shape (profile.c: gemm_efficiency; sm_count 0: eff[COST_MATMUL] for every shape) */
    int sm_count;              /* streaming multiprocessors: one output tile each per wave */
    int gemm_tile_m, gemm_tile_n; /* the output tile a large GEMM kernel computes per SM */
    double gemm_max_eff;       /* the best share of the BF16 peak a GEMM reaches at any shape (measured) */
    double gemm_typical;       /* the share of that best a model's large GEMMs reach (measured) */
    /* attention's measured share of the BF16 peak at sequence 2k, 4k, 8k, 16k (forward + backward, causal,
     * head dim 128; all 0: eff[COST_ATTENTION] for every length) */
    double attn_eff[4];
    /* the slowdown of compute that overlaps a collective (NCCL's kernels take SMs and memory bandwidth):
     * a kernel overlapping one runs 1 + overlap_slowdown times as long (cpu/modelled_clock.c) */
    double overlap_slowdown;
    double kernel_latency_us;  /* a kernel's, copy's or memset's fixed time on its stream */
    double host_launch_us;     /* the host's time to enqueue one op */
    /* the link model (--link-*, --inter-link-*, --pcie-* override them; coll_common.c: coll_link_time_us) */
    double link_gbps, link_latency_us;             /* within a node: a rank's bus bandwidth, Gbit/s each way, as
                                                    * NCCL's ring reaches it; us per ring step */
    double inter_link_gbps, inter_link_latency_us; /* between nodes: one NIC's bus bandwidth (each GPU has one);
                                                    * us per ring step that crosses nodes */
    double coll_latency_us;                        /* a collective's fixed time, however many steps */
    double pcie_gbs, pcie_latency_us;              /* host <-> device copies: GB/s each way, us per copy */
    const char *source;        /* where the numbers come from */
} DeviceProfile;

/* The profile called name, or NULL. */
const DeviceProfile *device_profile_find(const char *name);
/* Every profile's constants as a markdown table, and their sources (train --device-profile list). */
void device_profile_table(FILE *f);
/* The profiles' names, ", "-separated (for messages). */
const char *device_profile_names(void);
#define DEVICE_PROFILE_DEFAULT "teach"

/* What a kernel of cost c takes on profile p, in us (tf32: a float32 matmul may use TF32; price_ops: PriceOps,
 * runtime.h: as itself, or as the eager kernels it declares). */
double kernel_time_us(const DeviceProfile *p, const KernelCost *c, int tf32, int price_ops);
/* The share of the peak a GEMM of output [m, n] reaches on p (tile and wave quantisation under gemm_max_eff). */
double gemm_efficiency(const DeviceProfile *p, double m, double n);
/* The share of the BF16 peak attention at sequence length seq reaches on p. */
double attention_efficiency(const DeviceProfile *p, double seq);

#endif
