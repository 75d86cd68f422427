"""The bytes PyTorch's CUDA caching allocator would reserve for this program's allocations.

torchtitan's published "Memory (GiB)" is the caching allocator's peak reserved bytes
(torch.cuda.memory_stats()["reserved_bytes.all.peak"], GiB = 1024^3): the device memory it obtained from
cudaMalloc and holds as segments, not the bytes live tensors hold. A dry run counts the bytes its
allocations ask for (memory_rank<r>.json, "current_bytes"); this module replays the same alloc/free events,
in host call order, through a model of that allocator and reports the segments it would hold.

The rules, each from PyTorch's c10/cuda/CUDACachingAllocator.cpp (DeviceCachingAllocator; read at
pytorch/pytorch commit 001074d2) and the "CUDA semantics: memory management" notes
(docs.pytorch.org/docs/stable/notes/cuda.html#cuda-memory-management), restated:

  1. size      A request is rounded up to a multiple of 512 bytes, 512 at least (round_size, kMinBlockSize);
               the roundup_power2_divisions option is off by default and not modelled.
  2. pools     A rounded size of 1 MiB or less is served from the small pool, anything larger from the large
               pool (get_pool, kSmallSize). Each pool is ordered by (stream, size, address)
               (BlockComparatorSize), so a free block serves only requests made on the stream it was
               allocated on: one pool per (small/large, stream).
  3. best fit  The request takes the smallest free block of its pool and stream that is at least its size,
               the lowest address among equal sizes (get_free_block: lower_bound on that order).
               max_split_size, the oversize-block rules, is unlimited by default: not modelled.
  4. segments  With no block to reuse, one cudaMalloc'd segment: 2 MiB for a small request (kSmallBuffer),
               20 MiB for a large one under 10 MiB (kLargeBuffer, kMinLargeAlloc), otherwise the size rounded
               up to a multiple of 2 MiB (kRoundLarge) (get_allocation_size, alloc_block). Reserved bytes are
               the sum of the segments held (stats.reserved_bytes).
  5. split     A block larger than the request is split, the request taking its low end, when the rest is
               at least 512 bytes in the small pool or more than 1 MiB in the large pool; otherwise the
               request takes the whole block (should_split, alloc_found_block).
  6. free      A freed block merges with the free neighbours of its segment and goes back to its pool
               (free_block, try_merge_blocks). A block used on other streams (record_stream) is not
               reusable until those streams passed its free (insert_events, process_events): the snapshot
               logs it as "free_requested" then "free_completed", and it returns to the pool at the latter.
  7. release   Segments are never given back (no empty_cache) unless a cudaMalloc fails: then the allocator
               waits for the pending frees and frees every cached segment that is one whole free block,
               in both pools, and retries (malloc's fallbacks; release_cached_blocks, release_blocks). With
               a capacity (the profile's HBM) a new segment that would take the reserved bytes past it does
               that first; if it still does not fit a GPU would stop (CUDA out of memory), and the replay
               counts the segment anyway and says so (over_capacity), as the dry run goes on.

What the replay does not know: the addresses cudaMalloc returns (segments are laid out one after another,
so "lowest address" means "oldest segment"), memory outside the allocator (the CUDA context, NCCL's
buffers, cuBLAS workspaces), and expandable segments (off by default). Pinned host memory (the snapshot's
host_events) is a different allocator and is not counted. Standard library only.
"""
import bisect
import json

KIB, MIB = 1024, 1024 * 1024
MIN_BLOCK = 512            # rule 1: kMinBlockSize
SMALL_SIZE = 1 * MIB       # rule 2: kSmallSize, the largest small request
SMALL_BUFFER = 2 * MIB     # rule 4: kSmallBuffer, a small-pool segment
LARGE_BUFFER = 20 * MIB    # rule 4: kLargeBuffer, the segment of a large request under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 * MIB  # rule 4: kMinLargeAlloc
ROUND_LARGE = 2 * MIB      # rule 4: kRoundLarge


