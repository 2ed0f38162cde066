"""Draft-model proposer: a second, smaller model with the same vocabulary drafts k tokens."""
from __future__ import annotations

import torch

from ..errors import MtpllmError
from ..gguf.reader import GGUFFile
from ..models.base import load_model
from ..registry import resolve_model
from ..tokenizer import GGUFTokenizer
from .verifier import draft_token


def check_vocab_compatible(target_tok: GGUFTokenizer, draft_tok: GGUFTokenizer, name: str) -> None:
    if target_tok.vocab_size != draft_tok.vocab_size:
        raise MtpllmError(f"draft model {name}: vocabulary has {draft_tok.vocab_size} tokens, the target's "
                          f"{target_tok.vocab_size}; a draft model must share the target's tokenizer")
    for i, (a, b) in enumerate(zip(target_tok.tokens, draft_tok.tokens)):
        if a != b:
            raise MtpllmError(f"draft model {name}: vocabulary differs from the target's at id {i} "
                              f"({b!r} vs {a!r}); a draft model must share the target's tokenizer")


class DraftModelProposer:
    def __init__(self, model, n_ctx: int, device="cpu"):
        self.model = model
        self.cache = model.make_cache(n_ctx, device)
        self.device = device
        self.committed: list[int] = []  # tokens whose K/V are in the draft cache

    @classmethod
    def load(cls, name_or_path: str, engine) -> "DraftModelProposer":
        path = resolve_model(name_or_path)
        g = GGUFFile(path)
        check_vocab_compatible(engine.tokenizer, GGUFTokenizer(g.metadata, g.arch), str(name_or_path))
        model = load_model(path, "f32" if engine.model.lm_head.kind == "f32" else "fast", gguf_file=g)
        if engine.device != "cpu":
            model.to(engine.device)
        return cls(model, engine.n_ctx, engine.device)

    def reusable_prefix(self, prompt: list[int]) -> int:
        return len(prompt)  # keeps its own cache consistent in `_sync`

    def reset(self) -> None:
        """Forget the draft model's cached prefix (a benchmark repeat must not reuse it)."""
        self.cache.reset()
        self.committed = []

    def _sync(self, tokens: list[int]) -> torch.Tensor | None:
        """Make the draft cache hold exactly `tokens`; return the hidden state of the last one."""
        common = 0
        for a, b in zip(self.committed, tokens):
            if a != b:
                break
            common += 1
        common = min(common, len(tokens) - 1)
        self.cache.trim(self.cache.length - common)
        self.committed = list(tokens[:common])
        todo = torch.tensor(tokens[common:], dtype=torch.long, device=self.device)
        h = None
        for s in range(0, todo.shape[0], 512):
            h = self.model(todo[s:s + 512], self.cache)
        self.committed = list(tokens)
        return h[-1:]

    def begin(self, engine, prompt, prompt_hidden, start) -> None:
        self._sync(list(prompt))  # draft prefill counts as prompt time

    def propose(self, history: list[int], k: int, sampler, p_min: float = 0.0, p_cum: float = 0.0):
        k = min(k, self.cache.max_len - len(history))
        if k <= 0:
            return [], []
        h = self._sync(history)
        base = self.cache.length
        drafts, qs = [], []
        hist = list(history)
        cum = 1.0
        for i in range(k):
            d, q, top = draft_token(self.model.logits(h)[0], sampler, hist, max(p_min, p_cum))
            cum *= top
            if top < p_min or cum < p_cum:
                break
            drafts.append(d)
            qs.append(q)
            hist.append(d)
            if i + 1 < k:
                h = self.model(torch.tensor([d], device=self.device), self.cache)
        self.cache.trim(self.cache.length - base)  # keep only true tokens
        return drafts, qs

    def accept(self, history, n_accepted, target_hidden) -> None:
        pass  # the next `propose` syncs to the new history
