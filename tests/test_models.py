"""Every architecture loads from GGUF, generates, and is self-consistent: the KV-cached
incremental forward equals the full forward, the compressed path tracks the fp32 path."""
import pytest
import torch

from mtpllm.errors import MtpllmError
from mtpllm.models import load_model
from mtpllm.models.config import RopeConfig
from mtpllm.models.layers import rope_inv_freq
from mtpllm.runtime.engine import Engine
from mtpllm.runtime.sampling import SamplingParams

ARCHES = ["qwen2", "qwen3", "llama", "gemma3"]


@pytest.mark.parametrize("arch", ARCHES)
def test_incremental_equals_full_forward(tiny_models, arch):
    m = load_model(tiny_models[arch], "f32")
    toks = torch.randint(0, m.cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(0))
    full = m.logits(m(toks, m.make_cache(64)))
    cache = m.make_cache(64)
    parts = [m.logits(m(toks[:7], cache))]
    parts += [m.logits(m(toks[i:i + 1], cache)) for i in range(7, 20)]
    torch.testing.assert_close(torch.cat(parts), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHES)
def test_fast_path_tracks_f32(tiny_models, arch):
    toks = torch.arange(1, 30)
    ref = load_model(tiny_models[arch], "f32")
    fast = load_model(tiny_models[arch], "fast")
    a = ref.logits(ref(toks, ref.make_cache(64)))
    b = fast.logits(fast(toks, fast.make_cache(64)))
    # bf16 activations/weights: logits agree to a few percent of their spread
    assert (a - b).abs().max() < 0.05 * a.std() * 10
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


def test_gemma3_config_and_sliding_window(tiny_models):
    m = load_model(tiny_models["gemma3"], "f32")
    c = m.cfg
    assert c.sandwich_norm and c.qk_norm and c.act == "gelu_tanh" and c.tied_embeddings
    assert c.embed_scale == pytest.approx(16.0)  # sqrt(256)
    assert c.swa_layers == (True, True) and c.sliding_window == 8
    # beyond the window, a sliding layer must not see the first tokens: changing token 0 changes
    # nothing at position 30 only if every layer is windowed (true here: 2 layers, both sliding,
    # receptive field 2 * 7 < 30)
    cache = m.make_cache(64)
    t = torch.randint(0, c.vocab_size, (31,), generator=torch.Generator().manual_seed(1))
    a = m.logits(m(t, cache))[-1]
    t2 = t.clone()
    t2[0] = (t[0] + 1) % c.vocab_size
    b = m.logits(m(t2, m.make_cache(64)))[-1]
    torch.testing.assert_close(a, b)
    # while position 3 does see token 0
    assert not torch.allclose(m.logits(m(t[:4], m.make_cache(8)))[-1], m.logits(m(t2[:4], m.make_cache(8)))[-1])


@pytest.mark.parametrize("arch", ARCHES)
def test_generate_greedy_deterministic(tiny_models, arch):
    e = Engine.load(str(tiny_models[arch]), n_ctx=128)
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    a = e.generate("the cat sat", p, chat=False)
    b = e.generate("the cat sat", p, chat=False)
    assert a.tokens == b.tokens and len(a.tokens) == 12 and a.finish_reason == "length"
    assert a.timings.predicted_n == 12 and a.timings.prompt_n > 0
    assert b.timings.cached_n > 0  # second call reuses the cached prompt prefix


def test_seeded_sampling_reproducible(tiny_models):
    e = Engine.load(str(tiny_models["qwen2"]), n_ctx=128)
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42, max_tokens=16)
    assert e.generate("abc", p, chat=False).tokens == e.generate("abc", p, chat=False).tokens
    p2 = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=43, max_tokens=16)
    assert e.generate("abc", p, chat=False).tokens != e.generate("abc", p2, chat=False).tokens


def test_context_overflow_is_clear(tiny_models):
    e = Engine.load(str(tiny_models["qwen2"]), n_ctx=32)
    with pytest.raises(MtpllmError, match="prompt is .* tokens but the context size is 32"):
        e.generate("x" * 200, SamplingParams(temperature=0, max_tokens=4), chat=False)
    c = e.generate("hello", SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), chat=False)
    assert c.finish_reason == "context" and len(c.tokens) + c.prompt_tokens == 32


