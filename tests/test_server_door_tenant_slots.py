"""Connection slots per tenant, and the probes' own slots (issue 50, item 6), against the front
door in-process (splitlearn/server/http/frontdoor.py, a real waitress server on loopback).

The attack: a tenant opens keep-alive connections up to the replica's ``--max-connections``.
Before, HAProxy's tokenless ``GET /v1/ready`` then found no slot, the replica was marked DOWN
and every connection on it was cut. Now the tenant holds at most its own cap (429 beyond, at
its token), another tenant still gets its connections, and a tokenless probe is answered even
when tenants hold every one of ``--max-connections`` (the :data:`PROBE_SLOTS` beyond them).
"""
import json
import shutil
import socket
import subprocess
import threading
import time

import pytest

from splitlearn.api import protocol as P
from splitlearn.server.config import PROBE_SLOTS, DoorLimits
from splitlearn.server.http.frontdoor import make_server
from splitlearn.server.tenants import Tenants

from serverproc import OTHER, TOKEN

PROMPT_S = 3.0  # a probe under attack: one loop turn (<= 1 s) to make room, plus CI slack


def app(environ, start_response):
    """What answers behind the door: 200 and the path (the door decides who gets this far)."""
    body = json.dumps({"path": environ["PATH_INFO"]}).encode()
    start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
    return [body]


