"""Two devices emulated on one machine: client and server pinned to different cores.

On the shared-core runs of the other workloads, client and server take turns on the same
cores, so the split pays for its two processes waking each other (see README.md). Here each
side gets a core of its own, as two machines would give it:

- the server (``python -m splitlearn.server --torch-threads 1``, ``OMP_NUM_THREADS=1``)
  inherits the affinity ``{server_core}`` (``os.sched_setaffinity`` before it starts); with
  ``--mp-context forkserver`` (the tests' quick run) it is a fork of the client's process
  (torch and the server package imported) rather than a fresh interpreter;
- the client, in a child process of the harness pinned to ``{client_core}`` with one torch
  thread, runs the U-shape split (float32 wire) and, on the same core, the unsplit model
  (Hugging Face ``generate``): the reference, one device doing all the work.

Greedy generation of ``new_tokens`` after a ``prompt_len`` prompt, per batch of
``gen_batches``; every round runs each system once (paired: a slow phase of the machine hits
all of them), ``pinned_repeats`` rounds after one warm-up. Systems: ``unsplit (1 core)``;
``splitlearn u float32`` (:meth:`SplitClient.generate`: two row groups in flight from batch
2, see ``RemoteCache.row_groups`` in :mod:`splitlearn.hf.cache`); from batch 2 also ``... serial``
(``pipeline=False``, one group: client and server take turns). ``ratio`` is the median over rounds of the unsplit time over
the system's time. Also the decode-step overhead (round trip minus server compute, batch 1)
with both sides pinned. Skipped on machines with fewer than two cores and on GPU runs.

The split decodes on oneDNN prepacked weights on both sides (:mod:`splitlearn.model.packed`, the
default); ``unsplit (1 core, packed)`` is the unsplit model on the same kernels, to show what
the kernels give and what the split gives (the ratios are all over ``unsplit (1 core)``, the
model as Hugging Face runs it). ``... poll-idle`` rows: the same, with :class:`~splitlearn.procs.idlepoll.IdlePoller` on both cores
(what ``--poll-idle`` on the server and ``SplitClient(poll_idle=True)`` start), resumed for
those systems only and paused (SIGSTOP) for all the others, the unsplit reference included.
"""
from __future__ import annotations

import atexit
import os
import runpy
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback

from .config import BenchConfig
from .timing import ONE_THREAD_ENV, run_in_child


