"""`mtpllm bench`: a llama-bench-like test matrix that also measures speculative decoding.

Rows = models x threads x prompt sets x prompt sizes x generation lengths x depths x spec methods.
Each row: one warm-up repetition (excluded), then -r repetitions, run in rounds over the whole
matrix (round 1 of every row, then round 2, ...; with --vs-llama-cpp, llama-bench once per round)
so that the drift of a shared machine falls on all rows alike; each repetition clears the KV
cache (and the proposer's), fills `depth` tokens of real text untimed (llama-bench -d), then runs
its requests through the engine's normal stream. With --vs-llama-cpp each row also gets its decode
speed over llama.cpp's plain decoding of the same file in the same run. Reported per row: prefill, decode and end-to-end
tok/s (mean ± sd), acceptance rate, mean acceptance length, per-position acceptance, draft cost,
peak RSS and load time; the report records the full test conditions.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from ..errors import MtpllmError
from .report import conditions, plot, to_csv, to_json, to_markdown
from .workloads import (DOCUMENT_MODULES, DOCUMENT_SETS, PROMPT_SETS, SIZED_SETS, build_requests, check_documents,
                        depth_ids)


# ---------------------------------------------------------------------------- argument parsing
def _int_list(s: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{s}'") from None
    if not vals or any(v < 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got '{s}'")
    return vals


def split_cutoff(s: str) -> tuple[str, float, float]:
    """'mtp:3@0.5' -> ('mtp:3', 0.5, 0.0): the draft stops at a token whose draft probability is
    below 0.5 (`--spec-draft-p-min`); 'mtp:3@c0.3' -> ('mtp:3', 0.0, 0.3): it stops when the product
    of the step's draft probabilities falls below 0.3 (`--spec-draft-p-cum`); no '@': no cut-off.
    An '@' inside a draft model's path ('draft:/srv/user@host/m.gguf:4', 'draft:m@v2.gguf') is part
    of the path: what follows the last '@' is a cut-off only if it names no folder and no .gguf file."""
    base, at, p = s.strip().rpartition("@")
    if not at or "/" in p or os.sep in p or ".gguf" in p.lower():
        return s.strip(), 0.0, 0.0
    cumulative = p[:1] in ("c", "C")
    try:
        v = float(p[1:] if cumulative else p)
    except ValueError:
        raise MtpllmError(f"--spec {s}: draft p-min '{p}' is not a number (e.g. @0.5, or @c0.3 for the "
                          f"cumulative cut-off)") from None
    if not 0.0 < v < 1.0:
        raise MtpllmError(f"--spec {s}: draft p-min must be between 0 and 1, got {p}")
    return (base, 0.0, v) if cumulative else (base, v, 0.0)


def split_policy(s: str) -> tuple[str, str | None]:
    """'mtp:3~fixed' -> ('mtp:3', 'fixed'): the draft-length policy (cost, fixed, adaptive; default:
    cost for mtp, fixed otherwise); no known policy after the last '~': none given."""
    from ..speculative.config import POLICIES
    base, sep, pol = s.strip().rpartition("~")
    return (base, pol) if sep and pol in POLICIES else (s.strip(), None)


def parse_spec(s: str) -> tuple[str, str, int, str | None]:
    """'none' | 'mtp[:k]' | 'ngram[:k]' | 'draft:MODEL[:k]', each optionally with '@P' (a draft
    p-min) or '@cP' (a cumulative one) and '~POLICY' (cost, fixed, adaptive) -> (label, method, k,
    draft model); 'ngram[:k]+mtp[:k]' (a chain: lookup where it matches, MTP otherwise) -> method 'chain'."""
    s, policy = split_policy(s)
    if policy:
        label, method, k, draft = parse_spec(s)
        if method == "none":
            raise MtpllmError(f"--spec {s}~{policy}: a draft-length policy needs a method")
        return f"{label}~{policy}", method, k, draft
    if "+" in s:
        parts = [parse_spec(p) for p in s.split("+")]
        if len(parts) != 2 or "none" in [p[1] for p in parts]:
            raise MtpllmError(f"--spec {s}: a chain is two methods, e.g. ngram:4+mtp:1")
        return "+".join(p[0] for p in parts), "chain", max(p[2] for p in parts), None
    if s in ("none", "off", ""):
        return "none", "none", 0, None
    s, p_min, p_cum = split_cutoff(s)
    if p_min or p_cum:
        label, method, k, draft = parse_spec(s)
        return (f"{label}@{p_min:g}" if p_min else f"{label}@c{p_cum:g}"), method, k, draft
    parts = s.split(":")
    kind = parts[0]

    def k_of(x: str) -> int:
        try:
            k = int(x)
        except ValueError:
            raise MtpllmError(f"--spec {s}: draft length '{x}' is not an integer") from None
        if not 1 <= k <= 16:
            raise MtpllmError(f"--spec {s}: draft length must be 1..16, got {k}")
        return k
    if kind in ("mtp", "ngram"):
        if len(parts) > 2:
            raise MtpllmError(f"--spec {s}: expected {kind}[:k]")
        k = k_of(parts[1]) if len(parts) == 2 else 3
        return f"{kind}:{k}", ("mtp" if kind == "mtp" else "ngram"), k, None
    if kind == "draft":
        if len(parts) < 2 or not parts[1]:
            raise MtpllmError(f"--spec {s}: expected draft:MODEL[:k]")
        if len(parts) >= 3 and parts[-1].isdigit():
            model, k = ":".join(parts[1:-1]), k_of(parts[-1])
        else:
            model, k = ":".join(parts[1:]), 3
        return f"draft:{os.path.basename(model)}:{k}", "draft_model", k, model
    raise MtpllmError(f"--spec {s}: unknown method '{kind}' (none, mtp[:k], ngram[:k], draft:MODEL[:k])")


def build_parser() -> argparse.ArgumentParser:
    from ..registry import DEFAULT_MODEL
    ap = argparse.ArgumentParser(prog="mtpllm bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=DEFAULT_MODEL, help="models, comma-separated (registry names or GGUF paths)")
    ap.add_argument("-p", "--n-prompt", type=_int_list, default=[512],
                    help="prompt tokens (synthetic, long and edit prompt sets), comma-separated (default 512)")
    ap.add_argument("-n", "--n-gen", type=_int_list, default=[128], help="tokens to generate (default 128)")
    ap.add_argument("-d", "--depth", type=_int_list, default=[0], help="tokens already in context (default 0)")
    ap.add_argument("-r", "--repetitions", type=int, default=5, help="repetitions per row, run in rounds over all rows (default 5)")
    ap.add_argument("-t", "--threads", type=_int_list, default=None, help="threads, comma-separated")
    ap.add_argument("--spec", default="none",
                    help="speculative methods, comma-separated: none, mtp[:k], ngram[:k], draft:MODEL[:k], "
                         "or a chain ngram[:k]+mtp[:k] (lookup where it matches, MTP otherwise); '@P' after a "
                         "method stops its drafts at a token of draft probability below P (e.g. mtp:3@0.5), '@cP' when "
                         "the product of the step's draft probabilities falls below P (e.g. mtp:3@c0.3); '~POLICY' "
                         "last picks how k is chosen per step: cost (mtp's default: up to k, 0 included, from measured "
                         "costs and acceptance), fixed, adaptive (e.g. mtp:3~fixed)")
    ap.add_argument("--prompts", default="synthetic",
                    help=f"prompt sets, comma-separated: {', '.join(PROMPT_SETS)} (default synthetic)")
    ap.add_argument("--n-prompts", type=int, default=3, help="prompts per repetition for the code/prose sets")
    ap.add_argument("--documents", type=int, default=1,
                    help=f"documents per repetition for the long/edit sets (1-{len(DOCUMENT_MODULES)}; default 1): "
                         "each begins with another standard-library module; a row's tok/s are over all of them")
    ap.add_argument("--mtp-head", default=None, help="head-only mtp-*.gguf for the mtp rows")
    ap.add_argument("--temp", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-c", "--ctx-size", type=int, default=None, help="context size (default: what the rows need)")
    ap.add_argument("--dequantize", action="store_true", help="float32 weights (reference path)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up repetitions per row, excluded (default 1)")
    ap.add_argument("-o", "--output", choices=["md", "csv", "json"], default="md")
    ap.add_argument("--save", default=None, help="also write the JSON report to this file")
    ap.add_argument("--plot", default=None, help="draw tok/s vs k and vs depth to this PNG (needs matplotlib)")
    ap.add_argument("--vs-llama-cpp", default=None, metavar="DIR",
                    help="directory with llama.cpp binaries: run llama-bench on the same files and show its rows")
    return ap


# ---------------------------------------------------------------------------- measurement
def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (peak RSS) to the current RSS
        return True
    except OSError:
        return False


def _peak_rss_mib() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _stat(xs: list[float]) -> dict:
    return {"mean": statistics.fmean(xs) if xs else 0.0, "sd": statistics.stdev(xs) if len(xs) > 1 else 0.0}


class RowRun:
    """One row of the matrix (a workload and a speculation setting) measured over repeats. Repeats run
    in rounds across all rows (`main`), so that a slow or fast phase of the machine falls on every row
    alike (and on llama.cpp's, run once per round), rather than on whichever rows ran during it."""

    def __init__(self, spec, label: str, k: int, prompt_set: str, n_prompt: int, n_gen: int, depth: int,
                 reps: int, n_prompts: int, temp: float, seed: int, documents: int = 1):
        from ..speculative.verifier import SpecStats
        self.spec, self.label, self.k = spec, label, k
        self.prompt_set, self.n_prompt, self.n_gen, self.depth = prompt_set, n_prompt, n_gen, depth
        self.reps, self.n_prompts, self.temp, self.seed = reps, n_prompts, temp, seed
        self.documents = documents
        self.n_requests = 0
        self.pre, self.dec, self.e2e = [], [], []
        self.total = SpecStats()
        self.p_tok = self.g_tok = 0
        self.peak_mib = 0.0

    def run(self, engine, rep: int) -> None:
        """One repeat (rep < 0: a warm-up, not counted) over the row's requests."""
        from ..runtime.sampling import SamplingParams
        spec = self.spec
        P_n = P_ms = G_n = G_ms = 0.0
        reqs = build_requests(engine, self.prompt_set, self.n_prompt, self.n_prompts, self.seed + rep, self.documents)
        self.n_requests = len(reqs)
        dep = depth_ids(engine, self.depth, self.seed + rep)
        _reset_peak_rss()
        for req in reqs:
            engine.reset()  # the target's cache and every proposer's draft state on the engine's slot
            params = SamplingParams(temperature=self.temp, top_k=0, top_p=1.0, min_p=0.0, max_tokens=self.n_gen,
                                    seed=self.seed + rep, ignore_eos=self.prompt_set == "synthetic")
            if dep:  # the context the measured prompt is appended to, evaluated untimed (the engine and
                # an MTP head cache it during prefill, so the measured request reuses it)
                engine.generate(prompt_ids=dep, params=SamplingParams(temperature=0, max_tokens=0), speculative=spec)
            out = engine.generate(prompt_ids=dep + req.ids, params=params, speculative=spec)
            t = out.timings
            P_n += t.prompt_n
            P_ms += t.prompt_ms
            G_n += t.predicted_n
            G_ms += t.predicted_ms
            if rep >= 0 and out.stats is not None:
                self.total.merge(out.stats)
        self.peak_mib = max(self.peak_mib, _peak_rss_mib())
        if rep < 0:
            return  # warm-up
        self.p_tok += P_n
        self.g_tok += G_n
        self.pre.append(P_n / (P_ms / 1e3) if P_ms else 0.0)
        self.dec.append(G_n / (G_ms / 1e3) if G_ms else 0.0)
        self.e2e.append(G_n / ((P_ms + G_ms) / 1e3) if P_ms + G_ms else 0.0)

    def result(self) -> dict:
        spec_on, total, reps = self.spec is not None, self.total, self.reps
        return {
            "threads": 0, "prompt_set": self.prompt_set,
            "n_prompt": self.n_prompt if self.prompt_set in SIZED_SETS else 0,
            "n_gen": self.n_gen, "depth": self.depth, "spec": self.label, "k": self.k, "repeats": reps,
            "requests": self.n_requests,  # per repetition
            "prompt_tokens": self.p_tok / reps, "gen_tokens": self.g_tok / reps,
            "prefill_tps": _stat(self.pre), "decode_tps": _stat(self.dec), "e2e_tps": _stat(self.e2e),
            "acceptance_rate": total.acceptance_rate if spec_on else None,
            "mean_acceptance_length": total.mean_acceptance_length if spec_on else None,
            "per_position_acceptance": total.per_position_acceptance if spec_on else [],
            # tokens per target forward, steps left undrafted by a p-min cut-off included
            "tokens_per_step": total.tokens_per_step if spec_on else None,
            "draft_ms_per_step": (total.draft_ms / total.num_drafts if total.num_drafts else 0.0) if spec_on else None,
            # target steps by the number of drafts they verified (0: plain steps the policy chose)
            "draft_length_histogram": list(total.k_hist) if spec_on else [],
            # a chain: per member, the steps it drafted and its drafts accepted
            "members": total.members_dict() if spec_on else {},
            "peak_rss_mib": self.peak_mib,
        }


# ---------------------------------------------------------------------------- llama.cpp side by side
def parse_llama_bench_json(text: str) -> list[dict]:
    """Rows of `llama-bench -o json` (a list of objects with n_prompt, n_gen, avg_ts, stddev_ts):
    model, threads, test (pp512, tg128, ...), ts (tokens per second: mean, sd)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MtpllmError(f"llama-bench printed something that is not JSON ({exc})") from None
    rows = []
    for r in data if isinstance(data, list) else []:
        pp, tg = int(r.get("n_prompt", 0)), int(r.get("n_gen", 0))
        rows.append({"model": os.path.basename(str(r.get("model_filename", "?"))),
                     "threads": int(r.get("n_threads", 0)), "test": f"pp{pp}" if pp else f"tg{tg}",
                     "ts": {"mean": float(r.get("avg_ts", 0)), "sd": float(r.get("stddev_ts", 0))}})
    return rows


def merge_llama_rounds(rounds: list[list[dict]]) -> list[dict]:
    """llama-bench's rows from several rounds (one run each) -> one row per test: the mean over rounds and
    their sd (one round: llama-bench's own), as prefill_tps (pp tests) or decode_tps (tg tests)."""
    merged: dict[tuple, list[dict]] = {}
    for rows in rounds:
        for r in rows:
            merged.setdefault((r["model"], r["threads"], r["test"]), []).append(r["ts"])
    out = []
    for (model, threads, test), ts in merged.items():
        s = ts[0] if len(ts) == 1 else _stat([t["mean"] for t in ts])
        text = f"{s['mean']:.2f} ± {s['sd']:.2f}"
        out.append({"model": model, "threads": threads, "test": test, "rounds": len(ts), "ts": s,
                    "prefill_tps": text if test.startswith("pp") else "-",
                    "decode_tps": text if test.startswith("tg") else "-"})
    return out


def compare_to_llama(rows: list[dict], llama_rows: list[dict]) -> None:
    """Each row's decode speed over llama.cpp's plain decoding of the same file, thread count and
    number of new tokens in the same run (row["decode_vs_llama_cpp"]), where llama.cpp ran that test."""
    tg = {(r["model"], r["threads"], r["test"]): r["ts"]["mean"] for r in llama_rows}
    for r in rows:
        ref = tg.get((os.path.basename(r["model"]), r["threads"], f"tg{r['n_gen']}"))
        if ref:
            r["decode_vs_llama_cpp"] = r["decode_tps"]["mean"] / ref


def run_llama_bench(bin_dir: str, path: str, a, threads: int, reps: int | None = None) -> list[dict]:
    d = Path(bin_dir)
    exe = next((p for p in (d / "llama-bench", d / "bin" / "llama-bench") if p.is_file()), None)
    if exe is None:
        raise MtpllmError(f"--vs-llama-cpp {bin_dir}: no llama-bench binary there (looked for llama-bench and "
                          f"bin/llama-bench)")
    cmd = [str(exe), "-m", path, "-p", ",".join(map(str, a.n_prompt)), "-n", ",".join(map(str, a.n_gen)),
           "-r", str(reps or a.repetitions), "-t", str(threads), "-o", "json"]
    if a.depth != [0]:
        cmd += ["-d", ",".join(map(str, a.depth))]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise MtpllmError(f"could not run {exe}: {exc}") from None
    if p.returncode != 0:
        raise MtpllmError(f"{exe} failed (exit {p.returncode}): {p.stderr.strip()[-500:]}")
    return parse_llama_bench_json(p.stdout)


# ---------------------------------------------------------------------------- main
def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    check_documents(a.documents)  # before the model loads
    if a.repetitions < 1 or a.warmup < 0 or a.n_prompts < 1:
        raise MtpllmError("-r and --n-prompts must be >= 1 and --warmup >= 0")
    if not a.n_gen or min(a.n_gen) < 1:
        raise MtpllmError("-n must be >= 1")
    from ..runtime.engine import resolve_device
    a.device = resolve_device(a.device)  # before any model loads: the report records the device used
    specs = [parse_spec(s) for s in a.spec.split(",")]
    sets = [s.strip() for s in a.prompts.split(",") if s.strip()]
    for s in sets:
        if s not in PROMPT_SETS:
            raise MtpllmError(f"--prompts: unknown prompt set '{s}' (known: {', '.join(PROMPT_SETS)})")
    if a.documents > 1 and not set(DOCUMENT_SETS) & set(sets):
        raise MtpllmError("--documents applies to the long and edit prompt sets (--prompts long,edit)")
    if a.vs_llama_cpp and not Path(a.vs_llama_cpp).is_dir():
        raise MtpllmError(f"--vs-llama-cpp {a.vs_llama_cpp}: not a directory")
    if a.plot:
        try:
            import matplotlib  # noqa: F401  (fail before the long run, not after)
        except ImportError:
            raise MtpllmError("--plot needs matplotlib: pip install 'mtpllm[bench]'") from None
    import torch

    from ..gguf.reader import GGUFFile
    from ..registry import resolve_model, sha256_cached
    from ..runtime.engine import Engine
    from ..speculative import SpecConfig
    threads_list = a.threads or [torch.get_num_threads()]
    longest = max(a.n_prompt) if any(s in SIZED_SETS for s in sets) else 0
    need = max(a.depth) + max(longest, 512 if any(s in ("code", "prose", "long", "edit") for s in sets) else 0) \
        + max(a.n_gen) + 64  # + chat template and summarisation instruction
    n_ctx = a.ctx_size or need
    rows, models, llama_rows = [], [], []
    def prompt_sizes(ps: str) -> list[int]:  # -p applies to the synthetic, long and edit sets only
        return a.n_prompt if ps in SIZED_SETS else [0]
    for name in [m.strip() for m in a.model.split(",") if m.strip()]:
        path = resolve_model(name)
        g = GGUFFile(path)
        sha = sha256_cached(path)
        models.append({"path": str(path), "sha256": sha, "size": g.file_size,
                       "quant_types": sorted({t.qtype.name for t in g.tensors.values()})})
        del g
        for threads in threads_list:
            torch.set_num_threads(threads)
            engine = Engine.load(str(path), n_ctx=n_ctx, mode="f32" if a.dequantize else "fast", threads=threads,
                                 device=a.device)
            built = {}
            def config(text: str, policy: str | None = None) -> SpecConfig:
                # 'a+b': a chain, b the fallback (checked by parse_spec); one policy for a whole chain
                text, own = split_policy(text)
                first, _, rest = text.partition("+")
                parts = [split_policy(x) for x in text.split("+")]
                policy = policy or own or next((p for _, p in parts if p), None)
                _, method, k, draft = parse_spec(parts[0][0])
                return SpecConfig(method=method, num_speculative_tokens=k, draft_model=draft,
                                  # one cut-off for a whole chain (its verifier's; lookup drafts ignore it)
                                  p_min=max(split_cutoff(x)[1] for x, _ in parts),
                                  p_cum=max(split_cutoff(x)[2] for x, _ in parts),
                                  mtp_head=a.mtp_head if method == "mtp" else None, policy=policy,
                                  fallback=config(rest, "fixed") if rest else None)
            for spec_text, (label, method, k, draft) in zip(a.spec.split(","), specs):
                if method != "none":  # build every proposer before measuring: bad input fails fast
                    built[label] = config(spec_text.strip()).build(engine)
            matrix = [RowRun(built.get(label), label, k, ps, n_prompt, n_gen, depth, a.repetitions, a.n_prompts,
                             a.temp, a.seed, a.documents)
                      for ps in sets for n_prompt in prompt_sizes(ps) for n_gen in a.n_gen for depth in a.depth
                      for label, method, k, draft in specs]
            rounds = []
            # repeats in rounds over the whole matrix (and llama.cpp once per round): a phase of the
            # machine (these VMs drift by 20-30% over minutes) falls on every row alike
            for rep_i in range(-a.warmup, a.repetitions):
                for row in matrix:
                    what = "warm-up" if rep_i < 0 else f"round {rep_i + 1}/{a.repetitions}"
                    print(f"[{what}] {path.name} t={threads} {row.prompt_set} p={row.n_prompt} n={row.n_gen} "
                          f"d={row.depth} spec={row.label}", file=sys.stderr)
                    row.run(engine, rep_i)
                if a.vs_llama_cpp and rep_i >= 0:
                    print(f"[round {rep_i + 1}/{a.repetitions}] llama-bench {path.name} t={threads}", file=sys.stderr)
                    rounds.append(run_llama_bench(a.vs_llama_cpp, str(path), a, threads, reps=1))
            for row in matrix:
                r = row.result()
                r.update(model=str(path), model_sha256=sha, threads=threads, load_ms=engine.load_ms)
                rows.append(r)
            if rounds:
                merged = merge_llama_rounds(rounds)
                compare_to_llama(rows[-len(matrix):], merged)
                llama_rows += merged
            del engine, built
    sampling = "greedy" if a.temp == 0 else f"temperature {a.temp}, seed {a.seed}"
    from ..runtime import kernels
    mode = "f32" if a.dequantize else ("fast (compressed; CPU kernel " + kernels.status() + ")"
                                        if a.device == "cpu" else "fast (compressed)")
    rep = {"conditions": conditions(argv, a.device, mode, sampling, models),
           "rows": rows}
    if llama_rows:
        rep["llama_cpp"] = llama_rows
    text = {"md": to_markdown, "csv": to_csv, "json": to_json}[a.output](rep)
    print(text)
    if a.save:
        Path(a.save).write_text(to_json(rep))
    if a.plot:
        plot(rep, a.plot)
        print(f"plot written to {a.plot}", file=sys.stderr)
    return 0
