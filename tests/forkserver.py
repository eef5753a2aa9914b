"""Test servers forked from a preloaded interpreter instead of exec'd (the tests' speed only).

A fresh ``python -m splitlearn.server`` spends ~9 CPU-seconds importing torch and transformers
before it serves, and a test run starts dozens. :func:`install` (conftest.py calls it unless
``SPLITLEARN_FORK_SERVERS=0``) makes :data:`splitlearn.procs.localserver.launch` start a child
``[sys.executable, "-m", MODULE, ARGS...]`` from a process that imported the server package
once (:data:`PRELOAD`): multiprocessing's "forkserver", one per process that uses it (one per
pytest-xdist worker), started on first use, gone when that process exits. It is a fresh
interpreter of its own, never a fork of the caller, so the caller's threads (torch's pools,
other servers) do not matter. The child (:func:`_run_as_main`) then does what ``python -m``
does: the caller's working directory and environment, ``sys.argv``, a fresh interpreter's
``sys.path``, the module run as ``__main__`` (runpy), the ``atexit`` handlers, its exit code;
its stdout and stderr are the caller's open files, passed over the fork server's socket as a
subprocess inherits them (stdin is /dev/null). :class:`ForkedProcess` is its
``subprocess.Popen`` (pid, poll, wait, returncode: minus the signal that killed it, signals).

Where forking cannot match an exec it is not done: another command, ``stdout=PIPE``, or an
environment whose ``PYTHON*`` variables differ from this process's start as a subprocess; a
child whose environment differs from the fork server's in a variable read when the interpreter
or a preloaded library starts (:data:`STARTUP_ENV`) exec's ``python -m`` in the forked process
(same pid, only slower), save torch's thread count (:data:`THREAD_ENV`).

Why multiprocessing's fork server, not one of our own: it already starts a clean preloaded
interpreter, forks on request, passes open files and reports exit statuses; one step of its
launch is changed (:class:`_Popen`), the rest is ``python -m``'s set-up, done in the child.
The child imports this module (to unpickle its target) from the caller's ``sys.path``, which
multiprocessing gives it, with this module's directory added, then takes a fresh interpreter's.

:func:`python_command` is ``[sys.executable, ARGS...]`` for a script or module run by a test in
a subprocess of its own that starts servers itself (the benchmarks, the demo): it forks them too.
"""
from __future__ import annotations

import atexit
import json
import os
import runpy
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional, Sequence, Union

from splitlearn.procs import localserver, openmp

FORK_ENV = "SPLITLEARN_FORK_SERVERS"  # "0": the tests' servers start as plain subprocesses

# What the fork server imports once: what ``python -m splitlearn.server`` imports (its __main__
# -> .http.cli; serve() -> .http.app, .http.frontdoor, ..idlepoll) and the fed server (its state
# and its app). A module that fails to import is skipped by multiprocessing; a child then imports
# it itself (slower, same result). The children run the code as it was when the fork server started: edits after
# that go unseen.
PRELOAD = ("splitlearn.procs.localserver", "splitlearn.server.http.cli", "splitlearn.server.http.app",
           "splitlearn.server.http.frontdoor", "splitlearn.procs.idlepoll", "splitlearn.server.federation.fedserver",
           "splitlearn.server.http.fedapp", "requests")  # requests: every client child (0.5 s of imports each)

# Environment variables read when an interpreter or the preloaded libraries start (glibc's
# malloc, OpenBLAS, libgomp, MKL, huggingface_hub's paths and switches, the locale...), not
# when they are first used: where a forked child's value differs from the fork server's, it
# exec's a fresh ``python -m`` (same process), except for torch's thread count (below).
STARTUP_ENV = ("PYTHON", "LD_", "MALLOC_", "GLIBC_", "LC_", "LANG", "HOME", "TZ", "TMP", "TEMP",
               "XDG_", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "GOTO", "HF_", "HUGGINGFACE_",
               "TRANSFORMERS_", "TOKENIZERS_", "TORCH", "PYTORCH_", "CUDA_", "NCCL_")
