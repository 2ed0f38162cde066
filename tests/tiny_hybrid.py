"""Tiny random Qwen3.5-family checkpoints in Hugging Face's layout (config.json, safetensors,
tokenizer.json), written with transformers' own model classes, plus the model's MTP layer
(`mtp.*`, which transformers does not model: random tensors in the released layout)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tiny import gpt2_vocab

# value heads twice the key heads (grouped like the real models), key/value head dims differ so a
# swapped dimension cannot go unnoticed
DENSE = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=8,
    linear_num_key_heads=2, linear_num_value_heads=4, rms_norm_eps=1e-6, max_position_embeddings=512,
    tie_word_embeddings=False,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [1, 1, 0], "mrope_interleaved": True},
)
MOE = dict(DENSE, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=6,
           num_experts_per_tok=2)
NEXT = dict(MOE, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
KINDS = {"qwen35": "Qwen3_5", "qwen35moe": "Qwen3_5Moe", "qwen3next": "Qwen3Next"}


def _classes(kind: str):
    import transformers as tf
    if kind == "qwen35":
        return tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM, DENSE
    if kind == "qwen35moe":
        return tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM, MOE
    if kind == "qwen3next":
        return tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM, NEXT
    raise ValueError(kind)


def write_tokenizer(d: Path) -> int:
    """tokenizer.json (byte-level BPE: the tiny GGUF models' vocabulary) + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    tokens, meta = gpt2_vocab()
    specials = [t for t in tokens if t.startswith("<|")]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split()) for m in meta["tokenizer.ggml.merges"]]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(specials)
    tk.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
        "chat_template": meta["tokenizer.chat_template"], "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 512}))
    return len(tokens)


def _mtp_tensors(cfg: dict, gen: torch.Generator, echo: float = 0.0) -> dict[str, torch.Tensor]:
    """The MTP layer in the released layout: fc (2D -> D, embedding half first), two pre-fc norms,
    one full-attention decoder layer, the final norm. Norms stored zero-centred (around 0).

    echo > 0: a head that mostly passes the token's embedding through (fc = [I | noise], the block's
    output projections scaled by `echo`): it drafts what the trunk's residual stream, dominated by
    the embedding in these tiny models, says after that token alone, a bigram guess that is right
    often but far from always, so speculation sees acceptances and rejections at every position."""
    D, H, KV, hd, F = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                        "intermediate_size"))

    def w(*shape, s=0.08):
        return torch.randn(*shape, generator=gen) * s

    def norm(n):
        return torch.randn(n, generator=gen) * 0.1

    p = "mtp.layers.0."
    t = {"mtp.fc.weight": w(D, 2 * D), "mtp.pre_fc_norm_embedding.weight": norm(D),
         "mtp.pre_fc_norm_hidden.weight": norm(D), "mtp.norm.weight": norm(D),
         p + "input_layernorm.weight": norm(D), p + "post_attention_layernorm.weight": norm(D),
         p + "self_attn.q_proj.weight": w(2 * H * hd, D), p + "self_attn.k_proj.weight": w(KV * hd, D),
         p + "self_attn.v_proj.weight": w(KV * hd, D), p + "self_attn.o_proj.weight": w(D, H * hd),
         p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd)}
    if "num_experts" in cfg:
        E, Fe, Fs = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
        t |= {p + "mlp.gate.weight": w(E, D), p + "mlp.shared_expert_gate.weight": w(1, D),
              p + "mlp.shared_expert.gate_proj.weight": w(Fs, D), p + "mlp.shared_expert.up_proj.weight": w(Fs, D),
              p + "mlp.shared_expert.down_proj.weight": w(D, Fs)}
        for e in range(E):
            t |= {p + f"mlp.experts.{e}.gate_proj.weight": w(Fe, D), p + f"mlp.experts.{e}.up_proj.weight": w(Fe, D),
                  p + f"mlp.experts.{e}.down_proj.weight": w(D, Fe)}
    else:
        t |= {p + "mlp.gate_proj.weight": w(F, D), p + "mlp.up_proj.weight": w(F, D), p + "mlp.down_proj.weight": w(D, F)}
    if echo:
        t["mtp.fc.weight"] = torch.cat([torch.eye(D), w(D, D, s=0.02)], dim=1)
        for n in list(t):
            if n.endswith(("o_proj.weight", "down_proj.weight")):
                t[n] = t[n] * echo
            elif "norm" in n:
                t[n] = t[n] * 0.1
    return t


