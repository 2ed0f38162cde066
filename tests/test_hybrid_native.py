"""The hybrid models' decoding step in C++ (`HybridStack`, models/hybrid_native.py) on tiny random
Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoints: it is the path taken for decoding and verification
rows, it agrees with the per-module PyTorch path, its rows do not depend on the rows beside them
(verification == decoding, rollback == feeding the kept rows), batches of sequences give each
sequence its own result, and the MTP block runs on it too.

Tolerances, C++ path against the PyTorch path (logits of spread ~0.6):
- float32 weights: 2e-5. The matrix products are the same operators on both paths; the elementwise
  steps (convolution, SiLU/sigmoid from a polynomial exp, L2 norms, the delta rule's sums) round
  differently, ~1e-7 relative per step, grown through 4 layers and the recurrence to a few 1e-6.
  A wrong gate, head order, decay or norm changes logits by 1e-2 and more (tests/test_qwen35.py).
- Q8_0 weights: 1e-2 of the logits' spread, or a tenth of how far int8 activations move the logits
  from the same weights in float32, whichever is larger. Activations are quantized to int8 per block
  of 32 before each product; an input that differs in the 7th digit can round one of them to the
  neighbouring step (1/127 of the block's largest value), so the paths may differ by such steps, not
  by bits. Through the MoE's small experts such steps reach 3% of the spread (on an Intel AVX-512
  VNNI machine), while quantization itself moves the logits by half of it.
"""
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from mtpllm.gguf.reader import GGUFFile
from mtpllm.models import load_model
from mtpllm.runtime import kernels
from mtpllm.runtime.engine import Engine
from mtpllm.runtime.sampling import SamplingParams
from mtpllm.tokenizer import GGUFTokenizer

tiny_hybrid = pytest.importorskip("tiny_hybrid")
pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not kernels.expected(), reason="the CPU kernels are not used on this machine")

KINDS = ["qwen35", "qwen35moe", "qwen3next"]
# value heads of 64: the C++ delta rule's column-block path (value heads a multiple of 32 wide) besides
# the row path the other checkpoints (value heads of 8) take
WIDE = {"linear_key_head_dim": 32, "linear_value_head_dim": 64}
# 1,536 convolution channels: a block of 20 rows splits the convolution between threads by channel
# blocks (hybrid.cpp kConvBlock), which one row never does
MANY = dict(WIDE, linear_num_key_heads=8, linear_num_value_heads=16)
TOKENS = [5, 17, 200, 33, 9, 101, 44, 3, 250, 7, 66, 12] * 4
CHUNKS = [20, 1, 5, 1, 1, 7, 1, 3, 1, 8]  # all below 32 rows: decoding and verification blocks
TOL_F32 = 2e-5
TOL_Q8 = 1e-2


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """kind -> {"f32": GGUF with float32 weights, "q8": GGUF with Q8_0 matrices}."""
    root = tmp_path_factory.mktemp("hybrid_native")
    out = {}
    for kind in KINDS:
        d, _ = tiny_hybrid.make_tiny_hf(root / kind, kind, echo=0.1)
        out[kind] = {"f32": tiny_hybrid.hf_to_gguf(d, root / f"{kind}-f32.gguf"),
                     "q8": tiny_hybrid.hf_to_gguf(d, root / f"{kind}-q8.gguf", QT.Q8_0)}
    d, _ = tiny_hybrid.make_tiny_hf(root / "wide", "qwen35", echo=0.1, **WIDE)
    out["wide"] = {"f32": tiny_hybrid.hf_to_gguf(d, root / "wide-f32.gguf"),
                   "q8": tiny_hybrid.hf_to_gguf(d, root / "wide-q8.gguf", QT.Q8_0)}
    d, _ = tiny_hybrid.make_tiny_hf(root / "many", "qwen35", echo=0.1, **MANY)
    out["many"] = {"q8": tiny_hybrid.hf_to_gguf(d, root / "many-q8.gguf", QT.Q8_0)}
    return out


def _boom(*a, **k):
    raise AssertionError("the per-module path ran where the C++ stack should have")


def _native_only(m):
    """Make the model's modules fail if called: only the C++ stack may run its blocks."""
    for blk in m.blocks:
        blk.mixer.forward = _boom
        blk.ffn.forward = _boom
    return m


