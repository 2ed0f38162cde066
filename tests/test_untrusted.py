"""Model files, chat templates and head sources are untrusted input: each class of damage found by
fuzzing (scripts/fuzz_models.py) gets the smallest file that shows it, and must end in one clean
MtpllmError naming the file and the key or tensor, quickly and without a large allocation. The last
test runs the fuzzer itself for a few thousand cases."""
from __future__ import annotations

import importlib.util
import json
import os
import struct
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from mtpllm import cli
from mtpllm.errors import MtpllmError
from mtpllm.gguf.reader import GGUFFile
from mtpllm.gguf.writer import write_gguf
from mtpllm.models.config import config_from_gguf
from mtpllm.runtime.engine import Engine
from mtpllm.speculative.hf_mtp import HFMTPFile
from mtpllm.speculative.mtp import load_mtp_head
from mtpllm.tokenizer import GGUFTokenizer, render_chat_template
from mtpllm.tools.doctor import diagnose
from mtpllm.tools.inspect import inspect_file
from tiny import make_tiny, make_tiny_head

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("fuzz_models", ROOT / "scripts" / "fuzz_models.py")
fuzz = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz)

# the issue's requirement: inspect, doctor, run and serve fail within a second on a damaged file
FAIL_FAST_S = 1.0
# a header of a few kilobytes must not cost more than a few megabytes to reject
SMALL_MEMORY = 8 << 20


# ---- a map of where each metadata value sits in a file ------------------------------------------------
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def header_map(data: bytes) -> dict[str, tuple[int, int, int]]:
    """metadata key -> (value type, offset of the value, its width; for an array: offset of its count)."""
    n_kv = struct.unpack_from("<Q", data, 16)[0]
    pos, out = 24, {}
    for _ in range(n_kv):
        n = struct.unpack_from("<Q", data, pos)[0]
        key = data[pos + 8:pos + 8 + n].decode()
        pos += 8 + n
        vt = struct.unpack_from("<I", data, pos)[0]
        pos += 4
        if vt == 8:
            out[key] = (vt, pos, 8)
            pos += 8 + struct.unpack_from("<Q", data, pos)[0]
        elif vt == 9:
            et, count = struct.unpack_from("<IQ", data, pos)
            out[key] = (vt, pos + 4, 8)
            pos += 12
            for _ in range(count):
                if et == 8:
                    pos += 8 + struct.unpack_from("<Q", data, pos)[0]
                else:
                    pos += _SIZES[et]
        else:
            out[key] = (vt, pos, _SIZES[vt])
            pos += _SIZES[vt]
    return out


def patched(src: Path, dst: Path, key: str, value: int | bytes) -> Path:
    """A copy of src with the value (or array count) of `key` overwritten in place."""
    data = bytearray(src.read_bytes())
    vt, pos, width = header_map(bytes(data))[key]
    data[pos:pos + width] = value if isinstance(value, bytes) else value.to_bytes(width, "little")
    dst.write_bytes(bytes(data))
    return dst


def with_meta(dst: Path, arch: str = "qwen2", changes: dict | None = None) -> Path:
    """A one-layer tiny model rewritten with some metadata changed (values of any type; keys starting
    with '.' are the architecture's)."""
    src = make_tiny(dst.with_suffix(".src.gguf"), arch, n_layers=1, ctx=64)
    g = GGUFFile(src)
    meta = {k: v for k, v in g.metadata.items() if k != "general.architecture"}
    meta.update({(arch + k if k.startswith(".") else k): v for k, v in (changes or {}).items()})
    tensors = {n: (g.raw(n), t.qtype) for n, t in g.tensors.items()}
    return write_gguf(dst, arch, meta, tensors)


