"""`mtpllm train-mtp`: the command line of MTP head retrofitting (parsing, then the run).

The training itself is `train.mtp.Trainer` over the windows of `train.data`; this module reads the
options, loads the trunk, runs the trainer, writes the head and evaluates it on held-out prompts.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from ..cli import _nonneg_int, _positive_int
from ..errors import MtpllmError
from ..registry import DEFAULT_MODEL
from . import HEAD_TYPES
from .data import read_texts, token_windows


def _keep_onednn_off_amx() -> None:
    """bfloat16 products on the CPU go through oneDNN, which picks AMX where the CPU claims it, and
    AMX faults on some virtual machines: on such CPUs, cap oneDNN at AVX-512 BF16 unless the user
    set ONEDNN_MAX_CPU_ISA. oneDNN reads the variable when it starts, so this runs before any
    training work, in the command (a process-wide setting, made here and said on stderr, never
    inside a library call)."""
    from ..runtime.kernels import _cpu_flags
    if "ONEDNN_MAX_CPU_ISA" not in os.environ and any(f.startswith("amx") for f in _cpu_flags()):
        os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE_BF16"
        print("note: --precision bf16 on a CPU with AMX: ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 for this run "
              "(set ONEDNN_MAX_CPU_ISA yourself to choose)", file=sys.stderr)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="mtpllm train-mtp",
                                 description="Retrofit an MTP head onto a model by self-distillation; "
                                             "writes a llama.cpp-style head-only mtp-*.gguf.")
    ap.add_argument("-m", "--model", default=DEFAULT_MODEL, help="registry name or GGUF path (the frozen trunk)")
    ap.add_argument("--data", nargs="+", required=True, help="text files or directories (.py .txt .md .jsonl)")
    ap.add_argument("--exclude", action="append", default=[], help="skip files whose path contains this")
    ap.add_argument("-o", "--output", required=True, help="output head file, e.g. mtp-MODEL.gguf")
    ap.add_argument("--steps", type=_positive_int, default=400)
    ap.add_argument("--seq-len", type=_positive_int, default=256)
    ap.add_argument("--batch", type=_positive_int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ffn", type=_nonneg_int, default=0, help="head FFN width (default: the trunk's)")
    ap.add_argument("--draft-vocab", type=_nonneg_int, default=0,
                    help="restrict drafts to the N most frequent tokens of the training text (0 = all)")
    ap.add_argument("--depth", type=_positive_int, default=1,
                    help="draft positions to train: 2 or 3 also trains the head on its own outputs, as it "
                         "runs for k > 1 (each step costs about `depth` times as much)")
    ap.add_argument("--depth-weight", type=float, default=0.5,
                    help="weight of each further position's loss relative to the previous one")
    ap.add_argument("--feature-weight", type=float, default=1.0,
                    help="weight of the hidden-state regression that keeps k > 1 drafts on track (0 = KL only)")
    ap.add_argument("--hard-weight", type=float, default=0.0,
                    help="weight of a cross-entropy term on the trunk's argmax token, added to the KL (default 0)")
    ap.add_argument("--answer-only", action="store_true",
                    help="in records that mark their prompt (self_answers.py's n_prompt) train only on predicting "
                         "answer tokens, what the head drafts; other text is scored everywhere")
    ap.add_argument("--no-context-tokens", dest="context_tokens", action="store_false",
                    help="with a draft vocabulary, do not train on the conversation's own tokens outside it (by "
                         "default they join the softmax from their first appearance on, as the proposer drafts them)")
    ap.add_argument("--describe", default=None, metavar="TEXT",
                    help="what the training text is, recorded in the head's metadata "
                         "(default: the data files' names)")
    ap.add_argument("--init", default=None, metavar="HEAD.gguf",
                    help="fine-tune an existing head for this model (keeps its FFN width, and its draft vocabulary "
                         "unless --draft-vocab is given)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint-every", type=_positive_int, default=50)
    ap.add_argument("--max-tokens", type=_positive_int, default=2_000_000, help="training text cap, in tokens")
    ap.add_argument("--fast-trunk", action="store_true",
                    help="compute the trunk's hidden states with the compressed kernels decoding uses (about 2x "
                         "faster on CPU) instead of float32; the teacher's logits still use the file's exact "
                         "lm_head weights")
    ap.add_argument("--hidden-cache", metavar="DIR",
                    help="folder for the trunk's hidden states, one file per training window (default: "
                         "OUTPUT.hidden next to the head); runs that share it compute each window once, "
                         "whatever mixture of texts the window came from")
    ap.add_argument("--device", default="auto",
                    help="where the trunk and the head run: auto (a CUDA GPU when present, else cpu), cpu, cuda, cuda:N")
    ap.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                    help="the head's products: bf16 (autocast; norms, losses and the teacher stay float32) or fp32; "
                         "auto: bf16 on a GPU, fp32 on the CPU (on CPUs with AVX-512 BF16 a bf16 step is ~1.5x "
                         "faster)")
    ap.add_argument("--head-type", type=str.lower, choices=HEAD_TYPES, default="q8_0",
                    help="storage of the head's matrices in the written file: every draft step reads them once, so "
                         "q5_0 / q4_0 draft faster for a little acceptance (default: q8_0)")
    ap.add_argument("--no-resume", action="store_true", help="ignore an existing checkpoint")
    ap.add_argument("--eval-prompts", default=None,
                    help="held-out prompts (.jsonl with 'prompt', or text lines); default: HumanEval if installed")
    ap.add_argument("--eval-n", type=_nonneg_int, default=10, help="held-out prompts to evaluate (0 = skip)")
    ap.add_argument("--eval-tokens", type=_positive_int, default=128)
    ap.add_argument("-t", "--threads", type=_positive_int, default=None)
    a = ap.parse_args(argv)
    from ..registry import sha256_cached
    from ..runtime.engine import Engine, resolve_device
    from .mtp import TrainConfig, Trainer, evaluate_head, humaneval_prompts, load_prompts
    device = resolve_device(a.device)
    precision = a.precision if a.precision != "auto" else ("bf16" if device.startswith("cuda") else "fp32")
    if precision == "bf16" and device == "cpu":
        _keep_onednn_off_amx()
    cfg = TrainConfig(steps=a.steps, seq_len=a.seq_len, batch=a.batch, lr=a.lr, ffn=a.ffn,
                      draft_vocab=a.draft_vocab, feature_weight=a.feature_weight, hard_weight=a.hard_weight, depth=a.depth,
                      depth_weight=a.depth_weight, answer_only=a.answer_only,
                      context_tokens=a.context_tokens, seed=a.seed,
                      checkpoint_every=a.checkpoint_every,
                      max_tokens=a.max_tokens, precision=precision, head_type=a.head_type)
    out = Path(a.output)
    if out.parent and not out.parent.exists():
        raise MtpllmError(f"-o {a.output}: directory {out.parent} does not exist")
    prompts = load_prompts(a.eval_prompts) if a.eval_prompts else humaneval_prompts()
    texts = read_texts(a.data, set(a.exclude))
    # the frozen trunk runs in float32 (its exact distribution is the target, and prompt-sized
    # batches need no per-call dequantization), or with --fast-trunk on the compressed kernels: the
    # hidden states the head sees when it drafts, at about twice the speed
    eng = Engine.load(a.model, n_ctx=max(1024, a.seq_len + a.eval_tokens + 512), threads=a.threads,
                      mode="fast" if a.fast_trunk else "f32", device=device)
    if eng.model.cfg.n_nextn:
        print(f"note: {a.model} already has {eng.model.cfg.n_nextn} MTP layer(s); training a separate head",
              file=sys.stderr)
    origins: list = []
    windows = token_windows(eng.tokenizer, texts, cfg.seq_len, cfg.max_tokens, cfg.seed, origins)
    n_tok = sum(len(w) for w in windows)
    n_short = sum(len(w) < cfg.seq_len for w in windows)
    print(f"training data: {len(texts)} documents, {n_tok} tokens in {len(windows)} windows of {cfg.seq_len}"
          f"{f' ({n_short} shorter: short documents)' if n_short else ''}; "
          f"{cfg.steps} steps x {cfg.batch} windows on {device} ({precision})", file=sys.stderr)
    # names only: no local paths
    desc = (a.describe or ", ".join(Path(p).name for p in a.data)) + f" ({n_tok} tokens" + \
        ("; trunk states from the compressed kernels)" if a.fast_trunk else ")")
    tr = Trainer(eng, windows, cfg, out, desc, init=a.init, hidden_dir=a.hidden_cache, origins=origins)
    if not a.no_resume and tr.load_checkpoint():
        print(f"resuming from {tr.ckpt_path} at step {tr.step}", file=sys.stderr)
    t0 = time.time()
    tr.train()
    trunk_sha = sha256_cached(eng.model.source)
    tr.write_gguf(trunk_sha)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB) after {time.time() - t0:.0f} s", file=sys.stderr)
    if prompts and a.eval_n:
        held = prompts[: a.eval_n]
        # evaluate on the compressed path users decode with (the float32 path verifies row by row)
        n_ctx, source = eng.n_ctx, str(eng.model.source)
        del eng, tr.head_w
        eng = Engine.load(source, n_ctx=n_ctx, threads=a.threads, device=device)
        stats = evaluate_head(eng, str(out), held, k=3, max_tokens=a.eval_tokens)
        print(f"held-out evaluation ({len(held)} prompts, k=3, greedy):\n{stats.summary()}", file=sys.stderr)
        tr.write_gguf(trunk_sha, {"mtpllm.eval.mean_acceptance_length": stats.mean_acceptance_length,
                                  "mtpllm.eval.per_position": json.dumps(stats.per_position_acceptance),
                                  "mtpllm.eval.prompts": len(held)})
    return 0
