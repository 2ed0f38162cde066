"""Tiny random-weight models written as real GGUF files (one per architecture), for the fast suite."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT

from mtpllm.gguf.writer import quantize, random_kquant, write_gguf
from mtpllm.tokenizer import _bytes_to_unicode

KQUANTS = {QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K}
D, HEADS, KV, HD, FFN = 256, 4, 2, 64, 512  # K-quants need rows that are multiples of 256

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# tensor -> storage type: together the tiny models cover every type the real files use and more
QTYPES = {
    "attn_q": QT.Q4_K, "attn_k": QT.Q5_0, "attn_v": QT.Q8_0, "attn_output": QT.Q6_K,
    "ffn_gate": QT.Q4_K, "ffn_up": QT.Q5_0, "ffn_down": QT.Q6_K,
}


def gpt2_vocab():
    """A byte-level BPE vocabulary: 256 byte symbols, a few merges, chat control tokens."""
    alphabet = list(_bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "r e", "d e", "Ġ f", "Ġ =", "Ġ Ġ", "ĠĠ ĠĠ"]
    tokens = alphabet + ["".join(m.split()) for m in merges]
    types = [1] * len(tokens)
    for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        tokens.append(s)
        types.append(3)
    meta = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": len(tokens) - 1, "tokenizer.ggml.bos_token_id": len(tokens) - 3,
        "tokenizer.ggml.padding_token_id": len(tokens) - 3, "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }
    return tokens, meta


def spm_vocab():
    """A SentencePiece-style vocabulary with byte fallback (Gemma layout: no merges in the file)."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    types = [3, 3, 3, 2, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    pieces = ["\u2581", "e", "t", "a", "o", "h", "n", "s", "\u2581t", "he", "\u2581the", "in", "\u2581a", "er", "  "]
    tokens += pieces
    types += [1] * (len(pieces) - 1) + [4]
    meta = {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * len(tokens), "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0, "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": False,
    }
    return tokens, meta


def _t(rng, shape, qtype, scale=0.05):
    if qtype in KQUANTS:
        return random_kquant(shape, qtype, rng, scale), qtype
    return quantize(rng.normal(0, scale, size=shape).astype(np.float32), qtype), qtype


def _block(rng, i, arch, tensors, qtypes=QTYPES, ffn=FFN):
    p = f"blk.{i}."
    tensors[p + "attn_norm.weight"] = (1 + rng.normal(0, 0.1, D).astype(np.float32), QT.F32)
    tensors[p + "ffn_norm.weight"] = (1 + rng.normal(0, 0.1, D).astype(np.float32), QT.F32)
    tensors[p + "attn_q.weight"] = _t(rng, (HEADS * HD, D), qtypes["attn_q"])
    tensors[p + "attn_k.weight"] = _t(rng, (KV * HD, D), qtypes["attn_k"])
    tensors[p + "attn_v.weight"] = _t(rng, (KV * HD, D), qtypes["attn_v"])
    tensors[p + "attn_output.weight"] = _t(rng, (D, HEADS * HD), qtypes["attn_output"])
    tensors[p + "ffn_gate.weight"] = _t(rng, (ffn, D), qtypes["ffn_gate"])
    tensors[p + "ffn_up.weight"] = _t(rng, (ffn, D), qtypes["ffn_up"])
    tensors[p + "ffn_down.weight"] = _t(rng, (D, ffn), qtypes["ffn_down"])
    if arch == "qwen2":
        for n, size in (("attn_q.bias", HEADS * HD), ("attn_k.bias", KV * HD), ("attn_v.bias", KV * HD)):
            tensors[p + n] = (rng.normal(0, 0.1, size).astype(np.float32), QT.F32)
    if arch in ("qwen3", "gemma3"):
        tensors[p + "attn_q_norm.weight"] = (1 + rng.normal(0, 0.1, HD).astype(np.float32), QT.F32)
        tensors[p + "attn_k_norm.weight"] = (1 + rng.normal(0, 0.1, HD).astype(np.float32), QT.F32)
    if arch == "gemma3":
        tensors[p + "post_attention_norm.weight"] = (1 + rng.normal(0, 0.1, D).astype(np.float32), QT.F32)
        tensors[p + "post_ffw_norm.weight"] = (1 + rng.normal(0, 0.1, D).astype(np.float32), QT.F32)


def nextn_tensors(rng, L, arch, tensors, ffn=FFN, qtypes=QTYPES):
    """An MTP (next-n) block `blk.L.*` in llama.cpp's layout."""
    _block(rng, L, arch, tensors, qtypes, ffn)
    p = f"blk.{L}.nextn."
    tensors[p + "eh_proj.weight"] = _t(rng, (D, 2 * D), QT.Q8_0, 0.1)
    tensors[p + "enorm.weight"] = (1 + rng.normal(0, 0.1, D).astype(np.float32), QT.F32)
    tensors[p + "hnorm.weight"] = (1 + rng.normal(0, 0.1, D).astype(np.float32), QT.F32)
    tensors[p + "shared_head_norm.weight"] = (1 + rng.normal(0, 0.1, D).astype(np.float32), QT.F32)


