"""``RemoteConfig``: where the server is and how the model classes talk to it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..api import protocol as P
from ..errors import ConfigError
from ..api.trust import Pins
from ..api.wire import check_wire_dtype


@dataclass
class RemoteConfig:
    """Where the server is and how to talk to it."""

    server: str  # base URL, e.g. http://127.0.0.1:8000
    token: Optional[str] = None  # bearer token (default $SPLITLEARN_TOKEN)
    client_id: Optional[str] = None  # this data owner's name on the server (default: random)
    wire_dtype: str = "float32"  # float32, bfloat16, float16 or int8 for activations and gradients
    timeout_s: float = 300.0  # seconds to wait for one answer
    retries: int = 6  # reconnects after a dropped connection (numbered requests: exactly once)
    wait_timeout_s: float = 600.0  # the longest wait for a segment busy with another client's step
    reconnect_timeout_s: float = 120.0  # the longest wait for a crashed server to come back (then replay)
    pins: Pins = field(default_factory=Pins)  # the splits this client accepts (splitlearn.trust): checked on /v1/info
    fed_url: Optional[str] = None  # a separate fed server for the client-side weights (federation modes)
    fed_token: Optional[str] = None  # its own token (default $SPLITLEARN_FED_TOKEN; never the segment server's)
    journal_dir: Optional[str] = None  # the request log on disk too, with the client's checkpoint (.journal)
    # how long a step's apply waits for the next step's first request to carry it before it is sent
    # alone: the server holds a shared segment for this client until then (at most a third of the lease)
    apply_wait_s: float = 0.1

    def __post_init__(self):
        self.wire_dtype = check_wire_dtype(self.wire_dtype)
        if not isinstance(self.pins, Pins):
            raise ConfigError(f"pins must be a splitlearn.trust.Pins, got {type(self.pins).__name__}")
        if self.client_id is not None and not P.valid_client_id(self.client_id):
            raise ConfigError(f"client_id must be 1-64 characters of [A-Za-z0-9_.-], got {self.client_id!r}")
        if not 0 < self.apply_wait_s <= 60:
            raise ConfigError(f"apply_wait_s must be in (0, 60] seconds, got {self.apply_wait_s}")
