"""Gemma 3 (text): sandwich norms, q/k norms, GELU(tanh) MLP, embeddings scaled by sqrt(d),
sliding-window attention on 5 of every 6 layers (rotary base 10000 there), global layers use
the file's rotary base and scaling. GGUF stores the norms' (1 + w) already folded in."""
import math


def adjust_config(g, cfg: dict) -> None:
    cfg["qk_norm"] = True
    cfg["sandwich_norm"] = True
    cfg["act"] = "gelu_tanh"
    cfg["embed_scale"] = math.sqrt(cfg["d_model"])
    cfg["tied_embeddings"] = "output.weight" not in g
    cfg["sliding_window"] = int(g.get("gemma3.attention.sliding_window", 0) or 0)
    n = cfg["n_layers"]
    cfg["swa_layers"] = tuple((i + 1) % 6 != 0 for i in range(n))  # every 6th layer is global
    cfg["rope"].base_swa = 10000.0
    # llama.cpp: the 27B model (62 layers) scales queries by 1/sqrt(d_model / n_heads), others by 1/sqrt(head_dim)
    if n == 62:
        cfg["attn_scale"] = 1.0 / math.sqrt(cfg["d_model"] / cfg["n_heads"])
    softcap = g.get("gemma3.final_logit_softcapping")
    if softcap:
        cfg["final_softcap"] = float(softcap)
