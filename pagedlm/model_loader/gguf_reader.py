"""A small, fast GGUF (v2/v3) parser: metadata, tensor infos and memory-mapped tensor bytes.

`gguf.GGUFReader` builds a numpy view per array element, which takes tens of seconds for a
150k-token vocabulary; here strings are decoded straight from the mapped bytes.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np

_MAGIC = b"GGUF"
# GGUF metadata value types -> struct format (8 = string, 9 = array).
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_NUMPY = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}


class GGUFStringArray(Sequence[str]):
    """A metadata array of strings (a vocabulary, merges) decoded only where it is read:
    the reader records where each string starts, holding 8 bytes per entry rather than a
    Python string (a 150k-token vocabulary and its merges: 2.4 MB instead of ~40 MB)."""

    def __init__(self, mv: memoryview, starts: array) -> None:
        self._mv, self._starts = mv, starts

    def __len__(self) -> int:
        return len(self._starts)

    def _decode(self, i: int) -> str:
        start = self._starts[i]
        (n,) = struct.unpack_from("<Q", self._mv, start)
        return bytes(self._mv[start + 8 : start + 8 + n]).decode("utf-8", errors="replace")

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self._decode(j) for j in range(*i.indices(len(self)))]
        return self._decode(range(len(self))[i])


@dataclass
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # PyTorch order (reversed GGUF ne)
    ggml_type: int
    offset: int  # absolute offset of the data in the file
    nbytes: int


class GGUFFile:
    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._buf = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._mv = memoryview(self._buf)
        self._pos = 0
        try:
            self._parse()
        except (struct.error, IndexError, UnicodeDecodeError, ValueError) as e:
            raise ValueError(
                f"{self.path} is not a valid GGUF file ({e}); it may be truncated or corrupt."
            ) from e

    # ------------------------------------------------------------------ parsing
    def _read(self, fmt: str) -> Any:
        value = struct.unpack_from("<" + fmt, self._mv, self._pos)[0]
        self._pos += struct.calcsize("<" + fmt)
        return value

    def _string(self) -> str:
        n = self._read("Q")
        s = bytes(self._mv[self._pos : self._pos + n]).decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _value(self, vtype: int) -> Any:
        if vtype == 8:
            return self._string()
        if vtype == 9:
            item_type, count = self._read("I"), self._read("Q")
            if item_type in _NUMPY:
                dtype = np.dtype(_NUMPY[item_type]).newbyteorder("<")
                arr = np.frombuffer(self._mv, dtype=dtype, count=count, offset=self._pos)
                self._pos += arr.nbytes
                return arr.tolist()
            if item_type == 8:
                starts = array("q")
                for _ in range(count):
                    starts.append(self._pos)
                    n = self._read("Q")
                    self._pos += n
                return GGUFStringArray(self._mv, starts)
            return [self._value(item_type) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {vtype}")
        return self._read(_SCALARS[vtype])

    def _parse(self) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        if bytes(self._mv[:4]) != _MAGIC:
            raise ValueError("bad magic (not a GGUF file)")
        self._pos = 4
        self.version = self._read("I")
        if self.version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {self.version}")
        n_tensors, n_kv = self._read("Q"), self._read("Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._read("I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            ne = [self._read("Q") for _ in range(self._read("I"))]
            ggml_type, offset = self._read("I"), self._read("Q")
            infos.append((name, ne, ggml_type, offset))
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors: list[GGUFTensorInfo] = []
        for name, ne, ggml_type, offset in infos:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            n = int(np.prod(ne)) if ne else 1
            nbytes = n // block * type_size
            start = data_start + offset
            if start + nbytes > len(self._buf):
                raise ValueError(f"tensor {name} runs past the end of the file")
            self.tensors.append(
                GGUFTensorInfo(name, tuple(int(d) for d in reversed(ne)), ggml_type, start, nbytes)
            )

    def tensor_bytes(self, info: GGUFTensorInfo) -> np.ndarray:
        return self._buf[info.offset : info.offset + info.nbytes]
