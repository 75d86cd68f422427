"""The words of the runtime's traces that the Python side reads: the grader, the tools and the tests
take them from here. Generated from the runtime's tables by tools/trace_names.c (make rewrites this file;
do not edit it): the collective kinds (CollKind, coll_common.c), the categories and tracks
(runtime/trace.h), the copy directions (CopyDir, alloc.c), the memory tags (MemTag, alloc.c) and the
phases (runtime/phase.h); tests/test_trace_names.py checks it against the generator and a run.

A trace event ("ph": "X") of a rank has "cat" one of CATEGORIES, "tid" its stream's index (the
compute stream COMPUTE_TID, the host's own track HOST_TID), "args.phase" one of PHASES (the hook or pass
that queued it) and, for a collective, the name "<label>.<kind>" (label: the module, or grad_norm); "ts"
and "dur" are on the world's clock (the file's otherData.clock: "model" on the CPU backends, the same on
every run), args.wall_ts_us / wall_dur_us the wall clock's (WALL_ARGS: never graded). A rubric stage's
"streams" name the comm streams by the kind they carry (ALL_GATHER, REDUCE_SCATTER). A memory snapshot's
allocations carry one of MEM_TAGS. The run's otherData (and run.json) repeat the vocabularies a run used.
Standard library only.
"""

# collective kinds, in the order of CollKind (common/runtime/runtime.h); P2P: a group of sends and receives
# (dev_send / dev_recv), named by what moves where, args.p2p the items
ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
ALL_REDUCE = "all_reduce"
BROADCAST = "broadcast"
BARRIER = "barrier"
P2P = "p2p"
COLLECTIVE_KINDS = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, BROADCAST, BARRIER, P2P)

# categories ("cat") of the trace's slices (common/runtime/trace.h): a copy between host and device is
# named "<module>.h2d" / ".d2h"; WAIT: a stream stalled on an event (traced iff it stalled on the modelled
# clock); HOST_SYNC: the host waited ("sync:<what>") on the host's track, every wait, 0 long if it did not
# stall; MEMSET: the CUDA backend's memsets (the CPU files them under COPY)
COMPUTE = "compute"
COPY = "copy"
COLLECTIVE = "collective"
EVENT = "event"
WAIT = "wait"
HOST_SYNC = "host_sync"
MEMSET = "memset"
CATEGORIES = (COMPUTE, COPY, COLLECTIVE, EVENT, WAIT, HOST_SYNC, MEMSET)

# args of a slice that hold wall-clock times (CPU backends): for performance work, never for grading
WALL_ARGS = ("wall_ts_us", "wall_dur_us")

# args of a kernel's slice (CPU backends): its cost class (CostClass, common/runtime/runtime.h, in the enum's
# order) and its math ("f32" / "bf16")
KERNEL_ARGS = ("class", "math")
COST_MATMUL = "matmul"
COST_ATTENTION = "attention"
COST_ELEMENTWISE = "elementwise"
COST_FREE = "free"
COST_CLASSES = (COST_MATMUL, COST_ATTENTION, COST_ELEMENTWISE, COST_FREE)

# copy directions (CopyDir, common/runtime/alloc.h): the last part of a copy's name
H2D = "h2d"
D2H = "d2h"

COMPUTE_TID = 0    # each rank's first stream is its compute stream
HOST_TID = 1000    # TRACE_HOST_TID: the host's own track

# memory tags (MemTag, common/device.h), in the enum's order: a snapshot's allocations are grouped by them
TAG_PARAM = "param"
TAG_PARAM_SHARD = "param_shard"
TAG_UNSHARDED_PARAM = "unsharded_param"
TAG_GRAD_SHARD = "grad_shard"
TAG_UNSHARDED_GRAD = "unsharded_grad"
TAG_ACTIVATION = "activation"
TAG_OPTIM_STATE = "optim_state"
TAG_COMM_BUFFER = "comm_buffer"
TAG_TEMP = "temp"
MEM_TAGS = (TAG_PARAM, TAG_PARAM_SHARD, TAG_UNSHARDED_PARAM, TAG_GRAD_SHARD, TAG_UNSHARDED_GRAD, TAG_ACTIVATION,
            TAG_OPTIM_STATE, TAG_COMM_BUFFER, TAG_TEMP)

# args.phase: where the training loop was when the op was queued (Phase, common/runtime/phase.h), in the
# order a step visits them
PHASE_INIT = "init"
PHASE_DATA = "data"
PHASE_PRE_FORWARD = "pre_forward"
PHASE_FORWARD = "forward"
PHASE_POST_FORWARD = "post_forward"
PHASE_PRE_BACKWARD = "pre_backward"
PHASE_RECOMPUTE_PRE_FORWARD = "recompute.pre_forward"
PHASE_RECOMPUTE = "recompute"
PHASE_RECOMPUTE_POST_FORWARD = "recompute.post_forward"
PHASE_BACKWARD = "backward"
PHASE_POST_BACKWARD = "post_backward"
PHASE_FINISH_BACKWARD = "finish_backward"
PHASE_OPTIMIZER = "optimizer"
PHASE_DISCARD = "discard"
PHASE_P2P = "p2p"
PHASE_END = "end"
PHASES = (PHASE_INIT, PHASE_DATA, PHASE_PRE_FORWARD, PHASE_FORWARD, PHASE_POST_FORWARD, PHASE_PRE_BACKWARD,
          PHASE_RECOMPUTE_PRE_FORWARD, PHASE_RECOMPUTE, PHASE_RECOMPUTE_POST_FORWARD, PHASE_BACKWARD,
          PHASE_POST_BACKWARD, PHASE_FINISH_BACKWARD, PHASE_OPTIMIZER, PHASE_DISCARD, PHASE_P2P, PHASE_END)
# the forward pass
FORWARD_PHASES = frozenset({PHASE_PRE_FORWARD, PHASE_FORWARD, PHASE_POST_FORWARD})
# the backward pass, --ac's recompute included
BACKWARD_PHASES = frozenset({PHASE_PRE_BACKWARD, PHASE_RECOMPUTE_PRE_FORWARD, PHASE_RECOMPUTE,
                             PHASE_RECOMPUTE_POST_FORWARD, PHASE_BACKWARD, PHASE_POST_BACKWARD,
                             PHASE_FINISH_BACKWARD})
# inside a student's hook of a pass (the optimizer step's is none)
HOOK_PHASES = frozenset({PHASE_PRE_FORWARD, PHASE_POST_FORWARD, PHASE_PRE_BACKWARD, PHASE_RECOMPUTE_PRE_FORWARD,
                         PHASE_RECOMPUTE_POST_FORWARD, PHASE_POST_BACKWARD, PHASE_FINISH_BACKWARD})
# neither pass: fsdp_init, the batch, the optimizer step, --forward-only's discard, the end; with
# --pp the schedule's sends and receives between pipe_forward / pipe_backward (module "pipe")
OTHER_PHASES = frozenset({PHASE_INIT, PHASE_DATA, PHASE_OPTIMIZER, PHASE_DISCARD, PHASE_P2P, PHASE_END})


def label_and_kind(name):
    """('block0', 'all_gather') of a collective named 'block0.all_gather' (a copy's name splits the same way);
    ('', name) for a name without a dot."""
    label, _, kind = name.rpartition(".")
    return label, kind
