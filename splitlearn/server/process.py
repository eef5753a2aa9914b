"""``LocalServer``: run ``python -m splitlearn.server`` as a child process (demo, benchmarks).

    with LocalServer(["--model", "tiny", "--cut", "1", "--cut", "3"]) as srv:
        client = SplitClient(srv.url, "tiny", token=srv.token)

The server gets a fresh random token and a free loopback port; leaving the block sends
SIGTERM (the server checkpoints if it has a --checkpoint-dir) and waits for it.
"""
from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Optional, Sequence


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    def __init__(self, args: Sequence[str], *, port: Optional[int] = None, token: Optional[str] = None,
                 startup_timeout_s: float = 120.0, quiet: bool = True, env: Optional[dict] = None):
        self.args = list(args)
        self.port = port or free_port()
        self.token = token or secrets.token_urlsafe(16)
        self.url = f"http://127.0.0.1:{self.port}"
        self.startup_timeout_s = startup_timeout_s
        self.quiet = quiet
        self.env = env or {}
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> "LocalServer":
        env = {**os.environ, **self.env, "SPLITLEARN_TOKEN": self.token}
        cmd = [sys.executable, "-m", "splitlearn.server", *self.args, "--host", "127.0.0.1",
               "--port", str(self.port)] + (["--log-level", "WARNING"] if self.quiet else [])
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL if self.quiet else None)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode}: {' '.join(cmd)}")
            try:
                with urllib.request.urlopen(self.url + "/v1/health", timeout=1):
                    return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server did not answer on {self.url} within {self.startup_timeout_s}s")

    def stop(self, timeout_s: float = 30.0) -> Optional[int]:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.terminate()
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self) -> "LocalServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
