"""The engine: one loaded model + tokenizer, and generation in layers.

  step generator  (`_steps`: a `Sequence`'s decoder plans rows, the model runs them, the decoder
                   commits: lists of new token ids; plain decoding yields one per step,
                   speculative decoding yields each verified block)
  -> stream       (`Engine.stream`: EOS / stop strings / max tokens / detokenization / timings,
                   yields `Response` objects)
  -> generate     (`Engine.generate`: collects a stream into a `Completion`)

CLI, server and benchmark all consume `stream` (or the `Scheduler`, which runs many sequences
through the same decoders with one forward per step); none re-implements decoding. All request
state lives in the `Sequence` (runtime/sequence.py); the engine holds the weights, the tokenizer
and one `Slot` (cache + draft states) for single-stream use.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from ..errors import MtpllmError
from ..models.hf import open_model_file
from ..models.base import Transformer, load_model
from ..registry import resolve_model
from ..tokenizer import GGUFTokenizer
from .prefix import PrefixSnapshot, untrimmable_parts
from .sampling import SamplingParams, make_sampler
from .sequence import OutputText, PlainDecoder, Response, Sequence, Slot, Timings, common_prefix, run_steps

__all__ = ["Engine", "Completion", "Response", "Timings", "resolve_device", "check_kv_memory"]

PREFILL_CHUNK = 512  # tokens per prefill forward: bounds the [T, L] attention mask and activations


def chunk_bounds(start: int, end: int, chunk: int) -> list[tuple[int, int]]:
    """The forwards that evaluate prompt positions [start, end): `chunk` tokens at a time, and the
    last token always alone, through the one-token decoding kernels (a later request that reuses
    this prefix recomputes just that token, and gets the same bits)."""
    out = [(a, min(a + chunk, end - 1)) for a in range(start, end - 1, chunk)]
    return out + [(end - 1, end)]


@dataclass
class Completion:
    text: str
    tokens: list[int]
    finish_reason: str
    timings: Timings
    prompt_tokens: int
    stats: object | None = None
    # the trunk's final-normed hidden state of every token of prompt + tokens [T, D] (float32):
    # `generate_batch(keep_hidden=True)`, for training text that comes with its states
    hidden: torch.Tensor | None = None


def resolve_device(name: str) -> str:
    """A device name from the command line or a caller: cpu, cuda, cuda:N, or auto (a CUDA GPU
    when PyTorch sees one, else the CPU). Anything else, or a GPU that is not there, is an MtpllmError."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return name
    if name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit()):
        if not torch.cuda.is_available():
            raise MtpllmError(f"device {name}: PyTorch sees no CUDA GPU on this machine (use cpu or auto)")
        if ":" in name and int(name[5:]) >= torch.cuda.device_count():
            raise MtpllmError(f"device {name}: there are {torch.cuda.device_count()} CUDA device(s)")
        return name
    raise MtpllmError(f"device {name!r}: expected auto, cpu, cuda or cuda:N")


