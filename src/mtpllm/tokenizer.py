"""Tokenizer built from GGUF metadata with the `tokenizers` library, and sandboxed chat templates.

- `tokenizer.ggml.model == "gpt2"`: byte-level BPE with the file's merges and the pre-tokenizer
  split regex named by `tokenizer.ggml.pre` (qwen2, llama-bpe, ...).
- `tokenizer.ggml.model == "llama"`: SentencePiece-style BPE with byte fallback; merges are
  recovered from the vocabulary (Gemma files store none: the token order is the merge order;
  other files: the token scores).
- `tokenizer.huggingface.json` present (a Hugging Face checkpoint's `tokenizer.json`, see
  `tokenizer_metadata`): that tokenizer as it is.
Control tokens are matched whole; `add_bos`/`add_eos` are honoured.
"""
from __future__ import annotations

import datetime
import json

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
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

    def __init__(self, meta: dict, arch: str = ""):
        kind = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not kind or not tokens:
            raise MtpllmError("GGUF file has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens missing)")
        types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        self.vocab_size = len(tokens)
        self.tokens = tokens
        if meta.get("tokenizer.huggingface.json"):
            tk = Tokenizer.from_str(meta["tokenizer.huggingface.json"])
        elif kind == "gpt2":
            tk = self._byte_level(meta, tokens)
        elif kind == "llama":
            tk = self._sentencepiece(meta, tokens, arch)
        else:
            raise MtpllmError(f"tokenizer type '{kind}' is not supported (supported: gpt2, llama)")
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
        self.special_ids = {i for i, ty in enumerate(types) if ty == TOKEN_TYPE_CONTROL}
        self.bos_id = meta.get("tokenizer.ggml.bos_token_id")
        self.eos_id = meta.get("tokenizer.ggml.eos_token_id")
        default_bos = kind == "llama"
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
    def _byte_level(meta: dict, tokens: list[str]) -> Tokenizer:
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {}
        for i, t in enumerate(tokens):
            key = t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))
            vocab.setdefault(key, i)
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
        tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        split = PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre", "default"), _GPT2_SPLIT)
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        tk.decoder = decoders.ByteLevel()
        return tk

    @staticmethod
    def _sentencepiece(meta: dict, tokens: list[str], arch: str) -> Tokenizer:
        gemma = arch.startswith("gemma")
        if gemma:  # Gemma stores runs of spaces as real spaces; the model sees them as '▁'
            tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        vocab = {}
        for i, t in enumerate(tokens):
            vocab.setdefault(t, i)
        if meta.get("tokenizer.ggml.merges"):
            merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        elif gemma:  # Gemma's scores do not follow its merge order; the token order does
            merges = _merges_from_vocab(tokens, {t: -i for i, t in enumerate(tokens)})
        else:
            scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
            merges = _merges_from_vocab(tokens, dict(zip(tokens, scores)))
        unk_id = meta.get("tokenizer.ggml.unknown_token_id")
        unk = tokens[unk_id] if unk_id is not None else None
        tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
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

    def id_to_piece(self, i: int) -> str:
        return self.tokens[i]

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


_ENV = None


def _env() -> ImmutableSandboxedEnvironment:
    global _ENV
    if _ENV is None:
        # templates inside model files are untrusted input: sandboxed and immutable
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **_: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        _ENV = env
    return _ENV


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
    """Render a chat template (jinja2, sandboxed). Errors become MtpllmError with the reason."""
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise MtpllmError(f"chat message must be an object with a 'role', got {m!r}")
    try:
        return _env().from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                   **extra)
    except TemplateError as exc:
        raise MtpllmError(f"chat template error: {exc}") from exc
    except Exception as exc:  # sandbox violations, type errors in the template
        raise MtpllmError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