def test_empty_prompt(tiny_models):
    e = Engine.load(str(tiny_models["qwen2"]), n_ctx=32)
    with pytest.raises(MtpllmError, match="empty prompt"):
        e.generate("", SamplingParams(max_tokens=4), chat=False)


def test_yarn_matches_transformers():
    tr = pytest.importorskip("transformers.modeling_rope_utils")
    from transformers import PretrainedConfig
    for base, dim, factor, orig in [(10000.0, 128, 4.0, 32768), (1e6, 64, 2.0, 4096), (500000.0, 128, 8.0, 8192)]:
        cfg = PretrainedConfig()
        cfg.rope_theta = base
        cfg.hidden_size = dim * 8
        cfg.num_attention_heads = 8
        cfg.head_dim = dim
        cfg.max_position_embeddings = int(orig * factor)
        cfg.rope_parameters = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": orig,
                               "rope_theta": base}
        cfg.rope_scaling = cfg.rope_parameters
        inv_ref, att_ref = tr.ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
        inv, att = rope_inv_freq(RopeConfig(base=base, scaling="yarn", factor=factor, orig_ctx=orig), dim)
        torch.testing.assert_close(inv, inv_ref.float(), rtol=1e-5, atol=0)
        assert att == pytest.approx(att_ref, rel=1e-6)


@pytest.mark.parametrize("mode", ["f32", "fast"])
@pytest.mark.parametrize("arch", ARCHES)
def test_verification_block_is_bitwise_equal_to_decoding(tiny_models, arch, mode):
    """Speculative verification runs k+1 tokens in one forward; every row must equal, bit for bit,
    the one-token decoding step at that position (this is what makes greedy identity exact)."""
    m = load_model(tiny_models[arch], mode)
    toks = torch.randint(0, m.cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(2))
    cache = m.make_cache(64)
    m(toks[:17], cache)
    block = m.logits(m(toks[17:24], cache))
    cache.trim(7)
    steps = torch.cat([m.logits(m(toks[i:i + 1], cache)) for i in range(17, 24)])
    assert torch.equal(block, steps)


def test_sliding_window_layers_keep_only_the_window(tiny_models):
    """Gemma's sliding layers hold window + SWA_SLACK positions in a ring buffer: same logits as a
    full cache, verification rows still bit-identical to decoding after the ring wrapped, rollback
    across the wrap works, and the memory estimate equals what is allocated."""
    from mtpllm.models.base import cache_windows
    from mtpllm.runtime.kv_cache import SWA_SLACK, KVCache, kv_cache_bytes
    for mode in ("f32", "fast"):
        m = load_model(tiny_models["gemma3"], mode)
        c = m.cfg
        ring = m.make_cache(256)
        full = KVCache(c.n_layers, c.n_kv_heads, c.head_dim, 256)  # no windows: every position kept
        assert ring.span(0) == c.sliding_window + SWA_SLACK and full.span(0) == 0
        assert ring.nbytes() < full.nbytes() / 3
        assert ring.nbytes() == kv_cache_bytes(c.n_layers, c.n_kv_heads, c.head_dim, 256, windows=cache_windows(c))
        toks = torch.randint(0, c.vocab_size, (200,), generator=torch.Generator().manual_seed(3))
        outs = {}
        for name, cache in (("ring", ring), ("full", full)):
            parts = [m.logits(m(toks[:90], cache))]  # one prefill chunk longer than the ring
            parts += [m.logits(m(toks[i:i + 5], cache)) for i in range(90, 150, 5)]
            parts += [m.logits(m(toks[i:i + 1], cache)) for i in range(150, 170)]
            outs[name] = torch.cat(parts)
        if mode == "f32":
            torch.testing.assert_close(outs["ring"], outs["full"], rtol=1e-5, atol=1e-5)
        else:  # bf16 activations: a last-bit difference in attention (fewer masked keys summed) can
            # cross a rounding boundary, so compare the decisions rather than the bits
            assert (outs["ring"].argmax(-1) == outs["full"].argmax(-1)).float().mean() > 0.97
        # verification block after the wrap == one-token decoding, bit for bit
        block = m.logits(m(toks[170:177], ring))
        ring.trim(7)
        steps = torch.cat([m.logits(m(toks[i:i + 1], ring)) for i in range(170, 177)])
        assert torch.equal(block, steps)
        # roll back 16 (a rejected draft block), continue with other tokens: equals a fresh run
        ring.trim(16)
        alt = torch.randint(0, c.vocab_size, (10,), generator=torch.Generator().manual_seed(4))
        a = m.logits(m(alt, ring))
        fresh = m.make_cache(256)
        m(toks[:161], fresh)
        b = m.logits(m(alt, fresh))
        if mode == "f32":
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        else:
            assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8


