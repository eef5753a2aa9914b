"""The client's side of the federation modes (:mod:`splitlearn.server.federation.modes`).

``FederationState`` keeps the server's mode, the version of the shared client-side weights this
client holds, the samples trained since its last sync and whether it holds the turn; it takes
the turn, downloads newer weights, syncs (to the segment server, or with a ticket to a fed
server) and waits for a round's result. Every wait is bounded by ``wait_timeout_s`` and ends in
a :class:`~splitlearn.errors.ServiceUnavailable`. Flow per mode: docs/FEDERATION.md.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from ..api import protocol as P
from ..api.wire import decode, encode
from ..errors import ConfigError, NotFound, NotYourTurn, ServiceUnavailable
from ..model.segments import Segment
from ..transport.busy import wait_while_busy
from ..transport.http import Transport

log = logging.getLogger(__name__)


class FederationState:
    def __init__(self, transport: Transport, client_id: str, segments: list[Segment],
                 wait_timeout_s: float, fed: Optional[Transport] = None):
        self.transport = transport
        self.fed = fed  # a separate fed server for the client-side weights (server/federation/fedserver.py)
        self.client_id = client_id
        self.segments = segments
        self.wait_timeout_s = wait_timeout_s
        status = transport.get_json(P.FEDERATION)
        self.mode: str = status["mode"]
        external = status.get("client_weights") == "external"
        if external != (fed is not None):
            raise ConfigError("this server keeps client-side weights on a separate fed server: give "
                              "fed_url" if external else "fed_url was given, but this server averages "
                              "client-side weights itself (start it with --client-weights external)")
        self.version: Optional[int] = None if self.mode == "shared" else -1  # -1: not yet fetched
        self.samples = 0  # rows trained since the last sync
        self.has_turn = False
        self.load_weights = lambda tensors: load_hf_weights(segments, tensors)  # LoRA: adapters only

    @property
    def shared(self) -> bool:
        return self.mode == "shared"

    def before_step(self) -> None:
        """Make sure this client may train now: turn taken, weights up to date."""
        if self.shared:
            return
        if self.mode == "sequential" and not self.has_turn:
            status = wait_while_busy(lambda: self.transport.post_json(P.FEDERATION_TURN,
                                                                      {"client_id": self.client_id}),
                                     "the turn", self.wait_timeout_s)
            self.has_turn = True
            if status["version"] != self.version:  # another client synced since our last turn
                self.download(status["version"])
        # Otherwise the version is checked by the server on every step (409 stale_weights), so
        # it is fetched here only when unknown: a new client, or after the server said stale.
        if self.version is None or self.version < 0:
            self.download(self.transport.get_json(P.FEDERATION)["version"])

    def download(self, server_version: int) -> None:
        """Load the shared client-side weights (none before the first sync: keep ours)."""
        if server_version == 0:
            self.version = 0
            return
        if self.fed is None:
            tensors, meta = decode(self.transport.get_bytes(P.FEDERATION_WEIGHTS))
            self.load_weights(tensors)
            self.version = int(meta["version"])
        else:  # the fed server holds them, once it has closed the round (or turn) too
            self._fed_catch_up(server_version)
            try:
                tensors, _ = decode(self.fed.get_bytes(P.FEDERATION_WEIGHTS))
                self.load_weights(tensors)
            except NotFound:  # no member's upload ever reached it: keep ours
                log.warning("the fed server has no client-side weights yet; client %s keeps its own", self.client_id)
            self.version = server_version  # what the segment server checks training requests against
        log.info("client %s loaded shared client-side weights version %d", self.client_id, self.version)

    def _fed_catch_up(self, target: int) -> None:
        """Wait until the fed server reaches the segment server's version ``target``, forwarding
        the segment server's signed close record once (a round that closed there on its
        timeout then closes on the fed server as well, with the uploads of its members)."""
        forwarded: set[str] = set()

        def caught_up() -> dict:
            st = self.fed.get_json(P.FEDERATION)
            if st["version"] < target:
                record = self.transport.get_json(P.FEDERATION).get("last_close")
                if record and record not in forwarded:
                    forwarded.add(record)
                    st = self.fed.post_json(P.FEDERATION_CLOSE, {"record": record})
            if st["version"] < target:
                raise ServiceUnavailable(f"the fed server is at version {st['version']}, the segment server "
                                         f"at {target}: waiting for the members' uploads", retry_after=0.5)
            return st

        wait_while_busy(caught_up, "the fed server's average", self.wait_timeout_s)

    def stale(self) -> None:
        """The server said our weights are stale (or our turn lapsed): fetch before redoing."""
        self.has_turn = False if self.mode == "sequential" else self.has_turn
        self.version = -1

    def sync(self, weights: dict[str, torch.Tensor]) -> dict:
        """Share our client-side weights; in splitfed, wait for the round's result.

        Without a fed server they go to the segment server. With one, the segment server
        gets an empty sync and answers a signed ticket (the rows it counted for us, our
        round), and the weights go to the fed server with that ticket (:mod:`splitlearn.server.federation.tickets`)."""
        if self.shared:
            return self.transport.get_json(P.FEDERATION)
        meta = P.SyncMeta(self.client_id, min(max(self.samples, 1), P.MAX_SAMPLES))
        try:
            status = answer = self.transport.post_bytes_json(
                P.FEDERATION_SYNC, encode(weights if self.fed is None else {}, meta.to_meta()))
        except NotYourTurn as e:  # sequential: the turn lapsed or passed to another tenant before this sync
            return self._turn_lost(e)
        if self.fed is not None:
            ticket = P.SyncMeta(meta.client_id, meta.samples, status["ticket"])
            answer = self.fed.post_bytes_json(P.FEDERATION_SYNC, encode(weights, ticket.to_meta()))
        self.samples = 0
        if self.mode == "sequential":
            self.has_turn = False
            # what we uploaded is the latest, unless the server bounded it (then fetch it)
            self.version = -1 if answer.get("clipped") else status["version"]
            return status
        mine = self.version

        def closed() -> dict:
            st = self.transport.get_json(P.FEDERATION)
            if st["version"] == mine:
                raise ServiceUnavailable(f"round {st['round']} waits for {st['clients_per_round']} syncs "
                                         f"({st.get('synced_count', 0)} so far)", retry_after=0.5)
            return st

        status = wait_while_busy(closed, "the other clients of the round", self.wait_timeout_s)
        self.download(status["version"])
        return status

    def _turn_lost(self, e: NotYourTurn) -> dict:
        """Sequential: our turn ended before our sync (idle past the server's timeout, or past
        its bound while another tenant waited). What we trained since our last sync is not
        shared; the next step takes the turn again and loads the shared weights."""
        log.warning("client %s: nothing shared, the turn was no longer ours (%s)", self.client_id, e.message)
        self.samples = 0
        self.stale()
        return {**self.transport.get_json(P.FEDERATION), "turn_lost": e.message}


def untied_weights(segments) -> dict[str, torch.Tensor]:
    """The segments' weights under their Hugging Face names, a tied tensor once (U-shape: the
    LM head is the token embedding; sending it twice would add 154 MB to a GPT-2 small sync)."""
    out, seen = {}, set()
    for seg in segments:
        for k, v in seg.hf_state_dict().items():
            if v.data_ptr() not in seen:
                seen.add(v.data_ptr())
                out[k] = v.detach().cpu().contiguous()
    return out


def load_hf_weights(segments: list[Segment], tensors: dict[str, torch.Tensor]) -> None:
    """Copy weights named as in the family's Hugging Face model into the segments' parameters (a tied
    parameter sent once under its first name is loaded through that name)."""
    with torch.no_grad():
        for seg in segments:
            for (_, p), hf in zip(seg.state_dict(keep_vars=True).items(), seg.hf_state_dict()):
                if hf in tensors:
                    p.copy_(tensors[hf].to(p.dtype))
