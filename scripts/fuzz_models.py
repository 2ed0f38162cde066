"""Mutation fuzzing of the model-file loaders: tiny real files, damaged in many ways, must load or fail
with one clean MtpllmError, within a time limit and a memory ceiling.

Seed files (written with tests/tiny.py): a tiny model of each architecture (qwen2 with an in-file MTP
layer, qwen3, llama, gemma3), a head-only MTP file and a Hugging Face safetensors MTP head. Each case
takes one seed and applies one to three mutations: random bytes changed in the header, truncation,
an extreme integer (0, 1, 2^31, 2^32 - 1, 2^63, 2^64 - 1, x +- 1, x * 2, ...) written over a header
field (a count, a string or array length, a value type, a metadata value, a tensor dimension, type
or offset), bytes inserted or deleted. The mutant then goes through what a user runs on a file:
`inspect`, `doctor` and `Engine.load` with a short generation for a model; the MTP head loader (and
one step of the head) for a head file.

Cases run in worker processes under a memory ceiling (RLIMIT_AS: the worker's size after start-up
plus --mem-mib) and a per-case limit of CPU time (SIGPROF, so that a busy machine does not turn a
slow case into a "hang"; a watchdog in the parent restarts a worker stuck in native code). Outcomes: load (the file worked), error (MtpllmError), crash (any other exception, or
the worker died), hang (time limit). Exit code 1 when there is any crash or hang.

    python scripts/fuzz_models.py --cases 100000 --seed 1 --json fuzz.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHS = ("qwen2", "qwen3", "llama", "gemma3")
SEED_NAMES = ARCHS + ("head", "hf-head")
EXTREMES = (0, 1, 2, 0x7F, 0xFF, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0x100000000,
            0x7FFFFFFFFFFFFFFF, 0x8000000000000000, 0xFFFFFFFFFFFFFFFF)


# ---- seed files ----------------------------------------------------------------------------------
def write_seeds(d: Path) -> dict[str, Path]:
    """The unmutated files: one tiny model per architecture, a head-only GGUF head and an HF head."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny import make_tiny, make_tiny_head  # noqa: E402
    seeds = {}
    for arch in ARCHS:
        seeds[arch] = make_tiny(d / f"{arch}.gguf", arch, n_layers=1, nextn=1 if arch == "qwen2" else 0, ctx=64)
    seeds["trunk"] = make_tiny(d / "trunk.gguf", "qwen2", n_layers=1, ctx=64)
    seeds["head"] = make_tiny_head(d / "head.gguf", "qwen2", n_layers=1, ffn=256)
    seeds["hf-head"] = _write_hf_head(d / "hf-head.safetensors")
    return seeds


def _write_hf_head(path: Path) -> Path:
    """A DeepSeek-layout MTP layer (model.layers.1.*) for the one-layer qwen2 trunk, as safetensors."""
    import torch
    from safetensors.torch import save_file
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny import D, FFN, HD, HEADS, KV
    g = torch.Generator().manual_seed(0)

    def r(*shape, scale=0.05):
        return (torch.randn(*shape, generator=g) * scale).contiguous()
    p = "model.layers.1."
    t = {p + "eh_proj.weight": r(D, 2 * D), p + "enorm.weight": 1 + r(D), p + "hnorm.weight": 1 + r(D),
         p + "shared_head.norm.weight": 1 + r(D), p + "input_layernorm.weight": 1 + r(D),
         p + "post_attention_layernorm.weight": 1 + r(D),
         p + "self_attn.q_proj.weight": r(HEADS * HD, D), p + "self_attn.q_proj.bias": r(HEADS * HD),
         p + "self_attn.k_proj.weight": r(KV * HD, D), p + "self_attn.k_proj.bias": r(KV * HD),
         p + "self_attn.v_proj.weight": r(KV * HD, D), p + "self_attn.v_proj.bias": r(KV * HD),
         p + "self_attn.o_proj.weight": r(D, HEADS * HD), p + "mlp.gate_proj.weight": r(FFN, D),
         p + "mlp.up_proj.weight": r(FFN, D), p + "mlp.down_proj.weight": r(D, FFN)}
    save_file(t, str(path), metadata={"format": "pt"})
    return path