def _steps(m, toks, chunks):
    cache = m.make_cache(128)
    out, s = [], 0
    t = torch.tensor(toks)
    for n in chunks:
        out.append(m.logits(m(t[s:s + n], cache)))
        s += n
    return torch.cat(out), cache


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("weights", ["f32", "q8"])
def test_cpp_path_is_taken_and_agrees_with_pytorch(files, kind, weights):
    path = files[kind][weights]
    cpp = _native_only(load_model(path, "fast"))
    ref = load_model(path, "fast")
    ref._stack = False  # the per-module PyTorch path
    n = sum(CHUNKS)
    a, _ = _steps(cpp, TOKENS[:n], CHUNKS)
    assert isinstance(cpp._stack, torch.ScriptObject)
    b, _ = _steps(ref, TOKENS[:n], CHUNKS)
    if weights == "q8":
        lin = cpp.blocks[0].mixer.proj
        assert all(p.kind == "gguf" for p in getattr(lin, "parts", [lin]))
    err = (a - b).abs().max().item()
    if weights == "f32":
        assert err < TOL_F32, err
    else:
        # int8 activations: both paths differ from the same weights in float32 by their rounding;
        # they must agree far closer than that (a tenth of it), or within TOL_Q8 of the spread
        exact = load_model(path, "f32")
        exact._stack = False
        c, _ = _steps(exact, TOKENS[:n], CHUNKS)
        quant = (b - c).abs().max().item()
        assert err < max(TOL_Q8 * b.std().item(), 0.1 * quant), (err, quant)
    # the check has teeth: logits one position off are far away
    assert (a[1:] - b[:-1]).abs().max() > 100 * TOL_F32


@pytest.mark.parametrize("kind,block,rejected", [("qwen35", 6, 2), ("qwen35moe", 5, 4), ("qwen3next", 3, 1),
                                                  ("wide", 4, 2), ("many", 20, 5)])
def test_rows_are_independent_and_rollback_is_exact(files, kind, block, rejected):
    """On the C++ path: a verification block gives each row what decoding it alone gives, bit for
    bit, and after `trim(rejected)` the state is exactly that of feeding only the kept rows."""
    m = _native_only(load_model(files[kind]["q8"], "fast"))
    prompt, blk, after = TOKENS[:20], TOKENS[20:20 + block], TOKENS[30:33]
    a, b, c = m.make_cache(96), m.make_cache(96), m.make_cache(96)
    for x in (a, b, c):
        m(torch.tensor(prompt), x)
    la = m.logits(m(torch.tensor(blk), a))
    rows = torch.cat([m.logits(m(torch.tensor([t]), c)) for t in blk])
    assert torch.equal(la, rows)
    a.trim(rejected)
    kept = block - rejected
    lb = m.logits(m(torch.tensor(blk[:kept]), b))
    assert torch.equal(la[:kept], lb)
    assert torch.equal(m.logits(m(torch.tensor(after), a)), m.logits(m(torch.tensor(after), b)))


@pytest.mark.parametrize("dv", [8, 64])
def test_replay_kernel_rows_at_once_equal_rows_one_by_one(dv):
    """kernels.replay_delta_rule over n rows (for value heads a multiple of 32 wide: column blocks held
    in L1 through all rows) gives the bits of n one-row replays (whole-row sweeps), and the delta rule
    (`delta_rule_update`) to float32 rounding."""
    from mtpllm.runtime.cache import delta_rule_update
    g = torch.Generator().manual_seed(dv)
    L, H, dk, n = 2, 3, 16, 5
    states = torch.randn(L, 2, H, dk, dv, generator=g)
    k = torch.nn.functional.normalize(torch.randn(L, n, H, dk, generator=g), dim=-1)
    v = torch.randn(L, n, H, dv, generator=g)
    gates = torch.rand(L, n, H, 2, generator=g) * 0.8 + 0.1  # decay, beta in (0.1, 0.9)
    rec = torch.cat([k, v, gates], -1).contiguous()
    a = states.clone()
    kernels.replay_delta_rule(a, rec, 0, n)
    b, base = states.clone(), 0
    for t in range(n):
        kernels.replay_delta_rule(b, rec[:, t:t + 1].contiguous(), base, 1)
        base = 1 - base
    assert torch.equal(a[:, 1], b[:, base])
    assert torch.equal(a[:, 0], states[:, 0])  # the base slot is only read
    for layer in range(L):
        S = states[layer, 0]
        for t in range(n):
            S = delta_rule_update(S, k[layer, t], v[layer, t], gates[layer, t, :, 0], gates[layer, t, :, 1])
        assert (S - a[layer, 1]).abs().max() < 1e-5


