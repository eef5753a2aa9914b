"""The client's options, each written once with its default and its help (issue 43):
:class:`Connection` (how a client talks to the server), :class:`RemoteConfig` (that, at a
``server``: what a :class:`~splitlearn.hf.remote.RemoteSegment` is built from) and
:class:`ModelOptions` (what a split model adds). A split model's ``from_pretrained`` takes
exactly the fields of :class:`SplitOptions` (both) as keywords; ``ClientConfig``
(:mod:`splitlearn.client.config`) extends them with the client's own, and the client's command
line is generated from the fields (:mod:`splitlearn.procs.clihelp`).

Nothing here imports torch at module level: the client's ``--help`` reads these fields.
"""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from ..procs.clihelp import opt
from ..errors import ConfigError, SplitLearnError

WIRE_DTYPES = ("float32", "bfloat16", "float16", "int8")  # splitlearn.api.wire.WIRE_DTYPE_NAMES (a test keeps them equal)


def token_of_file(path: str) -> str:
    """The token of a token file's first line (``--token-file``, ``--fed-token-file``)."""
    from ..api.protocol import parse_token_line, read_token_file

    return parse_token_line(read_token_file(path)[0])[1]


class _Names:
    @classmethod
    def names(cls, skip: tuple = ()) -> tuple[str, ...]:
        """The names of the fields (less ``skip``)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in skip)


@dataclass(kw_only=True)
class Connection(_Names):
    """How this client talks to the server"""

    token: Optional[str] = opt(None, "the bearer token (default: $SPLITLEARN_TOKEN); on the command line, a file "
                                     "whose first line is it", flag="--token-file", parse=token_of_file,
                               metavar="FILE")
    client_id: Optional[str] = opt(None, "this data owner's name on the server, 1-64 of [A-Za-z0-9_.-] "
                                         "(default: random)")
    wire_dtype: str = opt("float32", "dtype of the activations and gradients on the wire (docs/PROTOCOL.md)",
                          choices=WIRE_DTYPES)
    timeout_s: float = opt(300.0, "seconds to wait for one answer")
    retries: int = opt(6, "reconnects after a dropped connection (numbered requests: exactly once)")
    wait_timeout_s: float = opt(600.0, "seconds to wait for a busy segment, a sequential turn or a splitfed round "
                                       "before failing")
    reconnect_timeout_s: float = opt(120.0, "seconds to wait for a crashed or restarting server to come back "
                                            "(then the journal replays)")
    fed_url: Optional[str] = opt(None, "federation: a separate fed server that averages the client-side weights "
                                       "(a segment server started with --client-weights external)")
    fed_token: Optional[str] = opt(None, "the fed server's own token, never the segment server's (default: "
                                         "$SPLITLEARN_FED_TOKEN); on the command line, a file whose first line is "
                                         "it", flag="--fed-token-file", parse=token_of_file,
                                   metavar="FILE")
    journal_dir: Optional[Union[str, Path]] = opt(None, "the crash journal: the request log on disk too, with the "
                                                        "client's checkpoint (the command line: train --save)",
                                                  cli=False)
    min_client_blocks: int = opt(1, "refuse a server whose first cut leaves fewer blocks here (0 accepts a "
                                    "server that receives the raw token embeddings)")
    expected_cuts: Optional[tuple[int, ...]] = opt(None, "refuse a server whose cuts are not exactly these "
                                                         "(e.g. --expected-cuts 2 10)", nargs="+", metavar="CUT")
    shape: Optional[str] = opt(None, "refuse a server of the other shape (u: the labels never leave this "
                                     "machine)", choices=("u", "2way"))

    def __post_init__(self):
        from ..api import protocol as P
        from ..api.wire import check_wire_dtype

        self.pins  # ConfigError now if malformed
        if self.client_id is not None and not P.valid_client_id(self.client_id):
            raise ConfigError(f"client_id must be 1-64 characters of [A-Za-z0-9_.-], got {self.client_id!r}")
        try:
            self.wire_dtype = check_wire_dtype(self.wire_dtype)
        except SplitLearnError as e:  # the wire's own error is the server's 400
            raise ConfigError(str(e)) from None
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        for name in ("wait_timeout_s", "reconnect_timeout_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not isinstance(self.retries, int) or self.retries < 0:
            raise ConfigError(f"retries must be an integer >= 0, got {self.retries!r}")

    @property
    def pins(self):
        """What this client accepts of a server's split (:class:`splitlearn.api.trust.Pins`), checked
        on its ``/v1/info`` before anything is sent."""
        from ..api.trust import Pins

        return Pins(self.min_client_blocks, self.expected_cuts, self.shape)


@dataclass(kw_only=True)
class RemoteConfig(Connection):
    """Where the server is and how to talk to it."""

    server: str = opt(help="server URL, e.g. http://127.0.0.1:8000 or unix:///run/splitlearn.sock")
    # how long a step's apply waits for the next step's first request to carry it before it is sent
    # alone: the server holds a shared segment for this client until then (at most a third of the lease)
    apply_wait_s: float = opt(0.1, "seconds a step's apply waits for the next step's first request to carry it "
                                   "before it is sent alone (at most a third of the server's lease)", cli=False)

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.apply_wait_s <= 60:
            raise ConfigError(f"apply_wait_s must be in (0, 60] seconds, got {self.apply_wait_s}")

    @classmethod
    def given(cls, server: str, options: dict, what: str) -> "RemoteConfig":
        """The config of ``server`` with ``options`` (keywords of ``what``); an unknown one is a
        ConfigError naming the known ones."""
        known = {f.name for f in dataclasses.fields(cls)} - {"server"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown {what} option(s) {', '.join(unknown)}; the options are "
                              f"{', '.join(sorted(known))}")
        return cls(server=server, **options)

    @classmethod
    def of(cls, server: str, options: Connection, **more) -> "RemoteConfig":
        """The config of ``server`` carrying every :class:`Connection` field of ``options`` (a
        ``ClientConfig``, a :class:`SplitOptions`...); ``more``: RemoteConfig's own fields."""
        return cls(server=server, **{f.name: getattr(options, f.name) for f in dataclasses.fields(Connection)},
                   **more)


