"""Qwen2 / Qwen2.5: llama-style blocks with biases on q, k, v; NEOX rotary."""


def adjust_config(g, cfg: dict) -> None:
    cfg["qkv_bias"] = True


# Hugging Face name (after the `model.` prefix) -> GGUF name, per layer `{i}` (`models/hf.py`)
HF_MAP = {
    "embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight", "lm_head.weight": "output.weight",
    "layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight", "layers.{i}.self_attn.q_proj.bias": "blk.{i}.attn_q.bias",
    "layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight", "layers.{i}.self_attn.k_proj.bias": "blk.{i}.attn_k.bias",
    "layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight", "layers.{i}.self_attn.v_proj.bias": "blk.{i}.attn_v.bias",
    "layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "layers.{i}.self_attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",
    "layers.{i}.self_attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
    "layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight", "layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
}
HF_MTP_MAP: dict = {}
