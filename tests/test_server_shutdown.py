"""SIGTERM on a real `mtpllm serve` process: it stops accepting connections, lets the running
requests finish for up to --shutdown-timeout seconds, then cancels what is left and exits."""
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")

from server_proc import metric  # noqa: E402
from tiny import make_tiny  # noqa: E402

GRACE = 4.0  # --shutdown-timeout
CTX = 16384
LONG = 16000  # tokens: far more than GRACE seconds of generation at the measured speed (checked below)


def _stream(url, body, out: dict):
    out["lines"] = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out["lines"].append(line[6:])
    except httpx.HTTPError as exc:  # the connection closed mid-stream
        out["error"] = exc


def test_sigterm_drains_then_cancels(tiny_dir, serve_process):
    model = make_tiny(tiny_dir / "term.gguf", "qwen2", seed=9, ctx=CTX)
    srv = serve_process(model, "--shutdown-timeout", str(GRACE), ctx=CTX)
    try:
        # this machine's speed: the short request is sized to ~1 s of generation (done well within GRACE)
        t = httpx.post(srv.url + "/completion", json={"prompt": "x", "n_predict": 200, "ignore_eos": True},
                       timeout=120).json()["timings"]
        rate = t["predicted_per_second"]
        n_short = max(20, min(int(rate), 4000))
        if LONG / rate < 2 * GRACE:
            pytest.skip(f"this machine generates {rate:.0f} tokens/s: {LONG} tokens end before the deadline")
        short, long_ = {}, {}
        a = threading.Thread(target=_stream, args=(srv.url, {"prompt": "the cat", "max_tokens": n_short, "stream": True,
                                                             "ignore_eos": True, "temperature": 0}, short))
        a.start()
        while not short.get("lines"):
            time.sleep(0.01)
        b = threading.Thread(target=_stream, args=(srv.url, {"prompt": "a dog", "max_tokens": LONG, "stream": True,
                                                             "ignore_eos": True, "temperature": 0}, long_))
        b.start()
        t0 = time.monotonic()
        while metric(httpx.get(srv.url + "/metrics").text, "mtpllm_requests_waiting") < 1:  # b waits for a
            assert time.monotonic() - t0 < 30 and a.is_alive(), "the second request never queued"
            time.sleep(0.02)
        srv.terminate()
        t_term = time.monotonic()
        time.sleep(0.5)
        with pytest.raises(httpx.TransportError):  # no longer accepting
            httpx.get(srv.url + "/health", timeout=2)
        a.join(60)
        b.join(60)
        rc = srv.proc.wait(timeout=60)
        elapsed = time.monotonic() - t_term
    finally:
        srv.stop()
    # the running request was drained: complete, with its [DONE]
    assert short["lines"][-1] == "[DONE]" and "error" not in short
    assert len([x for x in short["lines"] if x != "[DONE]"]) >= 2
    # the one still going at the deadline was cancelled: no [DONE], far fewer than LONG tokens
    assert "[DONE]" not in long_["lines"] and len(long_["lines"]) < LONG
    # uvicorn re-raises the signal once it has shut down: the exit status says "ended by SIGTERM"
    assert rc in (0, -15) and GRACE - 0.5 <= elapsed < GRACE + 20, (rc, elapsed, srv.log())
    assert "timeout graceful shutdown exceeded" in srv.log()
