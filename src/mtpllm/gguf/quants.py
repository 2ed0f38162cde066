"""Quant-type registry: which GGML tensor types can be turned into float weights.

Dequantization is done by the `gguf` library (one class per type, registered by type id);
this module adds the torch conversion and a clear error for types it cannot handle.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGML_QUANT_SIZES
from gguf import quants as _gq

from ..errors import MtpllmError


def _dequantizable(qtype: GGMLQuantizationType) -> bool:
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.F64,
                 GGMLQuantizationType.I8, GGMLQuantizationType.I16, GGMLQuantizationType.I32,
                 GGMLQuantizationType.I64):
        return True
    cls = getattr(_gq, "_type_traits", {}).get(qtype)
    if cls is None:
        return False
    # a class whose dequantize_blocks is the abstract base raises NotImplementedError
    return "dequantize_blocks" in vars(cls)


SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    t for t in GGMLQuantizationType if t in GGML_QUANT_SIZES and _dequantizable(t)
)


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...], name: str = "?") -> torch.Tensor:
    """Raw tensor bytes (as stored by the reader) -> float32 torch tensor of `shape` (row-major, torch order)."""
    if qtype not in SUPPORTED_TYPES:
        raise MtpllmError(f"tensor '{name}': quantization type {qtype.name} is not supported "
                          f"(supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))})")
    if qtype == GGMLQuantizationType.F32:
        arr = np.asarray(data, dtype=np.float32)
    elif qtype == GGMLQuantizationType.F16:
        arr = np.asarray(data, dtype=np.float16).astype(np.float32)
    elif qtype in (GGMLQuantizationType.I8, GGMLQuantizationType.I16, GGMLQuantizationType.I32,
                   GGMLQuantizationType.I64, GGMLQuantizationType.F64):
        arr = np.asarray(data).astype(np.float32)
    else:
        arr = _gq.dequantize(np.asarray(data), qtype)
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if not arr.flags.writeable:
        arr = arr.copy()
    return torch.from_numpy(arr).reshape(shape)