class Engine:
    """A model ready to generate. Create with `Engine.load(name_or_path, ...)`."""

    def __init__(self, model: Transformer, tokenizer: GGUFTokenizer, n_ctx: int, load_ms: float = 0.0,
                 device: str = "cpu"):
        self.model = model
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        self.load_ms = load_ms
        self.device = device
        # prompt tokens per prefill forward (llama.cpp's ubatch): the server runs at most one such
        # forward between two decoding steps of the other sequences
        self.prefill_chunk = PREFILL_CHUNK
        self.slot = self.new_slot()  # the single-stream lane (`stream`): cache and draft states
        if model.cfg.vocab_size < tokenizer.vocab_size:
            raise MtpllmError(f"tokenizer has {tokenizer.vocab_size} tokens but the model only "
                              f"{model.cfg.vocab_size} embeddings")

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, name_or_path: str, n_ctx: int | None = None, mode: str = "fast", threads: int | None = None,
             cfg_overrides: dict | None = None, device: str = "cpu") -> "Engine":
        """Load a registry model, GGUF file or Hugging Face checkpoint directory. `threads` sets
        PyTorch's thread count for the whole process (`torch.set_num_threads`), as the CLI's `-t` does;
        leave it None to keep the process's setting. With the compressed kernels (mode "fast") the
        first load on a machine times their alternative paths and sets the fastest for the whole
        process, caching the choice in ~/.cache/mtpllm/tuning.json (docs/kernels.md)."""
        device = resolve_device(device)
        if threads:
            torch.set_num_threads(int(threads))
        t0 = time.perf_counter()
        path = resolve_model(name_or_path)
        g = open_model_file(path)  # a GGUF file, or a Hugging Face checkpoint read in place
        # the tokenizer's checks run before any weight is built: a bad vocabulary fails fast and small
        tok = GGUFTokenizer(g.metadata, g.arch)
        if device != "cpu" and mode == "fast":
            # the compressed formats run on the engine's CPU kernels; other devices get the weights
            # dequantized (float32) and PyTorch's own operators
            mode = "f32"
        model = load_model(path, mode, cfg_overrides, gguf_file=g)
        cfg = model.cfg
        n_ctx = int(n_ctx or min(cfg.ctx_len, 4096))
        if n_ctx <= 0:
            raise MtpllmError(f"context size must be positive, got {n_ctx}")
        check_kv_memory(cfg, n_ctx)
        if device != "cpu":
            model.to(device)
        elif mode == "fast":
            from .tuning import tune_at_load
            tune_at_load(model)  # the kernels' faster paths on this machine (timed once, cached)
        return cls(model, tok, n_ctx, (time.perf_counter() - t0) * 1e3, device)

    def new_slot(self, index: int = 0) -> Slot:
        """A lane of its own: a cache of n_ctx positions (and draft states made on first use)."""
        return Slot(self.model.make_cache(self.n_ctx, self.device), index)

    @property
    def cache(self):
        """The single-stream slot's cache."""
        return self.slot.cache

    def reset(self) -> None:
        """Forget the cached prompt prefix (and the proposers'): the next request evaluates its whole prompt."""
        self.slot.reset()

    # ------------------------------------------------------------------ prompts
    def encode_prompt(self, prompt: str | None = None, messages: list[dict] | None = None,
                      chat: bool | None = None) -> list[int]:
        """Token ids for a raw prompt or a chat conversation (rendered with the model's template)."""
        if messages is not None:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            return self.tokenizer.encode(text, add_special=not text.startswith(self._bos_text()))
        if prompt is None or prompt == "":
            raise MtpllmError("empty prompt: give some text to complete")
        if chat is None:
            chat = bool(self.tokenizer.chat_template)
        if chat:
            return self.encode_prompt(messages=[{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def _bos_text(self) -> str:
        t = self.tokenizer
        return t.tokens[t.bos_id] if t.bos_id is not None and t.add_bos else "\0"

    # ------------------------------------------------------------------ layer 1: step generator
    def prefill(self, seq: Sequence, max_reuse: int | None = None) -> torch.Tensor:
        """Evaluate the sequence's prompt on its slot, reusing at most `max_reuse` tokens of the
        common prefix with what the slot's cache holds. Returns the last position's hidden state
        [1, D]; `seq.prompt_hidden` gets the states of every evaluated position, `seq.cached_n`
        how many were reused."""
        return run_steps(self.prefill_steps(seq, max_reuse))

    def prefill_steps(self, seq: Sequence, max_reuse: int | None = None):
        """`prefill` one forward at a time: a generator that yields the number of prompt tokens of
        its next forward before running it (at most `prefill_chunk`; the last token goes alone) and
        returns what `prefill` returns. The scheduler interleaves these forwards with other
        sequences' decoding steps; run to the end at once they are exactly `prefill`'s work."""
        slot, prompt = seq.slot, seq.prompt
        cache = slot.cache
        # at least one token must be evaluated
        common = min(common_prefix(slot.tokens, prompt), len(prompt) - 1, cache.length)
        if max_reuse is not None:
            common = min(common, max_reuse)
        if cache.length - common > cache.max_trim():  # e.g. recurrent state: no way back that far
            snap = slot.prefix  # ... but perhaps a copy of it at the end of an earlier prompt
            if snap is not None and snap.usable(cache, prompt, common):
                common = snap.restore(cache)
            else:
                common = 0
                cache.reset()
        cache.trim(cache.length - common)
        slot.tokens = list(prompt[:common])
        seq.cached_n = common
        keep = untrimmable_parts(cache)  # recurrent state: keep a copy before the prompt's last token
        parts = []
        for a, b in chunk_bounds(common, len(prompt), self.prefill_chunk):
            yield b - a
            if keep and a == len(prompt) - 1 and (slot.prefix is None or slot.prefix.tokens != prompt[:-1]):
                slot.prefix = PrefixSnapshot(cache, prompt[:-1])  # for a later request to restart from
            parts.append(self.model(torch.tensor(prompt[a:b], dtype=torch.long, device=self.device), cache))
            slot.tokens = list(prompt[:b])  # the cache holds these now (a prefill stopped here leaves them reusable)
        hidden = torch.cat(parts) if len(parts) > 1 else parts[0]
        seq.prompt_hidden = hidden
        return hidden[-1:]

    def _evaluate(self, tokens: list[int], cache) -> torch.Tensor:
        """Prompt tokens into `cache` in chunks (`chunk_bounds`) -> their hidden states [T, D]."""
        todo = torch.tensor(tokens, dtype=torch.long, device=self.device)
        return torch.cat([self.model(todo[a:b], cache) for a, b in chunk_bounds(0, len(tokens), self.prefill_chunk)])

    def new_sequence(self, prompt_ids: list[int], params: SamplingParams | None = None, speculative=None,
                     slot: Slot | None = None) -> Sequence:
        """A generation of `prompt_ids` on `slot` (default: the engine's own), plain or speculative."""
        params = params or SamplingParams()
        self._check_prompt(prompt_ids)
        return Sequence(prompt_ids, params, slot or self.slot, speculative or PlainDecoder(), self.device)

    def _steps(self, seq: Sequence):
        """Layer 1: blocks of new tokens; the first is the token sampled from the prompt."""
        dec = seq.decoder
        yield dec.start(self, seq)
        while True:
            rows = dec.plan(seq, self)
            if rows is None:
                return  # the context is full
            t0 = time.perf_counter()
            hidden = self.model(torch.tensor(rows, dtype=torch.long, device=self.device), seq.slot.cache)
            yield dec.commit(self, seq, hidden, (time.perf_counter() - t0) * 1e3)

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise MtpllmError("empty prompt: give some text to complete")
        if len(ids) >= self.n_ctx:
            raise MtpllmError(f"prompt is {len(ids)} tokens but the context size is {self.n_ctx}: "
                              f"shorten the prompt or raise the context size (-c), at most {self.model.cfg.ctx_len} "
                              f"for this model without rope scaling")

    # ------------------------------------------------------------------ layer 2: stream
    def stream(self, prompt_ids: list[int], params: SamplingParams | None = None,
               speculative=None, slot: Slot | None = None) -> Iterator[Response]:
        """Generate from token ids; yields one Response per emitted token, the last one with a finish_reason."""
        seq = self.new_sequence(prompt_ids, params, speculative, slot)
        timings = Timings(load_ms=self.load_ms)
        out = OutputText(self.tokenizer, seq.params)
        steps = self._steps(seq)
        t0 = time.perf_counter()
        block = next(steps)  # prefill, and the first token
        t1 = time.perf_counter()
        timings.prompt_ms = (t1 - t0) * 1e3
        timings.cached_n = seq.cached_n
        timings.prompt_n = len(prompt_ids) - timings.cached_n
        stats = seq.stats
        try:
            while out.finish is None:
                for t, piece, finish, i in out.add(block):
                    timings.predicted_n = len(out.generated)
                    timings.predicted_ms = (time.perf_counter() - t1) * 1e3
                    yield out.response(block, i, t, piece, finish, timings, stats)
                    if finish is not None:
                        return
                if out.finish is not None:
                    break  # EOS: the text held back is flushed below
                try:
                    block = next(steps)
                except StopIteration:
                    out.finish = "context"  # the context is full
        finally:
            steps.close()
        timings.predicted_n = len(out.generated)
        timings.predicted_ms = (time.perf_counter() - t1) * 1e3
        yield Response(None, out.flush(), out.finish, timings, stats)

    # ------------------------------------------------------------------ layer 3: generate
    def generate(self, prompt: str | None = None, params: SamplingParams | None = None, messages=None,
                 chat: bool | None = False, prompt_ids: list[int] | None = None, speculative=None) -> Completion:
        ids = prompt_ids if prompt_ids is not None else self.encode_prompt(prompt, messages, chat)
        parts, tokens = [], []
        last = None
        for r in self.stream(ids, params, speculative):
            parts.append(r.text)
            if r.token is not None:
                tokens.append(r.token)
            last = r
        return Completion("".join(parts), tokens, last.finish_reason, last.timings, len(ids), last.stats)

    def generate_batch(self, prompts: list[list[int]], params: SamplingParams | None = None,
                       keep_hidden: bool = False) -> list[Completion]:
        """Several independent requests decoded together: each step feeds one token of every
        unfinished sequence through the model as one batch (`Transformer.decode_batch`), so the
        weights are read once per step for all of them. Each sequence gets exactly the tokens that
        `generate` would give it alone (same kernels row by row; greedy identical, sampling from the
        same distributions). Plain decoding only; EOS, stop strings, max_tokens and the text per
        sequence by its own `OutputText`, as `stream` does.
        Each sequence gets its own KV cache of len(prompt) + max_tokens positions (at most n_ctx).

        keep_hidden: each Completion also carries the model's final-normed hidden state of every
        token of prompt + output (`Completion.hidden`), the trunk states an MTP head is trained on;
        a sequence stopped by max_tokens feeds its last token once more for its state (when its
        cache has room), so the states cover every token."""
        params = params or SamplingParams()
        if not prompts:
            return []
        for ids in prompts:
            self._check_prompt(ids)
        check_kv_memory(self.model.cfg, sum(min(self.n_ctx, len(ids) + params.max_tokens) for ids in prompts))
        t0 = time.perf_counter()
        caches, hidden, samplers = [], [], []
        states: list[list[torch.Tensor]] = [[] for _ in prompts]  # keep_hidden: per sequence, in order
        for b, ids in enumerate(prompts):
            room = 1 if keep_hidden else 0  # the last token's state, for a sequence cut by max_tokens
            cache = self.model.make_cache(min(self.n_ctx, len(ids) + params.max_tokens + room), self.device)
            h_all = self._evaluate(ids, cache)
            hidden.append(h_all[-1:])
            if keep_hidden:
                states[b].append(h_all.float())
            caches.append(cache)
            samplers.append(make_sampler(params, self.device))
        t1 = time.perf_counter()
        # EOS, stop strings, max tokens and the text: each sequence's OutputText, as in `stream`
        outs = [OutputText(self.tokenizer, params) for _ in prompts]
        texts: list[list[str]] = [[] for _ in prompts]
        live = [b for b, o in enumerate(outs) if o.finish is None]
        h = torch.cat(hidden)
        last: list[tuple[int, int, int]] = []  # sequences done by max_tokens whose last token is fed for its state
        while live:
            logits = self.model.logits(h)
            nxt = []
            for row, b in enumerate(live):
                o = outs[b]
                t = samplers[b].sample(logits[row], prompts[b] + o.generated)
                emitted = [piece for _, piece, _, _ in o.add([t])]  # nothing for EOS
                texts[b] += emitted
                if o.finish is None and caches[b].length + 2 > caches[b].max_len:
                    o.finish = "context"
                if o.finish is None:
                    nxt.append((row, b, t))
                elif not emitted or o.finish == "context":
                    texts[b].append(o.flush())  # EOS or a full context: the text held back
                elif o.finish == "length" and keep_hidden and caches[b].length + 1 <= caches[b].max_len:
                    last.append((row, b, t))  # fed once more, for its state only
            live = [b for _, b, _ in nxt]
            if live or last:
                fed = nxt + last
                step = torch.tensor([t for _, _, t in fed], dtype=torch.long, device=self.device)
                h = self.model.decode_batch(step, [caches[b] for _, b, _ in fed])
                if keep_hidden:
                    for r, (_, b, _) in enumerate(fed):
                        states[b].append(h[r:r + 1].float())
                h, last = h[:len(nxt)], []
        t2 = time.perf_counter()
        done = []
        n_out = sum(len(o.generated) for o in outs)
        for b, o in enumerate(outs):
            tm = Timings(load_ms=self.load_ms, prompt_n=sum(map(len, prompts)), prompt_ms=(t1 - t0) * 1e3,
                         predicted_n=n_out, predicted_ms=(t2 - t1) * 1e3)
            done.append(Completion("".join(texts[b]), list(o.generated), o.finish, tm, len(prompts[b]),
                                   hidden=torch.cat(states[b]) if keep_hidden else None))
        return done


def check_kv_memory(cfg, n_ctx: int) -> int:
    """Fail with a clear message (and the largest context that fits) before allocating too much."""
    from ..models.base import model_kv_bytes
    need = model_kv_bytes(cfg, n_ctx)
    avail = available_memory()
    if avail and need > 0.9 * avail:
        per_tok = need / n_ctx
        fits = int(0.9 * avail / per_tok) // 256 * 256
        raise MtpllmError(f"the KV cache for a context of {n_ctx} tokens needs {need / 2**30:.2f} GiB but only "
                          f"{avail / 2**30:.2f} GiB of memory is available; the largest context that fits is "
                          f"about {fits} tokens (-c {fits})")
    return need


def available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
