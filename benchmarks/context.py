"""``BenchContext``: the processes and models one benchmark run shares across workloads.

Servers are real ``python -m splitlearn.server`` processes on loopback (one per shape and
batching mode, started on first use and reused), each with the same torch thread count as
this process. Models are loaded once, with the same seed everywhere, so every system in a
comparison runs the same weights on the same data.
"""
from __future__ import annotations

from typing import Optional

import torch
from transformers import GPT2LMHeadModel

from splitlearn import load_model
from splitlearn.client import SplitClient
from splitlearn.procs.localserver import LocalServer

from .config import BenchConfig


class BenchContext:
    def __init__(self, cfg: BenchConfig, log=print):
        self.cfg = cfg
        self.log = log
        self._servers: dict[tuple, LocalServer] = {}
        self._models: dict[str, GPT2LMHeadModel] = {}
        self._baselines: dict[str, object] = {}
        torch.set_num_threads(cfg.threads)
        self.env = {"OMP_NUM_THREADS": str(cfg.threads), "MKL_NUM_THREADS": str(cfg.threads)}

    # -- models ------------------------------------------------------------------------

    def model(self, source: Optional[str] = None) -> GPT2LMHeadModel:
        """The unsplit model (cached): the reference every ratio is taken against."""
        source = source or self.cfg.model
        if source not in self._models:
            self._models[source] = load_model(source, dtype=self.cfg.dtype, device=self.cfg.device,
                                              seed=self.cfg.seed)
        return self._models[source]

    def drop_models(self) -> None:
        """Forget the cached unsplit models (their memory goes once nothing else holds them)."""
        self._models.clear()

    def fresh_model(self, source: Optional[str] = None) -> GPT2LMHeadModel:
        """A new copy with the initial weights (for runs that compare weights or losses)."""
        return load_model(source or self.cfg.model, dtype=self.cfg.dtype, device=self.cfg.device,
                          seed=self.cfg.seed)

    def cuts(self, shape: str) -> tuple[int, ...]:
        return tuple(self.cfg.u_cuts) if shape == "u" else (self.cfg.two_way_cut,)

    # -- servers -----------------------------------------------------------------------

    def server_args(self, shape: str, *, batching: bool = True, model: Optional[str] = None,
                    cuts: Optional[tuple[int, ...]] = None, lr: Optional[float] = None) -> list[str]:
        c = self.cfg
        args = ["--model", model or c.model, "--device", c.device, "--dtype", c.dtype,
                "--torch-threads", str(c.threads), "--seed", str(c.seed),
                "--lr", str(lr if lr is not None else c.lr), "--threads", "16"]
        for cut in cuts or self.cuts(shape):
            args += ["--cut", str(cut)]
        return args + ([] if batching else ["--no-batching"])

    def server(self, shape: str, *, batching: bool = True) -> LocalServer:
        """The shared server for ``shape`` (``"u"`` or ``"2-way"``), started on first use."""
        key = (shape, batching)
        if key not in self._servers:
            self.log(f"  starting server: {shape}{'' if batching else ', unbatched'}")
            self._servers[key] = LocalServer(self.server_args(shape, batching=batching),
                                             env=self.env).start()
        return self._servers[key]

    def fresh_server(self, shape: str, **kw) -> LocalServer:
        """A server of its own, with initial weights; the caller stops it."""
        return LocalServer(self.server_args(shape, **kw), env=self.env).start()

    def client(self, shape: str, wire_dtype: str = "float32", *, model=None,
               server: Optional[LocalServer] = None, lr: Optional[float] = None) -> SplitClient:
        srv = server or self.server(shape)
        return SplitClient(srv.url, model if model is not None else self.model(), token=srv.token,
                           device=self.cfg.device, wire_dtype=wire_dtype, seed=self.cfg.seed,
                           lr=lr if lr is not None else self.cfg.lr)

    # -- baselines ---------------------------------------------------------------------

    def naive(self):
        """The naive JSON split (U-shape), started on first use; None on CUDA runs."""
        if "naive" not in self.cfg.baselines:
            return None
        if "naive" not in self._baselines and self.cfg.device != "cpu":
            self.log("  naive JSON baseline: CPU only, skipped on a GPU run")
            self._baselines["naive"] = None
        if "naive" not in self._baselines:
            try:
                from .baselines.naive_json import NaiveJsonSplit
            except ImportError as e:
                self.log(f"  naive JSON baseline unavailable: {e}")
                self._baselines["naive"] = None
                return None
            self.log("  starting baseline: naive JSON")
            self._baselines["naive"] = NaiveJsonSplit(
                self.cfg.model, tuple(self.cfg.u_cuts), lr=self.cfg.lr, seed=self.cfg.seed,
                torch_threads=self.cfg.threads).__enter__()
        return self._baselines["naive"]

    def rpc(self):
        """The torch.distributed.rpc split (U-shape), run in a child process per measurement
        (see :mod:`benchmarks.isolated_rpc`); None on GPU runs, where RPC is unavailable or
        when ``--baselines`` leaves it out."""
        if "rpc" not in self.cfg.baselines:
            return None
        if "rpc" not in self._baselines:
            import torch.distributed.rpc as rpc

            from .isolated_rpc import IsolatedRpc

            if self.cfg.device != "cpu":
                self.log("  torch.distributed.rpc baseline: CPU only, skipped on a GPU run")
                self._baselines["rpc"] = None
            elif not rpc.is_available():
                self.log("  torch.distributed.rpc is not available in this torch build: skipped")
                self._baselines["rpc"] = None
            else:
                self._baselines["rpc"] = IsolatedRpc(self.cfg)
        return self._baselines["rpc"]

    def close(self) -> None:
        for srv in self._servers.values():
            srv.stop()
        self._servers.clear()
        for b in self._baselines.values():
            if hasattr(b, "__exit__"):
                b.__exit__(None, None, None)
        self._baselines.clear()

    def __enter__(self) -> "BenchContext":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
