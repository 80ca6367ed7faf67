"""The pure core (plan, schedule, simulator, config) never imports the runtime,
threads or CUDA: what we simulate and validate must not depend on a device."""

import ast
import pathlib
import subprocess
import sys

import rotapipe

PKG = pathlib.Path(rotapipe.__file__).parent
PURE = ["plan", "schedule", "sim", "config.py", "errors.py"]
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
