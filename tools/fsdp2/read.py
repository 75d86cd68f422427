"""What make fsdp2-check reads of the two runs: the C run's metrics, safetensors and trace (its collectives,
backward all-gather issue points, pipeline pass orders and point-to-point transfers, in the grader's
parsing), and the same from FSDP2's records, both named as the C runtime names its groups.
"""
import json
import os

from trace_names import (ALL_GATHER, ALL_REDUCE, BACKWARD_PHASES, COLLECTIVE, COMPUTE, FORWARD_PHASES, REDUCE_SCATTER,
                         label_and_kind)

from gradelib.trace_model import passes_ran, read_trace

from .runner import Failure


def read_jsonl(path):
    with open(path) as fh:
        return [json.loads(l) for l in fh if l.strip()]


def read_safetensors(path):
    """{name: float32 numpy array} of a safetensors file: tools/torch_llama.py's reader (the tool runs
    under a python with torch, see ensure_torch)."""
    import torch_llama
    try:
        return torch_llama.read_safetensors_arrays(path)
    except ValueError as e:
        raise Failure(str(e))


GRAD_NORM = "grad_norm"  # the label of the grad norm's all-reduce in the C trace, its module name in FSDP2's


def group_name(ranks, groups):
    """The C run's name of the process group of these global ranks: the group of run.json's "groups" (what the
    runtime made: the world, a mesh's shard<i> and replicate<j>, the pipeline's stage<p>; trace_model.runtime_groups)
    with exactly these ranks, a mesh's or stage's before the world (under --mesh 4,1 a column is every rank); any
    other set: "ranks a,b,..", which no C trace names (the comparison then differs)."""
    ranks = sorted(int(r) for r in ranks)
    for name, members in sorted(groups.items(), key=lambda kv: kv[0] == "world"):
        if sorted(members) == ranks:
            return name
    return "ranks " + ",".join(str(r) for r in ranks)


def group_size(name, groups):
    """How many ranks the group of a C trace name holds (group_name's "ranks a,b,.." included)."""
    if name.startswith("ranks "):
        return len(name.split(" ", 1)[1].split(","))
    return len(groups[name])


def c_collective_events(cdir, rank):
    """The collective events of the C run's trace_rank<r>.json, each with its label and kind ('<label>.<kind>')."""
    return [(e, *label_and_kind(e["name"])) for e in read_trace_events(cdir, rank)
            if e.get("cat") == COLLECTIVE and "name" in e]


def c_collectives(cdir, world, modules):
    """Per rank {(step, microbatch, module, kind, phase, group, dtype, bytes): count} of the C trace (the grader's
    parsing): the modules' all-gathers, reduce-scatters and all-reduces, and the grad norm's all-reduce."""
    per_rank = []
    for r in range(world):
        counts = {}
        for e, label, kind in c_collective_events(cdir, r):
            if kind not in (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE):
                continue
            if label not in modules and (label, kind) != (GRAD_NORM, ALL_REDUCE):
                continue  # the checkpoint's gathers
            a = e.get("args", {})
            phase = a.get("phase")
            phase = "forward" if phase in FORWARD_PHASES else "backward" if phase in BACKWARD_PHASES else phase
            key = (a["step"], a.get("microbatch", -1), label, kind, phase, a.get("group", "world"),
                   a.get("dtype", "f32"), a.get("bytes", -1))
            counts[key] = counts.get(key, 0) + 1
        per_rank.append(counts)
    return per_rank


def torch_collectives(ranks, profiled_steps, groups):
    """FSDP2's counts per rank, keyed as c_collectives' (the groups' ranks named by group_name)."""
    out = []
    for rk in ranks:
        counts = {}
        for c in rk["collectives"]:
            if c["step"] < profiled_steps or c["step"] < 0:
                group = group_name(c["group"].split(","), groups)
                key = (c["step"], c["microbatch"], c["module"], c["kind"], c["phase"], group, c["dtype"],
                       c.get("bytes", -1))
                counts[key] = counts.get(key, 0) + c["count"]
        out.append(counts)
    return out


def without_single_rank_groups(per_rank, groups):
    """(counts without the collectives in a group of one rank, how many were left out); any key whose element
    5 is the group."""
    kept, left_out = [], 0
    for counts in per_rank:
        k = {}
        for key, n in counts.items():
            if group_size(key[5], groups) == 1:
                left_out += n
            else:
                k[key] = n
        kept.append(k)
    return kept, left_out


def c_backward_gathers(cdir, world, modules):
    """Per rank {(step, microbatch, module gathered, hook module, hook phase): count} of the all-gathers the C
    trace has in the backward: args.module and args.phase name the host hook that issued each."""
    per_rank = []
    for r in range(world):
        counts = {}
        for e, label, kind in c_collective_events(cdir, r):
            a = e.get("args", {})
            if kind != ALL_GATHER or label not in modules or a.get("phase") not in BACKWARD_PHASES:
                continue
            key = (a["step"], a.get("microbatch", -1), label, a.get("module", "?"), a["phase"])
            counts[key] = counts.get(key, 0) + 1
        per_rank.append(counts)
    return per_rank


def torch_backward_gathers(ranks, profiled_steps):
    return [{(g["step"], g["microbatch"], g["module"], g["hook_module"], g["hook_phase"]): g["count"]
             for g in rk.get("backward_all_gathers", []) if g["step"] < profiled_steps} for rk in ranks]


def _int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def read_trace_events(cdir, rank):
    """The slices of the C run's trace_rank<r>.json (gradelib.trace_model, the one reader of traces)."""
    return read_trace(os.path.join(cdir, "trace_rank%d.json" % rank)).events


def c_pass_orders(events):
    """{step: [(F | B, microbatch), ..]}: the forwards and backwards whose kernels ran in each step, in time order
    (trace_model.passes_ran, the grader's pp_schedule reading: a recompute's kernels are not a pass)."""
    steps = sorted({e["args"]["step"] for e in events if e.get("cat") == COMPUTE
                    and _int(e.get("args", {}).get("step"))})
    out = {s: passes_ran(events, s) for s in steps}
    return {s: o for s, o in out.items() if o}


def parse_p2p(text):
    """A p2p event's args.p2p, "send 2 0 act;recv 2 1 grad", as [(send | recv, peer, microbatch, label), ..]."""
    items = []
    for item in text.split(";"):
        f = item.split()
        if len(f) != 4 or f[0] not in ("send", "recv"):
            raise Failure("a p2p item %r: not 'send|recv peer microbatch label'" % item)
        try:
            items.append((f[0], int(f[1]), int(f[2]), f[3]))
        except ValueError:
            raise Failure("a p2p item %r: peer and microbatch are not numbers" % item)
    return items


def c_p2p_groups(events):
    """{step: [group, ..]}: each p2p event of a rank's trace (a dev_group, or a lone send or receive) as its
    items (parse_p2p), in the trace's order."""
    out = {}
    for e in events:
        a = e.get("args", {})
        if e.get("ph") == "X" and e.get("cat") == COLLECTIVE and a.get("p2p") and _int(a.get("step")):
            out.setdefault(a["step"], []).append(parse_p2p(a["p2p"]))
    return out


def torch_pipeline(ranks, what):
    """Per rank {step: [..]} of rank<r>.json's pipeline.passes or pipeline.p2p, items as tuples."""
    out = []
    for rk in ranks:
        per = {}
        for step, xs in enumerate(rk["pipeline"][what]):
            if what == "passes":
                per[step] = [tuple(x) for x in xs]
            else:
                per[step] = [[tuple(i) for i in g] for g in xs]
        out.append(per)
    return out
