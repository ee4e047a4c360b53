"""envs.py declares exactly the variables pagedlm reads; utils' OS helpers."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from pagedlm import envs
from pagedlm.utils import release_mapped_pages
from tests.proc_maps import HAS_SMAPS, resident_kb

PACKAGE = Path(envs.__file__).parent


def test_every_declared_variable_is_read() -> None:
    source = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py") if p.name != "envs.py")
    unread = [name for name in envs.ENV_VARS if not re.search(rf"\b{name}\b", source)]
    assert unread == []


def test_cache_dir_follows_the_variables(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("PAGEDLM_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert envs.cache_dir() == tmp_path / "pagedlm"


@pytest.mark.skipif(not HAS_SMAPS, reason="reads Linux's smaps")
def test_release_mapped_pages_drops_residency_and_keeps_the_data(tmp_path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(np.arange(1 << 22, dtype=np.uint8).tobytes())  # 4 MiB
    data = np.memmap(path, dtype=np.uint8, mode="r")
    want = int(data.astype(np.int64).sum())  # touches every page

    assert resident_kb(path)[1] >= 4000
    release_mapped_pages(data.ctypes.data, data.nbytes)
    assert resident_kb(path)[1] < 100
    assert int(data.astype(np.int64).sum()) == want  # read again from the page cache
