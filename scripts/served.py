"""What the load scripts share (``metrics_check.py``, ``pd_bench.py``): their command line (own
flags, then ``--`` and flags for ``oasiskv serve`` as is) and ``Server``, ``oasiskv serve`` in a
subprocess on a free loopback port. A bench preset runs with random weights (``--load-format
dummy``)."""
import argparse
import os
import socket
import subprocess
import sys
import time

import httpx


def parse(doc: str, requests: int, max_tokens: int, timeout: float,
          add=lambda parser: None):
    """(the script's arguments, the serve flags after ``--``): ``model``, ``--context``,
    ``--requests``, ``--max-tokens``, ``--timeout`` and what ``add`` adds."""
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--requests", type=int, default=requests)
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    add(parser)
    parser.add_argument("--timeout", type=float, default=timeout)
    return parser.parse_args(argv), extra


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``oasiskv serve args.model`` sized for ``args`` (context + max tokens, ``requests``
    sequences), with ``extra`` and ``flags``, on GPU ``gpu`` (``CUDA_VISIBLE_DEVICES``) when
    given; waits for /health (``RuntimeError`` when it exits or is not healthy in time)."""

    def __init__(self, args, extra: list[str], gpu: str | None = None, *flags: str):
        from oasiskv.models.loader import preset_names
        self.url = f"http://127.0.0.1:{_port()}"
        load = "dummy" if args.model in preset_names() else "auto"
        # (-P: the package comes from PYTHONPATH or the install, not the working directory, so
        # that a bench can serve another tree)
        cmd = [sys.executable, "-P", "-m", "oasiskv.cli", "--log-level", "WARNING", "serve",
               args.model, "--port", self.url.rsplit(":", 1)[1], "--load-format", load,
               "--max-model-len", str(args.context + args.max_tokens + 1),
               "--max-num-seqs", str(args.requests), *extra, *flags]
        env = dict(os.environ)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        self.proc = subprocess.Popen(cmd, env=env)
        deadline = time.monotonic() + args.timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("server not healthy in time")
            time.sleep(1)

    def metrics(self) -> dict[str, float]:
        """Samples by name, summed over labels but ``le`` (a histogram bucket: ``name{le}``)."""
        totals: dict[str, float] = {}
        for line in self.metrics_text().splitlines():
            if not line or line.startswith("#"):
                continue
            name, value = line.split("{")[0].split()[0], float(line.split()[-1])
            if 'le="' in line:
                name += "{" + line.split('le="')[1].split('"')[0] + "}"
            totals[name] = totals.get(name, 0.0) + value
        return totals

    def metrics_text(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
