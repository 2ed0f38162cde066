"""Speculative decoding is lossless: greedy output identical to plain decoding for every method
and k, sampled output follows the target distribution; MTP module equals its formula."""
import numpy as np
import pytest
import torch

from mtpllm.errors import MtpllmError
from mtpllm.gguf import GGUFFile
from mtpllm.models import load_model
from mtpllm.runtime.engine import Engine
from mtpllm.runtime.sampling import SamplingParams
from mtpllm.speculative import SpecConfig, parse_speculative_json
from mtpllm.speculative import verifier as V
from mtpllm.speculative.mtp import MTPProposer, load_mtp_head
from tiny import check_fill_matches_forward, make_tiny, make_tiny_head

GREEDY = dict(temperature=0, max_tokens=40, ignore_eos=True)
# a prompt with repeats, so n-gram lookup finds matches
PROMPT = "the cat the cat the cat sat on the mat; the cat sat on the"


@pytest.fixture(scope="module")
def target(tiny_dir):
    return Engine.load(str(make_tiny(tiny_dir / "tgt.gguf", "qwen2", seed=5, nextn=1)), n_ctx=256)


@pytest.fixture(scope="module")
def draft_path(tiny_dir):
    # same vocabulary, different weights: a real draft model with imperfect agreement
    return str(make_tiny(tiny_dir / "drf.gguf", "qwen2", seed=6, n_layers=1))


def _plain(engine, params, prompt=PROMPT):
    return engine.generate(prompt, SamplingParams(**params), chat=False)


@pytest.mark.parametrize("policy", ["fixed", "cost"])
@pytest.mark.parametrize("k", range(1, 7))
@pytest.mark.parametrize("method", ["ngram", "draft_model", "mtp"])
def test_greedy_identity(target, draft_path, method, k, policy):
    """Every method and k, with a fixed draft length and with the cost policy. On a tiny model the
    measured costs make drafts never pay (the cost policy's own tests cover that), so the cost policy
    gets free verification rows and drafting here: it verifies all its drafts, through its own path."""
    from mtpllm.speculative.policy import set_step_costs
    ref = _plain(target, GREEDY)
    cfg = SpecConfig(method=method, num_speculative_tokens=k, draft_model=draft_path if method == "draft_model" else None,
                     policy=policy)
    spec = cfg.build(target)
    set_step_costs(target, [1.0] * (k + 1) if policy == "cost" else None, 0.0)
    try:
        out = target.generate(PROMPT, SamplingParams(**GREEDY), chat=False, speculative=spec)
    finally:
        set_step_costs(target, None)
    if policy == "cost":
        assert len(out.stats.k_hist) == k + 1 and out.stats.k_hist[k] > 0
    assert out.tokens == ref.tokens
    assert out.finish_reason == ref.finish_reason
    assert out.stats.num_drafts > 0


def test_greedy_identity_head_only_file(target, tiny_dir):
    head = make_tiny_head(tiny_dir / "mtp-tgt.gguf", "qwen2", n_layers=2, seed=9)
    ref = _plain(target, GREEDY)
    for k in (1, 3, 6):
        spec = SpecConfig(method="mtp", num_speculative_tokens=k, mtp_head=str(head), policy="fixed").build(target)
        assert target.generate(PROMPT, SamplingParams(**GREEDY), chat=False, speculative=spec).tokens == ref.tokens


def test_head_window_limits_the_heads_attention(target, tiny_dir):
    """A head attending over the last W positions of its cache (`MTPHead.set_window`): the C++ rows
    (decoding, drafts) and the PyTorch prompt chunks agree on which keys a position sees, positions
    within the window are unchanged bit for bit, several sequences' rows in one batch get the bits
    they get alone, and greedy output stays plain decoding's. A head trained on S-token windows
    (`mtpllm.train.seq_len`) gets max(HEAD_WINDOW, 2 S) at load; other heads attend everywhere."""
    from mtpllm.speculative.mtp import HEAD_WINDOW, head_window
    path = make_tiny_head(tiny_dir / "mtp-win.gguf", "qwen2", n_layers=2, seed=9)
    assert head_window(GGUFFile(path)) == 0
    trained = make_tiny_head(tiny_dir / "mtp-win256.gguf", "qwen2", n_layers=2, seed=9,
                             meta={"mtpllm.train.seq_len": 256})
    assert head_window(GGUFFile(trained)) == max(HEAD_WINDOW, 512)
    assert MTPProposer.for_engine(target, str(trained)).head.window == max(HEAD_WINDOW, 512)
    bad = make_tiny_head(tiny_dir / "mtp-winbad.gguf", "qwen2", n_layers=2, seed=9,
                         meta={"mtpllm.train.seq_len": "long"})
    with pytest.raises(MtpllmError, match="seq_len"):
        head_window(GGUFFile(bad))

    prop = MTPProposer.for_engine(target, str(path))
    head, cfg = prop.head, target.model.cfg
    T = 40  # >= GEMM_MIN_ROWS: one prompt chunk runs the PyTorch modules (masked attention)
    g = torch.Generator().manual_seed(4)
    emb = prop.embed(torch.randint(0, cfg.vocab_size, (T,), generator=g))
    hid = torch.randn(T, cfg.d_model, generator=g)

    def run(window, chunk):
        head.set_window(window)
        c = head.make_cache(cfg, 64)
        with torch.inference_mode():
            if chunk:
                return head(emb, hid, c)
            return torch.cat([head(emb[t:t + 1], hid[t:t + 1], c) for t in range(T)])

    full, win = run(0, False), run(6, False)
    assert torch.equal(win[:6], full[:6])
    for w, rows in ((0, full), (6, win)):
        torch.testing.assert_close(run(w, True), rows, rtol=1e-4, atol=1e-4)  # float32 sums in another order
    gap = (win[6:] - full[6:]).abs().max()
    assert gap > 10 * (run(6, True) - win).abs().max()  # the window changes far more than the path does

    # two sequences past the window, verified together: each row as alone
    def fill(n):
        c = head.make_cache(cfg, 64)
        with torch.inference_mode():
            for t in range(n):
                head(emb[t:t + 1], hid[t:t + 1], c)
        return c
    head.set_window(6)
    with torch.inference_mode():
        a, b = fill(20), fill(13)
        together = head.forward_batch([emb[20:24], emb[13:14]], [hid[20:24], hid[13:14]], [a, b])
        a, b = fill(20), fill(13)
        alone = [head(emb[20:24], hid[20:24], a), head(emb[13:14], hid[13:14], b)]
    assert all(torch.equal(x, y) for x, y in zip(together, alone))

    ref = _plain(target, GREEDY)
    for k in (1, 3):
        spec = SpecConfig(method="mtp", num_speculative_tokens=k, mtp_head=str(path), policy="fixed").build(target)
        spec.proposer.head.set_window(4)
        assert target.generate(PROMPT, SamplingParams(**GREEDY), chat=False, speculative=spec).tokens == ref.tokens


