"""``RemoteDecoder``: the ``step`` of :func:`splitlearn.generation.decode` with the server in the middle.

One generation session on the server holds the KV cache of its segment; the client keeps the
KV caches of its own segments and the bottom's outputs so far. A decode step::

    new ids -> bottom (cache 0) -> h (B, T, d) --POST /v1/sessions/<sid>/step (h, new mask)-->
        2-way:   logits of the last position (B, V)
        U-shape: trunk output (B, T, d) -> top (cache 1) -> logits of the last position (B, V)

Each step sends only the new positions and their mask columns (the server keeps the rest),
so a decode step's request does not grow with the sequence. If the server loses the session
(restart, expiry), a new session is opened and the bottom outputs so far are replayed once.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch

from .. import protocol as P
from ..errors import NotFound, TransportError
from ..segments import Segment
from ..wire import pack, unpack
from .transport import Transport

log = logging.getLogger(__name__)


class RemoteDecoder:
    """Client side of one generation session over ``transport``.

    segments: the client's own segments, ``[bottom]`` (2-way) or ``[bottom, top]`` (U-shape).
    to_local: moves a received tensor to the client's device and compute dtype.
    """

    def __init__(self, transport: Transport, segments: Sequence[Segment], rows: int, wire_dtype: str,
                 to_local: Callable[[torch.Tensor], torch.Tensor]):
        self.transport = transport
        self.segments = list(segments)
        self.u_shape = len(self.segments) == 2
        self.rows = rows
        self.wire_dtype = wire_dtype
        self.to_local = to_local
        self.caches = [s.new_cache() for s in self.segments]
        self.history: Optional[torch.Tensor] = None  # (B, L, d) bottom outputs so far
        self.sid = self._open()

    def _open(self) -> str:
        return self.transport.post_json(P.SESSIONS, {"rows": self.rows})["session_id"]

    def _server(self, h: torch.Tensor, mask: torch.Tensor, position: int) -> torch.Tensor:
        path = P.SESSION_STEP.format(session_id=self.sid)
        meta = P.SessionStepMeta(position, self.wire_dtype).to_meta()
        new_mask = mask[:, -h.shape[1]:].cpu()  # (B, T): the server keeps the earlier columns
        out = self.transport.call(path, {**pack(P.HIDDEN, h, self.wire_dtype), P.MASK: new_mask}, meta)
        return self.to_local(unpack(out, P.HIDDEN if self.u_shape else P.LOGITS))

    @torch.no_grad()
    def step(self, new_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Logits (B, V) of the last position after feeding ``new_ids`` (B, T); ``mask`` (B, L)."""
        for seg in self.segments:
            seg.eval()
        T = new_ids.shape[1]
        h = self.segments[0](new_ids, mask, self.caches[0])  # (B, T, d)
        self.history = h if self.history is None else torch.cat([self.history, h], dim=1)
        position = self.history.shape[1] - T
        try:
            out = self._server(h, mask, position)
        except (NotFound, TransportError) as e:
            log.warning("generation session lost (%s); replaying %d positions", e, self.history.shape[1])
            self.sid = self._open()
            out = self._server(self.history, mask, 0)
            if self.u_shape:
                out = out[:, -T:]  # the top's cache already holds the earlier positions
        if not self.u_shape:
            return out  # (B, V) logits of the last position
        return self.segments[1](out, mask, self.caches[1], logits_to_keep=1)[:, -1, :]  # (B, V)

    def close(self) -> None:
        try:
            self.transport.delete(P.SESSION.format(session_id=self.sid))
        except Exception:  # the session may be gone already; nothing to free then
            pass
