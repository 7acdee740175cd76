"""Command line: ``python -m dsgd <command> [flags]``.

    python -m dsgd mnist [flags]   train the MNIST example (examples/mnist.py)
    python -m dsgd bench [flags]   the ResNet-101 benchmark (benchmarks/resnet101.py)

The example and the benchmark live in the repository next to the ``dsgd``
package, not inside it, so these commands need a checkout (or an editable
install) of the repository. The library never imports ``benchmarks``: the
benchmark runs as its own program, ``python benchmarks/resnet101.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from ray import cloudpickle

REPO_ROOT = Path(__file__).resolve().parent.parent

COMMANDS = {
    "mnist": ("train a small convnet on MNIST (examples/mnist.py)", "examples/mnist.py"),
    "bench": ("ResNet-101 on synthetic ImageNet (benchmarks/resnet101.py)", "benchmarks/resnet101.py"),
}


class CommandUnavailable(Exception):
    """The file a command runs is not in this installation."""


def _require(relative_path: str) -> Path:
    path = REPO_ROOT / relative_path
    if not path.is_file():
        raise CommandUnavailable(
            f"{relative_path} is not at {path}: `python -m dsgd` runs the example and the benchmark "
            "from a checkout of the dsgd repository (pip install -e .), not from an installed wheel")
    return path


def load_mnist() -> ModuleType:
    """examples/mnist.py, imported by file path (examples/ is not a package)."""
    path = _require(COMMANDS["mnist"][1])
    spec = importlib.util.spec_from_file_location("dsgd_example_mnist", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    # Ray workers cannot import this module by name: send its model classes by value.
    cloudpickle.register_pickle_by_value(module)
    return module


def run_bench(flags: list[str]) -> int:
    """benchmarks/resnet101.py as a separate Python program; its exit code."""
    path = _require(COMMANDS["bench"][1])
    return subprocess.run([sys.executable, str(path), *flags], check=False).returncode


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    commands = "\n".join(f"  {name:8s}{help_text}" for name, (help_text, _) in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="python -m dsgd", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run the dsgd example or benchmark.",
        epilog=f"commands:\n{commands}\n\n`python -m dsgd <command> --help` shows a command's flags.")
    parser.add_argument("command", choices=sorted(COMMANDS), help="what to run")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="passed on to the command")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "bench":
            return run_bench(args.flags)
        module = load_mnist()
    except CommandUnavailable as e:
        print(f"python -m dsgd {args.command}: {e}", file=sys.stderr)
        return 2
    sys.argv = [f"python -m dsgd {args.command}", *args.flags]  # what the command's --help shows
    module.main(args.flags)
    return 0


if __name__ == "__main__":
    sys.exit(main())
