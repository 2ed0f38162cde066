"""Benchmark reports: test conditions, the JSON schema of a report, markdown/CSV/JSON output, plots."""
from __future__ import annotations

import csv
import io
import json
import os
import platform
import sys
import time

from ..errors import MtpllmError
from .workloads import DOCUMENT_SETS

# One report = conditions + rows. Every figure that is averaged carries its standard deviation.
STAT = {"type": "object", "required": ["mean", "sd"],
        "properties": {"mean": {"type": "number"}, "sd": {"type": "number", "minimum": 0}}}
ROW_SCHEMA = {
    "type": "object",
    "required": ["model", "model_sha256", "threads", "prompt_set", "n_prompt", "n_gen", "depth", "spec", "k",
                 "repeats", "prompt_tokens", "gen_tokens", "prefill_tps", "decode_tps", "e2e_tps",
                 "acceptance_rate", "mean_acceptance_length", "per_position_acceptance", "draft_ms_per_step",
                 "peak_rss_mib", "load_ms"],
    "properties": {
        "model": {"type": "string"}, "model_sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
        "threads": {"type": "integer", "minimum": 1}, "prompt_set": {"type": "string"},
        "n_prompt": {"type": "integer", "minimum": 0}, "n_gen": {"type": "integer", "minimum": 1},
        "depth": {"type": "integer", "minimum": 0}, "spec": {"type": "string"}, "k": {"type": "integer", "minimum": 0},
        "repeats": {"type": "integer", "minimum": 1},
        "requests": {"type": "integer", "minimum": 1},  # per repetition (prompts, documents)
        "prompt_tokens": {"type": "number", "minimum": 0}, "gen_tokens": {"type": "number", "minimum": 0},
        "prefill_tps": STAT, "decode_tps": STAT, "e2e_tps": STAT,
        "acceptance_rate": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
        "mean_acceptance_length": {"type": ["number", "null"], "minimum": 1},
        "per_position_acceptance": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}},
        "draft_ms_per_step": {"type": ["number", "null"], "minimum": 0},
        "tokens_per_step": {"type": ["number", "null"], "minimum": 1},
        # target steps by the number of drafts they verified (index 0: plain steps)
        "draft_length_histogram": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        # a chain: per member (ngram, mtp, ...), steps it drafted, its draft tokens and those accepted
        "members": {"type": "object", "additionalProperties": {
            "type": "object", "required": ["drafts", "draft_tokens", "accepted_tokens"],
            "properties": {k: {"type": "integer", "minimum": 0} for k in ("drafts", "draft_tokens", "accepted_tokens")}}},
        "peak_rss_mib": {"type": "number", "minimum": 0}, "load_ms": {"type": "number", "minimum": 0},
        # decode t/s over llama.cpp's tg<n_gen> on the same file and threads in the same run (--vs-llama-cpp)
        "decode_vs_llama_cpp": {"type": "number", "minimum": 0},
    },
}
REPORT_SCHEMA = {
    "type": "object",
    "required": ["conditions", "rows"],
    "properties": {
        "conditions": {
            "type": "object",
            "required": ["date", "cpu", "cores", "torch", "mtpllm", "python", "device", "mode", "sampling",
                         "command", "models"],
            "properties": {"models": {"type": "array", "items": {
                "type": "object", "required": ["path", "sha256", "size", "quant_types"]}}},
        },
        "rows": {"type": "array", "items": ROW_SCHEMA},
        "llama_cpp": {"type": "array"},
    },
}


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU as figures must name it: its model name, family and model, and the vector extensions
    the kernels' speed depends on, e.g. "AMD EPYC (family 25 model 17; avx512_vnni)" (machines of
    one model name differ: Zen 3, 4 and 5 all report "AMD EPYC" in these VMs)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read(1 << 20)
        except OSError:
            cpuinfo = ""
    info = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if info:
                break  # the first processor's block
            continue
        key, _, val = line.partition(":")
        info.setdefault(key.strip(), val.strip())
    name = info.get("model name") or platform.processor() or platform.machine()
    details = []
    if "cpu family" in info and "model" in info:
        details.append(f"family {info['cpu family']} model {info['model']}")
    flags = set(info.get("flags", "").split())
    isa = [f for f in ("avx512_vnni", "amx_int8") if f in flags] or [f for f in ("avx2",) if f in flags]
    if isa:
        details.append(", ".join(isa))
    return f"{name} ({'; '.join(details)})" if details else name


