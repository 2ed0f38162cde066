"""Does torch.compile speed up one-token decoding? Plain greedy, 64 tokens, best of 4, 2 threads.

    python scripts/compile_decode.py mlp     # each block's FFN compiled
    python scripts/compile_decode.py block   # whole blocks (dynamo breaks the graph where it must)

Fake (meta) kernels are registered for the extension's operators so dynamo can trace them.
Result on the reference machine: see docs/kernels.md ("Lessons and things tried")."""
import sys, time, torch
from mtpllm.runtime.engine import Engine
from mtpllm.runtime.sampling import SamplingParams
from mtpllm.runtime import kernels

torch.set_num_threads(2)
e = Engine.load("qwen2.5-coder-0.5b", n_ctx=1024)
kernels._ensure()

@torch.library.register_fake("mtpllm::gguf_linear")
def _gl(x, ws, types):
    return x.new_empty(x.shape[0], sum(w.shape[0] for w in ws))

@torch.library.register_fake("mtpllm::rms_norm")
def _rn(x, w, eps):
    return torch.empty_like(x)

ids = e.encode_prompt(messages=[{"role": "user", "content": "Write a Python function that merges overlapping intervals."}])
p = SamplingParams(temperature=0, max_tokens=64)

def best(n=4):
    res = []
    for _ in range(n):
        out = e.generate(prompt_ids=ids, params=p)
        res.append(out.timings.predicted_ms / len(out.tokens))
    return out.tokens, min(res), sorted(res)

ref, eager, all_e = best()
print(f"eager: {eager:.2f} ms/token {[round(x,2) for x in all_e]}", flush=True)
variant = sys.argv[1] if len(sys.argv) > 1 else "mlp"
if variant == "mlp":  # the FFN of each block (gate/up product, SiLU * up, down product)
    for blk in e.model.blocks:
        blk.mlp = torch.compile(blk.mlp, dynamic=False)
elif variant == "block":  # whole blocks, graph breaks where dynamo must
    for blk in e.model.blocks:
        blk.forward = torch.compile(blk.forward, dynamic=False)
t = time.perf_counter()
toks, _, _ = best(1)
print(f"compile + first run: {time.perf_counter() - t:.1f} s", flush=True)
toks, comp, all_c = best()
print(f"compiled ({variant}): {comp:.2f} ms/token {[round(x,2) for x in all_c]}; same tokens: {toks == ref}")
