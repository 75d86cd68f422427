"""In the student tree (make handout) there is no solutions/: the tests that
compare against the instructors' solutions are not collected there."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

collect_ignore = []
if not os.path.isdir(os.path.join(ROOT, "solutions")):
    collect_ignore = ["test_solutions.py", "test_grader.py", "test_class.py", "test_gradescope.py", "test_starters.py", "test_parity_torch.py",
                      "test_diagnostic_mutants.py"]