def conditions(argv: list[str], device: str, mode: str, sampling: str, models: list[dict]) -> dict:
    import torch
    from .. import __version__
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cpu": cpu_model(), "cores": os.cpu_count(),
            "torch": torch.__version__, "mtpllm": __version__, "python": sys.version.split()[0],
            "device": device if device == "cpu" else f"{device} ({torch.cuda.get_device_name(0)})",
            "mode": mode, "sampling": sampling, "command": "mtpllm bench " + " ".join(argv), "models": models}


def _pm(s: dict, digits: int = 2) -> str:
    return f"{s['mean']:.{digits}f} ± {s['sd']:.{digits}f}"


def _test_name(r: dict) -> str:
    name = f"{r['prompt_set']}" if r["prompt_set"] != "synthetic" else f"pp{r['n_prompt']}"
    if r["prompt_set"] in DOCUMENT_SETS and r.get("requests", 1) > 1:
        name += f" x{r['requests']}"  # --documents: that many files, tok/s over all of them
    name += f"+tg{r['n_gen']}"
    return name + (f" @ d{r['depth']}" if r["depth"] else "")


def to_markdown(rep: dict) -> str:
    c = rep["conditions"]
    out = [f"mtpllm bench: {c['date']}, {c['cpu']} ({c['cores']} cores), torch {c['torch']}, mtpllm {c['mtpllm']}, "
           f"python {c['python']}, device {c['device']}, weights {c['mode']}, sampling {c['sampling']}"]
    for m in c["models"]:
        out.append(f"model {m['path']} ({m['size'] / 2**20:.1f} MiB, sha256 {m['sha256'][:16]}..., "
                   f"types {', '.join(m['quant_types'])})")
    out.append(f"command: {c['command']}")
    out.append("")
    vs = any("decode_vs_llama_cpp" in r for r in rep["rows"])
    out.append("| model | threads | test | spec | prefill t/s | decode t/s | e2e t/s | accept | mean acc. len "
               "| per position | peak MiB | load ms |" + (" decode vs llama.cpp |" if vs else ""))
    out.append("|---|---:|---|---|---:|---:|---:|---:|---:|---|---:|---:|" + ("---:|" if vs else ""))
    for r in rep["rows"]:
        acc = "-" if r["acceptance_rate"] is None else f"{100 * r['acceptance_rate']:.1f}%"
        mal = "-" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}"
        tps = r.get("tokens_per_step")
        if tps is not None and abs(tps - r["mean_acceptance_length"]) > 0.005:
            mal += f" ({tps:.2f}/step)"  # a p-min cut-off left steps without a draft
        pos = " ".join(f"{x:.2f}" for x in r["per_position_acceptance"]) or "-"
        hist = r.get("draft_length_histogram") or []
        if sum(1 for n in hist if n) > 1:  # the policy chose different draft lengths: steps by k
            pos += " (k " + " ".join(f"{k}:{n}" for k, n in enumerate(hist) if n) + ")"
        for name, m in (r.get("members") or {}).items():  # a chain: who drafted, and how well
            pos += f"; {name} {m['drafts']}x {m['accepted_tokens']}/{m['draft_tokens']}"
        out.append(f"| {os.path.basename(r['model'])} | {r['threads']} | {_test_name(r)} | {r['spec']} | "
                   f"{_pm(r['prefill_tps'])} | {_pm(r['decode_tps'])} | {_pm(r['e2e_tps'])} | {acc} | {mal} | "
                   f"{pos} | {r['peak_rss_mib']:.0f} | {r['load_ms']:.0f} |" +
                   ((f" {r['decode_vs_llama_cpp']:.2f}x |" if "decode_vs_llama_cpp" in r else " - |") if vs else ""))
    for row in rep.get("llama_cpp", []):
        out.append(f"| llama.cpp {row['model']} | {row['threads']} | {row['test']} | none | "
                   f"{row['prefill_tps']} | {row['decode_tps']} | - | - | - | - | - | - |" + (" - |" if vs else ""))
    out.append("")
    out.append("prefill t/s: prompt tokens / prompt time; decode t/s: generated tokens / generation time; "
               "e2e t/s: generated tokens / (prompt + generation time); mean ± sd over repeats (run in rounds over "
               "all rows, and llama.cpp once per round), warm-up excluded; "
               "mean acc. len: 1 + accepted / steps with a draft (in brackets, where a p-min cut-off left steps "
               "without one: per step); (k ...): steps by the number of drafts they verified, 0 = plain, where "
               "that varied; for a chain, per member: steps it drafted (x) and its accepted / drafted tokens.")
    return "\n".join(out)


