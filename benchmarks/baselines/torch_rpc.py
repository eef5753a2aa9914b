"""The PyTorch-native baseline: a U-shape split over ``torch.distributed.rpc`` (TensorPipe).

What a PyTorch user would write from the RPC tutorials ("Distributed Pipeline Parallelism
Using RPC", "Implementing a Parameter Server"): two workers on loopback, world size 2, the
trunk held by worker ``server`` (rank 0, which also hosts the rendezvous store), bottom + top
by worker ``client`` (rank 1). Training uses distributed autograd and a
``DistributedOptimizer(torch.optim.AdamW, ...)`` over parameter RRefs of both workers;
generation keeps the trunk's KV cache on the server in a session object behind an RRef::

    set-up     client --rpc.remote(_served_trunk)-->    RRef[trunk]        (the module stays there)
               client --rpc_sync(_parameter_rrefs)-->   [RRef[param], ...] (for the optimizer)

    training   (inside dist_autograd.context() as ctx)
      client: ids -> bottom -> h1 (B, T, d) --rpc_sync(_trunk_forward)--> server: trunk(h1)
              <-- h2 (B, T, d)
      client: h2 -> top -> loss; dist_autograd.backward(ctx, [loss])
              dL/dh2 (B, T, d) --autograd RPC--> server: trunk backward --> dL/dh1 (B, T, d)
      client: optimizer.step(ctx): one RPC per worker runs its local AdamW on its gradients

    generation (greedy)
      client --rpc.remote(_DecodeSession, RRef[trunk])--> session (holds trunk.new_cache())
      prefill: h1 (B, T, d) --session.rpc_sync().step--> h2 (B, T, d)
      decode:  h1 (B, 1, d) --session.rpc_sync().step--> h2 (B, 1, d)   (one new position)

    ping: rpc_sync(_noop), nothing computed

Tensors travel as TensorPipe messages (pickled Python objects with the tensor storages sent
beside them): the RPC layer unpickles what the peer sends, so it is for trusted peers only.

Pitfalls found (torch 2.13, CPU):
- ``rpc.init_rpc`` works once per process: a second ``init_rpc`` after ``rpc.shutdown()`` hangs.
  Enter one :class:`TorchRpcSplit` per process (a second raises); benchmarks and tests run it in
  a child process.
- Functions and classes called remotely are pickled by qualified name, so the server must
  import this file as ``benchmarks.baselines.torch_rpc``, not as ``__main__`` (which would hold
  a second, empty ``_TRUNK``): the entry point below (``python -m benchmarks.baselines.torch_rpc``)
  re-imports itself under that name.
- ``DistributedOptimizer(torch.optim.AdamW, ...)`` swaps in TorchScript's ``_FunctionalAdamW``,
  whose default ``weight_decay`` is 0.01 like ``torch.optim.AdamW``'s; splitlearn uses 0, so
  pass ``weight_decay=0.0``. The losses then equal local AdamW's (see the tests).
- TensorPipe and the Gloo group ``init_rpc`` builds pick their interface from the host name
  unless ``TP_SOCKET_IFNAME`` / ``GLOO_SOCKET_IFNAME`` say otherwise; both are set to ``lo``.
- If the server dies before the rendezvous, the client's ``init_rpc`` would wait for it; the
  server prints a ready line after loading the model and the client waits for that first.
"""
from __future__ import annotations

import os
import tempfile
import warnings
from typing import Optional, Sequence

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch.distributed.optim import DistributedOptimizer

from splitlearn.model.checkpoint import unique_parameters
from splitlearn.model.segments import Segment, loss_from_logits

from .common import (BaselineConfig, BaselineServer, BaselineSplit, check_generation_length, parse_config,
                     server_trunk)

MODULE = "benchmarks.baselines.torch_rpc"  # the server runs as `python -m MODULE` (see the pitfalls above)
READY = "torch_rpc server ready"
RPC_TIMEOUT_S = 600.0  # per RPC call; a GPT-2 small training forward takes seconds on a CPU
LOOPBACK_ENV = {"TP_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}

_TRUNK: Optional[Segment] = None  # the server's trunk, set by serve()
_RPC_USED = False  # rpc.init_rpc has run in this process (it cannot run twice)


def _init_rpc(name: str, rank: int, cfg: BaselineConfig) -> None:
    """Join the group of two as worker ``name``; the server (rank 0) hosts the store on ``cfg.port``."""
    for key, value in LOOPBACK_ENV.items():
        os.environ.setdefault(key, value)
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{cfg.port}",
                                              rpc_timeout=RPC_TIMEOUT_S)
    with warnings.catch_warnings():  # init_rpc's own Gloo barrier warns that it is deprecated
        warnings.filterwarnings("ignore", message=".*ProcessGroupGloo.*", category=UserWarning)
        rpc.init_rpc(name, rank=rank, world_size=2, rpc_backend_options=options)


