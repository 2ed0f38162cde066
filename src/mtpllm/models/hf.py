"""Hugging Face checkpoints of whole models, read in place: no conversion step.

`HFModelFile` opens a model directory (sharded with `model.safetensors.index.json`, or plain
`*.safetensors` files), an index file or a single `.safetensors` file, and answers the calls a
`GGUFFile` answers (`arch`, `get`, `require`, `info`, `raw`, `load`, `in`, `metadata`) with
llama.cpp's GGUF tensor names and metadata keys, so one builder per architecture serves both
formats. Tensors are read lazily and transformed on reading exactly as llama.cpp's
`convert_hf_to_gguf.py` writes them, so a checkpoint and its converted GGUF give the same logits:

  - zero-centred RMSNorm weights (every `*norm.weight` but the DeltaNet output norm) get +1;
  - `A_log` becomes `ssm_a = -exp(A_log)`, `dt_bias` is `ssm_dt.bias`, the conv kernel [C, 1, K] -> [C, K];
  - qwen35/qwen35moe: DeltaNet value heads from grouped to tiled order (qkv rows, z rows, beta/alpha
    rows, A, dt_bias, the conv kernel's value channels, out_proj columns);
  - qwen3next: `in_proj_qkvz` (per key head [q, k, v x r, z x r]) split into `attn_qkv` + `attn_gate`;
  - routed experts stacked [E, N, K] (`gate_up_proj` split in gate and up; per-expert files stacked);
  - the MTP layer `mtp.*` becomes block `n_layers` with `nextn.*` tensors.

Every tensor comes back float32. The tokenizer comes from `tokenizer.json` (`tokenizer_metadata`).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from ..errors import MtpllmError
from ..gguf.reader import TensorInfo
from ..speculative.hf_mtp import FLOAT_DTYPES, HFMTPFile

# config.json model_type -> our architecture
MODEL_TYPES = {
    "qwen3_5": "qwen35", "qwen3_5_text": "qwen35", "qwen3_5_moe": "qwen35moe", "qwen3_5_moe_text": "qwen35moe",
    "qwen3_next": "qwen3next", "qwen2": "qwen2", "qwen3": "qwen3", "llama": "llama",
}
HYBRID = ("qwen35", "qwen35moe", "qwen3next")
MAX_CONFIG_BYTES = 1 << 20  # config.json / tokenizer_config.json are small; a larger one is not a config
MAX_TOKENIZER_BYTES = 256 << 20


def is_hf_checkpoint(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() or p.name.endswith(".safetensors") or p.name.endswith(".safetensors.index.json")


def _read_json(f: Path, limit: int = MAX_CONFIG_BYTES) -> dict:
    try:
        if f.stat().st_size > limit:
            raise MtpllmError(f"{f}: {f.stat().st_size} bytes, more than a {f.name} can be ({limit})")
        d = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise MtpllmError(f"{f}: not readable JSON ({exc})") from None
    if not isinstance(d, dict):
        raise MtpllmError(f"{f}: expected a JSON object")
    return d


def _reorder_v_heads(t: torch.Tensor, dim: int, n_k: int, r: int, hd: int) -> torch.Tensor:
    """Value heads along `dim` from grouped [k0: v0..v(r-1), k1: ...] to tiled [v0 of k0, v0 of k1, ...]."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], n_k, r, hd, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


