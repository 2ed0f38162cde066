"""`mtpllm serve` as a real process on loopback, for the end-to-end server tests (started through
the `serve_process` fixture of conftest.py, which stops them at the end of the module)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`mtpllm serve -m MODEL ARGS...` in a child process on a free loopback port (the default bind),
    its output in a log file under `log_dir`; ready once /health answers. `threads`: -t (None: the
    server's default); `timeout`: seconds to wait for it to start."""

    def __init__(self, model, *args: str, log_dir: Path, ctx: int = 512, env: dict | None = None,
                 threads: int | None = 1, timeout: float = 180):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"serve-{self.port}.log"
        self._log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "mtpllm", "serve", "-m", str(model), "-c", str(ctx),
               *(["-t", str(threads)] if threads else []), "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        deadline = time.monotonic() + timeout  # a cold start may build the CPU kernels
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mtpllm serve did not start:\n{self.log()}")
            time.sleep(0.2)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def metric(text: str, name: str, **labels) -> float:
    """The value of one sample of a Prometheus text exposition (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def metric_sum(text: str, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))
