"""`inspect` and `doctor`: reports on healthy files, and a table of corrupted copies each caught
with a specific message (tiny files here; the same table on a real model in the slow suite)."""
import json
import shutil
import struct

import pytest

from mtpllm.cli import main
from mtpllm.gguf import GGUFFile
from mtpllm.registry import REGISTRY, resolve_model, sha256_cached
from mtpllm.tools.doctor import diagnose
from mtpllm.tools.inspect import inspect_file
from tiny import make_tiny, make_tiny_head


def offset_field(path, name: str) -> int:
    """Byte position of tensor `name`'s data-offset field in the GGUF header."""
    data = open(path, "rb").read(GGUFFile(path).data_offset)
    key = struct.pack("<Q", len(name)) + name.encode()
    pos = data.index(key) + len(key)
    n_dims = struct.unpack_from("<I", data, pos)[0]
    return pos + 4 + 8 * n_dims + 4


def corrupt_copies(src, d, head_other) -> dict:
    """name -> (path, extra doctor args, (check name, words the message must contain))."""
    blob = bytearray(open(src, "rb").read())
    g = GGUFFile(src)
    out = {}

    def put(name, data):
        p = d / f"{name}-{src.name}"
        p.write_bytes(bytes(data))
        return p
    out["truncated"] = (put("trunc", blob[: len(blob) - 4096]), {}, ("header", ["past the end", "truncated"]))
    b = bytearray(blob)
    b[0] ^= 0xFF
    out["flipped magic"] = (put("magic", b), {}, ("header", ["not a GGUF file"]))
    b = bytearray(blob)
    b[16:24] = struct.pack("<Q", 10**9)  # metadata key count
    out["flipped key count"] = (put("nkv", b), {}, ("header", ["truncated or damaged GGUF header"]))
    names = list(g.tensors)
    t0, t1 = g.tensors[names[0]], g.tensors[names[1]]
    pos = offset_field(src, names[1])
    b = bytearray(blob)
    b[pos:pos + 8] = struct.pack("<Q", t1.offset - g.data_offset + 1)
    out["misaligned offset"] = (put("misal", b), {}, ("header", ["not aligned"]))
    b = bytearray(blob)
    b[pos:pos + 8] = struct.pack("<Q", t0.offset - g.data_offset)  # points into another tensor
    out["overlapping offset"] = (put("overlap", b), {}, ("layout", ["overlaps", names[0]]))
    out["wrong head"] = (src, {"head": str(head_other)}, ("mtp", ["trained for a model with sha256"]))
    return out


@pytest.fixture(scope="module")
def files(tiny_dir):
    d = tiny_dir / "tools"
    d.mkdir(exist_ok=True)
    model = make_tiny(d / "model.gguf", "qwen2", seed=31)
    other = make_tiny(d / "other.gguf", "qwen2", seed=32)
    head_other = make_tiny_head(d / "mtp-other.gguf", "qwen2", trunk_sha256=sha256_cached(other))
    head_ok = make_tiny_head(d / "mtp-model.gguf", "qwen2", trunk_sha256=sha256_cached(model))
    return d, model, head_ok, head_other