def _same_state(a, b):
    assert a.length == b.length
    for layer in range(a.rec.state.shape[0]):
        assert torch.equal(a.rec.state_of(layer), b.rec.state_of(layer))
        assert torch.equal(a.rec.conv_state(layer), b.rec.conv_state(layer))


# (rows of a block, the trims that follow it) or a snapshot / a restore of it
PLAN = [(5, (2,)), (4, (1, 1)), (1, ()), (6, (0, 3)), (3, (1,)), (1, ()), (2, (1,)), "snapshot", (4, (2,)), (3, ()),
        "restore", (5, (4,)), (3, (0,)), (4, (3,)), "check", (6, (1,)), (2, ())]


@pytest.mark.parametrize("kind", KINDS + ["wide"])
@pytest.mark.parametrize("native", [True, False], ids=["cpp", "pytorch"])
def test_lazy_replay_after_trims_is_exact(files, kind, native):
    """A verification block rolled back by `trim` leaves its kept rows as a pending replay, applied by
    the next forward (the C++ path: in its delta-rule pass; the PyTorch path: `materialize`) or by a
    snapshot: logits and states are bit for bit those of feeding only the kept rows, through trims
    after trims, trims of 0, single rows after a trim, snapshot and restore."""
    m = load_model(files[kind]["q8"], "fast")
    if native:
        _native_only(m)
    else:
        m._stack = False  # the per-module PyTorch path
    a, b = m.make_cache(160), m.make_cache(160)
    for c in (a, b):
        m(torch.tensor(TOKENS[:9]), c)
    toks, pos, snap, replayed = TOKENS * 3, 9, None, 0
    for step in PLAN:
        if step == "snapshot":
            snap = a.snapshot(), b.snapshot(), pos
            assert torch.equal(snap[0]["rec"][2], snap[1]["rec"][2])
            continue
        if step == "restore":
            a.restore(snap[0])
            b.restore(snap[1])
            pos = snap[2]
            continue
        if step == "check":
            _same_state(a, b)  # materializes the pending replay (C++: kernels.replay_delta_rule)
            continue
        T, trims = step
        blk = toks[pos:pos + T]
        replayed += a.rec.replay()[1]
        la = m.logits(m(torch.tensor(blk), a))
        for n in trims:
            assert a.trim(n) == n
        kept = T - sum(trims)
        assert a.rec.replay()[1] == (kept if kept < T else 0)
        lb = m.logits(m(torch.tensor(blk[:kept]), b))
        assert torch.equal(la[:kept], lb)
        pos += kept
    assert replayed > 10  # the forwards did replay rows
    _same_state(a, b)
    assert torch.equal(m.logits(m(torch.tensor(toks[pos:pos + 3]), a)), m.logits(m(torch.tensor(toks[pos:pos + 3]), b)))


@pytest.mark.parametrize("kind", ["qwen35", "qwen3next", "wide"])
def test_lazy_replay_on_both_paths_agrees(files, kind):
    """The C++ path's replays (in the forward, in `materialize`) and the PyTorch path's give the same
    states to float32 rounding, and a cache whose rows one path recorded continues on the other."""
    path = files[kind]["f32"]
    cpp, ref = load_model(path, "fast"), load_model(path, "fast")
    ref._stack = False
    a, b = cpp.make_cache(96), ref.make_cache(96)
    for m, c in ((cpp, a), (ref, b)):
        m(torch.tensor(TOKENS[:9]), c)
        m(torch.tensor(TOKENS[9:14]), c)
        c.trim(3)
        m(torch.tensor(TOKENS[20:24]), c)
        c.trim(1)
    for layer in range(a.rec.state.shape[0]):
        assert (a.rec.state_of(layer) - b.rec.state_of(layer)).abs().max() < TOL_F32
    # the PyTorch path after C++ rows (replayed by kernels.replay_delta_rule) and the other way round
    cpp(torch.tensor(TOKENS[30:34]), a)
    a.trim(2)
    ref(torch.tensor(TOKENS[30:34]), b)
    b.trim(2)
    la = ref.logits(ref(torch.tensor(TOKENS[40:43]), a))
    lb = cpp.logits(cpp(torch.tensor(TOKENS[40:43]), b))
    assert (la - lb).abs().max() < TOL_F32


