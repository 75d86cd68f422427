"""Bench sections of stage 10 (tools/bench.py): the backward prefetch policies and CPU offload.

Each runs stage 10's solution on the same weights and batches under several flags and reads what the runtime
recorded: metrics.jsonl (peak, loss), the memory snapshot (hook_memory records, the host pool) and the trace
(copies, collectives, and the last step on the modelled clock: the link and PCIe models' time is only there, the
wall clock holds none of it). Rendered by render(); numbers only, never asserted.
"""
import json
import os

from trace_names import COPY, D2H, H2D, label_and_kind
from trace_names import BACKWARD_PHASES  # the backward's phases and hooks (runtime/phase.h)
from trace_names import TAG_GRAD_SHARD, TAG_OPTIM_STATE, TAG_PARAM_SHARD  # the memory tags (MemTag)

from .figures import MIB, fmt_mib, runs_section
from .measure import CASE_LINK, first_stage, log, train_cases
from .traces import last_step_on_model_clock, trace_events



def _stage10():
    return first_stage(lambda s: s.backward_prefetch != "pre" or s.offload)


def _config(cfg):
    if cfg.get("quick"):
        return dict(flavor="tiny", world=2, batch=2, seq=32, steps=3)
    return dict(flavor="debugmodel", world=4, batch=2, seq=128, steps=6)


def _hook_notes(run_dir):
    with open(os.path.join(run_dir, "memory_rank0.json")) as fh:
        doc = json.load(fh)
    return doc, [e for e in doc["events"] if e.get("kind") == "hook_memory"]


def _losses_agree(rows):
    """The cases run one layout on the same batches and differ only in when things run (prefetch policy,
    streams, offloading the optimizer's state): the same sums in the same order, so their last losses are
    equal bit for bit on any machine."""
    return len({r["loss_last"] for r in rows}) == 1


def section_prefetch(bench, cfg):
    """The backward prefetch policies (stage 10's solution) on a slow link, with two comm streams and with one:
    rank 0's peak, the high-water inside the backward's hooks, the last step's exposed communication and step time
    on the modelled clock; the same loss everywhere."""
    st = _stage10()
    if st is None:
        return {"skipped": "no stage has a backward prefetch policy"}
    c = _config(cfg)
    link = ["--link-gbps", 1, "--link-latency-us", 50]
    cases = [("pre", ["--backward-prefetch", "pre"]), ("post", ["--backward-prefetch", "post"]),
             ("none", ["--backward-prefetch", "none"]),
             ("pre, one comm stream", ["--backward-prefetch", "pre", "--single-comm-stream"]),
             ("post, one comm stream", ["--backward-prefetch", "post", "--single-comm-stream"])]
    res = dict(c, solution=st.dir, link=" ".join(str(x) for x in link), rows=[])
    for name, flags, d, met in train_cases(bench, st, c, "prefetch", link, cases):
        _, notes = _hook_notes(d)
        back = [e for e in notes if e["hook"] in BACKWARD_PHASES and e["step"] >= 0]
        row = {"case": name, "flags": " ".join(flags),
               "peak_bytes_rank0": max(m["peak_mem_bytes_per_rank"][0] for m in met),
               "backward_high_bytes": max((e["high_water_bytes"] for e in back), default=0),
               "model": last_step_on_model_clock(d, met), "loss_last": met[-1]["loss"]}
        res["rows"].append(row)
        log("prefetch: %-22s peak %.2f MiB  backward high-water %.2f MiB  modelled: exposed comm %.3f ms (backward "
            "%.3f), step %.3f ms  loss %.6f" % (
                name, row["peak_bytes_rank0"] / MIB, row["backward_high_bytes"] / MIB, row["model"]["exposed_comm_ms"],
                row["model"]["exposed_comm_ms_by_phase"]["backward"], row["model"]["model_step_ms"], row["loss_last"]))
    res["losses_agree"] = _losses_agree(res["rows"])
    return res


