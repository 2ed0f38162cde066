"""Batched decoding of independent requests (`Engine.generate_batch`): every sequence gets exactly
what `generate` gives it alone, on every architecture (Gemma 3's sliding-window layers included)."""
import pytest

from mtpllm.errors import MtpllmError
from mtpllm.runtime.engine import Engine
from mtpllm.runtime.sampling import SamplingParams

PROMPTS = ["the cat sat on the mat", "a", "once upon a time there was a little dog that ran and ran and",
           "the quick brown fox jumps over the lazy dog " * 6]


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "llama", "gemma3"])
def engine(request, tiny_models):
    return Engine.load(str(tiny_models[request.param]), n_ctx=256)


def _alone(engine, ids, params):
    engine.reset()
    return engine.generate(prompt_ids=ids, params=params)


def test_greedy_batch_equals_each_alone(engine):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ids = [engine.encode_prompt(p, chat=False) for p in PROMPTS]
    got = engine.generate_batch(ids, params)
    assert len(got) == len(ids)
    for i, c in zip(ids, got):
        ref = _alone(engine, i, params)
        assert c.tokens == ref.tokens and c.text == ref.text
        assert c.finish_reason == ref.finish_reason == "length" and len(c.tokens) == 24
        assert c.prompt_tokens == len(i)


def test_sampled_batch_equals_each_alone(engine):
    # the same seed per sequence: each request samples exactly the tokens it samples alone
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7, max_tokens=16, ignore_eos=True)
    ids = [engine.encode_prompt(p, chat=False) for p in PROMPTS[:3]]
    got = engine.generate_batch(ids, params)
    for i, c in zip(ids, got):
        assert c.tokens == _alone(engine, i, params).tokens


def test_stop_strings_and_context_end_per_sequence(engine):
    ids = [engine.encode_prompt(p, chat=False) for p in PROMPTS[:3]]
    free = engine.generate_batch(ids, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    # a stop string taken from the middle of the second answer ends that one only, as it does alone
    stop = free[1].text[len(free[1].text) // 2:][:3]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])
    got = engine.generate_batch(ids, params)
    for i, c in zip(ids, got):
        ref = _alone(engine, i, params)
        assert (c.tokens, c.text, c.finish_reason) == (ref.tokens, ref.text, ref.finish_reason)
    assert got[1].finish_reason == "stop" and stop not in got[1].text


def test_batch_errors(engine):
    with pytest.raises(MtpllmError, match="empty prompt"):
        engine.generate_batch([[1, 2], []])
    with pytest.raises(MtpllmError, match="context size"):
        engine.generate_batch([[1] * engine.n_ctx])
    assert engine.generate_batch([]) == []
    got = engine.generate_batch([[1, 2]], SamplingParams(temperature=0, max_tokens=0))
    assert got[0].tokens == [] and got[0].finish_reason == "length"


def test_keep_hidden_gives_the_state_of_every_token(engine):
    """keep_hidden: each sequence's final-normed hidden states of prompt + output, one per token (a
    sequence cut by max_tokens feeds its last token once more), the states the prompt's evaluation
    and then one-token decoding give that sequence alone (the same kernels row by row); the tokens
    are those of a batch without it."""
    import torch
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ids = [engine.encode_prompt(p, chat=False) for p in PROMPTS]
    plain = engine.generate_batch(ids, params)
    got = engine.generate_batch(ids, params, keep_hidden=True)
    assert all(c.hidden is None for c in plain)
    for i, c, ref in zip(ids, got, plain):
        assert c.tokens == ref.tokens
        seq = i + c.tokens
        assert c.hidden.shape == (len(seq), engine.model.cfg.d_model)
        cache = engine.model.make_cache(len(seq), "cpu")
        alone = [engine._evaluate(i, cache)] + [engine.model(torch.tensor([t]), cache) for t in c.tokens]
        assert torch.equal(c.hidden, torch.cat(alone).float())


def test_eos_ends_each_sequence_as_alone(engine):
    """EOS (made likely with a logit bias): a sequence that samples it ends there with "stop", its
    tokens and text exactly those it gets alone; the others go on."""
    import torch
    eos = min(engine.tokenizer.eos_ids)
    ids = [engine.encode_prompt(p, chat=False) for p in PROMPTS]
    # the bias that puts EOS one logit below the first prompt's top token (the tiny models' logits
    # differ in scale): likely at every step, rarely the first
    first = engine.model.logits(engine.model(torch.tensor(ids[0]), engine.model.make_cache(64)))[-1]
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=5, max_tokens=24,
                            logit_bias={eos: float(first.max() - first[eos]) - 1.0})
    got = engine.generate_batch(ids, params)
    for i, c in zip(ids, got):
        ref = _alone(engine, i, params)
        assert (c.tokens, c.text, c.finish_reason) == (ref.tokens, ref.text, ref.finish_reason)
        assert eos not in c.tokens
    assert any(c.finish_reason == "stop" and c.tokens for c in got)
