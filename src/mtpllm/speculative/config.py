"""Speculative-decoding settings: vLLM-style JSON (`--speculative`) and llama.cpp-style flags."""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace

from ..errors import MtpllmError

MTP_ALIASES = {"mtp", "deepseek_mtp", "qwen3_next_mtp", "qwen3_5_mtp", "draft-mtp"}
METHODS = {"mtp", "draft_model", "ngram"}
LLAMA_SPEC_TYPES = {"none": None, "draft-mtp": "mtp", "draft-simple": "draft_model", "ngram-simple": "ngram"}
MAX_K = 16
# how the draft length is chosen per step: "cost" (expected tokens per unit of time from the measured
# step costs, the head's confidence and this request's acceptance, 0 = a plain step; policy.py),
# "fixed" (always the draft length, less what a cut-off stops), "adaptive" (grow by one after a
# fully accepted draft, shrink by one after a rejected first draft)
POLICIES = ("cost", "fixed", "adaptive")


@dataclass
class SpecConfig:
    method: str
    num_speculative_tokens: int = 3
    min_speculative_tokens: int = 1
    p_min: float = 0.0  # stop drafting when the draft's top probability falls below this
    # stop drafting when the product of the step's draft probabilities so far falls below this: the
    # head's estimate that the draft is still on the target's path (worth a verification row only
    # while above the row's cost relative to a step)
    p_cum: float = 0.0
    draft_model: str | None = None
    # head-only `mtp-*.gguf` file, or Hugging Face safetensors (a .safetensors file or a model directory);
    # default: MTP layers in the model file, or a shipped head
    mtp_head: str | None = None
    # shortest match lookup drafts from; None: 1 alone, 3 (or prompt_lookup_max if smaller) as the
    # first member of a chain, where a weak match's draft would displace a better MTP draft
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int = 4
    adaptive: bool = False  # the same as policy="adaptive"
    # None: "cost" for MTP, "fixed" for draft models, n-gram lookup and chains
    policy: str | None = None
    # made by default (chat, serve): used when the model has an MTP head, plain decoding otherwise
    auto: bool = False
    # a second method for the steps where this one has no draft (a chain: n-gram lookup first, MTP
    # otherwise), with its own draft length
    fallback: "SpecConfig | None" = None

    def __post_init__(self):
        m = self.method
        if m in MTP_ALIASES:
            self.method = m = "mtp"
        if m not in METHODS:
            raise MtpllmError(f"unknown speculative method '{m}' (known: mtp (aliases deepseek_mtp, qwen3_next_mtp, "
                              f"qwen3_5_mtp), draft_model, ngram)")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_K:
            raise MtpllmError(f"num_speculative_tokens must be an integer in 1..{MAX_K}, got {k!r}")
        kmin = self.min_speculative_tokens
        if not isinstance(kmin, int) or not 1 <= kmin <= k:
            raise MtpllmError(f"minimum draft length must be an integer in 1..{k}, got {kmin!r}")
        if not isinstance(self.p_min, (int, float)) or not 0.0 <= self.p_min < 1.0:
            raise MtpllmError(f"draft p-min must be in [0, 1), got {self.p_min!r}")
        if not isinstance(self.p_cum, (int, float)) or isinstance(self.p_cum, bool) or not 0.0 <= self.p_cum < 1.0:
            raise MtpllmError(f"draft cumulative p-min must be in [0, 1), got {self.p_cum!r}")
        if m == "draft_model" and not self.draft_model:
            raise MtpllmError("method draft_model needs a draft model: \"model\": NAME_OR_PATH (or -md FILE)")
        lo, hi = (1 if self.prompt_lookup_min is None else self.prompt_lookup_min), self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise MtpllmError(f"prompt_lookup_min/max must be integers with 1 <= min <= max, got {lo!r}, {hi!r}")
        if self.adaptive and self.policy not in (None, "adaptive"):
            raise MtpllmError(f"adaptive draft length and policy '{self.policy}' contradict each other")
        if self.adaptive:
            self.policy = "adaptive"
        if self.policy is None:
            self.policy = "cost" if m == "mtp" and self.fallback is None else "fixed"
        if self.policy not in POLICIES:
            raise MtpllmError(f"unknown draft-length policy {self.policy!r} (known: {', '.join(POLICIES)})")
        self.adaptive = self.policy == "adaptive"
        fb = self.fallback
        if fb is not None:
            if fb.fallback is not None:
                raise MtpllmError("a chain of speculative methods has two members at most")
            if fb.method == m:
                raise MtpllmError(f"the fallback method must differ from the first one ({m})")
            if m != "ngram":
                # MTP and draft models always draft: a member after them would never be asked
                raise MtpllmError(f"only n-gram lookup can come first in a chain ({m} always has a draft)")

    def label(self) -> str:
        own = f"{self.method}:{self.num_speculative_tokens}"
        return own if self.fallback is None else f"{own}+{self.fallback.label()}"

    def build(self, engine):
        """The speculative decoder for this config on a loaded engine (loads draft model / MTP head)."""
        from .verifier import SpeculativeDecoder
        prop = self._proposer(engine)
        if self.fallback is not None:
            from .chain import ChainProposer
            fb = self.fallback
            prop = ChainProposer([prop, fb._proposer(engine)], [self.num_speculative_tokens, fb.num_speculative_tokens],
                                 [self.method, fb.method])
            k = max(self.num_speculative_tokens, fb.num_speculative_tokens)
            return SpeculativeDecoder(prop, replace(self, fallback=None, num_speculative_tokens=k,
                                                    min_speculative_tokens=min(self.min_speculative_tokens, k)))
        return SpeculativeDecoder(prop, self)

    def usable(self, engine) -> bool:
        """For a default (`auto`) config: whether the model has an MTP head to draft with (in its
        file, or a shipped / cached head made for it). Explicit configs are always tried."""
        if not self.auto:
            return True
        from .mtp import MTPProposer
        return MTPProposer.head_available(engine)

    def _proposer(self, engine):
        if self.method == "ngram":
            from .ngram import NgramProposer
            lo = self.prompt_lookup_min
            if lo is None:
                lo = min(3, self.prompt_lookup_max) if self.fallback is not None else 1
            prop = NgramProposer(lo, self.prompt_lookup_max)
        elif self.method == "draft_model":
            from .draft import DraftModelProposer
            prop = DraftModelProposer.load(self.draft_model, engine)
        else:
            from .mtp import MTPProposer
            prop = MTPProposer.for_engine(engine, self.mtp_head)
        return prop


