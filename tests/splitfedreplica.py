"""The replica processes of tests/test_cluster_splitfed.py's in-process tests, and what they share
with the test: a module of its own, light to import, because a forked replica imports the module
of its target (a test module's imports, ``requests`` and its chardet above all, took ~5 s of each
replica's start on a loaded 2-core machine)."""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import torch

from splitlearn.api import protocol as P

TOKEN = "tok-5c1f0e8b2a9d4e77"  # serverproc.TOKEN (serverproc imports requests; the test checks they agree)
K = 3  # clients per round: a and b on replica 0, c on replica 1


def _config(k=K, aggregation="fedavg", store=None, rank=0, world=1, timeout_s=5.0, lora=False):
    from splitlearn.model.lora import LoraSpec
    from splitlearn.server.config import ServerConfig

    extra = {} if store is None else dict(fed_store=store, fed_rank=rank, fed_world_size=world, fed_timeout_s=timeout_s)
    return ServerConfig(model="tiny", cuts=(2,), optimizer="sgd", lr=0.1, tokens=(TOKEN,), federation="splitfed",
                        clients_per_round=k, aggregation=aggregation, max_update_norm=5.0, torch_threads=1,
                        round_timeout_s=60.0, lora=LoraSpec(4, 8.0, ("c_attn", "c_proj")) if lora else None, **extra)


def _member_data(key: str):
    g = torch.Generator().manual_seed(sum(map(ord, key)))
    rows = 4 if key.startswith("b") else 2  # members of different sizes: FedAvg weights them by rows
    return torch.randn(rows, 6, 32, generator=g), torch.randint(0, 256, (rows, 6), generator=g)


def _client_upload(rt, key: str) -> dict:
    g = torch.Generator().manual_seed(100 + sum(map(ord, key)))
    fed = rt.federation
    init = fed.client_weights if fed.client_weights is not None else fed.clientside.initial()
    scale = 50.0 if key.startswith("c") else 0.01  # c's upload is long: bounded (--max-update-norm 5) on its replica
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in init.items()}


def _train_and_sync(rt, keys, step=1):
    for key in keys:
        h, y = _member_data(f"{key}{step}")
        rt.compute.run(rt.train_step, P.StepMeta(f"t:{key}", step, "float32", fed_version=rt.federation.version),
                       h, y, None)
        rt.compute.run(rt.train_apply, f"t:{key}", P.ApplyRequest(key, step, 1, rt.cfg.lr))  # the member's copy
    for key in keys:
        rt.sync(f"t:{key}", _client_upload(rt, f"{key}{step}"))


def _result(rt) -> dict:
    fed = rt.federation
    out = {f"server/{k}": v.detach().clone() for k, v in fed.base.segment.state_dict().items()}
    out.update({f"client/{k}": v.clone() for k, v in (fed.client_weights or {}).items()})
    return out


def _wait(cond, timeout_s=60.0, what="a condition"):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _replica(rank, port, world, out, keys, aggregations, die_after_sync, linger, lora=False):
    """A replica in its own process: for each round (its strategy in ``aggregations``), train one
    step of ``keys``, sync them, wait for the round to close and write its weights and status to
    ``out``; ``linger``: then stay in the group until the file ``out/stop`` appears."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)  # (torch is imported already: the module's import, the fork server's)
    from safetensors.torch import save_file

    from splitlearn.server.engine.runtime import SegmentRuntime
    from splitlearn.server.federation.strategy import make_strategy

    rt = SegmentRuntime(_config(store=f"127.0.0.1:{port}", rank=rank, world=world, lora=lora))
    fed = rt.federation
    _wait(fed.group.ready.is_set, what="the group")
    if die_after_sync:  # this replica never contributes to a close: it dies first, however the
        # threads are scheduled (the round's collective could otherwise finish with it still alive)
        fed.freeze_round = lambda number: threading.Event().wait()
    for n, aggregation in enumerate(aggregations or ["fedavg"], start=1):
        fed.strategy = make_strategy(aggregation, 5.0)  # (every replica switches between rounds)
        if aggregations:
            _train_and_sync(rt, keys, n)
        if die_after_sync:  # synced, then the replica dies before the round can close
            _wait(lambda: fed.group.counts(fed.round.number)[1] >= K, what="every sync")
            os._exit(3)
        _wait(lambda: fed.version >= n, timeout_s=90, what="the round to close")
        save_file({k: v.contiguous() for k, v in _result(rt).items()}, str(Path(out) / f"r{rank}-{n}.safetensors"))
        status = rt.compute.run(fed.status)
        (Path(out) / f"r{rank}-{n}.json").write_text(json.dumps({"status": status, "version": fed.version}))
    if linger:
        _wait(lambda: (Path(out) / "stop").exists(), timeout_s=120, what="the test")
    os._exit(0)  # (no atexit in a process whose gloo group may be half torn down)


def _spawn(*args):
    """A replica process (:func:`_replica`): forked from the tests' fork server (torch and the server
    package imported), without importing pytest's ``__main__`` or a test module there (this
    module's ``requests`` pulls chardet: ~5 s of a loaded child's start); spawned where the tests'
    servers are not forked (``SPLITLEARN_FORK_SERVERS=0``)."""
    import forkserver

    ctx = forkserver.process_context()  # (starts the fork server, or says "spawn")
    if ctx.get_start_method() == "forkserver":
        p = forkserver._ServerProcess(target=_replica, args=args, daemon=True)
    else:
        p = ctx.Process(target=_replica, args=args, daemon=True)
    p.start()
    return p