@dataclass(kw_only=True)
class ModelOptions(_Names):
    """What the split model adds"""

    seed: int = opt(0, "seed of a spec model's weights and of a new head (the server's spec and seed give its "
                       "weights); train: also of the batches")
    defense: Any = opt(None, "a splitlearn.privacy Defense (GaussianNoise, NoPeek) on every activation sent "
                             "(the command line: --noise-sigma, --nopeek)", cli=False)
    lora: Any = opt(None, "per-client LoRA: a peft.LoraConfig, a splitlearn.model.lora.LoraSpec or \"server\" (the "
                          "server's options; the command line: train --lora)", cli=False)
    micro_batches: int = opt(1, "split each training batch into this many micro-batches, pipelined with the "
                                "server so that both compute at once (GPipe)")

    def __post_init__(self):
        from ..api import protocol as P

        m = self.micro_batches
        if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= P.MAX_MICROS:
            raise ConfigError(f"micro_batches must be an integer in 1..{P.MAX_MICROS}, got {m!r}")


HEAD_OPTIONS = ("defense", "lora", "micro_batches")  # the ModelOptions of a head model (not the trunk's)


@dataclass(kw_only=True)
class SplitOptions(ModelOptions, RemoteConfig):
    """The keywords of a split model's ``from_pretrained``: :class:`RemoteConfig`'s and
    :class:`ModelOptions`'."""

    def __post_init__(self):
        RemoteConfig.__post_init__(self)
        ModelOptions.__post_init__(self)

    @property
    def remote_config(self) -> RemoteConfig:
        return RemoteConfig.of(self.server, self, apply_wait_s=self.apply_wait_s)

    @classmethod
    def take(cls, kwargs: dict, skip: tuple = ()) -> "SplitOptions":
        """The options among ``kwargs`` (taken out of it: what is left goes to the head's config,
        ``num_labels=3``), checked; ``skip``: names left in ``kwargs``."""
        given = {k: kwargs.pop(k) for k in cls.names(skip) if k in kwargs}
        if given.get("server") is None:
            raise ConfigError("from_pretrained of a split model needs server=URL (the splitlearn server)")
        return cls(**given)


def with_options(*names: str):
    """Give a ``from_pretrained(cls, source, *model_args, **kwargs)`` the signature that names
    its options (keyword-only, with their defaults: ``help()`` and editors show them)."""
    fields = {f.name: f for f in dataclasses.fields(SplitOptions)}

    def default(f):
        return f.default if f.default is not dataclasses.MISSING else inspect.Parameter.empty

    names = sorted(names, key=lambda n: n != "server")  # the server first

    def wrap(func):
        sig = inspect.signature(func)
        params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
        params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=default(fields[n]))
                   for n in names]
        params += [p for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD]
        func.__signature__ = sig.replace(parameters=params)
        return func

    return wrap
