"""MTP proposer and MTP weight loading (GGUF in-file next-n layers, a head-only `mtp-*.gguf`, or
Hugging Face safetensors through `hf_mtp.HFMTPFile`, which presents them under the GGUF names).

GGUF layout (llama.cpp): `<arch>.nextn_predict_layers = n`, `<arch>.block_count` includes the n
MTP blocks; block L = block_count - n + j holds ordinary `blk.L.attn_*`/`ffn_*` tensors plus
`blk.L.nextn.{eh_proj,enorm,hnorm,shared_head_norm}` (optional `shared_head_head`, `embed_tokens`).
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch

from ..errors import MtpllmError
from ..gguf.quants import SUPPORTED_TYPES
from ..gguf.reader import GGUFFile
from ..models.base import ARCHITECTURES, Embedding, build_block, make_rotaries, _norm
from ..models.mtp import MTPHead
from ..runtime.kernels import argmax
from ..runtime.linear import decode_rows, make_linear
from .hf_mtp import HFMTPFile, is_safetensors_source
from ..runtime.engine import PREFILL_CHUNK
from .verifier import common_prefix, draft_chain_steps, draft_token, draft_token_in

HEAD_SHA_KEY = "mtpllm.trunk_sha256"


def open_head_file(path: str | Path, trunk_cfg) -> "GGUFFile | HFMTPFile":
    """A head source given by the user: a GGUF file, or Hugging Face safetensors (file, index or directory)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise MtpllmError(f"{p}: no such MTP head file or directory (expected a GGUF head, a .safetensors "
                          f"file or a Hugging Face model directory)")
    if is_safetensors_source(p):
        from ..models.hf import HYBRID, HFModelFile
        if trunk_cfg.arch in HYBRID:  # a hybrid's checkpoint: its `mtp.*` layer, block n_layers
            g = HFModelFile(p)
            if g.arch != trunk_cfg.arch or g.n_layers != trunk_cfg.n_layers:
                raise MtpllmError(f"{p}: a {g.arch} checkpoint with {g.n_layers} layers; the model is "
                                  f"{trunk_cfg.arch} with {trunk_cfg.n_layers}")
            return g
        return HFMTPFile(p, trunk_cfg)
    return GGUFFile(p)


