#!/usr/bin/env python3
"""The hwFSDP autograder.

    grade.py                              grade stages/: every core stage, and the bonus stages you
                                          started (changed from their starter, or carried)
    grade.py --every-stage                every stage in stages/, the untouched bonus starters too
    grade.py --stage 03                   one stage (repeat --stage for several)
    grade.py --solutions                  grade solutions/ instead (they score full marks)
    grade.py --file my/hw_fsdp.c --stage 03
    grade.py --out grade-runs --json results.json --reference logs/reference
    grade.py --tree their/copy            grade their/copy/stages/*/hw_fsdp.c
    grade.py --class SUBMISSIONS --out class-runs     a whole class (scores.csv, one report each)

For each stage: build the hw_fsdp.c (make impl) into OUT/stageNN/train, run it
on the stage's configuration from grader/rubric.json in a child process with a
wall-clock limit and resource limits, then run the stage's checks against the
run's files, the reference logs and a non-sharded baseline run. A failed
build or run fails every check of the stage with the reason; nothing a
student's code does can crash the grader.

Exit status: 0 whenever grading happened (the score says how it went),
2 for a usage error of the grader itself.
Standard library only (python3 >= 3.9). The code is the package grader/gradelib/.
"""
import sys

from gradelib.cli import main  # gradelib/ sits beside this script, whose folder Python puts on sys.path

if __name__ == "__main__":
    sys.exit(main())
