"""envs.py declares exactly the variables pagedlm reads."""

from __future__ import annotations

import re
from pathlib import Path

from pagedlm import envs

PACKAGE = Path(envs.__file__).parent


def test_every_declared_variable_is_read() -> None:
    source = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py") if p.name != "envs.py")
    unread = [name for name in envs.ENV_VARS if not re.search(rf"\b{name}\b", source)]
    assert unread == []


def test_cache_dir_follows_the_variables(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("PAGEDLM_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert envs.cache_dir() == tmp_path / "pagedlm"
