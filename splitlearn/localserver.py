"""Servers as child processes on loopback, for the demo, the tests and the benchmarks.

    with LocalServer(["--model", "tiny", "--cut", "1", "--cut", "3"]) as srv:
        client = SplitClient(srv.url, "tiny", token=srv.token)

:class:`ChildServer` starts any command that serves HTTP on a port, waits until a health URL
answers, and on leaving the block sends SIGTERM and waits (SIGKILL after a timeout).
:class:`LocalServer` is ``python -m splitlearn.server`` with a fresh random token and a free
loopback port (it checkpoints on SIGTERM if it has a --checkpoint-dir). This module imports
neither Flask nor the server package.
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

from . import protocol as P
from .errors import TransportError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ChildServer:
    """A child process serving HTTP on ``port`` of 127.0.0.1; ready when ``health`` answers."""

    def __init__(self, cmd: Sequence[str], port: int, *, health: str = P.HEALTH,
                 startup_timeout_s: float = 120.0, quiet: bool = True, env: Optional[dict] = None):
        self.cmd = list(cmd)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.health = health
        self.startup_timeout_s = startup_timeout_s
        self.quiet = quiet
        self.env = env or {}
        self.proc: Optional[subprocess.Popen] = None

    def start(self):
        self.proc = subprocess.Popen(self.cmd, env={**os.environ, **self.env}, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL if self.quiet else None)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise TransportError(f"server exited with code {self.proc.returncode}: {' '.join(self.cmd)}")
            try:
                with urllib.request.urlopen(self.url + self.health, timeout=1):
                    return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise TransportError(f"server did not answer on {self.url} within {self.startup_timeout_s}s")

    def stop(self, timeout_s: float = 30.0) -> Optional[int]:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL; the exit code (None if never started)."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.terminate()
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def kill(self) -> int:
        """SIGKILL now (a crash, for recovery tests); the exit code."""
        assert self.proc is not None, "not started"
        self.proc.kill()
        return self.proc.wait()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class LocalServer(ChildServer):
    """``python -m splitlearn.server ARGS`` on a free loopback port with a fresh token."""

    def __init__(self, args: Sequence[str], *, port: Optional[int] = None, token: Optional[str] = None,
                 startup_timeout_s: float = 120.0, quiet: bool = True, env: Optional[dict] = None):
        self.args = list(args)
        self.token = token or secrets.token_urlsafe(16)
        port = port or free_port()
        cmd = [sys.executable, "-m", "splitlearn.server", *self.args, "--host", "127.0.0.1",
               "--port", str(port)] + (["--log-level", "WARNING"] if quiet else [])
        super().__init__(cmd, port, startup_timeout_s=startup_timeout_s, quiet=quiet,
                         env={**(env or {}), "SPLITLEARN_TOKEN": self.token})