def load_mtp_head(g: "GGUFFile | HFMTPFile", trunk, mode: str = "fast", layer: int | None = None) -> MTPHead:
    """Build the first MTP block found in `g` (the trunk file itself or a head-only file) for `trunk`."""
    from ..models.config import MAX_LAYERS, MAX_VOCAB, meta_int
    tcfg = trunk.cfg
    arch = g.get("general.architecture")
    if arch != tcfg.arch:
        raise MtpllmError(f"{g.path}: MTP head is for architecture '{arch}', the model is '{tcfg.arch}'")
    n_nextn = meta_int(g, f"{arch}.nextn_predict_layers", 0, lo=0, hi=MAX_LAYERS)
    if n_nextn <= 0:
        raise MtpllmError(f"{g.path}: no MTP layers ({arch}.nextn_predict_layers is missing or 0)")
    d = meta_int(g, f"{arch}.embedding_length", 0, lo=0)
    if d != tcfg.d_model:
        raise MtpllmError(f"{g.path}: MTP head hidden size {d} does not match the model's {tcfg.d_model}")
    head_vocab = meta_int(g, f"{arch}.vocab_size", None, hi=MAX_VOCAB)
    if head_vocab is not None and head_vocab != tcfg.vocab_size:
        raise MtpllmError(f"{g.path}: MTP head vocabulary {head_vocab} does not match the model's {tcfg.vocab_size}")
    block_count = meta_int(g, f"{arch}.block_count", hi=MAX_LAYERS)
    if n_nextn > block_count:
        raise MtpllmError(f"{g.path}: {arch}.nextn_predict_layers = {n_nextn} is more than {arch}.block_count = "
                          f"{block_count}")
    L = block_count - n_nextn if layer is None else layer
    p = f"blk.{L}."
    if p + "nextn.eh_proj.weight" not in g:
        raise MtpllmError(f"{g.path}: MTP block {L} has no tensor '{p}nextn.eh_proj.weight'")
    eh = g.info(p + "nextn.eh_proj.weight")
    if eh.shape != (tcfg.d_model, 2 * tcfg.d_model):
        raise MtpllmError(f"{g.path}: {_shown(g, p + 'nextn.eh_proj.weight')} has shape {list(eh.shape)}, expected "
                          f"[{tcfg.d_model}, {2 * tcfg.d_model}] for this model")
    arch_mod = ARCHITECTURES[tcfg.arch]
    if hasattr(arch_mod, "build_mtp_block"):  # an architecture with its own block type (qwen35: gated attention)
        block = arch_mod.build_mtp_block(g, tcfg, L, mode)
    else:
        _check_block_shapes(g, tcfg, p)
        full_rot, _ = make_rotaries(trunk.gguf, tcfg)
        # the head's block may differ from the trunk's in optional parts: its own tensors decide
        cfg = replace(tcfg, qkv_bias=p + "attn_q.bias" in g, qk_norm=p + "attn_q_norm.weight" in g,
                      sandwich_norm=p + "post_ffw_norm.weight" in g)
        block = build_block(g, cfg, L, full_rot, mode)
    eps = tcfg.norm_eps
    lm_head = make_linear(g, [p + "nextn.shared_head_head.weight"], mode=mode) \
        if p + "nextn.shared_head_head.weight" in g else None
    embed = None
    if p + "nextn.embed_tokens.weight" in g:
        e = g.info(p + "nextn.embed_tokens.weight")
        embed = Embedding(g.raw(e.name), e.qtype, e.shape[0], e.shape[1], tcfg.embed_scale)
    head = MTPHead(_norm(g, p + "nextn.enorm.weight", eps), _norm(g, p + "nextn.hnorm.weight", eps),
                   make_linear(g, [p + "nextn.eh_proj.weight"], mode=mode), block,
                   _norm(g, p + "nextn.shared_head_norm.weight", eps), lm_head, embed)
    vocab = g.get("mtpllm.draft_vocab")
    if vocab is not None:
        if not isinstance(vocab, list) or not vocab \
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in vocab):
            raise MtpllmError(f"{g.path}: metadata 'mtpllm.draft_vocab' must be a non-empty array of token ids")
        if min(vocab) < 0 or max(vocab) >= tcfg.vocab_size:
            raise MtpllmError(f"{g.path}: mtpllm.draft_vocab has token ids outside the model's vocabulary")
        head.draft_vocab = torch.tensor(vocab, dtype=torch.long)
    head.set_window(head_window(g))
    head.eval()
    return head


# A head trained by `train-mtp` on windows of S tokens attends over the last max(HEAD_WINDOW, 2 S)
# positions of its cache, not all of them: at 8K-token prompts the 0.5B's shipped head (S = 256)
# accepted as many drafts with a window of 1024-4096 as with the whole context (summary 1.63-1.72
# vs 1.63, file edit 1.65-1.69 vs 1.65, k = 3) while its drafting cost per step fell from 7.2 to
# 5.2-6.0 ms, and the cost no longer grows with the context (a draft row's attention at 32K: 2.1 ms
# against 0.3). Contexts within the window are unchanged bit for bit. A model's own MTP layers
# (trained by its makers on long sequences) keep full attention.
HEAD_WINDOW = 2048


def head_window(g) -> int:
    """The attention window of the head in `g`: 0 (all positions) unless it records the length of
    the windows it was trained on (`mtpllm.train.seq_len`)."""
    from ..models.config import meta_int
    seq_len = meta_int(g, "mtpllm.train.seq_len", 0, lo=0, hi=1 << 30)
    return max(HEAD_WINDOW, 2 * seq_len) if seq_len else 0


def _shown(g, name: str) -> str:
    """A tensor's name as the file spells it (Hugging Face files use their own names)."""
    return g.source_name(name) if hasattr(g, "source_name") else name


