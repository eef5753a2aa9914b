"""The pipelined decode: greedy generation of two row groups in flight (the decode fast path).

``SplitClient.generate`` is transformers' ``generate()`` on the client's split model
(:mod:`splitlearn.hf`). One case runs here instead: greedy decoding of two rows or more when
the server does not share this process's cores. Run as one batch, the client and the server
take turns: each waits while the other computes. :class:`RemoteDecoder` splits the rows into
two groups, each with its own server session and its own connection (a transport *lane*),
and keeps both in flight::

    client: bottom A | bottom B | top A, bottom A' | top B, bottom B' | top A', ...
    server:          | trunk A  | trunk B          | trunk A'         | trunk B', ...

so the server computes one group while the client computes the other. Greedy tokens do not
depend on the other rows, so the groups give the tokens one batch gives (each group is a
batch of its own through the same segments; :mod:`splitlearn.generation`'s loop, which
tests/test_generation.py proves equal to ``model.generate``). A decode step of a group::

    new ids -> bottom (cache 0) -> h (B, T, d) --POST /v1/sessions/<sid>/step (h, new mask)-->
        2-way:   logits of the last position (B, V)
        U-shape: trunk output (B, T, d) -> top (cache 1) -> logits of the last position (B, V)

Each step sends only the new positions and their mask columns (the server keeps the rest).
If the server loses a session (restart, expiry), a new one is opened and the group's bottom
outputs so far are replayed once.

Two groups of B/2 rows cost each side more than one group of B (a decode step reads every
weight once per group, and on a CPU that is most of its time up to batch 8 or so: measured,
batch 4 costs about 0.7x batch 8), so the overlap pays only where the server's cores would
otherwise sit idle while the client computes: by default (:func:`use_pipeline`) in the
U-shape (the client holds the top and the LM head: work worth overlapping) when the server
does not share this process's cores: a server on another host, or a loopback one
while this process is pinned to a subset of the machine's cores (as the benchmarks'
two-device emulation does).
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Iterator, Optional, Sequence

import torch
from transformers import StoppingCriteria
from transformers.generation.streamers import BaseStreamer

from .. import protocol as P
from .. import trust
from ..errors import NotFound, TransportError
from ..generation import DecodeState, GreedyConfig
from ..segments import Segment
from ..wire import pack
from ..transport import PendingCall, Transport, shares_cores_with_server

log = logging.getLogger(__name__)


class _Group:
    """Some rows of the batch: one server session, the client's caches, one request in flight."""

    def __init__(self, dec: "RemoteDecoder", rows: int, lane: int):
        self.dec, self.rows, self.lane = dec, rows, lane
        self.caches = [s.new_cache() for s in dec.segments]
        self.history: list[torch.Tensor] = []  # bottom outputs (B, T_i, d), one per step
        self.length = 0  # positions sent so far
        self.sid: Optional[str] = None
        self.pending: Optional[tuple[PendingCall, int, torch.Tensor]] = None  # call, T, mask

    def _send(self, h: torch.Tensor, mask: torch.Tensor, position: int) -> PendingCall:
        d = self.dec
        if self.sid is None:
            body = {"rows": self.rows, **({"client_id": d.client_id} if d.client_id else {})}  # LoRA
            self.sid = d.transport.post_json(P.SESSIONS, body)["session_id"]
        meta = P.SessionStepMeta(position, d.wire_dtype).to_meta()
        new_mask = mask[:, -h.shape[1]:].cpu()  # (B, T): the server keeps the earlier columns
        return d.transport.start_call(P.SESSION_STEP.format(session_id=self.sid),
                                      {**pack(P.HIDDEN, h, d.wire_dtype), P.MASK: new_mask}, meta, self.lane)

    def _answer(self, call: PendingCall, T: int) -> torch.Tensor:
        """The server's answer to a step of ``T`` positions, checked (:mod:`splitlearn.trust`)."""
        out = self.dec.transport.finish_call(call)
        config = self.dec.segments[0].config
        if self.dec.u_shape:
            return self.dec.to_local(trust.answer(out, P.HIDDEN, (self.rows, T, config.n_embd), "trunk output"))
        return self.dec.to_local(trust.answer(out, P.LOGITS, (self.rows, config.vocab_size), "logits"))

    @torch.no_grad()
    def begin(self, new_ids: torch.Tensor, mask: torch.Tensor) -> None:
        """Run the bottom on ``new_ids`` (B, T) and send its output; ``mask`` (B, L) is the whole sequence's."""
        h = self.dec.defend(self.dec.segments[0](new_ids, mask, self.caches[0]))  # (B, T, d), as sent
        self.history.append(h)
        position, self.length = self.length, self.length + h.shape[1]
        try:
            call = self._send(h, mask, position)
        except (NotFound, TransportError):
            call = None  # finish() opens a new session and replays
        self.pending = (call, h.shape[1], mask)

    @torch.no_grad()
    def finish(self) -> torch.Tensor:
        """Wait for the answer of :meth:`begin`; logits (B, V) of the last position."""
        call, T, mask = self.pending
        self.pending = None
        try:
            if call is None:
                raise TransportError("the request could not be sent")
            out = self._answer(call, T)
        except (NotFound, TransportError) as e:
            history = torch.cat(self.history, dim=1)  # (B, L, d)
            self.history = [history]
            log.warning("generation session lost (%s); replaying %d positions", e, history.shape[1])
            self.sid = None
            out = self._answer(self._send(history, mask, 0), history.shape[1])
            if self.dec.u_shape:
                out = out[:, -T:]  # the top's cache already holds the earlier positions
        if not self.dec.u_shape:
            return out  # (B, V) logits of the last position
        return self.dec.segments[1](out, mask, self.caches[1], logits_to_keep=1)[:, -1, :]  # (B, V)

    def close(self) -> None:
        if self.sid is not None:
            try:
                self.dec.transport.delete(P.SESSION.format(session_id=self.sid))
            except Exception:  # the session may be gone already; nothing to free then
                pass
            self.sid = None