_JSON_KEYS = {"method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max",
              "draft_p_min", "draft_p_cumulative", "min_speculative_tokens", "adaptive", "policy", "mtp_head",
              "fallback"}


def parse_speculative_json(text: str) -> SpecConfig:
    """vLLM's `--speculative-config` schema: {"method": ..., "num_speculative_tokens": N, ...}, plus
    "fallback": {another such object} for a chain (n-gram lookup first, e.g. MTP otherwise)."""
    try:
        d = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MtpllmError(f"--speculative: invalid JSON ({exc.msg} at column {exc.colno}): {text!r}") from None
    return _spec_from_dict(d)


def _spec_from_dict(d) -> SpecConfig:
    if not isinstance(d, dict):
        raise MtpllmError(f"--speculative: expected a JSON object, got {type(d).__name__}")
    unknown = sorted(set(d) - _JSON_KEYS)
    if unknown:
        raise MtpllmError(f"--speculative: unknown keys {unknown} (known: {sorted(_JSON_KEYS)})")
    if "method" not in d:
        raise MtpllmError("--speculative: \"method\" is required (mtp, draft_model, ngram)")
    if not isinstance(d["method"], str):
        raise MtpllmError("--speculative: \"method\" must be a string")
    return SpecConfig(
        method=d["method"], num_speculative_tokens=d.get("num_speculative_tokens", 3),
        min_speculative_tokens=d.get("min_speculative_tokens", 1), p_min=d.get("draft_p_min", 0.0),
        p_cum=d.get("draft_p_cumulative", 0.0),
        draft_model=d.get("model"), mtp_head=d.get("mtp_head"),
        prompt_lookup_min=d.get("prompt_lookup_min"), prompt_lookup_max=d.get("prompt_lookup_max", 4),
        adaptive=bool(d.get("adaptive", False)), policy=_policy(d.get("policy")),
        fallback=_spec_from_dict(d["fallback"]) if d.get("fallback") is not None else None)


