"""How well an MTP head fits text: teacher-forced greedy drafts on each data file in turn.

For every position of the (answer) text the head drafts up to --depth tokens as it would in
speculative decoding, from the trunk's states; a draft counts when it equals the text's next token.
On the model's own greedy answers (scripts/self_answers.py) that is the trunk's own choice, so the
figures estimate acceptance. Run it on answers the head was trained on and on answers it never saw:
close figures mean the head is at its capacity (a larger head, or other inputs, would help, more text
of the same kind would not); a large gap means it is short of text.

    python scripts/head_fit.py -m qwen2.5-coder-1.5b --head mtp.gguf --data trained.jsonl unseen.jsonl

Per file: per position, the share of drafts equal to the text (alone, and with all earlier drafts
equal: the acceptance of a draft of that length), and 1 + the sum of the latter, an estimate of the
mean acceptance length at k = depth.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True, help="registry name or GGUF file")
    ap.add_argument("--head", required=True, help="head-only mtp-*.gguf")
    ap.add_argument("--data", nargs="+", required=True, help=".jsonl / .jsonl.gz / text files, each reported alone")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--max-windows", type=int, default=120, help="windows per file (a seeded sample)")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="bf16",
                    help="the head's products (bf16: as `train-mtp --precision bf16` trains on a CPU, ~2x faster)")
    ap.add_argument("--all-tokens", action="store_true", help="score prompt tokens too (default: answers only)")
    ap.add_argument("-t", "--threads", type=int, default=None)
    a = ap.parse_args(argv)
    missing = [p for p in a.data + [a.head] if not Path(p).exists()]
    if missing:
        ap.error(f"no such file: {missing[0]}")

    import random

    import torch

    from mtpllm.errors import MtpllmError
    from mtpllm.runtime.engine import Engine
    from mtpllm.train.data import read_texts, token_windows
    from mtpllm.train.mtp import TrainConfig, Trainer
    try:
        eng = Engine.load(a.model, n_ctx=max(1024, a.seq_len + 64), threads=a.threads)
        cfg = TrainConfig(steps=1, seq_len=a.seq_len, batch=4, depth=a.depth, answer_only=not a.all_tokens,
                          precision=a.precision)
        # one trainer over every file's windows (the head and its lm_head rows are loaded once),
        # each file's windows reported apart
        windows, origins, parts = [], [], []
        for path in a.data:
            o: list = []
            w = token_windows(eng.tokenizer, read_texts([path]), cfg.seq_len, 10**9, 0, o)
            keep = sorted(random.Random(0).sample(range(len(w)), min(a.max_windows, len(w))))
            parts.append((path, range(len(windows), len(windows) + len(keep))))
            windows += [w[i] for i in keep]
            origins += [o[i] for i in keep]
        with tempfile.TemporaryDirectory() as tmp:
            tr = Trainer(eng, windows, cfg, Path(tmp) / "unused.gguf", "head_fit", init=a.head, origins=origins)
            tr.hidden.fill(None)
            for path, part in parts:
                scored = [i for i in tr.order if i in part]  # windows with a scored token
                if not scored:
                    raise MtpllmError(f"{path}: no window with a token to score (answer tokens, or --all-tokens)")
                counts = sum(tr.agreement(scored[i:i + 4]) for i in range(0, len(scored), 4))
                n = counts[:, 0].clamp_min(1).double()
                alone = counts[:, 1] / n
                whole = counts[:, 2] / n
                print(f"{Path(path).name}: {len(scored)} windows, {int(counts[0, 0])} positions; per position "
                      f"{' '.join(f'{x:.3f}' for x in alone.tolist())}; whole drafts "
                      f"{' '.join(f'{x:.3f}' for x in whole.tolist())}; estimated mean acceptance length "
                      f"{1 + float(whole.sum()):.3f}", flush=True)
    except MtpllmError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
