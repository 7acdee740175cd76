"""Compile the dsgd op library against the installed TensorFlow.

``python -m dsgd.ops.build`` builds it (the Makefile install step runs this).
The result is cached under ``dsgd/ops/_build/<key>/libdsgd_ops.so`` (or
``$DSGD_OPS_BUILD_DIR``), where the key hashes the sources, the TensorFlow
version and the compiler flags, so a changed source or TensorFlow triggers a
rebuild. Several processes building at once (e.g. Ray workers starting
together) serialize on a file lock and publish the library by atomic rename.
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

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parents[1]  # sources include "dsgd/ops/cc/..."
SOURCES = ("cc/dsgd_ops.cc", "cc/buffer_registry.cc")
HEADERS = ("cc/buffer_registry.h",)
LIBRARY_NAME = "libdsgd_ops.so"


class BuildError(RuntimeError):
    """The op library could not be compiled."""


def find_compiler() -> str:
    """Return the C++ compiler to use: ``$CXX``, else g++, else c++."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise BuildError(
        "no C++ compiler found (looked for $CXX, g++, c++); the dsgd op library "
        "needs one to build against TensorFlow, e.g. `apt-get install g++`")


def _tf_flags() -> tuple[list[str], list[str], str]:
    import tensorflow as tf

    return tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags(), tf.__version__


def _command(compiler: str, output: Path, compile_flags: list[str], link_flags: list[str]) -> list[str]:
    sources = [str(PACKAGE_DIR / s) for s in SOURCES]
    return [compiler, "-O3", "-fPIC", "-shared", "-Wno-deprecated-declarations",
            "-Wno-interference-size", f"-I{REPO_ROOT}", *compile_flags, *sources,
            "-o", str(output), *link_flags]


def build_dir() -> Path:
    return Path(os.environ.get("DSGD_OPS_BUILD_DIR", PACKAGE_DIR / "_build"))


def library_path() -> Path:
    """Where the library for the current sources and TensorFlow lives (built or not)."""
    compile_flags, link_flags, tf_version = _tf_flags()
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update(name.encode() + b"\0" + (PACKAGE_DIR / name).read_bytes())
    digest.update(" ".join(_command("CXX", Path("OUT"), compile_flags, link_flags)).encode())
    return build_dir() / f"tf{tf_version}-{digest.hexdigest()[:16]}" / LIBRARY_NAME


def build(force: bool = False, verbose: bool = False) -> Path:
    """Build the library unless an up-to-date one exists; return its path."""
    target = library_path()
    if target.exists() and not force:
        return target
    compiler = find_compiler()
    compile_flags, link_flags, _ = _tf_flags()
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(build_dir() / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same thing
        if target.exists() and not force:
            return target
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        cmd = _command(compiler, Path(tmp), compile_flags, link_flags)
        if verbose:
            print(" ".join(cmd), file=sys.stderr)
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            os.unlink(tmp)
            raise BuildError(f"compiling the dsgd op library failed:\n{' '.join(cmd)}\n{result.stderr}")
        os.replace(tmp, target)
    return target


def main() -> None:
    path = build(force="--force" in sys.argv, verbose=True)
    print(path)


if __name__ == "__main__":
    main()