def _policy(p):
    if p is not None and not isinstance(p, str):
        raise MtpllmError(f"--speculative: \"policy\" must be one of {', '.join(POLICIES)}, got {p!r}")
    return p


def add_spec_args(ap: argparse.ArgumentParser, default_mtp: bool = False) -> None:
    g = ap.add_argument_group("speculative decoding")
    g.add_argument("--speculative", "--speculative-config", dest="speculative", default=None, metavar="JSON",
                   help='vLLM-style, e.g. \'{"method":"mtp","num_speculative_tokens":3}\'')
    g.add_argument("--spec-type", default=None, metavar="TYPE",
                   help="llama.cpp-style: none | draft-mtp | draft-simple | ngram-simple; two as a chain, "
                        "e.g. ngram-simple,draft-mtp (lookup where it finds a match, MTP otherwise)"
                        + ("; default where the model has an MTP head: ngram-simple,draft-mtp under the cost "
                           "policy, lookup drafting up to 8 and the head up to --spec-draft-n-max (none: plain decoding)"
                           if default_mtp else ""))
    g.add_argument("--spec-draft-n-max", type=int, default=None, help="max draft tokens per step (default 3)")
    g.add_argument("--spec-draft-n-min", type=int, default=None, help="min draft tokens per step (default 1)")
    g.add_argument("--spec-fallback-n-max", type=int, default=None,
                   help="max draft tokens of the second type of a chain (default: --spec-draft-n-max)")
    g.add_argument("--spec-draft-p-min", type=float, default=None,
                   help="stop drafting when the draft's top probability is below this (default 0)")
    g.add_argument("--spec-draft-p-cum", type=float, default=None, metavar="P",
                   help="stop drafting when the product of the step's draft probabilities is below this "
                        "(default 0; e.g. 0.3 where a verification row costs ~a quarter of a step)")
    g.add_argument("-md", "--spec-draft-model", "--model-draft", dest="spec_draft_model", default=None,
                   help="draft model for draft-simple (registry name or GGUF path)")
    g.add_argument("--spec-mtp-head", default=None,
                   help="MTP head for draft-mtp: a head-only mtp-*.gguf file, a .safetensors file or a Hugging Face "
                        "model directory (Qwen3-Next/3.5 mtp.* or DeepSeek/GLM model.layers.L.* names)")
    g.add_argument("--spec-policy", choices=POLICIES, default=None,
                   help="how the draft length is chosen each step: cost (default for draft-mtp: "
                        "the k, 0 included, with the most expected tokens per unit of time, from this machine's "
                        "measured step costs, the draft's confidence and the acceptance so far), fixed (always "
                        "--spec-draft-n-max, less what a cut-off stops), adaptive (as --spec-adaptive)")
    g.add_argument("--spec-adaptive", action="store_true", help="grow/shrink the draft length from acceptance")
    g.add_argument("--spec-ngram-min", type=int, default=None, help="n-gram lookup: shortest match (default 1; 3 as the first type of a chain)")
    g.add_argument("--spec-ngram-max", type=int, default=None, help="n-gram lookup: longest match (default 4)")


DEFAULT_LOOKUP = 8  # drafts of n-gram lookup in the default chain


def default_config() -> SpecConfig:
    """What `run`, `chat` and `serve` speculate with unless told: n-gram lookup first, the MTP head
    otherwise, under the cost policy (`auto`: only where the model has a head). Lookup is free to
    propose and drafts long runs where the answer copies the context (a long file edited: 1.84x
    plain at 8K tokens, against 0.97x for the head alone), and where it has no match the head
    drafts as alone (code answers: 1.05x the head alone); docs/benchmarks.md."""
    return SpecConfig(method="ngram", num_speculative_tokens=DEFAULT_LOOKUP, policy="cost", auto=True,
                      fallback=SpecConfig(method="mtp"))


