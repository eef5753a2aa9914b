"""Issue 53 item 1: a piece is answered with its own answer and never another's, under the
faults of a real link: delays, an answer read out of order (a stale answer left on a keep-alive
connection, a relay that reorders or repeats), a read that times out while its answer is still
coming, a connection dropped mid-step and sent again.

The attack: every tensor answer of a pipelined step (micro-batches on lanes, GPipe and 1F1B)
goes through a faulty link (:class:`Faults`, injected into the client's transport). A piece that
took another piece's answer of the same shape (two forwards of equal micro-batches, two
backwards) passed the answer checks before the fix: the step's loss and gradients were silently
wrong. Now every training answer names its request (metadata ``echo``: ``step/micro path``,
server/http/routing.py) and the client sends a piece again on a fresh connection when the
answer is another's (hf/pieces.py), so each step equals the same step unpipelined and clean.
"""
import os
import random
import socket
import tempfile
import time

import pytest
import torch

from splitlearn.api import protocol as P
from splitlearn.hf import SplitGPT2LMHeadModel
from splitlearn.transport import http as H

from serverproc import TOKEN, ServerProcess

pytestmark = pytest.mark.slow  # a server process (seconds to start); the tests ~10 s together

M = 4  # micro-batches: 8 rows -> four of 2, every forward's answer the same shape


@pytest.fixture(scope="module")
def server():
    d = tempfile.mkdtemp(prefix="sl-race-")
    path = os.path.join(d, "server.sock")
    with ServerProcess((1, 3), extra=["--listen", "unix://" + path]) as srv:
        srv.unix_url = "unix://" + path
        yield srv


def _model(url: str, micro_batches: int, **kw) -> SplitGPT2LMHeadModel:
    torch.manual_seed(0)
    m = SplitGPT2LMHeadModel.from_pretrained("tiny", server=url, token=TOKEN, micro_batches=micro_batches,
                                             **kw).train()
    m.choose_micro_batches = False
    return m


class Faults:
    """A faulty link under ``transport``: each tensor answer is delayed, replaced by an earlier
    answer to the same path (read out of order), lost with its connection (dropped, sent
    again), or its read timed out, each with probability ``p`` (``only``: just that fault, once)."""

    KINDS = ("delay", "stale", "drop", "timeout")

    def __init__(self, transport, monkeypatch, seed: int = 0, p: float = 0.25, only=None):
        self.t, self.rng, self.p, self.only = transport, random.Random(seed), p, only
        self.seen: dict[str, list[bytes]] = {}  # path -> answers read so far
        self.fired: dict[str, int] = {k: 0 for k in self.KINDS}
        self.clean = False
        self.now = None  # the fault of the call being read
        self.real_finish, self.real_lean = transport._finish, transport._lean_answer
        monkeypatch.setattr(transport, "_finish", self._finish)
        monkeypatch.setattr(transport, "_lean_answer", self._lean)

    def _pick(self):
        if self.only is not None:
            return self.only if not self.fired[self.only] else None
        if self.clean:  # the call after a fault (its resend) goes through: a resend that fails too is an error
            self.clean = False
            return None
        kind = self.rng.choice(self.KINDS) if self.rng.random() < self.p else None
        self.clean = kind is not None
        return kind

    def _lean(self, p):
        """HTTP lanes: the connection dropped before its answer is read, or a read timeout that
        expires while the server is still answering (the late answer stays on the socket)."""
        kind, self.now = self.now, None  # the fault _finish picked for this call
        lane = self.t._lanes.get(p.lane)
        if kind == "drop" and lane is not None and lane.conn is not None:
            self.fired["drop"] += 1
            lane.conn.sock.shutdown(socket.SHUT_RDWR)  # the answer is lost: sent again, answered once
        elif kind == "timeout" and lane is not None and lane.conn is not None:
            self.fired["timeout"] += 1
            lane.conn.sock.settimeout(1e-6)  # the server answers after the read gave up
            try:
                return self.real_lean(p)
            finally:
                if lane.conn is not None:
                    lane.conn.sock.settimeout(self.t.cfg.read_timeout_s)
        return self.real_lean(p)

    def _finish(self, p, view=False):
        kind = self.now = self._pick() if p.path in (P.TRAIN_FORWARD, P.TRAIN_BACKWARD) else None
        if kind == "delay":
            self.fired["delay"] += 1
            time.sleep(self.rng.uniform(0.0, 0.02))
        content = self.real_finish(p, view=False)
        before = self.seen.setdefault(p.path, [])
        before.append(bytes(content))
        if kind == "stale" and len(before) > 1:
            self.fired["stale"] += 1
            return before[-2]  # another piece's answer (out of order), this one's lost
        return content


