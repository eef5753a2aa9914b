"""ChildServer starts a real child command, waits until it is ready, and stops it; a child that
exits or never gets ready fails ``start()`` with a TransportError that says why. The tests' own
launcher (tests/forkserver.py, which conftest installs) forks a ``python -m`` child from a fork
server instead: it behaves as the exec'd one."""
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

import forkserver
from forkserver import ForkedProcess, can_fork
from splitlearn.procs import localserver
from splitlearn.api import protocol as P
from splitlearn.errors import TransportError
from splitlearn.procs.localserver import ChildServer, LocalServer, free_port


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


# -- the tests' fork server (tests/forkserver.py): python -m children forked, not exec'd -------

@pytest.fixture
def forked(monkeypatch):
    """ChildServer starts through the tests' launcher (whatever $SPLITLEARN_FORK_SERVERS says)."""
    monkeypatch.setattr(localserver, "launch", forkserver.launch)

TINY = ["--model", "tiny", "--cut", "1", "--cut", "3", "--threads", "2"]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def get(url: str, token=None) -> int:
    """The status of GET ``url`` (with a bearer ``token``)."""
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_forked_server_serves_its_token_and_checkpoints_on_sigterm(tmp_path, forked):
    srv = LocalServer([*TINY, "--checkpoint-dir", str(tmp_path)], env=ONE_THREAD).start()
    try:
        assert isinstance(srv.proc, ForkedProcess) and srv.proc.stdout is None
        assert srv.proc.poll() is None and srv.proc.returncode is None
        assert get(srv.url + P.HEALTH) == 200
        assert get(srv.url + P.INFO, srv.token) == 200  # the token came through env
        assert get(srv.url + P.INFO, "not-" + srv.token) == 401
        assert get(srv.url + P.INFO) == 401
    finally:
        code = srv.stop()
    assert code == 0, "SIGTERM: checkpoint, then exit 0"
    assert sorted(tmp_path.glob("server-*")), "no checkpoint written on SIGTERM"
    assert srv.stop() == 0 and srv.proc.wait(0) == 0


def test_a_forked_server_killed_says_minus_sigkill(forked):
    srv = LocalServer(TINY, env=ONE_THREAD).start()
    assert srv.kill() == -signal.SIGKILL
    assert srv.proc.poll() == -signal.SIGKILL


def test_a_forked_server_that_fails_at_start_quotes_its_stderr(forked):
    port = free_port()
    cmd = [sys.executable, "-m", "splitlearn.server", *TINY, "--port", str(port), "--no-such-flag"]
    srv = ChildServer(cmd, port, startup_timeout_s=60, capture_stderr=True)
    with pytest.raises(TransportError, match="exited with code 2(.|\n)*unrecognized arguments: --no-such-flag"):
        srv.start()
    assert isinstance(srv.proc, ForkedProcess)


PROBE = """\
import atexit, json, os, sys
atexit.register(lambda: print("atexit", flush=True))
print(json.dumps({"argv": sys.argv, "path": sys.path, "cwd": os.getcwd(), "name": __name__,
                  "probe": os.environ.get("PROBE"), "stdout_tty": sys.stdout.isatty()}))
if "torch" in sys.modules:  # forked: torch came preloaded
    print("threads", sys.modules["torch"].get_num_threads())
sys.exit(7)
"""


def test_a_forked_child_starts_as_python_dash_m_would(tmp_path, monkeypatch):
    """Same argv, sys.path, working directory, environment, atexit and exit code as exec'd;
    torch (preloaded) takes the child's OMP_NUM_THREADS."""
    (tmp_path / "probe_mod.py").write_text(PROBE)
    monkeypatch.chdir(tmp_path)
    cmd = [sys.executable, "-m", "probe_mod", "a", "b"]
    if forkserver.fork_server_env is None:  # start the fork server with this worker's environment
        assert ForkedProcess(cmd, dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).wait(60) == 7
    # the fork server's own environment: libraries imported by earlier tests (lm-eval, tokenizers)
    # set startup variables since, and a child that differs there is started afresh, not forked
    env = {**forkserver.fork_server_env, "PROBE": "p", **ONE_THREAD}
    with open(tmp_path / "forked.out", "wb") as out:
        assert ForkedProcess(cmd, env, stdout=out, stderr=out).wait(60) == 7
    exec_ = subprocess.run(cmd, env=env, capture_output=True, timeout=60)
    assert exec_.returncode == 7, exec_.stderr
    forked = (tmp_path / "forked.out").read_text().splitlines()
    assert forked[0] == exec_.stdout.decode().splitlines()[0]
    assert forked[1:] == ["threads 1", "atexit"]


