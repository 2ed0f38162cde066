"""MTP weights from Hugging Face safetensors, presented under llama.cpp's GGUF names.

`HFMTPFile` reads the MTP tensors of a `.safetensors` file or of a model directory (sharded with
`model.safetensors.index.json`, or plain `*.safetensors` files) lazily, and answers the same calls
as `GGUFFile` (`get`, `require`, `info`, `raw`, `load`, `in`) under the names `blk.L.*` and
`blk.L.nextn.*`, so `load_mtp_head` and `build_block` build the head with the same code and the
same checks as for a GGUF head. Every tensor comes back as float32.

Naming families (the module is the same: proj(concat[enorm(embed(t)), hnorm(h)]) -> block -> norm):

| family | MTP tensors | block | norms |
|---|---|---|---|
| Qwen3-Next / Qwen3.5 | `mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.norm` | `mtp.layers.0.*` | zero-centred `x̂·(1+w)` |
| DeepSeek-V3 / GLM-4.5 | `model.layers.L.{eh_proj,enorm,hnorm,shared_head.norm,shared_head.head}` | `model.layers.L.*` | plain `x̂·w` |

L is `num_hidden_layers` from `config.json` (the MTP layer follows the trunk layers); without a
config it is the lowest layer that has an `eh_proj`. Both families concatenate the embedding part
first (vLLM `qwen3_next_mtp.py`, `deepseek_mtp.py`). Zero-centred norm weights get +1 here, so the
plain `RMSNorm` computes the same thing; a Gemma `model_type` in `config.json` is zero-centred too.

GGUF's llama architecture stores q/k rows permuted for adjacent-pair rotary (llama.cpp's converter);
Hugging Face stores them for rotate-half. For a trunk with that rotary style the same permutation is
applied here; qwen2/qwen3/gemma3 are not permuted.

The files are untrusted input: the `safetensors` library checks each header (its size, offsets,
dtypes, shapes against the file); here an index may only name shard files inside its own directory,
JSON files are read only up to a size limit and the values taken from `config.json` are type- and
range-checked.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from ..errors import MtpllmError
from ..gguf.reader import TensorInfo

INDEX_NAME = "model.safetensors.index.json"
QWEN_MARK = "mtp.fc.weight"
DEEPSEEK_MARK = re.compile(r"^(.*?)layers\.(\d{1,6})\.eh_proj\.weight$")
MAX_JSON_BYTES = 64 << 20  # config.json / index: real ones are kilobytes to a few megabytes
ZERO_CENTRED_TYPES = ("qwen3_next", "qwen3_5", "gemma")  # config.json model_type prefixes with x̂·(1+w) norms
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# block tensors: Hugging Face suffix -> GGUF suffix
_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# Gemma-style sandwich blocks name their norms differently
_SANDWICH = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
_QWEN_NEXTN = {
    "mtp.fc.weight": "eh_proj.weight", "mtp.pre_fc_norm_embedding.weight": "enorm.weight",
    "mtp.pre_fc_norm_hidden.weight": "hnorm.weight", "mtp.norm.weight": "shared_head_norm.weight",
    "mtp.embed_tokens.weight": "embed_tokens.weight",
}
_DEEPSEEK_NEXTN = {
    "eh_proj.weight": "eh_proj.weight", "enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
    "shared_head.norm.weight": "shared_head_norm.weight", "shared_head.head.weight": "shared_head_head.weight",
    "embed_tokens.weight": "embed_tokens.weight",
}


def is_safetensors_source(path: Path) -> bool:
    """A directory, an index json, or a file that starts like a safetensors file (not GGUF)."""
    if path.is_dir() or path.name.endswith(".safetensors") or path.name.endswith(".safetensors.index.json"):
        return True
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError:
        return False
    return len(head) == 9 and head[:4] != b"GGUF" and head[8:9] == b"{"


def _read_json(f: Path):
    """A JSON file of at most MAX_JSON_BYTES."""
    try:
        size = f.stat().st_size
        if size > MAX_JSON_BYTES:
            raise MtpllmError(f"{f}: {size} bytes is too large for a JSON configuration file "
                              f"(at most {MAX_JSON_BYTES})")
        with open(f, "rb") as fh:
            return json.loads(fh.read(MAX_JSON_BYTES + 1))
    except (OSError, ValueError, RecursionError) as exc:
        raise MtpllmError(f"{f}: invalid JSON ({type(exc).__name__}: {exc})") from None


def permute_for_adjacent_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows of a q or k projection (or bias) from rotate-half to adjacent-pair order, as llama.cpp's converter."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class HFMTPFile:
    """The first MTP layer of a Hugging Face checkpoint, readable like a head-only GGUF file for `trunk_cfg`."""

    def __init__(self, path: str | Path, trunk_cfg, zero_centred_norms: bool | None = None):
        self.path = Path(path)
        self._handles: dict[Path, object] = {}
        self._where = self._index()  # HF tensor name -> shard file
        self.config = self._read_config()
        cfg = self.config
        self.family, block_p, nextn = self._find_layer(cfg)
        model_type = str(cfg.get("model_type", ""))
        if zero_centred_norms is None:
            zero_centred_norms = self.family == "qwen" or model_type.startswith(ZERO_CENTRED_TYPES)
        self.zero_centred = zero_centred_norms
        self._check_block_kind(block_p)
        arch = trunk_cfg.arch
        L = trunk_cfg.n_layers  # GGUF block index of the head: right after the trunk's blocks
        p = f"blk.{L}."
        self._map: dict[str, str] = {}  # GGUF name -> HF name (expected; may be absent from the files)
        for hf, gg in nextn.items():
            self._map[p + "nextn." + gg] = hf
        sandwich = block_p + "pre_feedforward_layernorm.weight" in self._where
        block = dict(_BLOCK, **(_SANDWICH if sandwich else {"post_attention_layernorm.weight": "ffn_norm.weight"}))
        for hf, gg in block.items():
            self._map[p + gg] = block_p + hf
        self._norms = {n for n in self._map if n.endswith("norm.weight")}
        self._permute = {}
        if trunk_cfg.rope.style == "normal":  # llama GGUF: q/k rows permuted for adjacent-pair rotary
            for part, heads in (("attn_q", trunk_cfg.n_heads), ("attn_k", trunk_cfg.n_kv_heads)):
                self._permute[p + part + ".weight"] = self._permute[p + part + ".bias"] = heads
        self.tensors: dict[str, TensorInfo] = {}
        for gg, hf in self._map.items():
            if hf in self._where:
                shape = tuple(self._handle(hf).get_slice(hf).get_shape())
                n = int(np.prod(shape)) if shape else 1
                self.tensors[gg] = TensorInfo(gg, QT.F32, shape, 4 * n, 0)
        eh = self.tensors.get(p + "nextn.eh_proj.weight")
        if eh is None or len(eh.shape) != 2:
            raise MtpllmError(f"{self.path}: MTP tensor '{self._map[p + 'nextn.eh_proj.weight']}' has shape "
                              f"{list(eh.shape) if eh else None}, expected [hidden, 2 x hidden]")
        self.metadata = {
            "general.architecture": arch, "general.type": "mtp-head",
            f"{arch}.block_count": L + 1, f"{arch}.nextn_predict_layers": 1,
            f"{arch}.embedding_length": int(eh.shape[0]),
        }
        vocab = cfg.get("vocab_size")
        for own in (p + "nextn.shared_head_head.weight", p + "nextn.embed_tokens.weight"):
            if own in self.tensors:
                vocab = self.tensors[own].shape[0]
        if vocab is not None:
            self.metadata[f"{arch}.vocab_size"] = int(vocab)
        known = {"qwen2": "qwen2", "qwen3": "qwen3", "llama": "llama", "gemma3": "gemma3", "gemma3_text": "gemma3"}
        if model_type in known and known[model_type] != arch:
            raise MtpllmError(f"{self.path}: MTP head is for architecture '{known[model_type]}' (config.json "
                              f"model_type '{model_type}'), the model is '{arch}'")

    # ---- files ------------------------------------------------------------------------
    def _index(self) -> dict[str, Path]:
        p = self.path
        if not p.exists():
            raise MtpllmError(f"{p}: no such file or directory")
        if p.is_file() and p.name.endswith(".index.json"):
            return self._read_index(p)
        if p.is_file():
            return {k: p for k in self._handle_for(p).keys()}
        if (p / INDEX_NAME).exists():
            return self._read_index(p / INDEX_NAME)
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise MtpllmError(f"{p}: no {INDEX_NAME} and no .safetensors files in this directory")
        where: dict[str, Path] = {}
        for f in files:
            for k in self._handle_for(f).keys():
                where[k] = f
        return where

    def _read_index(self, index: Path) -> dict[str, Path]:
        try:
            wm = _read_json(index)["weight_map"]
        except (KeyError, TypeError) as exc:
            raise MtpllmError(f"{index}: not a safetensors index (a JSON object with \"weight_map\"): {exc}") from None
        if not isinstance(wm, dict):
            raise MtpllmError(f"{index}: \"weight_map\" must map tensor names to shard files")
        where, home = {}, index.parent.resolve()
        for k, v in wm.items():
            if not isinstance(v, str) or not v or Path(v).is_absolute() or ".." in Path(v).parts:
                raise MtpllmError(f"{index}: tensor '{k}' is mapped to {v!r}: expected the name of a shard file in "
                                  f"the index's own directory")
            f = index.parent / v
            if home not in f.resolve().parents:  # a symbolic link out of the directory
                raise MtpllmError(f"{index}: shard {v!r} of tensor '{k}' lies outside the model directory {home}")
            where[k] = f
        return where

    def _handle_for(self, f: Path):
        if f not in self._handles:
            from safetensors import safe_open
            if not f.exists():
                raise MtpllmError(f"{self.path}: shard {f.name} listed in the index is missing")
            try:
                self._handles[f] = safe_open(str(f), framework="pt")
            except Exception as exc:  # safetensors raises its own error types for damaged headers
                raise MtpllmError(f"{f}: not a readable safetensors file ({exc})") from None
        return self._handles[f]

    def _handle(self, hf_name: str):
        return self._handle_for(self._where[hf_name])

    def _read_config(self) -> dict:
        d = self.path if self.path.is_dir() else self.path.parent
        f = d / "config.json"
        if not f.exists():
            return {}
        cfg = _read_json(f)
        if not isinstance(cfg, dict):
            raise MtpllmError(f"{f}: expected a JSON object")
        text = cfg.get("text_config")
        cfg = dict(cfg, **text) if isinstance(text, dict) else cfg
        for key in ("num_hidden_layers", "vocab_size"):
            v = cfg.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 24):
                raise MtpllmError(f"{f}: \"{key}\" = {str(v)[:40]}: expected a non-negative integer")
        if not isinstance(cfg.get("model_type", ""), str):
            raise MtpllmError(f"{f}: \"model_type\" must be a string")
        return cfg

    # ---- layout -----------------------------------------------------------------------
    def _find_layer(self, cfg: dict) -> tuple[str, str, dict[str, str]]:
        """(family, HF prefix of the block, HF name -> GGUF nextn suffix)."""
        names = self._where
        qwen = sorted(n[:-len(QWEN_MARK)] for n in names if n.endswith(QWEN_MARK))
        if qwen:
            pre = qwen[0]
            return "qwen", pre + "mtp.layers.0.", {pre + k: v for k, v in _QWEN_NEXTN.items()}
        found = sorted((int(m.group(2)), m.group(1)) for m in map(DEEPSEEK_MARK.match, names) if m)
        want = cfg.get("num_hidden_layers")
        if found:
            if want is not None:
                hit = [(i, pre) for i, pre in found if i == int(want)]
                if not hit:
                    raise MtpllmError(
                        f"{self.path}: config.json has num_hidden_layers = {want}, so the MTP layer should be "
                        f"'model.layers.{want}.eh_proj.weight', but eh_proj is only found in layer(s) "
                        f"{sorted({i for i, _ in found})}")
                found = hit
            i, pre = found[0]
            lp = f"{pre}layers.{i}."
            return "deepseek", lp, {lp + k: v for k, v in _DEEPSEEK_NEXTN.items()}
        L = want if want is not None else "{L}"
        hint = ""
        if any(n.startswith("model.mtp_layers.") for n in names):
            hint = " (MiMo's 'model.mtp_layers.*' layout is not supported)"
        raise MtpllmError(
            f"{self.path}: no MTP tensors found: looked for '{QWEN_MARK}' (Qwen3-Next / Qwen3.5) and "
            f"'model.layers.{L}.eh_proj.weight' (DeepSeek / GLM, L = num_hidden_layers){hint}. Quantized or "
            f"converted checkpoints often drop the MTP weights; use the original release's files")

    def _check_block_kind(self, block_p: str) -> None:
        names = [n for n in self._where if n.startswith(block_p)]
        if any(".mlp.experts." in n or ".mlp.gate.weight" in n for n in names):
            raise MtpllmError(f"{self.path}: the MTP block '{block_p}*' is a mixture-of-experts block; only "
                              f"dense blocks (mlp.gate_proj/up_proj/down_proj) are supported")
        if any(".self_attn.q_a_proj" in n or ".self_attn.kv_a_proj_with_mqa" in n for n in names):
            raise MtpllmError(f"{self.path}: the MTP block '{block_p}*' uses multi-head latent attention "
                              f"(DeepSeek MLA); only q/k/v projections are supported")

    # ---- GGUFFile interface -----------------------------------------------------------
    @property
    def arch(self) -> str:
        return self.metadata["general.architecture"]

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    def require(self, key: str):
        if key not in self.metadata:
            raise MtpllmError(f"{self.path}: required metadata key '{key}' is missing")
        return self.metadata[key]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def source_name(self, name: str) -> str:
        """The Hugging Face name behind a GGUF name."""
        return self._map.get(name, name)

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            hf = self._map.get(name, name)
            raise MtpllmError(f"{self.path}: required tensor '{hf}' is missing")
        return self.tensors[name]

    def load(self, name: str) -> torch.Tensor:
        """float32 tensor under its GGUF name: norms made plain, q/k permuted where the trunk needs it."""
        self.info(name)
        hf = self._map[name]
        try:
            t = self._handle(hf).get_tensor(hf)
        except Exception as exc:  # safetensors' own error types: a damaged or unsupported tensor
            raise MtpllmError(f"{self.path}: tensor '{hf}' cannot be read ({type(exc).__name__}: {exc})") from None
        if t.dtype not in FLOAT_DTYPES:
            raise MtpllmError(f"{self.path}: tensor '{hf}' has type {t.dtype}; only float32/float16/bfloat16 "
                              f"checkpoints are supported (FP8 or other quantized releases are not)")
        t = t.float()
        if name in self._norms and self.zero_centred:
            t = t + 1.0
        if name in self._permute:
            heads = self._permute[name]
            if t.shape[0] % (2 * heads):
                raise MtpllmError(f"{self.path}: tensor '{hf}' has {t.shape[0]} rows, not a multiple of "
                                  f"2 x {heads} heads")
            t = permute_for_adjacent_rotary(t, heads)
        return t.contiguous()

    def raw(self, name: str) -> np.ndarray:
        return self.load(name).numpy()

