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