def test_sliding_window_speculation_stays_identical(tiny_models):
    from mtpllm.speculative import SpecConfig
    e = Engine.load(str(tiny_models["gemma3"]), n_ctx=400)
    p = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    prompt = list(range(5, 25)) * 3
    ref = e.generate(prompt_ids=prompt, params=p)
    for k in (2, 5):
        out = e.generate(prompt_ids=prompt, params=p, speculative=SpecConfig("ngram", k).build(e))
        assert out.tokens == ref.tokens


def test_yarn_beyond_the_original_context_end_to_end(tiny_dir, capsys):
    """A tiny model trained for 256 positions, run to 900 with YaRN x4: the scaled rotary is in
    place (frequencies and attention factor differ from the plain ones), perplexity over the long
    text is finite, and the CLI runs such a prompt (and warns when scaling is missing)."""
    import math

    from mtpllm.cli import main
    from tiny import make_tiny
    path = make_tiny(tiny_dir / "yarn.gguf", "qwen2", seed=12, ctx=256)
    yarn = {"rope.scaling": "yarn", "rope.factor": 4.0, "rope.orig_ctx": 256}
    plain, scaled = load_model(path, "f32"), load_model(path, "f32", yarn)
    assert scaled.cfg.rope.scaling == "yarn"
    inv0, att0 = rope_inv_freq(plain.cfg.rope, plain.cfg.head_dim)
    inv1, att1 = rope_inv_freq(scaled.cfg.rope, scaled.cfg.head_dim)
    assert att0 == 1.0 and att1 == pytest.approx(0.1 * math.log(4.0) + 1.0)
    assert inv1[0] == inv0[0] and inv1[-1] < inv0[-1]  # the highest frequency kept, the lowest scaled
    toks = torch.tensor(([7, 8, 9, 10, 11, 12, 13, 14] * 120)[:900])
    for model in (plain, scaled):
        cache = model.make_cache(1024)
        logits = torch.cat([model.logits(model(toks[s:s + 300], cache)) for s in range(0, 900, 300)])
        nll = torch.nn.functional.cross_entropy(logits[:-1], toks[1:])
        assert torch.isfinite(nll) and cache.length == 900
    prompt = tiny_dir / "long.txt"
    prompt.write_text("the cat sat on the mat. " * 60)
    argv = ["run", "-m", str(path), "-f", str(prompt), "--no-chat", "-n", "8", "--temp", "0", "-c", "1024"]
    assert main(argv + ["--rope-scaling", "yarn", "--rope-scale", "4", "--yarn-orig-ctx", "256"]) == 0
    err = capsys.readouterr().err
    assert "warning" not in err and "prompt eval time" in err
    assert main(argv) == 0
    assert "--rope-scaling yarn --rope-scale 4 --yarn-orig-ctx 256" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ARCHES)
def test_fused_decode_operators_match_pytorch(tiny_models, arch, monkeypatch):
    """The fused CPU operators (RMS norm; q/k norm + rotary + cache write + attention in one call)
    compute what the PyTorch formulation computes: prompt then one-token steps, logits to float32
    rounding. (Qwen3 has q/k norms, Llama adjacent-pair rotary, Gemma 3 sliding-window layers that
    stay on the PyTorch path.)"""
    from mtpllm.models import layers
    from mtpllm.runtime import kernels
    if not kernels.available():
        pytest.skip(kernels.status())
    m = load_model(tiny_models[arch], "f32")
    toks = torch.randint(0, m.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(3))

    def run():
        cache = m.make_cache(64)
        out = [m.logits(m(toks[:33], cache))]  # 33 tokens: the prompt path (PyTorch attention)
        out += [m.logits(m(toks[i:i + 1], cache)) for i in range(33, 40)]
        return torch.cat(out)

    fused = run()
    monkeypatch.setattr(layers, "_fused", lambda x: False)
    plain = run()
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
    x = torch.randn(5, 64)
    w = torch.randn(64)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6),
                               x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w)


