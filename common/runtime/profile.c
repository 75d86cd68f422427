/* profile.c — the device profiles (profile.h): one row per device.
 *
 * Datasheet figures are NVIDIA's (A100 80GB SXM4 and H100 SXM5 datasheets:
 * dense peaks, HBM bandwidth, NVLink and PCIe each way); inter-node links are
 * the InfiniBand adapter per GPU of a DGX A100 (HDR) and DGX H100 (NDR).
 * Efficiencies, latencies and the host's launch time are our assumptions, the
 * same for both GPUs, and stated as such:
 *   - a large GEMM reaches about 70 % of the dense peak (cuBLAS on big shapes);
 *   - attention about 40 % (fused attention kernels, forward and backward);
 *   - element-wise kernels are bandwidth-bound, at about 80 % of HBM (so are
 *     copies and memsets);
 *   - 3 us of fixed time per kernel, 4 us of host time per op enqueued (a CUDA
 *     launch from C), 3 us per ring hop on NVLink, 6 us across nodes, 5 us
 *     per PCIe copy.
 * Device memory (hbm_capacity_bytes), from the same datasheets: "80GB" of
 * HBM2e (A100 80GB SXM4) and of HBM3 (H100 SXM5 80GB). A DRAM die's capacity
 * is a power of two, so these are binary gigabytes: 5 active stacks (of the
 * package's 6 sites) of 16 GiB each (8 dies of 16 Gbit) = 80 GiB =
 * 85,899,345,920 bytes, the figure both rows use. It is the physical memory,
 * an upper bound on what allocations get: cudaMemGetInfo reports somewhat
 * less (the driver keeps a share), and a CUDA context, cuBLAS's workspace and
 * NCCL's buffers take more; none of that is modelled, so a configuration that
 * comes within a GiB or so of the capacity may still fail on the GPU, while
 * one reported over it surely does.
 * The "teach" profile is no real device: a small accelerator sized so that the
 * grading configuration (the tiny flavour, 128 tokens per rank, world 4) and
 * `make run` (the debugmodel, 256 tokens per rank) spend about as long on
 * their collectives as on their compute, so overlap and its absence both show;
 * its link is the rubric's 10 Gbit/s and 5 us per hop. It has no memory
 * capacity (0: no limit), so the grader's runs are never held to one. */
#include "runtime/profile.h"

#include <stdio.h>
#include <string.h>

/* 80 GiB: 5 HBM stacks x 16 GiB (the header comment: which bytes and why) */
#define HBM_80_GIB ((size_t)80 << 30)

static const DeviceProfile PROFILES[] = {
    {.name = "teach",
     .about = "the grader's teaching accelerator: compute and collectives of the same order",
     .peak_f32 = 100e9, .peak_tf32 = 100e9, .peak_bf16 = 200e9, .hbm_bytes_s = 100e9,
     .hbm_capacity_bytes = 0, /* no limit: not a real device */
     .eff = {1.0, 1.0, 1.0}, .eff_memory = 1.0,
     .kernel_latency_us = 1, .host_launch_us = 1,
     .link_gbps = 10, .link_latency_us = 5, .inter_link_gbps = 10, .inter_link_latency_us = 5,
     .pcie_gbs = 4, .pcie_latency_us = 5,
     .source = "chosen, not measured: peaks and efficiencies folded into one figure each (profile.c)"},
    {.name = "a100-80g",
     .about = "NVIDIA A100 80GB SXM4: NVLink 3 in a node, InfiniBand HDR between nodes",
     .peak_f32 = 19.5e12, .peak_tf32 = 156e12, .peak_bf16 = 312e12, .hbm_bytes_s = 2039e9,
     .hbm_capacity_bytes = HBM_80_GIB, /* datasheet: 80GB HBM2e = 5 stacks x 16 GiB */
     .eff = {0.7, 0.4, 0.8}, .eff_memory = 0.8,
     .kernel_latency_us = 3, .host_launch_us = 4,
     .link_gbps = 2400, .link_latency_us = 3, .inter_link_gbps = 200, .inter_link_latency_us = 6,
     .pcie_gbs = 32, .pcie_latency_us = 5,
     .source = "NVIDIA A100 datasheet (dense FP32 19.5, TF32 156, BF16 312 TFLOP/s; 80GB HBM2e (80 GiB) at 2,039 "
               "GB/s; NVLink 600 GB/s = 300 each way; PCIe Gen4 x16 32 GB/s each way); DGX A100: one HDR 200 Gb/s "
               "adapter per GPU; efficiencies and latencies assumed (profile.c)"},
    {.name = "h100-sxm",
     .about = "NVIDIA H100 SXM5 80GB: NVLink 4 in a node, InfiniBand NDR between nodes",
     .peak_f32 = 66.9e12, .peak_tf32 = 494.7e12, .peak_bf16 = 989.4e12, .hbm_bytes_s = 3350e9,
     .hbm_capacity_bytes = HBM_80_GIB, /* datasheet: 80GB HBM3 = 5 stacks x 16 GiB */
     .eff = {0.7, 0.4, 0.8}, .eff_memory = 0.8,
     .kernel_latency_us = 3, .host_launch_us = 4,
     .link_gbps = 3600, .link_latency_us = 3, .inter_link_gbps = 400, .inter_link_latency_us = 6,
     .pcie_gbs = 64, .pcie_latency_us = 5,
     .source = "NVIDIA H100 datasheet, SXM5 (dense FP32 66.9, TF32 494.7, BF16 989.4 TFLOP/s; 80GB HBM3 (80 GiB) "
               "at 3.35 TB/s; NVLink 900 GB/s = 450 each way; PCIe Gen5 x16 64 GB/s each way); DGX H100: one NDR "
               "400 Gb/s adapter per GPU; efficiencies and latencies assumed (profile.c)"},
};
#define N_PROFILES (sizeof PROFILES / sizeof PROFILES[0])


const DeviceProfile *device_profile_find(const char *name) {
    for (size_t i = 0; name && i < N_PROFILES; i++)
        if (strcmp(PROFILES[i].name, name) == 0) return &PROFILES[i];
    return NULL;
}

const char *device_profile_names(void) {
    static char names[256];
    if (!names[0]) {
        size_t n = 0;
        for (size_t i = 0; i < N_PROFILES; i++)
            n += (size_t)snprintf(names + n, sizeof names - n, "%s%s", i ? ", " : "", PROFILES[i].name);
    }
    return names;
}

double kernel_time_us(const DeviceProfile *p, const KernelCost *c, int tf32) {
    if (c->cls == COST_FREE) return 0.0;
    double peak = c->math == DTYPE_BF16 ? p->peak_bf16 : tf32 && c->cls == COST_MATMUL ? p->peak_tf32 : p->peak_f32;
    double math_s = c->flops / (peak * p->eff[c->cls]);
    double mem_s = c->bytes / (p->hbm_bytes_s * p->eff_memory);
    return p->kernel_latency_us + 1e6 * (math_s > mem_s ? math_s : mem_s);
}

const char *cost_class_name(CostClass c) {
    static const char *const names[COST_CLASS_COUNT] = {"matmul", "attention", "elementwise", "free"};
    return (unsigned)c < COST_CLASS_COUNT ? names[c] : "?";
}
