"""The runtime's Chrome traces (trace_rank<r>.json) summed by rank and step, the process groups
they name, and the figures of one step on the modelled clock.

Every event's ts/dur is on the modelled clock (common/cpu/modelled_clock.c): the same on every run,
whatever the load. A collective's dur is the link model's time for it (coll_common.c
coll_link_time_us), a host-device copy's the PCIe model's, a kernel's the device profile's roofline for
the FLOPs it declared (args.flops); the wall-clock times are in args.wall_ts_us / wall_dur_us. The
profile the run was priced on is in the trace's otherData (device_profile, peak_flops, hbm_bytes_per_s).
"""
from gradelib.trace_model import RunDir, exposed_comm, is_compute_kernel
from trace_names import COLLECTIVE, COMPUTE


def trace_events(run_dir):
    """The complete ("X") events of every rank's trace in run_dir."""
    return RunDir(run_dir).events()


def trace_meta(run_dir):
    """The otherData of rank 0's trace: clock, device_profile, peak_flops {f32, tf32, bf16}, hbm_bytes_per_s."""
    return RunDir(run_dir).meta


def matmul_math(rj):
    """The math the matmuls of a run declared (its run.json): 'bf16' under --param-dtype bf16, 'tf32' under
    --tf32, 'f32' otherwise; the key of otherData.peak_flops they were priced at."""
    if rj.get("param_dtype") == "bf16":
        return "bf16"
    return "tf32" if rj.get("tf32") else "f32"


def step_on_model_clock(run_dir, step, model_step_ms, rank=0, events=None):
    """One rank's figures of one step (0-based) on the modelled clock, from run_dir's traces and the step's
    modelled time (metrics.jsonl model_step_ms: the max over ranks):
      exposed_comm_ms            the compute stream's time in collectives and waits (trace_model.exposed_comm)
      exposed_comm_ms_by_phase   the same by forward / backward / other
      exposed_comm_fraction      exposed_comm_ms / model_step_ms
      compute_ms                 the compute stream's time in kernels
      collective_ms              the rank's collectives on every stream (the link model's time for them)
      kernel_flops               the FLOPs its kernels declared (args.flops), every stream
      math, peak_flops           the matmuls' math (matmul_math) and the profile's peak for it (otherData)
      kernel_flops_over_peak     kernel_flops / (model_step_ms * peak_flops)"""
    run = RunDir(run_dir)
    rj, meta = run.run_json, run.meta
    math = matmul_math(rj)
    peak = meta["peak_flops"][math]
    ev = [e for e in (run.events() if events is None else events)
          if e["pid"] == rank and e["args"].get("step") == step]
    by_phase = {k: us / 1e3 for k, us in exposed_comm(ev).items()}
    flops = sum(e["args"].get("flops", 0) for e in ev if e.get("cat") == COMPUTE)
    exposed = sum(by_phase.values())
    return {"rank": rank, "step": step + 1, "device_profile": meta["device_profile"], "model_step_ms": model_step_ms,
            "exposed_comm_ms": exposed, "exposed_comm_ms_by_phase": by_phase,
            "exposed_comm_fraction": exposed / model_step_ms,
            "compute_ms": sum(e["dur"] for e in ev if is_compute_kernel(e)) / 1e3,
            "collective_ms": sum(e["dur"] for e in ev if e.get("cat") == COLLECTIVE) / 1e3,
            "kernel_flops": flops, "math": math, "peak_flops": peak,
            "kernel_flops_over_peak": flops / (model_step_ms / 1e3 * peak)}


def last_step_on_model_clock(run_dir, metrics, rank=0):
    """step_on_model_clock of a run's last step (metrics: its metrics.jsonl; the step must be traced): on the
    modelled clock every run of a configuration gives the same figures, so one step says it all."""
    m = metrics[-1]
    return step_on_model_clock(run_dir, m["step"] - 1, m["model_step_ms"], rank)
