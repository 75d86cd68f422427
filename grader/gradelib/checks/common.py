"""What several feature modules share: a ratio test, where a memory note was taken, the hook_check notes'
zero / nonzero test, two byte counts printed apart, and the interval arithmetic of the trace measures.
"""
from ..util import CheckFailed, fmt_bytes, is_int


def near(x, target, tol):
    return target > 0 and abs(x / target - 1) <= tol


def note_where(n, rank):
    """'step 2, rank 1' of a hook_check note, with its microbatch when the run accumulates."""
    micro = n.get("microbatch")
    return "step %d%s, rank %d" % (n["step"] + 1, ", microbatch %d" % micro if is_int(micro) else "", rank)


def notes_check(ctx, hook, field, want_zero, what, advice, unless=None):
    """Every hook_check note of `hook` has `field` zero (or nonzero); notes whose flag `unless` (set by the
    loop on the module, --grad-accum) is 0 are left to the accumulation checks."""
    seen = 0
    for rank in range(ctx.world):
        for n in ctx.notes(rank):
            if n.get("hook") != hook or field not in n:
                continue
            if unless and n.get(unless, 1) == 0:
                continue
            seen += 1
            live = int(n[field])
            if want_zero and live:
                raise CheckFailed("%s's %s still live after its %s (%s, %s): %s"
                                  % (n["module"], what, hook, fmt_bytes(live), note_where(n, rank), advice))
            if not want_zero and not live:
                raise CheckFailed("%s's %s freed by its %s (%s): %s"
                                  % (n["module"], what, hook, note_where(n, rank), advice))
    if not seen:
        raise CheckFailed("the memory snapshots hold no %s checks (memory_rank*.json)" % hook)
    return ""


def two_sizes(a, b):
    """fmt_bytes of a and b, in exact bytes when they would print the same."""
    fa, fb = fmt_bytes(a), fmt_bytes(b)
    return ("%d bytes" % a, "%d bytes" % b) if fa == fb else (fa, fb)


class Accum:
    """What the grader asked a --grad-accum run for (the stage's flags), and the analytic model of what
    lives between microbatches: per module its unsharded bytes (params = grads) and its padded shard
    bytes on a rank, from the DTensor dumps."""

    def __init__(self, flags, ctx=None):
        flags = dict(f[2:].split("=", 1) if "=" in f else (f[2:], "true") for f in flags)
        self.K = int(flags.get("grad-accum", "1"))
        self.sync_every = flags.get("grad-sync", "every") == "every"
        self.rab = flags.get("reshard-after-backward", "true") == "true"
        self.raf = flags.get("reshard-after-forward", "true") == "true"
        self.ctx = ctx
        if ctx is not None:
            self.order, self.unsharded = ctx.module_order()
            # the units a module's collectives and buffers belong to (Context.units: one per module unless flat)
            self.flat = ctx.flat()
            self.units = ctx.units() if self.flat else [(m, [m], self.unsharded[m]) for m in self.order]

    def syncs(self, k):
        return self.sync_every or k == self.K - 1

    def reshards(self, k):
        return self.rab or k == self.K - 1

    def shard_bytes(self, rank, module):
        return sum(4 * p["padded_rows"] * p["row_numel"] for p in self.ctx.dtensors(rank)["params"]
                   if p["module"] == module)

    def total_shard_bytes(self, rank):
        """A rank's grad shards: its padded rows of every param, or with flat units S floats per unit."""
        if self.flat:
            return sum(size // self.ctx.world for _, _, size in self.units)
        return sum(self.shard_bytes(rank, m) for m in self.order)

    def total_unsharded(self):
        """The unsharded params of the whole model: the modules' bytes, or with flat units W x S floats each."""
        return sum(size for _, _, size in self.units)

    def describe(self):
        return "--grad-accum %d --grad-sync %s%s%s" % (self.K, "every" if self.sync_every else "last",
                                                       "" if self.rab else " --reshard-after-backward=false",
                                                       "" if self.raf else " --reshard-after-forward=false")
