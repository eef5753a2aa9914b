"""Servers as child processes on loopback, for the demo, the tests and the benchmarks.

    with LocalServer(["--model", "tiny", "--cut", "1", "--cut", "3"]) as srv:
        client = SplitClient(srv.url, "tiny", token=srv.token)

:class:`ChildServer` starts any command that serves HTTP on a port, waits until a health URL
answers (or whatever readiness check a subclass's ``ready()`` makes), and on leaving the block
sends SIGTERM and waits (SIGKILL after a timeout).
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
import tempfile
import time
import urllib.request
from typing import IO, Optional, Sequence

from ..api import protocol as P
from ..errors import TransportError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: How every :class:`ChildServer` starts its command: ``launch(cmd, env=..., stdout=...,
#: stderr=...)`` returns a ``subprocess.Popen``, or an object with the same ``pid``, ``stdout``,
#: ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate`` and ``kill``. The tests
#: replace it with one that forks ``python -m`` children from a preloaded interpreter
#: (tests/forkserver.py); everything else starts a plain subprocess.
launch = subprocess.Popen


class ChildServer:
    """A child process serving HTTP on ``port`` of 127.0.0.1; ready when ``health`` answers.

    :meth:`ready` says whether the child is ready (default: a GET on ``health`` answers 2xx); a
    subclass whose child signals readiness otherwise (a line on stdout) overrides it, with
    ``stdout=subprocess.PIPE`` to read that line from ``self.proc.stdout``. ``capture_stderr``
    keeps the child's stderr in a temporary file, whose tail (:meth:`stderr_tail`) the errors
    of :meth:`start` then quote; otherwise stderr is dropped (``quiet``) or inherited. The
    child starts through :data:`launch`.
    """

    def __init__(self, cmd: Sequence[str], port: int, *, health: str = P.HEALTH,
                 startup_timeout_s: float = 120.0, quiet: bool = True, env: Optional[dict] = None,
                 stdout: Optional[int] = subprocess.DEVNULL, capture_stderr: bool = False):
        self.cmd = list(cmd)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.health = health
        self.startup_timeout_s = startup_timeout_s
        self.quiet = quiet
        self.env = env or {}
        self.stdout = stdout
        self.capture_stderr = capture_stderr
        self.proc: Optional[subprocess.Popen] = None  # or what launch() returned
        self._stderr: Optional[IO[bytes]] = None

    def start(self):
        """Start the child and wait until :meth:`ready`; stop it and raise TransportError if it
        exits first or is not ready within ``startup_timeout_s``."""
        self._spawn()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self) -> None:
        """Start the child process (a subclass may start it otherwise)."""
        self._stderr = tempfile.TemporaryFile() if self.capture_stderr else None
        stderr = self._stderr or (subprocess.DEVNULL if self.quiet else None)
        self.proc = launch(self.cmd, env={**os.environ, **self.env}, stdout=self.stdout, stderr=stderr)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise TransportError(f"server exited with code {self.proc.returncode}: {' '.join(self.cmd)}"
                                     + self._quoted_stderr())
            if self.ready():
                return
            time.sleep(0.1)
        raise TransportError(f"server did not answer on {self.url} within {self.startup_timeout_s}s: "
                             f"{' '.join(self.cmd)}" + self._quoted_stderr())

    def ready(self) -> bool:
        """Whether the started child is ready to serve: here, a GET on ``health`` answers 2xx."""
        try:
            with urllib.request.urlopen(self.url + self.health, timeout=1):
                return True
        except OSError:
            return False

    def stderr_tail(self, chars: int = 2000) -> str:
        """The last ``chars`` characters of the child's stderr ("" unless ``capture_stderr``)."""
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-chars:]

    def _quoted_stderr(self) -> str:
        tail = self.stderr_tail()
        return f"\n{tail}" if tail else ""

    def stop(self, timeout_s: float = 30.0) -> Optional[int]:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL; the exit code (None if never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._close_pipes()
        return self.proc.returncode

    def _close_pipes(self) -> None:
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def kill(self) -> int:
        """SIGKILL now (a crash, for recovery tests); the exit code."""
        assert self.proc is not None, "not started"
        self.proc.kill()
        code = self.proc.wait()
        self._close_pipes()
        return code

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