@pytest.fixture
def door_server():
    servers = []

    def start(**limits):
        server = make_server(app, Tenants([f"alice {TOKEN}", f"mallory {OTHER}"]), host="127.0.0.1", port=0,
                             threads=4, max_body_bytes=1 << 20,
                             limits=DoorLimits(request_timeout_s=5.0, idle_timeout_s=60.0, **limits))
        threading.Thread(target=server.run, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.task_dispatcher.shutdown()
        server.close()


def connect(server) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", int(server.effective_port)), timeout=10)
    s.settimeout(10)
    return s


def ask(sock: socket.socket, path: str, token=None) -> tuple[int, dict, bytes]:
    """One GET on ``sock`` (kept alive unless the server says otherwise): (status, headers, body)."""
    a = f"Authorization: Bearer {token}\r\n" if token else ""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{a}\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed without an answer: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk
        body += chunk
    return int(lines[0].split()[1]), headers, body


def closed_by_server(sock: socket.socket, timeout_s: float = 5.0) -> bool:
    sock.settimeout(timeout_s)
    try:
        while sock.recv(65536):
            pass
        return True
    except OSError:
        return False


def probe(server) -> float:
    """HAProxy's check: a tokenless ``GET /v1/ready`` on a new connection; its wait in seconds."""
    t0 = time.monotonic()
    s = connect(server)
    try:
        status, headers, _ = ask(s, P.READY)
    finally:
        s.close()
    assert status == 200 and headers.get("connection") == "close"
    return time.monotonic() - t0


def test_a_tenant_at_its_cap_leaves_slots_to_the_probe_and_the_other_tenant(door_server):
    server = door_server(max_connections=6)  # two tenants: 3 connections each
    mallory = []
    try:
        for k in range(6):  # the attack: keep-alive connections up to the replica's --max-connections
            s = connect(server)
            status, headers, body = ask(s, P.INFO, OTHER)
            if k < 3:
                assert status == 200, body
                mallory.append(s)  # kept alive: holds a slot
                continue
            assert status == 429, body  # refused at its token, never reaching the app
            err = json.loads(body)
            assert err["error"] == "too_many_requests" and "--max-tenant-connections 3" in err["message"]
            assert headers["connection"] == "close" and "retry-after" in headers
            assert closed_by_server(s)
            s.close()
        assert server.door.held == {"mallory": 3}
        for _ in range(3):  # HAProxy's checks (fall 2): every one answered
            assert probe(server) < PROMPT_S
        alice = [connect(server) for _ in range(3)]
        for s in alice:
            assert ask(s, P.INFO, TOKEN)[0] == 200
        assert ask(mallory[0], P.INFO, OTHER)[0] == 200  # her own connections still serve her
        assert server.door.held == {"mallory": 3, "alice": 3}
        for s in alice:
            s.close()
        stop = time.monotonic() + 5
        while server.door.held.get("alice") and time.monotonic() < stop:
            time.sleep(0.05)
        assert server.door.held == {"mallory": 3}  # closed connections give their slots back
    finally:
        for s in mallory:
            s.close()


@pytest.mark.serial  # measures the probe's wait
def test_the_probe_gets_a_slot_when_tenants_hold_every_connection(door_server):
    """An operator who lets one tenant hold all of --max-connections: the probes' slots stay
    free of tenants, and tokenless connections sitting on them make room."""
    server = door_server(max_connections=4, max_tenant_connections=4)
    held = []
    try:
        for _ in range(4):
            s = connect(server)
            assert ask(s, P.INFO, OTHER)[0] == 200
            held.append(s)
        for _ in range(PROBE_SLOTS):  # strangers on the probes' slots, sending nothing
            held.append(connect(server))
        time.sleep(0.3)
        waits = [probe(server) for _ in range(3)]
        assert max(waits) < PROMPT_S, [round(w, 2) for w in waits]
        s = connect(server)  # a fifth tenant connection: no tenant slot is left (503), whoever asks
        status, _, body = ask(s, P.INFO, TOKEN)
        assert status == 503 and json.loads(body)["error"] == "unavailable", body
        s.close()
        assert server.door.held == {"mallory": 4}
    finally:
        for s in held:
            s.close()


def test_a_connection_is_counted_as_the_tenant_of_its_last_request(door_server):
    """A proxy reuses its connections to the replica for any client: a connection counts
    against the tenant of its last request, never twice."""
    server = door_server(max_connections=2)  # a slot each
    s = connect(server)
    try:
        assert ask(s, P.INFO, OTHER)[0] == 200
        assert server.door.held == {"mallory": 1}
        assert ask(s, P.INFO, TOKEN)[0] == 200  # the same connection, now alice's
        assert server.door.held == {"alice": 1}
        t = connect(server)
        assert ask(t, P.INFO, OTHER)[0] == 200  # mallory's slot is free again
        status, _, body = ask(s, P.INFO, OTHER)  # ... and full: s cannot move to her
        assert status == 429, body
        t.close()
    finally:
        s.close()


HAPROXY = shutil.which("haproxy")


@pytest.mark.skipif(HAPROXY is None, reason="HAProxy is not installed (apt-get install haproxy; .ci/run installs it)")
def test_a_tenant_filling_the_replica_through_haproxy_does_not_take_it_out(door_server, tmp_path):
    """The attack end to end: the generated HAProxy configuration (checks every 100 ms, down
    after 2 failed, ``shutdown-sessions``) in front of the door; mallory opens twice the
    replica's --max-connections through HAProxy and keeps them. The replica stays up: her
    first connections keep being served, alice is served, no connection is cut."""
    from splitlearn.cluster.haproxy import HAProxySettings, command, write_config
    from splitlearn.procs.localserver import free_port

    server = door_server(max_connections=6)
    port = free_port()
    settings = HAProxySettings(bind=f"127.0.0.1:{port}", inter_ms=100, fall=2, rise=1,
                               servers=[("r0", f"127.0.0.1:{server.effective_port}")])
    proxy = subprocess.Popen(command(HAPROXY, write_config(settings, tmp_path / "haproxy.cfg", HAPROXY)),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    held = []
    try:
        deadline = time.monotonic() + 20
        while True:  # HAProxy up, the replica checked in
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=10)
                s.settimeout(10)
                if ask(s, P.INFO, TOKEN)[0] == 200:
                    s.close()
                    break
                s.close()
            except (OSError, AssertionError):
                pass
            assert time.monotonic() < deadline, "HAProxy never served"
            time.sleep(0.1)
        statuses = []
        for _ in range(12):  # the attack: twice --max-connections, kept alive
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.settimeout(10)
            statuses.append(ask(s, P.INFO, OTHER)[0])
            held.append(s)
        assert statuses.count(200) == 3 and set(statuses) == {200, 429}, statuses
        time.sleep(1.0)  # ten checks: two failed in a row would take the replica out
        for s in held[:3]:  # hers still served: nothing was cut
            assert ask(s, P.INFO, OTHER)[0] == 200
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.settimeout(10)
        assert ask(s, P.INFO, TOKEN)[0] == 200  # alice, through HAProxy, on a replica still up
        s.close()
    finally:
        for s in held:
            s.close()
        proxy.terminate()
        proxy.wait(10)
