"""`python -m dsgd`: lists its commands and hands flags to them; no Ray is started here."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from dsgd import __main__ as cli


def test_module_help_lists_the_commands():
    out = subprocess.run([sys.executable, "-m", "dsgd", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage: python -m dsgd" in out.stdout
    for command in ("mnist", "bench"):
        assert f"  {command} " in out.stdout


def test_mnist_help_shows_the_example_flags(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["mnist", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m dsgd mnist")
    for flag in ("--num-workers", "--strategy", "--steps", "--logdir", "--address"):
        assert flag in out


def test_unknown_command_is_rejected(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'train'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["mnist", "bench"])
def test_missing_checkout_gives_a_clear_error(command, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(cli, "REPO_ROOT", tmp_path)
    assert cli.main([command, "--help"]) == 2
    err = capsys.readouterr().err
    assert f"python -m dsgd {command}: " in err
    assert "from a checkout of the dsgd repository" in err


def test_bench_runs_the_benchmark_script_as_its_own_program(capfd, monkeypatch):
    monkeypatch.delitem(sys.modules, "benchmarks", raising=False)
    assert cli.main(["bench", "--help"]) == 0
    out = capfd.readouterr().out
    assert out.startswith("usage: resnet101.py")
    for flag in ("--num-workers", "--strategy", "--timeline"):
        assert flag in out
    assert "benchmarks" not in sys.modules  # run in a child process, not imported here


def test_the_library_does_not_import_benchmarks_or_examples():
    package = Path(cli.__file__).resolve().parent
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in ("benchmarks", "examples"), f"{path} imports {name}"
