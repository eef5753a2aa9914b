"""The unix door's direct dispatch (splitlearn/server/http/direct.py): a tensor route's request
over ``unix://`` is served without Flask, and must be the app's answer exactly: the same bytes,
the same errors (a 500 names an incident), the same access line, metrics and memory account.

In-process: the app and its unix door in this process, a Transport (and Flask's test client)
against them; no server process is needed to test the dispatch itself."""
import logging
import os
import tempfile
import time

import pytest
import torch

from splitlearn.api import protocol as P
from splitlearn.errors import NotFound, SplitLearnError
from splitlearn.server.config import ServerConfig
from splitlearn.server.http import routing
from splitlearn.server.http.app import create_app
from splitlearn.server.http.routing import SERVED
from splitlearn.server.http.unixdoor import UnixDoor
from splitlearn.transport import Transport, TransportConfig
from splitlearn.transport import unixframe as F
from splitlearn.api.wire import decode, encode, pack

from serverproc import OTHER, TENANTS, TOKEN, access_lines, auth

D = 32  # models/tiny.json


@pytest.fixture(scope="module")
def served():
    """``(app, transport over its unix door)``; the app counts the requests Flask sees
    (``app.flask_calls``), ``app.door`` is the door."""
    cfg = ServerConfig(model="tiny", cuts=(1, 3), tokens=TENANTS, seed=0)
    app = create_app(cfg)
    app.flask_calls = 0
    wsgi = app.wsgi_app

    def counted(environ, start_response):
        app.flask_calls += 1
        return wsgi(environ, start_response)

    app.wsgi_app = counted
    path = os.path.join(tempfile.mkdtemp(prefix="sl-direct-"), "s.sock")
    door = app.door = UnixDoor(app, cfg.tenants, path, max_body_bytes=cfg.max_body_bytes).start()
    t = Transport(TransportConfig("unix://" + path, OTHER))
    yield app, t
    t.close()
    door.close()


