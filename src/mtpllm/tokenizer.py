"""Tokenizer built from GGUF metadata with the `tokenizers` library, and sandboxed chat templates.

- `tokenizer.ggml.model == "gpt2"`: byte-level BPE with the file's merges and the pre-tokenizer
  split regex named by `tokenizer.ggml.pre` (qwen2, llama-bpe, ...).
- `tokenizer.ggml.model == "llama"`: SentencePiece-style BPE with byte fallback; merges are
  recovered from the vocabulary (Gemma files store none: the token order is the merge order;
  other files: the token scores).
- `tokenizer.huggingface.json` present (a Hugging Face checkpoint's `tokenizer.json`, see
  `tokenizer_metadata`): that tokenizer as it is.
Control tokens are matched whole; `add_bos`/`add_eos` are honoured.

The metadata is untrusted input: types, lengths, token ids and merges are checked (each merge's
parts and result must be tokens) before the `tokenizers` library sees them, and anything it still
refuses becomes an MtpllmError naming the file. Chat templates run sandboxed, with a time limit and
a limit on the size of what they write.
"""
from __future__ import annotations

import datetime
import functools
import json
import math
import re
import threading
import time

from jinja2 import TemplateError, nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from .errors import MtpllmError

_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
PRE_TOKENIZER_SPLITS = {
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "gpt-2": _GPT2_SPLIT, "default": _GPT2_SPLIT,
}
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
MAX_TOKEN_CHARS = 1024  # merges are recovered by splitting each token: cost grows with its length squared
TEMPLATE_MAX_SECONDS = 2.0
TEMPLATE_MAX_CHARS = 4 << 20  # 4M characters of rendered prompt (or of any string or list it builds)
TEMPLATE_MAX_SOURCE = 1 << 20  # released templates are a few kilobytes
_ID_KEYS = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id", "eot_token_id",
            "eom_token_id", "sep_token_id")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_UNICODE_TO_BYTE = {u: b for b, u in _bytes_to_unicode().items()}
_BYTE_LEVEL_ALPHABET = set(_UNICODE_TO_BYTE)


def _bad(where: str, key: str, what: str) -> MtpllmError:
    return MtpllmError(f"{where}: tokenizer metadata '{key}' {what}")


def _check_list(where: str, meta: dict, key: str, n: int | None, kinds: tuple) -> list | None:
    v = meta.get(key)
    if v is None:
        return None
    if not isinstance(v, list):
        raise _bad(where, key, f"must be an array, got {type(v).__name__}")
    if n is not None and len(v) != n:
        raise _bad(where, key, f"has {len(v)} entries, expected one per token ({n})")
    if not set(map(type, v)) <= set(kinds):  # one pass in C: vocabularies have 150k+ entries
        i, x = next((i, x) for i, x in enumerate(v) if type(x) not in kinds)
        raise _bad(where, key, f"entry {i} is {x!r}, expected {' or '.join(k.__name__ for k in kinds)}")
    return v


def check_metadata(meta: dict, where: str = "model file") -> None:
    """Types, lengths and token ids of the tokenizer metadata (merges are checked when they are used)."""
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template"):
        if meta.get(key) is not None and not isinstance(meta[key], str):
            raise _bad(where, key, f"must be a string, got {type(meta[key]).__name__}")
    tokens = _check_list(where, meta, "tokenizer.ggml.tokens", None, (str,))
    n = len(tokens or [])
    _check_list(where, meta, "tokenizer.ggml.token_type", n, (int,))
    _check_list(where, meta, "tokenizer.ggml.scores", n, (int, float))
    _check_list(where, meta, "tokenizer.ggml.merges", None, (str,))
    for key in _ID_KEYS:
        v = meta.get("tokenizer.ggml." + key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < n):
            raise _bad(where, "tokenizer.ggml." + key, f"is {v!r}, expected a token id from 0 to {n - 1}")


def _bpe(where: str, vocab: dict[str, int], merges: list, **kw) -> Tokenizer:
    """The BPE model from the file's merges ("a b" strings) or recovered (a, b) pairs. When `tokenizers`
    refuses them, which merge and why (it needs both parts of a merge and their concatenation in the
    vocabulary): checked only then, so the usual path stays fast."""
    pairs = [tuple(m.split(" ", 1)) if isinstance(m, str) else m for m in merges]
    try:
        return Tokenizer(models.BPE(vocab=vocab, merges=pairs, **kw))
    except Exception:
        for i, (m, pair) in enumerate(zip(merges, pairs)):
            if len(pair) != 2 or not pair[0] or not pair[1]:
                raise _bad(where, "tokenizer.ggml.merges", f"entry {i} is {m[:40]!r}, expected two tokens "
                                                           f"separated by a space") from None
            for piece in (pair[0], pair[1], pair[0] + pair[1]):
                if piece not in vocab:
                    raise _bad(where, "tokenizer.ggml.merges", f"entry {i} ({pair[0]!r} + {pair[1]!r}) uses "
                                                               f"{piece!r}, which is not a token of the "
                                                               f"vocabulary") from None
        raise