@pytest.mark.parametrize("window", [0, 9, 40])
@pytest.mark.parametrize("H,KV,D", [(12, 2, 128), (14, 2, 64), (10, 2, 64), (6, 3, 80), (4, 2, 36)])
def test_cached_attention_rows_alone_or_together(H, KV, D, window):
    """The fused decode attention (rotary, cache write, attention over the cache) takes the query
    vectors that share a kv head together, sweeping keys and values in chunks: every row's output is
    still bit for bit what it is when the row is decoded alone (verification of drafts must equal
    decoding), at contexts that are and are not multiples of the chunk, head sizes with and without
    a 32-dim tail, 5, 6 and 7 query heads per kv head (the values' tiles of 4 queries and a remainder
    of 1, 2, 3); and it is attention (float64 reference, float32 rounding), over the last
    `window` keys of each row when a window is set (the MTP head's: shorter and longer than the
    context, not a multiple of the blocks of 8 keys). 12 rows of 14 heads are more query vectors than
    one task takes (64), so a row's queries are split between tasks; 300 positions span several
    chunks of the online softmax. Either prefetch of the keys ahead (`attn_prefetch`) gives the same bits."""
    from mtpllm.runtime import kernels
    if not kernels.available():
        pytest.skip(kernels.status())
    g = torch.Generator().manual_seed(D)
    for start, T in ((0, 5), (37, 5), (300, 5), (300, 12)):
        max_len = start + T + 3
        kc, vc = torch.randn(KV, max_len, D, generator=g), torch.randn(KV, max_len, D, generator=g)
        qkv = torch.randn(T, (H + 2 * KV) * D, generator=g)
        ang = torch.randn(max_len, D // 2, generator=g)
        cos, sin = ang.cos().contiguous(), ang.sin().contiguous()

        def attend(rows, at, k, v):
            return kernels.attend_cached(rows.contiguous(), cos, sin, k, v, at, H, KV, D, D, True, D ** -0.5,
                                         None, None, 1e-6, window)
        k1, v1 = kc.clone(), vc.clone()
        together = attend(qkv, start, k1, v1)
        old = kernels.tuning("attn_prefetch", 1 - kernels.tuning("attn_prefetch"))  # the other prefetch:
        try:  # at 300 positions both prefetch (the burst from 128 positions on, the spread 128 ahead)
            assert torch.equal(attend(qkv, start, kc.clone(), vc.clone()), together)
        finally:
            kernels.tuning("attn_prefetch", old)
        k2, v2 = kc.clone(), vc.clone()
        alone = torch.cat([attend(qkv[t:t + 1], start + t, k2, v2) for t in range(T)])
        assert torch.equal(together, alone) and torch.equal(k1, k2) and torch.equal(v1, v2)
        # reference: NeoX rotary of q and k, k/v written at start.., causal softmax attention
        x = qkv.double().view(T, H + 2 * KV, D)
        c, s = cos[start:start + T].double()[:, None], sin[start:start + T].double()[:, None]
        h = D // 2

        def rot(u):
            return torch.cat([u[..., :h] * c - u[..., h:] * s, u[..., h:] * c + u[..., :h] * s], -1)
        q, k_new, v_new = rot(x[:, :H]), rot(x[:, H:H + KV]), x[:, H + KV:]
        K, V = kc.double().clone(), vc.double().clone()
        K[:, start:start + T], V[:, start:start + T] = k_new.transpose(0, 1), v_new.transpose(0, 1)
        torch.testing.assert_close(k1.double(), K, rtol=1e-5, atol=1e-5)
        for t in range(T):
            for hd in range(H):
                kv = hd // (H // KV)
                lo = max(0, start + t + 1 - window) if window else 0
                w = torch.softmax(K[kv, lo:start + t + 1] @ q[t, hd] * D ** -0.5, 0)
                torch.testing.assert_close(together[t, hd * D:(hd + 1) * D].double(), w @ V[kv, lo:start + t + 1],
                                           rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("H,KV,D", [(14, 2, 64), (12, 2, 128), (4, 4, 32), (6, 3, 80)])
def test_a_deep_prompt_chunk_attends_to_its_prefix_and_itself(H, KV, D):
    """A prompt chunk with many keys before it attends to those without a mask and to its own keys
    causally, merged by log-sum-exp: causal attention (float64 reference, float32 rounding), for
    7, 6, 1 and 2 query heads per kv head, the default and a given scale."""
    from mtpllm.models import layers
    if layers._FLASH is None:
        pytest.skip("no CPU flash attention operator in this PyTorch")
    g = torch.Generator().manual_seed(H * D)
    T, P = 40, 300
    q = torch.randn(T, H, D, generator=g).transpose(0, 1).unsqueeze(0)  # [1, H, T, D], as the model makes it
    k, v = torch.randn(KV, P + T, D, generator=g), torch.randn(KV, P + T, D, generator=g)
    for scale in (None, 0.3):
        got = layers._attend_prefix_and_block(q, k, v, scale)
        sc = D ** -0.5 if scale is None else scale
        kk, vv = k.double().repeat_interleave(H // KV, 0), v.double().repeat_interleave(H // KV, 0)
        s_ = q[0].double() @ kk.transpose(1, 2) * sc  # [H, T, L]
        s_ = s_.masked_fill(torch.arange(P + T)[None, :] > torch.arange(P, P + T)[:, None], float("-inf"))
        want = torch.softmax(s_, -1) @ vv
        torch.testing.assert_close(got[0].double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_deep_prompt_chunks_give_the_masked_kernels_logits(tiny_models, arch, monkeypatch):
    """A prompt prefilled in chunks, the chunks past SPLIT_PREFIX_MIN keys attending split (here
    from 64 keys): the logits of one masked attention over the whole context, to float32 rounding."""
    from mtpllm.models import layers
    if layers._FLASH is None:
        pytest.skip("no CPU flash attention operator in this PyTorch")
    m = load_model(tiny_models[arch], "f32")
    toks = torch.randint(0, m.cfg.vocab_size, (200,), generator=torch.Generator().manual_seed(3))
    calls = []
    real = layers._attend_prefix_and_block

    def run():
        cache = m.make_cache(256)
        return torch.cat([m.logits(m(toks[a:a + 50], cache)) for a in range(0, 200, 50)])
    masked = run()
    monkeypatch.setattr(layers, "SPLIT_PREFIX_MIN", 64)
    monkeypatch.setattr(layers, "_attend_prefix_and_block", lambda *a: calls.append(a[1].shape[1]) or real(*a))
    split = run()
    full = sum(1 for mod in m.modules() if isinstance(mod, layers.Attention) and not mod.window)
    assert (full == 0) == (arch == "gemma3")  # every layer of the tiny Gemma 3 has a window
    # the chunks with 100 and 150 keys before them, in each layer without a window (the others: the mask)
    assert sorted(calls) == sorted([150, 200] * full)
    torch.testing.assert_close(split, masked, rtol=1e-4, atol=1e-4)


def test_moving_a_model_moves_every_weight(tiny_models):
    """`model.to(device)` (how Engine.load places a model on a GPU) carries the Linear weights,
    which are plain attributes, along; the CPU-kernel formats refuse to move instead of failing
    later. ("meta" stands in for a GPU here.)"""
    from mtpllm.runtime.linear import Linear
    m = load_model(tiny_models["qwen2"], "f32").to("meta")
    lins = [mod for mod in m.modules() if isinstance(mod, Linear)]
    assert lins and all(lin.weight.device.type == "meta" for lin in lins)
    assert all(lin.bias is None or lin.bias.device.type == "meta" for lin in lins)
    fast = load_model(tiny_models["qwen2"], "fast")
    if any(mod.kind in ("gguf", "blocks") for mod in fast.modules() if isinstance(mod, Linear)):
        with pytest.raises(RuntimeError, match="CPU kernels"):
            fast.to("meta")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_decode_stack_equals_the_per_operator_blocks(tiny_models, arch, monkeypatch):
    """Decoding and verification rows run every block in one C++ call (`DecodeStack`); it computes
    exactly what the modules compute operator by operator (same kernels, same order), bit for bit:
    prompt rows, one-token steps and a verification block. Gemma 3 (sliding windows, sandwich
    norms, GELU) stays on the modules."""
    from mtpllm.models import base, layers
    from mtpllm.runtime import kernels
    if not kernels.available():
        pytest.skip(kernels.status())
    toks = torch.randint(0, 200, (30,), generator=torch.Generator().manual_seed(5))

    def run(m):
        cache = m.make_cache(64)
        out = [m.logits(m(toks[:9], cache))]
        out += [m.logits(m(toks[i:i + 1], cache)) for i in range(9, 20)]
        out.append(m.logits(m(toks[20:30], cache)))
        return torch.cat(out)

    native = load_model(tiny_models[arch], "fast")
    got = run(native)
    assert native._stack is not False and native._stack.size() == native.cfg.n_layers
    monkeypatch.setattr(base, "native_rows", lambda x, kv: False)
    monkeypatch.setattr(layers, "native_rows", lambda x, kv: False)
    plain = load_model(tiny_models[arch], "fast")
    assert torch.equal(got, run(plain)) and plain._stack is None


def test_decode_stack_stage_timers(tiny_models):
    """The C++ blocks' per-stage timers (scripts/step_cost.py --stages): off by default, summed while
    on, reset when switched, and they leave the results unchanged."""
    from mtpllm.runtime import kernels
    if not kernels.available():
        pytest.skip(kernels.status())
    m = load_model(tiny_models["qwen2"], "fast")
    toks = torch.arange(1, 12)
    cache = m.make_cache(64)
    m(toks[:8], cache)
    before = m(toks[8:9], cache).clone()
    stack = m._stack
    assert stack.stage_times() == [0.0] * 6
    cache.trim(1)
    stack.set_timing(True)
    assert torch.equal(m(toks[8:9], cache), before)
    one = stack.stage_times()
    assert len(one) == 6 and all(t >= 0 for t in one) and sum(one) > 0
    m(toks[9:12], cache)
    assert all(b >= a for a, b in zip(one, stack.stage_times()))  # summed over calls
    stack.set_timing(False)
    assert stack.stage_times() == [0.0] * 6
    m(toks[:1], m.make_cache(64))
    assert stack.stage_times() == [0.0] * 6


def test_decode_stack_leaves_other_layouts_to_the_modules(tiny_models):
    from mtpllm.models.layers import decode_stack
    from mtpllm.runtime import kernels
    if not kernels.available():
        pytest.skip(kernels.status())
    assert decode_stack(list(load_model(tiny_models["gemma3"], "fast").blocks)) is None  # windows, GELU
    assert decode_stack(list(load_model(tiny_models["qwen2"], "f32").blocks)) is None  # float32 weights
    m = load_model(tiny_models["gemma3"], "fast")
    m(torch.arange(1, 6), m.make_cache(64))
    assert m._stack is False


def test_silu_mul_matches_pytorch():
    from mtpllm.runtime import kernels
    if not kernels.available():
        pytest.skip(kernels.status())
    gu = torch.randn(3, 2 * 83, generator=torch.Generator().manual_seed(1)) * 6  # 83: a scalar tail
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    g, u = gu.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_mul(gu), torch.nn.functional.silu(g) * u, rtol=2e-6, atol=1e-7)


def test_argmax_kernel_is_torch_argmax():
    """Greedy decoding and verification take each row's argmax with the C++ kernel: the same index
    as torch.argmax, ties to the first one, a NaN counting as the maximum, any row length."""
    from mtpllm.runtime import kernels
    if not kernels.available():
        pytest.skip(kernels.status())
    gen = torch.Generator().manual_seed(3)
    for V in (1, 7, 8, 31, 32, 33, 1000, 151936):
        x = torch.randn(5, V, generator=gen)
        x[1] = torch.randint(0, 3, (V,), generator=gen).float()  # many ties of the maximum
        x[2] = float("-inf")
        x[3, V // 2] = float("nan")
        x[3, V - 1] = float("inf")
        x[4, -1] = x[4].max() + 1  # the maximum in the scalar tail
        assert kernels.argmax(x) == x.argmax(-1).tolist(), V
        assert kernels.argmax(x[1]) == int(x[1].argmax())
    assert kernels.argmax(torch.tensor([[0.0, 2.0, 2.0]], dtype=torch.float64)) == [1]  # torch's, not float32

def test_verification_blocks_stay_below_the_row_threshold():
    """One threshold (runtime.linear.GEMM_MIN_ROWS) separates decoding/verification rows, which
    every layer computes as one-token decoding does, from prompt chunks: the largest verification
    block (1 + MAX_K drafts) must stay below it, or speculative greedy output could differ from plain."""
    from mtpllm.models import layers
    from mtpllm.runtime.linear import GEMM_MIN_ROWS
    from mtpllm.speculative.config import MAX_K
    assert 1 + MAX_K < GEMM_MIN_ROWS
    assert not hasattr(layers, "ROW_BY_ROW_MAX")  # no second definition
