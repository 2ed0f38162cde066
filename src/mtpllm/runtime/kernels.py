"""The engine's own CPU kernels (csrc/*.cpp), compiled on first use and cached.

- `gguf_linear(x, blocks, types)`: float32 activations times weights that are the GGUF file's own
  blocks (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K), read in place from the file mapping
  (csrc/gguf_blocks.cpp, the operators; the kernels in gguf_blocks.h, gguf_rows.cpp, gguf_x8.cpp and
  gguf_c32.cpp); `gguf_dequantize` decodes them to float32 (prompt chunks, embeddings);
  `gguf_repack` lays Q4_K / Q6_K out by 8 rows for their faster kernels (types `Q4_KX8`, `Q6_KX8`).
- `q8_linear(x, codes, scales, mins, group)`: the same for other types, kept as integer codes with
  per-group scales (csrc/qgemv.cpp).
- `rms_norm`, `attend_cached`: the small per-layer operators of decoding fused (csrc/attention.cpp).
- `silu_mul`, `DecodeStack`: whole decoder blocks in one call for decoding and verification
  (csrc/decode.cpp), the same arithmetic as the per-operator path.
- `HybridStack`: the same for the hybrid models' blocks (Gated DeltaNet with its recurrent state,
  gated attention, dense or mixture-of-experts feed-forward; csrc/hybrid.cpp).

The extension is built with the system C++ compiler through torch.utils.cpp_extension (ninja) into
the torch extensions cache (~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR) the first time a
model is loaded: about 30-90 s once, then a cached load. Needs an x86-64 CPU with AVX2 and FMA.
Where the CPU also has AVX-512 VNNI (with VL and BW), the same sources are built with it: the
integer dot products then use its fused instructions, on 256-bit registers, with bit-identical
results (csrc/gguf_blocks.h, MTPLLM_VNNI). The build is named by its instruction set, so a cache shared between
machines never hands one CPU another's build. MTPLLM_KERNELS_ISA=avx2 forces the AVX2 build.

While it compiles, one line on stderr says so, with a dot every few seconds and the seconds it
took at the end; a cached load prints nothing. The build runs `ninja`: when the `ninja` wheel's
binary sits next to the interpreter (a virtual environment used without activating it), that
folder is put on PATH for the duration of the build only, and PATH is restored afterwards.

If it cannot be built or the CPU lacks AVX2, `available()` is False with the reason in `status()`
and the engine falls back to PyTorch's own int8/int4 kernels and operators (slower).
MTPLLM_KERNELS=0 turns the extension off.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / "qgemv.cpp", _CSRC / "gguf_blocks.cpp", _CSRC / "gguf_rows.cpp", _CSRC / "gguf_x8.cpp",
            _CSRC / "gguf_c32.cpp", _CSRC / "attention.cpp", _CSRC / "decode.cpp", _CSRC / "hybrid.cpp",
            _CSRC / "deltanet_chunk.cpp"]
# -fopenmp: at::parallel_for is an inline OpenMP loop, compiled into the extension itself; without
# the flag it silently runs on one thread. The extension then shares PyTorch's own libgomp.so.1.
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-DNDEBUG"]
# AVX-512 VNNI for its 256-bit forms (EVEX-encoded vpdpbusd / vpdpwssd); loops the compiler
# vectorizes itself stay at 256 bits
_VNNI_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mprefer-vector-width=256"]
_VNNI_CPU = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
_LDFLAGS = ["-fopenmp"]
_lock = threading.Lock()
_state: dict = {}
# a load that has not finished after this many seconds is a compilation (a cached load takes well
# under a second): only then is it announced on stderr
_NOTICE_AFTER_S = 2.0
_DOT_EVERY_S = 5.0


def _cpu_has_avx2() -> bool:
    cap = torch.backends.cpu.get_cpu_capability()
    return cap in ("AVX2", "AVX512") or {"avx2", "fma"} <= _cpu_flags()


def _cpu_has_vnni() -> bool:
    return set(_VNNI_CPU) <= _cpu_flags()


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def isa() -> str:
    """The instruction set the kernels are built for here: "avx512vnni" or "avx2"."""
    forced = os.environ.get("MTPLLM_KERNELS_ISA", "").lower()
    if forced:
        if forced not in ("avx2", "avx512vnni"):
            raise ValueError(f"MTPLLM_KERNELS_ISA={forced!r}: use avx2 or avx512vnni")
        return forced
    return "avx512vnni" if _cpu_has_vnni() else "avx2"


def _unsupported() -> str | None:
    """Why the kernels cannot be used here without trying to build them, or None."""
    if os.environ.get("MTPLLM_KERNELS", "1") == "0":
        return "disabled by MTPLLM_KERNELS=0"
    if not _cpu_has_avx2():
        return "the CPU has no AVX2/FMA"
    try:
        chosen = isa()
    except ValueError as e:
        return str(e)
    if chosen == "avx512vnni" and not _cpu_has_vnni():
        return "MTPLLM_KERNELS_ISA=avx512vnni but the CPU has no AVX-512 VNNI"
    return None


def expected() -> bool:
    """Whether the kernels should be used on this machine (cheap: does not build them)."""
    return _unsupported() is None


@contextlib.contextmanager
def _ninja_on_path():
    """The `ninja` wheel installs its binary next to the interpreter: make it findable while the
    extension builds when the virtual environment is used without being activated. PATH is
    restored afterwards (no lasting change to the process environment)."""
    bindir = os.path.dirname(sys.executable)
    old = os.environ.get("PATH")
    add = os.path.exists(os.path.join(bindir, "ninja")) and bindir not in (old or "").split(os.pathsep)
    if add:
        os.environ["PATH"] = bindir + os.pathsep + (old or "")
    try:
        yield
    finally:
        if add:
            if old is None:
                os.environ.pop("PATH", None)
            else:
                os.environ["PATH"] = old


@contextlib.contextmanager
def slow_notice(message: str, out=None):
    """Says `message` on stderr when the block has not finished after _NOTICE_AFTER_S seconds,
    prints a dot every _DOT_EVERY_S seconds while it runs and the seconds it took at the end; a
    block that finishes sooner (a cached load) prints nothing."""
    out = out or sys.stderr
    done = threading.Event()
    shown = threading.Event()
    t0 = time.perf_counter()

    def watch():
        if done.wait(_NOTICE_AFTER_S):
            return
        print(f"mtpllm: {message} ", end="", file=out, flush=True)
        shown.set()
        while not done.wait(_DOT_EVERY_S):
            print(".", end="", file=out, flush=True)

    th = threading.Thread(target=watch, name="mtpllm-slow-notice", daemon=True)
    th.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        done.set()
        th.join()
        if shown.is_set():
            print(f" {'done' if ok else 'failed'} in {time.perf_counter() - t0:.0f} s", file=out, flush=True)


def _build_notice(what: str, out=None):
    """`slow_notice` for compiling `what`."""
    cache = os.environ.get("TORCH_EXTENSIONS_DIR") or "~/.cache/torch_extensions"
    return slow_notice(f"compiling {what} (first use only, about 30-90 s; cached in {cache})", out)


def _build() -> None:
    reason = _unsupported()
    if reason:
        _state["reason"] = reason
        return
    chosen = isa()
    # a compiler too old for AVX-512 VNNI gets the AVX2 build rather than no kernels at all
    tries = [chosen] + (["avx2"] if chosen != "avx2" and not os.environ.get("MTPLLM_KERNELS_ISA") else [])
    for name in tries:
        try:
            from torch.utils.cpp_extension import load
            with warnings.catch_warnings(), _ninja_on_path(), \
                    _build_notice(f"the CPU kernels ({'AVX-512 VNNI' if name == 'avx512vnni' else 'AVX2'} build)"):
                warnings.simplefilter("ignore")
                load(name="mtpllm_cpu_v4_" + name, sources=[str(s) for s in _SOURCES],
                     extra_cflags=_FLAGS + (_VNNI_FLAGS if name == "avx512vnni" else []),
                     extra_include_paths=[str(_CSRC)], extra_ldflags=_LDFLAGS, is_python_module=False, verbose=False)
            _state["op"] = torch.ops.mtpllm.q8_linear
            _state["gguf_linear"] = torch.ops.mtpllm.gguf_linear
            _state["gguf_dequantize"] = torch.ops.mtpllm.gguf_dequantize
            _state["gguf_repack"] = torch.ops.mtpllm.gguf_repack
            _state["gguf_linear_chunk"] = torch.ops.mtpllm.gguf_linear_chunk
            _state["rms_norm"] = torch.ops.mtpllm.rms_norm
            _state["attend_cached"] = torch.ops.mtpllm.attend_cached
            _state["silu_mul"] = torch.ops.mtpllm.silu_mul
            _state["argmax_rows"] = torch.ops.mtpllm.argmax_rows
            _state["x8_tile4"] = torch.ops.mtpllm.x8_tile4
            _state["tuning"] = torch.ops.mtpllm.tuning
            _state["paired_tiles"] = torch.ops.mtpllm.paired_tiles
            _state["isa"] = name
            return
        except Exception as e:  # no compiler, no ninja, build error: fall back with the reason
            msg = str(e).strip()
            _state["reason"] = f"could not build the CPU kernels ({type(e).__name__}: {msg.splitlines()[-1][:200] if msg else ''})"


def _ensure() -> None:
    if "done" in _state:
        return
    with _lock:
        if "done" not in _state:
            _build()
            _state["done"] = True


def available() -> bool:
    _ensure()
    return "op" in _state


def status() -> str:
    _ensure()
    return f"built ({_state['isa']})" if "op" in _state else _state.get("reason", "unavailable")


def q8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
              group: int) -> torch.Tensor:
    return _op("op")(x, codes, scales, mins, group)


def _op(name: str):
    op = _state.get(name)
    if op is None:
        if not available():
            raise RuntimeError(f"the engine's CPU kernel is not available: {status()}")
        op = _state[name]
    return op


def gguf_linear(x: torch.Tensor, weights: list[torch.Tensor], types: list[int]) -> torch.Tensor:
    """x [M, K] float32 @ W^T, W the row-wise concatenation of GGUF block matrices `weights`
    (uint8 [N_i, row bytes], GGML type ids `types`) -> [M, sum N_i] float32."""
    return _op("gguf_linear")(x, weights, types)


def gguf_linear_chunk(x: torch.Tensor, weights: list[torch.Tensor], types: list[int]) -> torch.Tensor:
    """`gguf_linear` for prompt chunks: Q4_0/Q5_0/Q8_0 matrices are multiplied 8 weight rows at a
    time against all rows of x (decoded once per 8 rows; integer sums per block). Each row of the
    result depends on its own row of x only, with another rounding than `gguf_linear`'s."""
    return _op("gguf_linear_chunk")(x, weights, types)


