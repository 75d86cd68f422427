"""The runtime's Chrome traces (trace_rank<r>.json) summed by rank and step, the process groups
they name, and the link model of common/runtime/collectives.c (the overlap section calibrates it,
the HSDP section predicts its collectives' time with it)."""
import glob
import json
import os
from collections import defaultdict

from trace_names import ALL_GATHER, ALL_REDUCE, COLLECTIVE, COMPUTE, COMPUTE_TID, REDUCE_SCATTER, WAIT


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


# time a rank's compute stream spends in a collective or a wait is communication the step could not
# hide behind compute.
def is_compute(e):
    return e.get("cat") == COMPUTE and e["tid"] == COMPUTE_TID


def is_exposed_comm(e):
    return e["tid"] == COMPUTE_TID and e.get("cat") in (COLLECTIVE, WAIT)


# ring passes per collective: an all-reduce is a reduce-scatter then an all-gather
COLL_FACTOR = {ALL_GATHER: 1.0, REDUCE_SCATTER: 1.0, ALL_REDUCE: 2.0}


def ring_us(kind, nbytes, n, gbps, latency_us):
    """One collective of `nbytes` (the whole gathered / scattered / reduced buffer) over a ring of n ranks
    in the link model: (n-1)/n * bytes / bandwidth + (n-1) * latency, twice for an all-reduce; a group of
    one rank moves nothing."""
    if n <= 1:
        return 0.0
    bw = gbps * 1e9 / 8.0
    return COLL_FACTOR.get(kind, 1.0) * ((n - 1) / n * nbytes / bw * 1e6 + (n - 1) * latency_us)


def link_model_us(colls, W, gbps, latency_us):
    """The link model of common/runtime/collectives.c for [(kind, bytes)] collectives over all W ranks."""
    return sum(ring_us(kind, b, W, gbps, latency_us) for kind, b in colls)


def group_members(name, world, mesh=None):
    """The ranks of the process group a trace names (args.group): "world"; under --mesh R,S "shard<i>",
    row i of the mesh (ranks i*S .. i*S+S-1), or "replicate<j>", column j (ranks j, S+j, 2S+j, ...)."""
    S = mesh[1] if mesh else world
    if name == "world":
        return list(range(world))
    if name.startswith("shard"):
        i = int(name[len("shard"):])
        return list(range(i * S, (i + 1) * S))
    if name.startswith("replicate"):
        return list(range(int(name[len("replicate"):]), world, S))
    raise ValueError("unknown process group %r" % name)