def section_offload(bench, cfg):
    """CPU offload (stage 10's solution): without it, and with it over a fast and a slow PCIe model; rank 0's
    device peak, its host pool's peak, the device bytes of shards and optimizer state, the host-device copies
    of a step (trace) and the last step's exposed communication and step time on the modelled clock."""
    st = _stage10()
    if st is None:
        return {"skipped": "no stage offloads"}
    c = _config(cfg)
    cases = [("no offload", []), ("offload, PCIe 16 GB/s", ["--offload-params", "--pcie-gbps", 16,
                                                             "--pcie-latency-us", 10]),
             ("offload, PCIe 0.05 GB/s", ["--offload-params", "--pcie-gbps", 0.05, "--pcie-latency-us", 10])]
    res = dict(c, solution=st.dir, link=" ".join(str(x) for x in CASE_LINK), rows=[])
    for name, flags, d, met in train_cases(bench, st, c, "offload", CASE_LINK, cases):
        doc, notes = _hook_notes(d)
        kept = max((sum(e["exit_by_tag"].get(t, 0) for t in (TAG_PARAM_SHARD, TAG_GRAD_SHARD, TAG_OPTIM_STATE))
                    for e in notes), default=0)
        copies = {H2D: [0, 0], D2H: [0, 0]}
        for e in trace_events(d):
            _, kind = label_and_kind(e["name"])
            if e["pid"] == 0 and e.get("cat") == COPY and kind in copies and e["args"].get("step") == c["steps"] - 1:
                copies[kind][0] += 1
                copies[kind][1] += e["args"].get("bytes", 0)
        row = {"case": name, "flags": " ".join(str(f) for f in flags),
               "peak_bytes_rank0": max(m["peak_mem_bytes_per_rank"][0] for m in met),
               "host_peak_bytes_rank0": doc.get("host_peak_bytes", 0), "device_shard_state_bytes": kept,
               "h2d": copies[H2D], "d2h": copies[D2H],
               "model": last_step_on_model_clock(d, met), "loss_last": met[-1]["loss"]}
        res["rows"].append(row)
        log("offload: %-22s device peak %.2f MiB  host peak %.2f MiB  shards+state on device %.2f MiB  "
            "h2d %d (%.2f MB)  d2h %d (%.2f MB)  modelled: exposed comm %.3f ms, step %.3f ms  loss %.6f" % (
                name, row["peak_bytes_rank0"] / MIB, row["host_peak_bytes_rank0"] / MIB, kept / MIB,
                copies[H2D][0], copies[H2D][1] / 1e6, copies[D2H][0], copies[D2H][1] / 1e6,
                row["model"]["exposed_comm_ms"], row["model"]["model_step_ms"], row["loss_last"]))
    res["losses_agree"] = _losses_agree(res["rows"])
    return res


def render(L, R):
    """Append the sections' tables to the report lines L."""
    runs_section(L, R.get("prefetch", {}), "4e. Backward prefetch policy",
                 "The same weights and batches under each `--backward-prefetch` policy, link %(link)s. Backward "
                 "high-water: the most bytes allocated inside any backward hook (hook_memory records). Exposed "
                 "comm and step: rank 0's last step on the modelled clock (exposed: its compute stream's time in "
                 "collectives and waits; in the backward: the backward phases'). Losses %(losses)s.",
                 ["policy", "peak MiB", "backward high-water MiB", "modelled exposed comm ms (backward)",
                  "modelled step ms"],
                 lambda r: (r["case"], fmt_mib(r["peak_bytes_rank0"]), fmt_mib(r["backward_high_bytes"]),
                            "%.3f (%.3f)" % (r["model"]["exposed_comm_ms"],
                                             r["model"]["exposed_comm_ms_by_phase"]["backward"]),
                            "%.3f" % r["model"]["model_step_ms"]),
                 "Pre holds module i-1's all-gather buffer beside module i's params and grads (the backward's "
                 "high-water); post issues it once module i's reduce-scatter is queued; none not ahead at all. "
                 "With one comm stream post queues each all-gather behind the previous module's reduce-scatter, "
                 "which waits for that module's grads: the backward serializes. With two, the modelled host "
                 "(which pays only a launch cost per op and runs ahead of the device) enqueues the all-gathers at "
                 "almost the same time under every policy, and the all-gather stream's order decides. The memory "
                 "difference is one module's all-gather buffer; next to the debugmodel's activations it is small.")
    runs_section(L, R.get("offload", {}), "4f. CPU offload",
                 "Shards, grad shards and AdamW state in pinned host memory (`--offload-params`), link %(link)s. "
                 "Copies: rank 0's host-device copies of the last step (trace). Exposed comm and step: rank 0's last "
                 "step on the modelled clock (the PCIe model prices the copies). Losses %(losses)s.",
                 ["case", "device peak MiB", "host peak MiB", "shards + state on device MiB", "h2d (MB)",
                  "d2h (MB)", "modelled exposed comm ms", "modelled step ms"],
                 lambda r: (r["case"], fmt_mib(r["peak_bytes_rank0"]), fmt_mib(r["host_peak_bytes_rank0"]),
                            fmt_mib(r["device_shard_state_bytes"]), "%d (%.2f)" % (r["h2d"][0], r["h2d"][1] / 1e6),
                            "%d (%.2f)" % (r["d2h"][0], r["d2h"][1] / 1e6), "%.3f" % r["model"]["exposed_comm_ms"],
                            "%.3f" % r["model"]["model_step_ms"]),
                 "The device keeps only the modules at work, their comm buffers and the activations; every step "
                 "copies the shards in (once per all-gather) and the grad shards out. A slow PCIe link shows in "
                 "the step time once the copies no longer hide under compute (0.05 GB/s is deliberately slow: at "
                 "PCIe speeds the copies hide under this model's compute).")