def _check_block_shapes(g, tcfg, p: str) -> None:
    """The MTP block's tensors must fit the trunk's attention layout and one consistent FFN width."""
    from ..models.config import MATRIX_UNSUPPORTED
    D, H, KV, hd = tcfg.d_model, tcfg.n_heads, tcfg.n_kv_heads, tcfg.head_dim
    qshape = g.info(p + "attn_q.weight").shape
    if qshape == (2 * H * hd, D):
        raise MtpllmError(f"{g.path}: the MTP block's q projection has {qshape[0]} rows = 2 x {H} heads x {hd}: "
                          f"an attention output gate (Qwen3-Next / Qwen3.5 style), which is not supported")
    ffn = g.info(p + "ffn_gate.weight").shape[0]
    want = {"attn_q.weight": (H * hd, D), "attn_k.weight": (KV * hd, D), "attn_v.weight": (KV * hd, D),
            "attn_output.weight": (D, H * hd), "ffn_gate.weight": (ffn, D), "ffn_up.weight": (ffn, D),
            "ffn_down.weight": (D, ffn), "attn_norm.weight": (D,), "ffn_norm.weight": (D,), "nextn.enorm.weight": (D,),
            "nextn.hnorm.weight": (D,), "nextn.shared_head_norm.weight": (D,)}
    optional = {"attn_q.bias": (H * hd,), "attn_k.bias": (KV * hd,), "attn_v.bias": (KV * hd,),
                "attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,),
                "post_attention_norm.weight": (D,), "post_ffw_norm.weight": (D,),
                "nextn.shared_head_head.weight": (tcfg.vocab_size, D),
                "nextn.embed_tokens.weight": (tcfg.vocab_size, D)}
    for name, shape in list(want.items()) + [(n, s) for n, s in optional.items() if p + n in g]:
        info = g.info(p + name)
        if info.qtype not in SUPPORTED_TYPES or (len(shape) == 2 and info.qtype in MATRIX_UNSUPPORTED):
            raise MtpllmError(f"{g.path}: MTP tensor '{_shown(g, p + name)}' has type {info.qtype.name}, which is "
                              f"not supported")
        have = tuple(info.shape)
        if have != shape:
            raise MtpllmError(f"{g.path}: MTP tensor '{_shown(g, p + name)}' has shape {list(have)}, "
                              f"expected {list(shape)} for this model (hidden {D}, {H} heads, {KV} kv heads, head dim {hd})")


def check_head_trunk(g: GGUFFile, trunk_path: Path) -> None:
    """A head trained for another trunk (recorded SHA-256 differs) is refused."""
    want = g.get(HEAD_SHA_KEY)
    if not want:
        return
    if not isinstance(want, str):
        raise MtpllmError(f"{g.path}: metadata '{HEAD_SHA_KEY}' must be a SHA-256 string, got {type(want).__name__}")
    from ..registry import sha256_cached
    have = sha256_cached(trunk_path)
    if have != want:
        raise MtpllmError(f"{g.path}: this MTP head was trained for a model with sha256 {want[:16]}..., "
                          f"but {trunk_path.name} has sha256 {have[:16]}...; use the head made for this model "
                          f"or train one with `mtpllm train-mtp`")


def find_head_for(trunk_path: Path) -> Path | None:
    """A shipped or cached head for a registry model: `mtp-<model>.gguf` next to the package or the model."""
    from ..registry import find_entry_by_path
    entry = find_entry_by_path(trunk_path)
    names = [f"mtp-{entry.name}.gguf"] if entry else []
    names.append(f"mtp-{trunk_path.stem}.gguf")
    dirs = [Path(__file__).resolve().parent.parent / "heads", trunk_path.parent]
    for d in dirs:
        for n in names:
            if (d / n).exists():
                return d / n
    return None


class MTPState:
    """One sequence's drafting state for an MTP head: the head's own KV cache of (t_{i+1}, h_i)
    entries, the trunk states not yet fed to it, and the request's tokens outside the draft vocabulary."""

    def __init__(self, cache):
        self.cache = cache
        self.tokens: list[int] = []  # tokens t_1.. whose (t_{i+1}, h_i) entries are in the cache
        self._pending: list[torch.Tensor] = []  # trunk hidden states not yet fed to the head, by step
        self.pending_start = 0  # position of pending_h[0]
        self.catchup_ms = 0.0  # time spent writing the head's entries of earlier positions, not yet read
        self.clear_context(None)

    def clear_context(self, vocab) -> None:
        self.ctx_tokens: list[int] = []  # this request's tokens outside the draft vocabulary
        self.ctx_seen = 0  # history tokens already scanned for them
        self.ctx_head = None  # lm_head rows of ctx_tokens
        self.draft_ids = vocab  # token id of each draft logit: the vocabulary, then ctx_tokens

    @property
    def pending_h(self) -> torch.Tensor | None:
        """The trunk states not yet fed to the head [n, D] (None: none). Kept as the steps' pieces
        and joined when read: steps that do not draft add theirs without copying the earlier ones."""
        if not self._pending:
            return None
        if len(self._pending) > 1:
            self._pending = [torch.cat(self._pending)]
        return self._pending[0]

    @pending_h.setter
    def pending_h(self, h: torch.Tensor | None) -> None:
        self._pending = [] if h is None else [h]

    @property
    def has_pending(self) -> bool:
        """Whether trunk states wait for the head (without joining them, as `pending_h` does)."""
        return bool(self._pending)

    def add_pending(self, h: torch.Tensor) -> None:
        self._pending.append(h)

    def reset(self) -> None:
        self.cache.reset()
        self.tokens, self.pending_h, self.pending_start = [], None, 0


