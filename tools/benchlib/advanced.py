"""Bench sections of stage 10 (tools/bench.py): the backward prefetch policies and CPU offload.

Each runs stage 10's solution on the same weights and batches under several flags and reads what the runtime
recorded: metrics.jsonl (step time, peak, loss), the memory snapshot (hook_memory records, the host pool) and the
trace (copies and collectives). Rendered by render(); numbers only, never asserted.
"""
import json
import os

from .figures import MIB, fmt_s, stats
from .measure import log, manifest
from .traces import trace_events

BACKWARD_PHASES = {"pre_backward", "backward", "post_backward", "finish_backward"}


def _stage10():
    return next((s for s in manifest.stages() if s.backward_prefetch != "pre" or s.offload), None)


def _config(cfg):
    if cfg.get("quick"):
        return dict(flavor="tiny", world=2, batch=2, seq=32, steps=3)
    return dict(flavor="debugmodel", world=4, batch=2, seq=128, steps=6)


def _run(bench, st, c, name, d, link, flags):
    return bench.train(bench.solution(st), d, "--flavor", c["flavor"], "--world", c["world"], "--batch-size",
                       c["batch"], "--seq-len", c["seq"], "--steps", c["steps"], "--profile-steps", c["steps"],
                       *link, *flags, what="%s %s" % (st.dir, name))


def _hook_notes(run_dir):
    with open(os.path.join(run_dir, "memory_rank0.json")) as fh:
        doc = json.load(fh)
    return doc, [e for e in doc["events"] if e.get("kind") == "hook_memory"]


def _group_members(group, world, shards):
    """World ranks of a group by its runtime name: world, shard<i> (a row of the mesh), replicate<j> (a column)."""
    if group.startswith("shard"):
        i = int(group[5:])
        return list(range(i * shards, (i + 1) * shards))
    if group.startswith("replicate"):
        return list(range(int(group[9:]), world, shards))
    return list(range(world))


def ring_us(kind, nbytes, n, gbps, lat_us):
    """The runtime's link model (collectives.c): a ring over n ranks; an all-reduce is two rings."""
    if n <= 1:
        return 0.0
    t = (n - 1) / n * nbytes / (gbps * 1e9 / 8) * 1e6 + (n - 1) * lat_us
    return 2 * t if kind == "all_reduce" else t