# torch sizes its intra-op pool when imported, from these (MKL's order: the first set wins;
# neither: one per core). A child asking for n threads where the fork server has m >= n
# gets torch.set_num_threads(n): what a fresh import would have picked, as n is under the cap
# that made m. Anything else starts fresh. (numpy's OpenBLAS keeps the fork server's count.)
THREAD_ENV = ("MKL_NUM_THREADS", "OMP_NUM_THREADS")
# Under those prefixes but read each time they are used, from the process's environment (which the
# forked child's os.environ sets): a child whose value differs needs no fresh start. The Hugging Face
# tokenizers' switch is one that tests set meanwhile: a transformers pipeline or an lm-eval run
# writes TOKENIZERS_PARALLELISM=false into os.environ, and every server forked after that in the
# worker exec'd afresh (~9 CPU-seconds each).
USE_TIME_ENV = ("TOKENIZERS_PARALLELISM",)

_fork_lock = threading.Lock()
_fork_ctx = None
#: the environment the fork server started with (its children whose startup variables differ from
#: it start afresh: :func:`_start_plan`); None until the first forked child starts it
fork_server_env: Optional[dict] = None
#: a fresh ``python -m``'s sys.path after its first entry (the working directory); set with the fork server
_fresh_path: Optional[list] = None


def can_fork(cmd: Sequence[str], env: Optional[dict] = None, stdout=None) -> bool:
    """Whether ``cmd`` (with the environment ``env``, default this process's, and ``stdout``)
    can start forked: it is ``[sys.executable, "-m", MODULE, ...]``, stdout is not a pipe to
    read, ``env``'s ``PYTHON*`` variables are this process's, and this platform has a fork server."""
    env = os.environ if env is None else env
    return (len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-m" and bool(cmd[2])
            and not cmd[2].startswith("-") and stdout != subprocess.PIPE
            and not any(k.startswith("PYTHON") and env.get(k) != os.environ.get(k) for k in {*env, *os.environ})
            and _ForkServerProcess is not object)


def launch(cmd: Sequence[str], env: Optional[dict] = None, stdout=None, stderr=None):
    """:data:`splitlearn.procs.localserver.launch` for the tests: forked where :func:`can_fork`, else
    ``subprocess.Popen``."""
    if can_fork(cmd, env, stdout):
        return ForkedProcess(cmd, dict(os.environ if env is None else env), stdout=stdout, stderr=stderr)
    return subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr)


def run_module(folder: Path, module: str, args: Sequence[str], env: Optional[dict] = None,
               timeout: float = 600) -> int:
    """``python -m module *args`` started in ``folder`` (where the caller wrote the module), through
    ``localserver.launch`` (forked where :func:`install` made it so), run to its exit -> its exit code;
    its output in ``folder / "stdout"`` and ``folder / "stderr"``."""
    cwd = os.getcwd()
    with open(folder / "stdout", "w") as stdout, open(folder / "stderr", "w") as stderr:
        os.chdir(folder)  # python -m MODULE: the child starts in this directory
        try:
            proc = localserver.launch([sys.executable, "-m", module, *args], env=env, stdout=stdout, stderr=stderr)
        finally:
            os.chdir(cwd)
        try:
            return proc.wait(timeout)
        finally:
            proc.kill()


# What libraries write into os.environ when imported: scikit-learn and joblib (imported by some
# tests through lm-eval and datasets) ``setdefault`` these Intel OpenMP switches. Imported after the
# fork server started, they made every later child's environment differ from its own, so each
# started fresh (~9 CPU-seconds: the journal tests took 13-15 s instead of 2-3 s in a suite run).
# Set before the fork server starts, the import changes nothing. (torch's CPU build runs GNU
# OpenMP, which reads neither.)
# Likewise torch's inductor writes its cache directory (TORCHINDUCTOR_CACHE_DIR, under the "TORCH"
# prefix) when first used, which importing peft does (LoRA tests, lazily): every server forked after
# that in the worker exec'd afresh (the journal tests took 30-40 s instead of 2-3 s in a suite run).
# It is set here to the value torch itself would write (:func:`_inductor_cache_dir`).
IMPORT_ENV = {"KMP_DUPLICATE_LIB_OK": "True", "KMP_INIT_AT_FORK": "FALSE"}


