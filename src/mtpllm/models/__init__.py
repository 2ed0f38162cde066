"""Model architectures: one file per architecture, one contract (see `base.py`)."""
from .config import ModelConfig, config_from_gguf
from .base import Transformer, ARCHITECTURES, load_model

__all__ = ["ModelConfig", "config_from_gguf", "Transformer", "ARCHITECTURES", "load_model"]
