"""The sampler: its transforms (top-k, top-p, min-p, temperature) computed on the few tokens they
keep agree with the same transforms over the whole vocabulary, and its draw follows the
distribution it is given."""
import numpy as np
import pytest
import torch

from mtpllm.errors import MtpllmError
from mtpllm.runtime.sampling import Sampler, SamplingParams, make_sampler

V = 5000


def _logits(seed: int, spread: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, generator=g) * spread


CASES = [
    dict(),  # the defaults: top-k 40, top-p 0.95, min-p 0.05, temperature 0.8
    dict(top_k=5, top_p=1.0, min_p=0.0, temperature=1.3),
    dict(top_k=0, top_p=0.9, min_p=0.0),  # nucleus among the first NUCLEUS_TRY
    dict(top_k=0, top_p=0.999, min_p=0.1),
    dict(top_k=0, top_p=1.0, min_p=0.2),
    dict(top_k=200, top_p=0.5, min_p=0.0, temperature=0.3),
]


@pytest.mark.parametrize("params", CASES)
@pytest.mark.parametrize("spread", [0.5, 3.0, 8.0])  # flat (wide nucleus) to peaked
def test_candidates_give_the_whole_vocabularys_distribution(params, spread):
    s = Sampler(SamplingParams(**params))
    # where the candidates' path must run: top-k, or a nucleus that peaked logits keep narrow
    fast = params.get("top_k", 40) > 0 or (params.get("top_p", 0.95) < 1.0 and spread >= 8.0)
    for seed in range(4):
        x = _logits(seed, spread)
        assert s._candidates(x) is not None or not fast
        got, want = s.probs(x), s._full(x)
        assert torch.equal(got > 0, want > 0)  # the same tokens kept
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)


def test_ties_and_banned_tokens_take_the_whole_vocabulary():
    """Logits tied with the k-th are all kept (as llama.cpp's top-k by value); fewer finite logits
    than k (a logit bias of -inf, a draft vocabulary) keep them all."""
    x = _logits(1, 3.0)
    kth = torch.topk(x, 10).values[-1]
    x[torch.topk(x, 12).indices[10:]] = kth  # two more tokens tied with the 10th
    s = Sampler(SamplingParams(top_k=10, top_p=1.0, min_p=0.0))
    assert s._candidates(x) is None and int((s.probs(x) > 0).sum()) == 12
    few = torch.full((V,), float("-inf"))
    few[[3, 9, 27]] = torch.tensor([1.0, 2.0, 0.5])
    p = s.probs(few)
    assert s._candidates(few) is None and torch.equal(torch.nonzero(p).flatten(), torch.tensor([3, 9, 27]))
    # a nucleus wider than NUCLEUS_TRY tokens: sorted over the whole vocabulary
    flat = Sampler(SamplingParams(top_k=0, top_p=0.95, min_p=0.0))
    assert flat._candidates(torch.zeros(V)) is None and int((flat.probs(torch.zeros(V)) > 0).sum()) == 4750


def test_draws_follow_the_distribution_and_never_a_zero():
    from scipy.stats import chisquare
    p = torch.tensor([0.0, 0.45, 0.0, 0.25, 0.15, 0.10, 0.05, 0.0])
    s = make_sampler(SamplingParams(temperature=1.0, seed=3))
    n = 20000
    counts = np.bincount([s.sample_from(p) for _ in range(n)], minlength=len(p))
    assert counts[p.numpy() == 0].sum() == 0
    keep = p.numpy() > 0
    assert chisquare(counts[keep], n * p.numpy()[keep]).pvalue > 1e-3
    # unnormalized weights are a distribution too (the residual max(0, p - q) before its division)
    assert 0 < s.sample_from(p * 7.0) < len(p)
    # a seed reproduces the draws
    a, b = (make_sampler(SamplingParams(temperature=1.0, seed=9)) for _ in range(2))
    assert [a.sample_from(p) for _ in range(50)] == [b.sample_from(p) for _ in range(50)]


@pytest.mark.parametrize("bad", [[0.0, 0.0, 0.0], [0.5, float("nan"), 0.5], [0.5, -0.1, 0.6], [float("inf"), 0.0, 1.0]])
def test_draws_refuse_what_is_not_a_distribution(bad):
    with pytest.raises(MtpllmError, match="cannot sample"):
        make_sampler(SamplingParams(temperature=1.0, seed=1)).sample_from(torch.tensor(bad))


def test_sampler_factory():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    assert make_sampler(SamplingParams(temperature=0)).sample(logits) == 1
    p = make_sampler(SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0)).probs(logits)
    assert p[0] == 0 and p[2] == 0 and abs(float(p.sum()) - 1) < 1e-6
    p = make_sampler(SamplingParams(temperature=1.0, top_k=0, top_p=0.5, min_p=0.0)).probs(logits)
    assert p[1] == 1.0  # token 1 alone holds > 50%
    p = make_sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.3)).probs(logits)
    assert p[0] == 0 and p[2] == 0 and p[3] > 0  # e^-1 = 0.37 >= 0.3, e^-2 < 0.3
    pen = make_sampler(SamplingParams(temperature=0, repetition_penalty=10.0)).sample(logits, history=[1])
    assert pen == 3
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_k=-1), dict(min_p=2), dict(max_tokens=-1)):
        with pytest.raises(MtpllmError):
            SamplingParams(**bad)
