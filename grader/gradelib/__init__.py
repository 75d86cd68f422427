"""The hwFSDP autograder as a package (grader/grade.py is its command line).

    rubric.py    grader/rubric.json (with the measured figures, through grader/manifest.py): checking it,
                 each stage's flags
    runner.py    building a hw_fsdp.c and running it under limits; why a run failed
    context.py   what the checks read of a run: its files, the reference logs, the baseline
    checks/      the checks, one module per feature, each declared with its key and label (@check), and
                 run_check (checks/__init__.py lists the modules)
    cli.py       the arguments, the grading loop, the printed lines and results.json
    util.py      small helpers every module uses (numbers, messages, paths, errors)

The stages themselves come from grader/manifest.py: grader/ must be on sys.path (it is for the
scripts in grader/, which Python runs with their own folder first on sys.path; the tools get it
from tools/repo_paths.py, the tests from tests/conftest.py). Standard library only (python3 >= 3.9).
"""
