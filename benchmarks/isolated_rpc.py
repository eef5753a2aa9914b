"""The ``torch.distributed.rpc`` baseline, one child process per measurement.

Two facts about RPC on torch 2.13 (CPU) decide how the harness runs it:

- A live RPC group keeps both of its processes busy even when no call is in flight
  (measured: 5.0 s of CPU in 5 s of idle sleep in the client, about 100% in the server):
  left running, it would take the cores from every other measurement of the run. (An
  earlier run of this harness that kept it alive measured the unsplit model's batch-8
  generation at 7.5 tokens/s instead of 112.)
- ``rpc.init_rpc`` works once per process.

So each measurement starts a child process that enters a
:class:`~benchmarks.baselines.torch_rpc.TorchRpcSplit` (which starts the server process),
warms up, measures, shuts the group down, and sends its timings back::

    harness --spawn--> child: TorchRpcSplit --> server process
            <--------- Timing (and generated ids) ----
"""
from __future__ import annotations

import torch

from .config import BenchConfig
from .timing import Timing, call_samples, measure, run_in_child


def _job(conn, kind: str, cfg: BenchConfig, args: tuple) -> None:
    try:
        torch.set_num_threads(cfg.threads)
        from .baselines.torch_rpc import TorchRpcSplit

        with TorchRpcSplit(cfg.model, tuple(cfg.u_cuts), lr=cfg.lr, seed=cfg.seed,
                           torch_threads=cfg.threads) as rpc:
            if kind == "generate":
                ids, n = args
                out = rpc.generate(ids, n)
                conn.send(("ok", (measure(lambda: rpc.generate(ids, n), cfg.repeats, cfg.warmup), out)))
            elif kind == "train":
                (ids,) = args
                conn.send(("ok", (measure(lambda: rpc.train_step(ids), cfg.repeats, cfg.warmup), None)))
            else:
                (calls,) = args
                conn.send(("ok", (call_samples(rpc.ping, calls), None)))
    except BaseException as e:  # report it to the harness rather than dying silently
        conn.send(("error", f"{type(e).__name__}: {e}"))


class IsolatedRpc:
    """Measurements of the RPC baseline, each in a fresh child process."""

    def __init__(self, cfg: BenchConfig, timeout_s: float = 1800.0):
        self.cfg = cfg
        self.timeout_s = timeout_s

    def _run(self, kind: str, *args):
        return run_in_child(_job, (kind, self.cfg, args), f"the RPC baseline's {kind}", timeout_s=self.timeout_s)

    def measure_generate(self, ids: torch.Tensor, new_tokens: int) -> tuple[Timing, torch.Tensor]:
        return self._run("generate", ids, new_tokens)

    def measure_train(self, ids: torch.Tensor) -> Timing:
        return self._run("train", ids)[0]

    def ping_samples(self, calls: int) -> list[float]:
        return self._run("ping", calls)[0]
