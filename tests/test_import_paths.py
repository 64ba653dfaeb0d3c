"""Several test modules put bench/ on sys.path to import the benches' helpers by name (servers, serving,
chaos, router, peer_model). bench/ also holds kernels.py, and transformers imports an installed package
named `kernels`: with bench/ first on the path that import found bench/kernels.py and every test that
loads a model through transformers failed (in whichever order pytest collected them)."""

import importlib.machinery
import importlib.util
import sys

from tests.serve_testing import REPO_ROOT  # puts bench/ on sys.path, as the serving tests' modules do


def test_no_bench_module_shadows_an_installed_package():
    bench = str(REPO_ROOT / "bench")
    assert bench in sys.path
    others = [p for p in sys.path if p != bench]
    for module in sorted((REPO_ROOT / "bench").glob("*.py")):
        installed = importlib.machinery.PathFinder.find_spec(module.stem, others)
        if installed is None:
            continue  # only bench/ has it: importing it by name is what the tests want
        found = importlib.util.find_spec(module.stem)
        assert found is not None and found.origin == installed.origin, (
            f"import {module.stem} finds {found and found.origin}, not the installed {installed.origin}")
