"""What the two baselines share: the server's config and command line, who loads which part
of the model, the server as a child process, and the frame of the client.

Both baselines split the model in a U-shape: this process holds bottom + top
(:func:`client_segments`), a child process on loopback holds the trunk, blocks [c1, c2)
(:func:`server_trunk`); both load the same model with the same seed. The client starts the
server as ``python -m MODULE *cfg.argv()`` (:class:`BaselineServer`), and the server's ``main``
reads those arguments back with :func:`parse_config`.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from splitlearn import load_model, partition
from splitlearn.errors import ConfigError
from splitlearn.procs.localserver import ChildServer, free_port
from splitlearn.model.segments import Segment

REPO = Path(__file__).resolve().parents[2]  # where `benchmarks` is importable from


@dataclass
class BaselineConfig:
    """One baseline split: the model, where it is cut, and how the server runs."""

    model: str  # model source, as for splitlearn.load_model ("tiny", "random:gpt2", a directory)
    cuts: tuple[int, int]  # U-shape cuts c1 < c2 (block indices): the server holds blocks [c1, c2)
    port: int  # TCP port on 127.0.0.1 the server listens on (HTTP, or RPC's rendezvous store)
    lr: float = 1e-3  # AdamW learning rate (no weight decay, as splitlearn's default)
    seed: int = 0  # seed of random inits; both sides use the same
    torch_threads: Optional[int] = None  # torch intra-op threads of the server; None: torch's default

    def __post_init__(self):
        self.cuts = tuple(int(c) for c in self.cuts)
        if len(self.cuts) != 2:
            raise ConfigError(f"a baseline is a U-shape: give two cuts, got {list(self.cuts)}")
        if not self.cuts[0] < self.cuts[1]:
            raise ConfigError(f"cuts must be increasing (c1 < c2), got {list(self.cuts)}")
        if not 0 < self.port < 65536:
            raise ConfigError(f"port must lie in [1, 65535], got {self.port}")
        if not self.lr > 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ConfigError(f"torch_threads must be >= 1, got {self.torch_threads}")

    def argv(self) -> list[str]:
        """The command-line arguments that :func:`parse_config` turns back into this config."""
        args = ["--model", self.model, "--cut", str(self.cuts[0]), "--cut", str(self.cuts[1]),
                "--port", str(self.port), "--lr", repr(self.lr), "--seed", str(self.seed)]
        return args + ([] if self.torch_threads is None else ["--torch-threads", str(self.torch_threads)])


def parse_config(description: str, argv: Optional[Sequence[str]] = None) -> BaselineConfig:
    """A baseline server's command line (``argv``, default ``sys.argv[1:]``) as its config."""
    p = argparse.ArgumentParser(description=description, allow_abbrev=False)
    p.add_argument("--model", required=True, help="model source: tiny, random:gpt2, a directory, ...")
    p.add_argument("--cut", type=int, action="append", required=True, help="give twice: c1 and c2")
    p.add_argument("--port", type=int, required=True, help="TCP port on 127.0.0.1")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed of random inits (default 0)")
    p.add_argument("--torch-threads", type=int, default=None, help="torch intra-op threads")
    a = p.parse_args(argv)
    try:
        return BaselineConfig(a.model, tuple(a.cut), a.port, a.lr, a.seed, a.torch_threads)
    except ConfigError as e:
        p.error(e.message)  # exits with status 2, as for any other bad argument


def client_segments(cfg: BaselineConfig) -> tuple[Segment, Segment]:
    """Bottom and top of the model, for the client; the trunk is dropped (the server holds it)."""
    parts = partition(load_model(cfg.model, seed=cfg.seed), cfg.cuts)
    return parts.bottom, parts.top


def server_trunk(cfg: BaselineConfig) -> Segment:
    """The trunk (blocks [c1, c2)), for the server; bottom and top are dropped."""
    return partition(load_model(cfg.model, seed=cfg.seed), cfg.cuts).trunk


def check_generation_length(bottom: Segment, input_ids: torch.Tensor, max_new_tokens: int) -> None:
    """Raise ConfigError if the prompt (B, T) plus ``max_new_tokens`` passes the model's n_positions."""
    n_pos = bottom.config.n_positions
    if input_ids.shape[1] + max_new_tokens > n_pos:
        raise ConfigError(f"prompt of {input_ids.shape[1]} tokens + {max_new_tokens} new passes "
                          f"n_positions={n_pos}")


class BaselineServer(ChildServer):
    """``python -m MODULE cfg.argv()`` from this repository: a baseline's server as a child process.

    The child gets ``REPO`` on its PYTHONPATH (unless it runs there) and, with
    ``cfg.torch_threads``, as many OpenMP/MKL threads; its stdout goes to ``stdout`` and its
    stderr is kept for the errors of ``start()``.
    """

    def __init__(self, module: str, cfg: BaselineConfig, *, health: str = "/health",
                 startup_timeout_s: float = 120.0, env: Optional[dict] = None,
                 stdout: Optional[int] = subprocess.DEVNULL):
        threads = {} if cfg.torch_threads is None else {
            "OMP_NUM_THREADS": str(cfg.torch_threads), "MKL_NUM_THREADS": str(cfg.torch_threads)}
        # `python -m` puts the working directory first on sys.path: run from REPO (as `make bench`
        # and the tests are), the child imports `benchmarks` from there, and an environment left
        # as it is lets the tests fork the child (tests/forkserver.py) instead of exec'ing it
        path = {} if Path.cwd().resolve() == REPO else {
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        super().__init__([sys.executable, "-m", module, *cfg.argv()], cfg.port, health=health,
                         startup_timeout_s=startup_timeout_s, env={**threads, **path, **(env or {})},
                         stdout=stdout, capture_stderr=True)


class BaselineSplit:
    """Bottom + top in this process, the trunk in a server a subclass starts in :meth:`start`.

    model_src, cuts, lr, seed: as for the server (both sides load the same model).
    torch_threads: the server's torch threads (this process keeps its own setting).
    startup_timeout_s: how long to wait for the server to be ready.
    ``stats``: ``calls``, ``bytes_sent``, ``bytes_received`` (what each baseline counts: see there).
    """

    def __init__(self, model_src: str, cuts: Sequence[int], *, lr: float = 1e-3, seed: int = 0,
                 torch_threads: Optional[int] = None, startup_timeout_s: float = 120.0):
        self.cfg = BaselineConfig(model_src, tuple(cuts), free_port(), lr, seed, torch_threads)
        self.startup_timeout_s = startup_timeout_s
        self.bottom, self.top = client_segments(self.cfg)
        self.stats = {"calls": 0, "bytes_sent": 0, "bytes_received": 0}

    def start(self):
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
