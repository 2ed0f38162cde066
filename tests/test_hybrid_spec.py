"""Speculation on the hybrid models (qwen35 dense and qwen35moe) with their own MTP layer:

- sampled output is distributed exactly as plain sampling (chi-square, as for the dense models in
  test_speculative.py);
- an MTP layer distilled from its trunk (transformers' modules, trained here for a few hundred
  steps) drafts far better than an untrained one, and the same weights read wrongly (the
  concatenation's halves swapped, the zero-centred norms without their 1) lose that: the check
  that our MTP layer computes what the released layer computes.
"""
import shutil

import pytest
import torch

from mtpllm.runtime.engine import Engine
from mtpllm.runtime.sampling import SamplingParams
from mtpllm.speculative import SpecConfig
from mtpllm.speculative.verifier import SpecStats
from test_speculative import _chi2_pvalue

tiny_hybrid = pytest.importorskip("tiny_hybrid")
pytest.importorskip("transformers")


def _engine(src, n_ctx=256):
    return Engine.load(str(src), n_ctx=n_ctx)


# ------------------------------------------------------------------ distribution
# The tiny checkpoints' logits spread ~0.6 over 273 tokens: sampling from them is nearly uniform and
# a chi-square test on a few thousand samples could see nothing. Scaling lm_head by 8 gives top
# probabilities of a few tenths (a distribution a wrong residual or a wrong state visibly moves);
# the MTP layer drafts through the same lm_head, so its q is peaked too, and drafts are accepted
# at some positions and rejected at others.
PEAK = 8.0
SAMPLED = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, ignore_eos=True)
PROMPT = [5, 6, 7]
N_TOK = 4  # with k = 2 the first verification emits tokens 2..4 at most: a rejection there makes
#           a later step run on the recurrent state rolled back, so tokens 3 and 4 depend on it
N = 1000  # samples per arm


@pytest.fixture(scope="module")
def peaky(tmp_path_factory):
    from safetensors.torch import load_file, save_file
    root = tmp_path_factory.mktemp("peaky")
    out = {}
    for kind in ("qwen35", "qwen35moe"):
        d, _ = tiny_hybrid.make_tiny_hf(root / kind, kind, seed=3, echo=0.1)
        state = load_file(str(d / "model.safetensors"))
        state["lm_head.weight"] = state["lm_head.weight"] * PEAK
        save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
        out[kind] = _engine(d, 64)
    return out


def _samples(engine, k, seed0):
    spec = SpecConfig("mtp", k, policy="fixed").build(engine) if k else None
    stats = SpecStats()
    out = []
    for s in range(N):
        p = SamplingParams(**SAMPLED, max_tokens=N_TOK, seed=seed0 + s)
        c = engine.generate(prompt_ids=PROMPT, params=p, speculative=spec)
        out.append(tuple(c.tokens))
        if c.stats is not None:
            stats.merge(c.stats)
    return out, stats


# the MoE model runs its experts one by one in Python: 2 x 1000 generations take ~50 s, so that
# case runs with the slow tests
@pytest.mark.parametrize("kind,k", [("qwen35", 2), pytest.param("qwen35moe", 3, marks=pytest.mark.slow)])
def test_sampling_with_the_models_own_mtp_layer_follows_the_target(peaky, kind, k):
    """Tokens 1..4 sampled with MTP speculation (temperature 1) against plain sampling: a
    chi-square test of homogeneity per position (categories with fewer than 10 samples pooled).
    p > 1e-3 per position: a correct engine fails one of the 4 positions with probability < 0.4%.
    The rule's own power against a wrong residual step is shown in test_speculative
    (`test_acceptance_rule_emits_target_distribution`); here it runs through the hybrid model's
    recurrent-state rollback, and the drafts are both accepted and rejected at both positions."""
    eng = peaky[kind]
    plain, _ = _samples(eng, 0, 0)
    spec, st = _samples(eng, k, 10**6)
    assert all(len(t) == N_TOK for t in plain + spec)
    # the test exercises both outcomes of the acceptance rule at every draft position
    # (no step drafts past max_tokens: the first, after the prefill's token, at most N_TOK - 2)
    assert all(0 < a < d for a, d in zip(st.accepted_per_pos, st.drafted_per_pos))
    assert len(st.drafted_per_pos) == min(k, N_TOK - 2)
    # the distribution is peaked enough for the test to see something: the top first token is
    # far above uniform (1/273)
    first = [t[0] for t in plain]
    assert max(first.count(x) for x in set(first)) > 0.1 * N
    for pos in range(N_TOK):
        assert _chi2_pvalue(plain, spec, pos) > 1e-3, pos


