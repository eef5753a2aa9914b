"""``ClientConfig``: every option of a :class:`~splitlearn.client.SplitClient`, in one dataclass.

    from splitlearn.client import ClientConfig, SplitClient
    cfg = ClientConfig(lr=3e-4, wire_dtype="bfloat16", micro_batches=4)
    client = SplitClient(url, "gpt2", config=cfg)                  # or: SplitClient(url, "gpt2", lr=3e-4, ...)
    client = SplitClient(url, "gpt2", config=cfg, client_id="alice")  # keyword options override the config

The fields are the constructor's keyword options, with the same names and defaults, so code
written against the keywords keeps working; a config can be built once, validated before any
network call, stored and reused. Bad values raise :class:`~splitlearn.errors.ConfigError`
here, before the client contacts the server.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from ..api import protocol as P
from ..errors import ConfigError, SplitLearnError
from ..api.trust import Pins
from ..api.wire import check_wire_dtype


@dataclass
class ClientConfig:
    token: Optional[str] = None  # bearer token (default $SPLITLEARN_TOKEN)
    optimizer: str = "adamw"  # the client's optimizer: adamw | sgd
    lr: float = 1e-3
    weight_decay: float = 0.0
    device: str = "auto"  # auto | cpu | cuda
    wire_dtype: str = "float32"  # float32 | bfloat16 | float16 | int8: the tensors this client sends and asks for
    client_id: Optional[str] = None  # this data owner's name on the server (1-64 of [A-Za-z0-9_.-]; default random)
    seed: int = 0  # seeds a spec model's weights (the same spec and seed as the server's)
    timeout_s: float = 300.0  # read timeout of one call
    retries: int = 6  # retries of a call that failed on the connection
    wait_timeout_s: float = 600.0  # longest wait for a busy segment, a sequential turn or a splitfed round
    reconnect_timeout_s: float = 120.0  # longest wait for a crashed server to come back
    journal_dir: Optional[Union[str, Path]] = None  # the crash journal: survives a client crash
    defense: Any = None  # splitlearn.privacy.Defense applied to every activation sent
    micro_batches: int = 1  # pipelined training: micro-batches in flight
    fed_url: Optional[str] = None  # a separate fed server that averages the client-side weights
    fed_token: Optional[str] = None  # the fed server's own token (default $SPLITLEARN_FED_TOKEN)
    lora: Any = None  # per-client LoRA: a peft.LoraConfig, a splitlearn.lora.LoraSpec or "server"
    packed_weights: bool = True  # generate on oneDNN prepacked copies of the client's linear weights
    poll_idle: bool = False  # keep this process's cores polling while the server works (Linux)
    min_client_blocks: int = 1  # refuse a server whose first cut leaves fewer blocks here (0 sends raw embeddings)
    expected_cuts: Optional[tuple] = None  # refuse a server whose cuts are not exactly these (None: any)
    shape: Optional[str] = None  # "u": refuse a 2-way server (the labels stay here); "2way"; None: either

    def __post_init__(self):
        Pins(self.min_client_blocks, self.expected_cuts, self.shape)  # ConfigError now if malformed
        if not isinstance(self.micro_batches, int) or not 1 <= self.micro_batches <= P.MAX_MICROS:
            raise ConfigError(f"micro_batches must be an integer in 1..{P.MAX_MICROS}, got {self.micro_batches!r}")
        if self.client_id is not None and not P.valid_client_id(self.client_id):
            raise ConfigError(f"client_id must be 1-64 characters of [A-Za-z0-9_.-], got {self.client_id!r}")
        try:
            self.wire_dtype = check_wire_dtype(self.wire_dtype)
        except SplitLearnError as e:  # the wire's own error is the server's 400
            raise ConfigError(str(e)) from None
        if self.optimizer not in ("adamw", "sgd"):
            raise ConfigError(f"unknown optimizer {self.optimizer!r}; choose adamw or sgd")
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        for name in ("lr", "weight_decay", "wait_timeout_s", "reconnect_timeout_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not isinstance(self.retries, int) or self.retries < 0:
            raise ConfigError(f"retries must be an integer >= 0, got {self.retries!r}")

    @property
    def pins(self) -> Pins:
        """What this client accepts of a server's split, checked on its ``/v1/info``."""
        return Pins(self.min_client_blocks, self.expected_cuts, self.shape)

    @classmethod
    def of(cls, config: Optional["ClientConfig"] = None, **options) -> "ClientConfig":
        """``config`` (default: the defaults) with ``options`` replacing its fields; an unknown
        option is a :class:`ConfigError` naming the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown SplitClient option(s) {', '.join(unknown)}; the options are "
                              f"{', '.join(sorted(known))}")
        if config is not None and not isinstance(config, cls):
            raise ConfigError(f"config must be a ClientConfig, got {type(config).__name__}")
        return dataclasses.replace(config, **options) if config is not None else cls(**options)