@pytest.mark.parametrize("kind", KINDS + ["wide"])
def test_batch_with_pending_replays(files, kind):
    """forward_batch over sequences each with its own pending replay (verification blocks batched,
    each trimmed by another amount) == each sequence fed only its kept rows alone."""
    m = _native_only(load_model(files[kind]["q8"], "fast"))
    prompts = [TOKENS[:9], TOKENS[3:20], TOKENS[7:12]]
    blocks = [TOKENS[20:24], TOKENS[24:27], TOKENS[27:32]]
    trims = [2, 0, 4]
    nxt = [TOKENS[32:35], TOKENS[35:36], TOKENS[36:38]]
    batched = [m.make_cache(64) for _ in prompts]
    for p, c in zip(prompts, batched):
        m(torch.tensor(p), c)
    m.forward_batch([torch.tensor(x) for x in blocks], batched)
    for c, n in zip(batched, trims):
        c.trim(n)
    assert [c.rec.replay()[1] for c in batched] == [2, 0, 1]
    got = m.forward_batch([torch.tensor(x) for x in nxt], batched)
    for p, blk, n, x, g, cb in zip(prompts, blocks, trims, nxt, got, batched):
        c = m.make_cache(64)
        m(torch.tensor(p), c)
        m(torch.tensor(blk[:len(blk) - n]), c)
        assert torch.equal(m(torch.tensor(x), c), g)
        _same_state(c, cb)


@pytest.mark.parametrize("kind", KINDS)
def test_batch_gives_each_sequence_its_own_result(files, kind):
    """forward_batch over sequences at different positions with different row counts (one matrix
    product for all rows, recurrent state and attention per sequence) == each sequence alone."""
    m = _native_only(load_model(files[kind]["q8"], "fast"))
    prompts = [TOKENS[:9], TOKENS[3:20], TOKENS[7:12]]
    steps = [TOKENS[20:21], TOKENS[21:25], TOKENS[25:27]]
    alone, batched = [], [m.make_cache(64) for _ in prompts]
    for p, s, c in zip(prompts, steps, batched):
        m(torch.tensor(p), c)
    for p, s in zip(prompts, steps):
        c = m.make_cache(64)
        m(torch.tensor(p), c)
        alone.append((m(torch.tensor(s), c), c.length))
    got = m.forward_batch([torch.tensor(s) for s in steps], batched)
    for (h, n), g, c in zip(alone, got, batched):
        assert torch.equal(h, g) and c.length == n
    # then one more token each (decode_batch) still agrees with decoding alone
    nxt = torch.tensor([1, 2, 3])
    h = m.decode_batch(nxt, batched)
    for i, (p, s) in enumerate(zip(prompts, steps)):
        c = m.make_cache(64)
        m(torch.tensor(p), c)
        m(torch.tensor(s), c)
        assert torch.equal(m(nxt[i:i + 1], c), h[i:i + 1])


def test_mtp_block_runs_on_the_stack_and_speculation_stays_greedy_identical(files):
    from mtpllm.speculative import SpecConfig
    path = files["qwen35moe"]["q8"]
    eng = Engine(_native_only(load_model(path, "fast")), GGUFTokenizer(GGUFFile(path).metadata, "qwen35moe"), 256)
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ids = eng.encode_prompt("the fox = the fox", chat=False)
    ref = eng.generate(prompt_ids=ids, params=p).tokens
    for k in (1, 3, 6):
        spec = SpecConfig("mtp", k, policy="fixed").build(eng)
        out = eng.generate(prompt_ids=ids, params=p, speculative=spec)
        assert out.tokens == ref, k
        assert isinstance(spec.proposer.head.block._native, torch.ScriptObject)
        st = out.stats
        assert st.num_accepted_tokens > 0 and st.accepted_per_pos[0] < st.drafted_per_pos[0]