def test_ngram_index_drafts_what_a_full_search_drafts():
    """n-gram lookup keeps an index that grows with the history (no scan of the whole history per
    step): on random histories over a small alphabet (many repeats, overlapping matches), grown a
    few tokens at a time, its drafts are exactly those of a search over every earlier window, the
    latest match of the longest n first; a new history (another request) rebuilds the index."""
    import random
    from mtpllm.speculative.ngram import NgramProposer

    def search(h, k, lo, hi):
        L = len(h)
        for n in range(min(hi, L - 1), lo - 1, -1):
            starts = [j for j in range(0, L - n) if h[j:j + n] == h[L - n:]]
            if starts and h[starts[-1] + n:starts[-1] + n + k]:
                return h[starts[-1] + n:starts[-1] + n + k]
        return []
    rng = random.Random(0)
    for trial in range(120):
        lo, hi = rng.choice([(1, 4), (3, 8), (2, 2)])
        p = NgramProposer(lo, hi)
        st = p.new_state()
        for _ in range(2):  # a second request on the same state
            h = [rng.randrange(6) for _ in range(rng.randrange(1, 5))]
            for step in range(40):
                k = rng.randrange(1, 9)
                assert p.propose(st, h, k)[0] == search(h, k, lo, hi), (h, k)
                h.extend(rng.randrange(6) for _ in range(rng.randrange(1, 4)))


def test_mtp_head_with_matching_weights_is_accepted(tiny_dir):
    """A head whose block copies trunk data is still only a draft; but a tiny model with an MTP
    block of its own gets non-zero acceptance on repetitive text only by chance. Check instead
    that greedy acceptance statistics are consistent."""
    e = Engine.load(str(make_tiny(tiny_dir / "t2.gguf", "qwen2", seed=11, nextn=1)), n_ctx=256)
    spec = SpecConfig(method="mtp", num_speculative_tokens=3, policy="fixed").build(e)
    out = e.generate(PROMPT, SamplingParams(**GREEDY), chat=False, speculative=spec)
    s = out.stats
    assert s.num_draft_tokens >= s.num_accepted_tokens >= 0
    assert sum(s.drafted_per_pos) == s.num_draft_tokens and sum(s.accepted_per_pos) == s.num_accepted_tokens
    # every target step emits accepted + 1 tokens (the last may be cut by max_tokens)
    assert len(out.tokens) <= s.num_accepted_tokens + s.num_steps + 1
    assert sum(s.k_hist) == s.num_steps and sum(s.k_hist[1:]) == s.num_drafts


@pytest.mark.parametrize("method", ["ngram", "draft_model", "mtp"])
def test_stop_strings_and_max_tokens_inside_blocks(target, draft_path, method):
    ref_full = _plain(target, GREEDY)
    text = target.tokenizer.decode(ref_full.tokens)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cfg = SpecConfig(method=method, num_speculative_tokens=4, draft_model=draft_path if method == "draft_model" else None,
                     policy="fixed")  # every step drafts: blocks of 5 tokens to cut
    for params in (dict(GREEDY, stop=[stop]), dict(GREEDY, max_tokens=7), dict(GREEDY, max_tokens=1)):
        ref = _plain(target, params)
        out = target.generate(PROMPT, SamplingParams(**params), chat=False, speculative=cfg.build(target))
        assert out.text == ref.text and out.tokens == ref.tokens and out.finish_reason == ref.finish_reason


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5])
def test_drafts_stop_at_max_tokens(target, max_tokens):
    """A step emits at most k + 1 tokens, so no step drafts more than the tokens still allowed
    less one: the first step (after the prefill's token) at most max_tokens - 2, none when
    max_tokens <= 2. The output is plain decoding's."""
    params = dict(GREEDY, max_tokens=max_tokens)
    spec = SpecConfig(method="mtp", num_speculative_tokens=6, policy="fixed").build(target)  # drafts every step
    out = target.generate(PROMPT, SamplingParams(**params), chat=False, speculative=spec)
    assert out.tokens == _plain(target, params).tokens and len(out.tokens) == max_tokens
    used = [k for k, n in enumerate(out.stats.k_hist) if n]
    assert max(used, default=0) <= max(0, max_tokens - 2)
    assert out.stats.num_steps == 0 or max_tokens > 1


