"""The layers keep to their places: the data plane (the server, the transports, the wire) imports no TensorFlow,
and the lower layers (transport, wire) import nothing above them."""

import ast
import pathlib
import subprocess
import sys

import dsgd

PACKAGE = pathlib.Path(dsgd.__file__).parent
DATA_PLANE = ("server", "transport", "wire")
LOWER = ("transport", "wire")
ABOVE = ("dsgd.server", "dsgd.exchange", "dsgd.cluster", "dsgd.driver", "dsgd.worker", "dsgd.integrations")

IMPORT_DATA_PLANE = f"""
import importlib, pkgutil, sys
import dsgd.ps_actor
for package in {DATA_PLANE!r}:
    module = importlib.import_module("dsgd." + package)
    for info in pkgutil.walk_packages(module.__path__, module.__name__ + "."):
        importlib.import_module(info.name)
print("tensorflow" in sys.modules)
"""


def test_the_data_plane_imports_no_tensorflow():
    """A parameter server is a light process: ps_actor and every module of server, transport and wire load without
    TensorFlow (in a fresh interpreter: this one may have TensorFlow loaded already)."""
    out = subprocess.run([sys.executable, "-c", IMPORT_DATA_PLANE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False"]


def _imports(path: pathlib.Path) -> set[str]:
    """The modules ``path`` imports, absolute (a relative import resolved against its package)."""
    package = ".".join(("dsgd", *path.relative_to(PACKAGE).parent.parts))
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.update([base, *(f"{base}.{alias.name}" for alias in node.names)])
    return names


def test_transport_and_wire_import_nothing_above_them():
    modules = [path for layer in LOWER for path in sorted((PACKAGE / layer).rglob("*.py"))]
    assert len(modules) > 5
    upward = {str(path.relative_to(PACKAGE)): sorted(name for name in _imports(path)
                                                    if any(name == a or name.startswith(a + ".") for a in ABOVE))
              for path in modules}
    assert {path: names for path, names in upward.items() if names} == {}
