"""The hybrid Qwen3.5 family (qwen35 dense, qwen35moe, qwen3next) against Hugging Face
transformers on tiny random checkpoints written with transformers' own classes, loaded from the
safetensors directory and from GGUF files in llama.cpp's layout.

Tolerance against transformers: 1e-4 absolute on logits of spread ~0.6. Both sides compute in
float32 but sum in different orders (our chunked delta rule vs theirs with other chunk
boundaries, SDPA vs eager attention), which costs ~1e-6 here; a wrong norm offset, head order, gate
or decay changes logits by 1e-2 and more.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from mtpllm.errors import MtpllmError
from mtpllm.gguf.reader import GGUFFile
from mtpllm.models import load_model
from mtpllm.models.hf import HFModelFile
from mtpllm.runtime.engine import Engine
from mtpllm.runtime.sampling import SamplingParams
from mtpllm.tokenizer import GGUFTokenizer

tiny_hybrid = pytest.importorskip("tiny_hybrid")
pytest.importorskip("transformers")

KINDS = ["qwen35", "qwen35moe", "qwen3next"]
TOL = 1e-4
# 96 tokens: longer than the recurrent cache's per-row window (32), so prefill takes the chunked
# form, and more than one chunk of 64
TOKENS = [5, 17, 200, 33, 9, 101, 44, 3, 250, 7, 66, 12] * 8


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """kind -> (checkpoint dir, transformers model, GGUF written from the checkpoint)."""
    root = tmp_path_factory.mktemp("hybrid")
    out = {}
    for kind in KINDS:
        d, hf = tiny_hybrid.make_tiny_hf(root / kind, kind, echo=0.1)  # an MTP layer that drafts well at times
        out[kind] = (d, hf, tiny_hybrid.hf_to_gguf(d, root / f"{kind}.gguf"))
    return out


def _logits(m, toks, chunks=None):
    cache = m.make_cache(256)
    t = torch.tensor(toks)
    if chunks is None:
        return m.logits(m(t, cache))
    out, s = [], 0
    for n in chunks:
        out.append(m.logits(m(t[s:s + n], cache)))
        s += n
    return torch.cat(out)


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(hybrid, kind):
    d, hf, _ = hybrid[kind]
    ref = tiny_hybrid.hf_logits(hf, TOKENS)
    m = load_model(d, "f32")
    assert m.cfg.arch == kind and m.cfg.layer_pattern() == "LALA"
    prefill = _logits(m, TOKENS)
    decode = _logits(m, TOKENS, [1] * len(TOKENS))
    mixed = _logits(m, TOKENS, [40, 5, 1, 17, 33])  # a long chunk, verification-sized blocks, a chunk
    for got in (prefill, decode, mixed):
        assert (got - ref).abs().max() < TOL
    # the check has teeth: transformers' logits one position off are far away
    assert (prefill[1:] - ref[:-1]).abs().max() > 100 * TOL


@pytest.mark.parametrize("impl", ["torch", "c++"])
@pytest.mark.parametrize("T,H", [(150, 4), (128, 4), (40, 1), (1, 4)])
def test_chunked_delta_rule_with_fast_forgetting_heads(impl, T, H):
    """Log-decays down to -50 per row (fast-forgetting heads, as a random or real Qwen3.5 DeltaNet
    has): the chunked form, whose decay products below e^-40 count as 0 (no subnormal floats in its
    matrix products), in PyTorch (`delta_rule_chunked`) and in C++ (`kernels.deltanet_chunked`, what
    prompt chunks run), equals the row-by-row recurrence in float64 to float32 precision, outputs
    and final state: several chunks and a partial one, two whole chunks, one partial chunk of one
    head, one row."""
    from mtpllm.models.deltanet import DECAY_FLOOR, delta_rule_chunked, delta_rule_steps, l2norm
    from mtpllm.runtime import kernels
    if impl == "c++" and not kernels.available():
        pytest.skip("the CPU kernels are not built here")
    chunked = delta_rule_chunked if impl == "torch" else kernels.deltanet_chunked
    g0 = torch.Generator().manual_seed(3)
    dk, dv = 32, 16
    q = l2norm(torch.randn(T, H, dk, generator=g0)) * dk ** -0.5
    k = l2norm(torch.randn(T, H, dk, generator=g0))
    v = torch.randn(T, H, dv, generator=g0)
    g = -torch.rand(T, H, generator=g0) * torch.tensor([50.0, 0.05, 1.0, 20.0][:H])  # fast .. slow heads
    beta = torch.rand(T, H, generator=g0)
    S0 = torch.randn(H, dk, dv, generator=g0) * 0.1
    assert T == 1 or g[:, 0].cumsum(0)[min(T, 64) - 1] < -DECAY_FLOOR  # the floor is reached within a chunk
    o, S = chunked(q, k, v, g, beta, S0)
    ro, rS = delta_rule_steps(*(x.double() for x in (q, k, v, g, beta, S0)))
    assert (o.double() - ro).abs().max() < 1e-5 and (S.double() - rS).abs().max() < 1e-5
    assert ro.abs().max() > 0.01  # not vacuous: outputs 1,000 times the tolerance
    if impl == "c++":
        with pytest.raises(RuntimeError, match="deltanet_chunked"):
            kernels.deltanet_chunked(q, k, v, g, beta, S0[..., :1])  # a state narrower than the values


def test_interleaved_mrope_is_plain_rotary_for_text():
    """transformers' interleaved MRoPE with the same position in the three sections (text) gives the
    cos/sin of the plain NEOX rotary over rope.dimension_count dims that the model uses."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    from mtpllm.models.qwen35 import make_rotary
    cfg = Qwen3_5TextConfig(hidden_size=256, num_attention_heads=2, head_dim=128, rope_parameters={
        "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [6, 5, 5],
        "mrope_interleaved": True})
    emb = Qwen3_5TextRotaryEmbedding(cfg)
    pos = torch.arange(300)
    cos, sin = emb(torch.zeros(1, 1, dtype=torch.float32), pos[None, None].expand(3, 1, -1))
    from mtpllm.models.config import RopeConfig
    from mtpllm.models.qwen35 import HybridConfig
    ours = make_rotary(HybridConfig(
        arch="qwen35", n_layers=1, d_model=256, n_heads=2, n_kv_heads=1, head_dim=128, ffn_dim=1, vocab_size=1,
        ctx_len=300, rope=RopeConfig(base=1e7, dim=32), recurrent=(True,), ssm_k_heads=1, ssm_v_heads=1,
        ssm_k_dim=1, ssm_v_dim=1))
    # the reduction itself, exactly: transformers' MRoPE == the plain rotary computed as it computes it
    freqs = pos.float()[:, None] * emb.inv_freq
    assert torch.equal(cos[0], torch.cat([freqs.cos(), freqs.cos()], -1))
    assert torch.equal(sin[0], torch.cat([freqs.sin(), freqs.sin()], -1))
    # our tables (angles in float64) agree up to transformers' float32 angle rounding: positions
    # < 300 rad, so 300 * 2^-24 ~ 2e-5
    c, s = ours.tables(300, "cpu")
    torch.testing.assert_close(cos[0], torch.cat([c[:300], c[:300]], -1), rtol=0, atol=3e-5)
    torch.testing.assert_close(sin[0], torch.cat([s[:300], s[:300]], -1), rtol=0, atol=3e-5)
    # with different positions per section (an image grid) the sections do differ: not a vacuous check
    cos2, _ = emb(torch.zeros(1, 1), torch.stack([pos, pos // 2, pos // 3])[:, None])
    assert not torch.allclose(cos2[0], cos[0])


@pytest.mark.parametrize("kind", KINDS)
def test_gguf_and_safetensors_give_identical_logits(hybrid, kind):
    d, _, gguf = hybrid[kind]
    a, b = load_model(d, "f32"), load_model(gguf, "f32")
    assert torch.equal(_logits(a, TOKENS), _logits(b, TOKENS))
    assert torch.equal(_logits(a, TOKENS[:20], [12, 1, 7]), _logits(b, TOKENS[:20], [12, 1, 7]))


@pytest.mark.parametrize("kind,block,rejected", [("qwen35", 5, 0), ("qwen35", 5, 2), ("qwen35", 7, 6),
                                                 ("qwen35", 2, 1), ("qwen35moe", 5, 3), ("qwen3next", 4, 1)])
def test_verification_rollback_equals_feeding_kept_rows(hybrid, kind, block, rejected):
    """A verification block followed by `cache.trim(rejected)` leaves exactly the state that feeding
    only the kept rows leaves: the next logits are bit-identical, the block's kept rows too."""
    d, _, _ = hybrid[kind]
    m = load_model(d, "f32")
    prompt, blk, after = TOKENS[:40], TOKENS[40:40 + block], TOKENS[60:63]
    a, b = m.make_cache(128), m.make_cache(128)
    for c in (a, b):
        m(torch.tensor(prompt), c)
    la = m.logits(m(torch.tensor(blk), a))
    assert a.max_trim() == block - 1
    a.trim(rejected)
    kept = block - rejected
    lb = m.logits(m(torch.tensor(blk[:kept]), b))
    assert torch.equal(la[:kept], lb)
    assert a.length == b.length == 40 + kept
    assert torch.equal(m.logits(m(torch.tensor(after), a)), m.logits(m(torch.tensor(after), b)))
    # one row at a time (decoding) gives the same bits as the block
    c = m.make_cache(128)
    m(torch.tensor(prompt), c)
    rows = torch.cat([m.logits(m(torch.tensor([t]), c)) for t in blk])
    assert torch.equal(rows, la)


def test_quantized_gguf_runs_on_the_compressed_kernels(hybrid, tmp_path):
    d, _, _ = hybrid["qwen35"]
    q8 = tiny_hybrid.hf_to_gguf(d, tmp_path / "q8.gguf", QT.Q8_0)
    fast, ref = load_model(q8, "fast"), load_model(d, "f32")
    kinds = {type(lin).__name__ + ":" + getattr(lin, "kind", "") for blk in fast.blocks
             for lin in (getattr(blk.mixer, "proj", None), getattr(blk.mixer, "qkv", None), blk.ffn.gate_up) if lin is not None}
    from mtpllm.runtime import kernels
    if kernels.available():
        assert kinds == {"Linear:gguf"}
    a, b = _logits(ref, TOKENS[:48]), _logits(fast, TOKENS[:48])
    # Q8_0 weights and int8 activations: a few per cent of the logits' spread (measured 0.09 / 0.65)
    assert (a - b).abs().max() < 0.3 * a.std()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8


def test_quantized_experts_run_on_the_compressed_kernels(hybrid, tmp_path):
    """Stacked expert tensors [E, N, K] in a block type: each expert a kernel Linear over its slice
    of the file. The router sees other inputs after quantization and can pick other experts, so
    only the top-1 token is compared (chance: 1/273)."""
    from mtpllm.runtime import kernels
    d, _, _ = hybrid["qwen35moe"]
    q8 = tiny_hybrid.hf_to_gguf(d, tmp_path / "moe-q8.gguf", QT.Q8_0)
    fast, ref = load_model(q8, "fast"), load_model(d, "f32")
    if kernels.available():
        assert all(lin.kind == "gguf" for blk in fast.blocks for e in blk.ffn.experts for lin in (e.gate_up, e.down))
    a, b = _logits(ref, TOKENS[:48]), _logits(fast, TOKENS[:48])
    assert torch.isfinite(b).all() and (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.5


def test_single_file_and_sharded_index(hybrid, tmp_path):
    from safetensors.torch import load_file, save_file
    d, _, _ = hybrid["qwen35"]
    ref = _logits(load_model(d, "f32"), TOKENS[:30])
    state = load_file(str(d / "model.safetensors"))
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(d / f, sharded / f)
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    wm = {}
    for fn, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(sharded / fn))
        wm |= {k: fn for k in keys}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    assert torch.equal(_logits(load_model(sharded, "f32"), TOKENS[:30]), ref)
    assert torch.equal(_logits(load_model(d / "model.safetensors", "f32"), TOKENS[:30]), ref)


def test_bad_checkpoints_get_clear_errors(hybrid, tmp_path):
    d, _, _ = hybrid["qwen35"]
    bad = tmp_path / "bad"
    shutil.copytree(d, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(cfg, model_type="mamba2")))
    with pytest.raises(MtpllmError, match="model_type 'mamba2' is not supported"):
        load_model(bad)
    (bad / "config.json").write_text(json.dumps(dict(cfg, linear_num_value_heads=3)))
    with pytest.raises(MtpllmError, match="not a multiple"):
        load_model(bad)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(MtpllmError, match="not readable JSON"):
        load_model(bad)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MtpllmError, match="no .*safetensors"):
        load_model(empty)


def test_engine_generates_from_the_checkpoint_directory(hybrid):
    """Greedy text is the same from the checkpoint directory and from its GGUF copy, and the cache
    memory estimate counts KV for the attention layers only plus the recurrent state."""
    from mtpllm.models.base import model_kv_bytes
    d, _, gguf = hybrid["qwen35"]
    h = HFModelFile(d)
    outs = []
    for src, meta in ((d, h.metadata), (gguf, GGUFFile(gguf).metadata)):
        m = load_model(src, "fast")
        eng = Engine(m, GGUFTokenizer(meta, "qwen35"), 128)
        outs.append(eng.generate("the fox", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)).tokens)
    assert outs[0] == outs[1] and len(outs[0]) == 12
    # several sequences decoded together give each its own greedy tokens
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [eng.encode_prompt("the fox", chat=False), eng.encode_prompt("a = the", chat=False)]
    batch = eng.generate_batch(prompts, p)
    assert [c.tokens for c in batch] == [eng.generate(prompt_ids=ids, params=p).tokens for ids in prompts]
    cfg = m.cfg
    kv_one_layer = 2 * cfg.n_kv_heads * cfg.head_dim * 4 * 128
    assert model_kv_bytes(cfg, 128) == kv_one_layer * (cfg.n_attn + cfg.n_nextn) + cfg.recurrent_bytes()
    assert eng.cache.nbytes() == kv_one_layer * cfg.n_attn + cfg.recurrent_bytes()


