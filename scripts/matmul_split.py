"""Time one decode step's matrix products alone, per GGUF type and shape, for M activation rows.

    python scripts/matmul_split.py ~/.cache/mtpllm/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --threads 2 -M 1,2,4

Every `gguf` Linear of the model is called through the kernel (`kernels.gguf_linear`) with random
activations, `--reps` times after a warm-up; the table gives ms per step and the weight bytes moved
per second (the file's bytes: the kernels read them in place). M = 1 is decoding, M = k + 1
verification of k drafts. MTPLLM_KERNELS_ISA=avx2 times the AVX2 build on a VNNI machine.
"""
import argparse
import collections
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
a = ap.parse_args()
torch.set_num_threads(a.threads)
model = load_model(a.model)
lins = [m for m in model.modules() if isinstance(m, Linear) and m.kind == "gguf"]
print(f"kernels: {kernels.status()}, threads {a.threads}, {len(lins)} matrix products per step")
for M in (int(m) for m in a.M.split(",")):
    per, nbytes = collections.defaultdict(float), collections.defaultdict(int)
    xs = [torch.randn(M, lin.in_features) for lin in lins]
    for rep in range(a.reps + 1):  # the first pass is a warm-up
        for lin, x in zip(lins, xs):
            t0 = time.perf_counter()
            kernels.gguf_linear(x, lin._gw, lin._gt)
            dt = time.perf_counter() - t0
            key = "+".join(str(t) for t in lin._gt) + f" {lin.out_features}x{lin.in_features}"
            if rep:
                per[key] += dt / a.reps
                if rep == 1:
                    nbytes[key] += sum(w.numel() for w in lin._gw)
    total, tb = sum(per.values()), sum(nbytes.values())
    print(f"M={M}: {total * 1e3:.2f} ms/step, {tb / 1e6:.0f} MB, {tb / total / 1e9:.1f} GB/s  (GGML type ids: "
          f"8 Q8_0, 6 Q5_0, 12 Q4_K, 14 Q6_K)")
    for k in sorted(per, key=lambda k: -per[k]):
        print(f"  {k:28s} {per[k] * 1e3:7.2f} ms  {nbytes[k] / per[k] / 1e9:5.1f} GB/s")