def expect_clean(path: Path, *words: str) -> str:
    """Every user-facing entry point fails with one MtpllmError naming the file, fast and small."""
    tracemalloc.start()
    t0 = time.process_time()
    with pytest.raises(MtpllmError) as e:
        Engine.load(str(path), n_ctx=32)
    spent = time.process_time() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    msg = str(e.value)
    assert str(path) in msg, msg
    for w in words:
        assert w in msg, msg
    assert spent < FAIL_FAST_S, f"{spent:.2f} s to reject"
    assert peak < SMALL_MEMORY + path.stat().st_size, f"{peak / 2**20:.1f} MiB to reject"
    return msg


def cli_fails_fast(capsys, path: Path, words: str) -> None:
    """`run` and `serve` stop with an error; `inspect` shows the file and the problem; `doctor` fails it."""
    for args in (["inspect", str(path)], ["doctor", "--no-sha", str(path)], ["run", "-m", str(path), "-p", "x"],
                 ["serve", "-m", str(path), "--port", "1"]):
        t0 = time.process_time()
        rc = cli.main(args)
        out, err = capsys.readouterr()
        assert time.process_time() - t0 < FAIL_FAST_S, args
        assert "Traceback" not in err
        if args[0] == "inspect":
            assert rc == 0 and words in out, out
        elif args[0] == "doctor":
            assert rc == 1 and words in out, out
        else:
            assert rc == 1 and "error:" in err and words in err, (args, err)


@pytest.fixture(scope="module")
def tiny1(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("u") / "tiny1.gguf", "qwen2", n_layers=1, ctx=64)


@pytest.fixture(scope="module", autouse=True)
def warm(tiny1):
    """One load first, so that the time limits below do not count loading the engine's kernels."""
    Engine.load(str(tiny1), n_ctx=32)


# ---- the header ----------------------------------------------------------------------------------------
def test_flipped_block_count(tiny1, tmp_path, capsys):
    """The issue's file: one byte of qwen2.block_count flipped (1 -> 2,852,126,721) took 15 GB."""
    bad = patched(tiny1, tmp_path / "bc.gguf", "qwen2.block_count", 2_852_126_721)
    expect_clean(bad, "qwen2.block_count", "2852126721")
    bad = patched(tiny1, tmp_path / "bc2.gguf", "qwen2.block_count", 2)  # one block short
    expect_clean(bad, "qwen2.block_count", "no tensors for block(s) 1")
    cli_fails_fast(capsys, bad, "block_count")
    with pytest.raises(MtpllmError, match="block_count"):
        config_from_gguf(GGUFFile(bad))
    r = inspect_file(bad)  # inspect still shows what the file holds
    assert "block_count" in r["architecture"]["error"]
    assert diagnose(bad, sha=False).verdict == "fail"


@pytest.mark.parametrize("key", ["tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"])
@pytest.mark.parametrize("count", [2**62, 2**32 + 5, 10**6])
def test_array_count_beyond_the_file(tiny1, tmp_path, key, count):
    bad = patched(tiny1, tmp_path / "arr.gguf", key, count)
    msg = expect_clean(bad, key)
    assert "truncated or damaged GGUF header" in msg


@pytest.mark.parametrize("offset,count,what", [(16, 2**63, "metadata entries"), (8, 2**40, "tensors")])
def test_header_counts_beyond_the_file(tiny1, tmp_path, offset, count, what):
    data = bytearray(tiny1.read_bytes())
    data[offset:offset + 8] = struct.pack("<Q", count)
    (tmp_path / "n.gguf").write_bytes(bytes(data))
    expect_clean(tmp_path / "n.gguf", f"claims {count} {what}")


def test_string_length_beyond_the_file(tiny1, tmp_path):
    bad = patched(tiny1, tmp_path / "s.gguf", "general.name", 2**63 - 1)
    expect_clean(bad, "general.name", "truncated or damaged")


def _raw_gguf(kvs: bytes, n_kv: int, n_tensors: int = 0, tensors: bytes = b"") -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + kvs + tensors


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


def test_nested_arrays(tmp_path):
    """Arrays of arrays of arrays ... each level costs 12 bytes: without a depth limit, recursion."""
    depth = 2000
    kv = _key("x") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * depth + struct.pack("<IQ", 4, 0)
    p = tmp_path / "nest.gguf"
    p.write_bytes(_raw_gguf(kv, 1))
    with pytest.raises(MtpllmError, match="nested more than"):
        GGUFFile(p)