def _engine(src, meta, kind, mode="fast"):
    return Engine(load_model(src, mode), GGUFTokenizer(meta, kind), 256)


@pytest.mark.parametrize("kind,source", [("qwen35", "hf"), ("qwen35moe", "gguf")])
def test_mtp_with_the_models_own_layer_is_greedy_identical(hybrid, kind, source):
    """Speculation with the model's own MTP layer (a gated-attention block, MoE for qwen35moe) gives
    plain greedy decoding's tokens for k = 1..6, while drafts are accepted at some positions and
    rejected at every position (each rejection rolls the recurrent state back through the cache)."""
    from mtpllm.speculative import SpecConfig
    d, _, gguf = hybrid[kind]
    eng = _engine(d, HFModelFile(d).metadata, kind) if source == "hf" else _engine(gguf, GGUFFile(gguf).metadata, kind)
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ids = eng.encode_prompt("the fox = the fox", chat=False)
    ref = eng.generate(prompt_ids=ids, params=p).tokens
    for k in range(1, 7):
        spec = SpecConfig("mtp", k, policy="fixed").build(eng)  # every step drafts k
        assert type(spec.proposer.head.block.mixer).__name__ == "GatedAttention"
        out = eng.generate(prompt_ids=ids, params=p, speculative=spec)
        assert out.tokens == ref, k
        st = out.stats
        assert st.num_accepted_tokens > 0 and st.accepted_per_pos[0] < st.drafted_per_pos[0]
        assert all(a < n for a, n in zip(st.accepted_per_pos, st.drafted_per_pos))


