import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(min(2, os.cpu_count() or 1))
# kernel choices timed at load go to a file of this run, not the user's cache
if "MTPLLM_TUNING_CACHE" not in os.environ:
    import tempfile
    os.environ["MTPLLM_TUNING_CACHE"] = os.path.join(tempfile.mkdtemp(prefix="mtpllm-tuning-"), "tuning.json")

from tiny import make_tiny, make_tiny_head  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_models(tiny_dir):
    """One tiny model file per architecture."""
    return {arch: make_tiny(tiny_dir / f"tiny-{arch}.gguf", arch) for arch in ("qwen2", "qwen3", "llama", "gemma3")}


@pytest.fixture(scope="session")
def tiny_mtp(tiny_dir):
    """A tiny qwen2 model with one MTP block in llama.cpp's in-file layout."""
    return make_tiny(tiny_dir / "tiny-qwen2-mtp.gguf", "qwen2", nextn=1, seed=3)


@pytest.fixture(scope="module")
def serve_process(tmp_path_factory):
    """Start `mtpllm serve` processes on loopback: `serve_process(model, *args, ctx=512, env=None,
    threads=1, timeout=180)` -> a ready `server_proc.ServerProcess` (url, log(), terminate(), stop()).
    Every one started is stopped when the module's tests are done."""
    from server_proc import ServerProcess
    started = []

    def start(model, *args, **kw):
        s = ServerProcess(model, *args, log_dir=tmp_path_factory.mktemp("serve"), **kw)
        started.append(s)
        return s
    yield start
    for s in started:
        s.stop()