def gguf_dequantize(weights: list[torch.Tensor], types: list[int], k: int) -> torch.Tensor:
    """GGUF block matrices uint8 [N_i, row bytes] of GGML types `types` -> float32 [sum N_i, k]."""
    return _op("gguf_dequantize")(weights, types, k)


# engine type ids of GGUF types repacked by 8 rows (csrc/gguf_blocks.h, "Q4_Kx8", "Q6_Kx8",
# "Q4_0x8", "Q5_0x8", "Q8_0x8"): gguf_linear and gguf_dequantize take them like GGML types, with weights
# uint8 [N / 8, K / 256 * 1184 | 1680] (Q4_Kx8 | Q6_Kx8), [N / 8, K / 32 * 144 | 176 | 272] (Q4_0x8 |
# Q5_0x8 | Q8_0x8)
Q4_KX8, Q6_KX8, Q4_0X8, Q5_0X8, Q8_0X8 = 1012, 1014, 1002, 1006, 1008
X8_TYPES = (Q4_KX8, Q6_KX8, Q4_0X8, Q5_0X8, Q8_0X8)
KX8_TYPES = (Q4_KX8, Q6_KX8)  # the K-quant ones (activations quantized per 256)
# GGML type id -> its 8-row layout
X8_OF = {12: Q4_KX8, 14: Q6_KX8, 2: Q4_0X8, 6: Q5_0X8, 8: Q8_0X8}


