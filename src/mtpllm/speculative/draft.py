"""Draft-model proposer: a second, smaller model with the same vocabulary drafts k tokens."""
from __future__ import annotations

import torch

from ..errors import MtpllmError
from ..gguf.reader import GGUFFile
from ..models.base import load_model
from ..registry import resolve_model
from ..tokenizer import GGUFTokenizer
from ..runtime.engine import PREFILL_CHUNK
from ..runtime.sequence import run_steps
from .verifier import common_prefix, draft_chain, draft_token


def check_vocab_compatible(target_tok: GGUFTokenizer, draft_tok: GGUFTokenizer, name: str) -> None:
    if target_tok.vocab_size != draft_tok.vocab_size:
        raise MtpllmError(f"draft model {name}: vocabulary has {draft_tok.vocab_size} tokens, the target's "
                          f"{target_tok.vocab_size}; a draft model must share the target's tokenizer")
    for i, (a, b) in enumerate(zip(target_tok.tokens, draft_tok.tokens)):
        if a != b:
            raise MtpllmError(f"draft model {name}: vocabulary differs from the target's at id {i} "
                              f"({b!r} vs {a!r}); a draft model must share the target's tokenizer")


class DraftState:
    """One sequence's draft-model cache and the tokens whose K/V it holds."""

    def __init__(self, cache):
        self.cache = cache
        self.committed: list[int] = []

    def reset(self) -> None:
        self.cache.reset()
        self.committed = []


class DraftModelProposer:
    """The draft model's weights are shared by every sequence; each has a `DraftState` (`new_state`)."""

    def __init__(self, model, n_ctx: int, device="cpu"):
        self.model = model
        self.n_ctx = n_ctx
        self.device = device

    def new_state(self) -> DraftState:
        return DraftState(self.model.make_cache(self.n_ctx, self.device))

    @classmethod
    def load(cls, name_or_path: str, engine) -> "DraftModelProposer":
        path = resolve_model(name_or_path)
        g = GGUFFile(path)
        check_vocab_compatible(engine.tokenizer, GGUFTokenizer(g.metadata, g.arch), str(name_or_path))
        model = load_model(path, "f32" if engine.model.lm_head.kind == "f32" else "fast", gguf_file=g)
        if engine.device != "cpu":
            model.to(engine.device)
        return cls(model, engine.n_ctx, engine.device)

    def reusable_prefix(self, st: DraftState, prompt: list[int]) -> int:
        return len(prompt)  # keeps its own cache consistent in `_sync`

    def _sync(self, st: DraftState, tokens: list[int]) -> torch.Tensor | None:
        """Make the draft cache hold exactly `tokens`; return the hidden state of the last one."""
        return run_steps(self._sync_steps(st, tokens, PREFILL_CHUNK))

    def _sync_steps(self, st: DraftState, tokens: list[int], chunk: int):
        """`_sync` one forward of at most `chunk` tokens at a time: yields each forward's size
        before running it (see `Engine.prefill_steps`)."""
        cache = st.cache
        common = min(common_prefix(st.committed, tokens), len(tokens) - 1)
        if cache.length - common > cache.max_trim():
            common = 0
        cache.trim(cache.length - common)
        st.committed = list(tokens[:common])
        todo = torch.tensor(tokens[common:], dtype=torch.long, device=self.device)
        h = None
        for s in range(0, todo.shape[0], chunk):
            yield min(chunk, todo.shape[0] - s)
            h = self.model(todo[s:s + chunk], cache)
            st.committed = list(tokens[:common + s + chunk])  # what the cache holds, if stopped here
        st.committed = list(tokens)
        return h[-1:]

    def begin(self, st: DraftState, prompt, prompt_hidden, start) -> None:
        run_steps(self.begin_steps(st, prompt, prompt_hidden, start))

    def begin_steps(self, st: DraftState, prompt, prompt_hidden, start, chunk: int = PREFILL_CHUNK):
        """The draft model's prefill of the prompt (it counts as prompt time), `chunk` tokens per
        forward, as a generator of steps: the scheduler interleaves them with other sequences'
        decoding."""
        yield from self._sync_steps(st, list(prompt), chunk)

    def propose(self, st: DraftState, history: list[int], k: int, sampler, p_min: float = 0.0, p_cum: float = 0.0,
                keep=None):
        k = min(k, st.cache.max_len - len(history))
        if k <= 0:
            return [], []
        h = self._sync(st, history)
        base = st.cache.length

        def next_draft(hist, cut):
            return draft_token(self.model.logits(h)[0], sampler, hist, cut)

        def advance(d):
            nonlocal h
            h = self.model(torch.tensor([d], device=self.device), st.cache)

        drafts, qs = draft_chain(k, next_draft, advance, history, p_min, p_cum, keep)
        st.cache.trim(st.cache.length - base)  # keep only true tokens
        return drafts, qs

    @torch.inference_mode()
    def probe_ms(self, st: DraftState, hidden, token: int) -> float | None:
        """Milliseconds of drafting one token (a forward of the draft model and its logits), rolled back."""
        cache = st.cache
        if cache.length + 1 > cache.max_len:
            return None
        import time
        t0 = time.perf_counter()
        self.model.logits(self.model(torch.tensor([token], device=self.device), cache))
        ms = (time.perf_counter() - t0) * 1e3
        if cache.max_trim() < 1:
            cache.reset()
            st.committed = []
        else:
            cache.trim(1)
        return ms

    def accept(self, st: DraftState, history, n_accepted, target_hidden) -> None:
        pass  # the next `propose` syncs to the new history
