"""Memory-mapped, lazy, validated GGUF reader.

The header is parsed here (the `gguf` library's reader builds a numpy view per array element and
takes ~17 s on a 150k-token vocabulary; this parser takes well under a second). Types, sizes and
dequantization come from the `gguf` library. Every structural problem (not a GGUF file,
truncated header, tensor data past the end of the file, unsupported type, missing key) is
reported as an MtpllmError naming the file and the tensor or key.

The file is untrusted input: every count and length in the header is checked against the bytes
left in the file before anything is allocated or looped over, so reading a header costs time and
memory in proportion to the header's size (at most ~20x its bytes, for arrays of 16-bit values
held as Python ints), whatever numbers it holds.
"""
from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGML_QUANT_SIZES, GGUFValueType

from ..errors import MtpllmError
from .quants import dequantize, SUPPORTED_TYPES

GGUF_MAGIC = b"GGUF"

# scalar value types: struct format
_SCALAR = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_NP = {
    GGUFValueType.UINT8: np.uint8, GGUFValueType.INT8: np.int8, GGUFValueType.UINT16: np.uint16,
    GGUFValueType.INT16: np.int16, GGUFValueType.UINT32: np.uint32, GGUFValueType.INT32: np.int32,
    GGUFValueType.FLOAT32: np.float32, GGUFValueType.BOOL: np.bool_, GGUFValueType.UINT64: np.uint64,
    GGUFValueType.INT64: np.int64, GGUFValueType.FLOAT64: np.float64,
}


# smallest encoded size of one array element / one metadata entry / one tensor header entry
_MIN_SIZE = {GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}
_MIN_KV = 8 + 4 + 1  # empty key, value type, a one-byte value
_MIN_TENSOR = 8 + 4 + 4 + 8  # empty name, n_dims = 0, type, offset
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 2  # an array of arrays at most (GGUF files use plain arrays)
MAX_ALIGNMENT = 1 << 30
MAX_ELEMENTS = 1 << 48  # elements of one tensor: far beyond any file, far below int64 overflow


class _Truncated(Exception):
    pass


class _Bad(Exception):
    """A count or length that the rest of the file cannot hold."""


class _Cursor:
    """Sequential reads over a buffer; running past the end raises _Truncated."""

    def __init__(self, buf):
        self.buf = buf
        self.pos = 0

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if n < 0 or end > len(self.buf):
            raise _Truncated(self.pos)
        view = memoryview(self.buf)[self.pos:end]
        self.pos = end
        return view

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    @property
    def left(self) -> int:
        return len(self.buf) - self.pos

    def string(self) -> str:
        n = self.unpack("<Q")
        return bytes(self.take(n)).decode("utf-8", errors="replace")

    def value(self, vtype: int, depth: int = 0) -> Any:
        vtype = GGUFValueType(vtype)
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            etype = GGUFValueType(self.unpack("<I"))
            n = self.unpack("<Q")
            size = _MIN_SIZE.get(etype) or np.dtype(_NP[etype]).itemsize
            if n * size > self.left:
                raise _Bad(f"an array of {n} {etype.name} values needs at least {n * size} bytes, "
                           f"only {self.left} are left in the file")
            if etype == GGUFValueType.STRING:
                return [self.string() for _ in range(n)]
            if etype == GGUFValueType.ARRAY:
                if depth + 1 >= MAX_ARRAY_DEPTH:
                    raise _Bad(f"arrays nested more than {MAX_ARRAY_DEPTH} deep")
                return [self.value(GGUFValueType.ARRAY, depth + 1) for _ in range(n)]
            dt = np.dtype(_NP[etype]).newbyteorder("<")
            arr = np.frombuffer(self.take(n * dt.itemsize), dtype=dt)
            return arr.tolist()
        return self.unpack(_SCALAR[vtype])


def _short(v: Any) -> str:
    """A metadata value for an error message (a long array or string is cut)."""
    text = repr(v)
    return text if len(text) <= 60 else text[:50] + f"... ({type(v).__name__} of {len(v)})"


class Metadata(dict):
    """A file's metadata: a dict that remembers which file it came from (for error messages)."""
    source: Path | None = None


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order (outermost first), e.g. (out_features, in_features)
    n_bytes: int
    offset: int  # absolute offset of the data in the file