def make_tiny(path: str | Path, arch: str = "qwen2", n_layers: int = 2, seed: int = 0, nextn: int = 0,
              out_scale: float = 0.15, ctx: int = 256, out_type: QT = QT.F16, embd_type: QT = QT.Q8_0,
              qtypes: dict | None = None, never: list[int] | None = None) -> Path:
    """Write a tiny random model of `arch` (qwen2, qwen3, llama, gemma3), optionally with `nextn` MTP blocks.
    `never`: token ids whose output rows are zero, so greedy decoding never picks them (e.g. the end
    of text: an answer that goes on until its token limit; not for gemma3, whose output is the embedding)."""
    rng = np.random.default_rng(seed)
    tokens, tmeta = spm_vocab() if arch == "gemma3" else gpt2_vocab()
    V = len(tokens)
    tensors: dict = {}
    tensors["token_embd.weight"] = _t(rng, (V, D), embd_type, 1.0)
    for i in range(n_layers + nextn):
        _block(rng, i, arch, tensors, qtypes or QTYPES)
    for j in range(nextn):
        nextn_tensors(rng, n_layers + j, arch, tensors, qtypes=qtypes or QTYPES)
        # nextn_tensors re-wrote the block with a fresh draw: fine, it is random either way
    tensors["output_norm.weight"] = (1 + rng.normal(0, 0.1, D).astype(np.float32), QT.F32)
    if arch != "gemma3":
        if never:
            w = rng.normal(0, out_scale, size=(V, D)).astype(np.float32)
            w[list(never)] = 0.0  # logit 0 loses to the largest of the other rows' random logits
            tensors["output.weight"] = quantize(w, out_type), out_type
        else:
            tensors["output.weight"] = _t(rng, (V, D), out_type, out_scale)
    meta = {
        ".block_count": n_layers + nextn, ".context_length": ctx, ".embedding_length": D,
        ".feed_forward_length": FFN, ".attention.head_count": HEADS, ".attention.head_count_kv": KV,
        ".attention.key_length": HD, ".attention.value_length": HD, ".rope.freq_base": 10000.0,
        ".attention.layer_norm_rms_epsilon": 1e-6, "general.name": f"tiny-{arch}",
    }
    if nextn:
        meta[".nextn_predict_layers"] = nextn
    if arch == "gemma3":
        meta[".attention.sliding_window"] = 8
    meta.update(tmeta)
    return write_gguf(path, arch, meta, tensors)


def make_tiny_head(path: str | Path, arch: str = "qwen2", n_layers: int = 2, seed: int = 1, ffn: int = 256,
                   trunk_sha256: str | None = None, draft_vocab: list[int] | None = None,
                   meta: dict | None = None) -> Path:
    """A head-only `mtp-*.gguf` file for a tiny trunk with `n_layers` layers (block index n_layers)."""
    rng = np.random.default_rng(seed)
    tensors: dict = {}
    nextn_tensors(rng, n_layers, arch, tensors, ffn=ffn)
    extra = meta or {}
    meta = {".block_count": n_layers + 1, ".nextn_predict_layers": 1, ".embedding_length": D,
            ".feed_forward_length": ffn, ".attention.head_count": HEADS, ".attention.head_count_kv": KV,
            "general.type": "mtp-head", **extra}
    if trunk_sha256:
        meta["mtpllm.trunk_sha256"] = trunk_sha256
    if draft_vocab is not None:
        meta["mtpllm.draft_vocab"] = [int(x) for x in draft_vocab]
    return write_gguf(path, arch, meta, tensors)


def check_fill_matches_forward(engine, T: int, seed: int) -> None:
    """The engine's MTP head: `fill` over T random rows writes the cache entries its full forward
    writes (the same bits at T >= 32 rows, where both run the PyTorch modules; float32 rounding
    against the C++ block below that), and the next row's output then matches. Shared by the dense
    and the hybrid heads' tests."""
    import pytest
    import torch

    from mtpllm.errors import MtpllmError
    from mtpllm.speculative.mtp import MTPProposer
    prop = MTPProposer.for_engine(engine)
    head, cfg = prop.head, engine.model.cfg
    g = torch.Generator().manual_seed(seed)
    emb = prop.embed(torch.randint(0, cfg.vocab_size, (T + 1,), generator=g))
    hid = torch.randn(T + 1, cfg.d_model, generator=g)
    full, filled = head.make_cache(cfg, 64), head.make_cache(cfg, 64)
    with torch.inference_mode():
        head(emb[:T], hid[:T], full)
        head.fill(emb[:T], hid[:T], filled)
        assert filled.length == full.length == T
        tol = dict(rtol=0, atol=0) if T >= 32 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(filled.k[:, :, :T], full.k[:, :, :T], **tol)
        torch.testing.assert_close(filled.v[:, :, :T], full.v[:, :, :T], **tol)
        assert filled.k[:, :, :T].abs().max() > 0.1  # entries were written
        torch.testing.assert_close(head(emb[T:], hid[T:], filled), head(emb[T:], hid[T:], full), rtol=1e-5, atol=1e-5)
        with pytest.raises(MtpllmError, match="exceed"):
            head.fill(emb, hid, head.make_cache(cfg, T))