def eventually(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "not within the time allowed"
        time.sleep(0.01)


def _step_tensors(seed: int, rows: int = 1, T: int = 1) -> dict:
    h = torch.randn(rows, T, D, generator=torch.Generator().manual_seed(seed))
    return {**pack(P.HIDDEN, h, "float32"), P.MASK: torch.ones(rows, T, dtype=torch.long)}


@pytest.mark.parametrize("rows, T", [(2, 5), (8, 64)])  # inline, and both ways through the region
def test_a_forward_is_the_apps_answer_byte_for_byte_and_flask_never_sees_it(served, rows, T):
    app, t = served
    tensors, meta = _step_tensors(rows + T, rows, T), {"wire_dtype": "float32"}
    flask = app.test_client().post(P.FORWARD, data=encode(tensors, meta),
                                   headers={**auth(OTHER), "Content-Type": P.CONTENT_TYPE})
    assert flask.status_code == 200
    before = app.flask_calls
    direct = t.post_bytes(P.FORWARD, encode(tensors, meta))
    assert app.flask_calls == before  # not through Flask
    assert direct == flask.get_data()
    if rows * T * D * 4 > F.INLINE_MAX:  # through the shared region both ways: the tensor API too
        out, m = t.call_meta(P.FORWARD, tensors, meta)
        want, want_meta = decode(flask.get_data())
        assert m == want_meta and out.keys() == want.keys() and all(torch.equal(out[k], want[k]) for k in out)


def test_decode_steps_match_the_apps_and_are_logged_and_counted(served):
    app, t = served
    c = app.test_client()
    sid_flask = c.post(P.SESSIONS, json={"rows": 1}, headers=auth(OTHER)).get_json()["session_id"]
    sid_direct = t.post_json(P.SESSIONS, {"rows": 1})["session_id"]
    metrics = app.extensions["splitlearn.metrics"]
    route = "/v1/sessions/<session_id>/step"
    counted = lambda: metrics.requests.labels(route, "POST", "200", "mallory")._value.get()  # noqa: E731
    with access_lines() as lines:
        before, n_before = app.flask_calls, counted()
        for pos in range(4):
            body = encode(_step_tensors(pos), P.SessionStepMeta(pos, "float32").to_meta())
            want = c.post(P.SESSION_STEP.format(session_id=sid_flask), data=body,
                          headers={**auth(OTHER), "Content-Type": P.CONTENT_TYPE}).get_data()
            calls = app.flask_calls
            assert t.post_bytes(P.SESSION_STEP.format(session_id=sid_direct), body) == want
            assert app.flask_calls == calls
        # the last line and count come once its answer is sent (accesslog.record): wait for them
        eventually(lambda: counted() - n_before == 8 and len([x for x in lines() if x["route"] == route]) == 8)
        got = [x for x in lines() if x["route"] == route]
    assert app.flask_calls == before + 4  # the four test-client requests only
    assert counted() - n_before == 8  # four through Flask, four direct: one family
    assert len(got) == 8 and all(x["tenant"] == "mallory" and x["status"] == 200 and x["method"] == "POST"
                                 for x in got)
    assert all(x["bytes_in"] > 0 and x["bytes_out"] > 0 and x["ms"] > 0 and x["request_id"] for x in got)


def test_the_request_id_is_kept_or_made_as_the_app_does(served):
    app, t = served
    from splitlearn.transport.unix import UnixLink

    link = UnixLink(t.cfg.url)
    body = encode(_step_tensors(0, 2, 3), {"wire_dtype": "float32"})
    headers = {"Authorization": f"Bearer {OTHER}", "Content-Type": P.CONTENT_TYPE}
    try:
        status, h, _ = link.request("POST", P.FORWARD, {**headers, P.REQUEST_ID_HEADER: "trace-42"}, body)
        assert status == 200 and h.get(P.REQUEST_ID_HEADER) == "trace-42"
        status, h, _ = link.request("POST", P.FORWARD, {**headers, P.REQUEST_ID_HEADER: "bad id\u00e9"}, body)
        assert status == 200 and len(h.get(P.REQUEST_ID_HEADER)) == 16  # a new one, as over HTTP
        assert float(h.get(P.SERVER_TIME_HEADER)) > 0
    finally:
        link.close()


@pytest.mark.parametrize("case", ["wrong-content-type", "unknown-session", "garbage", "bad-shape"])
def test_errors_are_the_apps_errors(served, case):
    app, t = served
    from splitlearn.transport.unix import UnixLink

    sid = t.post_json(P.SESSIONS, {"rows": 1})["session_id"]
    good = encode(_step_tensors(0), P.SessionStepMeta(0, "float32").to_meta())
    path, body, ctype = {
        "wrong-content-type": (P.SESSION_STEP.format(session_id=sid), good, "application/json"),
        "unknown-session": (P.SESSION_STEP.format(session_id="nope"), good, P.CONTENT_TYPE),
        "garbage": (P.FORWARD, b"not safetensors" * 3000, P.CONTENT_TYPE),  # 45 KB: through the region
        "bad-shape": (P.FORWARD, encode(_step_tensors(0, 2, 3) | {P.HIDDEN: torch.zeros(2, 3, D + 1)}),
                      P.CONTENT_TYPE),
    }[case]
    want = app.test_client().post(path, data=body, headers={**auth(OTHER), "Content-Type": ctype})
    link = UnixLink(t.cfg.url)
    try:
        status, headers, content = link.request("POST", path, {"Authorization": f"Bearer {OTHER}",
                                                               "Content-Type": ctype}, body)
    finally:
        link.close()
    assert 400 <= status < 500 and status == want.status_code
    assert headers.get("Content-Type") == "application/json"
    import json
    assert json.loads(content) == want.get_json()


def test_a_failing_handler_is_a_500_naming_an_incident_and_changes_nothing(served, monkeypatch, caplog):
    app, t = served
    route = next(r for r in routing.TENSOR_ROUTES["training"] if r.rule == P.FORWARD)

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    broken_route = routing.TensorRoute(route.rule, broken, route.owner, route.inline, route.cls, route.pattern)
    direct = app.door.direct
    monkeypatch.setattr(direct, "routes", [broken_route if r is route else r for r in direct.routes])
    memory = app.extensions[SERVED].memory
    held = memory.to_dict()["reserved_bytes"]
    with caplog.at_level(logging.ERROR, logger="splitlearn.server.http.app"), access_lines() as lines:
        with pytest.raises(SplitLearnError) as e:
            t.call(P.FORWARD, _step_tensors(1, 2, 3), {"wire_dtype": "float32"})
        assert e.value.status == 500 and "incident" in str(e.value)
        incident = str(e.value).split("incident ", 1)[1].split(":", 1)[0]
        # its line comes once the answer is sent (accesslog.record), maybe after a line the previous
        # test's last answer queued late: wait for the incident's own line
        eventually(lambda: any(x.get("incident") == incident for x in lines()))
        got = [x for x in lines() if x.get("incident") == incident]
    assert any(incident in r.getMessage() and r.exc_info for r in caplog.records)  # the traceback is the operator's
    assert len(got) == 1 and got[0]["status"] == 500 and got[0]["route"] == P.FORWARD
    assert memory.to_dict()["reserved_bytes"] == held  # the body's reservation was released
    monkeypatch.undo()
    assert t.call(P.FORWARD, _step_tensors(1, 2, 3), {"wire_dtype": "float32"})  # serving on


def test_only_tensor_routes_go_direct(served):
    app, t = served
    calls = app.flask_calls
    t.get_json(P.INFO)
    t.post_json(P.SESSIONS, {"rows": 1})
    with pytest.raises(NotFound):
        t.post_bytes("/v1/sessions/x/step/more", b"x")  # not a rule: the app's 404
    with pytest.raises(NotFound):
        t.call(P.FORWARD + "/", _step_tensors(0))  # a trailing slash: not the rule, the app's 404
    assert app.flask_calls == calls + 4


def test_echo_goes_direct_with_the_apps_limit(served):
    app, t = served
    calls = app.flask_calls
    x = torch.randn(64 << 10, generator=torch.Generator().manual_seed(5))  # 256 KiB: through the region both ways
    back = t.call(P.ECHO, {"x": x})
    assert torch.equal(back["x"], x) and app.flask_calls == calls
    cap = app.extensions[SERVED].cfg.max_echo_bytes
    too_big = b"\0" * (cap + 1)
    want = app.test_client().post(P.ECHO, data=too_big, headers=auth(OTHER))
    with pytest.raises(SplitLearnError) as e:
        t.post_bytes(P.ECHO, too_big)
    assert e.value.status == want.status_code == 413 and str(e.value).endswith(want.get_json()["message"])