def _step(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    model.remote.steps.discard(force=True)  # nothing applied: the server's weights stay as they are
    return float(loss), grads


def _assert_same(a, b):
    assert a[0] == pytest.approx(b[0], rel=1e-5)
    assert a[1].keys() == b[1].keys()
    for n in a[1]:
        assert torch.allclose(a[1][n], b[1][n], rtol=1e-4, atol=1e-6), n


@pytest.mark.parametrize("eager", [False, True], ids=["gpipe", "1f1b"])
def test_a_piece_never_takes_another_pieces_answer(server, monkeypatch, eager):
    """One forward answered with the answer of the forward before it (same shape): the piece
    is sent again and the step is the unpipelined one; before the fix its loss was silently
    another micro-batch's."""
    ids = torch.randint(0, 256, (8, 10), generator=torch.Generator().manual_seed(1))
    whole, piped = _model(server.url, 1), _model(server.url, M)
    if eager:
        piped.loss_gradient = 1.0  # backwards in flight during the forwards
    try:
        ref = _step(whole, ids)
        faults = Faults(piped.remote.transport, monkeypatch, only="stale")
        got = _step(piped, ids)
        assert faults.fired["stale"] == 1
        _assert_same(got, ref)
    finally:
        whole.remote.close()
        piped.remote.close()


@pytest.mark.parametrize("scheme", ["http", "unix"])
def test_pipelined_steps_under_a_faulty_link_equal_clean_ones(server, monkeypatch, scheme):
    """Tens of pipelined steps (GPipe and 1F1B alternating) with random delays, answers out of
    order, dropped connections and reads that time out: every step's loss and gradients equal
    the same step unpipelined over a clean link."""
    url = server.url if scheme == "http" else server.unix_url
    whole, piped = _model(url, 1), _model(url, M)
    faults = Faults(piped.remote.transport, monkeypatch, seed=7)
    g = torch.Generator().manual_seed(3)
    try:
        for step in range(16):
            ids = torch.randint(0, 256, (8, 6), generator=g)
            piped.loss_gradient = 1.0 if step % 2 else None
            _assert_same(_step(piped, ids), _step(whole, ids))
        assert faults.fired["stale"] and faults.fired["delay"]
        if scheme == "http":
            assert faults.fired["drop"] and faults.fired["timeout"]
    finally:
        whole.remote.close()
        piped.remote.close()


def test_a_call_abandoned_on_a_lane_never_answers_the_next(server):
    """One keep-alive connection answers in order: a request sent on a lane whose answer is
    unread (a call abandoned by an exception, an interrupt) would be answered with the first
    one's. It goes on a new connection instead, and the abandoned call, read after all, is
    sent again: each gets its own answer, in either order."""
    from splitlearn.api.wire import pack

    def hidden(seed, B, T):
        h = torch.randn(B, T, 32, generator=torch.Generator().manual_seed(seed))
        return {**pack(P.HIDDEN, h, "float32"), P.MASK: torch.ones(B, T, dtype=torch.long)}

    t = H.Transport(H.TransportConfig(server.url, TOKEN))
    try:
        for order in ((0, 1), (1, 0)):
            calls = [t.start_call(P.FORWARD, hidden(0, 2, 5), {"wire_dtype": "float32"}, lane=3),
                     t.start_call(P.FORWARD, hidden(1, 4, 7), {"wire_dtype": "float32"}, lane=3)]
            shapes = {i: tuple(t.finish_call(calls[i])[P.HIDDEN].shape) for i in order}
            assert shapes == {0: (2, 5, 32), 1: (4, 7, 32)}
    finally:
        t.close()
