"""Qwen3.5 / Qwen3.6 mixture-of-experts (`qwen35moe`): the `qwen35` hybrid with a routed
feed-forward in every layer (softmax router, top-k renormalised, plus a shared expert scaled by
sigmoid(x W_gate)). Same contract, same file layout: see `qwen35.py`."""
from .qwen35 import CONFIG, HF_MAP, HF_MTP_MAP, adjust_config, build_mtp_block, load_model

__all__ = ["CONFIG", "HF_MAP", "HF_MTP_MAP", "adjust_config", "build_mtp_block", "load_model"]
