"""Compile the dsgd op library against the installed TensorFlow, and the wire kernels.

``python -m dsgd.ops.build`` builds both (the Makefile install step runs
this); ``dsgd.wire.native`` does the compiling and caching. The op library's
cache key also covers the TensorFlow version and its compiler flags, so a
changed TensorFlow triggers a rebuild.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dsgd.wire import native
from dsgd.wire.native import BuildError

__all__ = ["BuildError", "build", "library_path", "main"]

SOURCES = ("cc/dsgd_ops.cc", "cc/buffer_registry.cc", *native.WIRE_SOURCES)
HEADERS = ("cc/buffer_registry.h", *native.WIRE_HEADERS)
LIBRARY_NAME = "libdsgd_ops.so"


def _tf_spec() -> tuple[str, list[str], list[str]]:
    """The cache prefix and the compile and link flags of the installed TensorFlow."""
    import tensorflow as tf

    return f"tf{tf.__version__}", tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags()


def library_path() -> Path:
    """Where the op library for the current sources and TensorFlow lives (built or not)."""
    prefix, compile_flags, link_flags = _tf_spec()
    return native.library_path(LIBRARY_NAME, prefix, SOURCES, HEADERS, compile_flags, link_flags)


def build(force: bool = False, verbose: bool = False) -> Path:
    """Build the op library unless an up-to-date one exists; return its path."""
    prefix, compile_flags, link_flags = _tf_spec()
    return native.build(LIBRARY_NAME, prefix, SOURCES, HEADERS, compile_flags, link_flags, force, verbose)


def main() -> None:
    force = "--force" in sys.argv
    print(build(force=force, verbose=True))
    print(native.build_wire(force=force, verbose=True))


if __name__ == "__main__":
    main()
