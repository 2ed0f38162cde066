"""`mtpllm inspect FILE`: what is inside a GGUF file (gguf-dump with MTP detection).

Metadata (long arrays summarized), the tensor table, an architecture summary, the tokenizer and
chat template, RoPE/YaRN settings, MTP layers (in-file next-n blocks or a head-only file) and a
size breakdown by tensor type and by role. `--json` gives the same as one JSON document.
"""
from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..errors import MtpllmError
from ..gguf.reader import GGUFFile

ARRAY_PREVIEW = 8  # array metadata longer than this is summarized (vocabularies have 150k+ entries)


def _summarize_value(v: Any) -> Any:
    if isinstance(v, list) and len(v) > ARRAY_PREVIEW:
        kinds = sorted({type(x).__name__ for x in v})
        return {"array": "/".join(kinds), "length": len(v), "head": v[:3]}
    if isinstance(v, str) and len(v) > 400:
        return v[:200] + f"... ({len(v)} characters)"
    return v


def tensor_role(name: str, mtp_blocks: set[int]) -> str:
    """Coarse role of a tensor for the size breakdown."""
    m = re.match(r"blk\.(\d+)\.", name)
    if m and int(m.group(1)) in mtp_blocks:
        return "mtp"
    if name.startswith("token_embd"):
        return "embedding"
    if name.startswith("output.") or name == "output_norm.weight":
        return "output" if name.startswith("output.") else "norm"
    if "norm" in name:
        return "norm"
    if ".attn_" in name:
        return "attention"
    if ".ffn_" in name:
        return "ffn"
    return "other"


def mtp_info(g: GGUFFile) -> dict:
    """MTP layers of a file: in-file next-n blocks (llama.cpp layout) or a head-only file."""
    arch = g.get("general.architecture", "?")
    n = g.get(f"{arch}.nextn_predict_layers", 0)
    n = n if isinstance(n, int) else 0  # a damaged value: config_from_gguf names it
    blocks = sorted({int(m.group(1)) for t in g.tensors if (m := re.match(r"blk\.(\d+)\.nextn\.", t))})
    head_only = bool(blocks) and "token_embd.weight" not in g
    info: dict[str, Any] = {"present": bool(blocks) and n > 0, "nextn_predict_layers": n, "blocks": blocks,
                            "kind": "none" if not blocks else ("head-only file" if head_only else "in-file layers")}
    if blocks and n <= 0:
        info["problem"] = f"blk.*.nextn.* tensors present but {arch}.nextn_predict_layers is {n}"
    elif n > 0 and not blocks:
        info["problem"] = f"{arch}.nextn_predict_layers = {n} but no blk.*.nextn.* tensors"
    for key in ("mtpllm.trunk_sha256", "mtpllm.train.data", "mtpllm.train.steps", "mtpllm.train.history",
                "mtpllm.eval.mean_acceptance_length", "mtpllm.eval.per_position"):
        if key in g.metadata:
            info[key.removeprefix("mtpllm.")] = g.metadata[key]
    if isinstance(g.get("mtpllm.draft_vocab"), list):
        info["draft_vocab_size"] = len(g.metadata["mtpllm.draft_vocab"])
    if info["present"]:
        from ..speculative.mtp import head_window
        try:
            info["attention_window"] = head_window(g)  # 0: every position
        except MtpllmError as e:
            info["problem"] = str(e)
    return info