# -- what the server runs, called by the client ------------------------------------------

def _noop() -> None:
    return None


def _served_trunk() -> Segment:
    """The server's trunk; called through ``rpc.remote`` it stays there and the caller gets an RRef."""
    if _TRUNK is None:
        raise RuntimeError(f"this worker serves no trunk: start it with `python -m {MODULE}`")
    return _TRUNK


def _trunk_config(trunk_rref: rpc.RRef) -> dict:
    t = trunk_rref.local_value()
    keys = ("n_embd", "n_layer", "n_head", "vocab_size", "n_positions")
    return {"blocks": list(t.blocks), **{k: getattr(t.config, k) for k in keys}}


def _parameter_rrefs(module_rref: rpc.RRef) -> list[rpc.RRef]:
    return [rpc.RRef(p) for p in module_rref.local_value().parameters()]


def _trunk_forward(trunk_rref: rpc.RRef, h1: torch.Tensor) -> torch.Tensor:
    trunk = trunk_rref.local_value()
    trunk.train()
    return trunk(h1)  # (B, T, d); distributed autograd records the graph on both sides


class _DecodeSession:
    """One generation on the server: the trunk's KV cache for one batch of sequences."""

    def __init__(self, trunk_rref: rpc.RRef):
        self.trunk: Segment = trunk_rref.local_value()
        self.cache = self.trunk.new_cache()

    @torch.no_grad()
    def step(self, h1: torch.Tensor) -> torch.Tensor:
        self.trunk.eval()
        return self.trunk(h1, None, self.cache)  # (B, T, d) for the new positions only


def serve(cfg: BaselineConfig) -> None:
    """Load the trunk, join as worker ``server`` (rank 0), and serve until the client shuts down."""
    global _TRUNK
    if cfg.torch_threads is not None:
        torch.set_num_threads(cfg.torch_threads)
    _TRUNK = server_trunk(cfg)
    print(READY, flush=True)
    _init_rpc("server", 0, cfg)
    rpc.shutdown()  # blocks until the client has called rpc.shutdown() too


def main(argv: Optional[Sequence[str]] = None) -> None:
    serve(parse_config("torch.distributed.rpc split-learning server (U-shape trunk)", argv))


# -- client ------------------------------------------------------------------------------

class RpcServer(BaselineServer):
    """The RPC server as a child process: ready once it prints :data:`READY` (it speaks no HTTP).

    Its stdout is a temporary file this side reads, not a pipe: a child that writes to a file can
    be forked from a preloaded interpreter where the tests fork their servers (tests/forkserver.py)."""

    def __init__(self, cfg: BaselineConfig, startup_timeout_s: float):
        super().__init__(MODULE, cfg, startup_timeout_s=startup_timeout_s, env=LOOPBACK_ENV)
        self.stdout = self._out = tempfile.TemporaryFile()

    def ready(self) -> bool:
        return READY.encode() in os.pread(self._out.fileno(), 1 << 16, 0)

    def _close_pipes(self) -> None:
        super()._close_pipes()
        self._out.close()


