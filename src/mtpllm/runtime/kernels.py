"""The engine's own CPU kernels (csrc/qgemv.cpp), compiled on first use and cached.

`q8_linear(x, codes, scales, mins, group)` multiplies float32 activations by block-quantized
weights kept as the GGUF file's integers (see csrc/qgemv.cpp). The extension is built with the
system C++ compiler through torch.utils.cpp_extension (ninja) into the torch extensions cache
(~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR) the first time a model is loaded: about
20-60 s once, then a cached load. Needs an x86-64 CPU with AVX2 and FMA.

If it cannot be built or the CPU lacks AVX2, `available()` is False with the reason in `status()`
and the engine falls back to PyTorch's own int8/int4 kernels (slower). MTPLLM_KERNELS=0 turns the
extension off.
"""
from __future__ import annotations

import os
import sys
import threading
import warnings
from pathlib import Path

import torch

_SRC = Path(__file__).parent / "csrc" / "qgemv.cpp"
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-DNDEBUG"]
_lock = threading.Lock()
_state: dict = {}


def _cpu_has_avx2() -> bool:
    cap = torch.backends.cpu.get_cpu_capability()
    if cap in ("AVX2", "AVX512"):
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2 " in flags and " fma " in flags


def _build() -> None:
    if os.environ.get("MTPLLM_KERNELS", "1") == "0":
        _state["reason"] = "disabled by MTPLLM_KERNELS=0"
        return
    if not _cpu_has_avx2():
        _state["reason"] = "the CPU has no AVX2/FMA"
        return
    # the `ninja` wheel installs its binary next to the interpreter: make it findable when the
    # virtual environment is used without being activated
    bindir = os.path.dirname(sys.executable)
    if os.path.exists(os.path.join(bindir, "ninja")) and bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    try:
        from torch.utils.cpp_extension import load
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load(name="mtpllm_qgemv_v2", sources=[str(_SRC)], extra_cflags=_FLAGS,
                 is_python_module=False, verbose=False)
        _state["op"] = torch.ops.mtpllm.q8_linear
    except Exception as e:  # no compiler, no ninja, build error: fall back with the reason
        _state["reason"] = f"could not build the CPU kernels ({type(e).__name__}: {str(e).strip().splitlines()[-1][:200] if str(e).strip() else ''})"


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
    return "built" if "op" in _state else _state.get("reason", "unavailable")


def q8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
              group: int) -> torch.Tensor:
    op = _state.get("op")
    if op is None:
        if not available():
            raise RuntimeError(f"the engine's CPU kernel is not available: {status()}")
        op = _state["op"]
    return op(x, codes, scales, mins, group)
