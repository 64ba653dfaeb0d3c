"""A script run as `python bench/x.py` (or `python experiments/x.py`) has its own folder first on
sys.path, so a module there named like an installed package is what every `import` of that name in
the process finds: bench/kernels.py once stood in for the `kernels` package that transformers
imports, and every model load through transformers failed. Benchmarks and experiments import each
other as `bench.x` / `experiments.x`, never by bare name, and their names must not be taken."""

import importlib.machinery
import sys

from tests.serve_testing import REPO_ROOT

SCRIPT_DIRS = ("bench", "experiments")


def _script_names() -> dict[str, str]:
    """Every benchmark and experiment module: its name -> its path relative to the repository."""
    return {p.stem: str(p.relative_to(REPO_ROOT)) for d in SCRIPT_DIRS for p in sorted((REPO_ROOT / d).glob("*.py"))}


def test_no_bench_or_experiment_module_is_named_like_an_installed_or_app_module():
    """No bench/ or experiments/ module has the name of a top-level module found elsewhere on sys.path
    (an installed package, the standard library) or of a module or package in app/ (app/kernels,
    app/router/..., which a reader would confuse it with)."""
    names = _script_names()
    assert "kernel_timings" in names and "http_load" in names, "the scan found no benchmarks"
    script_dirs = {str(REPO_ROOT / d) for d in SCRIPT_DIRS}
    path = [p for p in sys.path if p and str(p) not in script_dirs]
    app_names = {p.stem for p in (REPO_ROOT / "app").rglob("*.py")} | {
        p.name for p in (REPO_ROOT / "app").rglob("*") if p.is_dir() and not p.name.startswith("__")}
    taken = []
    for name, where in names.items():
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if name in sys.builtin_module_names or spec is not None:
            taken.append(f"{where}: `import {name}` also finds {spec.origin if spec else 'a built-in module'}")
        if name in app_names:
            taken.append(f"{where}: app/ has a module or package named {name}")
    assert not taken, taken


def test_nothing_imports_benchmarks_by_bare_name_or_experiments_from_the_product():
    """bench/, experiments/ and tests/ import benchmark modules as `bench.x` (nothing puts bench/ on
    sys.path); app/ and tests/ never import experiments/ (CI does not run them: see
    experiments/README.md)."""
    import ast

    names = _script_names()
    bench_names = {n for n, where in names.items() if where.startswith("bench/")}
    offenders = []
    for folder in ("app", "bench", "experiments", "tests"):
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    mods = [node.module]
                else:
                    continue
                where = f"{path.relative_to(REPO_ROOT)}:{node.lineno}"
                for m in mods:
                    if m.split(".")[0] in bench_names:
                        offenders.append(f"{where}: imports {m} by bare name (use bench.{m})")
                    if m.split(".")[0] == "experiments" and folder in ("app", "tests"):
                        offenders.append(f"{where}: imports {m}")
    assert not offenders, offenders