def use_pipeline(transport: Transport, rows: int, pipeline: Optional[bool] = None, u_shape: bool = True) -> bool:
    """Whether greedy decoding of ``rows`` rows runs as two groups in flight: ``pipeline`` if
    given (and two rows or more), else in the U-shape when the server does not share this
    process's cores. A 2-way client holds only the bottom: too little work to hide the
    server's behind, so two groups only double the server's weight reads (measured, pinned
    batch 8: 68 tokens/s in two groups against 87 in one; benchmarks/README.md)."""
    want = (u_shape and not shares_cores_with_server(transport.cfg.url)) if pipeline is None else pipeline
    return bool(want) and rows >= 2


class RemoteDecoder:
    """The pipelined greedy decode over ``transport`` (two row groups in flight).

    segments: the client's own segments, ``[bottom]`` (2-way) or ``[bottom, top]`` (U-shape).
    to_local: moves a received tensor to the client's device and compute dtype.
    """

    def __init__(self, transport: Transport, segments: Sequence[Segment], rows: int, wire_dtype: str,
                 to_local: Callable[[torch.Tensor], torch.Tensor], client_id: Optional[str] = None,
                 defend: Callable[[torch.Tensor], torch.Tensor] = lambda h: h):
        self.transport = transport
        self.defend = defend  # the client's defense on what leaves it (splitlearn.privacy)
        self.segments = list(segments)
        for seg in self.segments:
            seg.eval()  # once: Module.eval walks every submodule (~0.1 ms per step otherwise)
        self.u_shape = len(self.segments) == 2
        self.rows = rows
        self.wire_dtype = wire_dtype
        self.to_local = to_local
        self.client_id = client_id  # LoRA: sessions use this client's server-side adapter
        self.groups: list[_Group] = []

    def decode(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
               cfg: GreedyConfig) -> Iterator[torch.Tensor]:
        """Yield the next token of every row, (B,), as :func:`splitlearn.generation.decode` does."""
        if self.rows < 2:
            raise ValueError("the pipelined decode needs two rows or more")
        half = (self.rows + 1) // 2
        spans = [slice(0, half), slice(half, self.rows)]
        self.groups = [_Group(self, sl.stop - sl.start, lane=i) for i, sl in enumerate(spans)]
        states = [DecodeState(input_ids[sl], None if attention_mask is None else attention_mask[sl], cfg)
                  for sl in spans]
        for g, st, sl in zip(self.groups, states, spans):
            g.begin(input_ids[sl], st.mask)  # both prefills in flight
        for i in range(cfg.max_new_tokens):
            toks = []
            for g, st in zip(self.groups, states):
                if g.pending is None:  # every row of this group is done: padding
                    toks.append(st.padding())
                    continue
                tok = st.choose(g.finish())  # (b,)
                toks.append(tok)
                if i + 1 < cfg.max_new_tokens and not st.done:
                    g.begin(st.advance(tok), st.mask)  # in flight while the other group computes
            yield torch.cat(toks)  # (B,)
            if all(st.done for st in states):
                return

    def close(self) -> None:
        for g in self.groups:
            if g.pending is not None and g.pending[0] is not None:
                try:  # read the answer in flight so the connection can be reused
                    g.pending[0].result()
                except Exception:
                    pass
            g.close()
        self.groups = []


# -- streaming transformers' generate -------------------------------------------------------

_END = object()


class _TokenQueue(BaseStreamer):
    """A ``generate`` streamer that queues every new token of every row, (B,), prompt excluded."""

    def __init__(self):
        self.queue: "queue.Queue" = queue.Queue()
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate puts the prompt first
            self._prompt_seen = True
            return
        self.queue.put(value.reshape(-1))

    def end(self) -> None:
        self.queue.put(_END)


class _StopFlag(StoppingCriteria):
    """Stops ``generate`` at its next token once :attr:`stop` is set (the reader went away)."""

    def __init__(self):
        self.stop = threading.Event()

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.stop.is_set(), dtype=torch.bool, device=input_ids.device)


def stream_tokens(run: Callable[[BaseStreamer, StoppingCriteria], object]) -> Iterator[torch.Tensor]:
    """Yield each new token of every row, (B,), while ``run(streamer, stopping_criterion)``
    (a transformers ``generate`` given both) runs in a thread; its exception is re-raised
    here. Closing the iterator early stops the generation at its next token and waits for it
    (so its server session is closed when this returns)."""
    streamer, flag, error = _TokenQueue(), _StopFlag(), []

    def target():
        try:
            run(streamer, flag)
        except BaseException as e:  # noqa: BLE001 - re-raised in the reader's thread
            error.append(e)
        finally:
            streamer.queue.put(_END)  # generate does not call end() when it raises

    thread = threading.Thread(target=target, name="splitlearn-generate", daemon=True)
    thread.start()
    try:
        while True:
            item = streamer.queue.get()
            if item is _END:
                break
            yield item
    finally:
        flag.stop.set()
        thread.join()
    if error:
        raise error[0]
