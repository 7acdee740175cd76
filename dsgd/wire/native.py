"""Compile and cache dsgd's C++ libraries (sources in dsgd/ops/cc), without TensorFlow.

Two libraries come from there: the op library (``dsgd.ops.build``, built
against TensorFlow) and the wire kernels, ``libdsgd_wire.so``
(``build_wire``): plain C++ the parameter servers load through ctypes
(``dsgd.wire.kernels``) for their averages and bf16 conversions. Each is cached under
``dsgd/ops/_build/<prefix>-<key>/`` (or ``$DSGD_OPS_BUILD_DIR``), where the
key hashes the sources and the compiler command, so a changed source
triggers a rebuild. Several processes building at once (e.g. Ray workers
starting together) serialize on a file lock and publish the library by
atomic rename.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

OPS_DIR = Path(__file__).resolve().parents[1] / "ops"
REPO_ROOT = OPS_DIR.parents[1]  # sources include "dsgd/ops/cc/..."
WIRE_SOURCES = ("cc/wire_kernels.cc",)
WIRE_HEADERS = ("cc/wire_kernels.h",)
WIRE_LIBRARY = "libdsgd_wire.so"


class BuildError(RuntimeError):
    """A dsgd C++ library could not be compiled."""


def find_compiler() -> str:
    """Return the C++ compiler to use: ``$CXX``, else g++, else c++."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise BuildError(
        "no C++ compiler found (looked for $CXX, g++, c++); dsgd's C++ libraries need one, "
        "e.g. `apt-get install g++`")


def build_dir() -> Path:
    return Path(os.environ.get("DSGD_OPS_BUILD_DIR", OPS_DIR / "_build"))


def command(compiler: str, output: Path, sources: Sequence[str], compile_flags: Sequence[str] = (),
            link_flags: Sequence[str] = ()) -> list[str]:
    """The compiler command that builds ``sources`` (relative to dsgd/ops) into the shared library ``output``."""
    return [compiler, "-O3", "-fPIC", "-shared", "-Wno-deprecated-declarations",
            "-Wno-interference-size", f"-I{REPO_ROOT}", *compile_flags,
            *[str(OPS_DIR / s) for s in sources], "-o", str(output), *link_flags]


def library_path(name: str, prefix: str, sources: Sequence[str], headers: Sequence[str],
                 compile_flags: Sequence[str] = (), link_flags: Sequence[str] = ()) -> Path:
    """Where library ``name`` for the current sources and flags lives (built or not)."""
    digest = hashlib.sha256()
    for source in (*sources, *headers):
        digest.update(source.encode() + b"\0" + (OPS_DIR / source).read_bytes())
    digest.update(" ".join(command("CXX", Path("OUT"), sources, compile_flags, link_flags)).encode())
    return build_dir() / f"{prefix}-{digest.hexdigest()[:16]}" / name


def build(name: str, prefix: str, sources: Sequence[str], headers: Sequence[str],
          compile_flags: Sequence[str] = (), link_flags: Sequence[str] = (),
          force: bool = False, verbose: bool = False) -> Path:
    """Build library ``name`` unless an up-to-date one exists; return its path."""
    target = library_path(name, prefix, sources, headers, compile_flags, link_flags)
    if target.exists() and not force:
        return target
    compiler = find_compiler()
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(build_dir() / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same thing
        if target.exists() and not force:
            return target
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        cmd = command(compiler, Path(tmp), sources, compile_flags, link_flags)
        if verbose:
            print(" ".join(cmd), file=sys.stderr)
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            os.unlink(tmp)
            raise BuildError(f"compiling {name} failed:\n{' '.join(cmd)}\n{result.stderr}")
        os.replace(tmp, target)
    return target


def build_wire(force: bool = False, verbose: bool = False) -> Path:
    """Build (if needed) the wire kernels, ``libdsgd_wire.so``; return its path."""
    return build(WIRE_LIBRARY, "wire", WIRE_SOURCES, WIRE_HEADERS, force=force, verbose=verbose)
