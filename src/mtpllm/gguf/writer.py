"""Writing GGUF files: tiny random models (tests, examples) and MTP head sidecars.

Thin helpers over the `gguf` library's GGUFWriter and quantizers.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFWriter, GGMLQuantizationType as QT
from gguf import quants as gq


def quantize(arr: np.ndarray, qtype: QT) -> np.ndarray:
    """float32 [.., K] -> stored array for `qtype` (float types as-is, block types as uint8 rows)."""
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if qtype == QT.F32:
        return arr
    if qtype == QT.F16:
        return arr.astype(np.float16)
    return gq.quantize(arr, qtype)


# byte offsets of the float16 super-block scales (d, and dmin where present) inside each K-quant block
_KQ_SCALES = {QT.Q2_K: (80, 82), QT.Q3_K: (108, None), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208, None)}


def random_kquant(shape: tuple[int, int], qtype: QT, rng: np.random.Generator, scale: float = 0.02) -> np.ndarray:
    """Random valid K-quant blocks (the `gguf` library has no K-quant quantizer): random payload bits,
    super-block scales set to small finite float16 values so weights are about `scale` in size."""
    from gguf import GGML_QUANT_SIZES
    block, size = GGML_QUANT_SIZES[qtype]
    n, k = shape
    nb = k // block
    raw = rng.integers(0, 256, size=(n, nb, size), dtype=np.uint8)
    d_off, m_off = _KQ_SCALES[qtype]
    d = (rng.uniform(0.5, 1.0, size=(n, nb)) * scale / 32).astype(np.float16)
    raw[..., d_off:d_off + 2] = d.view(np.uint8).reshape(n, nb, 2)
    if m_off is not None:
        raw[..., m_off:m_off + 2] = (d / 2).astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    return raw.reshape(n, nb * size)


def write_gguf(path: str | Path, arch: str, metadata: dict, tensors: dict[str, tuple[np.ndarray, QT]]) -> Path:
    """Write a GGUF file. metadata: key (without the arch prefix for `arch.*` keys given as '.key') -> value."""
    path = Path(path)
    w = GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        full = arch + key if key.startswith(".") else key
        if isinstance(value, bool):
            w.add_bool(full, value)
        elif isinstance(value, int):
            w.add_uint32(full, value) if value >= 0 else w.add_int32(full, value)
        elif isinstance(value, float):
            w.add_float32(full, value)
        elif isinstance(value, str):
            w.add_string(full, value)
        elif isinstance(value, (list, tuple)):
            w.add_array(full, list(value))
        else:
            raise TypeError(f"metadata {full}: unsupported value type {type(value).__name__}")
    for name, (data, qtype) in tensors.items():
        if qtype in (QT.F32, QT.F16):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
