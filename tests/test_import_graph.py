"""The import graph of `app`: no circles between modules, and imports run one way between packages.

Every module under app/ is parsed with `ast` (nothing is imported), and every `import app...` /
`from app... import ...` in it, at module level or inside a function, is an edge to the module it
names (`from app.x import y` is an edge to app.x.y when that is a module, else to app.x).

The layers, lowest first (docs/DESIGN.md, "Layout"). A module imports only from its own layer or
lower ones, so: nothing in app.engine or app.router imports app.deployments, nothing in app.kernels
imports app.engine, nothing in app.engine imports app.router. Beyond the order, the router imports
no engine module (it runs in every caller's handle; it sees the engine's types only through
app.kv_events and app.serving_types), and the engine imports Ray only in its Ray executor.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

APP = Path(__file__).resolve().parents[1] / "app"

LAYERS = [
    ["app.kernels"],  # Triton kernels and their torch references
    ["app.kv_events"],  # block hashes, KV events, their wire form and transport: engine and router share them
    ["app.config"],  # the validated settings
    ["app.engine"],
    ["app.llm"],  # the offline API
    ["app.serving_types"],  # what a caller sends an LLMServer replica: the router reads it, deployments send it
    ["app.router"],
    ["app.deployments"],
    ["app", "app.__main__"],  # the package's lazy exports and the command line
]

# (importer, imported) pairs the layer order allows but the design does not
FORBIDDEN = [("app.router", "app.engine")]

# Where the engine may import Ray (tensor-parallel workers as Ray actors), see app/engine/__init__.py
RAY_IN_ENGINE = {"app.engine.ray_executor", "app.engine.tp_worker"}

# Circles that cannot be cut, each with the reason. None today.
ALLOWED_CYCLES: list[set[str]] = []


def module_names(root: Path = APP) -> dict[str, tuple[Path, bool]]:
    """app module name -> (its file relative to the repository, whether it is a package's __init__)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root.parent)
        parts = list(relative.with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        out[".".join(parts)] = (relative, is_package)
    return out


def imports_of(name: str, path: Path, is_package: bool, modules: dict) -> dict[str, int]:
    """The app modules `name` imports (module level or not) -> the line of the first such import."""
    found: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        if target.split(".")[0] == "app" and target != name:
            found.setdefault(target, line)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package this module is in (or is)
                package = name.split(".") if is_package else name.split(".")[:-1]
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module, node.lineno)
    return found


def import_graph(root: Path = APP) -> tuple[dict[str, dict[str, int]], dict]:
    """(module -> {app module it imports: line}, module_names(root))."""
    modules = module_names(root)
    return {name: imports_of(name, root.parent / path, pkg, modules) for name, (path, pkg) in modules.items()}, modules


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def layer_of(module: str) -> int:
    """Index in LAYERS of the most specific package that holds `module`."""
    best, depth = None, -1
    for i, packages in enumerate(LAYERS):
        for package in packages:
            if in_package(module, package) and package.count(".") > depth:
                best, depth = i, package.count(".")
    if best is None:
        raise AssertionError(f"{module} is in no layer: add its package to LAYERS")
    return best


def forbidden_imports(graph: dict[str, dict[str, int]], modules: dict) -> list[str]:
    bad = []
    for importer, targets in sorted(graph.items()):
        for target, line in sorted(targets.items()):
            where = f"{modules[importer][0]}:{line}: {importer} imports {target}"
            if layer_of(target) > layer_of(importer):
                bad.append(f"{where} (a layer above it: see LAYERS)")
            for low, high in FORBIDDEN:
                if in_package(importer, low) and in_package(target, high):
                    bad.append(f"{where} ({low} must not import {high})")
    return bad


def ray_imports(root: Path = APP) -> dict[str, list[int]]:
    """module -> lines importing ray (or a ray submodule), at any level."""
    out: dict[str, list[int]] = {}
    for name, (path, _) in module_names(root).items():
        for node in ast.walk(ast.parse((root.parent / path).read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(n == "ray" or n.startswith("ray.") for n in names):
                out.setdefault(name, []).append(node.lineno)
    return out


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """A module-level, a function-level, a `from package import module` and a relative import each
    make an edge, so the checks below can fail."""
    pkg = tmp_path / "app"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "router").mkdir()
    for f in ("__init__.py", "engine/__init__.py", "router/__init__.py", "router/index.py"):
        (pkg / f).write_text("")
    (pkg / "engine" / "a.py").write_text("import app.engine.b\n")
    (pkg / "engine" / "b.py").write_text("def f():\n    from app.engine import c\n")
    (pkg / "engine" / "c.py").write_text("from .a import x\nfrom app.router import index\n")
    g, modules = import_graph(pkg)
    assert g["app.engine.a"] == {"app.engine.b": 1}
    assert g["app.engine.b"] == {"app.engine.c": 2}
    assert g["app.engine.c"] == {"app.engine.a": 1, "app.router.index": 2}
    assert cycles(g) == [["app.engine.a", "app.engine.b", "app.engine.c"]]
    assert [b.split(": ", 1)[1] for b in forbidden_imports(g, modules)] == [
        "app.engine.c imports app.router.index (a layer above it: see LAYERS)"]


def test_every_app_import_names_a_module_that_exists(graph):
    g, modules = graph
    missing = [f"{importer} imports {target}" for importer, targets in sorted(g.items())
               for target in targets if target not in modules]
    assert not missing, missing


def test_no_import_circles(graph):
    g, _ = graph
    found = [c for c in cycles(g) if set(c) not in ALLOWED_CYCLES]
    assert not found, f"import circles (cut each, or list it in ALLOWED_CYCLES with the reason): {found}"


def test_imports_run_one_way_between_packages(graph):
    g, modules = graph
    bad = forbidden_imports(g, modules)
    assert not bad, "\n".join(bad)


def test_the_engine_imports_ray_only_in_its_ray_executor():
    found = {m: lines for m, lines in ray_imports().items() if in_package(m, "app.engine") and m not in RAY_IN_ENGINE}
    assert not found, f"Ray imported in app.engine outside {sorted(RAY_IN_ENGINE)}: {found}"
    assert set(ray_imports()) & RAY_IN_ENGINE == RAY_IN_ENGINE, "RAY_IN_ENGINE names a module that no longer imports Ray"


def test_building_the_application_imports_no_torch():
    """`serve run` imports the builder in its build step before any replica starts: torch (seconds
    with a CUDA build) is imported by the LLMServer replica's engine, not there."""
    import subprocess
    import sys

    code = "import sys, app.deployments.builder; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "[]", out.stdout[:500]


def test_starting_an_engine_and_generating_imports_no_torch_dynamo():
    """A replica's engine never compiles with dynamo, so it does not pay torch._dynamo's import
    (1.1 s here, 3.4 s on an H100 machine without bytecode caches: nn.Embedding's own init on the
    meta device imported it)."""
    import subprocess
    import sys

    code = ("import sys\nfrom app import LLM, SamplingParams\nllm = LLM(model='tiny-llama')\n"
            "llm.generate(['hi'], SamplingParams(max_tokens=2))\nprint('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout[-500:]