_PLAIN = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFFile:
    """A GGUF file opened read-only. Tensors are read lazily from the memory map."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.exists():
            raise MtpllmError(f"{self.path}: no such file")
        if self.path.is_dir():
            raise MtpllmError(f"{self.path}: is a directory, expected a GGUF file")
        self.file_size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise MtpllmError(f"{self.path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
        self._file = open(self.path, "rb")
        self._mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if self.file_size else b""
        self.metadata: dict[str, Any] = Metadata()
        self.metadata.source = self.path
        self.tensors: dict[str, TensorInfo] = {}
        cur = _Cursor(self._mm)
        key = "<header>"
        try:
            cur.take(4)
            self.version = cur.unpack("<I")
            if self.version not in (2, 3):
                raise MtpllmError(f"{self.path}: unsupported GGUF version {self.version} (supported: 2, 3)")
            n_tensors = cur.unpack("<Q")
            n_kv = cur.unpack("<Q")
            if n_kv * _MIN_KV > cur.left:
                raise _Bad(f"the header claims {n_kv} metadata entries, the file has room for at most "
                           f"{cur.left // _MIN_KV}")
            if n_tensors * _MIN_TENSOR > cur.left:
                raise _Bad(f"the header claims {n_tensors} tensors, the file has room for at most "
                           f"{cur.left // _MIN_TENSOR}")
            for _ in range(n_kv):
                key = "<key name>"
                key = cur.string()
                vtype = cur.unpack("<I")
                try:
                    GGUFValueType(vtype)
                except ValueError:
                    raise MtpllmError(f"{self.path}: metadata key '{key}' has unknown value type {vtype}") from None
                if key in self.metadata:
                    raise _Bad("the key appears twice")
                self.metadata[key] = cur.value(vtype)
            key = "general.alignment"
            self.alignment = self.metadata.get(key, 32)
            if isinstance(self.alignment, bool) or not isinstance(self.alignment, int) \
                    or not 0 < self.alignment <= MAX_ALIGNMENT or self.alignment & (self.alignment - 1):
                raise MtpllmError(f"{self.path}: metadata 'general.alignment' = {_short(self.alignment)}: expected "
                                  f"a power of two up to {MAX_ALIGNMENT}")
            pending = []
            for i in range(n_tensors):
                key = f"<tensor #{i} header>"
                name = cur.string()
                key = f"tensor '{name}' header"
                n_dims = cur.unpack("<I")
                if not 1 <= n_dims <= MAX_DIMS:
                    raise MtpllmError(f"{self.path}: tensor '{name}' claims {n_dims} dimensions "
                                      f"(expected 1 to {MAX_DIMS})")
                dims = [cur.unpack("<Q") for _ in range(n_dims)]
                tid = cur.unpack("<I")
                off = cur.unpack("<Q")
                pending.append((name, dims, tid, off))
        except _Truncated as exc:
            raise MtpllmError(f"{self.path}: truncated or damaged GGUF header while reading {key} "
                              f"(at byte {exc.args[0]} of {self.file_size})") from None
        except _Bad as exc:
            raise MtpllmError(f"{self.path}: truncated or damaged GGUF header at {key}: {exc}") from None
        except (UnicodeDecodeError, ValueError, OverflowError, struct.error, KeyError) as exc:
            raise MtpllmError(f"{self.path}: damaged GGUF header while reading {key} ({exc})") from None
        pad = (-cur.pos) % self.alignment
        self.data_offset = cur.pos + pad
        for name, dims, tid, off in pending:
            try:
                qtype = GGMLQuantizationType(tid)
            except ValueError:
                raise MtpllmError(f"{self.path}: tensor '{name}' has unknown type id {tid}") from None
            if name in self.tensors:
                raise MtpllmError(f"{self.path}: tensor '{name}' appears twice in the header")
            shape = tuple(int(x) for x in reversed(dims))  # GGUF stores innermost first
            n = math.prod(shape)
            if n > MAX_ELEMENTS:
                raise MtpllmError(f"{self.path}: tensor '{name}' shape {list(shape)} has {n} elements, more than "
                                  f"any file can hold")
            block, type_size = GGML_QUANT_SIZES.get(qtype, (1, 0))
            info = TensorInfo(name, qtype, shape, n // block * type_size, self.data_offset + off)
            self._check_tensor(info)
            self.tensors[name] = info

    # ---- validation -------------------------------------------------------------------
    def _check_tensor(self, info: TensorInfo) -> None:
        if info.qtype not in GGML_QUANT_SIZES:
            raise MtpllmError(f"{self.path}: tensor '{info.name}' has unknown type id {int(info.qtype)}")
        block, type_size = GGML_QUANT_SIZES[info.qtype]
        if info.shape and info.shape[-1] % block:
            raise MtpllmError(f"{self.path}: tensor '{info.name}' row length {info.shape[-1]} is not a multiple "
                              f"of the {info.qtype.name} block size {block}")
        if info.offset < self.data_offset or (info.offset - self.data_offset) % self.alignment:
            raise MtpllmError(f"{self.path}: tensor '{info.name}' data offset {info.offset} is not aligned "
                              f"to {self.alignment} bytes")
        end = info.offset + info.n_bytes
        if end > self.file_size:
            raise MtpllmError(f"{self.path}: tensor '{info.name}' data runs past the end of the file "
                              f"(ends at byte {end}, file has {self.file_size} bytes; truncated download?)")

    # ---- metadata ---------------------------------------------------------------------
    @property
    def arch(self) -> str:
        return self.require("general.architecture")

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise MtpllmError(f"{self.path}: required metadata key '{key}' is missing")
        return self.metadata[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    # ---- tensors ----------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise MtpllmError(f"{self.path}: required tensor '{name}' is missing")
        return self.tensors[name]

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes/values of a tensor (a view of the memory map)."""
        info = self.info(name)
        qt = info.qtype
        if qt in _PLAIN:
            return np.frombuffer(self._mm, dtype=_PLAIN[qt], count=math.prod(info.shape),
                                 offset=info.offset).reshape(info.shape)
        block, type_size = GGML_QUANT_SIZES[qt]
        rows = math.prod(info.shape[:-1])
        return np.frombuffer(self._mm, dtype=np.uint8, count=info.n_bytes, offset=info.offset).reshape(
            rows, info.shape[-1] // block * type_size)

    def release(self, name: str) -> None:
        """Drop a tensor's pages from this process's mapping (its resident size) once it has been
        copied elsewhere (e.g. repacked); they stay in the page cache and fault back in if read."""
        info = self.info(name)
        if not isinstance(self._mm, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = info.offset // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(len(self._mm), info.offset + info.n_bytes)
        try:
            self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError):  # only a memory saving: never fatal
            pass

    def load(self, name: str) -> torch.Tensor:
        """Dequantized float32 tensor in torch order."""
        info = self.info(name)
        if info.qtype not in SUPPORTED_TYPES:
            raise MtpllmError(f"{self.path}: tensor '{name}' has unsupported type {info.qtype.name}")
        return dequantize(self.raw(name), info.qtype, info.shape, name)
