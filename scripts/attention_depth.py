"""Time the decode attention kernel (csrc/attention.cpp) alone for T query rows at a cache depth.

    python scripts/attention_depth.py [--shape 0.5b|1.5b] [--depths 300,8192,32000] [--rows 1,2,4,9] [-t 2] [--layers 24]
                                      [--choice attn_width=512,256]

Random keys, values and queries shaped like the model's layers (0.5B: 14 heads, 2 kv heads, head
size 64; 1.5B: 12, 2, 128), one cache per layer called in turn as a decoding step does (so that
deep caches come from memory, not from a cache that holds one layer); per layer, best of 5 steps,
two passes; each row count relative to one row. A verification block of k + 1 rows pays this
ratio on every layer's attention. `--choice NAME=A,B` times each value of a kernel choice
(`kernels.choice`), alternating between them in every repetition.
"""
import argparse
import time

import torch

from mtpllm.runtime import kernels

SHAPES = {"0.5b": (14, 2, 64), "1.5b": (12, 2, 128)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=SHAPES, default="0.5b")
    ap.add_argument("--depths", default="300,8192,32000")
    ap.add_argument("--rows", default="1,2,4,9")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--choice", default=None, help="NAME=A,B: time each value of a kernel choice")
    a = ap.parse_args()
    if a.choice:
        name, vals = a.choice.split("=")
        setter, options = kernels.choice(name), [int(v) for v in vals.split(",")]
    else:
        setter, options = (lambda v: None), [None]
    torch.set_num_threads(a.threads)
    H, KV, D = SHAPES[a.shape]
    rows = [int(x) for x in a.rows.split(",")]
    for depth in [int(x) for x in a.depths.split(",")]:
        L = depth + max(rows) + 1
        caches = [(torch.randn(KV, L, D) * 0.1, torch.randn(KV, L, D)) for _ in range(a.layers)]
        ang = torch.outer(torch.arange(L).float(), 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D))
        cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
        best = {}
        for _ in range(2):
            for T in rows:
                qkv = torch.randn(T, (H + 2 * KV) * D)
                for _ in range(5):
                    for o in options:
                        setter(o)
                        t0 = time.perf_counter()
                        for kc, vc in caches:
                            kernels.attend_cached(qkv, cos, sin, kc, vc, depth, H, KV, D, D, True, D ** -0.5, None,
                                                  None, 1e-6, 0)
                        best[o, T] = min(best.get((o, T), 1e9), (time.perf_counter() - t0) / len(caches))
        for o in options:
            label = f"{a.choice.split('=')[0]}={o} " if o is not None else ""
            print(f"{label}depth {depth}: " + ", ".join(
                f"{T} rows {best[o, T] * 1e3:.3f} ms ({best[o, T] / best[o, rows[0]]:.2f}x)" for T in rows), flush=True)

if __name__ == "__main__":
    main()
