"""Write a random-weight model shaped exactly like Qwen3.5-0.8B, for speed comparisons on the CPU.

No real weights of the family can be downloaded here, and speed does not depend on the values:
the model has the real configuration (24 layers, three Gated DeltaNet layers then one gated
full-attention layer, hidden 1024, FFN 3584, 8 query / 2 KV heads of 256 with a quarter rotated,
16 DeltaNet key and value heads of 128, conv kernel 4, vocabulary 248320 with tied embeddings, one
MTP layer) and random weights at transformers' initialisation scales.

Steps (each skipped when its output exists):
  1. `hf/`: a Hugging Face checkpoint written with transformers' `Qwen3_5ForCausalLM` (bf16
     safetensors + config.json) plus the MTP layer (`mtp.*`) in the released layout, and a
     tokenizer.json built from a Qwen2.5 GGUF's byte-level BPE vocabulary (the converter pads
     the vocabulary to 248320 entries);
  2. `qwen35-0.8b-f16.gguf`: llama.cpp's `convert_hf_to_gguf.py` (MTP layer included);
  3. `qwen35-0.8b-q4_k_m.gguf`: llama.cpp's `llama-quantize ... Q4_K_M`.

    python scripts/make_qwen35_08b.py OUT_DIR --llamacpp LLAMA_CPP_SOURCE --quantize PATH/llama-quantize \
        [--tokenizer-from QWEN2.5.gguf] [--seed 0]

Needs transformers >= 5.18 (Qwen3_5), safetensors, tokenizers, and about 6 GB of memory.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CONFIG = dict(
    vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
    num_attention_heads=8, num_key_value_heads=2, head_dim=256, attention_bias=False, attn_output_gate=True,
    linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, rms_norm_eps=1e-6, full_attention_interval=4, max_position_embeddings=262144,
    tie_word_embeddings=True, hidden_act="silu",
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True},
)
MTP_LAYERS = 1
DEFAULT_TOKENIZER = Path.home() / ".cache/mtpllm/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


def write_tokenizer(d: Path, src: Path) -> tuple[int, int]:
    """tokenizer.json + tokenizer_config.json from a GGUF's byte-level BPE vocabulary (Qwen2.5's:
    the same byte-level scheme as Qwen3.5's). Returns (eos id, pad id)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from mtpllm.gguf.reader import GGUFFile
    meta = GGUFFile(src).metadata
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta["tokenizer.ggml.token_type"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True) for t, ty in zip(tokens, types) if ty == 3])
    tk.save(str(d / "tokenizer.json"))
    eos = int(meta.get("tokenizer.ggml.eos_token_id", len(tokens) - 1))
    pad = int(meta.get("tokenizer.ggml.padding_token_id", eos))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": tokens[eos], "pad_token": tokens[pad], "bos_token": None,
        "chat_template": meta.get("tokenizer.chat_template", ""), "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": CONFIG["max_position_embeddings"]}))
    return eos, pad


def mtp_tensors(gen, dtype) -> dict:
    """The MTP layer in the released layout (fc 2D -> D with the embedding half first, two pre-fc
    norms, one gated full-attention decoder layer with a dense FFN, the final norm); norms stored
    zero-centred, matrices at transformers' initialisation scale (std 0.02)."""
    import torch
    c = CONFIG
    D, H, KV, hd, F = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], \
        c["intermediate_size"]

    def w(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(dtype)

    def norm(n):
        return torch.zeros(n, dtype=dtype)

    p = "mtp.layers.0."
    return {"mtp.fc.weight": w(D, 2 * D), "mtp.pre_fc_norm_embedding.weight": norm(D),
            "mtp.pre_fc_norm_hidden.weight": norm(D), "mtp.norm.weight": norm(D),
            p + "input_layernorm.weight": norm(D), p + "post_attention_layernorm.weight": norm(D),
            p + "self_attn.q_proj.weight": w(2 * H * hd, D), p + "self_attn.k_proj.weight": w(KV * hd, D),
            p + "self_attn.v_proj.weight": w(KV * hd, D), p + "self_attn.o_proj.weight": w(D, H * hd),
            p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd),
            p + "mlp.gate_proj.weight": w(F, D), p + "mlp.up_proj.weight": w(F, D), p + "mlp.down_proj.weight": w(D, F)}


def write_checkpoint(d: Path, tokenizer_src: Path, seed: int) -> None:
    import torch
    import transformers as tf
    from safetensors.torch import save_file
    d.mkdir(parents=True, exist_ok=True)
    eos, pad = write_tokenizer(d, tokenizer_src)
    torch.manual_seed(seed)
    cfg = tf.Qwen3_5TextConfig(**CONFIG, eos_token_id=eos, pad_token_id=pad)
    model = tf.Qwen3_5ForCausalLM(cfg).to(torch.bfloat16).eval()
    model.config.architectures = ["Qwen3_5ForCausalLM"]
    model.config.save_pretrained(d)
    conf = json.loads((d / "config.json").read_text())
    conf["mtp_num_hidden_layers"] = MTP_LAYERS  # what the released config says (transformers does not model it)
    (d / "config.json").write_text(json.dumps(conf, indent=2))
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    state |= mtp_tensors(torch.Generator().manual_seed(seed + 1), torch.bfloat16)
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})


def convert(hf: Path, out: Path, llamacpp: Path) -> None:
    # the tokenizer built above is not in the converter's list of known pre-tokenizers: it is
    # Qwen2's byte-level scheme, so name it that
    script = ("import sys, runpy; root = sys.argv[1]; sys.path[:0] = [root, root + '/gguf-py'];"
              "from conversion import base; base.TextModel.get_vocab_base_pre = lambda self, tok: 'qwen2';"
              "sys.argv = [root + '/convert_hf_to_gguf.py'] + sys.argv[2:];"
              "runpy.run_path(root + '/convert_hf_to_gguf.py', run_name='__main__')")
    subprocess.run([sys.executable, "-c", script, str(llamacpp), str(hf), "--outfile", str(out), "--outtype", "f16"],
                   check=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--llamacpp", type=Path, required=True, help="llama.cpp source tree (convert_hf_to_gguf.py)")
    ap.add_argument("--quantize", type=Path, required=True, help="the llama-quantize binary")
    ap.add_argument("--tokenizer-from", type=Path, default=DEFAULT_TOKENIZER,
                    help="a GGUF with a byte-level BPE vocabulary (default: the registry's Qwen2.5-Coder 0.5B)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    for p, what in ((a.llamacpp / "convert_hf_to_gguf.py", "llama.cpp's converter"), (a.quantize, "llama-quantize"),
                    (a.tokenizer_from, "the tokenizer GGUF")):
        if not p.is_file():
            print(f"error: {what} not found at {p}", file=sys.stderr)
            return 2
    a.out.mkdir(parents=True, exist_ok=True)
    hf, f16, q4 = a.out / "hf", a.out / "qwen35-0.8b-f16.gguf", a.out / "qwen35-0.8b-q4_k_m.gguf"
    if not (hf / "model.safetensors").exists():
        print(f"writing the checkpoint to {hf}", flush=True)
        write_checkpoint(hf, a.tokenizer_from, a.seed)
    if not f16.exists():
        print(f"converting to {f16}", flush=True)
        convert(hf, f16, a.llamacpp)
    if not q4.exists():
        print(f"quantizing to {q4}", flush=True)
        subprocess.run([str(a.quantize), str(f16), str(q4), "Q4_K_M"], check=True)
    print(q4)
    return 0


if __name__ == "__main__":
    sys.exit(main())