# ---- where the integer fields of a file are ------------------------------------------------------
def gguf_fields(data: bytes) -> dict[str, list[tuple[int, int]]]:
    """(offset, width) of every integer field of a well-formed GGUF header, grouped by kind."""
    kinds: dict[str, list[tuple[int, int]]] = {k: [] for k in (
        "header", "key_len", "value_type", "value", "str_len", "array_type", "array_len", "tensor_name_len",
        "n_dims", "dim", "tensor_type", "offset")}
    pos = 4
    kinds["header"].append((pos, 4))
    kinds["header"] += [(pos + 4, 8), (pos + 12, 8)]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, pos + 4)
    pos += 20
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def string(kind):
        nonlocal pos
        kinds[kind].append((pos, 8))
        n = struct.unpack_from("<Q", data, pos)[0]
        pos += 8 + n

    for _ in range(n_kv):
        string("key_len")
        kinds["value_type"].append((pos, 4))
        vt = struct.unpack_from("<I", data, pos)[0]
        pos += 4
        if vt == 8:
            string("str_len")
        elif vt == 9:
            kinds["array_type"].append((pos, 4))
            et = struct.unpack_from("<I", data, pos)[0]
            kinds["array_len"].append((pos + 4, 8))
            n = struct.unpack_from("<Q", data, pos + 4)[0]
            pos += 12
            for _ in range(n):
                if et == 8:
                    string("str_len")
                else:
                    kinds["value"].append((pos, sizes[et]))
                    pos += sizes[et]
        else:
            kinds["value"].append((pos, sizes[vt]))
            pos += sizes[vt]
    for _ in range(n_tensors):
        string("tensor_name_len")
        kinds["n_dims"].append((pos, 4))
        nd = struct.unpack_from("<I", data, pos)[0]
        pos += 4
        for _ in range(nd):
            kinds["dim"].append((pos, 8))
            pos += 8
        kinds["tensor_type"].append((pos, 4))
        kinds["offset"].append((pos + 4, 8))
        pos += 12
    return {k: v for k, v in kinds.items() if v} | {"_header_end": [(pos, 0)]}


def safetensors_fields(data: bytes) -> dict[str, list[tuple[int, int]]]:
    """The header length, and the places of the numbers (offsets, shape entries) in the JSON header."""
    n = struct.unpack_from("<Q", data, 0)[0]
    digits, i = [], 8
    while i < 8 + n:
        if chr(data[i]).isdigit():
            j = i
            while chr(data[j]).isdigit():
                j += 1
            digits.append((i, j - i))
            i = j
        else:
            i += 1
    return {"header_len": [(0, 8)], "number": digits, "_header_end": [(8 + n, 0)]}


