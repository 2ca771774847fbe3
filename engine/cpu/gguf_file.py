"""A GGUF file read as it lies on disk: its metadata, and each tensor as a view of the mapped file.

The gguf package's reader makes a numpy object for every element of every metadata array (a
tokenizer's 49,152 tokens and 48,900 merges: 160 MB for a 100 MB model, and seconds); this one
decodes the metadata once into Python values and leaves the tensors in the memory map, so a loader
takes what it keeps (the blocks of the products, the norms) and nothing else of the file stays.

The format (version 2 and 3): a header, key/value pairs, tensor descriptions, then the tensors'
data, aligned. Tensor dimensions are stored innermost first; ``shape`` gives them outermost first,
as torch and Hugging Face checkpoints do ([out features, in features] for a product's weight).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError

MAGIC = b"GGUF"
# metadata value types: (struct format, size) of the scalars; 8 is a string, 9 an array
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
F32 = 0  # the GGML type of plain float32 tensors


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    type: int  # GGML type id
    shape: tuple[int, ...]  # outermost first
    offset: int  # from the start of the file


class GGUFFile:
    """``metadata``: key -> value (arrays as lists); ``tensors``: name -> TensorInfo."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as handle:
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        if self._map[:4] != MAGIC:
            raise ConfigError(f"{self.path} is not a GGUF file")
        self._at = 4
        version, tensor_count, kv_count = self._unpack("<IQQ")
        if version not in (2, 3):
            raise ConfigError(f"{self.path}: GGUF version {version} is not read here (2 and 3 are)")
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            (kind,) = self._unpack("<I")
            self.metadata[key] = self._value(kind)
        described = []
        for _ in range(tensor_count):
            name = self._string()
            (dims,) = self._unpack("<I")
            shape = self._unpack(f"<{dims}Q")
            kind, offset = self._unpack("<IQ")
            described.append((name, kind, tuple(reversed(shape)), offset))
        alignment = int(self.metadata.get("general.alignment", 32))
        start = -(-self._at // alignment) * alignment
        self.tensors = {name: TensorInfo(name, kind, shape, start + offset) for name, kind, shape, offset in described}

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def field(self, key: str, default: Any = None) -> Any:
        """A metadata value of this architecture ("context_length" -> "llama.context_length")."""
        return self.metadata.get(f"{self.arch}.{key}", default)

    def raw(self, name: str) -> np.ndarray:
        """Tensor ``name`` as stored, rows in the checkpoint's order (``row_order``): [rows, row
        bytes] uint8, rows being every dimension but the innermost; a read-only view of the mapped
        file where no rows move."""
        rows, row_bytes = self._layout(name)
        stored = np.frombuffer(self._map, np.uint8, rows * row_bytes, self.tensors[name].offset).reshape(
            rows, row_bytes
        )
        order = self.row_order(name)
        return stored if order is None else stored[order]

    def forget(self, name: str) -> None:
        """Drop tensor ``name``'s pages from this process's memory once it is copied out (they stay
        in the system's file cache; a later read maps them again)."""
        rows, row_bytes = self._layout(name)
        start = self.tensors[name].offset // mmap.PAGESIZE * mmap.PAGESIZE
        end = self.tensors[name].offset + rows * row_bytes
        if hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def _layout(self, name: str) -> tuple[int, int]:
        """(rows, bytes a row) of tensor ``name`` as stored."""
        import gguf

        info = self.tensors[name]
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(info.type)]
        return int(np.prod(info.shape[:-1], dtype=np.int64)), info.shape[-1] // block * size

    def floats(self, name: str, rows: slice | None = None) -> np.ndarray:
        """Tensor ``name`` dequantized to float32, in its shape, rows in the checkpoint's order
        (the gguf package's arithmetic); ``rows``: only those of a matrix, [rows, columns]."""
        import gguf

        info = self.tensors[name]
        raw = self.raw(name) if rows is None else self.raw(name)[rows]
        if info.type == F32:
            values = raw.view(np.float32)
        else:
            values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(info.type)).astype(np.float32, copy=False)
        return values.reshape(info.shape if rows is None else (len(raw), *info.shape[1:]))

    def row_order(self, name: str) -> np.ndarray | None:
        """Where a tensor's rows differ from the checkpoint it was converted from, the stored row of
        each checkpoint row: llama.cpp's converter interleaves the two halves of every query and key
        head of a Llama model for its RoPE, and transformers' loader (so this one too) undoes that."""
        if self.arch != "llama" or not (".attn_q." in name or ".attn_k." in name):
            return None
        heads = self.field("attention.head_count")
        groups = heads if ".attn_q." in name else self.field("attention.head_count_kv", heads)
        rows = self.tensors[name].shape[0]
        return np.arange(rows).reshape(groups, rows // groups // 2, 2).swapaxes(2, 1).reshape(rows)

    def _unpack(self, layout: str) -> tuple:
        values = struct.unpack_from(layout, self._map, self._at)
        self._at += struct.calcsize(layout)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        text = self._map[self._at : self._at + length].decode("utf-8", errors="replace")
        self._at += length
        return text

    def _value(self, kind: int) -> Any:
        if kind == STRING:
            return self._string()
        if kind == ARRAY:
            element, count = self._unpack("<IQ")
            if element == STRING:
                return [self._string() for _ in range(count)]
            if element == ARRAY:
                return [self._value(ARRAY) for _ in range(count)]
            layout = SCALARS[element]
            values = np.frombuffer(self._map, np.dtype("<" + layout), count, self._at).tolist()
            self._at += count * struct.calcsize(layout)
            return values
        (value,) = self._unpack("<" + SCALARS[kind])
        return value
