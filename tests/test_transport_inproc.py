"""The in-process link (splitlearn/transport/inproc.py): a Transport reaching the server's app
in this process answers as the same server does over HTTP: the same tensors, error classes,
statuses and messages, the token enforced; tensor calls are answered when they start."""
import pytest
import torch

from splitlearn.api import protocol as P
from splitlearn.errors import BadRequest, ConfigError, NotFound, TransportError, Unauthorized
from splitlearn.transport import Transport, TransportConfig, shares_cores_with_server
from splitlearn.transport.inproc import serve_inproc, unserve
from splitlearn.api.wire import decode, encode, pack

from serverproc import TOKEN, InprocServerProcess, ServerProcess, sgd_steps, tenants_flag

D = 32  # models/tiny.json


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The same server twice: a process on a port, and its app in this process; several tenants,
    so their decode answers are the same bits (the products batch-invariant, not measured per process)."""
    flag = tenants_flag(tmp_path_factory.mktemp("inproc"))
    with ServerProcess((1, 3), extra=flag) as http, InprocServerProcess((1, 3), extra=flag) as inproc:
        assert http.url.startswith("http://") and inproc.url.startswith("inproc://")
        yield http, inproc


def transports(servers, token=TOKEN):
    return [Transport(TransportConfig(s.url, token)) for s in servers]


def _hidden(seed: int, T: int = 5) -> dict:
    h = torch.randn(2, T, D, generator=torch.Generator().manual_seed(seed))
    return {**pack(P.HIDDEN, h, "float32"), P.MASK: torch.ones(2, T, dtype=torch.long)}


def test_a_forward_gets_the_same_tensors_and_metadata(servers):
    answers = []
    for t in transports(servers):
        out, meta = t.call_meta(P.FORWARD, _hidden(0), {"wire_dtype": "float32"})
        answers.append((out, meta))
        assert t.stats.calls == 1 and t.stats.bytes_received > 0
        assert t.stats.server_compute_s > 0  # X-Server-Time-Ms came back
        t.close()
    (a, meta_a), (b, meta_b) = answers
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert meta_a == meta_b


def test_decode_steps_get_the_same_answers_and_a_started_call_is_already_answered(servers):
    answers = []
    for t in transports(servers):
        sid = t.post_json(P.SESSIONS, {"rows": 1})["session_id"]
        path = P.SESSION_STEP.format(session_id=sid)
        got = []
        for i in range(4):
            h = torch.randn(1, 1, D, generator=torch.Generator().manual_seed(i))
            body = encode({**pack(P.HIDDEN, h, "float32"), P.MASK: torch.ones(1, 1, dtype=torch.long)},
                          P.SessionStepMeta(i, "float32").to_meta())
            call = t.start(path, body, lane=i % 2)
            if t.link is not None:
                assert call.ready()  # in process: answered when started
            got.append(decode(call.result())[0][P.HIDDEN])
        t.delete(P.SESSION.format(session_id=sid))
        answers.append(got)
        t.close()
    for a, b in zip(*answers):
        assert torch.equal(a, b)


def _error(fn):
    with pytest.raises(Exception) as info:
        fn()
    e = info.value
    return type(e), getattr(e, "status", None), str(e)


@pytest.mark.parametrize("case", ["unknown-route", "unknown-session", "bad-rows", "garbage-body", "no-tensors"])
def test_errors_are_the_same_classes_statuses_and_messages(servers, case):
    calls = {
        "unknown-route": lambda t: t.get_json("/v1/nothing-here"),
        "unknown-session": lambda t: t.post_bytes(P.SESSION_STEP.format(session_id="nope"), b"x"),
        "bad-rows": lambda t: t.post_json(P.SESSIONS, {"rows": 0}),
        "garbage-body": lambda t: t.post_bytes(P.FORWARD, b"not safetensors"),
        "no-tensors": lambda t: t.call(P.FORWARD, {}),
    }
    got = []
    for t in transports(servers):
        got.append(_error(lambda: calls[case](t)))
        t.close()
    assert got[0] == got[1]
    assert issubclass(got[0][0], (BadRequest, NotFound)) and got[0][1] in (400, 404)


@pytest.mark.parametrize("token", [None, "wrong-token-0123456789"])
def test_the_token_is_enforced(servers, token):
    for t in transports(servers, token=token):
        assert t.get_json(P.HEALTH)  # the health check needs none
        with pytest.raises(Unauthorized, match="bearer token") as info:
            t.get_json(P.INFO)
        assert info.value.status == 401
        with pytest.raises(Unauthorized):
            t.call(P.FORWARD, _hidden(1))
        t.close()


def test_a_training_step_is_the_same_over_both():
    """Two fresh servers (the same seed): a split model trained on each for two steps has the
    same losses, client-side weights and logits after, bit for bit."""
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    with ServerProcess((1, 3), optimizer="sgd", lr=0.1) as http, \
            InprocServerProcess((1, 3), optimizer="sgd", lr=0.1) as inproc:
        results = []
        for srv in (http, inproc):
            losses, model = sgd_steps(srv.url, ids, "c")
            model.eval()
            with torch.no_grad():
                logits = model(input_ids=ids).logits
            results.append((losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, logits))
    (l1, w1, o1), (l2, w2, o2) = results
    assert l1 == l2 and l1[1] < l1[0]  # bit for bit (float32 wire)
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
    assert torch.equal(o1, o2)


def test_an_unserved_url_is_a_refused_connection_until_served_again():
    with InprocServerProcess((1, 3)) as srv:
        t = Transport(TransportConfig(srv.url, TOKEN, retries=2, backoff_s=0.0))
        assert t.get_json(P.INFO)
        srv.restart()  # a new app at the same URL: the client reaches it
        assert t.get_json(P.INFO)
        app = srv.app
    with pytest.raises(TransportError, match="after 3 attempts: no app is served"):
        t.get_json(P.INFO)
    with pytest.raises(TransportError, match="after 3 attempts"):
        t.call(P.FORWARD, _hidden(2))
    assert t.stats.retries == 4  # retried as a refused connection is
    assert serve_inproc(app, srv.url.split("://")[1]) == srv.url
    try:
        assert t.get_json(P.HEALTH)
        with pytest.raises(ConfigError, match="already serves another"):
            serve_inproc(object(), srv.url.split("://")[1])
    finally:
        unserve(srv.url)


def test_urls_and_cores():
    assert shares_cores_with_server("inproc://anything")  # the server is this process
    t = Transport(TransportConfig("inproc://x", TOKEN))
    assert not t.lean and t.link is not None
    with pytest.raises(ConfigError, match="must start with"):
        TransportConfig("ftp://127.0.0.1:8000")


def test_requests_reaches_inproc_urls_through_the_adapter(servers):
    """tests/serverproc.py's ``web``: requests' calls, the same answers from either server."""
    from serverproc import auth, web

    answers = []
    for srv in servers:
        info = web.get(srv.url + P.INFO, headers=auth(), timeout=10)
        assert info.status_code == 200 and info.headers["content-type"].startswith("application/json")
        denied = web.post(srv.url + P.SESSIONS, json={"rows": 1}, headers=auth("wrong-token-0123456789"))
        assert denied.status_code == 401 and not denied.ok
        bad = web.post(srv.url + P.SESSIONS, json={"rows": 0}, headers=auth(), timeout=10)
        answers.append((info.json()["cuts"] if "cuts" in info.json() else None, denied.json(), bad.status_code,
                        bad.json()))
    assert answers[0] == answers[1]
    with pytest.raises(web.ConnectionError):
        web.get("inproc://never-served" + P.HEALTH)


def test_unserve_refuses_new_requests_and_waits_for_those_running():
    """As a server that stops: what it is running is answered, what comes after is refused."""
    import threading
    import time

    from flask import Flask

    app = Flask("slow")
    entered, release = threading.Event(), threading.Event()

    @app.route(P.HEALTH)
    def health():
        entered.set()
        release.wait(30)
        return {"ok": True}

    url = serve_inproc(app)
    t = Transport(TransportConfig(url, retries=0))
    answers = []
    running = threading.Thread(target=lambda: answers.append(t.get_json(P.HEALTH)))
    running.start()
    assert entered.wait(30)
    stopping = threading.Thread(target=unserve, args=(url,))
    stopping.start()
    time.sleep(0.2)
    assert stopping.is_alive()  # waits for the request in flight
    with pytest.raises(TransportError, match="no app is served"):
        t.get_json(P.HEALTH)  # a new one is refused meanwhile
    release.set()
    stopping.join(30)
    running.join(30)
    assert answers == [{"ok": True}] and not stopping.is_alive()
