"""The unix:// transport (splitlearn/transport/unix.py, server/http/unixdoor.py): a server with
``--listen unix:///PATH`` answers there as over HTTP (tensors, errors, tokens), bodies go through
the connection's shared region, and what is malformed or hostile gets a clean error while the
server keeps serving."""
import array
import fcntl
import json
import os
import socket
import stat
import tempfile
import time

import pytest
import torch

from splitlearn.api import protocol as P
from splitlearn.errors import BadRequest, ConfigError, NotFound, TransportError, Unauthorized
from splitlearn.hf import SplitGPT2LMHeadModel
from splitlearn.transport import Transport, TransportConfig
from splitlearn.transport import unixframe as F
from splitlearn.transport.unix import Connection, UnixLink
from splitlearn.api import wire
from splitlearn.api.wire import decode, encode, pack

from serverproc import TOKEN, ServerProcess, sgd_steps, tenants_flag

D = 32  # models/tiny.json


@pytest.fixture(scope="module")
def server():
    """One server process: HTTP on a port and the same app on a Unix socket."""
    d = tempfile.mkdtemp(prefix="sl-unix-")
    path = os.path.join(d, "server.sock")
    # several tenants: decode answers batch-invariant, whichever steps share a batch (packed.py)
    with ServerProcess((1, 3), optimizer="sgd", lr=0.1, extra=["--listen", "unix://" + path, *tenants_flag(d)]) as srv:
        srv.unix_path, srv.unix_url = path, "unix://" + path
        yield srv


def both(server, token=TOKEN):
    return [Transport(TransportConfig(u, token)) for u in (server.url, server.unix_url)]


def _hidden(seed: int, B: int = 2, T: int = 5) -> dict:
    h = torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))
    return {**pack(P.HIDDEN, h, "float32"), P.MASK: torch.ones(B, T, dtype=torch.long)}


def test_the_socket_file_is_private(server):
    st = os.stat(server.unix_path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600


@pytest.mark.parametrize("rows", [(2, 5), (4, 64)])  # inline (2.6 KB) and through the region (33 KB)
def test_a_forward_gets_the_same_tensors_and_metadata(server, rows):
    answers = []
    for t in both(server):
        answers.append(t.call_meta(P.FORWARD, _hidden(0, *rows), {"wire_dtype": "float32"}))
        assert t.stats.server_compute_s > 0  # X-Server-Time-Ms came back
        t.close()
    (a, ma), (b, mb) = answers
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) and ma == mb


@pytest.mark.parametrize("rows", [(2, 5), (4, 64)])  # inline, and through the region
def test_each_tensor_crosses_host_memory_once_each_way(server, rows):
    """WireStats.host_copy_bytes: over HTTP each tensor is copied once into the body and the
    answer's once out of it; over unix:// once into the region (or the inline frame) and once
    out. A second copy anywhere (a join after a copy, bytes() of a view) would show."""
    body = _hidden(0, *rows)
    sent = sum(v.numel() * v.element_size() for v in body.values())
    for t in both(server):
        a = t.call(P.FORWARD, body, {"wire_dtype": "float32"})
        got = sum(v.numel() * v.element_size() for v in a.values())
        assert t.stats.host_copy_bytes == sent + got, t.cfg.url
        t.close()


def test_decode_steps_on_two_lanes_are_sent_before_they_are_read(server):
    answers = []
    for t in both(server):
        sids = [t.post_json(P.SESSIONS, {"rows": 1})["session_id"] for _ in range(2)]
        got = []
        for i in range(3):
            calls = []
            for lane, sid in enumerate(sids):  # both requests out before either answer is read
                h = torch.randn(1, 1, D, generator=torch.Generator().manual_seed(10 * i + lane))
                body = encode({**pack(P.HIDDEN, h, "float32"), P.MASK: torch.ones(1, 1, dtype=torch.long)},
                              P.SessionStepMeta(i, "float32").to_meta())
                calls.append(t.start(P.SESSION_STEP.format(session_id=sid), body, lane=lane))
            deadline = time.monotonic() + 10
            while not all(c.ready() for c in calls) and time.monotonic() < deadline:
                time.sleep(0.001)
            got += [decode(c.result())[0][P.HIDDEN] for c in calls]
        for sid in sids:
            t.delete(P.SESSION.format(session_id=sid))
        if t.link is not None:
            assert sorted(t.link._lanes) == [0, 1]  # one connection per lane
        answers.append(got)
        t.close()
    assert all(torch.equal(a, b) for a, b in zip(*answers))