def test_duplicate_key_and_tensor(tmp_path):
    kv = (_key("a") + struct.pack("<II", 4, 1)) * 2
    p = tmp_path / "dup.gguf"
    p.write_bytes(_raw_gguf(kv, 2))
    with pytest.raises(MtpllmError, match="at a: the key appears twice"):
        GGUFFile(p)
    info = _key("t") + struct.pack("<I", 1) + struct.pack("<Q", 32) + struct.pack("<I", 0) + struct.pack("<Q", 0)
    data = _raw_gguf(b"", 0, 2, info * 2)
    data += b"\0" * ((-len(data)) % 32) + b"\0" * 128
    p.write_bytes(data)
    with pytest.raises(MtpllmError, match="tensor 't' appears twice"):
        GGUFFile(p)


@pytest.mark.parametrize("dims", [(2**62, 2**62), (2**63, 4), (2**32, 2**32, 2**32)])
def test_tensor_shape_overflow(tmp_path, dims):
    """Element counts are exact: a product past 2^64 once wrapped in int64 and passed the size check."""
    info = _key("t") + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) + \
        struct.pack("<IQ", 0, 0)
    data = _raw_gguf(b"", 0, 1, info)
    data += b"\0" * ((-len(data)) % 32) + b"\0" * 64
    p = tmp_path / "shape.gguf"
    p.write_bytes(data)
    with pytest.raises(MtpllmError, match="tensor 't'"):
        GGUFFile(p)


@pytest.mark.parametrize("n_dims", [0, 5, 2**32 - 1])
def test_tensor_dimension_count(tmp_path, n_dims):
    info = _key("t") + struct.pack("<I", n_dims) + struct.pack("<Q", 32) * min(n_dims, 5) + struct.pack("<IQ", 0, 0)
    p = tmp_path / "nd.gguf"
    p.write_bytes(_raw_gguf(b"", 0, 1, info) + b"\0" * 256)
    with pytest.raises(MtpllmError, match="dimensions"):
        GGUFFile(p)


@pytest.mark.parametrize("etype,size", [(2, 2), (8, 8), (0, 1), (6, 4)])
def test_header_memory_is_a_small_multiple_of_its_size(tmp_path, etype, size):
    """Whatever a header holds, reading it costs memory in proportion to its bytes. The worst case is an
    array of 16-bit values: a Python int (28 bytes) plus a list slot (8) for every 2 bytes, 18x."""
    n = 200_000
    body = struct.pack("<Q", 0) * n if etype == 8 else np.arange(n).astype({0: np.uint8, 2: np.uint16, 6: np.float32}[etype]).tobytes()
    kv = _key("big") + struct.pack("<I", 9) + struct.pack("<IQ", etype, n) + body
    p = tmp_path / "big.gguf"
    p.write_bytes(_raw_gguf(kv, 1))
    tracemalloc.start()
    g = GGUFFile(p)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(g.metadata["big"]) == n
    assert peak < 20 * len(kv) + (1 << 20), f"{peak / len(kv):.1f} bytes per header byte"


