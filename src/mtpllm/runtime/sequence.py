"""Per-sequence state: everything one generation owns, so that many can run side by side.

  Slot       what survives between requests on one lane of the engine: the target model's cache,
             the tokens whose states it holds (a later prompt that starts with them reuses them),
             and each proposer's per-sequence draft state (an MTP head's own cache, a draft model's
             cache). The engine has one for single-stream use; the scheduler has one per `-np` lane.
  Sequence   one request on a slot: prompt, sampling parameters and samplers, history, the decoder
             (plain or speculative) and its draft state, speculative statistics, output text.
  OutputText detokenization (incremental: only a short tail is decoded per token), EOS, stop strings,
             max tokens: turns emitted token blocks into `Response` pieces.

Decoders split a step into `plan` (the rows to feed: the last token, plus drafts) and `commit`
(what the target's hidden states of those rows emit), so one driver can run a sequence alone
(`Engine.stream`) and another can put the rows of many sequences through one forward (`Scheduler`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import SamplingParams, Sampler, make_sampler


@dataclass
class Timings:
    load_ms: float = 0.0
    prompt_n: int = 0  # prompt tokens actually evaluated (after prefix-cache reuse)
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    cached_n: int = 0  # prompt tokens reused from the cache

    @property
    def prompt_per_second(self) -> float:
        return self.prompt_n / (self.prompt_ms / 1e3) if self.prompt_ms > 0 else 0.0

    @property
    def predicted_per_second(self) -> float:
        return self.predicted_n / (self.predicted_ms / 1e3) if self.predicted_ms > 0 else 0.0

    def to_dict(self) -> dict:
        return {"prompt_n": self.prompt_n, "prompt_ms": self.prompt_ms,
                "prompt_per_second": self.prompt_per_second, "predicted_n": self.predicted_n,
                "predicted_ms": self.predicted_ms, "predicted_per_second": self.predicted_per_second,
                "cache_n": self.cached_n}


@dataclass
class Response:
    """One emitted token (text may be '' while bytes of a character or a possible stop string are held)."""
    token: int | None
    text: str
    finish_reason: str | None = None  # None while running; "stop" | "length" | "context" | "cancelled"
    timings: Timings | None = None
    stats: object | None = None  # speculative statistics (SpecStats) when speculation is on
    draft: bool = False  # the token is an accepted draft token (else the target model produced it)
    # with SamplingParams.logprobs: the token's log-probability under the target model, and the
    # most likely tokens with theirs [(id, logprob), ...]
    logprob: float | None = None
    top_logprobs: list | None = None


class Block(list):
    """The tokens one step emits: its `accepted` draft tokens first (0 for plain decoding), then
    the target's own; `logprobs[i]` = (logprob, [(id, logprob), ...]) of token i when asked for."""

    def __init__(self, tokens: list[int], accepted: int = 0, logprobs: list | None = None):
        super().__init__(tokens)
        self.accepted = accepted
        self.logprobs = logprobs


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list:
    """logits [n, V] of the rows that emitted tokens[i] -> [(logprob, [(id, logprob) x top])] per row."""
    lp = torch.log_softmax(logits[:len(tokens)].float(), -1)
    out = []
    for i, t in enumerate(tokens):
        alts = []
        if top > 0:
            v, ix = lp[i].topk(top)
            alts = list(zip(ix.tolist(), v.tolist()))
        out.append((float(lp[i, t]), alts))
    return out


def run_steps(gen):
    """Run a generator of steps (`Engine.prefill_steps`, a decoder's `start_steps`) to its end: its return value."""
    try:
        while True:
            next(gen)
    except StopIteration as stop:
        return stop.value


