"""Fixture submissions for grading a class (tests/test_class.py, tests/test_gradescope.py): each is
a stage's solution with one misbehaviour put at the top of fsdp_init."""
import os

from helpers import SOLVED

INIT = "Fsdp *fsdp_init(const FsdpConfig *cfg) {"
HEAD = "#include <signal.h>\n#include <stdio.h>\n#include <stdlib.h>\n#include <unistd.h>\n#include <sys/wait.h>\n"

# what each misbehaving submission does first thing in fsdp_init (runs on every rank)
BEHAVIOURS = {
    "crash": "    { volatile int *p = NULL; *p = 1; }\n",
    "hang": "    for (;;) pause();\n",
    # trains correctly, but leaves a grandchild behind in a session of its own (it must not outlive the
    # grading); $HOME/orphan-alive says it was started (written once it exists, before training goes on).
    # Rank 0 alone forks (a static "once" flag would be state the rank threads share, which the build refuses)
    "orphan": "    if (dev_rank(cfg->dev) == 0) {\n"
              "        pid_t child = fork();\n"
              "        if (child == 0) {\n"
              "            setsid();\n"
              "            if (fork() == 0) for (;;) pause();\n"
              "            char path[4096]; snprintf(path, sizeof path, \"%s/orphan-alive\", getenv(\"HOME\"));\n"
              "            FILE *fh = fopen(path, \"w\"); if (fh) fclose(fh);\n"
              "            _exit(0);\n"
              "        }\n"
              "        waitpid(child, NULL, 0);\n"
              "    }\n",
    "forkbomb": "    for (;;) (void)fork();\n",
    "spam": "    for (;;) fputs(\"spam spam spam spam spam spam spam spam spam spam spam spam spam spam\\n\", stderr);\n",
}


def source(stage, behaviour=None, outside=()):
    """Stage `stage`'s solution, with `behaviour` (a BEHAVIOURS key) or, with `outside`, writing into each
    of those paths before training on correctly."""
    st = next(s for s in SOLVED if s.id == stage)
    text = open(st.solution_src()).read()
    assert INIT in text, "fsdp_init's definition moved: update tests/class_fixtures.py"
    inject = BEHAVIOURS[behaviour] if behaviour else ""
    for p in outside:
        inject += '    { FILE *fh = fopen("%s", "a"); if (fh) { fputs("tampered\\n", fh); fclose(fh); } }\n' % p
    return HEAD + text.replace(INIT, INIT + "\n" + inject, 1)


def write_tree(root, stages, behaviour=None, outside=(), starter=False):
    """A student's copy at root: stages/NN_name/hw_fsdp.c for each stage id in `stages`."""
    for st in SOLVED:
        if st.id not in stages:
            continue
        d = os.path.join(root, "stages", st.dir)
        os.makedirs(d, exist_ok=True)
        text = open(st.starter_src()).read() if starter else source(st.id, behaviour, outside)
        with open(os.path.join(d, "hw_fsdp.c"), "w") as fh:
            fh.write(text)
