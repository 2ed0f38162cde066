"""Tokenizer round trips, sandboxed chat templates, and CLI bad-input handling."""
import subprocess
import sys

import pytest

from mtpllm.cli import main
from mtpllm.errors import MtpllmError
from mtpllm.gguf import GGUFFile
from mtpllm.registry import REGISTRY, RegistryEntry, assemble
from mtpllm.runtime.sampling import SamplingParams
from mtpllm.tokenizer import GGUFTokenizer, render_chat_template

TEXTS = ["the cat", "  two  spaces", "tabs\tand\nnewlines\n\n", "héllo wörld", "日本語 🚀", "<|im_start|>user\nhi<|im_end|>", ""]


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_roundtrip(tiny_models, arch):
    g = GGUFFile(tiny_models[arch])
    tok = GGUFTokenizer(g.metadata, g.arch)
    for t in TEXTS:
        ids = tok.encode(t)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids, skip_special=False).replace("<bos>", "") == t


def test_special_tokens_and_bos(tiny_models):
    q = GGUFFile(tiny_models["qwen2"])
    tq = GGUFTokenizer(q.metadata, q.arch)
    ids = tq.encode("<|im_start|>user")
    assert ids[0] == tq.token_to_id("<|im_start|>") and not tq.add_bos
    assert tq.eos_id in tq.eos_ids
    gm = GGUFFile(tiny_models["gemma3"])
    tg = GGUFTokenizer(gm.metadata, gm.arch)
    assert tg.add_bos and tg.encode("the")[0] == 2
    assert tg.encode(" the") == [2, tg.token_to_id("\u2581the")]  # BPE merges recovered from the vocabulary
    assert tg.encode("the") == [2, tg.token_to_id("t"), tg.token_to_id("he")]  # no prefix space for Gemma


def test_chat_template_renders(tiny_models):
    g = GGUFFile(tiny_models["qwen2"])
    tok = GGUFTokenizer(g.metadata, g.arch)
    s = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert s == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_is_sandboxed():
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(MtpllmError, match="chat template"):
        render_chat_template(evil, [{"role": "user", "content": "x"}])
    with pytest.raises(MtpllmError, match="boom"):
        render_chat_template("{{ raise_exception('boom') }}", [{"role": "user", "content": "x"}])
    with pytest.raises(MtpllmError, match="role"):
        render_chat_template("{{ messages }}", ["not a dict"])


def test_registry_sha_mismatch(tmp_path, monkeypatch):
    """A part package whose bytes do not hash to the registry's SHA-256: clear error, file not kept."""
    pkg = tmp_path / "fake_part_pkg"
    pkg.mkdir()
    (pkg / "data.bin").write_bytes(b"not the model")
    (pkg / "__init__.py").write_text("import os\ndef get_part_path():\n"
                                     "    return os.path.join(os.path.dirname(__file__), 'data.bin')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = RegistryEntry("fake", "fake.gguf", 13, "0" * 64, ("fake_part_pkg",), ("fake-part-pkg",), "")
    out = tmp_path / "cache"
    out.mkdir()
    with pytest.raises(MtpllmError, match="failed verification.*discarded"):
        assemble(entry, out)
    assert list(out.iterdir()) == []
    missing = RegistryEntry("fake2", "fake2.gguf", 1, "0" * 64, ("no_such_part_pkg",), ("no-such-part-pkg",), "")
    with pytest.raises(MtpllmError, match="is not installed"):
        assemble(missing, out)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "mtpllm", *args], capture_output=True, text=True, timeout=300)


def test_cli_run_prints_the_engines_greedy_text(tiny_models):
    """`mtpllm run` streams what the library generates for the same prompt and settings (greedy,
    n-gram speculation, which keeps greedy output identical), then the timings on stderr."""
    from mtpllm.runtime.engine import Engine
    r = _cli("run", "-m", str(tiny_models["qwen2"]), "-p", "the cat", "-n", "8", "--temp", "0", "--no-chat",
             "--ignore-eos", "--spec-type", "ngram-simple", "--spec-draft-n-max", "3")
    assert r.returncode == 0, r.stderr
    eng = Engine.load(str(tiny_models["qwen2"]))
    ref = eng.generate(prompt_ids=eng.encode_prompt("the cat", chat=False),
                       params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(ref.tokens) == 8 and r.stdout == ref.text + "\n"
    assert "eval time" in r.stderr and "prompt eval time" in r.stderr and "load time" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args,msg", [
    (["run", "-m", "/nonexistent.gguf", "-p", "x"], "no such file"),
    (["run", "-m", "no-such-model", "-p", "x"], "not a registry name"),
    (["run", "-p", ""], "empty prompt"),
    (["run", "-p", "x", "--spec-type", "mtp"], "the name is draft-mtp"),
    (["run", "-p", "x", "--speculative", "{bad"], "invalid JSON"),
    (["run", "-p", "x", "-f", "/nonexistent.txt"], "not allowed with"),
    (["run", "-f", "/nonexistent.txt"], "cannot read prompt file"),
    (["run", "-p", "x", "--spec-type", "none", "--spec-draft-n-max", "3"], "without a method"),
    (["run", "-p", "x", "--spec-type", "none", "-md", "m.gguf"], "without a method"),
    (["run", "-p", "x", "--spec-type", "none", "--spec-ngram-max", "3"], "without a method"),
    (["run", "-p", "x", "--spec-type", "none", "--speculative", '{"method":"mtp"}'], "contradict"),
    (["run", "-p", "x", "-n", "-5"], "expected an integer >= 0"),
    (["frobnicate"], "unknown command"),
])
def test_cli_bad_input(args, msg):
    r = _cli(*args)
    assert r.returncode != 0
    assert msg in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_not_gguf_and_truncated(tmp_path, tiny_models):
    bad = tmp_path / "bad.gguf"
    bad.write_text("hello")
    r = _cli("run", "-m", str(bad), "-p", "x")
    assert r.returncode == 1 and "not a GGUF file" in r.stderr
    tr = tmp_path / "tr.gguf"
    tr.write_bytes(tiny_models["qwen2"].read_bytes()[:-5000])
    r = _cli("run", "-m", str(tr), "-p", "x")
    assert r.returncode == 1 and "runs past the end of the file" in r.stderr


def test_cli_prompt_longer_than_context(tiny_models):
    r = _cli("run", "-m", str(tiny_models["qwen2"]), "-p", "word " * 100, "-c", "16", "--no-chat")
    assert r.returncode == 1 and "context size is 16" in r.stderr


def test_cli_chat_session(tiny_models):
    r = subprocess.run([sys.executable, "-m", "mtpllm", "chat", "-m", str(tiny_models["qwen2"]), "-n", "5",
                        "--temp", "0", "--timings"], input="hello\nagain\n/exit\n", capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("eval time") >= 2 * 2  # prompt eval + eval, two turns
    assert "cached prompt" in r.stderr  # the second turn reuses the first turn's KV cache
