"""What one speculative step costs against one plain step, in one process.

    python scripts/step_cost.py [-m qwen2.5-coder-1.5b] [--spec mtp:3] [-t 2] [--stages] [--no-decode]

Decodes one code prompt plain and with speculation (three rounds, alternating; draft and
verification time per step from the decoder's statistics), then times forwards of 1 and 4 rows
at ~300 positions with and without the logits and their argmax (25 alternations, median and min).
The per-stage figures in docs/kernels.md come from this script.
"""
import argparse
import statistics
import time

import torch

from mtpllm.runtime.engine import Engine
from mtpllm.runtime.sampling import SamplingParams
from mtpllm.speculative import SpecConfig


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--spec", default="mtp:3")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--stages", action="store_true", help="also time each stage of the C++ blocks")
    ap.add_argument("--no-decode", action="store_true", help="skip the decoding rounds")
    a = ap.parse_args()
    eng = Engine.load(a.model, n_ctx=1024, threads=a.threads)
    method, k = a.spec.split(":")
    spec = SpecConfig(method, int(k), policy="fixed").build(eng)
    ids = eng.encode_prompt("Write a Python function that parses an ISO 8601 date string and returns a datetime, "
                            "with tests.", chat=True)
    p = SamplingParams(temperature=0, max_tokens=a.n, ignore_eos=True)
    for r in range(0 if a.no_decode else 3):
        t0 = time.perf_counter()
        eng.generate(prompt_ids=ids, params=p)
        t1 = time.perf_counter()
        st = eng.generate(prompt_ids=ids, params=p, speculative=spec).stats
        t2 = time.perf_counter()
        print(f"round {r}: plain {a.n / (t1 - t0):.1f} tok/s, {a.spec} {a.n / (t2 - t1):.1f} tok/s (end to end); "
              f"{st.num_steps} steps, {st.tokens_per_step:.2f} tokens per step, draft {st.draft_ms / st.num_steps:.2f} "
              f"ms per step, verification {st.verify_ms / st.num_steps:.2f} ms per step")
    m = eng.model
    cache = m.make_cache(1024)
    with torch.inference_mode():
        m(torch.tensor((ids * 8)[:300]), cache)

        def forward(T, logits):
            h = m(torch.tensor(ids[:T]), cache)
            if logits:
                m.logits(h).argmax(-1).tolist()
            cache.trim(T)
        cases = {f"{T} row(s){' + logits' if lg else ''}": (T, lg) for lg in (False, True) for T in (1, 4)}
        times = {name: [] for name in cases}
        for _ in range(25):
            for name, (T, lg) in cases.items():
                t0 = time.perf_counter()
                forward(T, lg)
                times[name].append((time.perf_counter() - t0) * 1e3)
        stages = {}
        stack = getattr(m, "_stack", None)
        if a.stages and stack is not None and stack is not False:  # the C++ blocks' own timers, per stage, summed over the layers
            for T in (1, 4):
                runs = []
                for _ in range(25):
                    stack.set_timing(True)
                    forward(T, False)
                    runs.append(stack.stage_times())
                stack.set_timing(False)
                stages[T] = [statistics.median(r[i] for r in runs) for i in range(len(runs[0]))]
    for name, v in times.items():
        print(f"forward of {name} at 300 positions: median {statistics.median(v):.2f} ms, min {min(v):.2f} ms")
    names = ("norm + QKV", "attention", "output + residual", "norm + gate/up", "SiLU * up", "down + residual")
    for i, name in enumerate(names if stages else ()):
        print(f"  {name:<18} 1 row {stages[1][i]:6.2f} ms   4 rows {stages[4][i]:6.2f} ms (medians of 25)")
    if stages:
        print(f"  {'all blocks':<18} 1 row {sum(stages[1]):6.2f} ms   4 rows {sum(stages[4]):6.2f} ms")


if __name__ == "__main__":
    main()