def _inductor_cache_dir() -> Optional[str]:
    """The directory torch's inductor puts in ``TORCHINDUCTOR_CACHE_DIR`` when first used, by torch's
    own function, loaded from its file alone (importing ``torch._inductor`` costs ~2 s); None if
    this torch has no such file."""
    import importlib.util

    import torch

    path = Path(torch.__file__).parent / "_inductor" / "runtime" / "cache_dir_utils.py"
    try:
        spec = importlib.util.spec_from_file_location("_forkserver_inductor_cache_dir", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return os.path.abspath(module.default_cache_dir())
    except Exception:  # noqa: BLE001 - another torch: the children may start fresh, slower, same result
        return None


def install() -> None:
    """Every ChildServer (LocalServer, the relay, ...) of this process starts through :func:`launch`."""
    for k, v in IMPORT_ENV.items():
        os.environ.setdefault(k, v)
    # `import splitlearn` before torch sets libgomp's spin in os.environ (splitlearn/procs/openmp.py):
    # the fork server's preload does; this process, whose torch came first, did not. Unequal, every
    # forked child exec'd afresh (a suite run took 1130 s instead of ~500 s).
    openmp.spin_env()
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ and (cache := _inductor_cache_dir()) is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    localserver.launch = launch


def prestart() -> None:
    """Start the fork server now, with os.environ as it is now, rather than at the first forked
    child: its preload (~9 CPU-seconds of imports) runs in its own process while this one goes on
    (conftest.py calls it in ``make test``'s serial phase, whose collection it then overlaps on
    the other core), and the first child waits only for what is left of it. Nothing where the
    tests' servers are not forked."""
    global fork_server_env
    if os.environ.get(FORK_ENV, "1") != "1" or _ForkServerProcess is object:
        return
    from multiprocessing import forkserver

    _context()
    with _fork_lock:
        if fork_server_env is None:  # as ForkedProcess: the environment the fork server starts with
            fork_server_env = dict(os.environ)
    forkserver.ensure_running()


BOOT = ("import runpy, sys; sys.path.insert(0, {tests!r}); import forkserver; forkserver.install(); "
        "del sys.path[0]; sys.argv = {argv!r}; ")


def process_context():
    """The multiprocessing context for a test's own child processes (``ctx.Process(target=...)``):
    this module's fork server's, whose children start with torch, transformers and the server
    package imported (~9 CPU-seconds less each than "spawn"); "spawn" where the tests' servers are
    not forked (``SPLITLEARN_FORK_SERVERS=0``) or there is no fork server. As with "spawn", the
    target and its arguments are pickled and the child imports the caller's ``__main__`` and
    ``sys.path``; unlike it, the child's environment is the fork server's (os.environ when it
    started) and torch's thread count the fork server's: a child that needs one thread sets it."""
    import multiprocessing

    if os.environ.get(FORK_ENV, "1") != "1" or _ForkServerProcess is object:
        return multiprocessing.get_context("spawn")
    ctx = _context()
    global fork_server_env
    if fork_server_env is None:  # as ForkedProcess: this start launches it, with os.environ as it is now
        fork_server_env = dict(os.environ)
    return ctx


def python_command(*args: str) -> list[str]:
    """``[sys.executable, *args]`` (``SCRIPT ARGS...`` or ``-m MODULE ARGS...``), run so that the
    servers it starts through ChildServer are forked as the tests' own are."""
    if os.environ.get(FORK_ENV, "1") != "1":
        return [sys.executable, *args]
    tests = str(Path(__file__).resolve().parent)
    if args[0] == "-m":
        code = BOOT.format(tests=tests, argv=["-m", *args[2:]]) + (
            f"runpy.run_module({args[1]!r}, run_name='__main__', alter_sys=True)")
    else:
        code = BOOT.format(tests=tests, argv=list(args)) + (
            f"sys.path.insert(0, {str(Path(args[0]).resolve().parent)!r}); "
            f"runpy.run_path({args[0]!r}, run_name='__main__')")
    return [sys.executable, "-c", code]


# -- the fork server -----------------------------------------------------------------------

def _context():
    """The multiprocessing forkserver context, preloading :data:`PRELOAD` (set once)."""
    global _fork_ctx, _fresh_path
    with _fork_lock:
        if _fork_ctx is None:
            import multiprocessing

            _fresh_path = json.loads(subprocess.run(
                [sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
                capture_output=True, text=True, check=True, timeout=60).stdout)
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(list(PRELOAD))
            _fork_ctx = ctx
        return _fork_ctx


class _Fd:
    """An open file descriptor of the caller, for the forked child: multiprocessing sends it
    over the fork server's socket when it pickles the child's arguments; the child gets an int."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return _Fd._detach, (reduction.DupFd(self.fd),)

    @staticmethod
    def _detach(dup) -> int:
        return dup.detach()


def _start_plan(env: dict) -> Optional[int]:
    """In a forked child, before it takes ``env``: the torch threads to set for it to start as a
    fresh ``python -m`` would (None: nothing to set); -1 if it must start fresh."""
    if any(k.startswith(STARTUP_ENV) and k not in THREAD_ENV + USE_TIME_ENV and env.get(k) != os.environ.get(k)
           for k in set(env) | set(os.environ)):
        return -1
    if all(env.get(k) == os.environ.get(k) for k in THREAD_ENV) or "torch" not in sys.modules:
        return None  # the same threads, or torch not imported yet: it reads env when it is
    value = next((env[k] for k in THREAD_ENV if k in env), "")
    n = int(value) if value.strip().isdigit() else 0
    return n if 0 < n <= sys.modules["torch"].get_num_threads() else -1


def _run_as_main(cmd: list, env: dict, cwd: str, path: list, stdout: Union[int, str], stderr: Union[int, str]):
    """In the forked child: become ``cmd`` = ``python -m MODULE ARGS`` and run it to its exit
    (``path``: a fresh interpreter's sys.path after its first entry)."""
    import multiprocessing

    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    for target, fd in ((stdout, 1), (stderr, 2)):
        src = os.open(target, os.O_WRONLY) if isinstance(target, str) else target
        if src != fd:
            os.dup2(src, fd)
            os.close(src)
    os.chdir(cwd)
    threads = _start_plan(env)
    if threads == -1:  # a fresh interpreter after all, in this process (as Popen, no other fds)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        os.execve(cmd[0], cmd, env)
    os.environ.clear()
    os.environ.update(env)
    if threads is not None:
        sys.modules["torch"].set_num_threads(threads)
    if sys.stdout is not None:  # python -m buffers stdout by lines on a terminal only
        sys.stdout.reconfigure(line_buffering=sys.stdout.isatty())
    me = multiprocessing.current_process()
    me.name, me.daemon = "MainProcess", False  # as the main process of its own interpreter
    sys.argv = ["-m", *cmd[3:]]  # runpy puts the module's path first, as python -m does
    sys.path[:] = [os.getcwd(), *path]
    interrupted = False
    try:
        runpy.run_module(cmd[2], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code
    except BaseException as e:  # noqa: BLE001 - what the interpreter does with it
        sys.excepthook(type(e), e, e.__traceback__)
        code, interrupted = 1, isinstance(e, KeyboardInterrupt)
    # what the interpreter does at exit, which multiprocessing's os._exit would skip: wait for
    # the threads that are not daemons, then run the atexit handlers (the rest is multiprocessing's)
    threading._shutdown()
    atexit._run_exitfuncs()
    if interrupted:  # python exits killed by SIGINT after an uncaught KeyboardInterrupt
        sys.stdout.flush(), sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    raise SystemExit(code)  # multiprocessing makes it the exit code, as the interpreter does


try:
    from multiprocessing import popen_forkserver as _popen_forkserver
    from multiprocessing.context import ForkServerProcess as _ForkServerProcess
except ImportError:  # a platform without a fork server (Windows): can_fork() says no
    _ForkServerProcess = object
else:
    class _Popen(_popen_forkserver.Popen):
        """multiprocessing's fork-server Popen, less one step: the child does not import the
        caller's ``__main__`` (as ``__mp_main__``), which multiprocessing does for a target
        defined there; ``python -m`` never would, and a script that starts servers at its top
        level would start them again in each child. And one more: the child finds this module."""

        def _launch(self, process_obj):  # popen_forkserver.Popen._launch but for the pops
            import io
            from multiprocessing import context, forkserver, spawn, util

            prep_data = spawn.get_preparation_data(process_obj._name)
            prep_data.pop("init_main_from_path", None)
            prep_data.pop("init_main_from_name", None)
            here = os.path.dirname(os.path.abspath(__file__))  # the child unpickles _run_as_main from here
            prep_data["sys_path"] = [*prep_data.get("sys_path", sys.path), here]
            buf = io.BytesIO()
            context.set_spawning_popen(self)
            try:
                context.reduction.dump(prep_data, buf)
                context.reduction.dump(process_obj, buf)
            finally:
                context.set_spawning_popen(None)
            self.sentinel, w = forkserver.connect_to_new_process(self._fds)
            _parent_w = os.dup(w)  # the child's sentinel of this process
            self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))
            with open(w, "wb", closefd=True) as f:
                f.write(buf.getbuffer())
            self.pid = forkserver.read_signed(self.sentinel)


class _ServerProcess(_ForkServerProcess):
    """A ``multiprocessing`` process started by the fork server, through :class:`_Popen`."""

    @staticmethod
    def _Popen(process_obj):
        return _Popen(process_obj)


class ForkedProcess:
    """``cmd`` = ``[sys.executable, "-m", MODULE, ARGS...]`` forked from the fork server: the
    parts of ``subprocess.Popen`` that :class:`~splitlearn.procs.localserver.ChildServer` and its
    users need.

    ``stdout``/``stderr``: None (this process's), ``subprocess.DEVNULL``, an fd or a file.
    ``returncode`` is the exit code, or minus the signal that killed it; 255 if the fork
    server itself was killed before it could say.
    """

    def __init__(self, cmd: Sequence[str], env: dict, stdout=None, stderr=None):
        self.args = list(cmd)
        self.stdout = None
        self.returncode: Optional[int] = None
        global fork_server_env
        _context()
        if fork_server_env is None:  # this start launches the fork server, with os.environ as it is now
            fork_server_env = dict(os.environ)
        self._process = _ServerProcess(
            target=_run_as_main, name=" ".join(self.args[1:3]), daemon=True,  # daemon: ended at our exit
            args=(self.args, dict(env), os.getcwd(), list(_fresh_path), self._target(stdout, 1),
                  self._target(stderr, 2)))
        self._process.start()
        self.pid: int = self._process.pid

    @staticmethod
    def _target(f, default_fd: int):
        if f == subprocess.DEVNULL:
            return os.devnull
        if f is None:
            return _Fd(default_fd)
        if isinstance(f, int) and f >= 0:
            return _Fd(f)
        if hasattr(f, "fileno"):
            return _Fd(f.fileno())
        raise ValueError(f"a forked child's output goes to None, DEVNULL, an fd or a file, not {f!r}")

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            code = self._process.exitcode
            if code is not None:
                self.returncode = code
                self._process.close()
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            self._process.join(timeout)
            if self.poll() is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # exited meanwhile
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __repr__(self) -> str:
        return f"<ForkedProcess {self.pid} returncode={self.returncode} args={self.args!r}>"
