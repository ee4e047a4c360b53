"""Packaged-model assembly: atomic, idempotent, sha256-checked, self-healing, clear errors."""

from __future__ import annotations

import hashlib
import os
import uuid

import pytest

from pagedlm import envs
from pagedlm.model_loader import catalog
from pagedlm.model_loader.catalog import PackagedModel, assemble


@pytest.fixture
def fake_model(tmp_path, monkeypatch) -> PackagedModel:
    """Two chunk 'packages' (importable modules with data/ files) on sys.path."""
    chunks = [b"GGUF" + os.urandom(1000), os.urandom(777)]
    root = tmp_path / "site"
    tag = uuid.uuid4().hex[:8]  # fresh module names: imported modules are cached per process
    for i, data in enumerate(chunks):
        pkg = root / f"fake_chunk_{tag}_{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(root))
    blob = b"".join(chunks)
    return PackagedModel(
        name="fake",
        filename="fake.gguf",
        size=len(blob),
        sha256=hashlib.sha256(blob).hexdigest(),
        chunks=((f"fake_chunk_{tag}_0", "part0.bin"), (f"fake_chunk_{tag}_1", "part1.bin")),
        packages=("fake-chunk-pkg0", "fake-chunk-pkg1"),
        description="test",
    )


def test_assemble_is_idempotent(fake_model, tmp_path) -> None:
    path = assemble(fake_model, tmp_path / "cache")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == fake_model.sha256
    mtime = path.stat().st_mtime_ns
    assert assemble(fake_model, tmp_path / "cache") == path
    assert path.stat().st_mtime_ns == mtime  # not rewritten
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.suffix == ".tmp"] == []


def test_truncated_cache_file_is_rebuilt(fake_model, tmp_path) -> None:
    path = assemble(fake_model, tmp_path / "cache")
    path.write_bytes(path.read_bytes()[:500])
    rebuilt = assemble(fake_model, tmp_path / "cache")
    assert hashlib.sha256(rebuilt.read_bytes()).hexdigest() == fake_model.sha256


def test_corrupt_chunks_give_the_fix_command(fake_model, tmp_path) -> None:
    bad = PackagedModel(**{**fake_model.__dict__, "sha256": "0" * 64})
    with pytest.raises(OSError, match="pip install --force-reinstall fake-chunk-pkg0"):
        assemble(bad, tmp_path / "cache")
    assert not (tmp_path / "cache" / "fake.gguf").exists()  # nothing half-written left


def test_missing_package_gives_the_fix_command(fake_model, tmp_path) -> None:
    missing = PackagedModel(
        **{**fake_model.__dict__, "chunks": (("no_such_chunk_module", "x.bin"),)}
    )
    with pytest.raises(FileNotFoundError, match=r"pagedlm\[models\]"):
        assemble(missing, tmp_path / "cache")


def test_cache_dir_respects_env(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PAGEDLM_CACHE_DIR", str(tmp_path / "x"))
    assert envs.cache_dir() == tmp_path / "x"
    monkeypatch.delenv("PAGEDLM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert envs.cache_dir() == tmp_path / "xdg" / "pagedlm"


def test_unknown_name_is_not_packaged() -> None:
    assert catalog.resolve_packaged_model("not-a-model") is None