class HFModelFile(HFMTPFile):
    """A whole Hugging Face checkpoint of a supported architecture (the hybrids, and dense Qwen2,
    Qwen3, Llama without rope scaling), readable like a GGUF file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._handles: dict[Path, object] = {}
        self._where = self._index()  # HF tensor name -> shard file
        d = self.path if self.path.is_dir() else self.path.parent
        self.dir = d
        if not (d / "config.json").exists():
            raise MtpllmError(f"{d}: no config.json beside the safetensors files (needed for the architecture)")
        top = _read_json(d / "config.json")
        text = top.get("text_config")
        cfg = dict(top, **text) if isinstance(text, dict) else top
        self.config = cfg
        mt = str(cfg.get("model_type", ""))
        if mt not in MODEL_TYPES:
            raise MtpllmError(f"{d}: model_type '{mt}' is not supported from safetensors (supported: "
                              f"{', '.join(sorted(MODEL_TYPES))}); convert it to GGUF with llama.cpp instead")
        self.arch_name = MODEL_TYPES[mt]
        self._build(cfg)

    # ---- layout -----------------------------------------------------------------------
    def _int(self, cfg: dict, key: str, default=None) -> int:
        v = cfg.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise MtpllmError(f"{self.dir}/config.json: '{key}' must be a positive integer, got {v!r}")
        return v

    def _build(self, cfg: dict) -> None:
        from .base import ARCHITECTURES
        arch = self.arch_name
        mod = ARCHITECTURES[arch]
        names = self._where
        emb = next((n for n in names if n.endswith("embed_tokens.weight") and not n.startswith("mtp.")), None)
        if emb is None:
            raise MtpllmError(f"{self.path}: no '*embed_tokens.weight' tensor: not a language model checkpoint")
        pre = emb[:-len("embed_tokens.weight")]  # "model." or "model.language_model."
        n = self._int(cfg, "num_hidden_layers")
        D = self._int(cfg, "hidden_size")
        self.n_layers = n
        hybrid = arch in HYBRID
        if hybrid:
            nk, nv = self._int(cfg, "linear_num_key_heads"), self._int(cfg, "linear_num_value_heads")
            dk, dv = self._int(cfg, "linear_key_head_dim"), self._int(cfg, "linear_value_head_dim")
        else:
            nk = nv = dk = dv = 1
            rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
            if rope.get("rope_type", "default") != "default":
                raise MtpllmError(f"{self.dir}/config.json: rope_type '{rope.get('rope_type')}' is not supported "
                                  f"from safetensors; convert the model to GGUF with llama.cpp")
        if nv % nk:
            raise MtpllmError(f"{self.dir}/config.json: {nv} linear value heads not a multiple of {nk} key heads")
        self._heads = (nk, nv // nk, dk, dv)
        self._tiled = arch != "qwen3next"
        mtp = any(k.startswith("mtp.") for k in names)
        n_mtp = 1 if mtp else 0
        self._map: dict[str, str] = {}  # GGUF name -> HF name
        self._experts: dict[str, tuple[str, int]] = {}  # GGUF stacked name -> (HF per-expert pattern, part)

        def add(hf: str, gg: str) -> None:
            if hf in names:
                self._map[gg] = hf

        for hf_t, gg_t in mod.HF_MAP.items():
            if "{i}" not in hf_t:
                add(pre + hf_t if hf_t != "lm_head.weight" else hf_t, gg_t)
                continue
            for i in range(n):
                add(pre + hf_t.format(i=i), gg_t.format(i=i))
        if mtp:
            for hf_t, gg_t in mod.HF_MTP_MAP.items():
                add(hf_t, gg_t.format(L=n))
            for hf_t, gg_t in mod.HF_MAP.items():
                if hf_t.startswith("layers.{i}."):
                    add("mtp.layers.0." + hf_t[len("layers.{i}."):], gg_t.format(i=n))
        # fused forms: Qwen3-Next's qkvz, gate_up of stacked experts, per-expert tensors
        for i in list(range(n)) + ([n] if mtp else []):
            lp = f"{pre}layers.{i}." if i < n else "mtp.layers.0."
            if lp + "linear_attn.in_proj_qkvz.weight" in names:
                self._map[f"blk.{i}.attn_qkv.weight"] = lp + "linear_attn.in_proj_qkvz.weight#qkv"
                self._map[f"blk.{i}.attn_gate.weight"] = lp + "linear_attn.in_proj_qkvz.weight#z"
            gu = lp + "mlp.experts.gate_up_proj"
            for suffix in ("", ".weight"):
                if gu + suffix in names:
                    self._map[f"blk.{i}.ffn_gate_exps.weight"] = gu + suffix + "#gate"
                    self._map[f"blk.{i}.ffn_up_exps.weight"] = gu + suffix + "#up"
                if lp + "mlp.experts.down_proj" + suffix in names:
                    self._map[f"blk.{i}.ffn_down_exps.weight"] = lp + "mlp.experts.down_proj" + suffix
            if lp + "mlp.experts.0.gate_proj.weight" in names:
                for part, gg in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"),
                                 ("down_proj", "ffn_down_exps")):
                    self._map[f"blk.{i}.{gg}.weight"] = f"{lp}mlp.experts.{{e}}.{part}.weight#stack"
        self._n_experts = int(cfg.get("num_experts", 0) or 0)
        # shapes (after the transforms) without reading the data
        self.tensors: dict[str, TensorInfo] = {}
        for gg in self._map:
            shape = self._shape(gg)
            self.tensors[gg] = TensorInfo(gg, QT.F32, shape, 4 * int(np.prod(shape)), 0)
        hd = int(cfg.get("head_dim") or D // self._int(cfg, "num_attention_heads"))
        rope = cfg.get("rope_parameters") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25 if hybrid else 1.0))
        types = cfg.get("layer_types") if hybrid else ["full_attention"] * n
        if types is None:
            every = int(cfg.get("full_attention_interval", 4))
            types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
        if len(types) != n or not set(types) <= {"linear_attention", "full_attention"}:
            raise MtpllmError(f"{self.dir}/config.json: layer_types must list linear_attention/full_attention "
                              f"for each of the {n} layers")
        a = arch + "."
        meta = {
            "general.architecture": arch, "general.name": str(cfg.get("_name_or_path") or self.dir.name),
            a + "block_count": n + n_mtp, a + "context_length": self._int(cfg, "max_position_embeddings"),
            a + "embedding_length": D, a + "feed_forward_length": int(cfg.get("intermediate_size") or 0)
            or int(cfg.get("moe_intermediate_size") or 0),
            a + "attention.head_count": self._int(cfg, "num_attention_heads"),
            a + "attention.head_count_kv": self._int(cfg, "num_key_value_heads"),
            a + "attention.key_length": hd, a + "attention.value_length": hd,
            # stored as float32, as in a GGUF file
            a + "attention.layer_norm_rms_epsilon": float(np.float32(cfg.get("rms_norm_eps", 1e-6))),
            a + "rope.freq_base": float(theta), a + "rope.dimension_count": int(hd * partial),
        }
        if hybrid:
            meta |= {
                a + "ssm.conv_kernel": self._int(cfg, "linear_conv_kernel_dim"), a + "ssm.state_size": dk,
                a + "ssm.group_count": nk, a + "ssm.time_step_rank": nv, a + "ssm.inner_size": nv * dv,
                a + "attention.recurrent_layers": [t == "linear_attention" for t in types] + [False] * n_mtp,
            }
        if "mrope_section" in rope:
            meta[a + "rope.dimension_sections"] = (list(rope["mrope_section"]) + [0, 0, 0, 0])[:4]
        if n_mtp:
            meta[a + "nextn_predict_layers"] = n_mtp
        if self._n_experts:
            meta[a + "expert_count"] = self._n_experts
            meta[a + "expert_used_count"] = self._int(cfg, "num_experts_per_tok")
            meta[a + "expert_feed_forward_length"] = self._int(cfg, "moe_intermediate_size")
            if cfg.get("shared_expert_intermediate_size"):
                meta[a + "expert_shared_feed_forward_length"] = int(cfg["shared_expert_intermediate_size"])
        if (self.dir / "tokenizer.json").exists():
            from ..tokenizer import tokenizer_metadata
            meta.update(tokenizer_metadata(self.dir, cfg))
        self.metadata = meta
        # zero-centred norms (x̂·(1+w)) in the hybrids only; dense Qwen2/Qwen3/Llama store w itself
        self._norms = {g for g in self._map if g.endswith("norm.weight") and not g.endswith("ssm_norm.weight")} \
            if hybrid else set()
        # llama's GGUF layout has q/k rows permuted for adjacent-pair rotary (llama.cpp's converter)
        self._permute = {}
        if arch == "llama":
            for i in range(n):
                self._permute[f"blk.{i}.attn_q.weight"] = meta[a + "attention.head_count"]
                self._permute[f"blk.{i}.attn_k.weight"] = meta[a + "attention.head_count_kv"]

    # ---- reading ----------------------------------------------------------------------
    def _hf_shape(self, hf: str) -> tuple[int, ...]:
        return tuple(self._handle(hf).get_slice(hf).get_shape())

    def _shape(self, gg: str) -> tuple[int, ...]:
        hf = self._map[gg]
        base, _, part = hf.partition("#")
        nk, r, dk, dv = self._heads
        if part == "stack":
            one = self._hf_shape(base.format(e=0))
            return (self._n_experts, *one)
        shape = self._hf_shape(base)
        if part in ("gate", "up"):
            return (shape[0], shape[1] // 2, shape[2])
        if part == "qkv":
            return (2 * nk * dk + nk * r * dv, shape[1])
        if part == "z":
            return (nk * r * dv, shape[1])
        if gg.endswith("ssm_conv1d.weight"):
            return (shape[0], shape[-1])
        return shape

    def _tensor(self, hf: str) -> torch.Tensor:
        if hf not in self._where:
            raise MtpllmError(f"{self.path}: required tensor '{hf}' is missing")
        t = self._handle(hf).get_tensor(hf)
        if t.dtype not in FLOAT_DTYPES:
            raise MtpllmError(f"{self.path}: tensor '{hf}' has type {t.dtype}; only float32/float16/bfloat16 "
                              f"checkpoints are supported (FP8 or other quantized releases are not)")
        return t.float()

    def load(self, name: str) -> torch.Tensor:
        """float32 tensor under its GGUF name, transformed as llama.cpp's converter writes it."""
        self.info(name)
        hf = self._map[name]
        base, _, part = hf.partition("#")
        nk, r, dk, dv = self._heads
        if part == "stack":
            t = torch.stack([self._tensor(base.format(e=e)) for e in range(self._n_experts)])
        else:
            t = self._tensor(base)
        if part in ("gate", "up"):
            F2 = t.shape[1] // 2
            t = t[:, :F2] if part == "gate" else t[:, F2:]
        elif part in ("qkv", "z"):  # Qwen3-Next: per key head [q dk, k dk, v r*dv, z r*dv]
            g = t.reshape(nk, 2 * dk + 2 * r * dv, -1)
            q, k, v, z = g.split([dk, dk, r * dv, r * dv], dim=1)
            t = torch.cat([x.reshape(-1, t.shape[1]) for x in (q, k, v)]) if part == "qkv" else z.reshape(-1, t.shape[1])
        if name.endswith("ssm_conv1d.weight"):
            t = t.reshape(t.shape[0], -1)
        if self._tiled and r > 1:
            t = self._tile(name, t)
        if name.endswith(".ssm_a"):
            t = -torch.exp(t)
        if name in self._norms:
            t = t + 1.0
        if name in self._permute:
            from ..speculative.hf_mtp import permute_for_adjacent_rotary
            t = permute_for_adjacent_rotary(t, self._permute[name])
        return t.contiguous()

    def _tile(self, name: str, t: torch.Tensor) -> torch.Tensor:
        nk, r, dk, dv = self._heads
        if name.endswith("attn_qkv.weight") or name.endswith("ssm_conv1d.weight"):
            qk = 2 * nk * dk
            return torch.cat([t[:qk], _reorder_v_heads(t[qk:], 0, nk, r, dv)])
        if name.endswith("attn_gate.weight"):
            return _reorder_v_heads(t, 0, nk, r, dv)
        if name.endswith(("ssm_beta.weight", "ssm_alpha.weight", ".ssm_a", "ssm_dt.bias")):
            return _reorder_v_heads(t, 0, nk, r, 1)
        if name.endswith("ssm_out.weight"):
            return _reorder_v_heads(t, 1, nk, r, dv)
        return t

    def raw(self, name: str) -> np.ndarray:
        return self.load(name).numpy()

    def release(self, name: str) -> None:
        pass


def open_model_file(path: str | Path):
    """A GGUF file, or a Hugging Face checkpoint (directory, index or .safetensors file)."""
    from ..gguf.reader import GGUFFile
    p = Path(path)
    if is_hf_checkpoint(p):
        return HFModelFile(p)
    return GGUFFile(p)