def section_hsdp(bench, cfg):
    """FSDP against HSDP (stage 09's solution) when the link between nodes is ten times slower than inside one:
    world 4 as 2 nodes of 2 ranks; rank 0's bytes of the last step inside a node and across nodes (trace), the
    link model's time for them, the param shards it keeps, its peak and the step time."""
    st = next((s for s in manifest.stages() if any(f.startswith("--mesh") for f in s.flags)), None)
    if st is None:
        return {"skipped": "no stage runs on a mesh"}
    c = dict(_config(cfg), world=4)
    intra, inter = (10, 5), (1, 50)
    link = ["--link-gbps", intra[0], "--link-latency-us", intra[1], "--inter-link-gbps", inter[0],
            "--inter-link-latency-us", inter[1], "--ranks-per-node", 2]
    cases = [("FSDP over the world", [], 4), ("HSDP --mesh 2,2", ["--mesh", "2,2"], 2),
             ("DDP --mesh 4,1", ["--mesh", "4,1"], 1)]
    res = dict(c, solution=st.dir, nodes="2 nodes of 2 ranks",
               link="inside a node %g Gbit/s, %g us; across nodes %g Gbit/s, %g us" % (intra + inter), rows=[])
    for name, flags, S in cases:
        d = os.path.join(bench.work, "hsdp", name.split()[0].lower())
        met = _run(bench, st, c, name, d, link, flags)
        inside = [0, 0.0]
        across = [0, 0.0]
        counts = {}
        for e in trace_events(d):
            if e["pid"] != 0 or e.get("cat") != "collective" or e["args"].get("step") != c["steps"] - 1:
                continue
            kind = e["name"].rsplit(".", 1)[-1]
            members = _group_members(e["args"].get("group", "world"), c["world"], S)
            counts[kind] = counts.get(kind, 0) + 1
            if len(members) < 2:
                continue  # a group of one rank moves nothing over a link
            spans = len({m // 2 for m in members}) > 1
            nbytes = e["args"].get("bytes", 0)
            gbps, lat = inter if spans else intra
            acc = across if spans else inside
            acc[0] += nbytes
            acc[1] += ring_us(kind, nbytes, len(members), gbps, lat)
        _, notes = _hook_notes(d)
        shard = max((e["exit_by_tag"].get("param_shard", 0) for e in notes), default=0)
        row = {"case": name, "flags": " ".join(flags), "bytes_inside_node": inside[0], "bytes_across_nodes": across[0],
               "model_ms_inside": inside[1] / 1e3, "model_ms_across": across[1] / 1e3, "collectives": counts,
               "param_shard_bytes": shard, "peak_bytes_rank0": max(m["peak_mem_bytes_per_rank"][0] for m in met),
               "step_ms": stats([m["step_ms"] for m in met if m["step"] > 1]), "loss_last": met[-1]["loss"]}
        res["rows"].append(row)
        log("hsdp: %-20s inside %.2f MB (%.1f ms)  across %.2f MB (%.1f ms)  shards %.2f MiB  peak %.2f MiB  "
            "step %s ms  loss %.6f" % (name, inside[0] / 1e6, inside[1] / 1e3, across[0] / 1e6, across[1] / 1e3,
                                       shard / MIB, row["peak_bytes_rank0"] / MIB, fmt_s(row["step_ms"], 1),
                                       row["loss_last"]))
    losses = {r["loss_last"] for r in res["rows"]}
    res["losses_agree"] = max(losses) - min(losses) <= 1e-5 * max(abs(x) for x in losses)
    return res


def section_prefetch(bench, cfg):
    """The backward prefetch policies (stage 10's solution) on a slow link, with two comm streams and with one:
    rank 0's peak, the high-water inside the backward's hooks, the step time; the same loss everywhere."""
    st = _stage10()
    if st is None:
        return {"skipped": "no stage has a backward prefetch policy"}
    c = _config(cfg)
    link = ["--link-gbps", 1, "--link-latency-us", 50]
    cases = [("pre", ["--backward-prefetch", "pre"]), ("post", ["--backward-prefetch", "post"]),
             ("none", ["--backward-prefetch", "none"]),
             ("pre, one comm stream", ["--backward-prefetch", "pre", "--single-comm-stream"]),
             ("post, one comm stream", ["--backward-prefetch", "post", "--single-comm-stream"])]
    res = dict(c, solution=st.dir, link="--link-gbps 1 --link-latency-us 50", rows=[])
    for name, flags in cases:
        d = os.path.join(bench.work, "prefetch", name.replace(", ", "_").replace(" ", "_"))
        met = _run(bench, st, c, name, d, link, flags)
        _, notes = _hook_notes(d)
        back = [e for e in notes if e["hook"] in BACKWARD_PHASES and e["step"] >= 0]
        row = {"case": name, "flags": " ".join(flags),
               "peak_bytes_rank0": max(m["peak_mem_bytes_per_rank"][0] for m in met),
               "backward_high_bytes": max((e["high_water_bytes"] for e in back), default=0),
               "step_ms": stats([m["step_ms"] for m in met if m["step"] > 1]), "loss_last": met[-1]["loss"]}
        res["rows"].append(row)
        log("prefetch: %-22s peak %.2f MiB  backward high-water %.2f MiB  step %s ms  loss %.6f" % (
            name, row["peak_bytes_rank0"] / MIB, row["backward_high_bytes"] / MIB, fmt_s(row["step_ms"], 1),
            row["loss_last"]))
    losses = {r["loss_last"] for r in res["rows"]}
    res["losses_agree"] = max(losses) - min(losses) <= 1e-6 * max(abs(x) for x in losses)
    return res


def section_offload(bench, cfg):
    """CPU offload (stage 10's solution): without it, and with it over a fast and a slow PCIe model; rank 0's
    device peak, its host pool's peak, the device bytes of shards and optimizer state, the host-device copies
    of a step (trace) and the step time."""
    st = _stage10()
    if st is None:
        return {"skipped": "no stage offloads"}
    c = _config(cfg)
    link = ["--link-gbps", 10, "--link-latency-us", 5]
    cases = [("no offload", []), ("offload, PCIe 16 GB/s", ["--offload-params", "--pcie-gbps", 16,
                                                             "--pcie-latency-us", 10]),
             ("offload, PCIe 0.05 GB/s", ["--offload-params", "--pcie-gbps", 0.05, "--pcie-latency-us", 10])]
    res = dict(c, solution=st.dir, link="--link-gbps 10 --link-latency-us 5", rows=[])
    for name, flags in cases:
        d = os.path.join(bench.work, "offload", name.replace(", ", "_").replace(" ", "_").replace("/", ""))
        met = _run(bench, st, c, name, d, link, flags)
        doc, notes = _hook_notes(d)
        kept = max((sum(e["exit_by_tag"].get(t, 0) for t in ("param_shard", "grad_shard", "optim_state"))
                    for e in notes), default=0)
        copies = {"h2d": [0, 0], "d2h": [0, 0]}
        for e in trace_events(d):
            kind = e["name"].rsplit(".", 1)[-1]
            if e["pid"] == 0 and e.get("cat") == "copy" and kind in copies and e["args"].get("step") == c["steps"] - 1:
                copies[kind][0] += 1
                copies[kind][1] += e["args"].get("bytes", 0)
        row = {"case": name, "flags": " ".join(str(f) for f in flags),
               "peak_bytes_rank0": max(m["peak_mem_bytes_per_rank"][0] for m in met),
               "host_peak_bytes_rank0": doc.get("host_peak_bytes", 0), "device_shard_state_bytes": kept,
               "h2d": copies["h2d"], "d2h": copies["d2h"],
               "step_ms": stats([m["step_ms"] for m in met if m["step"] > 1]), "loss_last": met[-1]["loss"]}
        res["rows"].append(row)
        log("offload: %-22s device peak %.2f MiB  host peak %.2f MiB  shards+state on device %.2f MiB  "
            "h2d %d (%.2f MB)  d2h %d (%.2f MB)  step %s ms  loss %.6f" % (
                name, row["peak_bytes_rank0"] / MIB, row["host_peak_bytes_rank0"] / MIB, kept / MIB,
                copies["h2d"][0], copies["h2d"][1] / 1e6, copies["d2h"][0], copies["d2h"][1] / 1e6,
                fmt_s(row["step_ms"], 1), row["loss_last"]))
    losses = {r["loss_last"] for r in res["rows"]}
    res["losses_agree"] = max(losses) - min(losses) <= 1e-6 * max(abs(x) for x in losses)
    return res


def render(L, R, table):
    """Append the sections' tables to the report lines L (table: report.table)."""
    h = R.get("hsdp", {})
    if h.get("rows"):
        L.append("## 4c'. FSDP against HSDP on a slow inter-node link (%s, %s, world %d as %s, batch %d × seq %d "
                 "per rank, rank 0, %d steps)" % (h["solution"], h["flavor"], h["world"], h["nodes"], h["batch"],
                                                  h["seq"], h["steps"]))
        L.append("")
        L.append("Link model: %s. Bytes: rank 0's collectives of the last step (trace), split by whether the "
                 "collective's group spans nodes (a group of one rank moves nothing); model ms: the link model's time for them, one after another. "
                 "Losses %s." % (h["link"], "agree" if h["losses_agree"] else "DIFFER (a bug)"))
        L.append("")
        table(L, ["case", "MB inside a node", "MB across nodes", "model ms inside", "model ms across",
                  "param shards MiB", "peak MiB", "step ms"],
              [(r["case"], "%.2f" % (r["bytes_inside_node"] / 1e6), "%.2f" % (r["bytes_across_nodes"] / 1e6),
                "%.1f" % r["model_ms_inside"], "%.1f" % r["model_ms_across"], "%.2f" % (r["param_shard_bytes"] / MIB),
                "%.2f" % (r["peak_bytes_rank0"] / MIB), fmt_s(r["step_ms"], 1)) for r in h["rows"]])
        L.append("")
        L.append("FSDP over the world sends every all-gather and reduce-scatter around a ring that crosses the "
                 "slow link; HSDP keeps them inside the node and sends only the grad shards' all-reduce across "
                 "(1/S of the model, twice), at the price of param shards 1/S of the model instead of 1/W; DDP "
                 "keeps the whole model and all-reduces all of it across.")
        L.append("")
    p = R.get("prefetch", {})
    if p.get("rows"):
        L.append("## 4d. Backward prefetch policy (%s, %s, world %d, batch %d × seq %d per rank, rank 0, %d steps)"
                 % (p["solution"], p["flavor"], p["world"], p["batch"], p["seq"], p["steps"]))
        L.append("")
        L.append("The same weights and batches under each `--backward-prefetch` policy, link %s. Backward "
                 "high-water: the most bytes allocated inside any backward hook (hook_memory records). Losses %s."
                 % (p["link"], "agree" if p["losses_agree"] else "DIFFER (a bug)"))
        L.append("")
        table(L, ["policy", "peak MiB", "backward high-water MiB", "step ms"],
              [(r["case"], "%.2f" % (r["peak_bytes_rank0"] / MIB), "%.2f" % (r["backward_high_bytes"] / MIB),
                fmt_s(r["step_ms"], 1)) for r in p["rows"]])
        L.append("")
        L.append("Pre holds module i-1's all-gather buffer beside module i's params and grads (the backward's "
                 "high-water); post issues it once module i's reduce-scatter is queued; none not ahead at all. "
                 "With one comm stream post queues each all-gather behind the previous module's reduce-scatter, "
                 "which waits for that module's grads: the backward serializes. The memory difference is one module's "
                 "all-gather buffer; next to the debugmodel's activations it is small.")
        L.append("")
    o = R.get("offload", {})
    if o.get("rows"):
        L.append("## 4e. CPU offload (%s, %s, world %d, batch %d × seq %d per rank, rank 0, %d steps)" % (
            o["solution"], o["flavor"], o["world"], o["batch"], o["seq"], o["steps"]))
        L.append("")
        L.append("Shards, grad shards and AdamW state in pinned host memory (`--offload-params`), link %s. "
                 "Copies: rank 0's host-device copies of the last step (trace). Losses %s."
                 % (o["link"], "agree" if o["losses_agree"] else "DIFFER (a bug)"))
        L.append("")
        table(L, ["case", "device peak MiB", "host peak MiB", "shards + state on device MiB", "h2d (MB)",
                  "d2h (MB)", "step ms"],
              [(r["case"], "%.2f" % (r["peak_bytes_rank0"] / MIB), "%.2f" % (r["host_peak_bytes_rank0"] / MIB),
                "%.2f" % (r["device_shard_state_bytes"] / MIB), "%d (%.2f)" % (r["h2d"][0], r["h2d"][1] / 1e6),
                "%d (%.2f)" % (r["d2h"][0], r["d2h"][1] / 1e6), fmt_s(r["step_ms"], 1)) for r in o["rows"]])
        L.append("")
        L.append("The device keeps only the modules at work, their comm buffers and the activations; every step "
                 "copies the shards in (once per all-gather) and the grad shards out. A slow PCIe link shows in "
                 "the step time once the copies no longer hide under compute (0.05 GB/s is deliberately slow: at "
                 "PCIe speeds the copies hide under this model's compute).")
        L.append("")