class Slot:
    """One lane's cache and draft states, kept between requests for prefix reuse."""

    def __init__(self, cache, index: int = 0):
        self.cache = cache
        self.index = index
        self.tokens: list[int] = []  # tokens whose states are in `cache`, in order
        self.drafts: dict = {}  # proposer -> its per-sequence draft state on this slot
        self.prefix = None  # a PrefixSnapshot (runtime/prefix.py) of a cache that cannot trim far back
        self.last_used = 0  # when a request last released it (the scheduler's counter; 0: empty), oldest taken first

    def draft_state(self, proposer):
        if proposer not in self.drafts:
            self.drafts[proposer] = proposer.new_state()
        return self.drafts[proposer]

    def reset(self) -> None:
        """Forget the cached prefix (target and drafts): the next request evaluates its whole prompt."""
        self.cache.reset()
        self.tokens = []
        self.prefix = None
        self.last_used = 0  # empty: a scheduler takes it before any slot holding a conversation
        for st in self.drafts.values():
            if hasattr(st, "reset"):
                st.reset()


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Sequence:
    """One generation on a slot. `decoder` is a `PlainDecoder` or a `SpeculativeDecoder`."""

    def __init__(self, prompt: list[int], params: SamplingParams, slot: Slot, decoder, device="cpu"):
        self.prompt = list(prompt)
        self.params = params
        self.slot = slot
        self.decoder = decoder
        self.sampler = make_sampler(params, device)
        self.history = list(prompt)  # prompt + emitted tokens
        self.x0: int | None = None  # the last emitted token: not in the cache yet
        self.cached_n = 0  # prompt tokens reused from the slot's cache
        self.prompt_hidden: torch.Tensor | None = None  # hidden states of the evaluated prompt positions
        self.draft = decoder.new_state(self)  # per-sequence draft state (None for plain decoding)
        self.stats = decoder.new_stats()
        self.k = getattr(getattr(decoder, "cfg", None), "num_speculative_tokens", 0)  # current draft length
        self.pending: tuple[list[int], list] = ([], [])  # this step's drafts and their distributions
        self.costs = None  # the cost policy's `Costs` at this sequence's depth (speculative/policy.py)
        self.policy = None  # the cost policy's record of this sequence's acceptance
        self.step_draft_ms = 0.0  # drafting time of the step being planned
        self.draft_carry_ms = 0.0  # drafting time not yet priced (steps whose drafts were all refused)
        self.draft_sampler = None
        if getattr(decoder, "speculative", False):
            self.draft_sampler = Sampler(params, device)
            if params.seed is not None:  # drafts use their own stream, so the target's matches plain decoding
                self.draft_sampler.gen.manual_seed(int(params.seed) ^ 0x5EED)

    def block(self, tokens: list[int], accepted: int, logits: torch.Tensor) -> Block:
        """A step's emitted tokens; logits [>= len(tokens), V]: the target rows that chose them."""
        n = self.params.logprobs
        return Block(tokens, accepted, None if n is None else token_logprobs(logits, tokens, n))


class PlainDecoder:
    """One token per step."""
    speculative = False

    def new_state(self, seq: Sequence):
        return None

    def new_stats(self):
        return None

    def start(self, engine, seq: Sequence) -> Block:
        """Prefill and sample the first token: its Block."""
        return run_steps(self.start_steps(engine, seq))

    def start_steps(self, engine, seq: Sequence):
        """`start` one prefill forward at a time (see `Engine.prefill_steps`); returns its Block."""
        hidden = yield from engine.prefill_steps(seq)
        logits = engine.model.logits(hidden)
        seq.x0 = seq.sampler.sample(logits[0], seq.history)
        seq.history.append(seq.x0)
        return seq.block([seq.x0], 0, logits)

    def plan(self, seq: Sequence, engine=None, batch: int = 1) -> list[int] | None:
        cache = seq.slot.cache
        if cache.length + 2 > cache.max_len:  # feeding x0 and sampling one more would pass n_ctx
            return None
        return [seq.x0]

    def commit(self, engine, seq: Sequence, hidden: torch.Tensor, forward_ms: float = 0.0,
               logits: torch.Tensor | None = None) -> Block:
        """`logits`: of these rows, when the caller computed them with other sequences' (the scheduler)."""
        seq.slot.tokens.append(seq.x0)
        logits = engine.model.logits(hidden[-1:]) if logits is None else logits[-1:]
        tok = seq.sampler.sample(logits[0], seq.history)
        seq.history.append(tok)
        seq.x0 = tok
        return seq.block([tok], 0, logits)


