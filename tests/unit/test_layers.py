"""The layer order of pyproject.toml's import-linter contract holds, and covers every module."""

from __future__ import annotations

import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import pagedlm

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("importlinter")
tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def _contract_layers() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = config["contracts"]
    return contract["layers"]


def test_no_module_imports_a_layer_above_its_own() -> None:
    # in a process of its own: import-linter reconfigures logging
    check = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports())"
    run = subprocess.run(
        [sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_every_package_and_module_has_a_layer() -> None:
    """A new top-level module or package must be placed in the order, not left unconstrained."""
    placed = {
        name.strip().removeprefix("pagedlm.")
        for layer in _contract_layers()
        for name in re.split(r"[|:]", layer)
    }
    present = {m.name for m in pkgutil.iter_modules(pagedlm.__path__)}
    assert present == placed
