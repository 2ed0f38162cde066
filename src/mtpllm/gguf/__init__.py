"""GGUF file access: a validated, memory-mapped reader and a quant-type registry."""
from .reader import GGUFFile, TensorInfo
from .quants import dequantize, SUPPORTED_TYPES

__all__ = ["GGUFFile", "TensorInfo", "dequantize", "SUPPORTED_TYPES"]
