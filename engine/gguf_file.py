"""A GGUF file's metadata and tensor table, read straight from a memory map.

The `gguf` package's GGUFReader builds a numpy view for every part of every metadata value: SmolLM2's vocabulary
and merges are ~100,000 strings, ~500,000 views, 3.9-4.4 s on the EPYC before the first tensor is read. This reads
the same header with `struct` (0.11-0.16 s) and hands out each tensor's bytes as GGUFReader does (a read-only numpy
array over the map: typed for float and integer tensors, [rows, bytes a row] of uint8 for quantized ones), so
`gguf.dequantize` reads them as before. Versions 2 and 3 of the format:
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
# GGUF value types with a fixed size: struct format and numpy dtype (little-endian files only, as llama.cpp writes).
SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
           4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
           10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
# Tensors stored element by element (ggml types F32, F16, I8, I16, I32, I64, F64); every other type is blocks.
PLAIN_TENSORS = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64,
                 28: np.float64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # as GGUF lists it: innermost dimension first
    data: np.ndarray


class GGUFFile:
    """`fields`: every metadata key and its value (Python scalars and strings, lists for arrays); `tensors`: the
    tensor table, in file order."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        if self._take(4) != MAGIC:
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        version, num_tensors, num_fields = self._unpack("<I"), self._unpack("<Q"), self._unpack("<Q")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
        self.fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I"))
        table = [(self._string(), [self._unpack("<Q") for _ in range(self._unpack("<I"))], self._unpack("<I"),
                  self._unpack("<Q")) for _ in range(num_tensors)]
        alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-self._pos // alignment) * alignment
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        self.tensors = [self._tensor(name, dims, GGMLQuantizationType(raw_type), GGML_QUANT_SIZES,
                                     data_start + offset) for name, dims, raw_type, offset in table]

    def _take(self, n: int) -> bytes:
        out = self._map[self._pos:self._pos + n]
        if len(out) != n:
            raise ValueError("the GGUF file ends inside its header")
        self._pos += n
        return out

    def _unpack(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self._map, self._pos)
        except struct.error:
            raise ValueError("the GGUF file ends inside its header") from None
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        return self._take(self._unpack("<Q")).decode("utf-8", errors="replace")

    def _value(self, kind: int) -> Any:
        if kind == STRING:
            return self._string()
        if kind == ARRAY:
            item_kind, count = self._unpack("<I"), self._unpack("<Q")
            if item_kind in SCALARS:
                dtype = np.dtype(SCALARS[item_kind][1]).newbyteorder("<")
                if self._pos + count * dtype.itemsize > len(self._map):
                    raise ValueError("the GGUF file ends inside its header")
                values = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos)
                self._pos += values.nbytes
                return values.tolist()
            return [self._value(item_kind) for _ in range(count)]
        if kind not in SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self._unpack(SCALARS[kind][0])

    def _tensor(self, name: str, dims: list[int], ggml_type: Any, quant_sizes: dict, offset: int) -> GGUFTensor:
        shape = tuple(reversed(dims))  # numpy order: outermost first
        if ggml_type in PLAIN_TENSORS:
            dtype, count = PLAIN_TENSORS[ggml_type], int(np.prod(shape))
        else:
            block_size, type_size = quant_sizes[ggml_type]
            shape = (*shape[:-1], shape[-1] // block_size * type_size)
            dtype, count = np.uint8, int(np.prod(shape))
        if offset + count * np.dtype(dtype).itemsize > len(self._map):
            raise ValueError(f"tensor {name!r} runs past the end of the GGUF file")
        data = np.frombuffer(self._map, dtype=dtype, count=count, offset=offset).reshape(shape)
        return GGUFTensor(name, ggml_type, tuple(dims), data)
