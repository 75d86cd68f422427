"""The check registry: @check(key, label=..., tier=..., variants=..., clock=...) declares a check with all the grader
knows of it, CHECKS holds them in the order they are declared (the package imports its feature modules in
the order of the stage that first grades each check), run_check runs one and never lets it crash grading.
"""
from ..util import CheckFailed, one_line


# How directly a failed check names its cause: when several checks of a stage fail, the grader says them in this
# order (cli.lead_order), so that the first failure a student reads is the one that names what to change and
# the totals it moves (memory, overlap, the loss) come after it.
SAYS_WHAT_RAN = 0      # what the code did, in its own terms: the order of the passes, the collectives a module or a
                       # microbatch issued, their group and dtype, the shards' layout, a host wait
SAYS_WHICH_BUFFER = 1  # which buffer outlived its hook or went missing: params, grads, activations, optimizer state
SAYS_WHICH_NUMBER = 2  # a number off, with the run's own evidence of why: the grad norm, the clip coefficient
SAYS_WHICH_HOOK = 3    # memory inside one hook against the reference's: where, and what was live, not which mistake
SAYS_HOW_MUCH = 4      # a total that many causes move: peak memory, the prefetch bound, overlap, the bubble
SAYS_THAT_IT_DIFFERS = 5  # the loss: what every numerical cause moves, said last
TIERS = (SAYS_WHAT_RAN, SAYS_WHICH_BUFFER, SAYS_WHICH_NUMBER, SAYS_WHICH_HOOK, SAYS_HOW_MUCH, SAYS_THAT_IT_DIFFERS)

CHECKS = {}  # key -> Check, in the order defined here (a rubric naming an unknown key is told this list)


class Check:
    """One check: its function and what the rest of the grader reads of it.

    key       how rubric.json, results.json ("key") and tests/mutants/mutants.json name it
    label     the name the grader prints ("== stage 03 == <label>: OK"), results.json's "name"
    variants  True: a variant may list it: it reads one run against that run's own reference and baseline,
              or against the analytic model of the run's flags, so it holds at any world and flags (the
              others compare with the grading configuration's runs or with the stage's schedule);
              "every": a stage that grades it grades it on its main run and on every variant by itself
              (no variant lists it), the check deciding where it applies
    clock     True: it judges how long things took (the trace's ts and dur), which only the modelled clock
              makes a property of the program; grade.py --cuda leaves it out of the score (cli.GPU_CLOCK_NOT_GRADED).
              A check that reads only the order of events (ts as a sort key) is not a clock check.
    tier      how directly its failure names the cause (SAYS_WHAT_RAN ... SAYS_THAT_IT_DIFFERS): the order in which
              the grader says a stage's failed checks
    partial   True: it can judge the partial record a run stopped by a runtime error leaves (partial_rank<r>.json:
              the reporting rank's enqueued ops in host order and its memory notes so far; Context.partial): it
              reads only the ranks that record has (Context.ranks), the order of events, never their times, and
              it does not fail for what the record lacks because the run stopped. On a failed run such a check
              earns nothing, but its failure is said (it may name the cause the runtime error is a symptom of).
    """

    def __init__(self, key, fn, label, variants, tier, clock=False, partial=False):
        self.key, self.fn, self.label, self.variants, self.clock = key, fn, label, variants, clock
        self.tier, self.partial = tier, partial

    def __call__(self, ctx):
        return self.fn(ctx)


def check(key, *, label, tier, variants=False, clock=False, partial=False):
    """Register the decorated function as the check `key`, printed as `label` (students and the reference
    outputs see it: never change one lightly); tier: how directly its failure names the cause (Check.tier);
    clock=True if it judges durations (Check.clock); partial=True if it can judge a failed run's partial record
    (Check.partial)."""
    assert variants in (False, True, "every"), variants
    assert tier in TIERS, tier
    assert not (clock and partial), "a partial record has no durations"
    def register(fn):
        if key in CHECKS:
            raise ValueError("two checks named %s" % key)
        if label in (c.label for c in CHECKS.values()):
            raise ValueError("two checks labelled %s" % label)
        CHECKS[key] = Check(key, fn, label, variants, tier, clock, partial)
        return fn
    return register


def run_check(ctx, key):
    """(ok, reason, detail) of one check, reason and detail one printable line each; the step a failure shows in
    (CheckFailed.step) goes to ctx.failed_at[key]."""
    try:
        return True, "", one_line(CHECKS[key](ctx) or "")
    except CheckFailed as e:
        ctx.failed_at[key] = e.step
        return False, one_line(str(e)) or "failed", ""
    except Exception as e:  # a grader bug: a failed check that says so, not a crash (tests/test_grader_fuzz.py)
        return False, one_line("could not check (%s: %s)" % (type(e).__name__, e)), ""
