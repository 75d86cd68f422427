"""The runtime's Chrome traces (trace_rank<r>.json) summed by rank and step, and the link
model of common/runtime/collectives.c that the overlap section calibrates."""
import glob
import json
import os
from collections import defaultdict


def trace_events(run_dir):
    """The complete ("X") events of every rank's trace in run_dir."""
    events = []
    for path in sorted(glob.glob(os.path.join(run_dir, "trace_rank*.json"))):
        with open(path) as fh:
            events += [e for e in json.load(fh)["traceEvents"] if e.get("ph") == "X"]
    return events


def per_rank_step(events, pred):
    """{(rank, step0): summed duration in ms} of the events pred accepts."""
    out = defaultdict(float)
    for e in events:
        if pred(e):
            out[(e["pid"], e["args"].get("step", -1))] += e["dur"] / 1e3
    return out


# tid 0 is a rank's compute stream: time spent there in a collective or a wait is
# communication the step could not hide behind compute.
def is_compute(e):
    return e.get("cat") == "compute" and e["tid"] == 0


def is_exposed_comm(e):
    return e["tid"] == 0 and e.get("cat") in ("collective", "wait")


# ring passes per collective: an all-reduce is a reduce-scatter then an all-gather
COLL_FACTOR = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0}


def link_model_us(colls, W, gbps, latency_us):
    """The link model of common/runtime/collectives.c: a ring collective of `bytes` lasts
    (W-1)/W * bytes / bandwidth + (W-1) * latency (an all-reduce twice that)."""
    bw = gbps * 1e9 / 8.0
    return sum(COLL_FACTOR.get(kind, 1.0) * ((W - 1) / W * b / bw * 1e6 + (W - 1) * latency_us) for kind, b in colls)
