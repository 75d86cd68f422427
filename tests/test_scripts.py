"""Every script of grader/ and tools/ starts from any working directory: each finds its own modules
through the folder Python puts first on sys.path (the script's), the tools grader/ through
tools/repo_paths.py, with no PYTHONPATH and nothing of tests/conftest.py's. `--help` goes as far
as the argument parser: every top-level import has run by then (make_starters.py has no parser
and would write stages/: --check only compares)."""
import glob
import importlib.util
import os
import subprocess
import sys

import pytest

from helpers import ROOT

SCRIPTS = sorted(os.path.relpath(p, ROOT) for folder in ("grader", "tools")
                 for p in glob.glob(os.path.join(ROOT, folder, "*.py"))
                 if 'if __name__ == "__main__":' in open(p, encoding="utf-8").read())
NEEDS_TORCH = {"tools/torch_llama.py"}
ARGS = {"tools/make_starters.py": ["--check"]}


def test_the_scripts_are_found():
    assert {"grader/grade.py", "grader/gradescope.py", "grader/make_reference.py", "tools/fsdp2_check.py",
            "tools/make_gradescope.py", "tools/plots.py", "tools/torch_llama.py"} <= set(SCRIPTS), SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_starts_from_another_folder(script, tmp_path):
    if script in NEEDS_TORCH and importlib.util.find_spec("torch") is None:
        pytest.skip("%s imports torch" % script)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    args = ARGS.get(script, ["--help"])
    p = subprocess.run([sys.executable, os.path.join(ROOT, script)] + args, cwd=str(tmp_path), env=env,
                       capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert "Traceback" not in out and p.returncode in (0, 2), out[-2000:]
    assert args != ["--help"] or "usage" in out.lower(), out[-2000:]