def make_tiny_hf(d: str | Path, kind: str = "qwen35", seed: int = 0, mtp: bool = True, echo: float = 0.0,
                 **overrides):
    """Write a tiny random `kind` checkpoint (qwen35 | qwen35moe | qwen3next) to directory d.
    Returns (directory, the transformers model in eval mode, float32)."""
    from safetensors.torch import save_file
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    Config, Model, base = _classes(kind)
    vocab = write_tokenizer(d)
    cfg = dict(base, vocab_size=vocab, eos_token_id=vocab - 1, **overrides)
    if kind == "qwen3next":  # Qwen3-Next's config knows no mrope sections
        cfg["rope_parameters"] = {k: v for k, v in cfg["rope_parameters"].items() if not k.startswith("mrope")}
    torch.manual_seed(seed)
    model = Model(Config(**cfg)).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # transformers initialises norms to their neutral value and A_log/dt_bias to fixed
            # ranges; random values everywhere make every term of the computation count
            if name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if "linear_attn.norm" in name else 0.0))
            elif name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen) * 2 - 1)
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "experts" in name or name.endswith("gate.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if "embed" in name else 0.08))
    model.config.architectures = [Model.__name__]
    model.config.save_pretrained(d)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if mtp:
        state |= _mtp_tensors(cfg, gen, echo)
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d, model


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    """transformers' logits [T, V] for one sequence (float32, no cache)."""
    with torch.no_grad():
        return model(torch.tensor([tokens]), use_cache=False).logits[0].float()


def hf_to_gguf(src, out, qtype=None) -> Path:
    """Write the checkpoint at `src` as a GGUF file in llama.cpp's layout, through `HFModelFile`
    (names, metadata and tensor transforms as llama.cpp's converter; `test_qwen35.py` checks that
    against the converter itself when MTPLLM_LLAMACPP points at its source). qtype: store the 2-D
    matrices whose rows allow it in that block type (norms, conv, A, dt and router stay F32)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

    from mtpllm.gguf.writer import quantize, write_gguf
    from mtpllm.models.hf import HFModelFile
    h = HFModelFile(src)
    arch = h.arch
    meta = {k: v for k, v in h.metadata.items() if k != "general.architecture"}
    tensors = {}
    for name in h.tensors:
        t = h.load(name).numpy()
        q = QT.F32
        if qtype is not None and t.ndim >= 2 and t.shape[-1] % GGML_QUANT_SIZES[qtype][0] == 0 \
                and not name.endswith(("ssm_conv1d.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")):
            q = qtype
        tensors[name] = (quantize(np.ascontiguousarray(t), q), q)
    return write_gguf(out, arch, meta, tensors)


# ---------------------------------------------------------------- an MTP layer distilled from its trunk
class ReferenceMTP(torch.nn.Module):
    """The MTP layer of the released checkpoints, built from transformers' own modules (transformers
    does not run `mtp.*`; this is the layer as vLLM's Qwen3.5 / Qwen3-Next MTP module computes it):

        x = fc(cat([pre_fc_norm_embedding(embed(t_{i+1})), pre_fc_norm_hidden(h_i)]))   # embedding first
        x = one full-attention decoder layer of the model's own class (causal over the entries)
        g = norm(x);  logits for t_{i+2} = the trunk's lm_head(g)

    h_i is the trunk's last hidden state (after its final norm). The norms are the model's zero-centred
    RMSNorm class. `state()` gives the tensors under the checkpoint's `mtp.*` names."""

    def __init__(self, model: torch.nn.Module, gen: torch.Generator):
        import copy
        import importlib
        super().__init__()
        cfg = copy.deepcopy(model.config)
        cfg.layer_types, cfg.num_hidden_layers, cfg.mlp_only_layers = ["full_attention"], 1, []
        mod = importlib.import_module(type(model).__module__)
        prefix = type(model).__name__[:-len("ForCausalLM")]  # Qwen3_5, Qwen3_5Moe, Qwen3Next
        Norm, Layer = getattr(mod, prefix + "RMSNorm"), getattr(mod, prefix + "DecoderLayer")
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.norm = Norm(D, eps), Norm(D, eps), Norm(D, eps)
        self.fc = torch.nn.Linear(2 * D, D, bias=False)
        self.layers = torch.nn.ModuleList([Layer(cfg, 0)])
        self.trunk = [model]  # a list: not a submodule, so neither trained nor in the state
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" in name:
                    p.zero_()  # neutral (1 + w with w = 0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if "gate" in name else 0.08))
            # start as a pass-through of the token's embedding (what the trunk says after that token
            # alone, a bigram guess): training refines it in a few hundred steps
            D = cfg.hidden_size
            self.fc.weight.copy_(torch.cat([torch.eye(D), torch.randn(D, D, generator=gen) * 0.02], 1))
            for name, p in self.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj")) or name.endswith("down_proj.weight"):
                    p.mul_(0.1)

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """emb = embed(t_{i+1}), hidden = h_i, both [B, T, D] -> logits for t_{i+2} [B, T, V]."""
        trunk = self.trunk[0]
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], -1))
        B, T, _ = x.shape
        pos = torch.arange(T)[None].expand(B, T)
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        out = self.layers[0](x, position_embeddings=trunk.model.rotary_emb(x, pos), attention_mask=mask,
                             position_ids=pos)
        out = out[0] if isinstance(out, tuple) else out
        return trunk.lm_head(self.norm(out))

    def state(self) -> dict[str, torch.Tensor]:
        """The layer under the checkpoint's names; fused experts ([E, 2F, D] gate+up, [E, D, F] down,
        as transformers keeps them) split into the checkpoint's per-expert matrices."""
        out = {}
        for name, t in self.state_dict().items():
            t = t.detach().contiguous()
            if name.endswith("mlp.experts.gate_up_proj"):
                base, F = "mtp." + name[:-len("gate_up_proj")], t.shape[1] // 2
                for e in range(t.shape[0]):
                    out[f"{base}{e}.gate_proj.weight"] = t[e, :F].contiguous()
                    out[f"{base}{e}.up_proj.weight"] = t[e, F:].contiguous()
            elif name.endswith("mlp.experts.down_proj"):
                base = "mtp." + name[:-len("down_proj")]
                for e in range(t.shape[0]):
                    out[f"{base}{e}.down_proj.weight"] = t[e].contiguous()
            else:
                out["mtp." + name] = t
        return out


