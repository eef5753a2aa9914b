"""The client's transport against a real server process: lanes, readiness, polling for answers."""
import os
import time

import pytest
import torch

from splitlearn.api import protocol as P
from splitlearn.transport import Transport, TransportConfig, shares_cores_with_server
from splitlearn.api.wire import decode, encode, pack

from serverproc import TOKEN, ServerProcess

D = 32  # models/tiny.json


@pytest.fixture(scope="module")
def server():
    with ServerProcess((1, 3)) as srv:
        yield srv


def _step_body(position: int) -> bytes:
    h = torch.randn(1, 1, D, generator=torch.Generator().manual_seed(position))
    return encode({**pack(P.HIDDEN, h, "float32"), P.MASK: torch.ones(1, 1, dtype=torch.long)},
                  P.SessionStepMeta(position, "float32").to_meta())


def test_who_shares_cores_with_the_server():
    assert not shares_cores_with_server("http://10.1.2.3:8000")  # another host has its own cores
    if not hasattr(os, "sched_getaffinity") or (os.cpu_count() or 1) < 2:
        pytest.skip("needs the affinity API and two cores")
    saved = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, set(saved))
        assert shares_cores_with_server("http://127.0.0.1:8000") == (len(saved) >= os.cpu_count())
        os.sched_setaffinity(0, {min(saved)})  # pinned to one core: the server has the others
        assert not shares_cores_with_server("http://127.0.0.1:8000")
    finally:
        os.sched_setaffinity(0, saved)


def test_polling_is_on_only_when_asked_or_the_server_has_its_own_cores(server):
    auto = Transport(TransportConfig(server.url, TOKEN))
    assert auto.spin == (not shares_cores_with_server(server.url))
    assert Transport(TransportConfig(server.url, TOKEN, spin=True)).spin
    assert not Transport(TransportConfig(server.url, TOKEN, spin=False)).spin


@pytest.mark.parametrize("spin", [False, True])
def test_decode_steps_are_answered_the_same_with_and_without_polling(server, spin):
    """The answers do not depend on how the client waits; with polling, each lane learns
    how long its answers take."""
    answers = {}
    for poll in (False, spin):
        t = Transport(TransportConfig(server.url, TOKEN, spin=poll))
        sid = t.post_json(P.SESSIONS, {"rows": 1})["session_id"]
        path = P.SESSION_STEP.format(session_id=sid)
        answers[poll] = [decode(t.post_bytes(path, _step_body(i)))[0][P.HIDDEN] for i in range(6)]
        if poll:
            expected = t._lanes[0].expected_s
            assert expected is not None and 0 < expected < 30
        t.delete(P.SESSION.format(session_id=sid))
        t.close()
    for a, b in zip(answers[False], answers[spin]):
        assert torch.equal(a, b)


def test_a_pending_call_says_when_its_answer_is_there(server):
    t = Transport(TransportConfig(server.url, TOKEN, spin=False))
    body = os.urandom(256 << 10)
    call = t.start(P.ECHO, body, lane=3)
    deadline = time.monotonic() + 30
    while not call.ready():  # the echo comes back without anybody reading it
        assert time.monotonic() < deadline, "the answer never became readable"
        time.sleep(0.001)
    assert call.result() == body
    t.close()


def test_an_answer_slower_than_expected_still_arrives_whole(server):
    """A lane that expects a fast answer (an echo) polls at most SPIN_S past it, then sleeps
    until a slower one (a prefill) comes."""
    t = Transport(TransportConfig(server.url, TOKEN, spin=True))
    t.post_bytes(P.ECHO, b"x")
    lane = t._lanes[0]
    before = lane.expected_s
    assert before is not None and before < 1.0
    sid = t.post_json(P.SESSIONS, {"rows": 1})["session_id"]
    prefill = encode(pack(P.HIDDEN, torch.randn(1, 64, D), "float32"), P.SessionStepMeta(0, "float32").to_meta())
    out, _ = decode(t.post_bytes(P.SESSION_STEP.format(session_id=sid), prefill))
    assert out[P.HIDDEN].shape == (1, 64, D)
    assert lane.expected_s > before  # the prefill's longer wait was folded in
    t.close()


class _FlakyProxy:
    """A stand-in for a load balancer on loopback: answers the first ``fail`` requests with a
    gateway error (HAProxy's HTML 502, or a given body), then ``ok`` (JSON)."""

    def __init__(self, fail: int, status: int = 502, body: bytes = b"<html><body><h1>502 Bad Gateway</h1></body></html>",
                 ok: bytes = b'{"status": "ok"}'):
        import http.server
        import threading

        proxy = self
        self.seen = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                proxy.seen += 1
                code, content = (status, body) if proxy.seen <= fail else (200, ok)
                self.send_response(code)
                self.send_header("Content-Type", "text/html" if content.startswith(b"<") else "application/json")
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            do_GET = do_POST = _answer

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("path", ["requests", "lean"])
def test_a_proxys_gateway_error_is_retried_as_a_dropped_connection(path):
    """HAProxy answers 502 (HTML) when the replica behind it dies mid-request: the request did
    not complete there, so it is sent again (as after a dropped connection) and the answer of
    the attempt that gets through is returned."""
    proxy = _FlakyProxy(fail=2)
    try:
        t = Transport(TransportConfig(url=proxy.url, token=TOKEN, backoff_s=0.01))
        if path == "requests":
            assert t.get_json(P.HEALTH) == {"status": "ok"}
        else:
            assert t.lean
            assert t.start(P.HEALTH, b"{}").result() == b'{"status": "ok"}'
        assert proxy.seen == 3 and t.stats.retries == 2
    finally:
        proxy.close()


def test_gateway_errors_past_the_retries_and_splitlearns_own_503_are_errors():
    from splitlearn.errors import ServiceUnavailable, TransportError

    proxy = _FlakyProxy(fail=100)
    try:
        t = Transport(TransportConfig(url=proxy.url, token=TOKEN, retries=2, backoff_s=0.01))
        with pytest.raises(TransportError, match="502"):
            t.get_json(P.HEALTH)
        assert proxy.seen == 3  # the first try and 2 retries
    finally:
        proxy.close()
    own = _FlakyProxy(fail=1, status=503, body=b'{"error": "unavailable", "message": "busy"}')
    try:  # the server's own 503 is an answer, not a lost request: raised at once, not resent
        t = Transport(TransportConfig(url=own.url, token=TOKEN, backoff_s=0.01))
        with pytest.raises(ServiceUnavailable, match="busy"):
            t.get_json(P.HEALTH)
        assert own.seen == 1
    finally:
        own.close()