def inspect_file(path: str | Path) -> dict:
    """Everything `inspect` reports, as plain data."""
    g = GGUFFile(path)
    arch = g.get("general.architecture", None)
    mtp = mtp_info(g)
    out: dict[str, Any] = {
        "file": {"path": str(g.path), "size": g.file_size, "gguf_version": g.version, "alignment": g.alignment,
                 "data_offset": g.data_offset, "n_tensors": len(g.tensors), "n_metadata": len(g.metadata)},
        "metadata": {k: _summarize_value(v) for k, v in g.metadata.items()},
        "tensors": [{"name": t.name, "type": t.qtype.name, "shape": list(t.shape), "bytes": t.n_bytes,
                     "offset": t.offset} for t in g.tensors.values()],
        "mtp": mtp,
    }
    # architecture summary (a head-only file has no embedding: describe what it has)
    try:
        from ..models.config import config_from_gguf
        cfg = config_from_gguf(g)
        d = asdict(cfg)
        d["swa_layers"] = sum(cfg.swa_layers) if cfg.swa_layers else 0
        n_params = sum(_numel(t.shape) for t in g.tensors.values())
        out["architecture"] = dict(d, n_params=n_params)
        if hasattr(cfg, "layer_pattern"):  # a hybrid: which layers keep a KV cache, which a recurrent state
            out["architecture"]["recurrent"] = cfg.n_recurrent
            out["architecture"]["layer_pattern"] = cfg.layer_pattern()
            out["architecture"]["recurrent_state_bytes"] = cfg.recurrent_bytes()
            out["architecture"]["kv_bytes_per_token"] = cfg.cache_bytes(1) - cfg.recurrent_bytes()
        out["rope"] = dict(asdict(cfg.rope), context_length=cfg.ctx_len)
    except MtpllmError as exc:
        if mtp["kind"] == "head-only file":  # no trunk here: describe the head's own shape
            p = f"{arch}."
            out["architecture"] = {"arch": arch, "head_only": True,
                                   **{k: g.get(p + key) for k, key in (
                                       ("d_model", "embedding_length"), ("n_heads", "attention.head_count"),
                                       ("n_kv_heads", "attention.head_count_kv"),
                                       ("ffn_dim", "feed_forward_length"), ("vocab_size", "vocab_size"))},
                                   "n_params": sum(_numel(t.shape) for t in g.tensors.values())}
        else:
            out["architecture"] = {"arch": arch, "error": str(exc).replace(str(g.path) + ": ", "")}
        p = f"{arch}."
        out["rope"] = {k.removeprefix(p): v for k, v in g.metadata.items() if k.startswith(p + "rope")}
    # tokenizer
    tok = {k.removeprefix("tokenizer.ggml."): _summarize_value(v) for k, v in g.metadata.items()
           if k.startswith("tokenizer.ggml.")}
    tokens = g.get("tokenizer.ggml.tokens") or []
    for key in ("bos_token_id", "eos_token_id", "padding_token_id", "eot_token_id"):
        i = g.get(f"tokenizer.ggml.{key}")
        if isinstance(i, int) and 0 <= i < len(tokens):
            tok[key.replace("_id", "")] = tokens[i]
    tok["vocab_size"] = len(tokens)
    template = g.get("tokenizer.chat_template")
    tok["chat_template"] = template
    out["tokenizer"] = tok
    # size breakdown
    by_type: dict[str, int] = defaultdict(int)
    by_role: dict[str, int] = defaultdict(int)
    mtp_blocks = set(mtp["blocks"])
    for t in g.tensors.values():
        by_type[t.qtype.name] += t.n_bytes
        by_role[tensor_role(t.name, mtp_blocks)] += t.n_bytes
    tensor_bytes = sum(by_type.values())
    out["size"] = {"tensor_bytes": tensor_bytes, "header_bytes": g.data_offset,
                   "by_type": dict(sorted(by_type.items(), key=lambda x: -x[1])),
                   "by_role": dict(sorted(by_role.items(), key=lambda x: -x[1]))}
    return out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def format_text(r: dict, all_tensors: bool = False) -> str:
    lines = []
    f = r["file"]
    lines.append(f"file: {f['path']}  ({_mib(f['size'])}, GGUF v{f['gguf_version']}, {f['n_tensors']} tensors, "
                 f"{f['n_metadata']} metadata keys, alignment {f['alignment']})")
    a = r["architecture"]
    lines.append("\n== architecture")
    if "error" in a:
        lines.append(f"  {a['arch']}: {a['error']}")
    elif a.get("head_only"):
        lines.append(f"  {a['arch']} MTP head only (no trunk): d_model {a['d_model']}, heads {a['n_heads']}/"
                     f"{a['n_kv_heads']}, ffn {a['ffn_dim']}, vocab {a['vocab_size']}, "
                     f"{a['n_params'] / 1e6:.1f}M parameters")
    else:
        lines.append(f"  {a['arch']}: {a['n_layers']} layers, d_model {a['d_model']}, heads {a['n_heads']}/"
                     f"{a['n_kv_heads']} (head dim {a['head_dim']}), ffn {a['ffn_dim']}, vocab {a['vocab_size']}, "
                     f"training context {a['ctx_len']}, {a['n_params'] / 1e6:.0f}M parameters")
        extras = [k for k in ("qkv_bias", "qk_norm", "sandwich_norm", "tied_embeddings") if a.get(k)]
        if a.get("sliding_window"):
            extras.append(f"sliding window {a['sliding_window']} on {a['swa_layers']} layers")
        if extras:
            lines.append("  " + ", ".join(extras))
        if a.get("layer_pattern"):
            n_att = a["n_layers"] - a["recurrent"]
            lines.append(f"  layers: {a['layer_pattern']} (L = Gated DeltaNet, A = gated full attention): "
                         f"{a['recurrent']} linear, {n_att} full attention")
            lines.append(f"  DeltaNet: {a['ssm_k_heads']} key / {a['ssm_v_heads']} value heads, head dims "
                         f"{a['ssm_k_dim']}/{a['ssm_v_dim']}, conv kernel {a['conv_kernel']}")
            if a.get("n_experts"):
                lines.append(f"  MoE: {a['n_experts']} experts, {a['n_experts_used']} used, expert ffn "
                             f"{a['expert_ffn']}, shared expert ffn {a['shared_ffn']}")
            lines.append(f"  state per sequence: KV {a['kv_bytes_per_token']:,d} bytes per token (attention and "
                         f"MTP layers) + recurrent {_mib(a['recurrent_state_bytes'])} (context-independent, "
                         f"with the state and rows speculation rolls back to)")
    lines.append("\n== rope")
    lines.append("  " + ", ".join(f"{k} {v}" for k, v in r["rope"].items()))
    m = r["mtp"]
    lines.append("\n== mtp")
    if m["present"]:
        lines.append(f"  {m['kind']}: {m['nextn_predict_layers']} next-n layer(s), blocks {m['blocks']}")
        for k in ("trunk_sha256", "train.data", "train.steps", "train.history", "eval.mean_acceptance_length",
                  "eval.per_position", "draft_vocab_size", "attention_window"):
            if k == "train.history" and isinstance(m.get(k), list):
                lines.append(f"  train.history: fine-tuned from {len(m[k])} earlier run(s), latest first:")
                lines.extend(f"    - {h}" for h in reversed(m[k]))
            elif k == "attention_window" and k in m:
                lines.append(f"  attention_window: {m[k] or 'all positions'}"
                             + (" (the head attends over the last positions of its cache only)" if m[k] else ""))
            elif k in m:
                lines.append(f"  {k}: {m[k]}")
    else:
        lines.append("  none: this file has no MTP layers (use a head file with --mtp-head, train one with "
                     "`mtpllm train-mtp`, or use --spec-type ngram-simple)")
    if "problem" in m:
        lines.append(f"  problem: {m['problem']}")
    t = r["tokenizer"]
    lines.append("\n== tokenizer")
    if not t["vocab_size"]:
        lines.append("  none in this file")
    else:
        lines.append(f"  model {t.get('model')}, pre {t.get('pre')}, {t['vocab_size']} tokens, bos {t.get('bos')!r}, "
                     f"eos {t.get('eos')!r}, add_bos {t.get('add_bos_token')}")
        tmpl = t.get("chat_template")
        lines.append(f"  chat template: {'none' if not tmpl else str(len(tmpl)) + ' characters'}")
    lines.append("\n== metadata")
    for k, v in r["metadata"].items():
        if k.startswith("tokenizer.") or k == "mtpllm.draft_vocab":
            continue
        lines.append(f"  {k} = {v}")
    s = r["size"]
    lines.append("\n== size")
    lines.append("  by type: " + ", ".join(f"{k} {_mib(v)}" for k, v in s["by_type"].items()))
    lines.append("  by role: " + ", ".join(f"{k} {_mib(v)}" for k, v in s["by_role"].items()))
    lines.append(f"  header {_mib(s['header_bytes'])}, tensors {_mib(s['tensor_bytes'])}")
    tensors = r["tensors"]
    lines.append(f"\n== tensors ({len(tensors)})")
    shown = tensors if all_tensors or len(tensors) <= 40 else tensors[:20] + tensors[-12:]
    for i, x in enumerate(shown):
        if not all_tensors and len(tensors) > 40 and i == 20:
            lines.append(f"  ... {len(tensors) - 32} more (--all to list every tensor)")
        lines.append(f"  {x['name']:<40} {x['type']:<6} {str(x['shape']):<18} {x['bytes']:>12,d}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="mtpllm inspect",
                                 description="Show what a GGUF file holds: metadata, tensors, architecture, "
                                             "tokenizer, RoPE/YaRN, MTP layers, size breakdown.")
    ap.add_argument("file", help="GGUF file (model or head-only mtp-*.gguf) or a registry model name")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    ap.add_argument("--all", action="store_true", help="list every tensor")
    a = ap.parse_args(argv)
    from ..registry import REGISTRY, resolve_model
    path = resolve_model(a.file) if a.file in REGISTRY else a.file
    r = inspect_file(path)
    if a.json:
        print(json.dumps(r, indent=1, default=str))
    else:
        print(format_text(r, a.all))
    return 0
