"""The tests' one sys.path edit: tests/ (helpers), grader/ (the stage manifest, trace_names, gradelib) and
tools/ (the tools the tests drive in process, torch_llama), as each tool and grader script gets
its own folder and grader/ when it runs (tools/repo_paths.py).

In the student tree (make handout) there is no solutions/: the tests that compare against the
instructors' solutions are not collected there."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _folder in ("tools", "grader", "tests"):  # tests/ ends up first
    if os.path.join(ROOT, _folder) not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, _folder))

collect_ignore = []
if not os.path.isdir(os.path.join(ROOT, "solutions")):
    collect_ignore = ["test_solutions.py", "test_grader.py", "test_class.py", "test_gradescope.py", "test_starters.py", "test_parity_torch.py",
                      "test_diagnostic_mutants.py"]


# Why tests were skipped, grouped: one line at the end of the run ("65 skipped: 52 need the instructors'
# solutions/, 13 need a git checkout"), so that a student copy's `./hwfsdp test` says what its skips are.
SKIP_GROUPS = (  # (words in a skip reason, what the line says of those tests), first match wins
    (("solution",), "need the instructors' solutions/"),
    (("git checkout",), "need a git checkout"),
    (("staged release", "not in this release"), "are for stages outside this release"),
)


def skip_summary(reasons, not_collected=()):
    """The line for the skip reasons of a run (and the test files collect_ignore left out), or None."""
    groups = {}
    for reason in reasons:
        low = reason.lower()
        said = next((say for words, say in SKIP_GROUPS if any(w in low for w in words)), None)
        key = said or reason
        groups[key] = groups.get(key, 0) + 1
    parts = ["%d %s" % (n, key) if any(key == say for _, say in SKIP_GROUPS) else "%d because %s" % (n, key)
             for key, n in sorted(groups.items(), key=lambda kv: -kv[1])]
    line = "%d skipped: %s" % (len(reasons), ", ".join(parts)) if reasons else ""
    if not_collected:
        line += "%s%d instructors' test files not collected (no solutions/: %s)" % (
            "; " if line else "", len(not_collected), ", ".join(not_collected))
    return line or None


def _skip_reason(report):
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    reasons = [_skip_reason(r) for r in terminalreporter.stats.get("skipped", [])]
    line = skip_summary(reasons, collect_ignore)
    if line:
        terminalreporter.write_line(line)
