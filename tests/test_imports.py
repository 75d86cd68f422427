"""No import cycle among the Python modules of grader/ and tools/ (issue 46): the graph of who imports whom,
built from the source with ast (every import, the ones inside functions too: a lazy import hides a cycle, it
does not remove it), has no cycle. grader/ and tools/ are the two roots on sys.path, so `import manifest` is
grader/manifest.py and `from gradelib.checks import X` grader/gradelib/checks/__init__.py."""
import ast
import os

from helpers import ROOT, find_cycle

ROOTS = [os.path.join(ROOT, "grader"), os.path.join(ROOT, "tools")]


def module_files(roots=ROOTS):
    """{module name: file} of every .py under the roots (a package's name is its __init__.py's)."""
    out = {}
    for top in roots:
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for f in filenames:
                if not f.endswith(".py"):
                    continue
                parts = os.path.relpath(os.path.join(dirpath, f), top)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                if parts:
                    out[".".join(parts)] = os.path.join(dirpath, f)
    return out


def imports_of(name, path, known):
    """The known modules the file of module `name` imports (a from-import of a submodule names the submodule)."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".") if package else []
                up = up[:len(up) - (node.level - 1)] if node.level > 1 else up
                base = ".".join(up + ([base] if base else []))
            targets = [base + "." + a.name if base else a.name for a in node.names if a.name != "*"] or [base]
            targets = [t if t in known else base for t in targets]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import a.b.c` of a module a.b.c that is not ours: its known parent
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def import_graph(roots=ROOTS):
    files = module_files(roots)
    return {name: imports_of(name, path, files) for name, path in files.items()}


def test_the_graph_sees_the_imports():
    """The graph is built from what the files say: the grader's known edges are in it (a parser that missed
    relative imports or lazy ones would find no cycle anywhere)."""
    g = import_graph()
    assert "manifest" in g["gradelib.rubric"]
    assert "gradelib.checks" in g["gradelib.rubric"]  # from .checks import CHECKS
    assert "gradelib.checks.registry" in g["gradelib.checks"]  # from .registry import ...
    assert "gradelib.checks.common" in g["gradelib.checks.parity"]  # from .common import ...
    assert "gradelib.checks.parity" in g["gradelib.checks"]  # from . import parity, ...
    assert "gradelib.classroom" in g["gradelib.cli"]  # a lazy import, inside a function


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) is None


def test_a_cycle_written_into_a_copy_is_found(tmp_path):
    """On a copy of grader/ with one lazy import added back (checks importing the rubric module, as it once
    did), the same graph finds the cycle."""
    import shutil
    shutil.copytree(os.path.join(ROOT, "grader"), str(tmp_path / "grader"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    path = tmp_path / "grader" / "gradelib" / "checks" / "overlap.py"
    path.write_text(path.read_text() + "\n\ndef _labels(rubric):\n    from ..rubric import variant_label\n"
                    "    return variant_label\n")
    cycle = find_cycle(import_graph([str(tmp_path / "grader")]))
    assert cycle and "gradelib.rubric" in cycle and "gradelib.checks.overlap" in cycle, cycle


def test_no_import_cycle_in_grader_and_tools():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: %s" % " -> ".join(cycle)
