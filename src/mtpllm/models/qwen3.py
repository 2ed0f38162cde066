"""Qwen3 dense: no qkv bias, per-head RMSNorm on q and k before rotary."""
from .qwen2 import HF_MAP, HF_MTP_MAP  # noqa: F401  (the same Hugging Face names)


def adjust_config(g, cfg: dict) -> None:
    cfg["qk_norm"] = True
    cfg["head_dim"] = int(g.get("qwen3.attention.key_length", cfg["head_dim"]))