class _ForkedServer:
    """``launch(cmd)`` (:data:`splitlearn.procs.localserver.launch`) for ``cmd`` = ``[python, -m,
    MODULE, ARGS...]`` as a fork of this process, run as ``python -m`` would run it (its
    environment, ``sys.argv``, the module as ``__main__``, the threads and ``atexit`` handlers at
    its exit), instead of a fresh interpreter importing torch again: the quick run's pinned server
    (``--mp-context forkserver``: this process was forked from a preloaded interpreter). A fork, it
    inherits this process's affinity as the exec'd server does. ``close`` (this side's pipe to the
    harness) is closed in the child. The parts of ``subprocess.Popen`` that ``ChildServer`` uses."""

    def __init__(self, cmd, env=None, stdout=None, stderr=None, close=()):
        assert cmd[1] == "-m", cmd
        self.args, self.stdout, self.returncode = list(cmd), None, None
        self.pid = os.fork()
        if self.pid == 0:  # the server: never returns
            code = 1
            try:
                for c in close:
                    c.close()
                for target, fd in ((stdout, 1), (stderr, 2)):
                    if target is None:
                        continue
                    src = os.open(os.devnull, os.O_WRONLY) if target == subprocess.DEVNULL else (
                        target if isinstance(target, int) else target.fileno())
                    os.dup2(src, fd)
                os.environ.clear()
                os.environ.update(env if env is not None else {})
                sys.argv = ["-m", *cmd[3:]]
                try:
                    runpy.run_module(cmd[2], run_name="__main__", alter_sys=True)
                    code = 0
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                threading._shutdown()
                atexit._run_exitfuncs()
            except BaseException:  # noqa: BLE001 - what the interpreter does with it
                traceback.print_exc()
            finally:
                sys.stdout.flush(), sys.stderr.flush()
                os._exit(code)

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig):
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def _child(conn, cfg: BenchConfig) -> None:
    srv = None
    try:
        os.environ.update(ONE_THREAD_ENV)
        import torch

        from splitlearn import load_model
        from splitlearn.client import SplitClient
        from splitlearn.procs.idlepoll import IdlePoller, available
        from splitlearn.model.packed import PackedLinears

        from .context import LocalServer
        from .generation import hf_generate, prompts
        from .overhead import decode_step_overheads

        if cfg.mp_context == "forkserver":  # forked from a preloaded interpreter: fork the server too
            from splitlearn.procs import localserver

            localserver.launch = lambda cmd, **kw: _ForkedServer(cmd, close=(conn,), **kw)
        os.sched_setaffinity(0, {cfg.pinned_cores[1]})  # the server process inherits this
        args = ["--model", cfg.model, "--device", "cpu", "--dtype", cfg.dtype, "--torch-threads", "1",
                "--seed", str(cfg.seed), "--threads", "16"]
        for c in cfg.u_cuts:
            args += ["--cut", str(c)]
        srv = LocalServer(args, env=ONE_THREAD_ENV).start()
        os.sched_setaffinity(0, {cfg.pinned_cores[0]})
        torch.set_num_threads(1)
        model = load_model(cfg.model, dtype=cfg.dtype, device="cpu", seed=cfg.seed)
        client = SplitClient(srv.url, model, token=srv.token, device="cpu", wire_dtype="float32", seed=cfg.seed)
        N, rows = cfg.new_tokens, []
        whole = PackedLinears(model)  # the unsplit model on the kernels the split decodes with
        poller = IdlePoller(cfg.pinned_cores).start() if available() else None
        if poller is not None:
            poller.pause()

        def within(context, fn):  # fn run inside context()
            def run():
                with context():
                    return fn()
            return run

        for B in cfg.gen_batches:
            ids = prompts(cfg, B, model.config.vocab_size)
            systems = {"unsplit (1 core)": lambda: hf_generate(model, ids, N),
                       "splitlearn u float32": lambda: client.generate(ids, max_new_tokens=N)}
            if whole.usable:
                systems["unsplit (1 core, packed)"] = within(whole.active, lambda: hf_generate(model, ids, N))
            if poller is not None:
                systems["splitlearn u float32 poll-idle"] = within(poller.running,
                                                                   systems["splitlearn u float32"])
            if B >= 2:
                systems["splitlearn u float32 serial"] = lambda: client.generate(ids, max_new_tokens=N,
                                                                                 pipeline=False)
            with torch.no_grad():
                reference = systems["unsplit (1 core)"]()
                same = {s: bool(torch.equal(fn(), reference)) for s, fn in systems.items()}  # + warm-up
                times = {s: [] for s in systems}
                for _ in range(cfg.pinned_repeats):
                    for s, fn in systems.items():
                        t0 = time.perf_counter()
                        fn()
                        times[s].append(time.perf_counter() - t0)
            base = times["unsplit (1 core)"]
            for s, ts in times.items():
                med = statistics.median(ts)
                rows.append({"workload": "pinned", "case": f"batch {B}, {N} new tokens", "batch": B,
                             "system": s, "value": B * N / med, "unit": "tokens/s", "better": "higher",
                             "median_s": med, "runs": ts, "same_tokens": same[s],
                             "ratio": statistics.median(u / t for u, t in zip(base, ts)),
                             "pipelined": s.startswith("splitlearn u float32") and "serial" not in s and B >= 2})
        overheads = {"splitlearn decode step": lambda: decode_step_overheads(client, cfg.overhead_calls)}
        if poller is not None:
            overheads["splitlearn decode step poll-idle"] = within(poller.running,
                                                                   overheads["splitlearn decode step"])
        for system, fn in overheads.items():
            trips, server = fn()
            rows.append({"workload": "pinned", "case": "one decode step, batch 1", "system": system,
                         "value": 1e3 * statistics.median(t - s for t, s in zip(trips, server)), "unit": "ms/call",
                         "better": "lower", "round_trip_ms": 1e3 * statistics.median(trips),
                         "server_ms": 1e3 * statistics.median(server)})
        client.close()
        if poller is not None:
            poller.stop()
        for r in rows:
            r["cores"] = {"client": cfg.pinned_cores[0], "server": cfg.pinned_cores[1]}
        conn.send(("ok", rows))
    except BaseException as e:  # report it to the harness rather than dying silently
        conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        if srv is not None:
            srv.stop()


def run(cfg: BenchConfig, ctx) -> list[dict]:
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if cfg.device != "cpu" or not set(cfg.pinned_cores) <= set(cores) or len(set(cfg.pinned_cores)) < 2:
        ctx.log(f"  pinned: needs two distinct CPU cores {cfg.pinned_cores} (have {cores}, device "
                f"{cfg.device}): skipped")
        return []
    ctx.log(f"  pinned: client on core {cfg.pinned_cores[0]}, server on core {cfg.pinned_cores[1]}, "
            f"one torch thread each")
    return run_in_child(_child, (cfg,), "the pinned measurement", ONE_THREAD_ENV, context=cfg.mp_context)