class TorchRpcSplit(BaselineSplit):
    """Bottom + top here (worker ``client``), the trunk in a child process (worker ``server``).

    Arguments as for :class:`~benchmarks.baselines.common.BaselineSplit`; ``lr`` is AdamW's on
    both workers (DistributedOptimizer, no weight decay).
    ``stats``: ``calls`` (remote calls), ``bytes_sent`` / ``bytes_received``. RPC does not
    report its message sizes, so the bytes are estimates: the tensor payloads
    (``numel * element_size``), without pickled headers or TensorPipe framing.

    ``rpc.init_rpc`` can run only once per process, so only one ``TorchRpcSplit`` can be
    entered per process, ever.
    """

    def __init__(self, model_src: str, cuts: Sequence[int], **kw):
        if not rpc.is_available():
            raise RuntimeError("this torch build has no torch.distributed.rpc")
        super().__init__(model_src, cuts, **kw)
        self.server: Optional[RpcServer] = None
        self._trunk: Optional[rpc.RRef] = None
        self.optimizer: Optional[DistributedOptimizer] = None

    # -- the server process and the RPC group --------------------------------------------

    def start(self) -> "TorchRpcSplit":
        global _RPC_USED
        if _RPC_USED:
            raise RuntimeError("torch.distributed.rpc was already initialised in this process and cannot "
                               "be again (a second init_rpc hangs): run each TorchRpcSplit in its own process")
        _RPC_USED = True
        self.server = RpcServer(self.cfg, self.startup_timeout_s).start()
        try:
            _init_rpc("client", 1, self.cfg)
        except BaseException:
            self.server.kill()
            raise
        self._connect()
        return self

    def _connect(self) -> None:
        self._trunk = rpc.remote("server", _served_trunk)  # RRef[Segment], owned by the server
        server_cfg = rpc.rpc_sync("server", _trunk_config, args=(self._trunk,))
        for key, value in server_cfg.items():
            mine = list(self.cfg.cuts) if key == "blocks" else getattr(self.bottom.config, key)
            if value != mine:
                raise RuntimeError(f"the server's {key}={value} differs from this side's {mine}: "
                                   f"load the same model on both sides")
        remote_params = rpc.rpc_sync("server", _parameter_rrefs, args=(self._trunk,))
        local_params = [rpc.RRef(p) for p in unique_parameters([self.bottom, self.top])]
        self.optimizer = DistributedOptimizer(torch.optim.AdamW, local_params + remote_params,
                                              lr=self.cfg.lr, weight_decay=0.0)
        self.stats["calls"] += 4  # remote, config, parameters, the server's optimizer

    def close(self) -> None:
        """Drop the RRefs, shut RPC down on both workers, and wait for the server to exit."""
        self._trunk = self.optimizer = None
        if self.server is None:
            return
        try:
            rpc.shutdown()  # graceful: waits for outstanding calls and RRef deletions on both sides
            self.server.proc.wait(30)
        except Exception:
            self.server.kill()
            raise
        finally:
            self.server.stop()  # the server has exited: closes its pipes
            self.server = None

    # -- calls ---------------------------------------------------------------------------

    def _count(self, sent: Optional[torch.Tensor] = None, received: Optional[torch.Tensor] = None) -> None:
        self.stats["calls"] += 1
        for key, t in (("bytes_sent", sent), ("bytes_received", received)):
            if t is not None:
                self.stats[key] += t.numel() * t.element_size()  # an estimate: the tensor payload

    def ping(self) -> None:
        """One remote call that computes nothing: the per-call overhead."""
        rpc.rpc_sync("server", _noop)
        self._count()

    def train_step(self, input_ids: torch.Tensor) -> float:
        """One AdamW step on both workers for a batch (B, T) with labels = input_ids; the loss."""
        ids = torch.as_tensor(input_ids)
        self.bottom.train()
        self.top.train()
        with dist_autograd.context() as ctx:
            h1 = self.bottom(ids)  # (B, T, d)
            h2 = rpc.rpc_sync("server", _trunk_forward, args=(self._trunk, h1))  # (B, T, d)
            self._count(h1, h2)
            loss = loss_from_logits(self.top(h2), ids)
            dist_autograd.backward(ctx, [loss])  # dL/dh2 goes to the server, dL/dh1 comes back
            self._count(h2, h1)
            self.optimizer.step(ctx)  # each worker's AdamW on the gradients of this context
            self._count()
        return float(loss.detach())

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.LongTensor:
        """Greedy: prompt (B, T) + ``max_new_tokens`` tokens, (B, T + new); no padding.

        Every side keeps a KV cache: after the prompt, one position (B, 1, d) crosses per token.
        """
        ids = torch.as_tensor(input_ids)
        check_generation_length(self.bottom, ids, max_new_tokens)
        self.bottom.eval()
        self.top.eval()
        caches = self.bottom.new_cache(), self.top.new_cache()
        session = rpc.remote("server", _DecodeSession, args=(self._trunk,))  # RRef[_DecodeSession]
        self._count()
        out, new = [ids], ids
        for _ in range(max_new_tokens):
            h1 = self.bottom(new, None, caches[0])  # (B, T or 1, d)
            h2 = session.rpc_sync().step(h1)  # (B, T or 1, d)
            self._count(h1, h2)
            new = self.top(h2, None, caches[1])[:, -1, :].argmax(-1)[:, None]  # (B, 1)
            out.append(new)
        del session  # the server frees the cache when the RRef's last user is gone
        return torch.cat(out, dim=1)


if __name__ == "__main__":
    # Import this file under its package name so that the functions the client names
    # (benchmarks.baselines.torch_rpc._served_trunk, ...) see the _TRUNK that serve() sets.
    from benchmarks.baselines.torch_rpc import main as package_main

    package_main()
