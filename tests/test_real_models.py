"""End-to-end checks on the real registry models (marked slow; run in CI).

Hugging Face transformers is the test-only reference: it loads the same GGUF files (dequantized
to float32); our side runs with every weight dequantized to float32 too (`mode="f32"`).
"""
import functools
import inspect
import json
import random

import pytest
import torch

from mtpllm.models import load_model
from mtpllm.registry import REGISTRY, resolve_model
from mtpllm.runtime.engine import Engine
from mtpllm.runtime.sampling import SamplingParams
from mtpllm.speculative import SpecConfig

pytestmark = pytest.mark.slow

PROMPTS = ["def quicksort(arr):", "The capital of France is", "import numpy as np\n\n# compute the mean of"]


def real_text() -> str:
    import textwrap
    return inspect.getsource(textwrap)  # real Python source shipped with every CPython


def _hf(path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=None)  # the pair fixture's and the tokenizer test's: read once (a GGUF read is ~10 s)
def _hf_tok(path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module", params=["qwen2.5-coder-0.5b", "gemma-3-270m"])
def pair(request):
    path = resolve_model(request.param)
    ours = Engine.load(str(path), n_ctx=1024, mode="f32")
    ref = _hf(path)
    yield request.param, ours, ref, _hf_tok(path)
    del ref


def test_logits_top1_agreement(pair):
    name, ours, ref, _ = pair
    ids = ours.tokenizer.encode(real_text())[:257]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].float()
    cache = ours.model.make_cache(512)
    got = ours.model.logits(ours.model(torch.tensor(ids), cache))
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    print(f"{name}: top-1 agreement {agree:.4f} over {len(ids)} positions")
    assert agree >= 0.99


def test_greedy_continuations_identical(pair):
    """Our greedy continuation is the reference's: one forward of transformers over the prompt and our
    32 tokens puts its argmax on our next token at every position, which is (by induction over the
    positions) what its own greedy decoding produces; a single forward instead of 32 decoding steps."""
    name, ours, ref, _ = pair
    for prompt in PROMPTS:
        ids = ours.tokenizer.encode(prompt)
        got = ours.generate(prompt_ids=ids, params=SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)).tokens
        assert len(got) == 32
        with torch.no_grad():
            logits = ref(torch.tensor([ids + got])).logits[0]
        want = logits[len(ids) - 1:-1].argmax(-1).tolist()
        assert got == want, (name, prompt)


def _strings():
    rng = random.Random(0)
    base = ["def f(x):\n    return x ** 2\n", "    indented\tand tabbed  ", "日本語のテキストです。", "中文分词测试",
            "한국어 문장", "emoji 🚀🔥👍🏽 and ZWJ 👨‍👩‍👧", "   ", "\n\n\n", "a" * 50, "1234567890 3.14159 -42",
            "<|im_start|>user\nhi<|im_end|>", "Ünïcödé façade naïve", "x = {'k': [1, 2, 3]}  # comment",
            "SELECT * FROM t WHERE id = 1;", "   leading and trailing   ", "mixed\r\nline\rendings"]
    src = real_text().splitlines()
    out = list(base)
    for _ in range(300):
        a = rng.randrange(len(src))
        out.append("\n".join(src[a:a + rng.randrange(1, 4)]))
        s = "".join(rng.choice(base) for _ in range(2))
        out.append(s[rng.randrange(len(s)):])
    return out


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "gemma-3-270m"])
def test_tokenizer_matches_transformers(name):
    from mtpllm.gguf import GGUFFile
    from mtpllm.tokenizer import GGUFTokenizer
    path = resolve_model(name)
    g = GGUFFile(path)
    ours = GGUFTokenizer(g.metadata, g.arch)
    ref = _hf_tok(path)
    strings = _strings()
    assert len(strings) >= 300
    for s in strings:
        a = ours.encode(s)
        b = ref(s)["input_ids"]
        assert a == b, repr(s)
        assert ours.decode(a) == ref.decode(b), repr(s)


@pytest.fixture(scope="module")
def qwen05():
    return Engine.load("qwen2.5-coder-0.5b", n_ctx=2048)  # the default (compressed) path


CODE_PROMPT = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number, "
                "then a second version of the same function with memoization."}]


def test_ngram_greedy_identity_real(qwen05):
    ids = qwen05.encode_prompt(messages=CODE_PROMPT)
    p = SamplingParams(temperature=0, max_tokens=96)
    ref = qwen05.generate(prompt_ids=ids, params=p)
    for k in (2, 4):
        out = qwen05.generate(prompt_ids=ids, params=p, speculative=SpecConfig("ngram", k).build(qwen05))
        assert out.tokens == ref.tokens
        print(f"ngram k={k}: {out.stats.summary()} decode {out.timings.predicted_per_second:.1f} tok/s "
              f"(plain {ref.timings.predicted_per_second:.1f})")


def test_draft_model_greedy_identity_real():
    tgt = Engine.load("qwen2.5-coder-1.5b", n_ctx=1024)
    ids = tgt.encode_prompt(messages=CODE_PROMPT)
    p = SamplingParams(temperature=0, max_tokens=64)
    ref = tgt.generate(prompt_ids=ids, params=p)
    out = tgt.generate(prompt_ids=ids, params=p,
                       speculative=SpecConfig("draft_model", 3, draft_model="qwen2.5-coder-0.5b").build(tgt))
    assert out.tokens == ref.tokens
    assert out.stats.acceptance_rate > 0.3  # the 0.5B agrees with the 1.5B on most code tokens
    print(f"draft 0.5B->1.5B k=3: {out.stats.summary()} decode {out.timings.predicted_per_second:.1f} tok/s "
          f"(plain {ref.timings.predicted_per_second:.1f})")


def test_registry_files_verified():
    for e in REGISTRY.values():
        p = resolve_model(e.name)
        assert p.stat().st_size == e.size
