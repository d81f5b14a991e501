"""``ServerProcess``: ``oasiskv serve`` (the real CLI) as a subprocess on a free loopback port.

It starts the server, waits for ``/health``, reads ``/metrics`` and stops it with a signal.
``assert_openai_error`` checks an error answer's status and OpenAI shape.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

NUM_KV_BLOCKS = 512
MAX_MODEL_LEN = 2048


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, log_path: Path, *flags: str, env: dict | None = None):
        self.log_path = log_path
        for attempt in range(3):  # the free port may be taken before the server binds it (e.g.
            self.port = free_port()  # by another process's NIXL listener): then another one
            self.url = f"http://127.0.0.1:{self.port}"
            cmd = [sys.executable, "-m", "oasiskv.cli", "--log-level", "WARNING", "serve",
                   "--port", str(self.port), "--max-model-len", str(MAX_MODEL_LEN),
                   "--num-kv-blocks", str(NUM_KV_BLOCKS), *flags]
            self.log = open(log_path, "w")
            self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **(env or {})})
            try:
                self._wait_healthy()
                return
            except RuntimeError:
                if attempt == 2 or "address already in use" not in log_path.read_text():
                    raise
                self.log.close()

    def _wait_healthy(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n"
                                   f"{self.log_path.read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout}s:\n{self.log_path.read_text()}")

    def stop(self, sig: int = signal.SIGINT, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of ``/metrics`` by name."""
        text = httpx.get(self.url + "/metrics", timeout=5.0).text
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                if line and not line.startswith("#") and "{" not in line}

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """Poll until no request runs or waits and every KV block is free; returns the last
        metrics."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m["oasiskv_num_requests_running"] == 0 and m["oasiskv_num_requests_waiting"] == 0
                    and m["oasiskv_kv_blocks_free"] == m["oasiskv_kv_blocks_total"]):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout}s: {m}")
            time.sleep(0.05)


def assert_openai_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error