# ---- mutations -----------------------------------------------------------------------------------
def mutate(data: bytes, fields: dict, rng: random.Random, json_header: bool = False) -> tuple[bytes, str]:
    """One to three mutations of `data`; returns the mutant and a short description."""
    buf = bytearray(data)
    header_end = fields["_header_end"][0][0]
    kinds = [k for k in fields if not k.startswith("_")]
    done = []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        op = rng.choice(("flip", "flip", "truncate", "extreme", "extreme", "extreme", "insert", "delete"))
        end = min(len(buf), header_end) if rng.random() < 0.95 else len(buf)
        end = max(end, 1)
        if op == "flip":
            for _ in range(rng.randint(1, 4)):
                i = rng.randrange(end)
                buf[i] = buf[i] ^ (1 << rng.randrange(8)) if rng.random() < 0.5 else rng.randrange(256)
            done.append("flip")
        elif op == "truncate":
            cut = rng.randrange(end) if rng.random() < 0.8 else rng.randrange(len(buf))
            del buf[cut:]
            done.append(f"truncate@{cut}")
            if not buf:
                break
        elif op == "extreme":
            kind = rng.choice(kinds)
            pos, width = rng.choice(fields[kind])
            if pos + width > len(buf):
                continue
            if json_header and kind == "number":
                text = str(rng.choice(EXTREMES + (-1, 10 ** 30)))
                buf[pos:pos + width] = text.encode()
                done.append(f"number@{pos}={text}")
                continue
            old = int.from_bytes(buf[pos:pos + width], "little")
            v = rng.choice(EXTREMES + (old + 1, old - 1, old * 2, old << 8, rng.getrandbits(8 * width)))
            v %= 1 << (8 * width)
            buf[pos:pos + width] = v.to_bytes(width, "little")
            done.append(f"{kind}@{pos}={v}")
        elif op == "insert":
            i = rng.randrange(end)
            buf[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
            done.append(f"insert@{i}")
        else:
            i = rng.randrange(end)
            del buf[i:i + rng.randint(1, 16)]
            done.append(f"delete@{i}")
    return bytes(buf), " ".join(done)


# ---- the worker: runs cases in-process ------------------------------------------------------------
class _Timeout(BaseException):
    pass


def _on_alarm(signum, frame):
    raise _Timeout()


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


class Targets:
    """What a user runs on a file, with the unmutated trunk kept for the head cases."""

    def __init__(self, seeds: dict[str, Path]):
        import torch
        torch.set_num_threads(1)
        from mtpllm.runtime.engine import Engine
        self.trunk = Engine.load(str(seeds["trunk"]), n_ctx=32)

    def model(self, path: Path, deep: bool) -> None:
        from mtpllm.gguf.reader import GGUFFile
        from mtpllm.runtime.engine import Engine
        from mtpllm.runtime.sampling import SamplingParams
        from mtpllm.tools.doctor import diagnose
        from mtpllm.tools.inspect import format_text, inspect_file
        GGUFFile(path)  # inspect, doctor and Engine.load all start here: a header error ends the case
        r = inspect_file(path)
        json.dumps(r, default=str)
        format_text(r)
        if deep:
            diagnose(path, sha=False).format()
        eng = Engine.load(str(path), n_ctx=32)
        params = SamplingParams(temperature=0.0, max_tokens=2)
        eng.generate("the", params)
        if eng.tokenizer.chat_template:
            eng.generate(messages=[{"role": "user", "content": "hi"}], params=params, chat=True)

    def head(self, path: Path) -> None:
        import torch
        from mtpllm.speculative.mtp import load_mtp_head, open_head_file
        trunk = self.trunk.model
        g = open_head_file(path, trunk.cfg)
        head = load_mtp_head(g, trunk)
        cache = head.make_cache(trunk.cfg, 8)
        x = torch.zeros(2, trunk.cfg.d_model)
        with torch.inference_mode():
            head(trunk.embed(torch.tensor([1, 2])), x, cache)


def case_input(i: int, seed: int, seeds: dict[str, Path], originals: dict, fields: dict) -> tuple[str, bytes, str]:
    rng = random.Random(seed * 1_000_003 + i)
    name = SEED_NAMES[i % len(SEED_NAMES)]
    data, how = mutate(originals[name], fields[name], rng, json_header=name == "hf-head")
    return name, data, how


def worker(args) -> None:
    from mtpllm.errors import MtpllmError
    work = Path(args.workdir)
    seeds = {p.stem: p for p in (work / "seeds").iterdir()}
    originals = {n: seeds[n].read_bytes() for n in SEED_NAMES}
    fields = {n: (safetensors_fields if n == "hf-head" else gguf_fields)(originals[n]) for n in SEED_NAMES}
    targets = Targets(seeds)
    # warm up every code path once (imports, lazily built kernels) before the ceiling is set
    for n in SEED_NAMES:
        (targets.head if "head" in n else lambda p: targets.model(p, True))(seeds[n])
    base_rss = _rss_kib()
    limit = _vm_size() + args.mem_mib * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    signal.signal(signal.SIGPROF, _on_alarm)
    out = sys.stdout
    out.write(f"ready {base_rss}\n")
    out.flush()
    mdir = work / "m"
    mdir.mkdir(exist_ok=True)
    for i in range(args.start, args.stop):
        name, data, how = case_input(i, args.seed, seeds, originals, fields)
        path = mdir / ("m.safetensors" if name == "hf-head" else "m.gguf")
        path.write_bytes(data)
        out.write(f"start {i}\n")
        out.flush()
        t0 = time.perf_counter()
        status, detail = "load", ""
        signal.setitimer(signal.ITIMER_PROF, args.case_s)
        try:
            if "head" in name:
                targets.head(path)
            else:
                targets.model(path, deep=i % 4 == 0)
        except _Timeout:
            status, detail = "hang", how
        except MtpllmError as exc:
            status, detail = "error", str(exc).replace(str(path), "FILE")[:200]
        except BaseException as exc:  # noqa: anything else is what this looks for
            tb = traceback.extract_tb(exc.__traceback__)
            where = f"{Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else "?"
            status, detail = "crash", f"{type(exc).__name__}: {str(exc)[:200]} at {where} [{how}]"
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)
        dt = time.perf_counter() - t0
        out.write(json.dumps({"i": i, "seed": name, "status": status, "s": round(dt, 4),
                              "rss_kib": _rss_kib() - base_rss, "detail": detail}) + "\n")
        out.flush()


