"""The GGUF reader: metadata/tensors of valid files, and a clear error for each kind of bad file."""
import shutil

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from mtpllm.errors import MtpllmError
from mtpllm.gguf import GGUFFile
from mtpllm.gguf.writer import write_gguf
from mtpllm.models import load_model


def test_reads_metadata_and_tensors(tiny_models):
    g = GGUFFile(tiny_models["qwen2"])
    assert g.arch == "qwen2"
    assert g.metadata["qwen2.block_count"] == 2
    assert g.info("blk.0.attn_q.weight").qtype == QT.Q4_K
    assert g.info("blk.0.attn_q.weight").shape == (256, 256)
    assert len(g.metadata["tokenizer.ggml.tokens"]) == g.info("token_embd.weight").shape[0]


def test_missing_file(tmp_path):
    with pytest.raises(MtpllmError, match="no such file"):
        GGUFFile(tmp_path / "nope.gguf")


def test_not_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_text("hello, this is not a model\n")
    with pytest.raises(MtpllmError, match="not a GGUF file"):
        GGUFFile(p)


def test_empty_file(tmp_path):
    p = tmp_path / "e.gguf"
    p.write_bytes(b"")
    with pytest.raises(MtpllmError, match="not a GGUF file"):
        GGUFFile(p)


def test_truncated_header(tmp_path, tiny_models):
    p = tmp_path / "t.gguf"
    p.write_bytes(tiny_models["qwen2"].read_bytes()[:3000])
    with pytest.raises(MtpllmError, match="truncated or damaged GGUF header"):
        GGUFFile(p)


def test_truncated_data(tmp_path, tiny_models):
    data = tiny_models["qwen2"].read_bytes()
    p = tmp_path / "t.gguf"
    p.write_bytes(data[:-1000])
    with pytest.raises(MtpllmError, match=r"tensor '.*' data runs past the end of the file"):
        GGUFFile(p)


def test_bad_offset(tmp_path):
    p = write_gguf(tmp_path / "o.gguf", "qwen2", {}, {"a": (np.zeros(64, np.float32), QT.F32)})
    raw = bytearray(p.read_bytes())
    # the tensor's offset field is the last 8 bytes of its header entry: point it far past the end
    name = b"a"
    i = raw.index(name + (1).to_bytes(4, "little"))  # name, n_dims=1
    off_pos = i + 1 + 4 + 8 + 4
    raw[off_pos:off_pos + 8] = (10 ** 9).to_bytes(8, "little")
    p.write_bytes(bytes(raw))
    with pytest.raises(MtpllmError, match="'a' data runs past the end"):
        GGUFFile(p)


def test_missing_required_key(tmp_path):
    p = write_gguf(tmp_path / "k.gguf", "qwen2", {".block_count": 1},
                   {"token_embd.weight": (np.zeros((4, 32), np.float32), QT.F32)})
    with pytest.raises(MtpllmError, match="required metadata key 'qwen2.embedding_length' is missing"):
        load_model(p)


def test_missing_tensor(tmp_path, tiny_models):
    g = GGUFFile(tiny_models["qwen2"])
    tensors = {n: (np.asarray(g.raw(n)), g.info(n).qtype) for n in g.tensors if n != "blk.1.ffn_up.weight"}
    meta = {k: v for k, v in g.metadata.items() if not k.startswith("general.architecture")}
    p = write_gguf(tmp_path / "m.gguf", "qwen2", meta, tensors)
    with pytest.raises(MtpllmError, match="required tensor 'blk.1.ffn_up.weight' is missing"):
        load_model(p)


def test_unsupported_architecture(tmp_path):
    p = write_gguf(tmp_path / "a.gguf", "mamba", {}, {"token_embd.weight": (np.zeros((4, 32), np.float32), QT.F32)})
    with pytest.raises(MtpllmError, match="architecture 'mamba' is not supported"):
        load_model(p)


def test_directory_is_not_a_model(tmp_path):
    with pytest.raises(MtpllmError, match="is a directory"):
        GGUFFile(tmp_path)