def test_eos_inside_block(target):
    """Make EOS the token plain greedy decoding emits 5th: speculation must stop at the same place."""
    ref = _plain(target, GREEDY)
    tok = target.tokenizer
    saved = set(tok.eos_ids)
    try:
        tok.eos_ids = {ref.tokens[4]}
        params = dict(GREEDY, ignore_eos=False)
        plain = _plain(target, params)
        for k in (2, 4, 6):
            spec = SpecConfig(method="mtp", num_speculative_tokens=k, policy="fixed").build(target)
            out = target.generate(PROMPT, SamplingParams(**params), chat=False, speculative=spec)
            assert out.tokens == plain.tokens and out.finish_reason == "stop"
        assert len(plain.tokens) == ref.tokens.index(ref.tokens[4])
    finally:
        tok.eos_ids = saved


def test_context_limit_with_speculation(target):
    e = Engine.load(str(target.model.source), n_ctx=40)
    p = SamplingParams(**dict(GREEDY, max_tokens=100))
    ref = e.generate("the cat the cat", p, chat=False)
    out = e.generate("the cat the cat", p, chat=False, speculative=SpecConfig("mtp", 4, policy="fixed").build(e))
    assert out.tokens == ref.tokens and out.finish_reason == ref.finish_reason == "context"


# ------------------------------------------------------------------ distribution
def _first_tokens(engine, spec_cfg, params, n, seed0, stats=None):
    out = []
    spec = spec_cfg.build(engine) if spec_cfg else None
    for s in range(n):
        p = SamplingParams(**dict(params, seed=seed0 + s))
        c = engine.generate(prompt_ids=[5, 6, 7], params=p, speculative=spec)
        out.append(tuple(c.tokens[:3]))
        if stats is not None:
            stats.merge(c.stats)
    return out


def _chi2_pvalue(a, b, pos):
    from scipy.stats import chi2_contingency
    ca = {}
    for x in a:
        ca[x[pos]] = ca.get(x[pos], 0) + 1
    cb = {}
    for x in b:
        cb[x[pos]] = cb.get(x[pos], 0) + 1
    keys = sorted(set(ca) | set(cb), key=lambda t: -(ca.get(t, 0) + cb.get(t, 0)))
    big = [k for k in keys if ca.get(k, 0) + cb.get(k, 0) >= 10]
    rows = [[ca.get(k, 0) for k in big] + [sum(v for k, v in ca.items() if k not in big)],
            [cb.get(k, 0) for k in big] + [sum(v for k, v in cb.items() if k not in big)]]
    rows = [r for r in zip(*rows) if sum(r) > 0]
    if len(rows) < 2:  # one outcome only, in both arms
        return 1.0
    return chi2_contingency(np.array(rows).T)[1]


@pytest.fixture(scope="module")
def peaky(tiny_dir):
    """Tiny model with a peaked output distribution (large output weights)."""
    return Engine.load(str(make_tiny(tiny_dir / "peaky.gguf", "qwen2", seed=21, out_scale=0.6)), n_ctx=64)


@pytest.fixture(scope="module")
def flat_draft(tiny_dir):
    """The same network with smaller output weights: q is a flattened p, so drafts are often
    rejected and max(0, p - q) differs a lot from p."""
    return str(make_tiny(tiny_dir / "flat.gguf", "qwen2", seed=21, out_scale=0.3))


SAMPLED = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, max_tokens=3, ignore_eos=True)
N = 2000  # samples per arm


@pytest.fixture(scope="module")
def plain_samples(peaky):
    return {key: _first_tokens(peaky, None, dict(SAMPLED, **extra), N, 0)
            for key, extra in (("t1", {}), ("top_p", {"top_p": 0.8}))}


@pytest.mark.parametrize("key,extra,policy", [("t1", {}, "fixed"), ("top_p", {"top_p": 0.8}, "fixed"),
                                               ("t1", {}, "cost")])
def test_sampling_distribution_preserved(peaky, flat_draft, plain_samples, key, extra, policy):
    """Empirical distribution of tokens 1..3 with draft-model speculation (k=3) equals plain sampling.
    With the cost policy, costs are set so that drafts are cheap: how many drafts a step verifies
    then depends on the draft's own confidence (a mix of 0..3), which must not bias the output.

    Power against a wrong residual step is shown directly on the acceptance rule in
    `test_acceptance_rule_emits_target_distribution`."""
    from mtpllm.speculative.policy import set_step_costs
    if policy == "cost":
        set_step_costs(peaky, [1.0, 1.05, 1.1, 1.15], 0.01)
    total = V.SpecStats()
    try:
        spec = _first_tokens(peaky, SpecConfig("draft_model", 3, draft_model=flat_draft, policy=policy),
                             dict(SAMPLED, **extra), N, 10**6, total)
    finally:
        set_step_costs(peaky, None)
    if policy == "cost":  # the steps verified different numbers of drafts
        assert sum(1 for n in total.k_hist if n > N // 50) >= 2, total.k_hist
    for pos in range(3):
        assert _chi2_pvalue(plain_samples[key], spec, pos) > 1e-3


def _verifier_first_token_counts(p, q, n, residual=None):
    """Run the acceptance rule n times on one draft d ~ q against target p; count emitted tokens."""
    from mtpllm.runtime.sampling import Sampler
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=123))
    logits = torch.log(p).repeat(2, 1)
    drafts = torch.multinomial(q, n, replacement=True, generator=torch.Generator().manual_seed(7)).tolist()
    counts = np.zeros(len(p))
    for d in drafts:
        n_acc, nxt = V.accept_drafts(logits, [d], [q], sampler, [])
        counts[d if n_acc else nxt] += 1
    return counts


