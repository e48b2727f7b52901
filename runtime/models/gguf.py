"""GGUF files: header parsing, model facts, and tensor access.

The header is parsed here directly from a memory map rather than through
`gguf.GGUFReader`, which builds Python objects for every element of every array (22 s for
Gemma 3's 262,144-token vocabulary on a 2-core machine). Large arrays are recorded as
`LazyArray` (type, count, offset) and read only on demand. The `gguf` package supplies
the quantization tables (block size and bytes per type) and, for the executors,
dequantization.

Every problem with a file (missing, not GGUF, unsupported version, truncated) raises a
`ModelFileError` whose message is one sentence.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvdeck.runtime.errors import ModelFileError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# Arrays longer than this are not materialized while parsing the header.
MAX_EAGER_ARRAY = 64

# GGUF value types -> (struct code, size). 8 = string, 9 = array are handled separately.
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4),
    6: ("f", 4), 7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8),
}
_NUMPY_DTYPES = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "u1",
                 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class LazyArray:
    """A large metadata array left in the file: its element type, length and offset."""

    value_type: int
    count: int
    offset: int
    """Where the array's elements start in the file."""
    end: int = 0
    """Where they end."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry. `shape` is in GGUF order (fastest-varying dimension first)."""

    name: str
    shape: tuple[int, ...]
    type_name: str
    type_id: int
    offset: int
    """Byte offset from the start of the tensor data section."""
    num_bytes: int

    @property
    def num_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class _Cursor:
    """Bounds-checked little-endian reads from a buffer; running past the end means truncation."""

    def __init__(self, buf: memoryview, path: Path):
        self.buf = buf
        self.pos = 0
        self.path = path

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > len(self.buf):
            raise ModelFileError(
                f"{self.path} is truncated: its GGUF header runs past the end of the file "
                f"({len(self.buf):,} bytes)."
            )
        self.pos += n
        return start

    def scalar(self, code: str, size: int) -> Any:
        return struct.unpack_from("<" + code, self.buf, self.take(size))[0]

    def u32(self) -> int:
        return self.scalar("I", 4)

    def u64(self) -> int:
        return self.scalar("Q", 8)

    def string(self) -> str:
        n = self.u64()
        start = self.take(n)
        return bytes(self.buf[start:start + n]).decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        self.take(self.u64())


@dataclass
class GGUFFile:
    """A parsed GGUF header plus a memory map of the file for tensor access."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    alignment: int
    data_offset: int
    file_size: int
    _mmap: mmap.mmap | None = field(default=None, repr=False)

    @property
    def expected_size(self) -> int:
        """The size the header implies: data section start plus the furthest tensor end."""
        end = max((t.offset + t.num_bytes for t in self.tensors.values()), default=0)
        return self.data_offset + end

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def strings(self, key: str) -> list[str]:
        """A string-array metadata value in full (a large one is read from the file now)."""
        value = self.get(key)
        if not isinstance(value, LazyArray):
            return list(value or [])
        assert self._mmap is not None and value.value_type == _STRING
        cur = _Cursor(memoryview(self._mmap)[:value.end], self.path)
        cur.pos = value.offset
        return [cur.string() for _ in range(value.count)]

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The raw bytes of one tensor as a read-only uint8 view into the memory map."""
        info = self.tensors[name]
        assert self._mmap is not None
        return np.frombuffer(self._mmap, dtype=np.uint8, count=info.num_bytes,
                             offset=self.data_offset + info.offset)

    def drop_pages(self, name: str) -> None:
        """Give one tensor's file pages back to the kernel (the map stays valid: a later
        read faults them in again), so a model load holds one tensor's pages resident at a
        time, not the whole file's beside the dequantized weights."""
        info = self.tensors[name]
        if self._mmap is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = self.data_offset + info.offset
        first = start - start % mmap.PAGESIZE
        try:
            self._mmap.madvise(mmap.MADV_DONTNEED, first, start + info.num_bytes - first)
        except (OSError, ValueError):
            pass  # only a hint: the pages then go when the map is closed

    def close(self) -> None:
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # tensor views are still alive; the map is unmapped when they go
            self._mmap = None


