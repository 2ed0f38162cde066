"""Dense Hugging Face checkpoints (Qwen2, Qwen3, Llama) load in place through the same reader as the
hybrids: logits equal transformers' on tiny random models written with transformers' own classes.
Tolerance as in test_qwen35.py: float32 on both sides, other summation orders (~1e-6 here)."""
import pytest
import torch

from mtpllm.models import load_model

tf = pytest.importorskip("transformers")
from tiny_hybrid import hf_logits, write_tokenizer  # noqa: E402

TOKENS = [5, 17, 200, 33, 9, 101, 44, 3, 250, 7, 66, 12] * 3


def _write(d, kind):
    d.mkdir()
    vocab = write_tokenizer(d)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                  tie_word_embeddings=False)
    Config, Model = {"qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM), "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
                     "llama": (tf.LlamaConfig, tf.LlamaForCausalLM)}[kind]
    extra = {"head_dim": 24} if kind == "qwen3" else {}  # Qwen3's head dim need not be hidden / heads
    torch.manual_seed(0)
    m = Model(Config(**common, **extra)).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in m.named_parameters():  # random everywhere, norms and biases included
            p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if p.dim() == 1 else 0.08) + (1.0 if "norm" in name else 0))
    m.config.architectures = [Model.__name__]
    m.save_pretrained(d)
    return m


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
def test_dense_checkpoint_matches_transformers(tmp_path, kind):
    hf = _write(tmp_path / kind, kind)
    ref = hf_logits(hf, TOKENS)
    m = load_model(tmp_path / kind, "f32")
    assert m.cfg.arch == kind
    cache = m.make_cache(64)
    got = m.logits(m(torch.tensor(TOKENS), cache))
    assert (got - ref).abs().max() < 1e-4
    assert (got[1:] - ref[:-1]).abs().max() > 1e-2  # not a vacuous comparison
