"""ChildServer starts a real child command, waits until it is ready, and stops it; a child that
exits or never gets ready fails ``start()`` with a TransportError that says why."""
import signal
import subprocess
import sys
import urllib.request

import pytest

from splitlearn.errors import TransportError
from splitlearn.localserver import ChildServer, free_port


def http_server(port: int, **kw) -> ChildServer:
    """``python -m http.server`` on 127.0.0.1:port, ready when GET / answers."""
    cmd = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    return ChildServer(cmd, port, health="/", startup_timeout_s=20, **kw)


def test_starts_answers_and_stops_with_sigterm():
    port = free_port()
    with http_server(port) as srv:
        assert srv.url == f"http://127.0.0.1:{port}"
        assert srv.proc.poll() is None
        with urllib.request.urlopen(srv.url + "/", timeout=5) as r:
            assert r.status == 200
    assert srv.proc.returncode == -signal.SIGTERM
    assert srv.stop() == -signal.SIGTERM  # stopping again just says how it ended


def test_kill_sends_sigkill():
    srv = http_server(free_port()).start()
    assert srv.kill() == -signal.SIGKILL


def test_a_child_that_exits_at_once_names_its_exit_code_and_stderr():
    cmd = [sys.executable, "-c", "import sys; sys.stderr.write('no model here'); sys.exit(3)"]
    srv = ChildServer(cmd, free_port(), startup_timeout_s=20, capture_stderr=True)
    with pytest.raises(TransportError, match="exited with code 3(.|\n)*no model here"):
        srv.start()
    assert srv.stderr_tail() == ""  # start() cleaned up after itself


def test_a_child_that_never_gets_ready_times_out_and_is_stopped():
    cmd = [sys.executable, "-c", "import time; time.sleep(60)"]
    srv = ChildServer(cmd, free_port(), startup_timeout_s=1)
    with pytest.raises(TransportError, match="did not answer .* within 1s"):
        srv.start()
    assert srv.proc.returncode == -signal.SIGTERM


class LineReady(ChildServer):
    """Ready once the child prints READY: a readiness check other than HTTP."""

    def ready(self) -> bool:
        return self.proc.stdout.readline().strip() == b"READY"


def test_ready_can_be_overridden():
    cmd = [sys.executable, "-u", "-c", "import time; print('starting'); print('READY'); time.sleep(60)"]
    with LineReady(cmd, free_port(), startup_timeout_s=20, stdout=subprocess.PIPE) as srv:
        assert srv.proc.poll() is None
    assert srv.proc.returncode == -signal.SIGTERM
