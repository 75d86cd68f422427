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
    double kernel_latency_us;  /* a kernel's, copy's or memset's fixed time on its stream */
    double host_launch_us;     /* the host's time to enqueue one op */
    /* the link model (--link-*, --inter-link-*, --pcie-* override them) */
    double link_gbps, link_latency_us;             /* within a node: Gbit/s each way per rank, us per ring hop */
    double inter_link_gbps, inter_link_latency_us; /* between nodes */
    double pcie_gbs, pcie_latency_us;              /* host <-> device copies: GB/s each way, us per copy */
    const char *source;        /* where the numbers come from */
} DeviceProfile;

/* The profile called name, or NULL. */
const DeviceProfile *device_profile_find(const char *name);
/* The profiles' names, ", "-separated (for messages). */
const char *device_profile_names(void);
#define DEVICE_PROFILE_DEFAULT "teach"

/* What a kernel of cost c takes on profile p, in us (tf32: a float32 matmul may use TF32). */
double kernel_time_us(const DeviceProfile *p, const KernelCost *c, int tf32);

#endif
