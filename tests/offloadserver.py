"""The tests' masked-offload server (tests/test_offload_server.py, tests/test_offload_families.py):
``python -m splitlearn.server --model M --offload`` on a loopback port, in this process, its runtime
a subclass with two test hooks (record every input; tamper with answers)."""
import dataclasses
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch

from splitlearn.offloadmath import field as F
from splitlearn.procs.localserver import free_port
from splitlearn.server.config import ServerConfig
from splitlearn.server.engine.offload import OffloadRuntime
from splitlearn.api.wire import encode

from serverproc import TOKEN

LOGIT_TOL = 1e-4  # stated in docs/OFFLOAD.md for tiny (measured ~1e-6)


class HookedOffload(OffloadRuntime):
    """The offload server's runtime with the tests' hooks: ``record`` (a directory) keeps every
    input it receives, one file per request; ``tamper`` (N) alters one element of every answer
    from the N-th product on (0: never)."""

    def __init__(self, cfg: ServerConfig, record: Optional[Path] = None, tamper: int = 0):
        self.record, self.tamper, self.recorded = record, tamper, 0
        super().__init__(cfg)

    def validate(self, tensors: dict, meta: dict):
        scheme, items = super().validate(tensors, meta)
        if self.record is not None:
            with self.lock:
                self.recorded += 1
                seq = self.recorded
            data = encode({f"x.{k}": x for k, (_, x) in enumerate(items)},
                          {"layers": ",".join(n for n, _ in items), "scheme": scheme, "seq": str(seq)})
            (self.record / f"{seq:07d}.safetensors").write_bytes(data)
        return scheme, items

    def product(self, name: str, x: torch.Tensor) -> torch.Tensor:
        z = super().product(name, x)  # (products run on the one compute thread, in order)
        if self.tamper and self.served >= self.tamper:
            z[0, 0, 0] = (int(z[0, 0, 0]) + 1) % F.PRIMES[0]
        return z


@contextmanager
def offload_server(*extra, model: str = "tiny", record: Optional[Path] = None, tamper: int = 0):
    """``python -m splitlearn.server --model MODEL --offload EXTRA`` on a loopback port, its
    runtime a :class:`HookedOffload`; yields an object with ``url``."""
    from splitlearn.server import create_app
    from splitlearn.server.http.cli import parse_args
    from splitlearn.server.http.frontdoor import make_server

    cfg = parse_args(["--model", model, "--offload", "--threads", "2", "--port", str(free_port()),
                      "--log-level", "WARNING", *extra])
    cfg = dataclasses.replace(cfg, tokens=(TOKEN,), generated_token=False)
    rt = HookedOffload(cfg, record, tamper)
    app = create_app(runtime=rt)
    server = make_server(app, cfg.tenants, host=cfg.host, port=cfg.port, threads=cfg.threads,
                         max_body_bytes=cfg.max_body_bytes, limits=cfg.door_limits())
    loop = threading.Thread(target=server.run, daemon=True)
    loop.start()
    srv = type("OffloadServer", (), {})()
    srv.url, srv.token, srv.record = f"http://{cfg.host}:{cfg.port}", TOKEN, record
    try:
        yield srv
    finally:  # closed on its loop's thread, which then returns
        from waitress import wasyncore
        server.trigger.pull_trigger(lambda: wasyncore.close_all(server._map))
        loop.join(10)
        server.task_dispatcher.shutdown()
        rt.compute.close()
