"""``Supervisor``: R replica processes and HAProxy in front of them, started and stopped together.

::

    start   replicas in parallel, each until its /v1/ready answers 200; haproxy.cfg written and
            checked (haproxy -c); HAProxy started; ready when a request through it answers;
            RUN_DIR/replicas.json written atomically (splitfed, R > 1: RUN_DIR/fed-store, a
            FileStore held here; a TCPStore with --fed-store-port)
    watch   every 0.2 s: a replica that exited is started again on its port (5 s between
            failed tries), replicas.json rewritten; HAProxy exiting stops everything
    stop    SIGTERM or SIGINT: HAProxy first, then every replica (SIGTERM), replicas.json removed

Why children are forked from the main thread only, and their session, PDEATHSIG and affinity:
docs/CLUSTER.md, 'The supervisor'."""
from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import IO, Optional

from ..api import protocol as P
from ..model.checkpoint import private_dir
from ..errors import ConfigError, TransportError
from ..procs.localserver import ChildServer, free_port
from . import haproxy
from .config import ClusterConfig

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _child_setup(cores: Optional[list[int]]):
    """What a child does between fork and exec: die with the supervisor, take its cores."""

    def setup() -> None:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):  # not Linux: children may outlive a killed supervisor
            pass
        if cores is not None:
            os.sched_setaffinity(0, cores)

    return setup


class ReplicaProcess(ChildServer):
    """One ``python -m splitlearn.server`` replica, its output appended to a log file."""

    def __init__(self, index: int, cfg: ClusterConfig, port: int, log_path: Path, store: Optional[str] = None):
        cmd = [sys.executable, "-m", "splitlearn.server", *cfg.replica_args(port, index, store)]
        # started (and back after a restart) when ready, as HAProxy's check sees it (haproxy.py)
        super().__init__(cmd, port, health=P.READY, startup_timeout_s=cfg.startup_timeout_s, quiet=False)
        self.index, self.name, self.log_path = index, f"r{index}", log_path
        self.cores = cfg.cores(index)
        port = cfg.replica_metrics_port(index)
        self.metrics_url = None if port is None else f"http://127.0.0.1:{port}/metrics"
        self.restarts = 0
        self.starting: Optional[float] = None  # time.monotonic() of a restart not answering yet
        self.next_try = 0.0  # time.monotonic() before which a failed restart is not tried again
        self._log: Optional[IO[bytes]] = None

    def spawn(self) -> None:
        """Start the process (not waiting for it)."""
        if self.proc is not None:
            self._close_pipes()
        self._log = open(self.log_path, "ab")
        env = None
        if "--fed-store" in self.cmd:  # the SplitFed group's gloo traffic stays on loopback (one machine)
            env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, preexec_fn=_child_setup(self.cores))

    _spawn = spawn  # ChildServer.start(): spawn, then wait until ready

    def _close_pipes(self) -> None:
        super()._close_pipes()
        if self._log is not None:
            self._log.close()
            self._log = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def describe(self) -> dict:
        return {"index": self.index, "name": self.name, "pid": self.proc.pid if self.proc else None,
                "port": self.port, "url": self.url, "cores": self.cores, "restarts": self.restarts,
                "alive": self.alive(), "ready": self.alive() and self.starting is None,
                "log": str(self.log_path), "metrics": self.metrics_url}


