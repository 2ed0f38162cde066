"""Sampling: parameters (validated dataclass) and a factory for samplers.

A sampler turns logits into the distribution it samples from (`probs`) so that speculative
verification can use exactly the same transforms for p and q. Temperature 0 means argmax.
Order of transforms (as in llama.cpp's default chain): logit bias -> penalties -> top-k -> top-p -> min-p ->
temperature. A logit bias (OpenAI's `logit_bias`: token id -> value added to its logit, -inf to ban it)
counts as a penalty for the fast paths: with one, greedy decoding and speculative verification go
through `probs`, so the target and the draft distributions both carry it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import MtpllmError
from .kernels import argmax


@dataclass
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40  # 0 = off
    top_p: float = 0.95  # 1.0 = off
    min_p: float = 0.05  # 0.0 = off
    repetition_penalty: float = 1.0  # 1.0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64  # how many recent tokens the penalties look at
    seed: int | None = None
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # log-probabilities of each emitted token and of the `logprobs` most likely alternatives, from the
    # target model's own distribution (log-softmax of its logits, before the sampling transforms);
    # None = not computed
    logprobs: int | None = None

    MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit

    def __post_init__(self):
        def bad(msg):
            raise MtpllmError(f"invalid sampling parameter: {msg}")
        if not (self.temperature >= 0):
            bad(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad(f"top_k must be an integer >= 0, got {self.top_k}")
        if not (0 < self.top_p <= 1):
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0 <= self.min_p <= 1):
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not (self.repetition_penalty > 0):
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            bad(f"max_tokens must be an integer >= 0, got {self.max_tokens}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not all(isinstance(s, str) for s in self.stop):
            bad("stop must be a list of strings")
        self.stop = [s for s in self.stop if s]
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= self.MAX_LOGPROBS):
            bad(f"logprobs must be an integer in 0..{self.MAX_LOGPROBS}, got {self.logprobs!r}")
        if not isinstance(self.logit_bias, dict):
            bad("logit_bias must be a mapping of token id -> bias")
        for t, b in self.logit_bias.items():
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                bad(f"logit_bias: token ids must be integers >= 0, got {t!r}")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or b != b or b == float("inf"):
                bad(f"logit_bias: the bias of token {t} must be a number (or -inf), got {b!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias))


class Sampler:
    """Built by `make_sampler(params)`. Holds the RNG so a seed reproduces a whole generation."""

    def __init__(self, params: SamplingParams, device="cpu"):
        self.p = params
        self.gen = torch.Generator(device=device)
        if params.seed is not None:
            self.gen.manual_seed(int(params.seed))
        else:
            self.gen.seed()
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, values), built on first use

    def apply_bias(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] plus the logit bias (ids outside the vocabulary are ignored, as in llama.cpp)."""
        if not self.p.logit_bias:
            return logits
        if self._bias is None or self._bias[0].device != logits.device:
            items = [(t, float(b)) for t, b in self.p.logit_bias.items() if t < logits.shape[-1]]
            ids = torch.tensor([t for t, _ in items], dtype=torch.long, device=logits.device)
            self._bias = (ids, torch.tensor([b for _, b in items], dtype=logits.dtype, device=logits.device))
        ids, vals = self._bias
        return logits.index_add(0, ids, vals.to(logits.dtype))

    def apply_penalties(self, logits: torch.Tensor, history: list[int]) -> torch.Tensor:
        """logits [V]; history = token ids so far (prompt + generated)."""
        p = self.p
        logits = self.apply_bias(logits)
        if not history or not (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
                               or p.frequency_penalty != 0.0):
            return logits
        recent = history[-p.penalty_last_n:] if p.penalty_last_n > 0 else history
        ids, counts = torch.unique(torch.tensor(recent, device=logits.device), return_counts=True)
        logits = logits.clone()
        sel = logits[ids]
        if p.repetition_penalty != 1.0:
            sel = torch.where(sel > 0, sel / p.repetition_penalty, sel * p.repetition_penalty)
        sel = sel - counts.to(sel.dtype) * p.frequency_penalty - p.presence_penalty
        logits[ids] = sel
        return logits

    # without top-k, the nucleus (top-p) is first looked for among this many of the most likely tokens
    NUCLEUS_TRY = 1024

    def probs(self, logits: torch.Tensor, history: list[int] | None = None) -> torch.Tensor:
        """The distribution this sampler draws from, for logits [V] -> probs [V] (one-hot when greedy).

        The transforms run on the few tokens top-k (or a nucleus found among the NUCLEUS_TRY most
        likely) leaves, not on the whole vocabulary: sorting 151,936 logits for top-p took ~2 ms a
        token, as long as a tenth of the 1.5B's decoding step. Where the candidates do not settle
        it (logits tied with the k-th, a nucleus wider than the try), every logit is sorted as
        before (`_full`). Either way the same transforms on the same logits: they differ only in
        float rounding and, for logits tied exactly at the top-p boundary, in which of them the
        sort puts first."""
        logits = self.apply_penalties(logits.float(), history or [])
        if self.p.greedy:
            out = torch.zeros_like(logits)
            out[argmax(logits)] = 1.0
            return out
        got = self._candidates(logits)
        if got is None:
            return self._full(logits)
        vals, ids = got
        out = torch.zeros_like(logits)
        return out.index_copy_(0, ids, self._finish(vals))

    def _candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The logits top-k and top-p keep, most likely first (the others -inf), with their token
        ids; None where a sort of the whole vocabulary has to decide."""
        p, n = self.p, logits.shape[-1]
        if p.top_k and p.top_k < n:
            vals, ids = torch.topk(logits, p.top_k)
            kth = vals[-1]
            if not bool(torch.isfinite(kth)) or int((logits >= kth).sum()) > p.top_k:
                return None  # ties with the k-th logit (all are kept), or fewer finite logits than k
            if p.top_p < 1.0:
                vals = _nucleus(vals, torch.softmax(vals, -1), p.top_p)
            return vals, ids
        if p.top_p < 1.0 and n > self.NUCLEUS_TRY:
            vals, ids = torch.topk(logits, self.NUCLEUS_TRY)
            pr = torch.exp(vals - torch.logsumexp(logits, -1))  # shares of the whole vocabulary
            if not bool(torch.isfinite(vals[0])) or float(pr.sum()) < p.top_p:
                return None
            return _nucleus(vals, pr, p.top_p), ids
        return None

    def _finish(self, logits: torch.Tensor) -> torch.Tensor:
        """min-p and the temperature on logits that top-k / top-p left -> probabilities."""
        p = self.p
        if p.min_p > 0:
            pr = torch.softmax(logits, -1)
            logits = logits.masked_fill(pr < p.min_p * pr.max(), float("-inf"))
        # shifted by the maximum before the division, and the temperature at least float32's smallest
        # normal number: a tiny one (1e-38, 5e-324) sends every logit below the maximum to -inf (a
        # one-hot) instead of overflowing all of them to inf or dividing by a zero (NaN probabilities)
        t = max(p.temperature, torch.finfo(torch.float32).tiny)
        return torch.softmax((logits - logits.max()) / t, -1)

    def _full(self, logits: torch.Tensor) -> torch.Tensor:
        """`probs` over the whole vocabulary (the reference the candidates' path agrees with)."""
        p = self.p
        if p.top_k and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, idx = torch.sort(logits, descending=True)
            logits = logits.scatter(0, idx, _nucleus(sorted_logits, torch.softmax(sorted_logits, -1), p.top_p))
        return self._finish(logits)

    def sample_from(self, probs: torch.Tensor) -> int:
        """A token drawn from probs [V] (not necessarily normalized) by inverting its cumulative sum
        at one uniform number: `torch.multinomial` draws one exponential number per token (~3 ms
        over 151,936 tokens, per sampled token). Never a token of probability 0: the sum rises
        strictly at the token it returns."""
        if self.p.greedy:
            return argmax(probs)
        cdf = probs.double().cumsum(0)
        total = float(cdf[-1])
        if not (total > 0 and total < float("inf")) or bool((probs < 0).any()):
            raise MtpllmError("cannot sample: the probabilities are not finite, non-negative and summing above 0")
        u = float(torch.rand((), dtype=torch.float64, generator=self.gen, device=self.gen.device)) * total
        i = int(torch.searchsorted(cdf, torch.full((1,), u, dtype=torch.float64, device=cdf.device), right=True))
        if i >= probs.shape[0]:  # u rounded up to the total: the last token that has a probability
            i = int(torch.nonzero(probs).max())
        return i

    def sample(self, logits: torch.Tensor, history: list[int] | None = None) -> int:
        if self.p.greedy and not self.p.uses_penalties:
            return argmax(logits)
        return self.sample_from(self.probs(logits, history))


def _nucleus(sorted_logits: torch.Tensor, pr: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p on logits sorted most likely first, pr their probabilities: the smallest prefix whose
    probability reaches top_p is kept, the rest set to -inf."""
    drop = pr.cumsum(-1) - pr >= top_p
    return sorted_logits.masked_fill(drop, float("-inf"))


def make_sampler(params: SamplingParams, device="cpu") -> Sampler:
    return Sampler(params, device)
