"""Qwen2 / Qwen2.5: llama-style blocks with biases on q, k, v; NEOX rotary."""


def adjust_config(g, cfg: dict) -> None:
    cfg["qkv_bias"] = True