def _merges_from_vocab(tokens: list[str], rank: dict[str, float]) -> list[tuple[str, str]]:
    """Recover BPE merges: every split of a token into two vocabulary pieces, best-ranked token first."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for tok in tokens:
        if len(tok) < 2:
            continue
        local = [(tok[:j], tok[j:]) for j in range(1, len(tok)) if tok[:j] in vocab and tok[j:] in vocab]
        local.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        r = rank[tok]
        merges.extend((r, a, b) for a, b in local)
    merges.sort(key=lambda m: (-m[0], len(m[1]), len(m[2])))
    return [(a, b) for _, a, b in merges]


class GGUFTokenizer:
    """Encode/decode text exactly as the model was trained; built from a GGUF file's metadata."""

    def __init__(self, meta: dict, arch: str = "", source: str | None = None):
        where = str(source or getattr(meta, "source", None) or "model file")
        kind = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not kind or not tokens:
            raise MtpllmError(f"{where}: no tokenizer in this file (tokenizer.ggml.model / tokenizer.ggml.tokens "
                              f"missing)")
        check_metadata(meta, where)
        types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        self.vocab_size = len(tokens)
        self.tokens = tokens
        try:
            if meta.get("tokenizer.huggingface.json"):  # a Hugging Face checkpoint's tokenizer.json
                tk = Tokenizer.from_str(meta["tokenizer.huggingface.json"])
            elif kind == "gpt2":
                tk = self._byte_level(meta, tokens, where)
            elif kind == "llama":
                tk = self._sentencepiece(meta, tokens, arch, where)
            else:
                raise MtpllmError(f"{where}: tokenizer type '{kind}' is not supported (supported: gpt2, llama)")
            self._finish(tk, meta, tokens, types)
        except MtpllmError:
            raise
        except Exception as exc:  # the tokenizers library refused the vocabulary: the file is at fault
            raise MtpllmError(f"{where}: the tokenizer data is invalid ({type(exc).__name__}: {exc})") from None

    def _finish(self, tk: Tokenizer, meta: dict, tokens: list[str], types: list[int]) -> None:
        # control tokens are matched whole (special), user-defined ones whole but not special;
        # only tokens that exist in the model vocabulary under their own id (never grow the vocab)
        specials = [AddedToken(t, normalized=False, special=True)
                    for i, (t, ty) in enumerate(zip(tokens, types)) if ty == TOKEN_TYPE_CONTROL and t
                    and tk.token_to_id(t) == i]
        user = [AddedToken(t, normalized=False, special=False)
                for i, (t, ty) in enumerate(zip(tokens, types)) if ty == TOKEN_TYPE_USER_DEFINED and t
                and tk.token_to_id(t) == i]
        tk.add_special_tokens(specials)
        if user:
            tk.add_tokens(user)
        self._tk = tk
        self._byte_level = type(tk.decoder).__name__ == "ByteLevel"
        self.special_ids = {i for i, ty in enumerate(types) if ty == TOKEN_TYPE_CONTROL}
        self.bos_id = meta.get("tokenizer.ggml.bos_token_id")
        self.eos_id = meta.get("tokenizer.ggml.eos_token_id")
        default_bos = meta.get("tokenizer.ggml.model") == "llama"
        self.add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_bos)) and self.bos_id is not None
        self.add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and self.eos_id is not None
        self.eos_ids = {self.eos_id} if self.eos_id is not None else set()
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            if meta.get(key) is not None:
                self.eos_ids.add(int(meta[key]))
        for name in ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|eot_id|>", "<|end_of_text|>"):
            tid = tk.token_to_id(name)
            if tid is not None and tid in self.special_ids:
                self.eos_ids.add(tid)
        self.chat_template = meta.get("tokenizer.chat_template")

    # ---- construction ------------------------------------------------------------------
    @staticmethod
    def _byte_level(meta: dict, tokens: list[str], where: str) -> Tokenizer:
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {}
        for i, t in enumerate(tokens):
            key = t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))
            vocab.setdefault(key, i)
        tk = _bpe(where, vocab, meta.get("tokenizer.ggml.merges") or [], fuse_unk=False, byte_fallback=False)
        split = PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre", "default"), _GPT2_SPLIT)
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        tk.decoder = decoders.ByteLevel()
        return tk

    @staticmethod
    def _sentencepiece(meta: dict, tokens: list[str], arch: str, where: str) -> Tokenizer:
        gemma = arch.startswith("gemma")
        if gemma:  # Gemma stores runs of spaces as real spaces; the model sees them as '▁'
            tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        vocab = {}
        for i, t in enumerate(tokens):
            vocab.setdefault(t, i)
        long = next((i for i, t in enumerate(tokens) if len(t) > MAX_TOKEN_CHARS), None)
        if meta.get("tokenizer.ggml.merges"):
            merges = meta["tokenizer.ggml.merges"]
        elif long is not None:
            raise _bad(where, "tokenizer.ggml.tokens", f"entry {long} is {len(tokens[long])} characters long; "
                                                       f"at most {MAX_TOKEN_CHARS} are supported")
        elif gemma:  # Gemma's scores do not follow its merge order; the token order does
            merges = _merges_from_vocab(tokens, {t: -i for i, t in enumerate(tokens)})
        else:
            scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
            merges = _merges_from_vocab(tokens, dict(zip(tokens, scores)))
        unk_id = meta.get("tokenizer.ggml.unknown_token_id")
        unk = tokens[unk_id] if unk_id is not None else None
        tk = _bpe(where, vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
        add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", not gemma))
        if add_prefix:
            tk.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        else:
            tk.normalizer = normalizers.Replace(" ", "\u2581")
        tk.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous")
        dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if add_prefix:
            dec.append(decoders.Strip(" ", 1, 0))
        tk.decoder = decoders.Sequence(dec)
        return tk

    # ---- use ---------------------------------------------------------------------------
    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Text -> token ids; control-token text (e.g. '<|im_start|>') maps to its single id."""
        ids = self._tk.encode(text, add_special_tokens=False).ids
        if add_special:
            if self.add_bos and (not ids or ids[0] != self.bos_id):
                ids = [self.bos_id] + ids
            if self.add_eos:
                ids = ids + [self.eos_id]
        return ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special)

    def token_to_id(self, s: str) -> int | None:
        return self._tk.token_to_id(s)

    def token_bytes(self, i: int) -> bytes:
        """The bytes one token stands for (a piece of a UTF-8 character for a byte token), with its
        leading space: what the token adds to a text, as llama.cpp's token_to_piece gives it."""
        t = self.tokens[i]
        if i in self.special_ids or not t:
            return t.encode("utf-8")
        if self._byte_level:
            if set(t) <= _BYTE_LEVEL_ALPHABET:
                return bytes(_UNICODE_TO_BYTE[c] for c in t)
            return t.encode("utf-8")
        if len(t) == 6 and t.startswith("<0x") and t.endswith(">"):  # sentencepiece byte fallback
            try:
                return bytes([int(t[3:5], 16)])
            except ValueError:
                pass
        return t.replace("\u2581", " ").encode("utf-8")

    # ---- chat ------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            template: str | None = None, **extra) -> str:
        tmpl = template or self.chat_template
        if not tmpl:
            raise MtpllmError("this model has no chat template (tokenizer.chat_template); use --no-chat "
                              "for plain text completion")
        return render_chat_template(tmpl, messages, add_generation_prompt,
                                    bos_token=self.tokens[self.bos_id] if self.bos_id is not None else "",
                                    eos_token=self.tokens[self.eos_id] if self.eos_id is not None else "",
                                    **extra)


def tokenizer_metadata(d, config: dict | None = None) -> dict:
    """GGUF tokenizer metadata for a Hugging Face checkpoint directory `d`: its `tokenizer.json`
    whole (`tokenizer.huggingface.json`), the token list in id order with the added special tokens
    typed as control tokens, bos/eos from `tokenizer_config.json` (else `config.json`), and the chat
    template (`chat_template.jinja` or `tokenizer_config.json`)."""
    from pathlib import Path
    d = Path(d)
    f = d / "tokenizer.json"
    if f.stat().st_size > 256 << 20:
        raise MtpllmError(f"{f}: {f.stat().st_size} bytes is not a tokenizer")
    text = f.read_text(encoding="utf-8")
    try:
        tk = Tokenizer.from_str(text)
    except Exception as exc:  # the tokenizers library raises its own exception type
        raise MtpllmError(f"{f}: not a readable tokenizer ({exc})") from None
    vocab = tk.get_vocab(with_added_tokens=True)
    n = max(vocab.values()) + 1 if vocab else 0
    tokens = [""] * n
    for t, i in vocab.items():
        tokens[i] = t
    types = [1] * n
    for i, added in tk.get_added_tokens_decoder().items():
        if added.special and i < n:
            types[i] = TOKEN_TYPE_CONTROL
    tc = {}
    if (d / "tokenizer_config.json").exists():
        try:
            tc = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise MtpllmError(f"{d / 'tokenizer_config.json'}: not readable JSON ({exc})") from None
        tc = tc if isinstance(tc, dict) else {}
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.huggingface.json": text, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.add_bos_token": False}

    def token_id(v):
        if isinstance(v, dict):
            v = v.get("content")
        return vocab.get(v) if isinstance(v, str) else None

    for key, name in (("bos", "tokenizer.ggml.bos_token_id"), ("eos", "tokenizer.ggml.eos_token_id")):
        tid = token_id(tc.get(f"{key}_token"))
        if tid is None and config is not None:
            v = config.get(f"{key}_token_id")
            v = v[0] if isinstance(v, list) and v else v
            tid = v if isinstance(v, int) and 0 <= v < n else None
        if tid is not None:
            meta[name] = tid
    if tc.get("add_bos_token") and "tokenizer.ggml.bos_token_id" in meta:
        meta["tokenizer.ggml.add_bos_token"] = True
    tmpl = d / "chat_template.jinja"
    if tmpl.exists():
        meta["tokenizer.chat_template"] = tmpl.read_text(encoding="utf-8")
    elif isinstance(tc.get("chat_template"), str):
        meta["tokenizer.chat_template"] = tc["chat_template"]
    return meta


