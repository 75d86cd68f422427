"""common/driver/'s files call each other without a cycle (issue 46, item 6): who calls whom, read from
their #include "driver/..." lines, is a DAG.

An include alone does not say who calls whom: a header may declare functions that two .c files define
(then a.c -> h <- b.c hides a.c <-> b.c). So each header stands for the one driver .c file that defines
the functions it declares (its owner; a header of static inline functions or types only stands for
itself), and the test checks two things:
- every driver header declares functions of at most one driver .c file;
- the graph "file -> owner of each driver header it includes" is acyclic.
The checker is run on small made-up trees too, so that it is seen to fail on a cycle.
"""
import os
import re

from helpers import ROOT, find_cycle

DRIVER = os.path.join(ROOT, "common", "driver")

INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"driver/([^"]+)"', re.M)
# a prototype at file scope: return type, name, (arguments);
PROTOTYPE = re.compile(r"^(?!static\b|typedef\b|extern\b|return\b)[A-Za-z_][\w \t*]*?\b([A-Za-z_]\w*)[ \t]*\([^;{}]*\)[ \t]*;",
                       re.M)


def strip_comments(src):
    """C source without its /* */ and // comments (string literals left alone: drivers' headers have none
    that hold comment markers)."""
    src = re.sub(r"/\*.*?\*/", " ", src, flags=re.S)
    return re.sub(r"//[^\n]*", "", src)


def read_tree(folder):
    """{file name: source without comments} for the .c and .h files of `folder`."""
    files = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith((".c", ".h")):
            with open(os.path.join(folder, name)) as fh:
                files[name] = strip_comments(fh.read())
    return files


def defines(src, name):
    """Whether `src` defines function `name` at file scope (its body follows the argument list)."""
    return re.search(r"^[^\s#][^;{}]*?\b%s[ \t]*\([^;{}]*\)\s*\{" % re.escape(name), src, re.M) is not None


def owners(files):
    """{header: sorted .c files defining a function the header declares}."""
    result = {}
    for h, src in files.items():
        if not h.endswith(".h"):
            continue
        names = set(PROTOTYPE.findall(src))
        result[h] = sorted(c for c, csrc in files.items() if c.endswith(".c") and any(defines(csrc, n) for n in names))
    return result


def graph(files):
    """({node: set of nodes it depends on}, {header: owners}) over files' nodes: a .c file, or a header
    with no single owner."""
    own = owners(files)

    def node(f):
        return own[f][0] if f.endswith(".h") and len(own[f]) == 1 else f

    edges = {node(f): set() for f in files}
    for f, src in files.items():
        for inc in INCLUDE.findall(src):
            if inc in files and node(inc) != node(f):
                edges[node(f)].add(node(inc))
    return edges, own


def problems(files):
    """What is wrong with a tree's layering, in sentences (empty: a DAG)."""
    edges, own = graph(files)
    said = ["%s declares functions defined in %s: one header per file, or the includes cannot say who calls whom"
            % (h, " and ".join(cs)) for h, cs in sorted(own.items()) if len(cs) > 1]
    cycle = find_cycle(edges)
    if cycle:
        said.append("include cycle: " + " -> ".join(cycle))
    return said


# ------------------------------------------------------------------ the checker on made-up trees

LOW_H = '#include "driver/top.h"\nvoid low(void);\n'
LOW_C = '#include "driver/low.h"\nvoid low(void) {\n}\n'
TOP_H = "void top(int n);\n"
TOP_C = '#include "driver/top.h"\n#include "driver/low.h"\nvoid top(int n) { low(); }\n'


def test_checker_accepts_a_dag():
    files = {"low.h": "void low(void);\n", "low.c": LOW_C, "top.h": TOP_H, "top.c": TOP_C}
    assert problems(files) == []


def test_checker_finds_an_include_cycle():
    files = {"low.h": LOW_H, "low.c": LOW_C, "top.h": TOP_H, "top.c": TOP_C}  # low.h includes top.h back
    said = problems(files)
    assert len(said) == 1 and said[0].startswith("include cycle:"), said
    assert "low.c" in said[0] and "top.c" in said[0]


def test_checker_finds_a_header_shared_by_two_files():
    # both.h declares a() of a.c and b() of b.c; a.c calls b() and b.c calls a() through it
    files = {"both.h": "void a(void);\nvoid b(void);\n",
             "a.c": '#include "driver/both.h"\nvoid a(void) { b(); }\n',
             "b.c": '#include "driver/both.h"\nvoid b(void) { a(); }\n'}
    said = problems(files)
    assert said == ["both.h declares functions defined in a.c and b.c: one header per file, or the includes "
                    "cannot say who calls whom"], said


def test_checker_reads_multiline_prototypes_and_definitions():
    files = {"p.h": "Model *p_make(const Model *full,\n              int P);\n",
             "p.c": '#include "driver/p.h"\nModel *p_make(const Model *full,\n              int P) {\n    return 0;\n}\n'}
    assert owners(files) == {"p.h": ["p.c"]}


# ------------------------------------------------------------------ the real driver


def test_driver_files_form_a_dag():
    files = read_tree(DRIVER)
    assert "train_step.c" in files and "pipeline.c" in files, sorted(files)
    assert problems(files) == []


def test_pipeline_does_not_call_the_loop():
    """The edge issue 46 named: pipeline.c runs the modules through functions of a lower file, and the
    loop (train_step.c) drives the step and calls pipeline.c."""
    edges, _ = graph(read_tree(DRIVER))
    assert "pipeline.c" in edges["train_step.c"]
    assert "train_step.c" not in edges["pipeline.c"]


if __name__ == "__main__":  # print the graph: python3 tests/test_driver_layers.py
    edges, own = graph(read_tree(DRIVER))
    for n in sorted(edges):
        print("%-14s -> %s" % (n, ", ".join(sorted(edges[n])) or "-"))
    for p in problems(read_tree(DRIVER)):
        print("PROBLEM:", p)