# ---- metadata values --------------------------------------------------------------------------------------
@pytest.mark.parametrize("change,words", [
    ({".embedding_length": "256"}, ["qwen2.embedding_length", "expected an integer"]),
    ({".context_length": 1.5}, ["qwen2.context_length", "expected an integer"]),
    ({".context_length": 2**31}, ["qwen2.context_length", "expected an integer from 1 to"]),
    ({".attention.head_count": [4]}, ["qwen2.attention.head_count", "expected an integer"]),
    ({".attention.head_count_kv": 3}, ["head_count_kv", "a divisor of the head count 4"]),
    ({".attention.head_count_kv": 8}, ["head_count_kv", "from 1 to 4"]),
    ({".rope.freq_base": float("nan")}, ["qwen2.rope.freq_base", "expected a number"]),
    ({".rope.freq_base": 0.0}, ["qwen2.rope.freq_base"]),
    ({".rope.dimension_count": 63}, ["rope.dimension_count", "even number"]),
    ({".rope.dimension_count": 128}, ["rope.dimension_count", "head dimension 64"]),
    ({".rope.scaling.factor": float("inf")}, ["rope.scaling.factor"]),
    ({".rope.scaling.type": 7}, ["rope.scaling.type", "a string"]),
    ({".attention.layer_norm_rms_epsilon": -1.0}, ["layer_norm_rms_epsilon"]),
    ({".nextn_predict_layers": 1}, ["nextn_predict_layers", "from 0 to 0"]),
    ({"general.alignment": 3}, ["general.alignment", "power of two"]),
    ({"general.alignment": "32"}, ["general.alignment", "power of two"]),
    ({"general.architecture": ["qwen2"]}, ["general.architecture", "a string"]),
])
def test_metadata_value_types_and_ranges(tmp_path, change, words):
    if "general.architecture" in change:  # the writer always writes it as a string: rewrite its bytes
        p = with_meta(tmp_path / "m.gguf")
        data = p.read_bytes()
        vt, pos, _ = header_map(data)["general.architecture"]
        # the string 'qwen2' becomes an array of one string: type 9, element type 8, count 1
        p.write_bytes(data[:pos - 4] + struct.pack("<IIQ", 9, 8, 1) + data[pos:])
    else:
        p = with_meta(tmp_path / "m.gguf", changes=change)
    expect_clean(p, *words)


@pytest.mark.parametrize("change,words", [
    ({"embedding_length": 255}, ["token_embd.weight", "expected [", "width 255"]),
    ({"attention.head_count": 2, "attention.head_count_kv": 2}, ["blk.0.attn_q.weight", "2 heads of 64"]),
    ({"attention.key_length": 32}, ["blk.0.attn_q.weight", "heads of 32"]),
    ({"feed_forward_length": 511}, ["blk.0.ffn_gate.weight", "FFN 511"]),
])
def test_widths_against_tensor_shapes(tmp_path, change, words):
    """Widths that disagree with the tensors once failed deep inside the first forward pass."""
    p = with_meta(tmp_path / "w.gguf", changes={"." + k: v for k, v in change.items()})
    expect_clean(p, *words)


def test_empty_embedding(tmp_path):
    src = make_tiny(tmp_path / "t.gguf", "qwen2", n_layers=1)
    g = GGUFFile(src)
    tensors = {n: (g.raw(n), t.qtype) for n, t in g.tensors.items()}
    tensors["token_embd.weight"] = (np.zeros((0, 256), np.float32), QT.F32)
    meta = {k: v for k, v in g.metadata.items() if k != "general.architecture"}
    p = write_gguf(tmp_path / "e.gguf", "qwen2", meta, tensors)
    expect_clean(p, "token_embd.weight")


def test_unsupported_tensor_type_in_a_weight(tmp_path):
    src = make_tiny(tmp_path / "t.gguf", "qwen2", n_layers=1)
    g = GGUFFile(src)
    tensors = {n: (g.raw(n), t.qtype) for n, t in g.tensors.items()}
    tensors["blk.0.ffn_norm.weight"] = (np.zeros(292, np.uint8), QT.Q8_K)  # one Q8_K block of 256 values
    meta = {k: v for k, v in g.metadata.items() if k != "general.architecture"}
    p = write_gguf(tmp_path / "i.gguf", "qwen2", meta, tensors)
    expect_clean(p, "blk.0.ffn_norm.weight", "Q8_K", "not supported")