def _raise_exception(msg):
    raise TemplateError(msg)


class TemplateLimit(TemplateError):
    """A chat template ran past its time or output-size limit."""


_limits = threading.local()  # deadline of the render running in this thread
_FORMAT_SPEC = re.compile(r"\{[^{}]*:([^{}]*)\}")
_PERCENT_SPEC = re.compile(r"%[-#0 +]*(\*|\d*)(?:\.(\*|\d*))?")


def _tick() -> None:
    if time.monotonic() > getattr(_limits, "deadline", math.inf):
        raise TemplateLimit(f"the chat template ran longer than {TEMPLATE_MAX_SECONDS:g} s")


def _fits(n: int, what: str) -> None:
    if n > TEMPLATE_MAX_CHARS:
        raise TemplateLimit(f"the chat template would build {what} of {n} items, more than the limit of "
                            f"{TEMPLATE_MAX_CHARS}")


def _size(x) -> int:
    return len(x) if isinstance(x, (str, list, tuple, dict)) else 0


def _check_ints(args, kwargs) -> None:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, int) and abs(a) > TEMPLATE_MAX_CHARS:
            raise TemplateLimit(f"the chat template passes the number {a} to a function (at most "
                                f"{TEMPLATE_MAX_CHARS})")


def _check_percent(fmt: str, right) -> None:
    for width, prec in _PERCENT_SPEC.findall(fmt):
        for w in (width, prec):
            if w == "*" or (w and int(w) > TEMPLATE_MAX_CHARS):
                raise TemplateLimit(f"the chat template formats with a width or precision {w!r} (at most "
                                    f"{TEMPLATE_MAX_CHARS})")
    _check_ints(right if isinstance(right, tuple) else (right,), {})