def test_mtp_layer_from_a_separate_checkpoint(hybrid):
    """--spec-mtp-head pointing at the Hugging Face checkpoint gives the same drafts as the layer
    inside the GGUF file."""
    from mtpllm.speculative import SpecConfig
    d, _, gguf = hybrid["qwen35"]
    eng = _engine(gguf, GGUFFile(gguf).metadata, "qwen35")
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ids = eng.encode_prompt("the fox", chat=False)
    a = eng.generate(prompt_ids=ids, params=p, speculative=SpecConfig("mtp", 3, policy="fixed").build(eng))
    b = eng.generate(prompt_ids=ids, params=p,
                     speculative=SpecConfig("mtp", 3, mtp_head=str(d), policy="fixed").build(eng))
    assert a.tokens == b.tokens and a.stats.accepted_per_pos == b.stats.accepted_per_pos


@pytest.mark.parametrize("T", [5, 40])
def test_mtp_layer_fill_writes_the_entries_its_forward_writes(hybrid, T):
    """The gated-attention MTP layer's `fill` (rows whose output is not read: the prompt, the
    catch-up before the last row) writes the key/value entries of its full forward: the same bits
    through the PyTorch modules (40 rows), float32 rounding against the C++ block (5 rows)."""
    from tiny import check_fill_matches_forward
    _, _, gguf = hybrid["qwen35"]
    check_fill_matches_forward(_engine(gguf, GGUFFile(gguf).metadata, "qwen35"), T, seed=2)


