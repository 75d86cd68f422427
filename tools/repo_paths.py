"""Where the repository is, and grader/ on sys.path: the tools' one bootstrap.

Python puts a script's own folder first on sys.path, so every tool (run as tools/x.py from any
working directory) finds this module and its sibling tools; importing this puts grader/ there
too, for the stage manifest (manifest.py), the trace's words (trace_names.py) and the grader's
library (gradelib/). The tests get the same folders from tests/conftest.py.

    from repo_paths import ROOT    # first, before anything of grader/
    import manifest
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRADER = os.path.join(ROOT, "grader")
if GRADER not in sys.path:
    sys.path.insert(0, GRADER)
