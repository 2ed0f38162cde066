"""Training text for MTP heads: the model's own greedy answers to chat prompts.

Prompts are HumanEval-style (a Python signature and docstring) taken from functions of CPython's
standard library, plus hand-written prose requests (none of them the benchmark's held-out prose
prompts). Answers are the engine's own greedy decoding of the model (batches of requests decoded
together, `Engine.generate_batch`, ~4x the tokens per second of one at a time here), and each conversation is written, rendered with the model's chat
template, as one {"text": ...} line of a .jsonl file that `mtpllm train-mtp --data` reads.

    python scripts/self_answers.py -m qwen2.5-coder-0.5b --stdlib /usr/lib/python3.11 -n 256 -o answers.jsonl

Resumable: prompts already in the output are skipped.
"""
from __future__ import annotations

import argparse
import ast
import json
import random
import sys
import time
from pathlib import Path

PROSE = [
    "Write a short story about a baker who discovers a secret recipe in an old book.",
    "Explain how a steam engine works.",
    "Explain what photosynthesis is and why it matters.",
    "Write a short story about a girl who can talk to birds.",
    "Describe a thunderstorm over the sea.",
    "Explain how a compass works.",
    "Write a short story about an old fisherman and a stubborn seagull.",
    "Explain why we have seasons on Earth.",
    "Explain how airplanes fly.",
    "Write a poem about a quiet morning in the forest.",
    "Explain what gravity is in simple words.",
    "Write a short story about a detective who solves a mystery in a library.",
    "Explain how the heart pumps blood through the body.",
    "Describe a walk through a city at night.",
    "Explain how money became a way to trade goods.",
    "Write a short story about a dragon who is afraid of fire.",
    "Explain what causes earthquakes.",
    "Write a diary entry of a sailor crossing the Atlantic in 1800.",
    "Explain how plants know which way to grow.",
    "Write a short story about a clockmaker who builds a clock that runs backwards.",
    "Explain how recycling works and why it helps.",
    "Describe a summer festival in a small village.",
    "Explain why the moon has phases.",
    "Write a short story about a boy who finds a door in the back of his wardrobe.",
    "Explain how electricity gets from a power plant to a home.",
    "Write a speech for a school graduation.",
    "Explain what DNA is and what it does.",
    "Write a short story about a musician who loses her voice.",
    "Explain how a volcano forms.",
    "Describe the first day of spring in the mountains.",
    "Explain how a computer stores information.",
    "Write a short story about a knight who refuses to fight.",
    "Explain why exercise is good for the brain.",
    "Write a letter to a friend describing a trip to the seaside.",
    "Explain how tides work.",
    "Write a short story about a gardener who grows a giant pumpkin.",
    "Explain what a black hole is.",
    "Explain how to cook rice perfectly.",
    "Write a short story about a postman in a town where it always rains.",
    "Explain how birds migrate over long distances.",
]


# more prose requests from templates (none of them is one of the benchmark's held-out prose prompts)
STORY_SUBJECTS = [
    "a lonely robot who repairs old radios", "a girl who finds a map inside a library book",
    "a chef who cooks for a king", "a boy who trains a stray dog", "a painter who paints only at night",
    "a village that forgets its own name", "a pilot who lands on an unknown island",
    "a teacher on her last day before retiring", "a tailor who sews a coat for a giant",
    "two rival inventors who must work together", "a fox who learns to read", "a miner who finds a glowing stone",
    "a family moving to a new country", "a runner training for her first marathon",
    "a shepherd who counts the stars", "an astronaut alone on the moon", "a violin that plays by itself",
    "a city where nobody is allowed to sing", "a turtle who wants to fly", "a young queen's first decision",
]
EXPLAIN_TOPICS = [
    "a microwave oven heats food", "a bank decides whether to give a loan", "solar panels make electricity",
    "the human eye sees colour", "a river shapes a valley", "a search engine ranks pages",
    "a camera captures a photograph", "the immune system fights a cold", "a battery stores energy",
    "an elevator works", "a newspaper is made", "a bridge carries heavy loads",
    "clouds form and why they float", "the stock market works", "a telescope magnifies distant objects",
    "soap removes dirt", "a submarine dives and rises", "the lungs bring oxygen into the blood",
    "a law is made in a parliament", "GPS finds your position",
]
MORE_PROSE = ([f"Write a short story about {s}." for s in STORY_SUBJECTS]
              + [f"Explain how {t}." for t in EXPLAIN_TOPICS])


def stdlib_prompts(root: Path, limit: int, seed: int) -> list[str]:
    """HumanEval-style prompts: public functions with a docstring (module level, in the standard
    library and its packages, tests excluded), body removed."""
    out = []
    files = sorted(f for f in root.rglob("*.py")
                   if not ({"test", "tests", "idlelib", "site-packages", "lib2to3"} & set(f.relative_to(root).parts)))
    for f in files:
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 40 or len(doc) > 1200:
                continue
            node.body = [ast.Expr(ast.Constant(doc))]
            node.decorator_list = []
            src = ast.unparse(node)
            out.append(src + "\n")
    random.Random(seed).shuffle(out)
    return out[:limit]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True, help="registry name or GGUF file")
    ap.add_argument("--stdlib", required=True, help="directory of Python sources for code prompts")
    ap.add_argument("--code", type=int, default=240, help="number of code prompts")
    ap.add_argument("-n", "--max-new", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8,
                    help="requests decoded together (Engine.generate_batch; 1 = one at a time with n-gram speculation)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--skip", nargs="*", default=[], help="earlier output files: their prompts are not asked again")
    a = ap.parse_args(argv)

    from mtpllm.runtime.engine import Engine
    from mtpllm.runtime.sampling import SamplingParams
    from mtpllm.speculative import SpecConfig
    eng = Engine.load(a.model, n_ctx=2048, threads=a.threads)
    spec = SpecConfig("ngram", 3).build(eng)

    prompts = PROSE + MORE_PROSE + stdlib_prompts(Path(a.stdlib), a.code, a.seed)
    random.Random(a.seed).shuffle(prompts)  # prose and code interleaved: a partial run has both
    out = Path(a.out)
    done = set()
    for f in [out] + [Path(x) for x in a.skip]:
        if f.exists():
            done |= {json.loads(line)["prompt"] for line in f.read_text().splitlines() if line.strip()}
    todo = [p for p in prompts if p not in done]
    print(f"{len(prompts)} prompts, {len(todo)} to do", flush=True)
    t0, n_tok = time.time(), 0
    params = SamplingParams(temperature=0, max_tokens=a.max_new)
    with out.open("a", encoding="utf-8") as fh:
        for i in range(0, len(todo), a.batch):
            group = todo[i:i + a.batch]
            ids = [eng.encode_prompt(messages=[{"role": "user", "content": p}]) for p in group]
            if a.batch == 1:
                done_c = [eng.generate(prompt_ids=ids[0], params=params, speculative=spec)]
            else:
                done_c = eng.generate_batch(ids, params)
            for p, pid, c in zip(group, ids, done_c):
                n_tok += len(c.tokens)
                text = eng.tokenizer.decode(pid + c.tokens)
                fh.write(json.dumps({"prompt": p, "text": text}) + "\n")
            fh.flush()
            print(f"{i + len(group)}/{len(todo)} prompts, {n_tok} tokens, {n_tok / (time.time() - t0):.1f} tok/s",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