# ---- tokenizer data -------------------------------------------------------------------------------------
def test_merge_outside_the_vocabulary(tmp_path):
    """The issue's 22 tracebacks: `Exception: Token 'er' out of vocabulary` from the tokenizers library."""
    src = make_tiny(tmp_path / "t.gguf", "qwen2", n_layers=1)
    tokens = GGUFFile(src).metadata["tokenizer.ggml.tokens"]
    i = tokens.index("er")
    data = bytearray(src.read_bytes())
    at = data.index(b"\x02\x00\x00\x00\x00\x00\x00\x00er", 24)  # the token 'er' in the vocabulary
    data[at + 8:at + 10] = b"eR"
    (tmp_path / "er.gguf").write_bytes(bytes(data))
    msg = expect_clean(tmp_path / "er.gguf", "tokenizer.ggml.merges", "'er'", "not a token")
    assert i > 0 and "Traceback" not in msg


@pytest.mark.parametrize("change,words", [
    ({"tokenizer.ggml.eos_token_id": 10**6}, ["eos_token_id", "token id from 0 to"]),
    ({"tokenizer.ggml.bos_token_id": -1}, ["bos_token_id"]),
    ({"tokenizer.ggml.token_type": [1, 2, 3]}, ["token_type", "has 3 entries"]),
    ({"tokenizer.ggml.merges": ["Ġ t", "nospace"]}, ["merges", "entry 1 is 'nospace'", "separated by a space"]),
    ({"tokenizer.ggml.pre": 5}, ["tokenizer.ggml.pre", "must be a string"]),
    ({"tokenizer.chat_template": 5}, ["tokenizer.chat_template", "must be a string"]),
])
def test_tokenizer_metadata(tmp_path, change, words):
    src = make_tiny(tmp_path / "t.gguf", "qwen2", n_layers=1)
    g = GGUFFile(src)
    meta = {k: v for k, v in g.metadata.items() if k != "general.architecture"} | change
    p = write_gguf(tmp_path / "tk.gguf", "qwen2", meta, {n: (g.raw(n), t.qtype) for n, t in g.tensors.items()})
    expect_clean(p, *words)


def test_more_tokens_than_embeddings(tmp_path):
    src = make_tiny(tmp_path / "t.gguf", "qwen2", n_layers=1)
    g = GGUFFile(src)
    meta = {k: v for k, v in g.metadata.items() if k != "general.architecture"}
    meta["tokenizer.ggml.tokens"] = meta["tokenizer.ggml.tokens"] + ["x1", "x2"] * 200
    meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"] + [1, 1] * 200
    p = write_gguf(tmp_path / "v.gguf", "qwen2", meta, {n: (g.raw(n), t.qtype) for n, t in g.tensors.items()})
    expect_clean(p, "tokenizer.ggml.tokens", "token_embd.weight")


def test_long_token_without_merges(tmp_path):
    """Merges recovered from a SentencePiece vocabulary split every token: cost grows with its length squared."""
    src = make_tiny(tmp_path / "t.gguf", "gemma3", n_layers=1)
    g = GGUFFile(src)
    meta = {k: v for k, v in g.metadata.items() if k != "general.architecture"}
    meta["tokenizer.ggml.tokens"] = list(meta["tokenizer.ggml.tokens"])
    meta["tokenizer.ggml.tokens"][-2] = "a" * 100_000
    p = write_gguf(tmp_path / "long.gguf", "gemma3", meta, {n: (g.raw(n), t.qtype) for n, t in g.tensors.items()})
    expect_clean(p, "tokenizer.ggml.tokens", "100000 characters")


def test_tokenizer_error_names_the_file_without_engine(tmp_path):
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.merges": ["a c"]}
    with pytest.raises(MtpllmError, match="^my.gguf: tokenizer metadata 'tokenizer.ggml.merges'"):
        GGUFTokenizer(meta, source="my.gguf")