def _read_value(cur: _Cursor, value_type: int) -> Any:
    if value_type in _SCALARS:
        return cur.scalar(*_SCALARS[value_type])
    if value_type == _STRING:
        return cur.string()
    if value_type == _ARRAY:
        elem_type = cur.u32()
        count = cur.u64()
        if elem_type not in _SCALARS and elem_type != _STRING:  # nested arrays: not in models
            raise ModelFileError(f"{cur.path} has a metadata array of unknown type {elem_type}.")
        if count > MAX_EAGER_ARRAY:
            start = cur.pos
            if elem_type == _STRING:
                for _ in range(count):
                    cur.skip_string()
            else:
                cur.take(count * _SCALARS[elem_type][1])
            return LazyArray(elem_type, count, start, cur.pos)
        return [_read_value(cur, elem_type) for _ in range(count)]
    raise ModelFileError(f"{cur.path} has a metadata value of unknown type {value_type}.")


def _tensor_nbytes(path: Path, name: str, shape: tuple[int, ...], type_id: int) -> tuple[str, int]:
    try:
        qtype = GGMLQuantizationType(type_id)
        block, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise ModelFileError(
            f"{path} has tensor {name!r} of unknown GGML type {type_id}."
        ) from None
    n = 1
    for d in shape:
        n *= d
    return qtype.name, (n // block) * type_size


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse a GGUF file's header and verify the file holds every tensor it declares."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{path} does not exist; give a path to a .gguf file or a model name.")
    if not path.is_file():
        raise ModelFileError(f"{path} is not a file; give a path to a .gguf file or a model name.")
    size = path.stat().st_size
    if size < 24:
        raise ModelFileError(f"{path} is not a GGUF file: it is only {size} bytes long.")
    with path.open("rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ModelFileError(f"{path} is not a GGUF file: it does not start with 'GGUF'.")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(memoryview(mm), path)
    cur.take(4)
    version = cur.u32()
    if version not in SUPPORTED_VERSIONS:
        raise ModelFileError(
            f"{path} is GGUF version {version}; kvdeck reads versions 2 and 3."
        )
    num_tensors, num_kv = cur.u64(), cur.u64()
    metadata: dict[str, Any] = {}
    for _ in range(num_kv):
        key = cur.string()
        metadata[key] = _read_value(cur, cur.u32())
    tensors: dict[str, TensorInfo] = {}
    for _ in range(num_tensors):
        name = cur.string()
        n_dims = cur.u32()
        if n_dims > 8:
            raise ModelFileError(
                f"{path} declares tensor {name!r} with {n_dims} dimensions (at most 8)."
            )
        shape = tuple(cur.u64() for _ in range(n_dims))
        type_id = cur.u32()
        offset = cur.u64()
        type_name, nbytes = _tensor_nbytes(path, name, shape, type_id)
        tensors[name] = TensorInfo(name, shape, type_name, type_id, offset, nbytes)
    cur.buf.release()
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_offset = -(-cur.pos // alignment) * alignment
    g = GGUFFile(path, version, metadata, tensors, alignment, data_offset, size, mm)
    if size < g.expected_size:
        g.close()
        raise ModelFileError(
            f"{path} is truncated: its header declares {g.expected_size:,} bytes of tensors "
            f"and data but the file has {size:,}."
        )
    return g


def iter_tensor_types(g: GGUFFile) -> Iterator[tuple[str, int, int]]:
    """(type name, tensor count, total bytes) per tensor type, largest first."""
    counts: dict[str, list[int]] = {}
    for t in g.tensors.values():
        c = counts.setdefault(t.type_name, [0, 0])
        c[0] += 1
        c[1] += t.num_bytes
    for name, (n, b) in sorted(counts.items(), key=lambda kv: -kv[1][1]):
        yield name, n, b
