"""Several test modules put bench/ on sys.path to import the benches' helpers by name (servers, serving,
chaos, router, peer_model). bench/ also holds kernels.py, and transformers imports an installed package
named `kernels`: with bench/ first on the path that import found bench/kernels.py and every test that
loads a model through transformers failed (in whichever order pytest collected them)."""

import os
import re
import subprocess
import sys

from tests.serve_testing import REPO_ROOT

# the bench modules tests import, each of which puts something on sys.path when imported
IMPORTED_BY_TESTS = ["tests.serve_testing", "bench.chaos", "bench.router", "bench.fp4_splits", "bench.kernels"]

CHECK = """
import importlib, importlib.machinery, importlib.util, sys
from pathlib import Path
for name in sys.argv[1:]:
    importlib.import_module(name)
bench = str(Path("bench").resolve())
assert bench in sys.path, "no module put bench/ on sys.path: the check below would test nothing"
others = [p for p in sys.path if p != bench]
bad = []
for module in sorted(Path("bench").glob("*.py")):
    installed = importlib.machinery.PathFinder.find_spec(module.stem, others)
    if installed is not None:
        found = importlib.util.find_spec(module.stem)
        if found is None or found.origin != installed.origin:
            bad.append(f"import {module.stem} finds {found and found.origin}, not the installed {installed.origin}")
print("\\n".join(bad))
sys.exit(1 if bad else 0)
"""


def test_no_bench_module_shadows_an_installed_package():
    """After importing what the tests import (in a fresh interpreter: pytest's own order does not matter),
    every bench module name that an installed package also has still imports the installed one."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), RAY_AUTH_MODE="disabled", TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", CHECK, *IMPORTED_BY_TESTS], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]


def test_nothing_puts_bench_first_on_the_path():
    """No bench or test module puts bench/ (its own directory, for bench modules) first on sys.path: a
    script run from bench/ has it there already, and a module imported by the tests must put it last."""
    own_dir = {"str(Path(__file__).resolve().parent)", "os.path.dirname(os.path.abspath(__file__))"}
    offenders = []
    for folder in ("bench", "tests"):
        for path in sorted((REPO_ROOT / folder).glob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                m = re.search(r"sys\.path\.insert\(0,\s*(.+)\)\s*$", line)
                if m and ('"bench"' in m.group(1) or (folder == "bench" and m.group(1).strip() in own_dir)):
                    offenders.append(f"{path.relative_to(REPO_ROOT)}:{n}: {line.strip()}")
    assert not offenders, offenders