def to_csv(rep: dict) -> str:
    buf = io.StringIO()
    cols = ["model", "threads", "prompt_set", "n_prompt", "n_gen", "depth", "spec", "k", "repeats",
            "prefill_tps", "prefill_sd", "decode_tps", "decode_sd", "e2e_tps", "e2e_sd", "acceptance_rate",
            "mean_acceptance_length", "per_position_acceptance", "peak_rss_mib", "load_ms", "decode_vs_llama_cpp"]
    w = csv.writer(buf)
    w.writerow(cols)
    for r in rep["rows"]:
        w.writerow([r["model"], r["threads"], r["prompt_set"], r["n_prompt"], r["n_gen"], r["depth"], r["spec"],
                    r["k"], r["repeats"], r["prefill_tps"]["mean"], r["prefill_tps"]["sd"], r["decode_tps"]["mean"],
                    r["decode_tps"]["sd"], r["e2e_tps"]["mean"], r["e2e_tps"]["sd"], r["acceptance_rate"],
                    r["mean_acceptance_length"], " ".join(f"{x:.4f}" for x in r["per_position_acceptance"]),
                    r["peak_rss_mib"], r["load_ms"], r.get("decode_vs_llama_cpp", "")])
    return buf.getvalue()


def to_json(rep: dict) -> str:
    return json.dumps(rep, indent=1)


def plot(rep: dict, path: str) -> None:
    """decode tok/s vs draft length k (one line per method), and vs depth (one line per method)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MtpllmError("--plot needs matplotlib: pip install 'mtpllm[bench]'") from None
    r0 = rep["rows"][0]
    same = ("model", "threads", "prompt_set", "n_prompt", "n_gen")  # one workload per plot: no mixed averages
    rows = [r for r in rep["rows"] if all(r[f] == r0[f] for f in same)]
    d0 = min(r["depth"] for r in rows)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    methods = sorted({r["spec"].rsplit(":", 1)[0] if r["k"] else "none" for r in rows})
    base = [r["decode_tps"]["mean"] for r in rows if r["k"] == 0 and r["depth"] == d0]
    for m in methods:
        if m != "none":
            pts = sorted((r["k"], r["decode_tps"]["mean"]) for r in rows
                         if r["k"] and r["spec"].rsplit(":", 1)[0] == m and r["depth"] == d0)
            if base:
                pts = [(0, base[0])] + pts
            ax1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
        for k in sorted({r["k"] for r in rows if (r["spec"].rsplit(":", 1)[0] if r["k"] else "none") == m}):
            pts = sorted((r["depth"], r["decode_tps"]["mean"]) for r in rows
                         if r["k"] == k and (r["spec"].rsplit(":", 1)[0] if r["k"] else "none") == m)
            ax2.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m if m == "none" else f"{m}:{k}")
    ax1.set_xlabel("draft tokens k (0 = plain decoding)")
    ax1.set_ylabel("decode tok/s")
    ax1.set_title("decode speed vs k")
    ax2.set_xlabel("depth (tokens already in context)")
    ax2.set_ylabel("decode tok/s")
    ax2.set_title("decode speed vs depth")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    c = rep["conditions"]
    work = r0["prompt_set"] + (f" p={r0['n_prompt']}" if r0["n_prompt"] else "") + f" n={r0['n_gen']}"
    fig.suptitle(f"{os.path.basename(r0['model'])}, {work}, {r0['threads']} threads; {c['cpu']}, {c['device']}, "
                 f"torch {c['torch']}, {c['date']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
