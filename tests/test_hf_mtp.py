"""MTP heads from Hugging Face safetensors, both naming families:

- Qwen3-Next / Qwen3.5: `mtp.fc`, `mtp.pre_fc_norm_{embedding,hidden}`, `mtp.layers.0.*`, `mtp.norm`,
  every norm zero-centred (x̂·(1+w));
- DeepSeek-V3 / GLM-4.5: `model.layers.L.{enorm,hnorm,eh_proj,shared_head.*}` + that layer's block,
  L = num_hidden_layers, plain norms.

The module built from them must equal the formula computed here directly from the raw tensors
(with Hugging Face's rotate-half rotary, so the q/k permutation for llama GGUF trunks is checked
too), speculative greedy output must equal plain greedy output, and bad files give clear errors.
"""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from mtpllm.errors import MtpllmError
from mtpllm.models import load_model
from mtpllm.runtime.engine import Engine
from mtpllm.runtime.sampling import SamplingParams
from mtpllm.speculative import SpecConfig
from mtpllm.speculative.hf_mtp import HFMTPFile
from mtpllm.speculative.mtp import load_mtp_head, open_head_file

D, H, KV, HD = 256, 4, 2, 64  # the tiny trunks' shape (tests/tiny.py)
FFN = 128  # the head's own FFN width
EPS = 1e-6
GREEDY = dict(temperature=0, max_tokens=30, ignore_eos=True)
PROMPT = "the cat the cat the cat sat on the mat; the cat sat on the"


# ------------------------------------------------------------------ writing checkpoints
def _block(g, pre, arch, zero_centred, ffn=FFN, q_rows=H * HD, k_rows=KV * HD):
    norm = (lambda n: 0.1 * g.standard_normal(n)) if zero_centred else (lambda n: 1 + 0.1 * g.standard_normal(n))
    t = {
        "input_layernorm.weight": norm(D), "post_attention_layernorm.weight": norm(D),
        "self_attn.q_proj.weight": 0.05 * g.standard_normal((q_rows, D)),
        "self_attn.k_proj.weight": 0.05 * g.standard_normal((k_rows, D)),
        "self_attn.v_proj.weight": 0.05 * g.standard_normal((KV * HD, D)),
        "self_attn.o_proj.weight": 0.05 * g.standard_normal((D, H * HD)),
        "mlp.gate_proj.weight": 0.05 * g.standard_normal((ffn, D)),
        "mlp.up_proj.weight": 0.05 * g.standard_normal((ffn, D)),
        "mlp.down_proj.weight": 0.05 * g.standard_normal((D, ffn)),
    }
    if arch == "qwen2":
        for n, rows in (("q", q_rows), ("k", k_rows), ("v", KV * HD)):
            t[f"self_attn.{n}_proj.bias"] = 0.1 * g.standard_normal(rows)
    if arch == "qwen3":
        t["self_attn.q_norm.weight"], t["self_attn.k_norm.weight"] = norm(HD), norm(HD)
    return {pre + k: v for k, v in t.items()}


def hf_tensors(family, arch, seed=0, L=2, own_head=False, vocab=None, dtype=torch.float32, **block):
    """MTP tensors of `family` for a trunk of `arch` (plus two trunk tensors a real file has too)."""
    g = np.random.default_rng(seed)
    zc = family == "qwen"
    norm = (lambda n: 0.1 * g.standard_normal(n)) if zc else (lambda n: 1 + 0.1 * g.standard_normal(n))
    if family == "qwen":
        t = {"mtp.fc.weight": 0.1 * g.standard_normal((D, 2 * D)), "mtp.pre_fc_norm_embedding.weight": norm(D),
             "mtp.pre_fc_norm_hidden.weight": norm(D), "mtp.norm.weight": norm(D)}
        t.update(_block(g, "mtp.layers.0.", arch, zc, **block))
    else:
        p = f"model.layers.{L}."
        t = {p + "eh_proj.weight": 0.1 * g.standard_normal((D, 2 * D)), p + "enorm.weight": norm(D),
             p + "hnorm.weight": norm(D), p + "shared_head.norm.weight": norm(D)}
        if own_head:
            t[p + "shared_head.head.weight"] = 0.15 * g.standard_normal((vocab, D))
            t[p + "embed_tokens.weight"] = g.standard_normal((vocab, D))
        t.update(_block(g, p, arch, zc, **block))
    t["model.norm.weight"] = 1 + 0.1 * g.standard_normal(D)
    t["model.layers.0.input_layernorm.weight"] = 1 + 0.1 * g.standard_normal(D)
    return {k: torch.tensor(v, dtype=torch.float32).to(dtype).contiguous() for k, v in t.items()}


