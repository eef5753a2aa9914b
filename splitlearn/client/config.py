"""``ClientConfig``: every option of a :class:`~splitlearn.client.SplitClient`, in one dataclass.

    from splitlearn.client import ClientConfig, SplitClient
    cfg = ClientConfig(lr=3e-4, wire_dtype="bfloat16", micro_batches=4)
    client = SplitClient(url, "gpt2", config=cfg)                  # or: SplitClient(url, "gpt2", lr=3e-4, ...)
    client = SplitClient(url, "gpt2", config=cfg, client_id="alice")  # keyword options override the config

The fields are the constructor's keyword options, with the same names and defaults, so code
written against the keywords keeps working; a config can be built once, validated before any
network call, stored and reused. Bad values raise :class:`~splitlearn.errors.ConfigError`
here, before the client contacts the server. Each field is written once, with its help: the
connection's and the model's in :mod:`splitlearn.hf.config` (a split model's
``from_pretrained`` takes the same), the client's own here; ``python -m splitlearn.client``'s
options are generated from them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from ..procs.clihelp import opt
from ..errors import ConfigError
from ..hf.config import Connection, ModelOptions


@dataclass(kw_only=True)
class Optimizer:
    """The client's optimizer"""

    optimizer: str = opt("adamw", "the client's optimizer (the server steps its own: match its --optimizer)",
                         choices=("adamw", "sgd"))
    lr: float = opt(1e-3, "the client's learning rate")
    weight_decay: float = opt(0.0, "the client's weight decay")


@dataclass(kw_only=True)
class Compute:
    """Where and how the client computes"""

    device: str = opt("auto", "where the client's blocks run (auto: cuda if there is one)",
                      choices=("auto", "cpu", "cuda"))
    packed_weights: bool = opt(True, "generation runs on oneDNN prepacked copies of the client's linear weights "
                                     "(CPU, float32); --no-packed-weights: on the weights themselves",
                               flag="--no-packed-weights")
    poll_idle: bool = opt(False, "keep this process's cores polling instead of sleeping between messages "
                                 "(Linux; lower latency per step for the cores' idle time: splitlearn/procs/idlepoll.py)")


@dataclass(kw_only=True)
class ClientConfig(Compute, Optimizer, ModelOptions, Connection):
    """Every option of a :class:`~splitlearn.client.SplitClient`: the connection
    (:class:`~splitlearn.hf.config.Connection`), what the model adds
    (:class:`~splitlearn.hf.config.ModelOptions`), the optimizer and where it computes; each
    field is written once, with its help (the client's ``--help`` shows it)."""

    def __post_init__(self):
        Connection.__post_init__(self)
        ModelOptions.__post_init__(self)
        if self.optimizer not in ("adamw", "sgd"):
            raise ConfigError(f"unknown optimizer {self.optimizer!r}; choose adamw or sgd")
        for name in ("lr", "weight_decay"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")

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