# ---- chat templates ----------------------------------------------------------------------------------
HOSTILE_TEMPLATES = {
    "string product": "{{ 'a' * 1000000000 }}",
    "list product": "{{ ([1] * 100000) * 100000 }}",
    "power": "{{ 10 ** 100000000 }}",
    "doubling with ~": "{% set x = 'aaaaaaaaaaaaaaaa' %}" + "{% set x = x ~ x %}" * 40 + "{{ x|length }}",
    "doubling with +": "{% set x = 'aaaaaaaaaaaaaaaa' %}" + "{% set x = x + x %}" * 40,
    "doubling a namespace": "{% set ns = namespace(s='ab') %}{% for i in range(100) %}"
                            "{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "output in a loop": "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxxxxxxxx"
                        "{% endfor %}{% endfor %}",
    "padding method": "{{ 'x'.center(1000000000) }}",
    "padding filter": "{{ 'x'|center(1000000000) }}",
    "format width": "{{ '{:>1000000000}'.format(1) }}",
    "format width argument": "{{ '{:>{}}'.format(1, 1000000000) }}",
    "percent width": "{{ '%1000000000d' % 1 }}",
    "percent star": "{{ '%*d' % (1000000000, 1) }}",
    "join separator": "{{ range(100000)|join('x' * 1000000) }}",
    "replace": "{% set s = 'a' * 1000000 %}{{ s|replace('a', 'bbbbbbbbbbbbbbbbbbbb') }}",
    "indent": "{% set s = '\n' * 1000000 %}{{ s|indent(100) }}",
    "tojson indent": "{{ range(1000)|list|tojson(indent=100000000) }}",
    "recursion": "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "deep expression": "{{ " + "(" * 100000 + "1" + ")" * 100000 + " }}",
    "huge source": "x" * (2 << 20),
}


@pytest.mark.parametrize("name", list(HOSTILE_TEMPLATES))
def test_hostile_chat_template(name):
    tracemalloc.start()
    t0 = time.process_time()
    with pytest.raises(MtpllmError, match="chat template"):
        render_chat_template(HOSTILE_TEMPLATES[name], [{"role": "user", "content": "hi"}])
    spent = time.process_time() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert spent < FAIL_FAST_S
    # the limit on what a template builds is 4M characters: a few of those at most, never gigabytes
    assert peak < 64 << 20, f"{peak / 2**20:.0f} MiB"


def test_template_time_limit(monkeypatch):
    """Loops that build nothing run until the deadline (2 s by default; 0.2 s here)."""
    import mtpllm.tokenizer as tk
    monkeypatch.setattr(tk, "TEMPLATE_MAX_SECONDS", 0.2)
    t0 = time.monotonic()
    with pytest.raises(MtpllmError, match="ran longer than 0.2 s"):
        render_chat_template("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                             [{"role": "user", "content": "hi"}])
    assert time.monotonic() - t0 < 5  # the deadline, plus a busy machine's delay


def test_real_templates_still_render():
    from tiny import CHAT_TEMPLATE
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi " * 1000}]
    out = render_chat_template(CHAT_TEMPLATE, msgs)
    assert out.endswith("<|im_start|>assistant\n") and out.count("hi ") == 1000
    t = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
         "{{ ns.n }} {{ messages|map(attribute='role')|join(', ') }} {{ '%5d|%-3s' % (7, 'ab') }} "
         "{{ '{:>4}'.format('x') }} {{ messages|tojson(indent=2)|length > 0 }} {{ 'ab' * 3 }} {{ 2 ** 10 }}")
    assert render_chat_template(t, msgs) == "2 system, user     7|ab     x True ababab 1024"


# ---- MTP head sources -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trunk_engine(tiny1):
    return Engine.load(str(tiny1), n_ctx=32)