def test_acceptance_rule_emits_target_distribution(monkeypatch):
    """Direct check of the rule on a draft that overlaps the target: the emitted token follows p
    exactly; with the residual max(0, p - q) replaced by p (plain resampling after a rejection,
    the classic bug) the same goodness-of-fit test rejects with an enormous margin. The end-to-end
    tests above check the whole engine; this one gives the residual step its statistical power."""
    from scipy.stats import chisquare
    p = torch.tensor([0.45, 0.25, 0.15, 0.10, 0.05, 0.0])
    q = torch.tensor([0.10, 0.15, 0.20, 0.25, 0.20, 0.10])
    n = 20000
    good = _verifier_first_token_counts(p, q, n)
    assert good[5] == 0  # a token the target cannot produce is never emitted
    assert chisquare(good[:5], n * p[:5].numpy()).pvalue > 1e-3
    monkeypatch.setattr(V, "residual_distribution", lambda p, q: p)
    buggy = _verifier_first_token_counts(p, q, n)
    assert chisquare(buggy[:5], n * p[:5].numpy()).pvalue < 1e-12


def _consistent_stats(st, k: int, n_tokens: int) -> None:
    """What the statistics must say of any speculative run: at most k drafts per drafting step, no
    more accepted than drafted, per-position counts that add up, and every token either the
    prefill's, an accepted draft or a target step's own (the last block may be cut by max_tokens)."""
    assert st.num_drafts > 0 and st.num_draft_tokens <= k * st.num_drafts
    assert 0 <= st.num_accepted_tokens <= st.num_draft_tokens
    assert sum(st.drafted_per_pos) == st.num_draft_tokens and sum(st.accepted_per_pos) == st.num_accepted_tokens
    assert n_tokens <= 1 + st.num_steps + st.num_accepted_tokens


@pytest.mark.parametrize("costs", [None, [1.0, 1.0, 1.0, 1.0]])
def test_sampling_with_mtp_is_seeded_and_reports(peaky, tiny_mtp, costs, monkeypatch):
    """Measured costs (timed once for the model, then reused) or given ones (free rows: every step
    drafts): the same seed gives the same sample. (The steps' observed times, which move measured
    costs between requests and so the drafts a step verifies, are held still here: a sample is the
    seed's only for the same sequence of draft lengths.)"""
    from mtpllm.speculative import policy
    from mtpllm.speculative.policy import set_step_costs
    monkeypatch.setattr(policy, "OBSERVE_WEIGHT", 0.0)
    e = Engine.load(str(tiny_mtp), n_ctx=64)
    set_step_costs(e, costs, 0.0)
    params = SamplingParams(**dict(SAMPLED, max_tokens=20, seed=1))
    out = e.generate(prompt_ids=[5, 6, 7], params=params, speculative=SpecConfig("mtp", 3).build(e))
    assert len(out.tokens) == 20
    if costs:
        _consistent_stats(out.stats, 3, len(out.tokens))
    again = e.generate(prompt_ids=[5, 6, 7], params=params, speculative=SpecConfig("mtp", 3).build(e))
    assert again.tokens == out.tokens  # the same seed gives the same sample


