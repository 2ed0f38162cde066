"""What one speculative step costs against one plain step, in one process.

    python scripts/step_cost.py [-m qwen2.5-coder-1.5b] [--spec mtp:3] [-t 2] [--stages] [--no-decode]
                                [--rows 1,4] [-r 25] [--choice x8_tile4=0,3] [--replay 2]

Decodes one code prompt plain and with speculation (three rounds, alternating; draft and
verification time per step from the decoder's statistics), then times forwards of 1 and 4 rows
at ~300 positions with and without the logits and their argmax as the verifier computes them
(`model.logits`, `kernels.argmax`; 25 alternations, median and min).
The per-stage figures in docs/kernels.md come from this script. `--choice NAME=A,B` times the
forwards (and stages) under each value of a kernel choice (`kernels.choice(NAME)`, e.g. x8_tile4, tile_rows),
alternating between them in every repetition, so that the comparison survives other load.
`--replay R` (a hybrid model) also times each forward right after a verification block rolled back
to R kept rows, so that it replays them first (runtime/cache.py RecurrentCache): the part of a
verification's cost paid by the step after it.
"""
import argparse
import statistics
import time

import torch

from mtpllm.runtime.engine import Engine
from mtpllm.runtime.kernels import argmax
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
    ap.add_argument("--rows", default="1,4", help="forward row counts to time, comma-separated")
    ap.add_argument("-r", "--reps", type=int, default=25, help="alternations of the forward timings")
    ap.add_argument("--choice", help="NAME=A,B: time under each value of the kernel choice NAME (kernels.choice; alternating)")
    ap.add_argument("--replay", type=int, default=0,
                    help="also time the forwards after a block of R + 1 rows trimmed to R (a pending replay)")
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
        snap = cache.snapshot()

        def forward(T, logits):
            h = m(torch.tensor(ids[:T]), cache)
            if logits:
                argmax(m.logits(h))  # as the verifier does

        def pending(r):  # (untimed) a block of r + 1 rows rolled back to r: its next forward replays them
            if r:
                m(torch.tensor(ids[:r + 1]), cache)
                cache.trim(1)

        def back(T):  # undo the forward (outside the timed part): a recurrent state cannot drop all T rows
            if cache.max_trim() >= T:
                cache.trim(T)
            else:
                cache.restore(snap)
        rows = [int(r) for r in a.rows.split(",")]
        choice, values = None, [None]
        if a.choice:
            from mtpllm.runtime import kernels
            name, vals = a.choice.split("=")
            choice, values = kernels.choice(name), [int(v) for v in vals.split(",")]
        replays = [0] + ([a.replay] if a.replay else [])
        cases = {(v, T, lg, r): f"{T} row(s){' + logits' if lg else ''}" + (f" after a trim to {r} rows" if r else "")
                 + (f" [{a.choice.split('=')[0]}={v}]" if choice else "")
                 for r in replays for lg in (False, True) for T in rows for v in values}
        times = {c: [] for c in cases}
        for _ in range(a.reps):
            for (v, T, lg, r) in cases:
                if choice:
                    choice(v)
                pending(r)
                t0 = time.perf_counter()
                forward(T, lg)
                times[(v, T, lg, r)].append((time.perf_counter() - t0) * 1e3)
                back(T + r)
        stages = {}
        stack = getattr(m, "_stack", None)
        if a.stages and stack is not None and stack is not False:  # the C++ blocks' own timers, per stage, summed over the layers
            runs = {(v, T, r): [] for v in values for r in replays for T in rows}
            for _ in range(a.reps):
                for (v, T, r) in runs:
                    if choice:
                        choice(v)
                    pending(r)
                    stack.set_timing(True)
                    forward(T, False)
                    runs[(v, T, r)].append(stack.stage_times())
                    back(T + r)
            stack.set_timing(False)
            stages = {key: [statistics.median(r[i] for r in rs) for i in range(len(rs[0]))] for key, rs in runs.items()}
            fastest = {key: [min(r[i] for r in rs) for i in range(len(rs[0]))] for key, rs in runs.items()}
    for c, name in cases.items():
        v = times[c]
        print(f"forward of {name} at 300 positions: median {statistics.median(v):.2f} ms, min {min(v):.2f} ms")
    names = ("norm + QKV", "attention", "output + residual", "norm + gate/up", "SiLU * up", "down + residual")
    if stages and len(next(iter(stages.values()))) == 7:  # a hybrid model's HybridStack
        names = ("DeltaNet norm + proj", "delta rule", "DeltaNet output", "attn norm + QKV", "attention",
                 "attn output", "FFN")
    for v in values if stages else ():
        for r in replays:
            print(f"stages{f', {a.choice.split(chr(61))[0]}={v}' if choice else ''}"
                  f"{f', after a trim to {r} rows' if r else ''}: medians of {a.reps} (fastest)")
            for i, name in enumerate(names):
                print(f"  {name:<18} " + "   ".join(
                    f"{T} row(s) {stages[(v, T, r)][i]:6.2f} ms (min {fastest[(v, T, r)][i]:6.2f})" for T in rows))
            print(f"  {'all blocks':<18} " + "   ".join(
                f"{T} row(s) {sum(stages[(v, T, r)]):6.2f} ms (min {sum(fastest[(v, T, r)]):6.2f})" for T in rows))


if __name__ == "__main__":
    main()
