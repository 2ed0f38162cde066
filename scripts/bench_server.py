"""Concurrent clients against a running server: aggregate and per-stream decode tok/s and time to
first token, at several client counts. Works with `mtpllm serve` and llama.cpp's `llama-server`
alike (both speak llama.cpp's `/apply-template` and streaming `/completion`).

    python scripts/bench_server.py --url http://127.0.0.1:8080 --clients 1,2,4,8 -n 128 --requests 2

Every client sends `--requests` different coding prompts one after another (chat template applied
by the server itself, greedy, `n_predict` tokens, EOS ignored so every answer has the same length);
all clients of a round start together. Aggregate tok/s = all generated tokens / the round's wall
time; per-stream tok/s = a request's tokens after the first / the time from its first to its last
token (as the client receives them); server tok/s = the decode rate the server reports in its
timings; TTFT = request sent -> first token. Prints a markdown table, or JSON with --json.
With --sustained SECONDS the clients instead send requests back to back for that long (steady load:
a burst's last requests, which run with fewer sequences beside them, do not weigh in).
"""
import argparse
import json
import statistics
import threading
import time

import httpx

from mtpllm.bench.workloads import code_prompts


def template(client: httpx.Client, url: str, prompt: str) -> str:
    r = client.post(f"{url}/apply-template", json={"messages": [{"role": "user", "content": prompt}]})
    r.raise_for_status()
    return r.json()["prompt"]


def one_request(client: httpx.Client, url: str, prompt: str, n: int) -> dict:
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "stream": True, "ignore_eos": True,
            "cache_prompt": True}
    t0 = time.perf_counter()
    first = last = server_tps = None
    tokens = 0
    # a fresh connection per request: a server may close a kept-alive one after a stream
    with client.stream("POST", f"{url}/completion", json=body, headers={"Connection": "close"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if chunk.get("content") and first is None:
                first = now
            if chunk.get("content"):
                last = now
            if chunk.get("stop"):
                tokens = int(chunk.get("tokens_predicted") or chunk.get("timings", {}).get("predicted_n") or 0)
                server_tps = chunk.get("timings", {}).get("predicted_per_second")
    first = first or time.perf_counter()
    last = last or first
    return {"ttft": first - t0, "tokens": tokens, "decode_s": last - first, "wall": time.perf_counter() - t0,
            "server_tps": server_tps}


def run_round(url: str, prompts: list[list[str]], n: int) -> dict:
    results: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(len(prompts))

    def client_main(ps):
        with httpx.Client(timeout=600) as c:
            barrier.wait()
            for p in ps:
                try:
                    res = one_request(c, url, p, n)
                except Exception as exc:  # report, do not hide: a failed request spoils the round
                    with lock:
                        errors.append(repr(exc))
                    return
                with lock:
                    results.append(res)

    threads = [threading.Thread(target=client_main, args=(ps,)) for ps in prompts]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"{len(errors)} request(s) failed: {errors[0]}")
    per_stream = [(r["tokens"] - 1) / r["decode_s"] for r in results if r["decode_s"] > 0 and r["tokens"] > 1]
    return {"clients": len(prompts), "requests": len(results), "tokens": sum(r["tokens"] for r in results),
            "wall_s": wall, "aggregate_tps": sum(r["tokens"] for r in results) / wall,
            "per_stream_tps": statistics.mean(per_stream) if per_stream else 0.0,
            "ttft_s_mean": statistics.mean(r["ttft"] for r in results),
            "ttft_s_max": max(r["ttft"] for r in results),
            # the decode rate each server reports for its own requests (llama.cpp's timings.predicted_per_second)
            "server_tps": statistics.mean(r["server_tps"] for r in results) if all(
                r["server_tps"] for r in results) else None}


def run_sustained(url: str, texts: list[str], n_clients: int, n: int, seconds: float) -> dict:
    """Every client sends requests back to back (cycling through the prompts) for `seconds`: the
    server is kept at n_clients sequences, as under steady load, so the figure does not depend on
    how a burst of requests ends. Aggregate = tokens streamed within the window / the window; a
    request still running at the end is closed (the server cancels it)."""
    counts = [0] * n_clients
    errors: list[str] = []
    barrier = threading.Barrier(n_clients + 1)
    t0 = [0.0]

    def client_main(c: int):
        body = {"n_predict": n, "temperature": 0, "stream": True, "ignore_eos": True, "cache_prompt": True}
        with httpx.Client(timeout=600) as cl:
            barrier.wait()
            i = 0
            while time.perf_counter() < t0[0] + seconds:
                prompt = texts[(c * 7 + i) % len(texts)]
                i += 1
                try:
                    with cl.stream("POST", f"{url}/completion", json=dict(body, prompt=prompt),
                                   headers={"Connection": "close"}) as r:
                        r.raise_for_status()
                        for line in r.iter_lines():
                            if time.perf_counter() >= t0[0] + seconds:
                                return
                            if line.startswith("data: ") and json.loads(line[6:]).get("content"):
                                counts[c] += 1
                except Exception as exc:  # noqa: BLE001 - reported below
                    errors.append(repr(exc))
                    return

    threads = [threading.Thread(target=client_main, args=(c,)) for c in range(n_clients)]
    for t in threads:
        t.start()
    t0[0] = time.perf_counter()
    barrier.wait()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(f"{len(errors)} request(s) failed: {errors[0]}")
    return {"clients": n_clients, "seconds": seconds, "tokens": sum(counts), "sustained_tps": sum(counts) / seconds}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--clients", default="1,2,4,8", help="client counts, comma-separated")
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--requests", type=int, default=2, help="requests per client per round")
    ap.add_argument("--label", default="", help="a name for this server in the output")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--sustained", type=float, default=0, metavar="SECONDS",
                    help="instead of rounds: clients send requests back to back for SECONDS (steady load)")
    a = ap.parse_args()
    url = a.url.rstrip("/")
    counts = [int(c) for c in a.clients.split(",")]
    base = code_prompts()
    with httpx.Client(timeout=60) as c:
        texts = [template(c, url, p) for p in base[: max(counts) * a.requests]]
        # warm-up with as many clients as the largest round, on prompts outside the set: a server's
        # first batched steps (kernel choice, speculation's cost tables) are not timed
        warm = [[template(c, url, f"Say hello to user {i}.")] for i in range(max(counts))]
    run_round(url, warm, 16)
    if a.sustained > 0:
        rows = [dict(run_sustained(url, texts, c, a.n_predict, a.sustained), label=a.label) for c in counts]
        for row in rows if not a.json else []:
            print(f"| {a.label} | {row['clients']} | {row['sustained_tps']:.1f} sustained |", flush=True)
        if a.json:
            print(json.dumps(rows, indent=1))
        return
    rows = []
    for n_clients in counts:
        ps = [[texts[(i * a.requests + j) % len(texts)] for j in range(a.requests)] for i in range(n_clients)]
        row = run_round(url, ps, a.n_predict)
        row["label"] = a.label
        rows.append(row)
        if not a.json:
            server = f"{row['server_tps']:.1f}" if row["server_tps"] else "-"
            print(f"| {a.label} | {n_clients} | {row['aggregate_tps']:.1f} | {row['per_stream_tps']:.1f} | {server} | "
                  f"{row['ttft_s_mean']:.2f} | {row['ttft_s_max']:.2f} |", flush=True)
    if a.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