# ------------------------------------------------------------------ MTP module vs formula
def _rms(x, w, eps=1e-6):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def test_mtp_module_equals_formula(tiny_mtp):
    trunk = load_model(tiny_mtp, "f32")
    g = GGUFFile(tiny_mtp)
    head = load_mtp_head(g, trunk, "f32")
    L = 2
    W = lambda n: g.load(f"blk.{L}.{n}")  # noqa: E731
    T = 5
    emb = torch.randn(T, 256)
    hid = torch.randn(T, 256)
    cache = head.make_cache(trunk.cfg, 16)
    got = head(emb, hid, cache)
    # reference: the formula written out, with a plain attention block
    x = torch.cat([_rms(emb, W("nextn.enorm.weight")), _rms(hid, W("nextn.hnorm.weight"))], -1) @ W("nextn.eh_proj.weight").t()
    h = _rms(x, W("attn_norm.weight"))
    q = (h @ W("attn_q.weight").t() + W("attn_q.bias")).view(T, 4, 64)
    k = (h @ W("attn_k.weight").t() + W("attn_k.bias")).view(T, 2, 64)
    v = (h @ W("attn_v.weight").t() + W("attn_v.bias")).view(T, 2, 64)
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2).double() / 64))
    ang = torch.outer(torch.arange(T).double(), inv).float()
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]

    def rot(t):
        a, b = t[..., :32], t[..., 32:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
    q, k = rot(q), rot(k)
    k = k.repeat_interleave(2, dim=1)
    v = v.repeat_interleave(2, dim=1)
    att = torch.einsum("thd,shd->hts", q, k) / 8.0
    att = att.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf")).softmax(-1)
    o = torch.einsum("hts,shd->thd", att, v).reshape(T, 256) @ W("attn_output.weight").t()
    x = x + o
    f = _rms(x, W("ffn_norm.weight"))
    x = x + (torch.nn.functional.silu(f @ W("ffn_gate.weight").t()) * (f @ W("ffn_up.weight").t())) @ W("ffn_down.weight").t()
    ref = _rms(x, W("nextn.shared_head_norm.weight"))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ configuration errors
def test_config_parsing_and_errors(target, tiny_dir):
    assert parse_speculative_json('{"method":"qwen3_5_mtp","num_speculative_tokens":2}').method == "mtp"
    assert parse_speculative_json('{"method":"ngram","prompt_lookup_max":5}').prompt_lookup_max == 5
    for bad, msg in [("{", "invalid JSON"), ("[1]", "expected a JSON object"), ('{"method":"x"}', "unknown speculative method"),
                     ('{"method":"mtp","num_speculative_tokens":0}', "num_speculative_tokens"),
                     ('{"method":"mtp","bogus":1}', "unknown keys"), ('{"method":"draft_model"}', "needs a draft model"),
                     ('{"method":"ngram","prompt_lookup_min":3,"prompt_lookup_max":2}', "prompt_lookup")]:
        with pytest.raises(MtpllmError, match=msg):
            parse_speculative_json(bad)
    plain = Engine.load(str(make_tiny(tiny_dir / "nomtp.gguf", "qwen2", seed=2)), n_ctx=64)
    with pytest.raises(MtpllmError, match="has no MTP layers.*train-mtp"):
        SpecConfig("mtp").build(plain)


def test_head_that_does_not_fit(target, tiny_dir):
    gem = make_tiny(tiny_dir / "g.gguf", "gemma3")
    with pytest.raises(MtpllmError, match="architecture 'gemma3'"):
        SpecConfig("mtp", mtp_head=str(gem)).build(target)  # a gemma file is not a qwen2 head
    wrong = make_tiny_head(tiny_dir / "mtp-wrong.gguf", "qwen2", trunk_sha256="0" * 64)
    with pytest.raises(MtpllmError, match="trained for a model with sha256"):
        SpecConfig("mtp", mtp_head=str(wrong)).build(target)


def test_draft_vocab_mismatch(target, tiny_dir):
    gem = make_tiny(tiny_dir / "g2.gguf", "gemma3")
    with pytest.raises(MtpllmError, match="must share the target's tokenizer"):
        SpecConfig("draft_model", draft_model=str(gem)).build(target)


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_adaptive_draft_length_keeps_identity(target, method):
    ref = _plain(target, GREEDY)
    cfg = SpecConfig(method=method, num_speculative_tokens=5, min_speculative_tokens=1, adaptive=True)
    out = target.generate(PROMPT, SamplingParams(**GREEDY), chat=False, speculative=cfg.build(target))
    assert out.tokens == ref.tokens
    assert max(len(out.stats.drafted_per_pos), 1) <= 5


def test_p_min_stops_drafting(target):
    ref = _plain(target, GREEDY)
    cfg = SpecConfig(method="mtp", num_speculative_tokens=4, p_min=0.999)
    out = target.generate(PROMPT, SamplingParams(**GREEDY), chat=False, speculative=cfg.build(target))
    assert out.tokens == ref.tokens
    # a random head is never 99.9% sure: drafting stops early, so few draft tokens are checked
    assert out.stats.num_draft_tokens < len(out.tokens)



def test_cumulative_p_min_cuts_on_the_product_of_draft_probabilities(target):
    """From one state: every cut-off's drafts are a prefix of the uncut ones; a higher threshold never
    drafts more; the cumulative cut-off (product of the step's draft probabilities) never drafts more
    than the per-token one at the same threshold, and strictly fewer for some (the product of two
    probabilities falls below a threshold that each of them passes)."""
    from mtpllm.runtime.sampling import Sampler
    ids = target.tokenizer.encode(PROMPT)
    spec = SpecConfig("mtp", 4).build(target)
    prop = spec.proposer

    def drafts(p_min=0.0, p_cum=0.0):
        cache = target.model.make_cache(64)
        st = prop.new_state()
        prop.begin(st, ids[:-1], target.model(torch.tensor(ids[:-1]), cache), 0)
        return prop.propose(st, list(ids), 4, Sampler(SamplingParams(temperature=0)), p_min, p_cum)[0]

    full = drafts()
    assert len(full) == 4
    grid = [10 ** (-e / 4) for e in range(40, 0, -1)]  # 1e-10 .. 0.56
    n_tok, n_cum = [], []
    for t in grid:
        a, b = drafts(p_min=t), drafts(p_cum=t)
        assert a == full[:len(a)] and b == full[:len(b)]
        assert len(b) <= len(a)
        n_tok.append(len(a))
        n_cum.append(len(b))
    assert n_cum == sorted(n_cum, reverse=True) and n_tok == sorted(n_tok, reverse=True)
    assert n_cum[0] == 4 and n_cum[-1] == 0
    assert any(b < a for a, b in zip(n_tok, n_cum))


def test_mtp_prompt_pass_runs_in_chunks(target, monkeypatch):
    """The head's pass over a prompt writes its cache entries `chunk` positions per call (bounding
    the activations of a long prompt); its cache then holds what one pass writes."""
    ids = target.tokenizer.encode(PROMPT)
    prop = SpecConfig("mtp", 4).build(target).proposer
    hidden = target.model(torch.tensor(ids), target.model.make_cache(64))
    one, chunked = prop.new_state(), prop.new_state()
    prop.begin(one, ids, hidden, 0, chunk=1000)
    head, sizes = prop.head, []
    fill = head.fill

    def recording(x, h, cache):  # the real pass, its row counts noted
        sizes.append(x.shape[0])
        return fill(x, h, cache)
    monkeypatch.setattr(head, "fill", recording)
    prop.begin(chunked, ids, hidden, 0, chunk=4)
    n = len(ids) - 1
    assert sizes == [4] * (n // 4) + ([n % 4] if n % 4 else [])
    assert chunked.cache.length == one.cache.length == n and chunked.tokens == one.tokens == ids[1:]
    for a, b in ((one.cache.k, chunked.cache.k), (one.cache.v, chunked.cache.v)):
        torch.testing.assert_close(a[..., :n, :], b[..., :n, :], rtol=1e-5, atol=1e-5)


def test_cumulative_p_min_keeps_greedy_identity(target):
    ref = _plain(target, GREEDY)
    for cfg in (SpecConfig(method="mtp", num_speculative_tokens=4, p_cum=0.01),
                parse_speculative_json('{"method":"mtp","num_speculative_tokens":3,"draft_p_cumulative":0.001}')):
        out = target.generate(PROMPT, SamplingParams(**GREEDY), chat=False, speculative=cfg.build(target))
        assert out.tokens == ref.tokens
    with pytest.raises(MtpllmError, match="cumulative p-min"):
        SpecConfig(method="mtp", p_cum=1.5)

# ------------------------------------------------------------------ chains (n-gram first, MTP otherwise)
@pytest.mark.parametrize("k_ngram,k_mtp,lookup_min", [(3, 1, None), (4, 2, 1), (1, 3, 1)])
def test_chain_ngram_then_mtp_keeps_greedy_identity(target, k_ngram, k_mtp, lookup_min):
    """Both members draft in one generation (lookup on the repeats, MTP elsewhere), each within its
    own draft length; the MTP head's cache stays in step across the steps it did not draft."""
    ref = _plain(target, GREEDY)
    cfg = SpecConfig("ngram", k_ngram, prompt_lookup_min=lookup_min, fallback=SpecConfig("mtp", k_mtp))
    out = target.generate(PROMPT, SamplingParams(**GREEDY), chat=False, speculative=cfg.build(target))
    assert out.tokens == ref.tokens
    m = out.stats.members
    # with 1-token matches lookup finds some in the tiny model's output; 3-token ones it may not
    assert set(m) == {"ngram", "mtp"} if lookup_min == 1 else "mtp" in m
    m.setdefault("ngram", [0, 0, 0])
    assert m["ngram"][0] + m["mtp"][0] == out.stats.num_drafts
    assert m["ngram"][1] <= k_ngram * m["ngram"][0] and m["mtp"][1] <= k_mtp * m["mtp"][0]
    assert "ngram:" in out.stats.summary() and out.stats.to_dict()["members"]["mtp"]["drafts"] == m["mtp"][0]
    # the same engine and chain again (prefix reuse of the trunk and the head's caches)
    again = target.generate(PROMPT, SamplingParams(**GREEDY), chat=False, speculative=cfg.build(target))
    assert again.tokens == ref.tokens


def test_chain_sampling_reports_per_member(peaky, tiny_mtp):
    e = Engine.load(str(tiny_mtp), n_ctx=64)
    cfg = SpecConfig("ngram", 3, fallback=SpecConfig("mtp", 2))
    out = e.generate(prompt_ids=[5, 6, 7, 5, 6, 7, 5, 6], params=SamplingParams(**dict(SAMPLED, max_tokens=30, seed=3)),
                     speculative=cfg.build(e))
    assert len(out.tokens) == 30
    st = out.stats
    _consistent_stats(st, 3, len(out.tokens))
    # the members' statistics add up to the chain's
    assert [sum(m[i] for m in st.members.values()) for i in range(3)] == \
        [st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens]


def test_chain_configuration(target):
    import argparse
    from mtpllm.speculative.config import add_spec_args, spec_from_args
    ap = argparse.ArgumentParser()
    add_spec_args(ap)
    cfg = spec_from_args(ap.parse_args(["--spec-type", "ngram-simple,draft-mtp", "--spec-draft-n-max", "4",
                                        "--spec-fallback-n-max", "1"]))
    assert (cfg.method, cfg.num_speculative_tokens, cfg.fallback.method, cfg.fallback.num_speculative_tokens) == \
        ("ngram", 4, "mtp", 1)
    cum = spec_from_args(ap.parse_args(["--spec-type", "ngram-simple,draft-mtp", "--spec-draft-p-cum", "0.3"]))
    assert cum.p_cum == cum.fallback.p_cum == 0.3 and cum.p_min == cum.fallback.p_min == 0.0
    js = parse_speculative_json('{"method":"ngram","num_speculative_tokens":4,'
                                '"fallback":{"method":"mtp","num_speculative_tokens":1}}')
    assert js.label() == "ngram:4+mtp:1"
    for args, msg in [(["--spec-type", "draft-mtp,ngram-simple"], "only n-gram lookup can come first"),
                      (["--spec-type", "ngram-simple,ngram-simple"], "must differ"),
                      (["--spec-type", "ngram-simple,draft-mtp,draft-simple"], "two types at most"),
                      (["--spec-type", "draft-mtp", "--spec-fallback-n-max", "2"], "needs a chain"),
                      (["--spec-type", "ngram-simple", "--spec-mtp-head", "x.gguf"], "is for draft-mtp"),
                      (["--spec-type", "ngram-simple,draft-mtp", "--spec-fallback-n-max", "0"], "num_speculative_tokens"),
                      (["--spec-type", "draft-mtp", "--spec-draft-p-cum", "1.5"], "cumulative p-min"),
                      (["--spec-draft-p-cum", "0.3"], "without a method")]:
        with pytest.raises(MtpllmError, match=msg):
            spec_from_args(ap.parse_args(args))
    # lookup in a chain needs a 3-token match unless told otherwise; alone it takes 1 (vLLM's default)
    chain = SpecConfig("ngram", 3, fallback=SpecConfig("mtp", 1)).build(target).proposer
    assert chain.proposers[0].n_min == 3
    assert SpecConfig("ngram", 3, prompt_lookup_min=1, fallback=SpecConfig("mtp", 1)).build(target).proposer.proposers[0].n_min == 1
    assert SpecConfig("ngram", 3, prompt_lookup_max=2, fallback=SpecConfig("mtp", 1)).build(target).proposer.proposers[0].n_min == 2
    assert SpecConfig("ngram", 3).build(target).proposer.n_min == 1
    inner = SpecConfig("mtp")
    inner.fallback = SpecConfig("ngram")
    with pytest.raises(MtpllmError, match="two members at most"):
        SpecConfig("ngram", fallback=inner)


def test_request_tokens_outside_the_draft_vocabulary_are_drafted(target, tiny_dir):
    """With a reduced draft vocabulary, tokens of the request (prompt and output so far) outside it
    are draft candidates too: the head's unrestricted greedy draft, removed from the vocabulary,
    is drafted again when it is in the prompt, and not when the request's tokens are left out.
    Greedy output stays identical to plain decoding, for greedy and sampled drafting."""
    head_file = make_tiny_head(tiny_dir / "mtp-ctx.gguf", "qwen2", n_layers=2, seed=9)
    V_ = target.model.cfg.vocab_size

    def proposer(vocab):
        head = load_mtp_head(GGUFFile(head_file), target.model, "fast")
        if vocab is not None:
            head.draft_vocab = torch.tensor(sorted(vocab))
        return MTPProposer(head, target.model, target.n_ctx)

    ids = target.tokenizer.encode(PROMPT)
    hidden = target.model(torch.tensor(ids), target.model.make_cache(len(ids), "cpu"))
    from mtpllm.runtime.sampling import make_sampler
    sampler = make_sampler(SamplingParams(temperature=0), "cpu")

    def first_draft(p, history):  # the prompt through the head, then the draft after its first token
        p.st = p.new_state()
        p.begin(p.st, ids, hidden, 0)
        return p.propose(p.st, history, 1, sampler)[0]

    # history: the prompt and one generated token x0, chosen so that the head's unrestricted draft
    # after it is a token of the history
    free_p = proposer(None)
    for x0 in range(V_):
        history = ids + [x0]
        [free] = first_draft(free_p, history)
        if free in history:
            break
    assert free in history
    reduced = proposer(set(range(V_)) - {free})
    [d] = first_draft(reduced, history)
    assert d == free and reduced.st.ctx_tokens == [free]
    reduced.context_vocab = False
    [d_off] = first_draft(reduced, history)
    assert d_off != free
    # logits of the context rows are the lm_head's at those tokens
    g = torch.randn(1, target.model.cfg.d_model)
    p = proposer(set(range(V_ // 2)))
    st = p.new_state()
    p.update_context(st, list(range(V_ // 2 - 3, V_ // 2 + 5)))
    assert st.ctx_tokens == list(range(V_ // 2, V_ // 2 + 5))
    full = target.model.lm_head(g)[0]
    both = torch.cat([p.lm_head(g)[0], st.ctx_head(g)[0]])
    assert torch.allclose(both, full[st.draft_ids], rtol=1e-5, atol=1e-5)
    # lossless, through the head file's own reduced vocabulary (half the tokens)
    half = make_tiny_head(tiny_dir / "mtp-half.gguf", "qwen2", n_layers=2, seed=9, draft_vocab=range(0, V_, 2))
    ref = _plain(target, GREEDY)
    spec = SpecConfig(method="mtp", num_speculative_tokens=3, mtp_head=str(half), policy="fixed").build(target)
    out = target.generate(PROMPT, SamplingParams(**GREEDY), chat=False, speculative=spec)
    assert out.tokens == ref.tokens and out.stats.num_drafts > 0
    ctx = target.slot.draft_state(spec.proposer).ctx_tokens
    assert ctx and all(t % 2 for t in ctx)
    sampled = dict(temperature=0.8, seed=3, max_tokens=30, ignore_eos=True)
    out = target.generate(PROMPT, SamplingParams(**sampled), chat=False, speculative=spec)
    assert len(out.tokens) == 30 and out.stats.num_drafts > 0


@pytest.mark.parametrize("params", [dict(temperature=0.8), dict(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0),
                                    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
                                    dict(temperature=0.8, repetition_penalty=1.3), dict(temperature=0.0)])
def test_drafts_from_a_draft_vocabulary_are_the_whole_vectors(params):
    """A head drafting from some tokens only samples on their logits alone: the same q (scattered
    to the vocabulary) and top probability as the whole vector with -inf elsewhere, and draws that
    follow q; with penalties (which look tokens up by id) and greedy, the whole vector itself."""
    from scipy.stats import chisquare
    from mtpllm.runtime.sampling import Sampler
    g = torch.Generator().manual_seed(4)
    ids = torch.randperm(1000, generator=g)[:300]
    sub = torch.randn(300, generator=g) * 2.5
    full = torch.full((1000,), float("-inf")).index_copy_(0, ids, sub)
    hist = [int(ids[0]), int(ids[1]), 5]
    a, b = Sampler(SamplingParams(seed=1, **params)), Sampler(SamplingParams(seed=1, **params))
    d, q, top = V.draft_token_in(sub, ids, 1000, a, hist, p_min=0.1)
    d_ref, q_ref, top_ref = V.draft_token(full, b, hist, p_min=0.1)
    assert top == pytest.approx(top_ref, abs=1e-6) and int(d) in ids.tolist()
    if params["temperature"] == 0:
        assert q is None and q_ref is None and d == d_ref
        return
    torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-7)
    assert torch.equal(q > 0, q_ref > 0)
    draws = np.bincount([V.draft_token_in(sub, ids, 1000, a, hist)[0] for _ in range(4000)], minlength=1000)
    keep = q.numpy() > 0.01
    assert draws[q.numpy() == 0].sum() == 0
    expect = 4000 * q.double().numpy() / q.double().sum().item()
    assert chisquare(np.append(draws[keep], draws[~keep].sum()), np.append(expect[keep], expect[~keep].sum())).pvalue > 1e-3


def test_responses_mark_accepted_draft_tokens(target, draft_path):
    """Each streamed token says whether it was an accepted draft: their count is the statistics'
    accepted count (a draft model identical to the target has most drafts accepted), and plain
    decoding marks none."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ids = target.encode_prompt(PROMPT, chat=False)
    for drafter, same in ((str(target.model.source), True), (draft_path, False)):
        spec = SpecConfig("draft_model", num_speculative_tokens=3, draft_model=drafter).build(target)
        rs = list(target.stream(ids, params, spec))
        marked = sum(r.draft for r in rs)
        assert marked == rs[-1].stats.num_accepted_tokens
        if same:
            assert marked > rs[-1].stats.num_draft_tokens // 2
    target.reset()
    assert not any(r.draft for r in target.stream(ids, params))


@pytest.mark.parametrize("method", ["ngram", "draft_model", "mtp"])
def test_logprobs_are_the_targets_with_and_without_speculation(target, draft_path, method):
    """Log-probabilities come from the target's own rows: identical (bit for bit) with and without
    speculation, the emitted token's one is among the top alternatives in greedy decoding, and they
    equal the log-softmax of a plain forward over prompt + output."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    ids = target.encode_prompt(PROMPT, chat=False)
    target.reset()
    plain = [r for r in target.stream(ids, params) if r.token is not None]
    spec = SpecConfig(method, 3, draft_model=draft_path if method == "draft_model" else None).build(target)
    fast = [r for r in target.stream(ids, params, spec) if r.token is not None]
    assert [(r.token, r.logprob, r.top_logprobs) for r in fast] == [(r.token, r.logprob, r.top_logprobs) for r in plain]
    assert any(r.draft for r in fast) or fast[-1].stats.num_accepted_tokens == 0
    for r in plain:
        assert r.top_logprobs[0][0] == r.token and r.top_logprobs[0][1] == r.logprob
        assert len(r.top_logprobs) == 3 and r.logprob <= 0
    toks = ids + [r.token for r in plain]
    m = target.model
    cache = m.make_cache(len(toks))
    hid = torch.cat([m(torch.tensor([t]), cache) for t in toks[:-1]])  # one-token decoding, as generation
    ref = torch.log_softmax(m.logits(hid), -1)
    got = torch.tensor([r.logprob for r in plain])
    want = ref[len(ids) - 1:, :].gather(1, torch.tensor(toks[len(ids):])[:, None])[:, 0]
    # int8 activation rounding differs in the last bits between paths; a shifted row (an
    # off-by-one) would differ by far more than this
    assert torch.allclose(got, want, atol=0.05)
    assert not torch.allclose(got[1:], want[:-1], atol=0.05)
    target.reset()
    assert all(r.logprob is None for r in target.stream(ids, SamplingParams(temperature=0, max_tokens=4)))
    with pytest.raises(MtpllmError, match="logprobs"):
        SamplingParams(logprobs=21)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("T", [5, 40])
def test_head_fill_writes_the_entries_its_forward_writes(tiny_dir, arch, T):
    """`MTPHead.fill` (prompt rows and the catch-up rows before the last, whose output nobody reads)
    writes the cache entries the head's full forward writes, with the projections only: the next
    row's output then matches. T = 40 rows go through the PyTorch modules on both sides (the same
    bits); T = 5 rows run the C++ block in `forward` (its own rotary and sums: float32 rounding)."""
    eng = Engine.load(str(make_tiny(tiny_dir / f"fill-{arch}.gguf", arch, seed=7, nextn=1)), n_ctx=128)
    check_fill_matches_forward(eng, T, seed=3)
