"""The layer order of pyproject.toml's import-linter contract holds, and covers every module."""

from __future__ import annotations

import pkgutil
import re
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
    from importlinter.cli import lint_imports

    sys.path.insert(0, str(ROOT))
    try:
        assert lint_imports(config_filename=str(ROOT / "pyproject.toml")) == 0
    finally:
        sys.path.remove(str(ROOT))


def test_every_package_and_module_has_a_layer() -> None:
    """A new top-level module or package must be placed in the order, not left unconstrained."""
    placed = {
        name.strip().removeprefix("pagedlm.")
        for layer in _contract_layers()
        for name in re.split(r"[|:]", layer)
    }
    present = {m.name for m in pkgutil.iter_modules(pagedlm.__path__)}
    assert present == placed
