"""`mtpllm perplexity`: the chunking and scoring against a direct computation, error cases, and
(slow) the compressed kernels against the float32 path on a real model."""
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtpllm.errors import MtpllmError
from mtpllm.runtime.engine import Engine
from mtpllm.tools.perplexity import perplexity

TEXT = (Path(__file__).parent / "data" / "sonnets.txt").read_text(encoding="utf-8")


def _direct_ppl(eng, inputs, n_ctx):
    """llama-perplexity's scoring, computed directly: in each chunk the logits at positions
    c/2 .. c-2 against the tokens c/2 + 1 .. c-1."""
    nll = []
    for chunk in inputs:
        cache = eng.model.make_cache(n_ctx)
        logp = torch.log_softmax(eng.model.logits(eng.model(torch.tensor(chunk), cache)), -1)
        nll += [-float(logp[t - 1, chunk[t]]) for t in range(n_ctx // 2 + 1, n_ctx)]
    return math.exp(sum(nll) / len(nll)), len(nll)


def test_perplexity_scores_the_second_half_of_each_chunk(tiny_models):
    """A model without BOS (qwen2's tokenizer adds none): each chunk of c tokens is the text's own
    tokens, evaluated from an empty cache in one pass; c - 1 - c/2 tokens per chunk are scored."""
    eng = Engine.load(str(tiny_models["qwen2"]), n_ctx=64, mode="f32")
    assert not eng.tokenizer.add_bos
    r = perplexity(eng, TEXT, n_ctx=32, max_chunks=3)
    assert perplexity(eng, TEXT, n_ctx=32, max_chunks=3, batch=5).ppl == pytest.approx(r.ppl, rel=1e-4)
    ids = eng.tokenizer.encode(TEXT, add_special=True)
    ppl, n = _direct_ppl(eng, [ids[c * 32:(c + 1) * 32] for c in range(3)], 32)
    assert r.tokens_scored == n == 3 * 15 and r.chunks == 3 and r.bos_id is None
    assert r.ppl == pytest.approx(ppl, rel=1e-5)
    assert r.stderr > 0 and r.ppl > 1
    assert "no BOS" in r.protocol and "tokens 17..31" in r.protocol


def test_perplexity_starts_every_chunk_with_bos(tiny_models):
    """A model that adds BOS (the tiny Gemma 3, sentencepiece vocabulary): as in llama-perplexity,
    every chunk's input starts with BOS in place of its first token, not only the first chunk's.
    The tokens the model is actually given are recorded with a forward pre-hook."""
    eng = Engine.load(str(tiny_models["gemma3"]), n_ctx=64, mode="f32")
    tok = eng.tokenizer
    assert tok.add_bos and tok.bos_id is not None
    seen = []

    def record(module, args):
        seen.append(args[0].tolist())

    handle = eng.model.register_forward_pre_hook(record)
    try:
        r = perplexity(eng, TEXT, n_ctx=32, max_chunks=3, batch=32)
    finally:
        handle.remove()
    ids = tok.encode(TEXT, add_special=True)
    assert len(seen) == 3 and all(len(c) == 32 for c in seen)
    assert [c[0] for c in seen] == [tok.bos_id] * 3
    assert ids[32] != tok.bos_id and ids[64] != tok.bos_id  # the later chunks' own first tokens are replaced
    assert [c[1:] for c in seen] == [ids[c * 32 + 1:(c + 1) * 32] for c in range(3)]
    assert r.bos_id == tok.bos_id and f"each starting with BOS (token {tok.bos_id})" in r.protocol
    ppl, n = _direct_ppl(eng, seen, 32)
    assert r.tokens_scored == n == 45
    assert r.ppl == pytest.approx(ppl, rel=1e-5)


def test_perplexity_errors(tiny_models, tmp_path):
    eng = Engine.load(str(tiny_models["qwen2"]), n_ctx=64)
    with pytest.raises(MtpllmError, match="fewer than one chunk"):
        perplexity(eng, "short text", n_ctx=32)
    with pytest.raises(MtpllmError, match="exceeds"):
        perplexity(eng, TEXT, n_ctx=128)
    r = subprocess.run([sys.executable, "-m", "mtpllm", "perplexity", "-m", str(tiny_models["qwen2"]),
                        "-f", str(tmp_path / "missing.txt")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "cannot read" in r.stderr and "Traceback" not in r.stderr


def test_perplexity_cli(tiny_models, tmp_path):
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    r = subprocess.run([sys.executable, "-m", "mtpllm", "perplexity", "-m", str(tiny_models["gemma3"]), "-f", str(f),
                        "-c", "32", "--chunks", "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("PPL = ") and "30 tokens in 2 chunks of 32" in r.stdout
    assert "protocol: llama-perplexity: 2 chunks of 32 tokens, each starting with BOS" in r.stdout


@pytest.mark.slow
def test_compressed_path_perplexity_within_one_percent_of_float32():
    """Issue target: the fast path costs under 1% of perplexity against every weight dequantized to
    float32, on a fixed text (2 chunks of 512). Batches of 16 tokens run the decoding kernel (file
    codes, int8 activations per 32-block or per 256 against K-quants); prompt-sized batches run the
    same integer kernel for K-quant matrices and the float32 GEMM on the file's exact weights for
    the others."""
    fast_eng = Engine.load("qwen2.5-coder-0.5b", n_ctx=512)
    fast = perplexity(fast_eng, TEXT, n_ctx=512, max_chunks=2, batch=16)
    prompt = perplexity(fast_eng, TEXT, n_ctx=512, max_chunks=2)
    del fast_eng
    ref = perplexity(Engine.load("qwen2.5-coder-0.5b", n_ctx=512, mode="f32"), TEXT, n_ctx=512, max_chunks=2)
    print(f"PPL decoding kernel {fast.ppl:.4f}, prompt path {prompt.ppl:.4f}, float32 {ref.ppl:.4f}")
    assert fast.tokens_scored == 2 * 255
    assert abs(fast.ppl / ref.ppl - 1) < 0.01
    assert abs(prompt.ppl / ref.ppl - 1) < 0.01


# llama.cpp's `llama-perplexity -m FILE -f tests/data/sonnets.txt -c 512` (llama.cpp as vendored by
# llama-cpp-python 0.3.36, CPU build, default settings: f16 KV cache, 4 chunks, 1,020 tokens scored)
# on the registry files; docs/benchmarks.md records the run.
LLAMA_CPP_PPL = {"gemma-3-270m": 71.1013, "qwen2.5-coder-0.5b": 141.6823, "qwen2.5-coder-1.5b": 26.1776}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LLAMA_CPP_PPL))
def test_perplexity_matches_llama_perplexity(name):
    """Issue target: `mtpllm perplexity -c 512` within 1% of llama-perplexity on the same file. The
    two engines differ in arithmetic only (llama.cpp keeps the KV cache in f16, sums in other
    orders), which moves the figure by a few tenths of a percent; a protocol difference (a chunk
    without BOS, other tokens scored, another tokenization) or a model error moves it by far more:
    on this file Gemma 3 scores 111.1 when only the first chunk starts with BOS (llama.cpp: 71.1)."""
    eng = Engine.load(name, n_ctx=512)
    r = perplexity(eng, TEXT, n_ctx=512)
    print(f"{name}: PPL {r.ppl:.4f}, llama-perplexity {LLAMA_CPP_PPL[name]:.4f}")
    assert r.chunks == 4 and r.tokens_scored == 4 * 255
    assert abs(r.ppl / LLAMA_CPP_PPL[name] - 1) < 0.01
