"""The transport layer: how a client reaches a server. Imports only the root and :mod:`splitlearn.api`.

- :mod:`.http`: :class:`Transport` (keep-alive HTTP, lanes, retries, :class:`WireStats`);
- :mod:`.busy`: :func:`~.busy.wait_while_busy`, calling again while the server answers busy;
- :mod:`.inproc`: ``inproc://`` URLs, a server app in this process reached without a socket
  (tests, experiments), through the scheme hook of :mod:`.http` (``register_scheme``);
- :mod:`.unix`: ``unix:///path.sock`` URLs, a server on the same host over a Unix socket with
  bodies in shared memory (:mod:`.unixframe`: the frames; docs/TRANSPORT.md).

The model classes (:mod:`splitlearn.hf`), :class:`~splitlearn.client.SplitClient`, the masked
offload and the analyzer all reach a server through these; docs/ARCHITECTURE.md draws the layers.
"""
from .http import PendingCall, Transport, TransportConfig, WireStats, shares_cores_with_server
from . import unix  # noqa: F401,E402 - registers unix:// (a server's --listen unix:///path.sock)

__all__ = ["PendingCall", "Transport", "TransportConfig", "WireStats", "shares_cores_with_server"]