def test_inspect_reports_model_and_head(files, tiny_mtp, capsys):
    d, model, head_ok, _ = files
    r = inspect_file(model)
    assert r["architecture"]["arch"] == "qwen2" and r["architecture"]["n_layers"] == 2
    assert r["mtp"]["present"] is False and r["mtp"]["kind"] == "none"
    assert sum(r["size"]["by_type"].values()) == sum(t["bytes"] for t in r["tensors"]) == r["size"]["tensor_bytes"]
    assert r["tokenizer"]["vocab_size"] == r["architecture"]["vocab_size"]
    m = inspect_file(tiny_mtp)["mtp"]
    assert m["present"] and m["kind"] == "in-file layers" and m["blocks"] == [2]
    assert inspect_file(tiny_mtp)["size"]["by_role"]["mtp"] > 0
    h = inspect_file(head_ok)
    assert h["mtp"]["kind"] == "head-only file" and h["architecture"]["head_only"]
    assert main(["inspect", str(head_ok), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mtp"]["trunk_sha256"] == sha256_cached(model)
    assert main(["inspect", str(tiny_mtp)]) == 0
    assert "in-file layers: 1 next-n layer(s), blocks [2]" in capsys.readouterr().out


def test_inspect_bad_input_is_a_clear_error(files, capsys):
    d = files[0]
    (d / "notgguf.bin").write_bytes(b"hello world" * 10)
    assert main(["inspect", str(d / "notgguf.bin")]) == 1
    assert "not a GGUF file" in capsys.readouterr().err
    assert main(["inspect", str(d / "missing.gguf")]) == 1


def test_doctor_healthy_file(files):
    d, model, head_ok, _ = files
    r = diagnose(model, ctx=128, head=str(head_ok))
    status = {c.name: c.status for c in r.checks}
    assert status["header"] == status["layout"] == status["model"] == status["mtp"] == "ok", r.format()
    assert status["sha256"] == "info"  # not a registry model
    assert r.verdict in ("ok", "warn") and any("draft-mtp" in f for f in r.flags)


def test_doctor_rope_and_memory_advice(files):
    model = files[1]  # training context 256
    r = diagnose(model, ctx=1024, sha=False)
    rope = next(c for c in r.checks if c.name == "rope")
    assert rope.status == "fail" and "factor 4" in rope.message
    assert "--rope-scaling yarn" in r.flags and "--rope-scale 4" in r.flags and "--yarn-orig-ctx 256" in r.flags
    r = diagnose(model, ctx=1024, sha=False, overrides={"rope.scaling": "yarn", "rope.factor": 4.0,
                                                        "rope.orig_ctx": 256})
    assert next(c for c in r.checks if c.name == "rope").status == "ok"
    r = diagnose(model, ctx=128, sha=False, overrides={"rope.scaling": "yarn", "rope.factor": 4.0,
                                                       "rope.orig_ctx": 256})
    short = next(c for c in r.checks if c.name == "rope")
    assert short.status == "warn" and "degrades short texts" in short.message
    r = diagnose(model, ctx=10**9, sha=False, overrides={"rope.scaling": "yarn", "rope.factor": 4e6,
                                                         "rope.orig_ctx": 256})
    mem = next(c for c in r.checks if c.name == "memory")
    assert mem.status == "fail" and "largest context that fits" in mem.message


def test_doctor_catches_each_corruption(files, capsys):
    d, model, _, head_other = files
    for case, (path, kw, (check, words)) in corrupt_copies(model, d, head_other).items():
        r = diagnose(path, ctx=128, sha=False, **kw)
        c = next((c for c in r.checks if c.name == check), None)
        assert c is not None and c.status == "fail", (case, r.format())
        assert any(w in c.message for w in words), (case, c.message)
        assert r.verdict == "fail"
    # the command: non-zero exit and JSON output
    trunc = d / f"trunc-{model.name}"
    assert main(["doctor", str(trunc), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == "fail" and out["checks"][0]["name"] == "header"


@pytest.mark.slow
def test_inspect_json_on_real_models(capsys):
    for name, entry in REGISTRY.items():
        assert main(["inspect", name, "--json"]) == 0
        r = json.loads(capsys.readouterr().out)
        assert r["file"]["size"] == entry.size
        assert r["architecture"]["arch"] in ("qwen2", "gemma3") and r["architecture"]["n_layers"] > 0
        assert r["mtp"]["present"] is False
        assert bool(r["tokenizer"]["chat_template"]) == ("instruct" in entry.filename)
        assert "Q4_K" in r["size"]["by_type"]


@pytest.mark.slow
def test_doctor_on_a_real_model_and_its_corrupted_copies(tmp_path, files):
    src = resolve_model("gemma-3-270m")
    r = diagnose(src, ctx=2048)
    assert r.verdict == "warn" and {c.name: c.status for c in r.checks}["sha256"] == "ok", r.format()
    # a damaged byte in tensor data of a file carrying the registry name: the SHA-256 check fails
    bad = tmp_path / REGISTRY["gemma-3-270m"].filename
    shutil.copyfile(src, bad)
    g = GGUFFile(src)
    with open(bad, "r+b") as f:
        f.seek(g.data_offset + g.file_size // 2 - g.data_offset // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    r = diagnose(bad, ctx=2048)
    sha = next(c for c in r.checks if c.name == "sha256")
    assert sha.status == "fail" and "corrupted" in sha.message
    bad.unlink()
    head_other = files[3]  # a head for a qwen2 trunk
    for case, (path, kw, (check, words)) in corrupt_copies(src, tmp_path, head_other).items():
        r = diagnose(path, ctx=2048, sha=False, **kw)
        c = next((c for c in r.checks if c.name == check), None)
        if case == "wrong head":  # architecture differs before the SHA-256 is even compared
            assert c.status == "fail" and "architecture" in c.message, c.message
            continue
        assert c is not None and c.status == "fail", (case, r.format())
        assert any(w in c.message for w in words), (case, c.message)
        if path != src:
            path.unlink()


def test_doctor_weight_estimate_matches_what_loading_keeps(files):
    """The memory check's weight estimate is what a loaded model actually holds: the file's blocks
    for the kernel's types (mapped, not copied), float32 for float matrices and norms."""
    from mtpllm.gguf import GGUFFile
    from mtpllm.models import load_model
    from mtpllm.runtime import kernels
    from mtpllm.runtime.linear import Linear
    from mtpllm.tools.doctor import weight_bytes_estimate
    if not kernels.available():
        pytest.skip(kernels.status())
    model = files[1]
    m = load_model(model, "fast")
    held = m.embed.raw.nbytes
    for mod in m.modules():
        if isinstance(mod, Linear):
            held += sum(w.numel() for w, _ in mod.ggufs)
            held += sum(b.codes.numel() + 4 * b.scales.numel() for b in mod.blocks)
            held += 4 * mod.weight.numel() if mod.weight is not None else 0
            held += 4 * mod.bias.numel() if mod.bias is not None else 0
    held += sum(4 * p.numel() for p in m.parameters())  # norms
    est = weight_bytes_estimate(GGUFFile(model), "fast")
    assert abs(est - held) <= 0.02 * held, (est, held)
