"""Model configuration read from GGUF metadata, as a validated dataclass.

A model file is untrusted input: every number taken from its metadata is checked for its type, for
a sane range, and against the tensors the file holds (block count against the `blk.N.*` tensors
present, widths and head counts against the tensor shapes), before anything is sized from it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gguf import GGMLQuantizationType

from ..errors import MtpllmError
from ..gguf.quants import SUPPORTED_TYPES
from ..gguf.reader import GGUFFile

# Sane ranges for metadata values: far beyond every released model, small enough that nothing sized
# from them (rotary tables, per-layer tuples, the default context) can take the machine's memory.
MAX_LAYERS = 4096
MAX_WIDTH = 1 << 20  # embedding / FFN width
MAX_HEADS = 4096
MAX_HEAD_DIM = 4096
MAX_CONTEXT = 1 << 24  # 16M tokens
MAX_VOCAB = 1 << 24
MAX_ROPE_BASE = 1e12
MAX_ROPE_FACTOR = 1024.0
_REQUIRED = object()
# storage types the dequantizer reads but the matrix code paths do not (no model file stores its
# matrices so): refused for 2-D tensors
MATRIX_UNSUPPORTED = frozenset({GGMLQuantizationType.F64, GGMLQuantizationType.I8, GGMLQuantizationType.I16,
                                GGMLQuantizationType.I32, GGMLQuantizationType.I64})


def _bad(g, key: str, v: Any, expected: str) -> MtpllmError:
    from ..gguf.reader import _short
    return MtpllmError(f"{g.path}: metadata '{key}' = {_short(v)}: expected {expected}")


def meta_int(g, key: str, default: Any = _REQUIRED, lo: int = 1, hi: int = MAX_WIDTH) -> int:
    """An integer metadata value in [lo, hi] (the default when absent, unless required)."""
    v = g.require(key) if default is _REQUIRED else g.get(key, default)
    if v is default and default is not _REQUIRED:
        return v
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _bad(g, key, v, f"an integer from {lo} to {hi}")
    return v


def meta_float(g, key: str, default: Any = _REQUIRED, lo: float = 0.0, hi: float = math.inf,
               lo_open: bool = False) -> float:
    """A finite number in [lo, hi] (or (lo, hi] with lo_open)."""
    v = g.require(key) if default is _REQUIRED else g.get(key, default)
    if v is default and default is not _REQUIRED:
        return v
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v <= hi \
        and (v > lo if lo_open else v >= lo)
    if not ok:
        raise _bad(g, key, v, f"a number {'>' if lo_open else '>='} {lo:g} and <= {hi:g}")
    return float(v)


def meta_str(g, key: str, default: Any = _REQUIRED) -> Any:
    v = g.require(key) if default is _REQUIRED else g.get(key, default)
    if v is not default and not isinstance(v, str):
        raise _bad(g, key, v, "a string")
    return v


@dataclass
class RopeConfig:
    base: float = 10000.0
    dim: int = 0  # rotary dims (0 = head_dim)
    style: str = "neox"  # "neox" (rotate halves) or "normal" (rotate adjacent pairs, llama GGUF)
    scaling: str = "none"  # none | linear | yarn
    factor: float = 1.0
    orig_ctx: int = 0
    base_swa: float | None = None  # sliding-window layers' base (gemma3: 10000)

    def __post_init__(self):
        if not (math.isfinite(self.base) and self.base > 0):
            raise MtpllmError(f"rope freq base must be a finite number > 0, got {self.base}")
        if self.scaling not in ("none", "linear", "yarn"):
            raise MtpllmError(f"rope scaling must be none|linear|yarn, got '{self.scaling}'")
        if self.scaling != "none" and not (math.isfinite(self.factor) and self.factor > 0):
            raise MtpllmError(f"rope scale factor must be a finite number > 0, got {self.factor}")
        if self.scaling == "yarn" and self.base <= 1:
            raise MtpllmError(f"rope freq base must be > 1 for YaRN, got {self.base}")
        if not 0 <= self.orig_ctx <= MAX_CONTEXT:
            raise MtpllmError(f"rope original context must be from 0 to {MAX_CONTEXT}, got {self.orig_ctx}")
        if self.style not in ("neox", "normal"):
            raise MtpllmError(f"rope style must be neox|normal, got '{self.style}'")


@dataclass
class ModelConfig:
    arch: str
    n_layers: int  # trunk layers (block_count minus nextn layers)
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    ctx_len: int
    norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    n_nextn: int = 0  # MTP (next-n) layers stored after the trunk
    qkv_bias: bool = False
    qk_norm: bool = False
    sandwich_norm: bool = False  # gemma: extra norms after attention and after the FFN
    act: str = "silu"  # silu | gelu_tanh
    embed_scale: float = 1.0
    attn_scale: float = 0.0  # 0 = 1/sqrt(head_dim)
    sliding_window: int = 0
    swa_layers: tuple[bool, ...] = ()  # per trunk layer: True = sliding-window attention
    tied_embeddings: bool = False
    final_softcap: float = 0.0

    def __post_init__(self):
        for name in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size", "ctx_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise MtpllmError(f"model config: {name} must be a positive integer, got {v!r}")
        if self.n_heads % self.n_kv_heads:
            raise MtpllmError(f"model config: n_heads {self.n_heads} not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.act not in ("silu", "gelu_tanh"):
            raise MtpllmError(f"model config: unknown activation '{self.act}'")
        if not self.swa_layers:
            self.swa_layers = (False,) * self.n_layers
        if len(self.swa_layers) != self.n_layers:
            raise MtpllmError("model config: swa_layers must have one entry per layer")
        if self.attn_scale == 0.0:
            self.attn_scale = 1.0 / math.sqrt(self.head_dim)
        for name in ("norm_eps", "embed_scale", "attn_scale", "final_softcap"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise MtpllmError(f"model config: {name} must be a finite number >= 0, got {v!r}")
        if not isinstance(self.sliding_window, int) or self.sliding_window < 0:
            raise MtpllmError(f"model config: sliding_window must be an integer >= 0, got {self.sliding_window!r}")


def block_indices(g) -> dict[int, list[str]]:
    """Block number -> names of its `blk.N.*` tensors."""
    blocks: dict[int, list[str]] = {}
    for name in g.tensors:
        if name.startswith("blk."):
            num = name[4:].split(".", 1)[0]
            if num.isascii() and num.isdigit() and len(num) < 8:
                blocks.setdefault(int(num), []).append(name)
    return blocks


def config_from_gguf(g: GGUFFile) -> ModelConfig:
    """The validated config of a model file: metadata values in range and consistent with the tensors."""
    arch = meta_str(g, "general.architecture")
    from .base import ARCHITECTURES  # noqa: local import, the registry lives with the models
    if arch not in ARCHITECTURES:
        raise MtpllmError(f"{g.path}: architecture '{arch}' is not supported "
                          f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    p = arch + "."
    block_count = meta_int(g, p + "block_count", hi=MAX_LAYERS)
    n_nextn = meta_int(g, p + "nextn_predict_layers", 0, lo=0, hi=block_count - 1)
    d_model = meta_int(g, p + "embedding_length")
    n_heads = meta_int(g, p + "attention.head_count", hi=MAX_HEADS)
    n_kv = g.get(p + "attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):
        raise MtpllmError(f"{g.path}: per-layer head_count_kv is not supported")
    n_kv = meta_int(g, p + "attention.head_count_kv", n_heads, hi=n_heads)
    if n_heads % n_kv:
        raise _bad(g, p + "attention.head_count_kv", n_kv, f"a divisor of the head count {n_heads}")
    head_dim = meta_int(g, p + "attention.key_length", max(d_model // n_heads, 1), hi=MAX_HEAD_DIM)
    ffn_dim = meta_int(g, p + "feed_forward_length")
    ctx_len = meta_int(g, p + "context_length", hi=MAX_CONTEXT)
    present = block_indices(g)
    missing = [i for i in range(block_count) if i not in present]
    extra = sorted(i for i in present if i >= block_count)
    if missing or extra:
        what = (f"no tensors for block(s) {_few(missing)}" if missing else
                f"tensors for block(s) {_few(extra)} beyond it")
        raise MtpllmError(f"{g.path}: metadata '{p}block_count' = {block_count} but the file has {what} "
                          f"(blocks present: {len(present)})")
    emb = g.info("token_embd.weight")
    if len(emb.shape) != 2:
        raise MtpllmError(f"{g.path}: tensor 'token_embd.weight' has shape {list(emb.shape)}, expected [vocab, width]")
    vocab = emb.shape[0]
    n_layers = block_count - n_nextn
    head_dim_default = head_dim
    rope_dim = meta_int(g, p + "rope.dimension_count", 0, lo=0, hi=MAX_HEAD_DIM)
    rope = RopeConfig(
        base=meta_float(g, p + "rope.freq_base", 10000.0, lo=1.0, hi=MAX_ROPE_BASE, lo_open=True),
        dim=rope_dim or head_dim_default,
        style="normal" if arch == "llama" else "neox",
        scaling=meta_str(g, p + "rope.scaling.type", "none") or "none",
        factor=meta_float(g, p + "rope.scaling.factor", 1.0, hi=MAX_ROPE_FACTOR) or 1.0,
        orig_ctx=meta_int(g, p + "rope.scaling.original_context_length", 0, lo=0, hi=MAX_CONTEXT),
    )
    cfg = dict(
        arch=arch, n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv,
        head_dim=head_dim, ffn_dim=ffn_dim, vocab_size=vocab, ctx_len=ctx_len,
        norm_eps=meta_float(g, p + "attention.layer_norm_rms_epsilon", 1e-6, hi=0.5), rope=rope, n_nextn=n_nextn,
        tied_embeddings="output.weight" not in g,
    )
    # optional values read by the architecture files: checked here, before they use them
    meta_int(g, p + "attention.sliding_window", 0, lo=0, hi=MAX_CONTEXT)
    meta_int(g, p + "attention.value_length", head_dim, hi=MAX_HEAD_DIM)
    meta_float(g, p + "final_logit_softcapping", 0.0, hi=1e6)
    meta_float(g, p + "attn_logit_softcapping", 0.0, hi=1e6)
    mod = ARCHITECTURES[arch]
    mod.adjust_config(g, cfg)
    if not rope_dim:
        rope.dim = cfg["head_dim"]
    if not 1 <= vocab <= MAX_VOCAB:
        raise MtpllmError(f"{g.path}: tensor 'token_embd.weight' has {vocab} rows, expected 1 to {MAX_VOCAB}")
    try:
        out = getattr(mod, "CONFIG", ModelConfig)(**cfg)
    except MtpllmError as exc:
        raise MtpllmError(f"{g.path}: {exc}") from None
    if not hasattr(mod, "CONFIG"):  # the dense layout; an architecture with its own config checks its tensors
        check_tensors(g, out)
    return out


def _few(xs: list[int]) -> str:
    return ", ".join(map(str, xs[:5])) + (f" ... ({len(xs)} in all)" if len(xs) > 5 else "")


def check_tensors(g, cfg: ModelConfig) -> None:
    """Every tensor the model reads exists with the shape the config implies and a supported type;
    the tokenizer's vocabulary fits the embedding. Metadata only: nothing is read or allocated."""
    D, H, KV, hd, F, V = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.vocab_size
    if cfg.rope.dim % 2 or not 2 <= cfg.rope.dim <= hd:
        raise MtpllmError(f"{g.path}: metadata '{cfg.arch}.rope.dimension_count' = {cfg.rope.dim}: expected an "
                          f"even number from 2 to the head dimension {hd}")
    want = {"token_embd.weight": (V, D), "output_norm.weight": (D,)}
    if not cfg.tied_embeddings:
        want["output.weight"] = (V, D)
    if "rope_freqs.weight" in g:
        want["rope_freqs.weight"] = (cfg.rope.dim // 2,)
    for i in range(cfg.n_layers + cfg.n_nextn):
        p = f"blk.{i}."
        want.update({p + "attn_norm.weight": (D,), p + "ffn_norm.weight": (D,),
                     p + "attn_q.weight": (H * hd, D), p + "attn_k.weight": (KV * hd, D),
                     p + "attn_v.weight": (KV * hd, D), p + "attn_output.weight": (D, H * hd),
                     p + "ffn_gate.weight": (F, D), p + "ffn_up.weight": (F, D), p + "ffn_down.weight": (D, F)})
        if cfg.qkv_bias:
            want.update({p + "attn_q.bias": (H * hd,), p + "attn_k.bias": (KV * hd,), p + "attn_v.bias": (KV * hd,)})
        if cfg.qk_norm:
            want.update({p + "attn_q_norm.weight": (hd,), p + "attn_k_norm.weight": (hd,)})
        if cfg.sandwich_norm:
            want.update({p + "post_attention_norm.weight": (D,), p + "post_ffw_norm.weight": (D,)})
    for name, shape in want.items():
        t = g.info(name)
        if tuple(t.shape) != shape:
            raise MtpllmError(f"{g.path}: tensor '{name}' has shape {list(t.shape)}, expected {list(shape)} "
                              f"(width {D}, {H} heads of {hd}, {KV} kv heads, FFN {F}, vocabulary {V})")
        if t.qtype not in SUPPORTED_TYPES or (len(shape) == 2 and t.qtype in MATRIX_UNSUPPORTED):
            raise MtpllmError(f"{g.path}: tensor '{name}' has type {t.qtype.name}, which is not supported"
                              + (" for a matrix" if t.qtype in SUPPORTED_TYPES else ""))
    tokens = g.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) > V:
        raise MtpllmError(f"{g.path}: metadata 'tokenizer.ggml.tokens' has {len(tokens)} tokens but the embedding "
                          f"'token_embd.weight' has only {V} rows")