def test_what_tests_write_into_the_environment_meanwhile_does_not_make_children_start_afresh(tmp_path, monkeypatch):
    """What libraries write into os.environ while tests run is set before the fork server starts
    (torch's inductor cache directory, which importing peft writes), or read only when used
    (TOKENIZERS_PARALLELISM, which a transformers pipeline writes): a server forked after that is
    still forked, not exec'd afresh (~9 CPU-seconds each)."""
    startup = {k: v for k, v in os.environ.items() if k.startswith(forkserver.STARTUP_ENV)}
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    cache_dir()  # what peft's import runs
    assert {k: v for k, v in os.environ.items() if k.startswith(forkserver.STARTUP_ENV)} == startup
    (tmp_path / "probe_mod.py").write_text(PROBE)
    monkeypatch.chdir(tmp_path)
    cmd = [sys.executable, "-m", "probe_mod"]
    if forkserver.fork_server_env is None:
        assert ForkedProcess(cmd, dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).wait(60) == 7
    parallelism = "true" if forkserver.fork_server_env.get("TOKENIZERS_PARALLELISM") == "false" else "false"
    env = {**forkserver.fork_server_env, "PROBE": "p", "TOKENIZERS_PARALLELISM": parallelism, **ONE_THREAD}
    with open(tmp_path / "forked.out", "wb") as out:
        assert ForkedProcess(cmd, env, stdout=out, stderr=out).wait(60) == 7
    assert (tmp_path / "forked.out").read_text().splitlines()[1:] == ["threads 1", "atexit"]  # torch preloaded


def test_fork_only_where_it_can_and_is_asked_to(monkeypatch):
    m, env = [sys.executable, "-m", "http.server"], dict(os.environ)
    assert can_fork(m) and can_fork(m, {**env, "OMP_NUM_THREADS": "1"}, subprocess.DEVNULL)
    assert not can_fork(m, stdout=subprocess.PIPE)  # a pipe to read: a subprocess
    assert not can_fork(m, {**env, "PYTHONPATH": "/x"})  # changes how the interpreter starts
    assert not can_fork([sys.executable, "-c", "pass"]) and not can_fork(["python3", "-m", "http.server"])
    monkeypatch.setattr(localserver, "launch", subprocess.Popen)  # the library's own: exec'd
    with http_server(free_port()) as srv:
        assert isinstance(srv.proc, subprocess.Popen)
    forkserver.install()  # what conftest does (monkeypatch puts the launcher back after)
    assert localserver.launch is forkserver.launch
    with http_server(free_port()) as srv:
        assert isinstance(srv.proc, ForkedProcess)
        with pytest.raises(subprocess.TimeoutExpired):
            srv.proc.wait(0.1)
    assert srv.proc.returncode == -signal.SIGTERM


def test_python_command_runs_a_script_or_module_whose_servers_fork_too(tmp_path, monkeypatch):
    """What a test runs in a subprocess that starts servers (the benchmarks) gets the launcher."""
    monkeypatch.delenv(forkserver.FORK_ENV, raising=False)
    (tmp_path / "probe_script.py").write_text(
        "import sys\nfrom splitlearn.procs import localserver\n"
        "print(localserver.launch.__module__, sys.argv[1:], __name__)\n")
    for args in ((str(tmp_path / "probe_script.py"), "x"), ("-m", "probe_script", "x")):
        cmd = forkserver.python_command(*args)
        assert cmd[:2] == [sys.executable, "-c"]
        out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split("\n")[0] == "forkserver ['x'] __main__"
    monkeypatch.setenv(forkserver.FORK_ENV, "0")
    assert forkserver.python_command("-m", "probe_script", "x") == [sys.executable, "-m", "probe_script", "x"]



def _report(conn) -> None:
    """A test's own child process (a target): who started it."""
    conn.send(os.getppid())


def test_process_context_forks_a_tests_target_from_the_fork_server(monkeypatch):
    """forkserver.process_context(): a target's process is forked by the fork server (its parent),
    not spawned by this process; with the tests' forking switched off, it is spawned."""
    monkeypatch.delenv(forkserver.FORK_ENV, raising=False)
    ctx = forkserver.process_context()
    assert ctx.get_start_method() == "forkserver"
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_report, args=(child,), daemon=True)
    p.start()
    child.close()
    assert parent.poll(120)
    ppid = parent.recv()
    p.join(60)
    assert p.exitcode == 0 and ppid not in (os.getpid(), 1)
    monkeypatch.setenv(forkserver.FORK_ENV, "0")
    assert forkserver.process_context().get_start_method() == "spawn"