LLAMACPP = os.environ.get("MTPLLM_LLAMACPP")  # llama.cpp source tree (vendor/llama.cpp of llama-cpp-python)


@pytest.mark.skipif(not LLAMACPP, reason="MTPLLM_LLAMACPP (llama.cpp source with convert_hf_to_gguf.py) not set")
@pytest.mark.parametrize("kind", KINDS)
def test_llamacpp_converter_agrees(hybrid, kind, tmp_path):
    """llama.cpp's own converter writes the same tensors (names, shapes, values) and the same
    architecture metadata as the checkpoint reader presents, and the GGUF gives the same logits."""
    d, _, _ = hybrid[kind]
    out = tmp_path / f"{kind}.gguf"
    # the tiny tokenizer is not in the converter's list of known pre-tokenizers: name it qwen2's
    script = ("import sys, runpy; root = sys.argv[1]; sys.path[:0] = [root, root + '/gguf-py'];"
              "from conversion import base; base.TextModel.get_vocab_base_pre = lambda self, tok: 'qwen2';"
              "sys.argv = [root + '/convert_hf_to_gguf.py'] + sys.argv[2:];"
              "runpy.run_path(root + '/convert_hf_to_gguf.py', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", script, LLAMACPP, str(d), "--outfile", str(out), "--outtype", "f32"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    g, h = GGUFFile(out), HFModelFile(d)
    assert set(g.tensors) == set(h.tensors)
    for name in g.tensors:
        assert torch.equal(g.load(name), h.load(name)), name
    for key, v in g.metadata.items():
        if key.startswith(kind + ".") and key != f"{kind}.full_attention_interval":
            assert h.metadata[key] == v, key
    assert torch.equal(_logits(load_model(out, "f32"), TOKENS), _logits(load_model(d, "f32"), TOKENS))


def test_inspect_and_doctor_describe_the_hybrid(hybrid):
    from mtpllm.tools.doctor import diagnose
    from mtpllm.tools.inspect import format_text, inspect_file
    _, _, gguf = hybrid["qwen35moe"]
    r = inspect_file(gguf)
    a = r["architecture"]
    assert a["layer_pattern"] == "LALA" and a["recurrent"] == 2 and r["mtp"]["blocks"] == [4]
    # KV per token: 2 attention layers + 1 MTP layer, keys and values, 2 kv heads x 16, float32
    assert a["kv_bytes_per_token"] == 3 * 2 * 2 * 16 * 4
    text = format_text(r)
    assert "layers: LALA" in text and "MoE: 6 experts, 2 used" in text and "recurrent" in text
    rep = diagnose(gguf, ctx=256, sha=False)
    mem = [c for c in rep.checks if c.name == "memory"][0]
    assert "recurrent state" in mem.message and "2 DeltaNet layers" in mem.message