def test_generation_through_the_model_classes_is_the_same(server):
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(1))
    outs = []
    for url in (server.url, server.unix_url):
        model = SplitGPT2LMHeadModel.from_pretrained("tiny", server=url, token=TOKEN, client_id="gen").eval()
        outs.append(model.generate(ids, max_new_tokens=6, do_sample=False))
    assert torch.equal(outs[0], outs[1])


def test_a_training_step_is_the_same_as_over_http(server):
    """A fresh HTTP-only server and the fixture's unix socket (same seed): two SGD steps give the
    same losses and weights, bit for bit."""
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    with ServerProcess((1, 3), optimizer="sgd", lr=0.1) as plain:
        results = []
        for url in (plain.url, server.unix_url):
            losses, model = sgd_steps(url, ids, "train")
            results.append((losses, {k: v.detach().clone() for k, v in model.state_dict().items()}))
    (l1, w1), (l2, w2) = results
    assert l1 == l2 and l1[1] < l1[0]
    assert all(torch.equal(w1[k], w2[k]) for k in w1)


@pytest.mark.parametrize("case", ["unknown-route", "unknown-session", "bad-rows", "garbage-body"])
def test_errors_are_the_same_classes_statuses_and_messages(server, case):
    calls = {
        "unknown-route": lambda t: t.get_json("/v1/nothing-here"),
        "unknown-session": lambda t: t.post_bytes(P.SESSION_STEP.format(session_id="nope"), b"x"),
        "bad-rows": lambda t: t.post_json(P.SESSIONS, {"rows": 0}),
        "garbage-body": lambda t: t.post_bytes(P.FORWARD, b"not safetensors" * 2000),  # via the region
    }
    got = []
    for t in both(server):
        with pytest.raises((BadRequest, NotFound)) as info:
            calls[case](t)
        got.append((type(info.value), info.value.status, str(info.value)))
        t.close()
    assert got[0] == got[1]


@pytest.mark.parametrize("token", [None, "wrong-token-0123456789"])
def test_the_token_is_enforced(server, token):
    t = Transport(TransportConfig(server.unix_url, token))
    assert t.get_json(P.HEALTH)
    with pytest.raises(Unauthorized, match="bearer token"):
        t.get_json(P.INFO)
    with pytest.raises(Unauthorized):
        t.call(P.FORWARD, _hidden(1, 4, 64))
    t.close()


# -- raw frames: malformed and hostile ------------------------------------------------------

def _raw(server) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(server.unix_path)
    return s


def _answer(s: socket.socket):
    kind, ml, bl = F.unpack_header(bytes(F.recv_exact(s, F.HEADER.size)), 1 << 30)
    meta = F.parse_meta(bytes(F.recv_exact(s, ml)))
    return meta, bytes(F.recv_exact(s, bl))


def _request(path=P.INFO, **extra) -> dict:
    return {"method": "GET", "path": path, "headers": {"Authorization": f"Bearer {TOKEN}"}, **extra}