def write(tensors, where, layout, config=None):
    """layout: "file" (one .safetensors), "dir" (model.safetensors + config.json), or "sharded"
    (index json; the trunk-only shard is garbage, so reading it would fail)."""
    where.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (where / "config.json").write_text(json.dumps(config))
    if layout == "file":
        save_file(tensors, str(where / "mtp.safetensors"))
        return where / "mtp.safetensors"
    if layout == "dir":
        save_file(tensors, str(where / "model.safetensors"))
        return where
    trunk_names = {"model.norm.weight", "model.layers.0.input_layernorm.weight"}
    mtp = sorted(set(tensors) - trunk_names)
    shards = {"model-00001-of-00003.safetensors": sorted(trunk_names),
              "model-00002-of-00003.safetensors": mtp[: len(mtp) // 2],
              "model-00003-of-00003.safetensors": mtp[len(mtp) // 2:]}
    wm = {}
    for f, names in shards.items():
        wm.update({n: f for n in names})
        if f.startswith("model-00001"):
            (where / f).write_bytes(b"not a safetensors file")
        else:
            save_file({n: tensors[n] for n in names}, str(where / f))
    (where / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return where


# ------------------------------------------------------------------ the formula, written out
def _rms(x, w, zero_centred):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * ((1 + w) if zero_centred else w)


def _rotate_half(x, pos):
    """Hugging Face rotary (rotate_half), base 10000 as in the tiny trunks."""
    inv = 1.0 / (10000 ** (torch.arange(0, HD, 2).double() / HD))
    ang = torch.outer(pos.double(), inv)
    ang = torch.cat([ang, ang], -1).float()
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = x[..., : HD // 2], x[..., HD // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference(t, family, emb, hid, L=2):
    """The MTP module computed from the raw Hugging Face tensors `t` (causal over the T positions 0..T-1)."""
    t = {k: v.float() for k, v in t.items()}
    zc = family == "qwen"
    if family == "qwen":
        fc, en, hn, on, b = "mtp.fc", "mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden", "mtp.norm", "mtp.layers.0."
    else:
        b = f"model.layers.{L}."
        fc, en, hn, on = b + "eh_proj", b + "enorm", b + "hnorm", b + "shared_head.norm"
    W = lambda n: t[b + n]  # noqa: E731

    def lin(x, n):
        y = x @ W(n + ".weight").t()
        return y + W(n + ".bias") if b + n + ".bias" in t else y

    T = emb.shape[0]
    x = torch.cat([_rms(emb, t[en + ".weight"], zc), _rms(hid, t[hn + ".weight"], zc)], -1) @ t[fc + ".weight"].t()
    h = _rms(x, W("input_layernorm.weight"), zc)
    q, k, v = lin(h, "self_attn.q_proj").view(T, H, HD), lin(h, "self_attn.k_proj").view(T, KV, HD), \
        lin(h, "self_attn.v_proj").view(T, KV, HD)
    if b + "self_attn.q_norm.weight" in t:
        q, k = _rms(q, W("self_attn.q_norm.weight"), zc), _rms(k, W("self_attn.k_norm.weight"), zc)
    pos = torch.arange(T)
    q, k = _rotate_half(q, pos), _rotate_half(k, pos)
    k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
    att = torch.einsum("thd,shd->hts", q, k) / HD ** 0.5
    att = att.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf")).softmax(-1)
    x = x + lin(torch.einsum("hts,shd->thd", att, v).reshape(T, H * HD), "self_attn.o_proj")
    f = _rms(x, W("post_attention_layernorm.weight"), zc)
    x = x + lin(F.silu(lin(f, "mlp.gate_proj")) * lin(f, "mlp.up_proj"), "mlp.down_proj")
    return _rms(x, t[on + ".weight"], zc)


# ------------------------------------------------------------------ (a) module == formula
CASES = [  # family, trunk arch, file layout, stored dtype
    ("qwen", "qwen3", "file", torch.float32),
    ("qwen", "qwen2", "sharded", torch.bfloat16),
    ("deepseek", "qwen2", "dir", torch.float32),
    ("deepseek", "llama", "sharded", torch.float16),  # llama GGUF trunk: q/k permuted for adjacent-pair rotary
    ("deepseek", "qwen3", "file", torch.bfloat16),
    ("qwen", "llama", "dir", torch.float32),
]


@pytest.mark.parametrize("family,arch,layout,dtype", CASES)
def test_module_equals_formula(tiny_models, tmp_path, family, arch, layout, dtype):
    trunk = load_model(tiny_models[arch], "f32")
    t = hf_tensors(family, arch, seed=len(family) + len(arch), dtype=dtype)
    cfg = {"num_hidden_layers": 2} if family == "deepseek" else None
    src = write(t, tmp_path / "hf", layout, cfg)
    head = load_mtp_head(open_head_file(src, trunk.cfg), trunk, "f32")
    torch.manual_seed(0)
    T = 6
    emb, hid = torch.randn(T, D), torch.randn(T, D)
    cache = head.make_cache(trunk.cfg, 16)
    # in two calls, as in decoding: the second attends over the first one's cache entries
    got = torch.cat([head(emb[:4], hid[:4], cache), head(emb[4:], hid[4:], cache)])
    torch.testing.assert_close(got, reference(t, family, emb, hid), rtol=1e-4, atol=1e-4)


def test_norm_convention_and_concat_order_matter(tiny_models, tmp_path):
    """The formula test has power: plain norms for the Qwen family, or [hidden, embedding] order, differ."""
    trunk = load_model(tiny_models["qwen3"], "f32")
    t = hf_tensors("qwen", "qwen3", seed=3)
    src = write(t, tmp_path / "q", "file")
    torch.manual_seed(1)
    emb, hid = torch.randn(4, D), torch.randn(4, D)
    good = load_mtp_head(open_head_file(src, trunk.cfg), trunk, "f32")(emb, hid, trunk_cache(trunk))
    plain = load_mtp_head(HFMTPFile(src, trunk.cfg, zero_centred_norms=False), trunk, "f32")(
        emb, hid, trunk_cache(trunk))
    assert not torch.allclose(good, plain, atol=1e-2)
    assert not torch.allclose(good, reference(t, "qwen", hid, emb), atol=1e-2)  # swapped inputs


def trunk_cache(trunk):
    from mtpllm.runtime.kv_cache import KVCache
    return KVCache(1, trunk.cfg.n_kv_heads, trunk.cfg.head_dim, 16)


# ------------------------------------------------------------------ (b) greedy identity
@pytest.mark.parametrize("family,arch,layout,own_head", [
    ("qwen", "qwen2", "sharded", False), ("deepseek", "qwen2", "dir", True), ("deepseek", "llama", "file", False)])
def test_greedy_identity(tiny_models, tmp_path, family, arch, layout, own_head):
    e = Engine.load(str(tiny_models[arch]), n_ctx=256)
    t = hf_tensors(family, arch, seed=7, own_head=own_head, vocab=e.model.cfg.vocab_size)
    src = write(t, tmp_path / "hf", layout, {"num_hidden_layers": 2, "model_type": "deepseek_v3"}
                if family == "deepseek" else {"model_type": "qwen3_next"})
    ref = e.generate(PROMPT, SamplingParams(**GREEDY), chat=False)
    for k in (1, 3):
        spec = SpecConfig("mtp", k, mtp_head=str(src), policy="fixed").build(e)  # every step drafts
        assert (spec.proposer.head.lm_head is not None) == own_head
        out = e.generate(PROMPT, SamplingParams(**GREEDY), chat=False, speculative=spec)
        assert out.tokens == ref.tokens and out.finish_reason == ref.finish_reason
        assert out.stats.num_drafts > 0


# ------------------------------------------------------------------ (c) errors
@pytest.fixture(scope="module")
def qwen2_engine(tiny_models):
    return Engine.load(str(tiny_models["qwen2"]), n_ctx=64)


def _build(engine, path):
    return SpecConfig("mtp", 3, mtp_head=str(path)).build(engine)


def test_missing_file_and_shard(qwen2_engine, tmp_path):
    with pytest.raises(MtpllmError, match="no such MTP head file or directory"):
        _build(qwen2_engine, tmp_path / "nowhere.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(MtpllmError, match="no model.safetensors.index.json and no .safetensors files"):
        _build(qwen2_engine, tmp_path / "empty")
    d = write(hf_tensors("qwen", "qwen2"), tmp_path / "sh", "sharded")
    (d / "model-00003-of-00003.safetensors").unlink()
    with pytest.raises(MtpllmError, match="shard model-00003-of-00003.safetensors listed in the index is missing"):
        _build(qwen2_engine, d)


def test_no_mtp_tensors(qwen2_engine, tmp_path):
    t = {"model.norm.weight": torch.ones(D), "model.layers.0.input_layernorm.weight": torch.ones(D)}
    f = write(t, tmp_path / "trunk", "dir", {"num_hidden_layers": 2})
    with pytest.raises(MtpllmError, match=r"no MTP tensors found: looked for 'mtp\.fc\.weight' .*"
                                          r"'model\.layers\.2\.eh_proj\.weight'"):
        _build(qwen2_engine, f)
    # a file without the .safetensors suffix is still recognised by its header
    save_file(t, str(tmp_path / "head.bin"))
    with pytest.raises(MtpllmError, match="no MTP tensors found"):
        _build(qwen2_engine, tmp_path / "head.bin")


def test_layer_index_from_config(qwen2_engine, tmp_path):
    f = write(hf_tensors("deepseek", "qwen2", L=2), tmp_path / "ds", "dir", {"num_hidden_layers": 5})
    with pytest.raises(MtpllmError, match=r"should be 'model\.layers\.5\.eh_proj\.weight'.*layer\(s\) \[2\]"):
        _build(qwen2_engine, f)


@pytest.mark.parametrize("change,msg", [
    (lambda t: t.update({"mtp.fc.weight": torch.zeros(128, 512)}), "hidden size 128 does not match the model's 256"),
    (lambda t: t.update({"mtp.fc.weight": torch.zeros(256, 384)}),
     r"mtp\.fc\.weight has shape \[256, 384\], expected \[256, 512\]"),
    (lambda t: t.update({"mtp.layers.0.self_attn.k_proj.weight": torch.zeros(64, 256)}),
     r"'mtp\.layers\.0\.self_attn\.k_proj\.weight' has shape \[64, 256\], expected \[128, 256\]"),
    (lambda t: t.update({"mtp.layers.0.mlp.down_proj.weight": torch.zeros(256, 96)}),
     r"mlp\.down_proj\.weight' has shape \[256, 96\], expected \[256, 128\]"),
    (lambda t: t.pop("mtp.layers.0.self_attn.o_proj.weight"),
     r"required tensor 'mtp\.layers\.0\.self_attn\.o_proj\.weight' is missing"),
    (lambda t: t.update({"mtp.layers.0.self_attn.q_proj.weight": torch.zeros(512, 256)}), "attention output gate"),
    (lambda t: t.update({"mtp.layers.0.mlp.experts.0.gate_proj.weight": torch.zeros(8, 256)}), "mixture-of-experts"),
    (lambda t: t.update({"mtp.layers.0.self_attn.k_proj.weight": torch.zeros(128, 256, dtype=torch.float8_e4m3fn)}),
     "only float32/float16/bfloat16"),
])
def test_head_that_does_not_fit(qwen2_engine, tmp_path, change, msg):
    t = hf_tensors("qwen", "qwen2")
    change(t)
    with pytest.raises(MtpllmError, match=msg):
        _build(qwen2_engine, write(t, tmp_path / "bad", "file"))


def test_config_that_does_not_fit(qwen2_engine, tmp_path):
    t = hf_tensors("deepseek", "qwen2")
    with pytest.raises(MtpllmError, match="architecture 'gemma3'"):
        _build(qwen2_engine, write(t, tmp_path / "a", "dir", {"num_hidden_layers": 2, "model_type": "gemma3_text"}))
    with pytest.raises(MtpllmError, match="vocabulary 1000 does not match"):
        _build(qwen2_engine, write(t, tmp_path / "b", "dir", {"num_hidden_layers": 2, "vocab_size": 1000}))
    with pytest.raises(MtpllmError, match="shared_head.head.weight' has shape"):
        bad = hf_tensors("deepseek", "qwen2", own_head=True, vocab=qwen2_engine.model.cfg.vocab_size)
        bad["model.layers.2.shared_head.head.weight"] = torch.zeros(qwen2_engine.model.cfg.vocab_size, 128)
        _build(qwen2_engine, write(bad, tmp_path / "c", "file"))