def greedy_continuations(d: str | Path, prompts: list[list[int]], n: int) -> torch.Tensor:
    """The checkpoint at `d` continues each prompt greedily by n tokens (end of text ignored), run by
    this engine (its logits match transformers' within 1e-4; transformers' own recurrent kernels
    on CPU are its slow reference ones) -> [B, P + n] token ids (prompts of one length)."""
    from mtpllm.runtime.engine import Engine
    from mtpllm.runtime.sampling import SamplingParams
    eng = Engine.load(str(d), n_ctx=len(prompts[0]) + n + 1)
    outs = eng.generate_batch(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return torch.tensor([p + c.tokens for p, c in zip(prompts, outs)])


def distill_mtp(d: str | Path, model, steps: int = 300, n_seq: int = 32, prompt_len: int = 6, gen_len: int = 48,
                seed: int = 0, lr: float = 3e-3) -> float:
    """Train an MTP layer (`ReferenceMTP`) for `steps` Adam steps on the trunk's own greedy
    continuations of `n_seq` random prompts: at each entry (t_{i+1}, h_i) of a continuation the
    target is the token the trunk chose after t_{i+1} (cross-entropy; the trunk's distributions
    themselves are too flat in these tiny random models to teach an argmax), and write it into the
    checkpoint at `d` (replacing any `mtp.*`). `model`: the checkpoint as a transformers model
    (trunk hidden states and lm_head). Returns the last step's loss."""
    from safetensors.torch import load_file, save_file
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    prompts = torch.randint(0, 256, (n_seq, prompt_len), generator=gen).tolist()  # byte tokens
    seqs = greedy_continuations(d, prompts, gen_len)
    with torch.no_grad():
        h = model.model(seqs, use_cache=False).last_hidden_state  # after the final norm
        emb = model.model.embed_tokens(seqs[:, 1:])  # t_{i+1}
    target = seqs[:, 2:].clone()  # t_{i+2}, for entries i = 0 .. T-3
    target[:, :prompt_len - 2] = -100  # random prompt tokens are not the trunk's choice
    mtp = ReferenceMTP(model, gen)
    for p in model.parameters():
        p.requires_grad_(False)
    opt = torch.optim.Adam(mtp.parameters(), lr=lr)
    loss = torch.tensor(0.0)
    for _ in range(steps):
        logits = mtp(emb[:, :-1], h[:, :-2])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    path = Path(d) / "model.safetensors"
    state = {k: v for k, v in load_file(str(path)).items() if not k.startswith("mtp.")}
    save_file(state | mtp.state(), str(path), metadata={"format": "pt"})
    return float(loss.detach())


def llamacpp_convert(root: str | Path, src: str | Path, out: str | Path) -> Path:
    """Convert the checkpoint at `src` with llama.cpp's own converter (`root`: the llama.cpp source
    tree with convert_hf_to_gguf.py), float32. The tiny tokenizer is not in the converter's list of
    known pre-tokenizers: it is named qwen2's. Raises AssertionError with the converter's output on failure."""
    import subprocess
    import sys
    script = ("import sys, runpy; root = sys.argv[1]; sys.path[:0] = [root, root + '/gguf-py'];"
              "from conversion import base; base.TextModel.get_vocab_base_pre = lambda self, tok: 'qwen2';"
              "sys.argv = [root + '/convert_hf_to_gguf.py'] + sys.argv[2:];"
              "runpy.run_path(root + '/convert_hf_to_gguf.py', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", script, str(root), str(src), "--outfile", str(out), "--outtype", "f32"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return Path(out)
