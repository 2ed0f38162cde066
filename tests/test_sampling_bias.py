"""logit_bias in the sampler: added to the logits before every other transform, in plain decoding and
in speculative decoding (target and draft distributions alike)."""
import pytest
import torch

from mtpllm.errors import MtpllmError
from mtpllm.runtime.engine import Engine
from mtpllm.runtime.sampling import Sampler, SamplingParams
from mtpllm.speculative import SpecConfig
from tiny import make_tiny


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return Engine.load(str(make_tiny(tiny_dir / "bias.gguf", "qwen2", seed=7, nextn=1)), n_ctx=96)


def test_probs_are_the_softmax_of_the_biased_logits():
    torch.manual_seed(0)
    logits = torch.randn(50)
    bias = {3: 2.5, 7: -1.0, 11: float("-inf")}
    p = Sampler(SamplingParams(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0, logit_bias=bias)).probs(logits)
    want = logits.clone()
    for t, b in bias.items():
        want[t] += b
    assert torch.allclose(p, torch.softmax(want / 0.7, -1), atol=1e-6)
    assert p[11] == 0
    # ids beyond this vocabulary are ignored (as llama.cpp does), not an index error
    Sampler(SamplingParams(temperature=0, logit_bias={10 ** 6: 5.0})).probs(logits)


@pytest.mark.parametrize("bad", [{-1: 1.0}, {"3": 1.0}, {3: float("nan")}, {3: float("inf")}, {3: "x"}, [(3, 1.0)]])
def test_bad_logit_bias_is_refused(bad):
    with pytest.raises(MtpllmError, match="logit_bias"):
        SamplingParams(logit_bias=bad)


def _greedy(n, bias=None):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logit_bias=bias or {})


def test_a_large_positive_bias_makes_greedy_emit_the_token(engine):
    prompt = engine.tokenizer.encode("the cat sat on")
    plain = engine.generate(prompt_ids=prompt, params=_greedy(10)).tokens
    target = next(t for t in range(engine.tokenizer.vocab_size) if t not in plain and t not in prompt)
    out = engine.generate(prompt_ids=prompt, params=_greedy(10, {target: 100})).tokens
    assert out == [target] * 10
    # a ban (-inf) removes a token greedy would pick: the first token changes
    banned = engine.generate(prompt_ids=prompt, params=_greedy(10, {plain[0]: float("-inf")})).tokens
    assert plain[0] not in banned


def test_speculation_carries_the_bias_to_target_and_draft(engine):
    prompt = engine.tokenizer.encode("the cat sat on")
    plain = engine.generate(prompt_ids=prompt, params=_greedy(12)).tokens
    target = next(t for t in range(engine.tokenizer.vocab_size) if t not in plain and t not in prompt)
    spec = SpecConfig("mtp", 3, policy="fixed").build(engine)  # every step drafts
    c = engine.generate(prompt_ids=prompt, params=_greedy(12, {target: 100}), speculative=spec)
    assert c.tokens == [target] * 12  # the verifier applied it
    # the draft head applied it too: every drafted token was the biased one, so all were accepted
    assert c.stats.num_draft_tokens > 0 and c.stats.num_accepted_tokens == c.stats.num_draft_tokens
    # a mild bias: speculative greedy equals plain greedy with the same bias (lossless)
    bias = {plain[1]: -3.0, target: 1.5}
    want = engine.generate(prompt_ids=prompt, params=_greedy(12, bias)).tokens
    got = engine.generate(prompt_ids=prompt, params=_greedy(12, bias), speculative=spec).tokens
    assert got == want
