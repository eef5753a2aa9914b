"""The fed server's options (:class:`FedConfig`: what it shares with its segment server;
:class:`FedServe`: where it listens, its tenants): plain data without torch, so its command's
``--help`` and a bad option are answered before torch is imported (:mod:`splitlearn.server.http.fedcli`,
as ``python -m splitlearn.server``'s). Its state is :mod:`.fedserver`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from ...errors import ConfigError
from ...model.loraspec import LoraSpec  # plain data: no torch
from ...api.protocol import read_token_file
from ..config import GiB, MiB, Observability, StrategyOptions, check_secret, read_secret_file
from ..options import opt
from ..tenants import Tenants


@dataclass
class FedConfig(StrategyOptions):
    """What the fed server shares with its segment server"""

    model: str = opt(help="the segment server's --model (the client-side schema)")
    cuts: tuple[int, ...] = opt(help="the segment server's --cut(s)", flag="--cut")
    secret: bytes = opt(help="the secret shared with the segment server (>= 32 bytes)", flag="--fed-secret-file",
                        parse=read_secret_file, repr=False)
    mode: str = opt("splitfed", "the segment server's --federation", choices=("splitfed", "sequential"))
    seed: int = opt(0, "the segment server's --seed")
    lora: Optional[LoraSpec] = opt(None, cli=False)  # the segment server's --lora-* (client-side adapters only)
    upload_timeout_s: float = opt(60.0, "seconds a closed round waits for a member's upload before closing "
                                        "without it")

    def __post_init__(self):
        self.check_strategy()
        if self.mode not in ("splitfed", "sequential"):
            raise ConfigError(f"a fed server runs sequential or splitfed, not {self.mode!r}")
        if not self.upload_timeout_s > 0:
            raise ConfigError(f"--upload-timeout must be > 0 seconds, got {self.upload_timeout_s}")
        check_secret(self.secret)
        self.cuts = tuple(self.cuts)


@dataclass(kw_only=True)
class FedServe(Observability):
    """Where the fed server listens, and its own tenants (and, from Observability: --log-level,
    --log-format, --access-log, --metrics-port, --no-request-log, as on the segment server)"""

    tokens: tuple[str, ...] = opt((), "this server's tenants, '<name> <token>' per line, named as on the segment "
                                      "server (default: $SPLITLEARN_FED_TOKEN, comma-separated)",
                                  flag="--token-file", parse=read_token_file, metavar="TOKEN_FILE")
    allow_weak_tokens: bool = opt(False, "accept tokens under 16 characters (tests only)")
    host: str = opt("127.0.0.1", "address to listen on")
    port: int = opt(8001, "port to listen on")
    max_body_bytes: int = opt(2048 * MiB, "larger request bodies get 413 (MiB)", flag="--max-body-mb", unit=MiB)
    max_memory_bytes: Optional[int] = opt(
        None, "memory (GiB) the request bodies of all tenants may hold at once (503 beyond, at their headers); "
              "default: 0.75 of the memory available at start (splitlearn/server/engine/memory.py)",
        flag="--max-memory-gb", unit=GiB)
    max_tenant_memory_bytes: Optional[int] = opt(
        None, "what one tenant's bodies may hold of it (429 beyond); default: all with one tenant, else half",
        flag="--max-tenant-memory-gb", unit=GiB)

    def __post_init__(self):
        for name in ("max_memory_bytes", "max_tenant_memory_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"--{name[:-6].replace('_', '-')}-gb must be > 0")
        if self.log_format not in ("text", "json"):
            raise ConfigError(f"--log-format must be text or json, got {self.log_format!r}")
        if self.metrics_port is not None and not (0 < self.metrics_port < 65536 and self.metrics_port != self.port):
            raise ConfigError(f"--metrics-port must be in 1..65535 and not --port, got {self.metrics_port}")

    def tenants(self) -> Tenants:
        tokens = self.tokens or tuple(t.strip() for t in os.environ.get("SPLITLEARN_FED_TOKEN", "").split(",")
                                      if t.strip())
        return Tenants(tokens, allow_weak=self.allow_weak_tokens)