@pytest.mark.parametrize("change,words", [
    ({".nextn_predict_layers": "1"}, ["nextn_predict_layers", "expected an integer"]),
    ({".block_count": 2**31}, ["block_count", "expected an integer"]),
    ({".embedding_length": [256]}, ["embedding_length", "expected an integer"]),
    ({"mtpllm.draft_vocab": ["a", "b"]}, ["mtpllm.draft_vocab", "array of token ids"]),
    ({"mtpllm.draft_vocab": [0, 10**6]}, ["draft_vocab", "outside the model's vocabulary"]),
])
def test_head_metadata(tmp_path, trunk_engine, change, words):
    src = make_tiny_head(tmp_path / "h.gguf", "qwen2", n_layers=1)
    g = GGUFFile(src)
    meta = {k.replace("qwen2.", ".", 1) if k.startswith("qwen2.") else k: v for k, v in g.metadata.items()
            if k != "general.architecture"} | change
    p = write_gguf(tmp_path / "hb.gguf", "qwen2", meta, {n: (g.raw(n), t.qtype) for n, t in g.tensors.items()})
    with pytest.raises(MtpllmError) as e:
        load_mtp_head(GGUFFile(p), trunk_engine.model)
    assert str(p) in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def _hf_head(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    return fuzz._write_hf_head(d / "model.safetensors")


def test_index_names_a_shard_outside_the_directory(tmp_path, trunk_engine):
    """An index file must not make the loader open files elsewhere on the machine."""
    outside = _hf_head(tmp_path / "elsewhere")
    d = tmp_path / "model"
    d.mkdir()
    names = list(HFMTPFile(outside, trunk_engine.model.cfg).tensors)
    assert names
    for target in ("../elsewhere/model.safetensors", str(outside), "/etc/passwd"):
        (d / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {"model.layers.1.eh_proj.weight": target}}))
        with pytest.raises(MtpllmError, match="shard file in the index's own directory"):
            HFMTPFile(d, trunk_engine.model.cfg)
    os.symlink(outside, d / "link.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.layers.1.eh_proj.weight": "link.safetensors"}}))
    with pytest.raises(MtpllmError, match="outside the model directory"):
        HFMTPFile(d, trunk_engine.model.cfg)


@pytest.mark.parametrize("config,words", [
    ({"num_hidden_layers": "1"}, ["num_hidden_layers", "non-negative integer"]),
    ({"vocab_size": 1.5}, ["vocab_size"]),
    ({"model_type": ["qwen2"]}, ["model_type", "a string"]),
])
def test_config_json_values(tmp_path, trunk_engine, config, words):
    d = tmp_path / "m"
    _hf_head(d)
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(MtpllmError) as e:
        HFMTPFile(d, trunk_engine.model.cfg)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_json_size_limit(tmp_path, trunk_engine, monkeypatch):
    import mtpllm.speculative.hf_mtp as hf
    monkeypatch.setattr(hf, "MAX_JSON_BYTES", 1000)
    d = tmp_path / "m"
    _hf_head(d)
    (d / "config.json").write_text(json.dumps({"pad": "x" * 2000}))
    with pytest.raises(MtpllmError, match="too large for a JSON configuration file"):
        HFMTPFile(d, trunk_engine.model.cfg)


@pytest.mark.parametrize("header", [
    b'{"__metadata__": {"a": 1}}',  # metadata values must be strings
    b'{"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1000000]}}',  # past the end
    b'{"x": {"dtype": "Q9", "shape": [4], "data_offsets": [0, 16]}}',  # unknown dtype
    b'{"x": {"dtype": "F32", "shape": [4611686018427387904, 4], "data_offsets": [0, 16]}}',  # shape overflow
])
def test_safetensors_header(tmp_path, trunk_engine, header):
    p = tmp_path / "h.safetensors"
    p.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    with pytest.raises(MtpllmError, match="not a readable safetensors file"):
        HFMTPFile(p, trunk_engine.model.cfg)


