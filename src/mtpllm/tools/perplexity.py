"""`mtpllm perplexity -m MODEL -f FILE`: perplexity of a model on a text, by llama-perplexity's protocol.

The protocol of llama.cpp's `llama-perplexity` (tools/perplexity/perplexity.cpp, `perplexity()`):
the text is tokenized once (with BOS in front where the model adds one) and cut into
len(tokens) // c chunks of `-c` tokens (the remainder is dropped). Each chunk is evaluated from an
empty cache; where the model adds a BOS token, the chunk's first token is replaced by BOS, so every
chunk starts as a document does. In each chunk the logits at positions c/2 .. c-2 are scored
against the tokens c/2 + 1 .. c-1 (c - 1 - c/2 tokens: 255 of a 512-token chunk), so every scored
token sees at least c/2 tokens of context. Prints the running estimate per chunk and the
final PPL with its standard error, and says which protocol it used. `--dequantize` runs every weight as float32: comparing the two
tells how much the compressed kernels cost in quality. `-b` sets the tokens per forward call: the
compressed path multiplies prompt-sized batches with the exact float32 weights, and batches of
fewer than 32 tokens (decoding, speculative verification) with the quantized-activation kernel,
so `-b 16` measures the quality of decoding.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import MtpllmError

PROMPT_CHUNK = 256  # tokens per forward call by default (-b): each chunk of -c tokens is scored in such pieces


@dataclass
class PerplexityResult:
    ppl: float
    stderr: float  # standard error of the PPL estimate
    tokens_scored: int
    chunks: int
    n_ctx: int
    seconds: float
    bos_id: int | None = None  # the token each chunk starts with, or None (the model adds no BOS)

    @property
    def protocol(self) -> str:
        """The protocol, in words (printed with the result)."""
        first = self.n_ctx // 2
        start = f"each starting with BOS (token {self.bos_id})" if self.bos_id is not None else \
            "no BOS (the model adds none)"
        return (f"llama-perplexity: {self.chunks} chunks of {self.n_ctx} tokens, {start}, "
                f"tokens {first + 1}..{self.n_ctx - 1} of each scored")

    def to_dict(self) -> dict:
        return dict(self.__dict__, protocol=self.protocol)


def chunk_inputs(ids: list[int], n_ctx: int, n_chunks: int, bos_id: int | None) -> list[list[int]]:
    """The token input of each chunk: `n_chunks` consecutive slices of `n_ctx` tokens, each with its
    first token replaced by `bos_id` when the model adds a BOS token (llama-perplexity does the
    same: "add BOS token for the first batch of each chunk")."""
    out = []
    for c in range(n_chunks):
        chunk = list(ids[c * n_ctx:(c + 1) * n_ctx])
        if bos_id is not None:
            chunk[0] = bos_id
        out.append(chunk)
    return out


def perplexity(engine, text: str, n_ctx: int = 512, max_chunks: int = 0, progress=None,
               batch: int = PROMPT_CHUNK) -> PerplexityResult:
    if batch < 1:
        raise MtpllmError(f"perplexity: -b must be positive, got {batch}")
    if n_ctx < 16:
        raise MtpllmError(f"perplexity: -c must be at least 16, got {n_ctx}")
    if n_ctx > engine.n_ctx:
        raise MtpllmError(f"perplexity: -c {n_ctx} exceeds the engine's context {engine.n_ctx}")
    tok = engine.tokenizer
    ids = tok.encode(text, add_special=True)
    bos_id = tok.bos_id if tok.add_bos else None
    n_chunks = len(ids) // n_ctx
    if max_chunks:
        n_chunks = min(n_chunks, max_chunks)
    if n_chunks == 0:
        raise MtpllmError(f"perplexity: the text has {len(ids)} tokens, fewer than one chunk of {n_ctx}")
    model, cache = engine.model, engine.cache
    first = n_ctx // 2
    nll = []
    t0 = time.perf_counter()
    for c, chunk in enumerate(chunk_inputs(ids, n_ctx, n_chunks, bos_id)):
        cache.reset()
        hidden = []
        for s in range(0, n_ctx, batch):
            toks = torch.tensor(chunk[s:s + batch], dtype=torch.long, device=engine.device)
            hidden.append(model(toks, cache))
        h = torch.cat(hidden)[first:n_ctx - 1]  # positions first..n_ctx-2 predict tokens first+1..n_ctx-1
        logp = torch.log_softmax(model.logits(h).float(), dim=-1)
        target = torch.tensor(chunk[first + 1:], dtype=torch.long, device=logp.device)
        nll.extend((-logp.gather(1, target[:, None])[:, 0]).tolist())
        if progress:
            progress(c + 1, n_chunks, math.exp(sum(nll) / len(nll)))
    cache.reset()
    n = len(nll)
    mean = sum(nll) / n
    var = sum((x - mean) ** 2 for x in nll) / max(n - 1, 1)
    ppl = math.exp(mean)
    return PerplexityResult(ppl, ppl * math.sqrt(var / n), n, n_chunks, n_ctx, time.perf_counter() - t0, bos_id)


def main(argv: list[str]) -> int:
    from ..runtime.engine import Engine
    ap = argparse.ArgumentParser(prog="mtpllm perplexity", description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True, help="registry name or GGUF path")
    ap.add_argument("-f", "--file", required=True, help="text file to score")
    ap.add_argument("-c", "--ctx-size", type=int, default=512, help="tokens per chunk (default 512)")
    ap.add_argument("-b", "--batch-size", type=int, default=PROMPT_CHUNK,
                    help=f"tokens per forward call (default {PROMPT_CHUNK}; below 32 uses the decoding kernels)")
    ap.add_argument("--chunks", type=int, default=0, help="score at most this many chunks (0 = all)")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--dequantize", action="store_true", help="every weight as float32 (reference path)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    a = ap.parse_args(argv)
    path = Path(a.file)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise MtpllmError(f"cannot read {a.file}: {e}") from None
    eng = Engine.load(a.model, n_ctx=max(a.ctx_size, 16), mode="f32" if a.dequantize else "fast", threads=a.threads)

    def progress(i, n, ppl):
        print(f"[{i}/{n}] running PPL {ppl:.4f}", file=sys.stderr, flush=True)

    r = perplexity(eng, text, a.ctx_size, a.chunks, None if a.json else progress, a.batch_size)
    if a.json:
        print(json.dumps(r.to_dict()))
    else:
        print(f"PPL = {r.ppl:.4f} +/- {r.stderr:.4f} ({r.tokens_scored} tokens in {r.chunks} chunks of "
              f"{r.n_ctx}, {'float32' if a.dequantize else 'compressed'} weights, {r.seconds:.1f} s)")
        print(f"protocol: {r.protocol}")
    return 0
