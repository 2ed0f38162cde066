"""Kernel code paths chosen by timing them on this machine, once, and remembered on disk.

Where the C++ kernels have two ways to compute the same bits (csrc/common.h), which one is faster
depends on the CPU (its vector units, caches, memory, how many cores are really free), not on its
name. At load, for each such choice that exists for this model and build, the model's own
forward is timed at 1 and 4 rows (a decoding step and a k = 3 verification) with every option,
and the fastest is kept:

  prefetch    how far ahead of the weight stream the products prefetch (0, 1024, 2048, 4096 bytes;
              0: the lines being read only, the stream left to the hardware prefetchers): on a Zen 4
              VM 2048 bytes ahead slowed the Q6_K products to two thirds of what the memory gives
  q6_prefetch the same for the Q6_Kx8 tiles, with far prefetches into L2 among the options (an odd
              value v: v - 1 bytes ahead, into L2): on that VM the 4-row Q6_K products over a long
              K ran at 17 GB/s with no distance and at 29 with 8192 bytes ahead into L2
  grain_macs  how a product's rows are split between threads (multiply-adds per task: small
              matrices on one thread, or spread); only with more than one thread
  pair_nsb    from which K the verification tile pairs two Q4_Kx8 row groups (`x8_tile2`, the
              AVX-512 VNNI build; options: never, or from each K of the model's Q4_K matrices)
  tile_rows   rows of x per tile of the 8-row K-quant layouts above 4 rows (4 or 8; the AVX-512
              VNNI build): what several sequences' verification rows in one step cost. Timed at 8
              rows (two sequences verifying 3 drafts each); the others at 1 and 4
  attn_prefetch how decode attention prefetches the keys and values ahead of its sweep (0: the
              chunk after next into L1; 1: spread over its blocks of 8 keys, 128 positions ahead,
              into L2). Timed on the attention operator itself (`attention_timer`: 128 MiB of
              caches shaped like the model's at 4,096 positions, 1 and 4 rows), since near position
              0, where the forward is timed, attention is a small part of a step; only for models
              whose cache can grow that large

The choice is cached in `tuning.json` in the model cache (`$MTPLLM_CACHE`, ~/.cache/mtpllm;
`$MTPLLM_TUNING_CACHE` names the file), keyed by the CPU model and flags, the kernels' build
(instruction set and a digest of their sources), the thread count and the model's matrix shapes:
another machine, build or model times again. An entry that is not what it should be (unreadable
file, a checksum that does not match, a choice that is not among the options or not the fastest of
its own timings) is timed again and rewritten. MTPLLM_TUNE=0 keeps the built-in defaults.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from . import kernels

NEVER = 1 << 30  # pair_nsb: no K is long enough
PREFETCH_OPTIONS = (0, 1024, 2048, 4096)  # 2048: the former fixed distance
Q6_PREFETCH_OPTIONS = (0, 2048, 4097, 8193, 16385)  # odd: (v - 1) bytes ahead into L2
GRAIN_OPTIONS = (65536, 262144, 1048576)
ATTN_PREFETCH_OPTIONS = (0, 1)  # 0: the former (the chunk after next into L1); 1: spread, into L2
ROWS = (1, 4)
ROWS_OF = {"tile_rows": (8,)}  # the row counts a choice changes, where not ROWS
TILE_ROWS = (4, 8)
REPS = 5
VERSION = 1


def cache_path() -> Path:
    p = os.environ.get("MTPLLM_TUNING_CACHE")
    if p:
        return Path(p)
    from ..registry import cache_dir
    return cache_dir() / "tuning.json"


def _cpu_identity() -> dict:
    name, flags = "?", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name == "?":
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {"cpu": name, "flags": hashlib.sha256(flags.encode()).hexdigest()[:16]}


def _gguf_linears(model):
    from .linear import Linear
    return [m for m in model.modules() if isinstance(m, Linear) and m.kind == "gguf"]


def shapes(model) -> list:
    """The model's kernel products: (types, rows, K) each, sorted."""
    return sorted({(tuple(int(t) for t in m._gt), int(m.out_features), int(m.in_features))
                   for m in _gguf_linears(model)})