def _closed(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except (ConnectionError, socket.timeout):
        return True


def _still_serves(server):
    t = Transport(TransportConfig(server.unix_url, TOKEN))
    assert "cuts" in t.get_json(P.INFO)
    t.close()


@pytest.mark.parametrize("frame, status, words", [
    (b"GET /v1/info HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 20, 400, "magic"),
    (F.HEADER.pack(F.MAGIC, F.REQUEST, 0, 0, F.MAX_META_BYTES + 1, 0), 400, "metadata of"),
    (F.HEADER.pack(F.MAGIC, F.REQUEST, 0, 0, 2, 1 << 40), 413, "inline body"),
    (F.HEADER.pack(F.MAGIC, F.REQUEST, 0, 0, 5, 0) + b"{nope", 400, "not json"),
    (F.HEADER.pack(F.MAGIC, 9, 0, 0, 2, 0) + b"{}", 400, "kind"),
])
def test_a_malformed_frame_gets_a_clean_error_and_the_connection_closes(server, frame, status, words):
    s = _raw(server)
    s.sendall(frame)
    meta, body = _answer(s)
    assert meta["status"] == status
    err = json.loads(body)
    assert set(err) == {"error", "message"} and words in err["message"].lower()
    assert _closed(s)
    s.close()
    _still_serves(server)


@pytest.mark.parametrize("fields, words", [
    ({"method": "get"}, "method"), ({"path": "v1/info"}, "path"), ({"path": "/v1/\ninfo"}, "path"),
    ({"headers": {"Authorization": 5}}, "headers"), ({"headers": {"X\r\nY": "1"}}, "header"),
    ({"region": [0, 10]}, "registered none"), ({"region": "0:10"}, "offset, length"),
    ({"device": [0, 10]}, "no device region"),  # a GPU region's descriptor, its header inline
])
def test_a_bad_field_gets_a_400_and_the_connection_goes_on(server, fields, words):
    s = _raw(server)
    head = wire.Encoded(_hidden(0)).head if "device" in fields else b""
    s.sendall(F.pack(F.REQUEST, {**_request(), **fields}, len(head)) + head)
    meta, body = _answer(s)
    assert meta["status"] == 400 and words in json.loads(body)["message"].lower()
    s.sendall(F.pack(F.REQUEST, _request()))  # the same connection answers the next request
    meta, body = _answer(s)
    assert meta["status"] == 200 and "cuts" in json.loads(body)
    s.close()


def _memfd(size: int, seal: bool = True) -> int:
    fd = os.memfd_create("t", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return fd


def _hello(s: socket.socket, fds: list, size: int):
    s.sendmsg([F.pack(F.HELLO, {"version": F.VERSION, "region_bytes": size})],
              [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else [])
    return _answer(s)


@pytest.mark.parametrize("case, words", [
    ("unsealed", "sealed"), ("file", "sealed"), ("none", "exactly one"), ("two", "exactly one"),
    ("size", "exactly region_bytes"), ("huge", "region_bytes must be"),
])
def test_a_hostile_region_is_refused(server, case, words):
    size = 1 << 16
    if case == "file":
        f = tempfile.TemporaryFile()
        f.truncate(size)
        fds = [os.dup(f.fileno())]
        f.close()
    else:
        fds = {"unsealed": lambda: [_memfd(size, seal=False)], "none": lambda: [],
               "two": lambda: [_memfd(size), _memfd(size)]}.get(case, lambda: [_memfd(size)])()
    claimed = {"size": size * 2, "huge": 1 << 50}.get(case, size)
    s = _raw(server)
    try:
        meta, body = _hello(s, fds, claimed)
        assert meta["status"] == 400 and words in json.loads(body)["message"], body
        assert _closed(s)
    finally:
        s.close()
        for fd in fds:
            os.close(fd)
    _still_serves(server)


@pytest.mark.parametrize("device, status", [({"bytes": 2 << 20, "uuid": "GPU-elsewhere"}, 200),
                                            ({"bytes": 2 << 20}, 400), ("all of it", 400)])
def test_a_device_region_offered_to_a_server_without_a_gpu(server, device, status):
    """This server computes on the CPU: a well-formed offer is declined (``device_bytes`` 0, the
    client sends from host memory; the second descriptor is never touched), a malformed one is a 400."""
    fds = [_memfd(1 << 16), _memfd(1 << 16)]
    s = _raw(server)
    try:
        s.sendmsg([F.pack(F.HELLO, {"version": F.VERSION, "region_bytes": 1 << 16, "device": device})],
                  [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        meta, body = _answer(s)
        assert meta["status"] == status, body
        if status == 200:
            assert meta["device_bytes"] == 0 and meta["region_bytes"] == 1 << 16
        else:
            assert "device must be" in json.loads(body)["message"] and _closed(s)
    finally:
        s.close()
        for fd in fds:
            os.close(fd)
    _still_serves(server)


def test_a_region_is_its_connections_alone(server):
    """A's region: B cannot name it (no names exist; B's descriptors are checked against B's own
    region), and B's large requests and answers never touch it."""
    a = Connection(server.unix_path, region_bytes=1 << 16)
    b = Connection(server.unix_path, region_bytes=1 << 15)
    none = Connection(server.unix_path, region_bytes=0)
    try:
        a.region[:] = b"A" * (1 << 16)
        secret = bytes(a.region)
        headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": P.CONTENT_TYPE}
        for conn, region, words in ((b, [1 << 15, 16], "outside"), (b, [-1, 4], "outside"),
                                    (b, [0, 1 << 16], "outside"), (none, [0, 16], "registered none")):
            meta = _request(P.FORWARD, region=region)
            meta["method"], meta["headers"] = "POST", headers
            conn.sock.sendall(F.pack(F.REQUEST, meta))
            status, _, content = conn._read_answer()
            assert status == 400 and words in json.loads(content)["message"]
        body = encode(_hidden(5, 4, 64), {"wire_dtype": "float32"})  # 33 KB: both ways via B's region
        status, headers_, content = b.request("POST", P.FORWARD, headers, body)
        assert status == 200 and decode(content)[0][P.HIDDEN].shape == (4, 64, D)
        assert bytes(a.region) == secret
        status, _, content = a.request("GET", P.INFO, {"Authorization": f"Bearer {TOKEN}"}, None)
        assert status == 200
    finally:
        for c in (a, b, none):
            c.close()


# -- the door alone: deadlines, connection slots, the socket file ---------------------------

@pytest.fixture
def door():
    from flask import Flask

    from splitlearn.server.tenants import Tenants
    from splitlearn.server.config import DoorLimits
    from splitlearn.server.http.unixdoor import UnixDoor

    app = Flask("t")

    @app.route(P.HEALTH)
    def health():
        return {"ok": True}

    path = os.path.join(tempfile.mkdtemp(prefix="sl-door-"), "d.sock")
    d = UnixDoor(app, Tenants([TOKEN]), path, max_body_bytes=1 << 20, mode=0o660,
                 limits=DoorLimits(max_connections=2, request_timeout_s=0.5, idle_timeout_s=0.5)).start()
    yield d
    d.close()


def test_the_door_cuts_silent_peers_and_limits_connections(door):
    assert stat.S_IMODE(os.stat(door.path).st_mode) == 0o660
    silent = socket.socket(socket.AF_UNIX)
    silent.connect(door.path)
    half = socket.socket(socket.AF_UNIX)
    half.connect(door.path)
    half.sendall(F.pack(F.REQUEST, {"method": "GET", "path": P.HEALTH})[:7])  # then nothing
    third = UnixLink(door.url)  # waits in the backlog while both slots are held
    t0 = time.monotonic()
    status, _, content = third.request("GET", P.HEALTH, {}, None)
    assert status == 200 and json.loads(content) == {"ok": True}
    assert time.monotonic() - t0 < 5  # admitted once the oldest stranger (silent) gave its slot up
    silent.settimeout(5)
    assert silent.recv(1) == b""  # closed, unanswered
    half.settimeout(5)
    meta, body = _answer(half)
    assert meta["status"] == 408  # its frame's deadline
    for s in (silent, half):
        s.close()
    third.close()


def test_each_request_on_a_connection_is_served_as_the_token_it_carries():
    """The door remembers the header a connection last authenticated with (no hash per request).
    The attack: a connection that authenticated as alice sends a later request with mallory's
    token, a wrong one or none, hoping to be served as alice. Each request is its own token's."""
    from flask import Flask, request as flask_request

    from splitlearn.server.tenants import Tenants
    from splitlearn.server.http.frontdoor import TENANT_KEY
    from splitlearn.server.http.unixdoor import UnixDoor

    from serverproc import OTHER, TENANTS

    app = Flask("t")

    @app.route("/whoami")
    def whoami():
        return {"tenant": flask_request.environ[TENANT_KEY].name}

    path = os.path.join(tempfile.mkdtemp(prefix="sl-door-"), "d.sock")
    d = UnixDoor(app, Tenants(TENANTS), path, max_body_bytes=1 << 20).start()
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(path)
    try:
        def ask(headers):
            s.sendall(F.pack(F.REQUEST, {"method": "GET", "path": "/whoami", "headers": headers}))
            meta, body = _answer(s)
            return meta["status"], json.loads(body)

        for token, expect in [(TOKEN, "alice"), (TOKEN, "alice"), (OTHER, "mallory"), (TOKEN, "alice"),
                              ("tok-5c1f0e8b2a9d4e78", 401), (TOKEN + " x", 401), (None, 401), (TOKEN, "alice")]:
            status, body = ask({"Authorization": f"Bearer {token}"} if token else {})
            if expect == 401:
                assert status == 401 and body["error"] == "unauthorized", token
            else:
                assert (status, body) == (200, {"tenant": expect}), token
    finally:
        s.close()
        d.close()


def test_a_live_socket_is_not_taken_over_and_a_stale_one_is(door):
    from splitlearn.server.config import socket_path
    from splitlearn.server.http.unixdoor import UnixDoor

    with pytest.raises(ConfigError, match="already listens"):
        UnixDoor(door.app, door.tenants, door.path, max_body_bytes=1 << 20)
    with pytest.raises(ConfigError, match="unix:///"):
        socket_path("unix://relative/x.sock")
    door.close()
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(door.path)  # a socket file nobody listens on (a crashed server's)
    stale.close()
    again = UnixDoor(door.app, door.tenants, door.path, max_body_bytes=1 << 20).start()
    try:
        assert UnixLink(again.url).request("GET", P.HEALTH, {}, None)[0] == 200
    finally:
        again.close()


def test_a_lane_whose_server_goes_silent_names_its_request(tmp_path):
    """A server that takes the request and never answers: the lane's read times out with the
    request's method and URL in the error, and the lane's connection is dropped."""
    import threading

    path = str(tmp_path / "silent.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(1)
    held = []

    def serve():
        c, _ = listener.accept()
        held.append(c)
        kind, ml, _ = F.unpack_header(bytes(F.recv_exact(c, F.HEADER.size)), 0)
        F.recv_exact(c, ml)  # the HELLO (its region comes and goes with it)
        c.sendall(F.pack(F.ANSWER, {"status": 200, "headers": [], "region_bytes": 1 << 20, "device_bytes": 0}))
        c.recv(1 << 16)  # the request: never answered

    threading.Thread(target=serve, daemon=True).start()
    link = UnixLink("unix://" + path, read_timeout_s=0.3)
    try:
        link.send(0, "POST", "/v1/sessions/abc/step", {}, b"x" * 16)
        with pytest.raises(TransportError, match=f"POST unix://{path}/v1/sessions/abc/step: no answer within 0.3s"):
            link.receive(0)
        assert 0 not in link._lanes
    finally:
        link.close()
        for c in held:
            c.close()
        listener.close()


def test_an_unserved_socket_is_a_refused_connection():
    t = Transport(TransportConfig("unix:///nonexistent/dir/s.sock", TOKEN, retries=1, backoff_s=0.0))
    with pytest.raises(TransportError, match="after 2 attempts"):
        t.get_json(P.INFO)
    with pytest.raises(ConfigError):
        TransportConfig("unix://host/x.sock").url and UnixLink("unix://host/x.sock")


def test_diagnose_measures_the_unix_link(server):
    from splitlearn.analysis.diagnose import DiagnoseConfig, diagnose

    t = Transport(TransportConfig(server.unix_url, TOKEN))
    try:
        report = diagnose(t, DiagnoseConfig(sizes=(1 << 10, 64 << 10), repeats=1, warmup=1, train_batch=1,
                                            train_seq=4, codec_repeats=1))
    finally:
        t.close()
    assert report["transport"] == "unix" and report["server"] == server.unix_url
    assert report["per_call_overhead_ms"] >= 0 and "rtt_ms" in report["link"]


def test_the_benchmark_functions_run(server):
    """benchmarks/unix_transport.py's measurements, a few calls each (not timed here)."""
    from benchmarks.unix_transport import (bare_frame_overheads, decode_overheads, echo_round_trips, measure,
                                           ratios, socket_ping_pongs)

    t = Transport(TransportConfig(server.unix_url, TOKEN))
    try:
        assert len(decode_overheads(t, D, 3)) == 3
        assert len(echo_round_trips(t, 64 << 10, 2)) == 2
        assert len(bare_frame_overheads(server.unix_path, TOKEN, t, D, 3)) == 3  # --floor
        assert len(socket_ping_pongs(300, 3)) == 3
    finally:
        t.close()
    rows = [{"case": "c", "transport": "tcp", "median_ms": 2.0}, {"case": "c", "transport": "unix", "median_ms": 1.0},
            {"case": "f", "transport": "unix", "median_ms": 1.0}, {"case": "f", "transport": "frames", "median_ms": 0.5}]
    assert ratios(rows) == {"c": 0.5} and callable(measure)


def test_the_listen_options():
    from splitlearn.server.http.cli import parse_args

    base = ["--model", "tiny", "--cut", "1", "--cut", "3"]
    cfg = parse_args(base + ["--listen", "unix:///tmp/a.sock", "--listen", "unix:///tmp/b.sock", "--no-tcp",
                             "--unix-mode", "0660"])
    assert cfg.listen == ("unix:///tmp/a.sock", "unix:///tmp/b.sock") and not cfg.tcp and cfg.unix_mode == "0660"
    assert parse_args(base).tcp and parse_args(base).listen == ()
    with pytest.raises(ConfigError, match="needs a --listen"):
        parse_args(base + ["--no-tcp"])
    with pytest.raises(ConfigError, match="unix:///absolute"):
        parse_args(base + ["--listen", "tcp://127.0.0.1:9"])


def test_a_refused_region_falls_back_to_inline_bodies(server):
    """A server that will not map this client's region (too large for it, here) still serves
    the connection, with bodies inline."""
    conn = Connection(server.unix_path, region_bytes=1 << 30)  # more than this server maps (512 MiB)
    try:
        assert conn.region is None and conn.size == 0
        body = encode(_hidden(6, 4, 64), {"wire_dtype": "float32"})
        status, _, content = conn.request("POST", P.FORWARD, {"Authorization": f"Bearer {TOKEN}",
                                                              "Content-Type": P.CONTENT_TYPE}, body)
        assert status == 200 and decode(content)[0][P.HIDDEN].shape == (4, 64, D)
    finally:
        conn.close()


def test_a_unix_only_server_serves_and_removes_its_socket_on_sigterm(tmp_path):
    """``--no-tcp --listen unix://... --unix-mode 0660``: no port, the group may connect; SIGTERM
    checkpoints, exits 0 and removes the socket file."""
    import signal
    import subprocess
    import sys

    from splitlearn.procs import localserver

    path = str(tmp_path / "only.sock")
    proc = localserver.launch([sys.executable, "-m", "splitlearn.server", "--model", "tiny", "--cut", "1", "--cut", "3",
                             "--listen", "unix://" + path, "--no-tcp", "--unix-mode", "0660", "--log-level", "WARNING"],
                            env={**os.environ, "SPLITLEARN_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        t = Transport(TransportConfig("unix://" + path, TOKEN, retries=8, backoff_s=0.2, max_backoff_s=1.0))
        assert t.get_json(P.INFO)["cuts"] == [1, 3]  # retried while the server starts
        t.close()
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert not os.path.exists(path)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cores_and_spinning(server, monkeypatch):
    """A unix:// server shares this process's cores when its own process (the socket's peer,
    ``SO_PEERCRED``) may run on one of them; then a lane sleeps for its answer (polling would
    take the core from the server), else it polls. Unknown server cores: as loopback (shared
    unless this process is pinned to fewer cores than the machine has)."""
    import splitlearn.transport.inproc  # noqa: F401 - registers inproc://
    from splitlearn.transport import shares_cores_with_server
    from splitlearn.transport import unix as unix_mod
    from splitlearn.transport.unix import server_cores

    server_pid = server.proc.pid
    assert server_cores(server.unix_url) == os.sched_getaffinity(server_pid)
    assert server_cores("unix:///nowhere/at/all.sock") is None
    asked = []  # generate() asks before every call: the answer is kept a while, not asked per call
    real = unix_mod._ask_cores
    monkeypatch.setattr(unix_mod, "_ask_cores", lambda url: asked.append(url) or real(url))
    unix_mod._cores_seen.clear()
    assert [server_cores(server.unix_url) for _ in range(3)] == [os.sched_getaffinity(server_pid)] * 3
    assert asked == [server.unix_url]
    cores = {"me": {0}, server_pid: {0}}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: cores.get(pid, cores["me"]) if pid else cores["me"])
    unix_mod._cores_seen.clear()  # a server's cores are kept 10 s: the mocked ones from now on
    assert shares_cores_with_server(server.unix_url)  # both pinned to core 0: pinned, and still shared
    assert shares_cores_with_server("inproc://x")  # in this very process
    if (os.cpu_count() or 1) > 1:
        cores[server_pid] = {1}
        unix_mod._cores_seen.clear()  # (a server re-pinned while it runs is seen within 10 s)
        assert not shares_cores_with_server(server.unix_url)  # two devices emulated: poll
        monkeypatch.setattr("splitlearn.transport.unix.server_cores", lambda url: None)
        monkeypatch.setattr("splitlearn.transport.unix.UnixLink.server_cores", staticmethod(lambda url: None))
        cores["me"] = set(range(os.cpu_count()))
        assert shares_cores_with_server(server.unix_url)  # unknown: all my cores, shared
    t = Transport(TransportConfig(server.unix_url, TOKEN, spin=True))
    try:
        for i in range(3):  # the first learns the expected wait, the others poll near it
            out = t.call(P.FORWARD, _hidden(i), {"wire_dtype": "float32"})
            assert out[P.HIDDEN].shape == (2, 5, D)
        assert t.link._lanes[0].expected_s is not None
    finally:
        t.close()


def test_a_lane_whose_connection_was_lost_is_resent_on_a_new_one(server):
    t = Transport(TransportConfig(server.unix_url, TOKEN, backoff_s=0.0))
    try:
        first = t.call(P.FORWARD, _hidden(7), {"wire_dtype": "float32"})
        lost = t.link._lanes[0]
        lost.sock.shutdown(socket.SHUT_RDWR)  # as a server that went away between two calls
        again = t.call(P.FORWARD, _hidden(7), {"wire_dtype": "float32"})
        assert torch.equal(first[P.HIDDEN], again[P.HIDDEN]) and t.link._lanes[0] is not lost
    finally:
        t.close()


# -- lanes: one request in flight each -------------------------------------------------------

def test_a_lane_with_an_unread_answer_takes_no_second_request(server):
    """A second request on a lane would be answered with the first one's answer (one connection,
    answers in order): the link refuses it, and the first answer is still read as sent."""
    t = Transport(TransportConfig(server.unix_url, TOKEN))
    first = t.start_call(P.FORWARD, _hidden(0), {"wire_dtype": "float32"}, lane=3)
    with pytest.raises(RuntimeError, match="lane 3 .* already has a request in flight"):
        t.start_call(P.FORWARD, _hidden(1, 4, 7), {"wire_dtype": "float32"}, lane=3)
    out = t.finish_call(first)
    assert out[P.HIDDEN].shape == (2, 5, D)  # the first request's answer, not another's
    again = t.finish_call(t.start_call(P.FORWARD, _hidden(1, 4, 7), {"wire_dtype": "float32"}, lane=3))
    assert again[P.HIDDEN].shape == (4, 7, D)
    t.close()


def test_a_pipelined_piece_sent_again_goes_on_its_own_lane(server, monkeypatch):
    """Issue 42's H100 run: a SplitClient with micro_batches=4 (backwards sent during the
    forwards, 1F1B) got "the server's trunk output is not usable: the body has no tensor
    'hidden' (it has ['grad'])". A forward piece whose answer failed (503 busy, a dropped
    connection) was sent again as a lone call on lane 0, where the first piece's backward was
    still out: it read that backward's answer. Here piece 1's first answer is a 503 while
    piece 0's backward is unread; the step's loss and gradients are the unpiped step's."""
    from splitlearn.errors import ServiceUnavailable
    from splitlearn.hf import pipeline

    def model():
        torch.manual_seed(0)
        m = SplitGPT2LMHeadModel.from_pretrained("tiny", server=server.unix_url, token=TOKEN,
                                                 micro_batches=4).train()
        m.loss_gradient = 1.0  # the backwards go out while the forwards come back (1F1B)
        return m

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 256, (8, 10), generator=g)
    whole = model()
    whole.micro_batches = 1
    ref = whole(input_ids=ids, labels=ids).loss
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in whole.named_parameters() if p.grad is not None}
    whole.remote.steps.discard()  # nothing applied: the server's weights stay as they are

    piped = model()
    transport, fired = piped.remote.transport, []
    real = transport.finish_call_meta

    def flaky(pending):
        out = real(pending)
        if pending.path == P.TRAIN_FORWARD and pending.lane == 1 and not fired:
            fired.append(pending.lane)
            raise ServiceUnavailable("the segment is busy")  # its answer read, then lost
        return out

    monkeypatch.setattr(transport, "finish_call_meta", flaky)
    monkeypatch.setattr(pipeline._Lanes, "ready", lambda self, key: key in self.answers)  # b(0) stays out
    loss = piped(input_ids=ids, labels=ids).loss
    loss.backward()
    assert fired and float(loss) == pytest.approx(float(ref), rel=1e-5)
    for n, p in piped.named_parameters():
        if n in ref_grads:
            assert torch.allclose(p.grad, ref_grads[n], rtol=1e-4, atol=1e-6), n
    piped.remote.steps.discard()
    whole.remote.close()
    piped.remote.close()
