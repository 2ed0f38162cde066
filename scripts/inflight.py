"""Several requests always in flight through the scheduler, in-process: plain decoding against the
default speculation, alternating, so that the comparison survives the machine's drift.

    python scripts/inflight.py [-m qwen2.5-coder-1.5b] [-np 8] [--requests 24] [-n 128] [-r 2] [-t 2]
                               [--temp 0.8 --seed 1]

`-np` slots (sequences decoded together, as `mtpllm serve -np`), `--requests` HumanEval prompts
(chat template applied, greedy or sampled at `--temp` with the other sampling settings at their
defaults, request i seeded with seed + i; EOS ignored so every answer has `-n` tokens) queued at once: the
slots stay full until the queue runs dry. After an untimed round of each on other prompts, every
repeat runs plain then default over the same prompts; aggregate tok/s = all tokens / wall time
(prefills included), and the scheduler's steps. No HTTP: what the server adds is measured by
`bench_server.py`.
"""
import argparse
import time

import torch

from mtpllm.bench.workloads import code_prompts
from mtpllm.runtime.engine import Engine
from mtpllm.runtime.sampling import SamplingParams
from mtpllm.runtime.scheduler import Scheduler
from mtpllm.speculative.config import default_config


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("-np", "--parallel", type=int, default=8)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", "--repeats", type=int, default=2)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-c", "--ctx", type=int, default=2048)
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    eng = Engine.load(a.model, n_ctx=a.ctx, threads=a.threads)
    tok = eng.tokenizer
    texts = code_prompts()[:a.requests + a.parallel]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in texts]
    spec = default_config().build(eng)

    def params(i):
        return SamplingParams(temperature=a.temp, max_tokens=a.n, ignore_eos=True, seed=a.seed + i)

    def run(dec, ps):
        sch = Scheduler(eng, dec, n_slots=a.parallel, start=False)
        for i, p in enumerate(ps):
            sch.submit(p, params(i))
        t0 = time.perf_counter()
        while sch.running or sch.waiting:
            sch.step()
        return a.n * len(ps) / (time.perf_counter() - t0), sch.steps

    for dec in (None, spec):  # warm-up: kernels, cost tables, the head's first passes
        run(dec, prompts[a.requests:])
    rates = {"plain": [], "default": []}
    for r in range(a.repeats):
        for name, dec in (("plain", None), ("default", spec)):
            tps, steps = run(dec, prompts[:a.requests])
            rates[name].append(tps)
            print(f"repeat {r + 1}: {name} {tps:.2f} tok/s, {steps} steps", flush=True)
    ratios = [d / p for p, d in zip(rates["plain"], rates["default"])]
    print("default / plain per repeat: " + ", ".join(f"{x:.3f}" for x in ratios))


if __name__ == "__main__":
    main()