def round_size(nbytes):
    """Rule 1: the block size of a request of nbytes (0 bytes still take 512)."""
    return max(MIN_BLOCK, (nbytes + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK)


def is_small(size):
    """Rule 2: does a block of this (rounded) size belong to the small pool?"""
    return size <= SMALL_SIZE


def segment_size(size):
    """Rule 4: the bytes cudaMalloc'd for a (rounded) request no cached block serves."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return (size + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE


def should_split(block_size, size):
    """Rule 5: is the rest of a block_size block, after a request of size, cut off as a free block of its own?"""
    rest = block_size - size
    return rest >= MIN_BLOCK if is_small(block_size) else rest > SMALL_SIZE


class Block:
    """A range [addr, addr + size) of one segment; prev/next: its neighbours in that segment (None at its ends)."""
    __slots__ = ("addr", "size", "stream", "small", "allocated", "pending", "prev", "next")

    def __init__(self, addr, size, stream, small):
        self.addr, self.size, self.stream, self.small = addr, size, stream, small
        self.allocated = False  # handed out (or freed with record_stream and not yet completed: pending)
        self.pending = False
        self.prev = self.next = None

    def whole_segment(self):
        return self.prev is None and self.next is None


class CachingAllocator:
    """The allocator's state: the free blocks of every (pool, stream), the segments, and the counts.

    malloc(key, nbytes, stream) and free(key) take the snapshot's events; key names an allocation (its
    address in the snapshot) from its malloc to its free."""

    def __init__(self, capacity=None):
        self.capacity = capacity                  # bytes the device has (None: no limit)
        self.pools = {}                           # (small, stream) -> sorted [(size, addr, Block)] of free blocks
        self.live = {}                            # key -> Block, allocated or pending
        self.next_addr = 0                        # where the next segment starts (rule 7's note: one after another)
        self.reserved = 0                         # sum of the segments held
        self.allocated = 0                        # sum of the blocks handed out (PyTorch's allocated_bytes)
        self.requested = 0                        # sum of the bytes asked for (the snapshot's current_bytes)
        self.segments = 0
        self.peak_reserved = 0
        self.released = 0                         # segments given back by rule 7
        self.over_capacity = 0                    # segments counted past the capacity (a GPU would have stopped)
        self.requested_of = {}                    # key -> the bytes asked for
        self.completed_early = set()              # record_stream blocks rule 7 completed before their free_completed

    # -- the free blocks of a pool
    def _pool(self, small, stream):
        return self.pools.setdefault((small, stream), [])

    def _insert(self, b):
        bisect.insort(self._pool(b.small, b.stream), (b.size, b.addr, b))

    def _remove(self, b):
        pool = self._pool(b.small, b.stream)
        i = bisect.bisect_left(pool, (b.size, b.addr))
        assert pool[i][2] is b
        del pool[i]

    # -- rules 3 to 5
    def malloc(self, key, nbytes, stream):
        if key in self.live:
            raise ValueError("allocation %r made twice with no free between" % (key,))
        size = round_size(nbytes)
        small = is_small(size)
        pool = self._pool(small, stream)
        i = bisect.bisect_left(pool, (size, -1))   # rule 3: smallest fit, lowest address
        if i < len(pool):
            b = pool.pop(i)[2]
        else:
            b = self._new_segment(size, small, stream)
        if should_split(b.size, size):             # rule 5
            rest = Block(b.addr + size, b.size - size, stream, small)
            rest.prev, rest.next = b, b.next
            if b.next:
                b.next.prev = rest
            b.next = rest
            b.size = size
            self._insert(rest)
        b.allocated = True
        self.live[key] = b
        self.requested_of[key] = nbytes
        self.allocated += b.size
        self.requested += nbytes
        return b

    def _new_segment(self, size, small, stream):
        """Rule 4, and rule 7's release when the capacity would be passed."""
        seg = segment_size(size)
        if self.capacity is not None and self.reserved + seg > self.capacity:
            self.release_cached()
            if self.reserved + seg > self.capacity:
                self.over_capacity += 1
        b = Block(self.next_addr, seg, stream, small)
        self.next_addr += seg
        self.reserved += seg
        self.segments += 1
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return b

    # -- rule 6
    def free(self, key):
        """The block of key back to its pool (a "free" or a "free_completed" event)."""
        if key in self.completed_early:            # rule 7 already waited for it
            self.completed_early.discard(key)
            return
        b = self.live.pop(key, None)
        if b is None:
            raise ValueError("free of %r, which is not allocated" % (key,))
        if not b.pending:                          # a pending block's bytes left the counts at free_requested
            self.allocated -= b.size
            self.requested -= self.requested_of[key]
        del self.requested_of[key]
        self._return(b)

    def free_requested(self, key):
        """A block freed with record_stream uses: out of the counts, not reusable until free_completed."""
        b = self.live.get(key)
        if b is None:
            raise ValueError("free of %r, which is not allocated" % (key,))
        b.pending = True
        self.allocated -= b.size
        self.requested -= self.requested_of[key]

    def _return(self, b):
        b.allocated = b.pending = False
        for nb in (b.prev, b.next):                # merge with free neighbours of the same segment
            if nb is not None and not nb.allocated:
                self._remove(nb)
                if nb is b.prev:
                    b.addr, b.prev = nb.addr, nb.prev
                    if nb.prev:
                        nb.prev.next = b
                else:
                    b.next = nb.next
                    if nb.next:
                        nb.next.prev = b
                b.size += nb.size
        self._insert(b)

    # -- rule 7
    def release_cached(self):
        """Wait for the pending frees, then give back every segment that is one free block."""
        for key in [k for k, b in self.live.items() if b.pending]:
            b = self.live.pop(key)
            del self.requested_of[key]
            self.completed_early.add(key)
            self._return(b)
        for pool in self.pools.values():
            keep = []
            for size, addr, b in pool:
                if b.whole_segment():
                    self.reserved -= size
                    self.segments -= 1
                    self.released += 1
                else:
                    keep.append((size, addr, b))
            pool[:] = keep


