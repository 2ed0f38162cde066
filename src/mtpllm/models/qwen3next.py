"""Qwen3-Next (`qwen3next`): the hybrid MoE that Qwen3.5 grew from. Differences from `qwen35`
(both in llama.cpp's converter and in Hugging Face's model): one projection `in_proj_qkvz` that
the converter splits into `attn_qkv` + `attn_gate`, beta and alpha from one projection `ssm_ba`
laid out per key head, and DeltaNet value heads left in Hugging Face's grouped order. The router
renormalises its top-k weights (`norm_topk_prob`, true in the released models). See `qwen35.py`."""
from .qwen35 import CONFIG, HF_MTP_MAP, adjust_config, build_mtp_block, load_model
from .qwen35 import HF_MAP as _QWEN35_MAP

HF_MAP = {k: v for k, v in _QWEN35_MAP.items()
          if ".in_proj_qkv." not in k and ".in_proj_z." not in k and ".in_proj_a." not in k
          and ".in_proj_b." not in k}

__all__ = ["CONFIG", "HF_MAP", "HF_MTP_MAP", "adjust_config", "build_mtp_block", "load_model"]
