"""Model configuration read from GGUF metadata, as a validated dataclass."""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, fields

from ..errors import MtpllmError
from ..gguf.reader import GGUFFile


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
        if self.base <= 0:
            raise MtpllmError(f"rope freq base must be > 0, got {self.base}")
        if self.scaling not in ("none", "linear", "yarn"):
            raise MtpllmError(f"rope scaling must be none|linear|yarn, got '{self.scaling}'")
        if self.scaling != "none" and not self.factor > 0:
            raise MtpllmError(f"rope scale factor must be > 0, got {self.factor}")
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

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Build from a dict, ignoring unknown keys with a warning."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            warnings.warn(f"ModelConfig: ignoring unknown keys {unknown}")
        d = {k: v for k, v in d.items() if k in known}
        if isinstance(d.get("rope"), dict):
            d["rope"] = RopeConfig(**d["rope"])
        return cls(**d)


def _swa_pattern(n_layers: int, period: int) -> tuple[bool, ...]:
    # every `period`-th layer is global (full attention), the others use the sliding window
    return tuple((i + 1) % period != 0 for i in range(n_layers))


def config_from_gguf(g: GGUFFile) -> ModelConfig:
    arch = g.arch
    from .base import ARCHITECTURES  # noqa: local import, the registry lives with the models
    if arch not in ARCHITECTURES:
        raise MtpllmError(f"{g.path}: architecture '{arch}' is not supported "
                          f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    p = arch + "."
    block_count = int(g.require(p + "block_count"))
    n_nextn = int(g.get(p + "nextn_predict_layers", 0))
    d_model = int(g.require(p + "embedding_length"))
    n_heads = int(g.require(p + "attention.head_count"))
    n_kv = g.get(p + "attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):
        raise MtpllmError(f"{g.path}: per-layer head_count_kv is not supported")
    head_dim = int(g.get(p + "attention.key_length", d_model // n_heads))
    emb = g.info("token_embd.weight")
    vocab = emb.shape[0]
    n_layers = block_count - n_nextn
    scaling = str(g.get(p + "rope.scaling.type", "none") or "none")
    rope = RopeConfig(
        base=float(g.get(p + "rope.freq_base", 10000.0)),
        dim=int(g.get(p + "rope.dimension_count", head_dim)),
        style="normal" if arch == "llama" else "neox",
        scaling=scaling,
        factor=float(g.get(p + "rope.scaling.factor", 1.0) or 1.0),
        orig_ctx=int(g.get(p + "rope.scaling.original_context_length", 0) or 0),
    )
    cfg = dict(
        arch=arch, n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=int(n_kv),
        head_dim=head_dim, ffn_dim=int(g.require(p + "feed_forward_length")), vocab_size=vocab,
        ctx_len=int(g.require(p + "context_length")),
        norm_eps=float(g.get(p + "attention.layer_norm_rms_epsilon", 1e-6)), rope=rope, n_nextn=n_nextn,
        tied_embeddings="output.weight" not in g,
    )
    mod = ARCHITECTURES[arch]
    mod.adjust_config(g, cfg)
    return getattr(mod, "CONFIG", ModelConfig)(**cfg)
