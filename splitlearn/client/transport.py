"""HTTP transport of the client: one keep-alive ``requests.Session``, retries, statistics.

Every tensor exchange goes through :meth:`Transport.call`: encode the tensors (safetensors,
:mod:`splitlearn.wire`), POST them, decode the answer, and count bytes and times in
:class:`WireStats`. JSON control calls use :meth:`get_json` / :meth:`post_json`.

Only connection failures are retried (with exponential backoff): the request never
reached the server, or the server went away mid-request. That is safe for every splitlearn
route because training steps are numbered and answered exactly once (a retry of an applied
step gets the stored answer). HTTP error answers are never retried here; they are turned
back into the :mod:`splitlearn.errors` class the server raised.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Optional

import requests

from .. import protocol as P
from ..errors import ConfigError, SplitLearnError, TransportError, from_payload
from ..wire import decode, encode

log = logging.getLogger(__name__)


@dataclass
class TransportConfig:
    url: str  # server base URL, e.g. http://127.0.0.1:8000
    token: Optional[str] = None  # bearer token
    connect_timeout_s: float = 5.0  # seconds to open a TCP connection
    read_timeout_s: float = 300.0  # seconds to wait for an answer
    retries: int = 6  # extra attempts after a connection failure
    backoff_s: float = 0.1  # first wait between attempts; doubles each time (0.1 .. 3.2 s)

    def __post_init__(self):
        self.url = self.url.rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"server URL must start with http:// or https://, got {self.url!r}")
        if self.retries < 0 or self.backoff_s < 0:
            raise ConfigError("retries and backoff_s must be >= 0")


@dataclass
class WireStats:
    """Per-client call statistics (the ones seed 001's RPC server kept)."""

    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    serialize_s: float = 0.0  # encoding request bodies
    deserialize_s: float = 0.0  # decoding answers
    round_trip_s: float = 0.0  # from sending a request to having its answer
    server_compute_s: float = 0.0  # what the server reported spending (X-Server-Time-Ms)
    retries: int = 0

    @property
    def overhead_s(self) -> float:
        """Round trips minus server compute: what the network and HTTP cost."""
        return self.round_trip_s - self.server_compute_s

    def as_dict(self) -> dict:
        return {**asdict(self), "overhead_s": self.overhead_s}


class Transport:
    def __init__(self, cfg: TransportConfig):
        self.cfg = cfg
        self.stats = WireStats()
        self.http = requests.Session()
        self.http.headers["User-Agent"] = "splitlearn-client"
        if cfg.token:
            self.http.headers["Authorization"] = f"Bearer {cfg.token}"

    def close(self) -> None:
        self.http.close()

    def _send(self, method: str, path: str, **kw) -> requests.Response:
        url = self.cfg.url + path
        timeout = (self.cfg.connect_timeout_s, self.cfg.read_timeout_s)
        for attempt in range(self.cfg.retries + 1):
            try:
                resp = self.http.request(method, url, timeout=timeout, **kw)
                break
            except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as e:
                if attempt == self.cfg.retries:
                    raise TransportError(f"cannot reach {url} after {attempt + 1} attempts: {e}") from None
                self.stats.retries += 1
                wait = self.cfg.backoff_s * (2 ** attempt)
                log.warning("%s %s failed (%s); retrying in %.1fs", method, path, type(e).__name__, wait)
                time.sleep(wait)
        if resp.status_code >= 400:
            raise self._error(resp)
        return resp

    @staticmethod
    def _error(resp: requests.Response) -> SplitLearnError:
        retry_after = resp.headers.get("Retry-After")
        try:
            payload = resp.json()
        except ValueError:
            payload = {"error": "transport", "message": f"HTTP {resp.status_code}: {resp.text[:200]}"}
        return from_payload(resp.status_code, payload, float(retry_after) if retry_after else None)

    def get_json(self, path: str) -> dict:
        return self._send("GET", path).json()

    def post_json(self, path: str, payload: dict) -> dict:
        return self._send("POST", path, json=payload).json()

    def delete(self, path: str) -> None:
        self._send("DELETE", path)

    def call(self, path: str, tensors: dict, meta: Optional[dict] = None) -> dict:
        """POST ``tensors`` (+ string ``meta``) as safetensors; return the answer's tensors."""
        t0 = time.perf_counter()
        body = encode(tensors, meta)
        t1 = time.perf_counter()
        answer = self.post_bytes(path, body)
        t2 = time.perf_counter()
        out, _ = decode(answer)
        self.stats.serialize_s += t1 - t0
        self.stats.deserialize_s += time.perf_counter() - t2
        return out

    def post_bytes(self, path: str, body: bytes) -> bytes:
        """POST a safetensors body; return the answer's bytes, counting everything."""
        t0 = time.perf_counter()
        resp = self._send("POST", path, data=body, headers={"Content-Type": P.CONTENT_TYPE})
        content = resp.content
        s = self.stats
        s.round_trip_s += time.perf_counter() - t0
        s.calls += 1
        s.bytes_sent += len(body)
        s.bytes_received += len(content)
        s.server_compute_s += float(resp.headers.get(P.SERVER_TIME_HEADER, 0.0)) / 1e3
        return content