def test_scheduler_serves_hybrid_sequences_as_alone(files):
    """Continuous batching on a hybrid with its MTP layer: several requests share forwards (the C++
    stack over all their rows) and each gets the tokens it gets alone."""
    import threading

    from mtpllm.runtime.scheduler import Scheduler
    from mtpllm.speculative import SpecConfig
    path = files["qwen35"]["q8"]
    eng = Engine(_native_only(load_model(path, "fast")), GGUFTokenizer(GGUFFile(path).metadata, "qwen35"), 128)
    spec = SpecConfig("mtp", 3, policy="fixed").build(eng)
    prompts = [eng.encode_prompt(t, chat=False) for t in ("the fox = the fox", "a b c a b", "the the the", "fox")]
    params = [SamplingParams(temperature=0, max_tokens=8 + 4 * i, ignore_eos=True) for i in range(len(prompts))]
    want = []
    for ids, p in zip(prompts, params):
        eng.reset()
        want.append(eng.generate(prompt_ids=ids, params=p, speculative=spec).tokens)
    eng.reset()
    m, batched = eng.model, []
    real = m.forward_batch

    def forward_batch(tokens, caches):  # record the batched forwards that completed
        out = real(tokens, caches)
        batched.append(len(caches))
        return out

    m.forward_batch = forward_batch
    sched = Scheduler(eng, spec, n_slots=3)
    got = {}

    def client(i, r):
        got[i] = [x.token for x in r if x.token is not None]

    try:
        reqs = [sched.submit(ids, p) for ids, p in zip(prompts, params)]
        ts = [threading.Thread(target=client, args=(i, r)) for i, r in enumerate(reqs)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=120)
    finally:
        sched.shutdown(1)
    assert [got[i] for i in range(len(prompts))] == want
    assert sched.steps < sum(len(w) for w in want) and max(batched) == 3  # steps were shared


@pytest.mark.parametrize("kind", ["qwen35", "qwen35moe"])
def test_mtp_layer_drafts_for_several_sequences_at_once(files, kind):
    """The MTP layer's gated-attention block drafts for several sequences in one stack pass per
    draft position (never its one-sequence forward) and each gets the drafts and head cache it
    gets alone, bit for bit."""
    from mtpllm.runtime.sampling import Sampler
    from mtpllm.speculative import SpecConfig
    path = files[kind]["q8"]
    eng = Engine(_native_only(load_model(path, "fast")), GGUFTokenizer(GGUFFile(path).metadata, kind), 128)
    prop = SpecConfig("mtp", 3, policy="fixed").build(eng).proposer
    m = eng.model
    prompts = [TOKENS[:9], TOKENS[3:20], TOKENS[7:12]]
    ks = [3, 1, 3]

    @torch.inference_mode()
    def ready(t):
        c = m.make_cache(64)
        hidden = m(torch.tensor(t), c)
        st = prop.new_state()
        prop.begin(st, t, hidden, 0)
        return st

    alone, together = [ready(t) for t in prompts], [ready(t) for t in prompts]
    hists = [t + [t[1]] for t in prompts]
    params = SamplingParams(temperature=0)
    want = [prop.propose(st, h, k, Sampler(params)) for st, h, k in zip(alone, hists, ks)]
    calls = []
    solo = type(prop.head).forward
    prop.head.forward = lambda *a: (calls.append(1), solo(prop.head, *a))[1]
    try:
        got = prop.propose_batch(together, hists, ks, [Sampler(params) for _ in prompts])
    finally:
        del prop.head.forward
    assert calls == [] and [d for d, _ in got] == [d for d, _ in want]
    assert [len(d) for d, _ in want] == ks
    for a, b in zip(alone, together):
        n = a.cache.length
        assert b.cache.length == n and torch.equal(a.cache.k[:, :, :n], b.cache.k[:, :, :n])


def test_prompt_chunk_convolution_is_the_decoding_rows_arithmetic():
    """A prompt chunk's DeltaNet convolution + SiLU (`kernels.deltanet_conv_silu`, split between
    threads by channel blocks) equals the fixed-order sum of the taps in PyTorch to float32
    rounding, and each row's bits do not depend on the rows computed with it: a chunk of 300 rows
    gives every row the bits it gets alone (channels 1,000: a partial block and a scalar tail)."""
    g = torch.Generator().manual_seed(0)
    K, C, T = 4, 1000, 300
    hist, w = torch.randn(K - 1 + T, C, generator=g), torch.randn(C, K, generator=g)
    got = kernels.deltanet_conv_silu(hist, w.t().contiguous())
    ref = hist[0:T] * w[:, 0]
    for j in range(1, K):
        ref = ref + hist[j:j + T] * w[:, j]
    torch.testing.assert_close(got, torch.nn.functional.silu(ref), rtol=1e-5, atol=1e-6)
    alone = torch.cat([kernels.deltanet_conv_silu(hist[t:t + K], w.t().contiguous()) for t in range(T)])
    assert torch.equal(got, alone)
    with pytest.raises(RuntimeError, match="deltanet_conv_silu"):
        kernels.deltanet_conv_silu(hist[:2], w.t().contiguous())  # fewer inputs than the kernel's taps
