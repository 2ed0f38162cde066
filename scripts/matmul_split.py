"""Time one decode step's matrix products alone, per GGUF type and shape, for M activation rows.

    python scripts/matmul_split.py ~/.cache/mtpllm/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --threads 2 -M 1,2,4
    python scripts/matmul_split.py MODEL -M 1,4 --reps 30 --choice x8_tile4=0,3

Every `gguf` Linear of the model is called through the kernel (`kernels.gguf_linear`) with random
activations, `--reps` times after a warm-up; the table gives ms per step and the weight bytes moved
per second (the file's bytes: the kernels read them in place). M = 1 is decoding, M = k + 1
verification of k drafts. MTPLLM_KERNELS_ISA=avx2 times the AVX2 build on a VNNI machine.
`--choice NAME=A,B` times every product under each value of a kernel choice (`kernels.choice(NAME)`,
e.g. x8_tile4 or tile_rows); row counts and values alternate step by step, and `--stat min` takes each product's
fastest repetition: comparisons that hold up on a machine shared with other work.
"""
import argparse
import collections
import statistics
import time

import torch

from mtpllm.models.base import load_model
from mtpllm.runtime import kernels
from mtpllm.runtime.linear import Linear

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("-M", default="1", help="activation rows, comma-separated")
ap.add_argument("--reps", type=int, default=5)
ap.add_argument("--choice", help="NAME=A,B: time under each value of the kernel choice NAME (kernels.choice; alternating)")
ap.add_argument("--stat", choices=("mean", "median", "min"), default="mean", help="per product, over the repetitions")
a = ap.parse_args()
torch.set_num_threads(a.threads)
model = load_model(a.model)
lins = [m for m in model.modules() if isinstance(m, Linear) and m.kind == "gguf"]
print(f"kernels: {kernels.status()}, threads {a.threads}, {len(lins)} matrix products per step")
choice, values = None, [None]
if a.choice:
    name, vals = a.choice.split("=")
    choice, values = kernels.choice(name), [int(v) for v in vals.split(",")]
stat = {"mean": statistics.mean, "median": statistics.median, "min": min}[a.stat]
Ms = [int(m) for m in a.M.split(",")]
combos = [(M, v) for M in Ms for v in values]
runs = collections.defaultdict(list)  # (M, value, key, product) -> seconds, one per repetition
nbytes = collections.defaultdict(int)
xs = {M: [torch.randn(M, lin.in_features) for lin in lins] for M in Ms}
for rep in range(a.reps + 1):  # the first pass is a warm-up
    # a whole step's products for one row count and value, then the next (each first in turn):
    # every product streams its weights from memory as in a step, and load on the machine falls on
    # all of them alike
    for M, v in combos[rep % len(combos):] + combos[:rep % len(combos)]:
        if choice:
            choice(v)
        for j, (lin, x) in enumerate(zip(lins, xs[M])):
            t0 = time.perf_counter()
            kernels.gguf_linear(x, lin._gw, lin._gt)
            dt = time.perf_counter() - t0
            key = "+".join(str(t) for t in lin._gt) + f" {lin.out_features}x{lin.in_features}"
            if rep:
                runs[(M, v, key, j)].append(dt)
                if rep == 1 and (M, v) == combos[0]:
                    nbytes[key] += sum(w.numel() for w in lin._gw)
for M, v in combos:
    per = collections.defaultdict(float)
    for (mm, vv, key, _), ts in runs.items():
        if (mm, vv) == (M, v):
            per[key] += stat(ts)
    total, tb = sum(per.values()), sum(nbytes.values())
    tag = f" [{a.choice.split('=')[0]}={v}]" if choice else ""
    print(f"M={M}{tag}: {total * 1e3:.2f} ms/step ({a.stat}), {tb / 1e6:.0f} MB, {tb / total / 1e9:.1f} GB/s  "
          f"(GGML type ids: 8 Q8_0, 6 Q5_0, 12 Q4_K, 14 Q6_K; 1012 Q4_Kx8, 1014 Q6_Kx8)")
    for k in sorted(per, key=lambda k: -per[k]):
        print(f"  {k:28s} {per[k] * 1e3:7.2f} ms  {nbytes[k] / per[k] / 1e9:5.1f} GB/s")