def choices(model) -> dict[str, list[int]]:
    """The choices that exist for this model on this build and thread count, with their options."""
    out = {"prefetch": list(PREFETCH_OPTIONS)}  # first: the others are timed on its choice
    if any(kernels.Q6_KX8 in m._gt for m in _gguf_linears(model)):
        out["q6_prefetch"] = list(Q6_PREFETCH_OPTIONS)
    if torch.get_num_threads() > 1:
        out["grain_macs"] = list(GRAIN_OPTIONS)
    if kernels.paired_tiles():
        nsbs = {m.in_features // 256 for m in _gguf_linears(model) if kernels.Q4_KX8 in m._gt}
        opts = sorted({NEVER} | {n - 1 for n in nsbs})  # pair_nsb = n - 1: paired from K = 256 n on
        if len(opts) > 1:
            out["pair_nsb"] = opts
        if any(kernels.Q4_KX8 in m._gt or kernels.Q6_KX8 in m._gt for m in _gguf_linears(model)):
            out["tile_rows"] = list(TILE_ROWS)
    if attention_shape(model) is not None:
        out["attn_prefetch"] = list(ATTN_PREFETCH_OPTIONS)
    return out


# Attention choices are timed deep in a context: caches of ATTN_BYTES in all (more than a last-level
# cache holds, so they come from memory as a long context's do) at ATTN_DEPTH positions
ATTN_DEPTH, ATTN_BYTES = 4096, 128 << 20


def attention_shape(model) -> tuple[int, int, int] | None:
    """(query heads, kv heads, head size) of the model's decode attention where the kernels' query-
    parallel attention runs it (head size a multiple of 8) and its cache can reach ATTN_BYTES
    (float32 keys and values of every attention layer at the model's context length), else None:
    a smaller cache stays in the CPU's caches, where how it is prefetched matters little."""
    cfg = getattr(model, "cfg", None)
    H, KV, D = (int(getattr(cfg, n, 0) or 0) for n in ("n_heads", "n_kv_heads", "head_dim"))
    if not (H and KV and D) or D % 8 or H % KV:
        return None
    n_attn = int(getattr(cfg, "n_layers", 0) or 0) - sum(bool(r) for r in getattr(cfg, "recurrent", ()) or ())
    if 2 * KV * D * 4 * n_attn * int(getattr(cfg, "ctx_len", 0) or 0) < ATTN_BYTES:
        return None
    return H, KV, D


def attention_timer(model, rows=ROWS):
    """ms of decode attention (`kernels.attend_cached`) over layers of caches at ATTN_DEPTH positions,
    shaped like the model's, at each row count in `rows`, added up."""
    H, KV, D = attention_shape(model)
    L = ATTN_DEPTH + max(rows)
    layers = max(2, -(-ATTN_BYTES // (2 * KV * L * D * 4)))
    caches = [(torch.full((KV, L, D), 0.01), torch.full((KV, L, D), 0.02)) for _ in range(layers)]
    ang = torch.outer(torch.arange(L).float(), 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D))
    cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
    qkv = {r: torch.full((r, (H + 2 * KV) * D), 0.1) for r in rows}

    def run() -> float:
        total = 0.0
        for r in rows:
            t0 = time.perf_counter()
            for kc, vc in caches:
                kernels.attend_cached(qkv[r], cos, sin, kc, vc, ATTN_DEPTH, H, KV, D, D, True, D ** -0.5, None, None,
                                      1e-6, 0)
            total += time.perf_counter() - t0
        return total * 1e3
    return run


def forward_timer(model, rows=ROWS):
    """ms of the model's forward at each row count in `rows`, added up (a scratch cache, reset)."""
    cache = model.make_cache(max(rows) + 1)
    toks = {r: torch.ones(r, dtype=torch.long) for r in rows}

    @torch.inference_mode()
    def run() -> float:
        total = 0.0
        for r in rows:
            t0 = time.perf_counter()
            model(toks[r], cache)
            total += time.perf_counter() - t0
            cache.reset()
        return total * 1e3
    return run


# choices timed on their own operator instead of the model's forward (near position 0, where
# attention is a small part of a step)
TIMERS = {"attn_prefetch": attention_timer}


def _check(key: dict, choice, ms: dict) -> str:
    return hashlib.sha256(json.dumps([key, choice, ms], sort_keys=True).encode()).hexdigest()[:32]


def valid_entry(entry, key: dict, options: list[int]) -> bool:
    """An entry is used only if it is for this key, intact, and its choice is the fastest of its own timings."""
    try:
        ms, choice = entry["ms"], entry["choice"]
        if entry["key"] != key or entry["check"] != _check(key, choice, ms):
            return False
        if sorted(ms) != sorted(str(o) for o in options) or choice not in options:
            return False
        vals = [float(v) for v in ms.values()]
        if not all(math.isfinite(v) and v > 0 for v in vals):
            return False
        return float(ms[str(choice)]) == min(vals)
    except (KeyError, TypeError, ValueError, AttributeError):
        return False


def _load(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("entries"), dict):
        return {}
    return data["entries"]


def _save(path: Path, entries: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"version": VERSION, "entries": entries}, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache: the choice is timed again next time


def tune(model, path: Path | None = None, timer=None, reps: int = REPS) -> dict:
    """Choose every kernel choice that exists for `model` (cached, or timed now) and apply it.
    timer(name, value) -> ms, when given, replaces the timing of the model's forward (tests).
    Returns {name: {"choice": value, "ms": {option: ms}, "cached": bool}}."""
    path = path or cache_path()
    opts = choices(model)
    if not opts:
        return {}
    base = {**_cpu_identity(), "build": kernels.build_id(), "threads": torch.get_num_threads(),
            "shapes": hashlib.sha256(json.dumps(shapes(model)).encode()).hexdigest()[:16], "version": VERSION}
    entries = _load(path)
    runs = {}
    out, changed = {}, False
    for name, options in opts.items():
        key = {**base, "choice": name, "options": options}
        if name in TIMERS:  # timed on its own operator: keyed by what that operator sees
            key["attention"] = list(attention_shape(model)) + [ATTN_DEPTH, ATTN_BYTES]
        kid = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        entry = entries.get(kid)
        if valid_entry(entry, key, options):
            kernels.tuning(name, entry["choice"])
            out[name] = {"choice": entry["choice"], "ms": entry["ms"], "cached": True}
            continue
        best = {o: math.inf for o in options}
        old = kernels.tuning(name)
        rows = ROWS_OF.get(name, ROWS)
        make = TIMERS.get(name, forward_timer)
        if timer is None and (make, rows) not in runs:
            runs[make, rows] = make(model, rows)
        run = runs.get((make, rows))
        try:
            for _ in range(reps if timer is None else 1):  # options interleaved: drift falls on all alike
                for o in options:
                    kernels.tuning(name, o)
                    best[o] = min(best[o], float(timer(name, o)) if timer is not None else run())
        except Exception:
            kernels.tuning(name, old)
            raise
        if name in TIMERS:
            runs.pop((make, rows), None)  # its own caches (ATTN_BYTES) are not kept past its timing
        choice = min(options, key=lambda o: (best[o], options.index(o)))
        ms = {str(o): best[o] for o in options}
        kernels.tuning(name, choice)
        entries[kid] = {"key": key, "choice": choice, "ms": ms, "check": _check(key, choice, ms)}
        out[name] = {"choice": choice, "ms": ms, "cached": False}
        changed = True
    if changed:
        _save(path, entries)
    return out


def tune_at_load(model) -> None:
    """`tune` for a model just loaded on the compressed kernels, unless MTPLLM_TUNE=0. A failure keeps
    the defaults with a warning: it never stops a load."""
    if os.environ.get("MTPLLM_TUNE", "1") == "0" or not kernels.available():
        return
    if not _gguf_linears(model):
        return
    try:
        with kernels.slow_notice(f"timing the kernels' alternative paths on this CPU (first load only; cached "
                                 f"in {cache_path()})"):
            tune(model)
    except Exception as e:  # noqa: BLE001
        print(f"mtpllm: warning: timing the kernel choices failed, keeping the defaults ({type(e).__name__}: {e})",
              file=sys.stderr)