class MTPProposer:
    """Drafts with an MTP head from the trunk's hidden states (no second pass of the trunk).
    The head's weights are shared by every sequence; each sequence has an `MTPState` (`new_state`)."""

    def __init__(self, head: MTPHead, trunk, n_ctx: int, device="cpu"):
        self.head = head
        self.trunk = trunk
        self.n_ctx = n_ctx
        self.embed = head.embed or trunk.embed
        self.lm_head = head.lm_head or trunk.lm_head
        self.vocab = getattr(head, "draft_vocab", None)  # reduced draft vocabulary (token ids) or None
        # Tokens of the request outside the draft vocabulary (an identifier of the prompt that the
        # answer repeats: 60% of the 1.5B's answer tokens missing from its head's vocabulary appear
        # earlier in their conversation) are draft candidates too, through their own lm_head rows.
        self.context_vocab = False
        if self.vocab is not None and head.lm_head is None:
            self.lm_head = trunk.lm_head.rows(self.vocab)  # only those rows: a cheaper draft matmul
            self.context_vocab = True
            self._in_vocab = torch.zeros(trunk.cfg.vocab_size, dtype=torch.bool)
            self._in_vocab[self.vocab.cpu()] = True
        self.device = device

    def new_state(self) -> MTPState:
        st = MTPState(self.head.make_cache(self.trunk.cfg, self.n_ctx, self.device))
        st.clear_context(self.vocab)
        return st

    @classmethod
    def for_engine(cls, engine, head_path: str | None = None) -> "MTPProposer":
        trunk = engine.model
        mode = "f32" if trunk.lm_head.kind == "f32" else "fast"
        src = trunk.source
        if head_path:
            g = open_head_file(head_path, trunk.cfg)
            check_head_trunk(g, src)
        elif trunk.cfg.n_nextn > 0:
            g = trunk.gguf
        else:
            found = find_head_for(src)
            if found is None:
                raise MtpllmError(
                    f"{src.name} has no MTP layers ({trunk.cfg.arch}.nextn_predict_layers = 0). Train a head with "
                    f"`mtpllm train-mtp -m {src} --data TEXT... -o mtp-{src.stem}.gguf` and pass it with "
                    f"--spec-mtp-head, or use --spec-type ngram-simple / draft-simple")
            g = GGUFFile(found)
            check_head_trunk(g, src)
        head = load_mtp_head(g, trunk, mode)
        if engine.device != "cpu":
            head.to(engine.device)
        return cls(head, trunk, engine.n_ctx, engine.device)

    @staticmethod
    def head_available(engine) -> bool:
        """Whether the engine's model has an MTP head without being told one: MTP layers in its file,
        or a shipped / cached head made for it."""
        trunk = engine.model
        if trunk.cfg.n_nextn > 0:
            return True
        found = find_head_for(trunk.source)
        if found is None:
            return False
        try:
            check_head_trunk(GGUFFile(found), trunk.source)
        except MtpllmError:
            return False
        return True

    MAX_CONTEXT_ROWS = 4096

    def update_context(self, st: MTPState, history: list[int]) -> None:
        """Add the history's new tokens outside the draft vocabulary to the sequence's draft candidates."""
        if not self.context_vocab or len(st.ctx_tokens) >= self.MAX_CONTEXT_ROWS:
            return
        have = set(st.ctx_tokens)
        new = [t for t in dict.fromkeys(history[st.ctx_seen:])
               if 0 <= t < self._in_vocab.shape[0] and not self._in_vocab[t] and t not in have]
        st.ctx_seen = len(history)
        if new:
            st.ctx_tokens += new[:self.MAX_CONTEXT_ROWS - len(st.ctx_tokens)]
            ids = torch.tensor(st.ctx_tokens, dtype=torch.long)
            st.ctx_head = self.trunk.lm_head.rows(ids)
            st.draft_ids = torch.cat([self.vocab, ids.to(self.vocab.device)])

    # the head's cache entry at position i needs t_{i+1}: it can reuse entries for prompt[1:]
    def reusable_prefix(self, st: MTPState, prompt: list[int]) -> int:
        return min(common_prefix(st.tokens, prompt[1:]), st.cache.length)

    @torch.inference_mode()
    def begin(self, st: MTPState, prompt, prompt_hidden: torch.Tensor, start: int, chunk: int = PREFILL_CHUNK) -> None:
        """The prompt's hidden states (positions start .. len(prompt)-1) go through the head now, as
        part of prompt processing: then a later request that shares this prefix finds it in the head's
        cache too, even when this one ends before any drafting. The last position waits for the first
        generated token (its entry needs t_{i+1}). Only their cache entries are computed
        (`MTPHead.fill`: no attention, no MLP), `chunk` positions at a time. (Cheap beside the
        trunk's prefill, so it runs in one scheduler step.)"""
        st.cache.trim(st.cache.length - start)
        st.clear_context(self.vocab)
        self.update_context(st, prompt)
        n = max(len(prompt) - 1 - start, 0)  # positions whose next token is already known
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            toks = torch.tensor(prompt[start + 1 + a:start + 1 + b], dtype=torch.long, device=self.device)
            self.head.fill(self.embed(toks), prompt_hidden[a:b], st.cache)
        st.tokens = list(prompt[1:start + 1 + n])
        st.pending_h = prompt_hidden[n:]  # positions start+n .. len(prompt)-1
        st.pending_start = start + n

    # requests a drafting generator (`_drafting`) yields for the head's weights
    HEAD, LOGITS, FILL = "head", "logits", "fill"

    def _drafting(self, st: MTPState, history: list[int], k: int, sampler, p_min: float = 0.0,
                  p_cum: float = 0.0, keep=None):
        """One sequence's drafting as a generator: it yields (HEAD, token ids, hidden [T, D]) for the
        head's block over T new positions of `st.cache`, (FILL, token ids, hidden) for their cache
        entries only, and (LOGITS, g [1, D]) for the draft logits of an output state, is sent their
        results, and returns (drafts, their q). The driver serves one sequence (`propose`) or several
        at once (`propose_batch`)."""
        p0 = len(history) - 1  # position of x0 (not yet in the trunk's cache)
        cache = st.cache
        c = cache.length
        assert c == st.pending_start, "MTP cache out of step with the trunk"
        k = min(k, cache.max_len - p0)
        if k <= 0 or st.pending_h is None:
            return [], []
        # catch-up: true entries for positions c..p0-1 with (t_{i+1}, h_i); only the last one's
        # output is read, so the others write their cache entries alone
        pending = st.pending_h
        if p0 - c > 1:
            yield (self.FILL, history[c + 1:p0], pending[:-1])
        g_last = yield (self.HEAD, history[p0:p0 + 1], pending[-1:])
        st.tokens = list(history[1:p0 + 1])
        st.pending_h = None
        self.update_context(st, history)

        def next_draft(hist, cut):
            logits = (yield (self.LOGITS, g_last))[0]
            if st.ctx_head is not None:
                logits = torch.cat([logits, st.ctx_head(g_last)[0]])
            if self.vocab is not None and sampler.p.greedy and not sampler.p.uses_penalties:
                # greedy drafts from the draft vocabulary's logits alone: the tokens outside it have
                # -inf (probability 0), so argmax and top probability are those of the full vector
                j = argmax(logits)
                d, q = int(st.draft_ids[j]), None
                top = float(torch.softmax(logits, -1)[j]) if cut > 0 else 1.0
            elif self.vocab is not None:  # tokens outside the draft vocabulary are never proposed
                d, q, top = draft_token_in(logits, st.draft_ids, self.trunk.cfg.vocab_size, sampler, hist, cut)
            else:
                d, q, top = draft_token(logits, sampler, hist, cut)
            return d, q, top

        def advance(d):
            nonlocal g_last
            g_last = yield (self.HEAD, [d], g_last)

        drafts, qs = yield from draft_chain_steps(k, next_draft, advance, history, p_min, p_cum, keep)
        cache.trim(cache.length - p0)  # drop speculative recursion entries
        return drafts, qs

    @torch.inference_mode()
    def propose(self, st: MTPState, history: list[int], k: int, sampler, p_min: float = 0.0, p_cum: float = 0.0,
                keep=None):
        """Up to k drafts and their distributions. The cut-offs drop the first draft whose top
        probability (or the product of them) is too low, and `keep(i, probability)`, when given,
        the first draft it refuses, with everything after it."""
        return self.propose_batch([st], [history], [k], [sampler], p_min, p_cum, [keep])[0]

    @torch.inference_mode()
    def propose_batch(self, sts: list, histories: list, ks: list[int], samplers: list, p_min: float = 0.0,
                      p_cum: float = 0.0, keeps: list | None = None) -> list:
        """`propose` for several sequences at once, each on its own state, history, draft length,
        sampler and keep rule: at each draft position the head's block runs once over every
        sequence still drafting (`MTPHead.forward_batch`: its weights read once, attention in each
        sequence's own cache) and the draft logits of all of them come from one pass of the output
        rows, in slices that keep each row's one-row bits. So each sequence's drafts are exactly
        those it drafts alone. -> [(drafts, qs)] per sequence. If it raises, every state is as it
        was before the call (the caller can retry each sequence alone)."""
        saved = [(st.cache.length, st.tokens, st.pending_h, st.pending_start) for st in sts]
        try:
            return self._propose_batch(sts, histories, ks, samplers, p_min, p_cum, keeps)
        except BaseException:
            for st, (length, tokens, pending_h, pending_start) in zip(sts, saved):
                st.cache.trim(st.cache.length - length)  # entries past it are written again later
                st.tokens, st.pending_h, st.pending_start = tokens, pending_h, pending_start
            raise

    def _propose_batch(self, sts, histories, ks, samplers, p_min, p_cum, keeps) -> list:
        keeps = keeps or [None] * len(sts)
        gens = [self._drafting(st, h, k, smp, p_min, p_cum, kp)
                for st, h, k, smp, kp in zip(sts, histories, ks, samplers, keeps)]
        out: list = [None] * len(gens)
        todo = {}
        for i, g in enumerate(gens):
            try:
                todo[i] = next(g)
            except StopIteration as stop:
                out[i] = stop.value
        while todo:
            results = {}
            for i in [i for i, r in todo.items() if r[0] == self.FILL]:
                t0 = time.perf_counter()
                self.head.fill(self.embed(torch.tensor(todo[i][1], dtype=torch.long, device=self.device)),
                               todo[i][2], sts[i].cache)
                sts[i].catchup_ms += (time.perf_counter() - t0) * 1e3
                results[i] = None
            heads = [i for i, r in todo.items() if r[0] == self.HEAD]
            if heads:
                embs = [self.embed(torch.tensor(todo[i][1], dtype=torch.long, device=self.device)) for i in heads]
                gs = self.head.forward_batch(embs, [todo[i][2] for i in heads], [sts[i].cache for i in heads])
                results.update(zip(heads, gs))
            outs = [i for i, r in todo.items() if r[0] == self.LOGITS]
            if outs:
                logits = decode_rows(self.lm_head, torch.cat([todo[i][1] for i in outs]))
                results.update((i, logits[j:j + 1]) for j, i in enumerate(outs))
            for i, res in results.items():
                try:
                    todo[i] = gens[i].send(res)
                except StopIteration as stop:
                    out[i] = stop.value
                    del todo[i]
        return out

    @staticmethod
    def take_catchup_ms(st: MTPState) -> float:
        """Milliseconds the head spent since the last call writing cache entries of positions it
        did not draft from (the tokens accepted or decoded plainly since it last drafted), reset."""
        ms, st.catchup_ms = st.catchup_ms, 0.0
        return ms

    @torch.inference_mode()
    def probe_ms(self, st: MTPState, hidden: torch.Tensor, token: int) -> float | None:
        """Milliseconds of drafting one token (the head's block and its logits) at the state's depth;
        the entry it writes is rolled back. None when the head's cache has no room."""
        cache = st.cache
        if hidden is None or cache.length + 1 > cache.max_len:
            return None
        t0 = time.perf_counter()
        g = self.head(self.embed(torch.tensor([token], device=self.device)), hidden[-1:], cache)
        self.lm_head(g)
        if st.ctx_head is not None:
            st.ctx_head(g)
        ms = (time.perf_counter() - t0) * 1e3
        cache.trim(1)
        return ms

    def accept(self, st: MTPState, history: list[int], n_accepted: int, target_hidden: torch.Tensor) -> None:
        if st.has_pending:
            # no `propose` consumed the earlier states (another member of a chain drafted this step,
            # or there was no room): keep them, positions pending_start.. continue into these
            st.add_pending(target_hidden)
            return
        st.pending_h = target_hidden  # trunk hidden states at positions p0 .. p0+n
        st.pending_start = st.cache.length