# ------------------------------------------------------------------ a distilled MTP layer
STEPS = 200


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    """A tiny qwen35 whose MTP layer is distilled from its trunk, and copies of it read wrongly."""
    from safetensors.torch import load_file, save_file
    root = tmp_path_factory.mktemp("distilled")
    d, hf = tiny_hybrid.make_tiny_hf(root / "trained", "qwen35", seed=7, mtp=True)  # mtp: untrained, random
    untrained = root / "untrained"
    shutil.copytree(d, untrained)
    loss = tiny_hybrid.distill_mtp(d, hf, steps=STEPS)
    state = load_file(str(d / "model.safetensors"))
    D = hf.config.hidden_size
    variants = {"trained": d, "untrained": untrained}
    # the concatenation in the wrong order: [hidden, embedding] instead of [embedding, hidden]
    fc = state["mtp.fc.weight"]
    variants["swapped"] = _variant(d, root / "swapped", {"mtp.fc.weight": torch.cat([fc[:, D:], fc[:, :D]], 1)})
    # the pre-fc norms read as plain (w) instead of zero-centred (1 + w): stored w - 1
    variants["norms"] = _variant(d, root / "norms", {n: state[n] - 1 for n in state
                                                      if n.startswith("mtp.pre_fc_norm")})
    return {name: tiny_hybrid.hf_to_gguf(p, root / f"{name}.gguf") for name, p in variants.items()}, loss


def _variant(src, dst, changes):
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    save_file(state | changes, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


# held-out prompts: not among the training prompts (those are drawn from seed 0)
EVAL_PROMPTS = [torch.randint(0, 256, (6,), generator=torch.Generator().manual_seed(100 + i)).tolist()
                for i in range(3)]


def acceptance(gguf, k=1, n=48) -> float:
    eng = _engine(gguf)
    st = SpecStats()
    for ids in EVAL_PROMPTS:
        out = eng.generate(prompt_ids=ids, params=SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                           speculative=SpecConfig("mtp", k, policy="fixed").build(eng))
        st.merge(out.stats)
    return st.acceptance_rate


def test_distilled_mtp_layer_drafts_well(distilled):
    """Greedy drafts of one token (what the layer is trained for) on held-out prompts. Chance is
    1/273 per draft, and an untrained (random) MTP layer stays near it. The distilled layer must
    be accepted on more than 0.15 of its drafts (40x chance) and 3x as often as the untrained one;
    the same weights read wrongly (the concatenation's halves swapped, the zero-centred pre-fc norms
    without their 1) feed the block inputs it was never trained on and must lose at least half of
    the distilled layer's rate. (A few hundred steps on ~1300 positions of one random trunk do not
    generalise far beyond the trunk's recurring continuations: held-out acceptance is a few
    tenths, not the 0.6-0.8 of real models' heads.)"""
    files, loss = distilled
    rates = {name: acceptance(f) for name, f in files.items()}
    assert rates["trained"] > 0.15 and rates["trained"] > 3 * rates["untrained"], (rates, loss)
    assert rates["swapped"] < 0.5 * rates["trained"] and rates["norms"] < 0.5 * rates["trained"], rates
