"""Where decode time goes: torch profiler over plain greedy decoding (and optionally MTP).

    python scripts/profile_decode.py [-m MODEL] [-n TOKENS] [--spec mtp:3]

Prints the operator table (self CPU time) for the decode phase only: the prompt is evaluated
before profiling starts. The figures in docs/kernels.md come from this script.
"""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from mtpllm.runtime.engine import Engine
from mtpllm.runtime.sampling import SamplingParams
from mtpllm.speculative import SpecConfig


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("-n", type=int, default=48)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--spec", default=None, help="e.g. mtp:3 or ngram:3")
    ap.add_argument("--rows", type=int, default=15)
    a = ap.parse_args()
    eng = Engine.load(a.model, n_ctx=1024, threads=a.threads)
    spec = None
    if a.spec:
        method, k = a.spec.split(":")
        spec = SpecConfig(method, int(k), policy="fixed").build(eng)
    ids = eng.encode_prompt("Write a Python function that parses an ISO 8601 date string.", chat=True)
    params = SamplingParams(temperature=0, max_tokens=a.n, ignore_eos=True)
    eng.generate(prompt_ids=ids, params=SamplingParams(temperature=0, max_tokens=4), speculative=spec)  # warm-up
    stream = eng.stream(ids, params, spec)
    next(stream)  # prompt evaluated, first token sampled: profile decoding only
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        n = 1 + sum(1 for _ in stream)
    dt = time.perf_counter() - t0
    print(f"{a.model}: {n} tokens in {dt:.2f} s under the profiler ({n / dt:.2f} tok/s), "
          f"threads {torch.get_num_threads()}, torch {torch.__version__}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows))


if __name__ == "__main__":
    main()
