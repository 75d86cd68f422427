"""ZeRO-2 (stage 06): --reshard-after-forward=false keeps the params from the forward to the backward, which then
all-gathers nothing; true frees them as before.
"""
from trace_names import ALL_GATHER, BACKWARD_PHASES
from trace_names import PHASE_POST_FORWARD  # the phases (runtime/phase.h)

from ..util import CheckFailed
from .common import notes_check
from .registry import SAYS_WHAT_RAN, check


@check("zero2_no_backward_all_gather", label="no all-gather in backward", variants=True, tier=SAYS_WHAT_RAN)
def check_zero2_no_backward_all_gather(ctx):
    bad = [(r, e) for r, e in ctx.collectives(ALL_GATHER) if e["args"].get("phase") in BACKWARD_PHASES]
    if bad:
        r, e = bad[0]
        raise CheckFailed("%d all-gathers in backward (first: %s in %s.%s, step %d, rank %d): with "
                          "reshard_after_forward = 0 post_forward keeps the params, so the backward needs none"
                          % (len(bad), e["name"], e["args"].get("module"), e["args"].get("phase"),
                             e["args"]["step"] + 1, r))
    return ""


@check("zero2_params_kept", label="reshard after forward follows the flag", variants=True, tier=SAYS_WHAT_RAN)
def check_zero2_params_kept(ctx):
    """post_forward follows --reshard-after-forward: keeps the params with false, frees them with true."""
    if "--reshard-after-forward=false" in ctx.flags:
        return notes_check(ctx, PHASE_POST_FORWARD, "unsharded_param_live_bytes", False, "unsharded params were",
                            "with --reshard-after-forward=false post_forward keeps the params for the backward")
    return notes_check(ctx, PHASE_POST_FORWARD, "unsharded_param_live_bytes", True, "unsharded params",
                        "with --reshard-after-forward=true (FsdpConfig.reshard_after_forward = 1) post_forward "
                        "reshards, as in stage 05: is the flag read?")
