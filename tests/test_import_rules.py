"""The pure core (plan, schedule, simulator, planner, config) never imports the runtime,
threads or CUDA: what we simulate and validate must not depend on a device. The
packages import one another one way only (no cycle), and the simulator never imports
the planner above it."""

import ast
import pathlib
import subprocess
import sys

import rotapipe

PKG = pathlib.Path(rotapipe.__file__).parent
PURE = ["plan", "schedule", "sim", "planner", "config.py", "errors.py"]
FORBIDDEN = ("rotapipe.runtime", "threading", "queue", "torch.cuda")


def _imports(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:  # relative: resolve against the package path
                parts = path.relative_to(PKG.parent).with_suffix("").parts[:-node.level]
                mod = ".".join(parts + ((mod,) if mod else ()))
            yield mod


def test_pure_modules_do_not_import_the_runtime():
    files = [f for p in PURE for f in ((PKG / p).rglob("*.py") if (PKG / p).is_dir()
                                      else [PKG / p])]
    assert len(files) >= 6
    for f in files:
        for mod in _imports(f):
            assert not mod.startswith(FORBIDDEN), f"{f.relative_to(PKG)} imports {mod}"


def test_import_needs_no_gpu_and_exports_a_typed_api():
    code = ("import torch, rotapipe; assert not torch.cuda.is_initialized(); "
            "print(len(rotapipe.__all__))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"CUDA_VISIBLE_DEVICES": "", "PATH": ""}, check=True)
    assert int(out.stdout) == len(rotapipe.__all__)
    for name in rotapipe.__all__:
        assert getattr(rotapipe, name).__doc__, f"rotapipe.{name} has no docstring"


def _unit_graph() -> dict[str, set[str]]:
    """``{unit: units it imports}`` over rotapipe's top-level modules and packages
    (every import statement, function-level ones too; the package root, which gathers
    the public API, left out)."""
    graph: dict[str, set[str]] = {}
    for f in PKG.rglob("*.py"):
        parts = f.relative_to(PKG).with_suffix("").parts
        if parts[0] in ("__init__", "__main__"):
            continue
        for mod in _imports(f):
            names = mod.split(".")
            if names[0] == "rotapipe" and len(names) > 1 and names[1] != parts[0]:
                graph.setdefault(parts[0], set()).add(names[1])
    return graph


def test_packages_import_one_another_without_a_cycle():
    graph = _unit_graph()
    done: set[str] = set()

    def visit(unit: str, path: list[str]) -> None:
        if unit in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(unit):] + [unit]))
        if unit in done:
            return
        for nxt in sorted(graph.get(unit, ())):
            visit(nxt, path + [unit])
        done.add(unit)

    for unit in sorted(graph):
        visit(unit, [])
    # The layering the docs describe: plan below schedule below sim below planner.
    assert "planner" not in graph["sim"] and "sim" not in graph["schedule"]
    assert not graph["plan"] & {"schedule", "sim", "planner", "runtime"}
