"""Prompt-prefix reuse on a hybrid model: the recurrent state cannot be trimmed back, so the engine
keeps a copy of it at the end of each prompt (runtime/prefix.py). A later request that starts with
that prompt (sent again, or a chat turn whose earlier answer differs from what was generated)
restores it and evaluates only the rest, with exactly the state a fresh evaluation leaves."""
import pytest
import torch

from mtpllm.runtime.engine import Engine
from mtpllm.runtime.sampling import SamplingParams
from mtpllm.speculative import SpecConfig
from tiny import make_tiny

tiny_hybrid = pytest.importorskip("tiny_hybrid")
pytest.importorskip("transformers")

# 40 tokens: more than the recurrent cache's per-row window (32), so the prompt takes the chunked form
P = [(7 * i + 3) % 256 for i in range(40)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d, _ = tiny_hybrid.make_tiny_hf(tmp_path_factory.mktemp("prefix") / "qwen35", "qwen35", echo=0.1)
    return d


def _engine(src):
    return Engine.load(str(src), n_ctx=128)


def _prefill(eng, prompt, speculative=None):
    """The prompt's last logits through the engine's prefix reuse -> (logits [1, V], tokens reused)."""
    seq = eng.new_sequence(prompt, GREEDY, speculative)
    return eng.model.logits(eng.prefill(seq)), seq.cached_n


def _segments(m, *parts):
    """Logits of the last token after feeding `parts` one forward each into a fresh cache."""
    cache = m.make_cache(128)
    for p in parts:
        h = m(torch.tensor(p), cache)
    return m.logits(h[-1:])


def test_the_same_prompt_again_reuses_its_prefix(model_dir):
    eng = _engine(model_dir)
    first = eng.generate(prompt_ids=P, params=GREEDY)
    again = eng.generate(prompt_ids=P, params=GREEDY)
    # the cache held P and 11 generated tokens: the recurrent state cannot go back 12 positions,
    # the copy at the end of the prompt can
    assert again.timings.cached_n == len(P) - 1 and again.timings.prompt_n == 1
    assert again.tokens == first.tokens
    got, n = _prefill(eng, P)
    fresh, n0 = _prefill(_engine(model_dir), P)
    assert n == len(P) - 1 and n0 == 0
    assert torch.equal(got, fresh)  # the same computation: bit for bit


def test_a_longer_prompt_restarts_from_the_snapshot(model_dir):
    """A chat turn: the earlier prompt, an answer other than the one generated, a new message."""
    eng = _engine(model_dir)
    eng.generate(prompt_ids=P, params=GREEDY)
    P2 = P + [11, 12, 13, 200, 201, 5, 6]
    got, n = _prefill(eng, P2)
    assert n == len(P) - 1
    # exactly the state evaluation leaves when fed in the same pieces ...
    assert torch.equal(got, _segments(eng.model, P[:-1], P2[len(P) - 1:-1], P2[-1:]))
    # ... and a fresh run of the whole prompt up to summation order (other chunk boundaries; the
    # tolerance of test_qwen35)
    fresh, _ = _prefill(_engine(model_dir), P2)
    assert (got - fresh).abs().max() < 1e-4


def test_reuse_with_speculation_keeps_greedy_identity(model_dir):
    eng = _engine(model_dir)
    ref = _engine(model_dir).generate(prompt_ids=P, params=GREEDY).tokens
    spec = SpecConfig("mtp", 3, policy="fixed").build(eng)
    assert eng.generate(prompt_ids=P, params=GREEDY, speculative=spec).tokens == ref
    out = eng.generate(prompt_ids=P, params=GREEDY, speculative=spec)
    assert out.timings.cached_n == len(P) - 1 and out.tokens == ref


def test_no_reuse_when_the_prompt_differs_before_the_snapshot(model_dir):
    eng = _engine(model_dir)
    eng.generate(prompt_ids=P, params=GREEDY)
    P3 = P[:10] + [9] * 30
    got, n = _prefill(eng, P3)
    assert n == 0
    assert torch.equal(got, _prefill(_engine(model_dir), P3)[0])
    # and after a reset the slot holds nothing to reuse
    eng.generate(prompt_ids=P, params=GREEDY)
    eng.reset()
    assert _prefill(eng, P)[1] == 0


def test_dense_models_keep_no_snapshot(tmp_path):
    """A KV cache trims back to any position: no copy is made."""
    eng = Engine.load(str(make_tiny(tmp_path / "d.gguf", "qwen2")), n_ctx=128)
    eng.generate(prompt_ids=P, params=GREEDY)
    assert eng.slot.prefix is None
    assert eng.generate(prompt_ids=P, params=GREEDY).timings.cached_n == len(P) - 1
