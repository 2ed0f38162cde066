"""Llama 2/3: plain pre-norm blocks. llama.cpp's converter permutes q/k for adjacent-pair rotary,
so the rotary style is "normal" (pairs 2i, 2i+1); llama3 frequency factors come from `rope_freqs.weight`."""
from .qwen2 import HF_MAP, HF_MTP_MAP  # noqa: F401  (the same Hugging Face names)


def adjust_config(g, cfg: dict) -> None:
    cfg["qkv_bias"] = "blk.0.attn_q.bias" in g