def spec_from_args(a, default_mtp: bool = False) -> SpecConfig | None:
    """Combine --speculative JSON and llama.cpp-style flags into one validated SpecConfig (or None).
    default_mtp: without a method, `default_config()` (`auto`: used where the model has a head);
    `--spec-type none` turns it off."""
    cfg = None
    if default_mtp and not a.speculative and a.spec_type is None and not a.spec_draft_model:
        cfg = default_config()
    if a.speculative:
        cfg = parse_speculative_json(a.speculative)
    if a.spec_type is not None:
        types = [t.strip() for t in a.spec_type.split(",") if t.strip()]
        for t in types:
            if t not in LLAMA_SPEC_TYPES:
                hint = " (the name is draft-mtp)" if t == "mtp" else ""
                raise MtpllmError(f"--spec-type: unknown type '{t}'{hint}; known: {', '.join(LLAMA_SPEC_TYPES)}")
        types = [t for t in types if LLAMA_SPEC_TYPES[t]]
        if len(types) > 2:
            raise MtpllmError("--spec-type: a chain has two types at most (e.g. ngram-simple,draft-mtp)")
        if not types and a.speculative:
            raise MtpllmError("--spec-type none and --speculative contradict each other: give one")
        if types:
            if cfg is not None and cfg.method != LLAMA_SPEC_TYPES[types[0]]:
                raise MtpllmError("--spec-type and --speculative name different methods")

            def one(t: str) -> SpecConfig:
                return SpecConfig(method=LLAMA_SPEC_TYPES[t], draft_model=a.spec_draft_model if t == "draft-simple" else None)
            cfg = cfg or one(types[0])
            if len(types) == 2:
                cfg.fallback = one(types[1])
    elif cfg is None and a.spec_draft_model:
        cfg = SpecConfig(method="draft_model", draft_model=a.spec_draft_model)
    if cfg is None:
        flags = [a.spec_draft_n_max, a.spec_draft_n_min, a.spec_draft_p_min, a.spec_draft_p_cum, a.spec_mtp_head,
                 a.spec_fallback_n_max, a.spec_policy, a.spec_draft_model, a.spec_ngram_min, a.spec_ngram_max]
        if any(f is not None for f in flags) or a.spec_adaptive:
            raise MtpllmError("speculative options given without a method: add --spec-type or --speculative")
        return None
    if a.spec_fallback_n_max is not None and cfg.fallback is None:
        raise MtpllmError("--spec-fallback-n-max needs a chain of two types (e.g. --spec-type ngram-simple,draft-mtp)")
    if a.spec_draft_n_max is not None:
        if cfg.auto and cfg.fallback is not None:  # the default chain: the MTP head's draft length
            cfg.fallback.num_speculative_tokens = a.spec_draft_n_max
        else:
            cfg.num_speculative_tokens = a.spec_draft_n_max
            if cfg.fallback is not None:
                cfg.fallback.num_speculative_tokens = a.spec_draft_n_max
    if a.spec_fallback_n_max is not None:
        cfg.fallback.num_speculative_tokens = a.spec_fallback_n_max
    if a.spec_draft_n_min is not None:
        cfg.min_speculative_tokens = a.spec_draft_n_min
    if a.spec_draft_p_min is not None:
        cfg.p_min = a.spec_draft_p_min
    if a.spec_draft_p_cum is not None:
        cfg.p_cum = a.spec_draft_p_cum
    if a.spec_mtp_head and "mtp" not in (cfg.method, cfg.fallback.method if cfg.fallback else None):
        raise MtpllmError("--spec-mtp-head is for draft-mtp: add it to --spec-type")
    for c in (cfg, cfg.fallback):
        if c is None:
            continue
        if a.spec_draft_model and c.method == "draft_model":
            c.draft_model = a.spec_draft_model
        if a.spec_mtp_head and c.method == "mtp":
            c.mtp_head = a.spec_mtp_head
        c.p_min, c.p_cum = cfg.p_min, cfg.p_cum
    if a.spec_ngram_min is not None:
        cfg.prompt_lookup_min = a.spec_ngram_min
    if a.spec_ngram_max is not None:
        cfg.prompt_lookup_max = a.spec_ngram_max
    if a.spec_adaptive and a.spec_policy not in (None, "adaptive"):
        raise MtpllmError(f"--spec-adaptive and --spec-policy {a.spec_policy} contradict each other")
    if a.spec_adaptive:
        cfg.policy = "adaptive"
    elif a.spec_policy is not None:
        cfg.policy, cfg.adaptive = a.spec_policy, False
    if cfg.auto and (cfg.mtp_head or (cfg.fallback is not None and cfg.fallback.mtp_head)):
        cfg.auto = False  # a head given by name is required, not optional
    if cfg.fallback is not None:
        cfg.fallback.__post_init__()
    cfg.__post_init__()
    return cfg
