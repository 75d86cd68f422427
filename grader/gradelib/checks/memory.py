"""Peak memory (every stage): per rank, the step's peak within a band of the reference's.
"""
from ..util import CheckFailed, fmt_bytes, rel, relpath
from .registry import SAYS_HOW_MUCH, check


@check("peak_memory", label="peak memory", variants=True, tier=SAYS_HOW_MUCH)
def check_peak_memory(ctx):
    band = ctx.tol["peak_mem_band_rel"]
    got = ctx.peaks(ctx.metrics())
    ref = ctx.peaks(ctx.reference_metrics())
    for r in range(ctx.world):
        if rel(got[r], ref[r]) <= band:
            continue
        if ref[r] <= 0:
            raise CheckFailed("rank %d peak %s vs a reference peak of 0 bytes: the reference log %s is corrupt "
                              "(instructors: make reference)" % (r, fmt_bytes(got[r]),
                                                                 relpath(ctx.reference_dir())))
        where = ctx.where_peak(r)
        if got[r] > ref[r]:
            hint = ("more than the reference: something is freed late or never (unsharded params after forward or "
                    "backward, grads after the reduce-scatter, all-gather buffers, optimizer state)")
        else:
            hint = ("less than the reference: is a buffer the stage needs missing (prefetched params, "
                    "ZeRO-2's kept params) or freed while still in use?")
        raise CheckFailed("rank %d peak %s vs reference %s (%+.1f%%, band +-%g%%): %s%s"
                          % (r, fmt_bytes(got[r]), fmt_bytes(ref[r]), 100.0 * (got[r] - ref[r]) / ref[r],
                             100 * band, hint, ("; " + where) if where else ""))
    return ""