def gguf_repack(weight: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """Q4_K / Q6_K / Q4_0 / Q5_0 / Q8_0 blocks uint8 [N, row bytes] (N % 8 == 0) -> their 8-row layout
    (type `X8_OF[qtype]`): the 8 rows of each group interleaved so one vector instruction multiplies
    weights of 8 rows (K-quants: 8 of each per 512-bit register, 4 per 32-bit lane for the 32-weight
    types); the same number of bytes as the file's blocks (Q4_Kx8: 2.8% more)."""
    return _op("gguf_repack")(weight, qtype, k)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * w over the last dimension (float32, CPU)."""
    return _op("rms_norm")(x, w, eps)


def attend_cached(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                  start: int, n_heads: int, n_kv: int, head_dim: int, rot_dim: int, neox: bool, scale: float,
                  q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                  window: int = 0) -> torch.Tensor:
    """Decode-time attention for T < GEMM_MIN_ROWS (32) new tokens at positions [start, start + T) (csrc/attention.cpp):
    q/k norm and rotary on qkv [T, (H + 2 KV) * D], k/v written into the layer's caches kc/vc
    [KV, max_len, D], causal attention over positions [0, start + t] (the last `window` of them
    when window > 0) -> [T, H * D]."""
    return _op("attend_cached")(qkv, cos, sin, kc, vc, start, n_heads, n_kv, head_dim, rot_dim, neox, scale,
                                q_norm, k_norm, eps, window)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [T, 2F] float32 (gate | up) -> silu(gate) * up [T, F] (csrc/decode.cpp)."""
    return _op("silu_mul")(gu)


def argmax(x: torch.Tensor) -> list[int] | int:
    """torch.argmax(x, -1) of float32 logits [V] (-> int) or [T, V] (-> list of T ints): the first
    index of each row's maximum, a NaN counting as the maximum (csrc/decode.cpp; torch's own where the
    kernels are not built yet or x is not a CPU float32 tensor: a greedy sample never starts their
    build)."""
    rows = x.unsqueeze(0) if x.dim() == 1 else x
    op = _state.get("argmax_rows")
    if op is not None and x.device.type == "cpu" and x.dtype == torch.float32 and x.shape[-1] > 0:
        got = op(rows).tolist()
    else:
        got = rows.argmax(-1).tolist()
    return got[0] if x.dim() == 1 else got


def x8_tile4(value: int = -1) -> int:
    """The AVX2 build's verification tiles for 3-4 rows of x on the 8-row K-quant layouts: a mask,
    bit 0 Q4_Kx8, bit 1 Q6_Kx8 run them in one pass (each group's codes decoded once for all rows),
    clear: tiles of 2 rows. Both give the same bits. Sets it when value >= 0; returns the value it
    had (-1 in the AVX-512 VNNI build, whose tiles always take 4 rows)."""
    return int(_op("x8_tile4")(int(value)))


def tuning(name: str, value: int = -1) -> int:
    """A choice between code paths of the kernels that give the same bits (csrc/common.h):
    "grain_macs" (multiply-adds per parallel task: how products split their rows between threads),
    "pair_nsb" (verification tiles pair Q4_Kx8 row groups above this many super-blocks of K),
    "tile_rows" (rows of x per tile of the 8-row K-quant layouts above 4 rows: 4 or 8),
    "prefetch" (bytes ahead of the weight stream the products prefetch into L1; even) or
    "q6_prefetch" (the same for the Q6_Kx8 tiles; an odd value v: v - 1 bytes ahead into L2) or
    "attn_prefetch" (decode attention's prefetch of the keys and values ahead: 0 or 1).
    Sets it when value >= 0; returns the value it had. Chosen per machine by `runtime/tuning.py`."""
    return int(_op("tuning")(name, int(value)))


def choice(name: str):
    """A setter for one of the kernels' code-path choices by name (for the timing scripts): the
    `x8_tile4` op, or a `tuning` choice ("grain_macs", "pair_nsb", "tile_rows", "prefetch",
    "q6_prefetch", "attn_prefetch")."""
    if name == "x8_tile4":
        return x8_tile4
    tuning(name)  # an unknown name fails here, with the list of choices
    return lambda value: tuning(name, value)


def paired_tiles() -> bool:
    """Whether this build has the paired verification tile (`pair_nsb` matters): the VNNI build."""
    return bool(_op("paired_tiles")())


def build_id() -> str:
    """The kernels' instruction set and a digest of their sources: a choice timed for one build is
    not reused for another."""
    import hashlib
    h = hashlib.sha256()
    for src in sorted(_SOURCES + list(_CSRC.glob("*.h"))):
        h.update(src.read_bytes())
    return f"{_state.get('isa', isa())}-{h.hexdigest()[:16]}"


def decode_stack(n_heads: int, n_kv: int, head_dim: int, rot_dim: int, neox: bool, scale: float, eps: float,
                 qk_eps: float):
    """An empty `DecodeStack` (csrc/decode.cpp): decoder blocks added with `add_layer(...)`, run for
    T < 32 rows with `forward(x, k, v, cos, sin, start, first, count)`."""
    _op("silu_mul")  # builds the extension (and fails with its reason) first
    return torch.classes.mtpllm.DecodeStack(n_heads, n_kv, head_dim, rot_dim, neox, scale, eps, qk_eps)


def hybrid_stack(n_heads: int, n_kv: int, head_dim: int, rot_dim: int, neox: bool, scale: float, eps: float,
                 qk_eps: float):
    """An empty `HybridStack` (csrc/hybrid.cpp): linear maps added with `add_part`, blocks with
    `add_deltanet` / `add_attention` and their feed-forward with `set_mlp` / `set_moe`, run for
    decoding and verification rows with `forward_batch(...)` (`models/hybrid_native.py` builds and runs it)."""
    _op("silu_mul")  # builds the extension (and fails with its reason) first
    return torch.classes.mtpllm.HybridStack(n_heads, n_kv, head_dim, rot_dim, neox, scale, eps, qk_eps)


def deltanet_conv_silu(hist: torch.Tensor, conv_t: torch.Tensor) -> torch.Tensor:
    """A DeltaNet prompt chunk's causal depthwise convolution + SiLU with the C++ forward's
    arithmetic (csrc/hybrid.cpp): hist [K - 1 + T, C] (the committed inputs, then the chunk's),
    conv_t [K, C] (the kernel transposed) -> [T, C]."""
    _op("silu_mul")  # builds the extension (and fails with its reason) first
    return torch.ops.mtpllm.deltanet_conv_silu(hist, conv_t)


def deltanet_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt chunk's delta rule in chunked form, per value head on all threads
    (csrc/deltanet_chunk.cpp; models/deltanet.py `delta_rule_chunked` is the same in PyTorch): q, k
    [T, H, dk], v [T, H, dv], g, beta [T, H], state [H, dk, dv] -> (o [T, H, dv], final state)."""
    _op("silu_mul")  # builds the extension (and fails with its reason) first
    return torch.ops.mtpllm.deltanet_chunked(q, k, v, g, beta, state)


def replay_delta_rule(states: torch.Tensor, records: torch.Tensor, base: int, n: int) -> None:
    """A recurrent cache's pending replay with the C++ forward's arithmetic (csrc/hybrid.cpp):
    states [L, 2, H, dk, dv], records [L, max_rows, H, dk + dv + 2]; slot 1 - base of every layer
    gets slot base with the first n recorded rows applied (`RecurrentCache.materialize`)."""
    _op("silu_mul")  # builds the extension (and fails with its reason) first
    torch.ops.mtpllm.replay_delta_rule(states, records, base, n)