class _LimitedCodeGenerator(CodeGenerator):
    def visit_Concat(self, node, frame) -> None:  # `a ~ b`: sized before it is built
        self.write("environment.limited_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _LimitedNamespace(Namespace):
    def __setitem__(self, name, value) -> None:
        _tick()
        _fits(_size(value), "a namespace value")
        super().__setitem__(name, value)


class _LimitedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, plus a deadline checked at every loop step, call, attribute lookup and operator, and
    sizes checked before a string or list is built (`*`, `+`, `~`, `%`, join, replace, padding)."""
    code_generator_class = _LimitedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def _parse(self, source, name, filename):
        tree = super()._parse(source, name, filename)
        for node in tree.find_all(nodes.For):  # every loop steps through the deadline check
            node.iter = nodes.Filter(node.iter, "_loop_guard", [], [], None, None, lineno=node.lineno)
        return tree

    def limited_concat(self, parts) -> str:
        _tick()
        parts = [str(p) for p in parts]
        _fits(sum(map(len, parts)), "a string")
        return "".join(parts)

    def call_binop(self, context, operator, left, right):
        _tick()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(n, int) and _size(seq):
                    _fits(_size(seq) * n, "a string or list")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            if right * left.bit_length() > 4096:
                raise TemplateLimit(f"the chat template computes {left} ** {right}, a number too large")
        elif operator == "+":
            _fits(_size(left) + _size(right), "a string or list")
        elif operator == "%" and isinstance(left, str):
            _check_percent(left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        _tick()
        _check_ints(args, kwargs)
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str) and args:
            name = getattr(__obj, "__name__", "")
            if name == "join":
                items = [str(x) for x in args[0]]
                _fits(sum(map(len, items)) + len(owner) * len(items), "a string")
                args = (items,) + args[1:]
            elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
                _fits(len(owner) + (owner.count(args[0]) + 1) * len(args[1]), "a string")
            elif name == "expandtabs" and isinstance(args[0], int):
                _fits(len(owner) + owner.count("\t") * args[0], "a string")
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj, attribute):
        _tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _tick()
        return super().getitem(obj, argument)

    def wrap_str_format(self, value):
        fmt = getattr(value, "__self__", None)
        if isinstance(fmt, str):
            for spec in _FORMAT_SPEC.findall(fmt):
                if any(int(d) > TEMPLATE_MAX_CHARS for d in re.findall(r"\d+", spec)):
                    raise TemplateLimit(f"the chat template formats with the spec {spec[:40]!r}: too wide")
        return super().wrap_str_format(value)


def _loop_guard(items):
    for x in items:
        _tick()
        yield x


def _limited_filter(name: str, f):
    """A built-in filter with its sizes checked first (arguments after a context argument shift by one)."""
    skip = 1 if getattr(f, "jinja_pass_arg", None) else 0

    @functools.wraps(f)
    def run(*args, **kwargs):
        _tick()
        rest = args[skip:]
        _check_ints(rest[1:], kwargs)
        if rest:
            value = rest[0]
            if name == "join":
                value = [x for x in value]
                sep = rest[1] if len(rest) > 1 else kwargs.get("d", "")
                _fits(sum(_size(x) if isinstance(x, str) else 8 for x in value) + _size(sep) * len(value),
                      "a string")
                args = args[:skip] + (value,) + rest[1:]
            elif name == "replace" and isinstance(value, str) and len(rest) >= 3:
                new = str(rest[2])
                _fits(len(value) + (value.count(str(rest[1])) + 1) * len(new), "a string")
            elif name == "indent" and isinstance(value, str):
                width = rest[1] if len(rest) > 1 else kwargs.get("width", 4)
                pad = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
                _fits(len(value) + (value.count("\n") + 1) * pad, "a string")
            elif name == "format" and isinstance(value, str):
                _check_percent(value, tuple(rest[1:]))
        return f(*args, **kwargs)
    return run


def _tojson(x, indent=None, ensure_ascii=False, **_):
    if indent is not None and (not isinstance(indent, int) or not 0 <= indent <= 16):
        raise TemplateLimit(f"tojson indent must be an integer from 0 to 16, got {indent!r}")
    return json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)


_ENV = None


def _env() -> ImmutableSandboxedEnvironment:
    global _ENV
    if _ENV is None:
        # templates inside model files are untrusted input: sandboxed, immutable, limited in time and size
        env = _LimitedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters = {name: _limited_filter(name, f) for name, f in env.filters.items()}
        env.filters["tojson"] = _tojson
        env.filters["_loop_guard"] = _loop_guard
        env.globals["namespace"] = _LimitedNamespace
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        _ENV = env
    return _ENV


@functools.lru_cache(maxsize=16)
def _compiled(template: str):
    return _env().from_string(template)


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
    """Render a chat template (jinja2, sandboxed, at most TEMPLATE_MAX_SECONDS and TEMPLATE_MAX_CHARS of
    output). Errors become MtpllmError with the reason."""
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise MtpllmError(f"chat message must be an object with a 'role', got {m!r}")
    if not isinstance(template, str) or len(template) > TEMPLATE_MAX_SOURCE:
        raise MtpllmError(f"chat template must be a string of at most {TEMPLATE_MAX_SOURCE} characters")
    _limits.deadline = time.monotonic() + TEMPLATE_MAX_SECONDS
    try:
        out, n = [], 0
        for chunk in _compiled(template).generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                  **extra):
            n += len(chunk)
            _fits(n, "a prompt")
            _tick()
            out.append(chunk)
        return "".join(out)
    except TemplateError as exc:
        raise MtpllmError(f"chat template error: {exc}") from None
    except Exception as exc:  # sandbox violations, type errors in the template, recursion
        raise MtpllmError(f"chat template failed: {type(exc).__name__}: {exc}") from None
    finally:
        _limits.deadline = math.inf