class Supervisor:
    def __init__(self, cfg: ClusterConfig):
        self.cfg = cfg
        self.run_dir = private_dir(cfg.run_dir)
        self.binary = haproxy.find_haproxy(cfg.haproxy)
        self.replicas: list[ReplicaProcess] = []
        self.proxy: Optional[subprocess.Popen] = None
        self._proxy_log: Optional[IO[bytes]] = None
        self.stopping = threading.Event()
        self._lock = threading.Lock()  # replicas.json and restarts
        self._down: set[int] = set()  # replicas that died and stay down (restart=False)
        self.store = None  # splitfed: the store where the replicas meet (torch.distributed)
        self.store_addr: Optional[str] = None

    @property
    def manifest(self) -> Path:
        return self.run_dir / "replicas.json"

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.cfg.host in ("0.0.0.0", "") else self.cfg.host
        return f"http://{host}:{self.cfg.port}"

    def start(self) -> "Supervisor":
        cfg = self.cfg
        ports = [cfg.replica_port + i if cfg.replica_port else free_port() for i in range(cfg.replicas)]
        if cfg.splitfed and cfg.fed_store_port is not None:  # asked for: every local user reaches the port
            from .store import host_store

            self.store = host_store("127.0.0.1", cfg.fed_store_port)
            self.store_addr = f"127.0.0.1:{self.store.port}"
        elif cfg.splitfed:  # a file in the private run directory: only this user may open it (SECURITY.md)
            from ..server.federation.collective import open_file_store

            path = self.run_dir / "fed-store"
            if path.exists():
                path.unlink()  # a past run's keys (its generations, its rounds): not this run's
            self.store = open_file_store(str(path))  # held: the replicas meet in it
            self.store_addr = f"file://{path}"
        self.replicas = [ReplicaProcess(i, cfg, p, self.run_dir / f"replica-{i}.log", self.store_addr)
                         for i, p in enumerate(ports)]
        if cfg.state_dir is not None:
            private_dir(cfg.state_dir)
        try:
            self._start_replicas()
            settings = haproxy.HAProxySettings(
                bind=f"{cfg.host}:{cfg.port}", servers=[(r.name, f"127.0.0.1:{r.port}") for r in self.replicas],
                inter_ms=cfg.check_interval_ms, fall=cfg.fall, rise=cfg.rise, server_s=cfg.server_timeout_s,
                metrics=f"127.0.0.1:{cfg.metrics_port}" if cfg.metrics_port else None)
            conf = haproxy.write_config(settings, self.run_dir / "haproxy.cfg", self.binary)
            self._proxy_log = open(self.run_dir / "haproxy.log", "ab")
            self.proxy = subprocess.Popen(haproxy.command(self.binary, conf), stdout=self._proxy_log,
                                          stderr=subprocess.STDOUT, start_new_session=True,
                                          preexec_fn=_child_setup(None))
            self._wait_proxy()
            self.write_manifest()
        except BaseException:
            self.stop()
            raise
        log.info("cluster ready: %d replicas behind HAProxy at %s (run dir %s)", len(self.replicas),
                 self.url, self.run_dir)
        return self

    def _start_replicas(self) -> None:
        """Start every replica at once (from this thread), then wait until each answers."""
        for r in self.replicas:
            r.spawn()
        errors: list[str] = []
        for r in self.replicas:
            try:
                r._wait_ready()
            except TransportError as e:
                errors.append(f"replica {r.index} (log: {r.log_path}): {e}")
        if errors:
            raise ConfigError("replicas did not start: " + "; ".join(errors))

    def _wait_proxy(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proxy.poll() is not None:
                raise ConfigError(f"HAProxy exited with code {self.proxy.returncode} "
                                  f"(log: {self.run_dir / 'haproxy.log'})")
            try:
                with urllib.request.urlopen(self.url + P.HEALTH, timeout=1):
                    return
            except OSError:
                time.sleep(0.05)
        raise ConfigError(f"HAProxy did not answer on {self.url} within {timeout_s:g}s")

    def write_manifest(self) -> None:
        """RUN_DIR/replicas.json, replaced atomically (a reader sees the old or the new one)."""
        with self._lock:
            data = {"url": self.url, "port": self.cfg.port, "supervisor_pid": os.getpid(),
                    "haproxy": {"pid": self.proxy.pid if self.proxy else None,
                                "config": str(self.run_dir / "haproxy.cfg"),
                                "log": str(self.run_dir / "haproxy.log"),
                                "metrics": f"http://127.0.0.1:{self.cfg.metrics_port}/metrics" if self.cfg.metrics_port else None},
                    "state_dir": self.cfg.state_dir, "server_args": list(self.cfg.server_args),
                    "fed_store": self.store_addr,
                    "replicas": [r.describe() for r in self.replicas]}
            tmp = self.manifest.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(data, indent=1) + "\n")
            os.replace(tmp, self.manifest)

    def run(self) -> int:
        """Watch until :meth:`request_stop` (0) or HAProxy's death (1); then stop everything."""
        code = 0
        while not self.stopping.wait(0.2):
            if self.proxy.poll() is not None:
                log.error("HAProxy exited with code %s: stopping the cluster", self.proxy.returncode)
                code = 1
                break
            for r in self.replicas:
                self._watch(r)
        self.stop()
        return code

    def _watch(self, r: ReplicaProcess) -> None:
        now = time.monotonic()
        if r.starting is not None:  # a restart: wait for it to answer, without blocking the others
            if r.alive() and r.ready():
                r.starting, r.restarts = None, r.restarts + 1
                log.info("replica %d is back (pid %d)", r.index, r.proc.pid)
                self.write_manifest()
            elif not r.alive() or now - r.starting > self.cfg.startup_timeout_s:
                log.error("replica %d did not restart (log: %s); trying again in 5 s", r.index, r.log_path)
                r.stop()
                r.starting, r.next_try = None, now + 5.0
            return
        if r.alive() or r.index in self._down or now < r.next_try:
            return
        if r.next_try == 0.0:  # (not after a failed restart: that was logged already)
            log.warning("replica %d (pid %s) exited with code %s", r.index, r.proc.pid, r.proc.returncode)
            self.write_manifest()
        if not self.cfg.restart:
            self._down.add(r.index)
            return
        with self._lock:  # stop() sets `stopping` under it: no replica is spawned after
            if self.stopping.is_set():
                return
            r.spawn()
        r.starting, r.next_try = now, 0.0
        self.write_manifest()  # its new pid, not ready yet

    def request_stop(self, *_args) -> None:
        self.stopping.set()

    def stop(self) -> None:
        with self._lock:
            self.stopping.set()
        if self.proxy is not None and self.proxy.poll() is None:
            self.proxy.terminate()
            try:
                self.proxy.wait(10)
            except subprocess.TimeoutExpired:
                self.proxy.kill()
                self.proxy.wait()
        if self._proxy_log is not None:
            self._proxy_log.close()
            self._proxy_log = None
        threads = [threading.Thread(target=r.stop) for r in self.replicas if r.proc is not None]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.manifest.unlink(missing_ok=True)