class OutputText:
    """Emitted tokens -> text pieces, with EOS, stop strings and max tokens.

    Detokenization is incremental (as vLLM's): each token decodes only the few tokens since the
    last complete piece, with a short prefix of earlier tokens as context, so a long answer costs
    the same per token as a short one (decoding the whole output per token is quadratic)."""
    CONTEXT = 6  # tokens of left context: enough for a tokenizer's leading-space and byte rules

    def __init__(self, tokenizer, params: SamplingParams):
        self.tok = tokenizer
        self.params = params
        self.eos = set() if params.ignore_eos else tokenizer.eos_ids
        self.stops = params.stop
        self.hold = max((len(s) for s in self.stops), default=1) - 1  # chars that might start a stop string
        self.generated: list[int] = []
        self.text = ""
        self.emitted = 0  # characters of text already yielded
        self.prefix, self.read = 0, 0  # token offsets: decoded context start, end of complete text
        self.finish: str | None = "length" if params.max_tokens == 0 else None

    def _append_text(self) -> None:
        ids = self.generated
        before = self.tok.decode(ids[self.prefix:self.read], skip_special=True)
        now = self.tok.decode(ids[self.prefix:], skip_special=True)
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.text += now[len(before):]
            self.prefix, self.read = max(0, len(ids) - self.CONTEXT), len(ids)

    def pending_text(self) -> str:
        """Text of tokens whose characters are still incomplete (decoded as they are)."""
        ids = self.generated
        before = self.tok.decode(ids[self.prefix:self.read], skip_special=True)
        return self.tok.decode(ids[self.prefix:], skip_special=True)[len(before):]

    def add(self, block: list[int]):
        """Yields (token, piece, finish_reason, index in the block) per token of an emitted block,
        stopping at the first that finishes the sequence."""
        for i, t in enumerate(block):
            if t in self.eos:
                self.finish = "stop"
                return
            self.generated.append(t)
            self._append_text()
            text = self.text
            incomplete = self.read < len(self.generated)
            end = len(text)
            cut = first_stop(text, self.stops, max(0, self.emitted - self.hold))
            finish = None
            if cut is not None:
                end, finish = cut, "stop"
            if finish is None and len(self.generated) >= self.params.max_tokens:
                finish = "length"
            if finish is None:
                end -= self.hold  # might be the start of a stop string
            elif finish == "length" and incomplete:
                text = self.text = text + self.pending_text()
                end = len(text)
            piece = text[self.emitted:end] if end > self.emitted else ""
            self.emitted = max(self.emitted, end)
            self.finish = finish
            yield t, piece, finish, i
            if finish is not None:
                return

    def response(self, block, i: int, t: int, piece: str, finish, timings, stats) -> Response:
        """The Response of token i of `block` (draft marking and log-probabilities from the block)."""
        lps = getattr(block, "logprobs", None)
        lp, top = lps[i] if lps else (None, None)
        return Response(t, piece, finish, timings, stats, i < getattr(block, "accepted", 0), lp, top)

    def flush(self) -> str:
        """At EOS or a full context: the text held back for stop-string matching (and any
        incomplete character, decoded as it is)."""
        if self.read < len(self.generated):
            self.text += self.pending_text()
            self.read = len(self.generated)
        piece = self.text[self.emitted:]
        self.emitted = len(self.text)
        return piece


def first_stop(text: str, stops: list[str], start: int = 0) -> int | None:
    """Where the earliest stop string begins in text[start:] (as an index into text), or None."""
    found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(found) if found else None
