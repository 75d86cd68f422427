"""The words of the runtime's traces that the Python side reads: the grader, the tools and the tests
take them from here. The C side writes them (common/runtime/coll_common.c the collective kinds,
cpu/runtime_cpu.c the categories, alloc.c the copy directions, world.c the compute stream first, trace.h the
host's track, driver/trainer.c and train_step.c the phases); tests/test_trace_names.py runs the runtime and
compares.

A trace event ("ph": "X") of a rank has "cat" one of CATEGORIES, "tid" its stream's index (the
compute stream COMPUTE_TID, the host's own track HOST_TID), "args.phase" the hook or pass that
queued it and, for a collective, the name "<label>.<kind>" (label: the module, or grad_norm); "ts" and
"dur" are on the world's clock (the file's otherData.clock: "model" on the CPU backends, the same on every
run), args.wall_ts_us / wall_dur_us the wall clock's (WALL_ARGS: never graded). A rubric stage's "streams"
name the comm streams by the kind they carry (ALL_GATHER, REDUCE_SCATTER).
Standard library only.
"""

# collective kinds, in the order of CollKind (common/runtime/coll.h)
ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
ALL_REDUCE = "all_reduce"
BROADCAST = "broadcast"
BARRIER = "barrier"
P2P = "p2p"  # a group of sends and receives (dev_send / dev_recv): named by what moves where, args.p2p the items
COLLECTIVE_KINDS = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, BROADCAST, BARRIER, P2P)

# categories ("cat") of the trace's slices
COMPUTE = "compute"        # a kernel
COPY = "copy"              # a copy or a memset; a copy between host and device is named "<module>.h2d" / ".d2h"
COLLECTIVE = "collective"
EVENT = "event"            # an event recorded on a stream
WAIT = "wait"              # a stream stalled on an event (traced iff it stalled on the modelled clock)
HOST_SYNC = "host_sync"    # the host waited ("sync:<what>") on the host's track: every wait, 0 long if it did not stall
MEMSET = "memset"          # a memset on the CUDA backend (common/cuda/runtime_cuda.c); the CPU one files it under copy
CATEGORIES = (COMPUTE, COPY, COLLECTIVE, EVENT, WAIT, HOST_SYNC, MEMSET)

# args of a slice that hold wall-clock times (CPU backends): for performance work, never for grading
WALL_ARGS = ("wall_ts_us", "wall_dur_us")

# copy directions: the last part of a copy's name
H2D = "h2d"
D2H = "d2h"

COMPUTE_TID = 0    # each rank's first stream is its compute stream
HOST_TID = 1000    # TRACE_HOST_TID: the host's own track

# args.phase: where the training loop was when the op was queued
FORWARD_PHASES = frozenset({"pre_forward", "forward", "post_forward"})
BACKWARD_PHASES = frozenset({"pre_backward", "recompute.pre_forward", "recompute", "recompute.post_forward",
                             "backward", "post_backward", "finish_backward"})
HOOK_PHASES = frozenset({"pre_forward", "post_forward", "pre_backward", "post_backward", "recompute.pre_forward",
                         "recompute.post_forward", "finish_backward"})  # inside a student's hook
OTHER_PHASES = frozenset({"init", "data", "optimizer", "end", "p2p"})  # fsdp_init, the batch, the optimizer step,
# the end; with --pp the schedule's sends and receives between pipe_forward / pipe_backward (module "pipe")


def label_and_kind(name):
    """('block0', 'all_gather') of a collective named 'block0.all_gather' (a copy's name splits the same way);
    ('', name) for a name without a dot."""
    label, _, kind = name.rpartition(".")
    return label, kind