# ---- the parent: runs workers, restarts them after a death or a hang ----------------------------------
def campaign(n_cases: int, seed: int = 0, workdir: str | Path | None = None, case_s: float = 5.0,
             mem_mib: int = 1024, nice: int = 0, start: int = 0, log=None) -> dict:
    """Run cases start .. start+n_cases-1; returns the figures (and the non-clean cases)."""
    tmp = None
    if workdir is None:
        tmp = tempfile.TemporaryDirectory()
        workdir = tmp.name
    work = Path(workdir)
    (work / "seeds").mkdir(parents=True, exist_ok=True)
    write_seeds(work / "seeds")
    counts: Counter = Counter()
    by_seed: Counter = Counter()
    bad: list[dict] = []
    peak_kib, slowest = 0, 0.0
    t_start = time.time()
    i, stop = start, start + n_cases
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    while i < stop:
        cmd = [sys.executable, __file__, "--worker", "--workdir", str(work), "--seed", str(seed),
               "--start", str(i), "--stop", str(stop), "--case-s", str(case_s), "--mem-mib", str(mem_mib)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
                                preexec_fn=(lambda: os.nice(nice)) if nice else None)
        current, ready = None, False
        while True:
            wait = max(120, case_s * 10) if ready else 1200
            r, _, _ = select.select([proc.stdout], [], [], wait)
            if not r:  # stuck beyond the in-process alarm (inside native code): a hang
                proc.kill()
                proc.wait()
                if current is None:
                    raise RuntimeError("fuzz worker did not start")
                counts["hang"] += 1
                bad.append({"i": current, "status": "hang", "detail": "watchdog"})
                i = current + 1
                break
            line = proc.stdout.readline()
            if not line:  # the worker died
                proc.wait()
                if current is None:
                    raise RuntimeError(f"fuzz worker failed to start: {proc.stderr.read()[-2000:]}")
                counts["crash"] += 1
                bad.append({"i": current, "status": "crash", "detail": f"worker died (exit {proc.returncode}): "
                                                                      f"{proc.stderr.read()[-500:]}"})
                i = current + 1
                break
            if line.startswith("ready"):
                ready = True
            elif line.startswith("start "):
                current = int(line.split()[1])
            else:
                rec = json.loads(line)
                counts[rec["status"]] += 1
                by_seed[(rec["seed"], rec["status"])] += 1
                peak_kib = max(peak_kib, rec["rss_kib"])
                slowest = max(slowest, rec["s"])
                if rec["status"] not in ("load", "error"):
                    bad.append(rec)
                i = rec["i"] + 1
                current = None
                if log and (i - start) % 1000 == 0:
                    log(f"{i - start} cases, {dict(counts)}, peak +{peak_kib / 1024:.1f} MiB, "
                        f"slowest {slowest:.2f} s, {time.time() - t_start:.0f} s")
                if i >= stop:
                    proc.wait()
                    break
    if tmp:
        tmp.cleanup()
    seeds_summary = {}
    for (s, st), n in sorted(by_seed.items()):
        seeds_summary.setdefault(s, {})[st] = n
    return {"cases": n_cases, "seed": seed, "start": start, "load": counts["load"], "error": counts["error"],
            "crash": counts["crash"], "hang": counts["hang"], "peak_rss_growth_mib": round(peak_kib / 1024, 1),
            "slowest_case_s": round(slowest, 3), "wall_s": round(time.time() - t_start, 1),
            "case_limit_s": case_s, "memory_ceiling_mib": mem_mib, "by_seed": seeds_summary, "bad": bad[:200]}


def merge(parts: list[dict]) -> dict:
    """The figures of several campaigns over consecutive case ranges, as one."""
    out = dict(parts[0])
    for k in ("cases", "load", "error", "crash", "hang"):
        out[k] = sum(p[k] for p in parts)
    for k in ("peak_rss_growth_mib", "slowest_case_s", "wall_s"):
        out[k] = max(p[k] for p in parts)
    out["start"] = min(p["start"] for p in parts)
    out["by_seed"] = {}
    for p in parts:
        for s, d in p["by_seed"].items():
            for st, n in d.items():
                out["by_seed"].setdefault(s, {}).setdefault(st, 0)
                out["by_seed"][s][st] += n
    out["bad"] = [b for p in parts for b in p["bad"]][:200]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0, help="first case number (to replay one case)")
    ap.add_argument("--case-s", type=float, default=5.0, help="time limit of one case (seconds)")
    ap.add_argument("--mem-mib", type=int, default=1024, help="memory ceiling above the worker's start-up size")
    ap.add_argument("--nice", type=int, default=0, help="niceness of the workers")
    ap.add_argument("--jobs", type=int, default=1, help="workers running side by side")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stop", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    def one(k: int) -> dict:
        n = a.cases // a.jobs + (k < a.cases % a.jobs)
        first = a.start + k * (a.cases // a.jobs) + min(k, a.cases % a.jobs)
        wd = None if a.workdir is None else Path(a.workdir) / f"job{k}"
        return campaign(n, a.seed, wd, a.case_s, a.mem_mib, a.nice, first,
                        log=lambda m: print(f"[job {k}] {m}", file=sys.stderr, flush=True))
    if a.jobs > 1:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(a.jobs) as ex:
            res = merge(list(ex.map(one, range(a.jobs))))
    else:
        res = one(0)
    text = json.dumps(res, indent=1)
    if a.json:
        Path(a.json).write_text(text + "\n")
    print(text)
    return 1 if res["crash"] or res["hang"] else 0


if __name__ == "__main__":
    sys.exit(main())
