"""What a first run tells the user: the kernel build is announced on stderr with progress and its
duration (a cached load prints nothing), the build's PATH change does not outlive it, and a
registry model's first assembly shows its progress."""
import hashlib
import io
import os
import time

import pytest

from mtpllm.registry import RegistryEntry, assemble
from mtpllm.runtime import kernels


def test_build_notice_announces_a_slow_build_with_progress_and_its_duration(monkeypatch):
    monkeypatch.setattr(kernels, "_NOTICE_AFTER_S", 0.05)
    monkeypatch.setattr(kernels, "_DOT_EVERY_S", 0.05)
    out = io.StringIO()
    with kernels._build_notice("the CPU kernels (AVX2 build)", out):
        time.sleep(0.5)
    text = out.getvalue()
    assert text.startswith("mtpllm: compiling the CPU kernels (AVX2 build) (first use only")
    assert text.count(".") >= 3 + text.split("(first use")[0].count(".")  # dots while it ran
    assert text.rstrip().endswith("done in 0 s") or text.rstrip().endswith("done in 1 s")
    assert text.count("\n") == 1  # one line


def test_build_notice_is_silent_for_a_cached_load_and_says_when_a_build_fails(monkeypatch):
    out = io.StringIO()
    with kernels._build_notice("x", out):
        pass  # a cached load: well under the threshold
    assert out.getvalue() == ""
    monkeypatch.setattr(kernels, "_NOTICE_AFTER_S", 0.02)
    with pytest.raises(RuntimeError):
        with kernels._build_notice("x", out):
            time.sleep(0.2)
            raise RuntimeError("compiler error")
    assert "compiling x" in out.getvalue() and " failed in " in out.getvalue()


def test_ninja_path_is_restored_after_the_build(tmp_path, monkeypatch):
    fake_python = tmp_path / "bin" / "python"
    fake_python.parent.mkdir()
    (tmp_path / "bin" / "ninja").write_text("")
    monkeypatch.setattr(kernels.sys, "executable", str(fake_python))
    monkeypatch.setenv("PATH", "/usr/bin")
    with kernels._ninja_on_path():
        assert os.environ["PATH"].split(os.pathsep)[:2] == [str(tmp_path / "bin"), "/usr/bin"]
    assert os.environ["PATH"] == "/usr/bin"


def test_assembly_shows_progress_once(tmp_path, monkeypatch):
    """A registry model assembled from part packages (real modules written here): one progress line
    with the share done, the first time only."""
    parts = []
    data = [os.urandom(3 << 20), os.urandom(2 << 20)]
    for i, blob in enumerate(data):
        pkg = tmp_path / f"tiny_part_pkg{i}"
        pkg.mkdir()
        (pkg / "data.bin").write_bytes(blob)
        (pkg / "__init__.py").write_text("import os\ndef get_part_path():\n"
                                         "    return os.path.join(os.path.dirname(__file__), 'data.bin')\n")
        parts.append(pkg.name)
    monkeypatch.syspath_prepend(str(tmp_path))
    whole = b"".join(data)
    entry = RegistryEntry("tiny", "tiny.gguf", len(whole), hashlib.sha256(whole).hexdigest(), tuple(parts),
                          ("tiny-part",), "")
    out = io.StringIO()
    cache = tmp_path / "cache"
    cache.mkdir()
    path = assemble(entry, cache, out)
    assert path.read_bytes() == whole
    line = out.getvalue()
    assert line.startswith("mtpllm: first use of tiny: assembling tiny.gguf") and "from 2 packages" in line
    assert "100% " in line and line.rstrip().endswith(" s") and line.count("\n") == 1
    out2 = io.StringIO()
    assert assemble(entry, cache, out2) == path and out2.getvalue() == ""  # verified before: silent