def replay(events, capacity=None, init="survivors"):
    """Replay a snapshot's device events (memory_rank<r>.json "events", host call order) through the allocator.

    init: "all" replays the init phase (step < 0) as the program ran it; "survivors" (torchtitan's way: it
    builds the model on the meta device and materializes the shards in place) allocates, when the first step
    begins, only what init left alive, in its allocation order, and nothing init freed.
    Returns {"reserved_peak": bytes, "reserved_end": bytes, "by_step": {step: (reserved peak within the step,
    reserved at its start)}, "allocator": the CachingAllocator}."""
    if init not in ("all", "survivors"):
        raise ValueError("init is 'all' or 'survivors' (got %r)" % (init,))
    a = CachingAllocator(capacity)
    by_step = {}
    survivors = {}                                 # init's live allocations, in allocation order
    for e in events:
        act = e.get("action")
        if act not in ("alloc", "free", "free_requested", "free_completed"):
            continue                               # notes (hook_memory, ...)
        step = e["step"]
        if step < 0 and init == "survivors":
            if act == "alloc":
                survivors[e["addr"]] = e
            elif act in ("free", "free_completed"):
                survivors.pop(e["addr"], None)
            continue                               # a free_requested one is still live until free_completed
        if survivors is not None and step >= 0:
            for s in survivors.values():
                a.malloc(s["addr"], s["size"], s["stream"])
            survivors = None
        if step not in by_step:
            by_step[step] = [a.reserved, a.reserved]
        if act == "alloc":
            a.malloc(e["addr"], e["size"], e["stream"])
        elif act == "free_requested":
            a.free_requested(e["addr"])
        else:                                      # free, or free_completed
            a.free(e["addr"])
        by_step[step][0] = max(by_step[step][0], a.reserved)
    return {"reserved_peak": a.peak_reserved, "reserved_end": a.reserved,
            "by_step": {s: tuple(v) for s, v in by_step.items()}, "allocator": a}


def reserved_in_step(memory_json, step, capacity=None, init="survivors"):
    """Rank r's reserved bytes at their most in `step` (0-based; the snapshot's step), as
    torch.cuda.memory_stats()["reserved_bytes.all.peak"] reads after a reset of the peaks at the step's start
    (torchtitan's memory monitor resets them at every log): the most the caching allocator holds in it, with
    what it held when the step began. Also the whole run's peak and the segments given back (rule 7)."""
    with open(memory_json) as fh:
        events = json.load(fh)["events"]
    r = replay(events, capacity, init)
    if step not in r["by_step"]:
        raise ValueError("%s has no events of step %d" % (memory_json, step))
    return {"reserved_bytes": r["by_step"][step][0], "reserved_peak_run": r["reserved_peak"],
            "segments_released": r["allocator"].released, "segments_over_capacity": r["allocator"].over_capacity}