# ---- the fuzzer ---------------------------------------------------------------------------------------
def test_mutation_fuzzing(tmp_path):
    """A few thousand damaged copies of tiny files of each architecture, a head-only GGUF and a safetensors
    head: each loads or fails with one MtpllmError, within the case time limit, under the memory ceiling.
    A failure prints its case number, which `scripts/fuzz_models.py --seed S --start I --cases 1` replays;
    MTPLLM_FUZZ_SEED / MTPLLM_FUZZ_CASES explore further."""
    seed = int(os.environ.get("MTPLLM_FUZZ_SEED", 1))
    n = int(os.environ.get("MTPLLM_FUZZ_CASES", 2400))
    res = fuzz.campaign(n, seed=seed, workdir=tmp_path, case_s=5.0, mem_mib=1024)
    assert res["crash"] == 0 and res["hang"] == 0, json.dumps({"seed": seed, "bad": res["bad"][:5]}, indent=1)
    assert res["load"] + res["error"] == n
    assert res["load"] > 0 and all(len(v) for v in res["by_seed"].values())
    # tiny files of at most ~1.3 MB: growth of hundreds of MB would mean a header value sized an allocation
    # (the issue's flipped block count took 15 GB)
    assert res["peak_rss_growth_mib"] < 256, res["peak_rss_growth_mib"]


def test_inspect_shows_damaged_values(tmp_path, capsys):
    """`inspect` reads values the loaders refuse: shown as they are, never a traceback."""
    src = make_tiny_head(tmp_path / "h.gguf", "qwen2", n_layers=1)
    g = GGUFFile(src)
    meta = {k: v for k, v in g.metadata.items() if k != "general.architecture"}
    meta.update({"qwen2.nextn_predict_layers": "one", "mtpllm.train.history": 3, "mtpllm.draft_vocab": 7})
    p = write_gguf(tmp_path / "hd.gguf", "qwen2", meta, {n: (g.raw(n), t.qtype) for n, t in g.tensors.items()})
    assert cli.main(["inspect", str(p)]) == 0
    out = capsys.readouterr().out
    assert "nextn_predict_layers is 0" in out and "mtpllm.train.history = 3" in out


def test_head_trunk_hash_of_the_wrong_type(tmp_path, tiny1):
    from mtpllm.speculative.mtp import HEAD_SHA_KEY, check_head_trunk
    src = make_tiny_head(tmp_path / "h.gguf", "qwen2", n_layers=1)
    g = GGUFFile(src)
    meta = {k: v for k, v in g.metadata.items() if k != "general.architecture"} | {HEAD_SHA_KEY: 12345}
    p = write_gguf(tmp_path / "hs.gguf", "qwen2", meta, {n: (g.raw(n), t.qtype) for n, t in g.tensors.items()})
    with pytest.raises(MtpllmError, match="must be a SHA-256 string"):
        check_head_trunk(GGUFFile(p), tiny1)


def _with_tensor(src, out, name: str, data: np.ndarray, qtype):
    """A copy of the GGUF file `src` at `out` with tensor `name` replaced by `data` of type `qtype`."""
    g = GGUFFile(src)
    tensors = {n: (g.raw(n), t.qtype) for n, t in g.tensors.items()}
    tensors[name] = (data, qtype)
    meta = {k: v for k, v in g.metadata.items() if k != "general.architecture"}
    return write_gguf(out, "qwen2", meta, tensors)


@pytest.mark.parametrize("qtype,dtype", [(QT.F64, np.float64), (QT.I32, np.int32)])
def test_matrix_of_a_plain_numeric_type(tmp_path, trunk_engine, qtype, dtype):
    """Found by the fuzzer: a type id flipped to F64 (28) made a matrix that loaded and then failed in
    the first matrix product. F64 and integer types are read for vectors, refused for matrices."""
    src = make_tiny(tmp_path / "t.gguf", "qwen2", n_layers=1)
    p = _with_tensor(src, tmp_path / "f64.gguf", "blk.0.ffn_gate.weight", np.zeros((512, 256), dtype), qtype)
    expect_clean(p, "blk.0.ffn_gate.weight", qtype.name, "not supported for a matrix")
    head = make_tiny_head(tmp_path / "h.gguf", "qwen2", n_layers=1)
    p = _with_tensor(head, tmp_path / "hf64.gguf", "blk.1.ffn_up.weight", np.zeros((256, 256), dtype), qtype)
    with pytest.raises(MtpllmError, match="blk.1.ffn_up.weight. has type .*, which is not supported"):
        load_mtp_head(GGUFFile(p), trunk_engine.model)
