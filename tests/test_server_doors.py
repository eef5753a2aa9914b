"""The doors' walls against one real server process (TCP and ``--listen unix://``, one tenant,
``--max-memory-gb 0.05``, ``--max-connections 4``): a body is reserved in the memory account
before a byte of it is allocated, tokenless requests carry no body, strangers give their unix
slots up, lone surrogates are a 400 (docs/SECURITY.md, 'Outsiders' and 'The Unix socket')."""
import array
import fcntl
import json
import os
import socket
import sys
import tempfile
import threading
import time

import pytest

from splitlearn.api import protocol as P
from splitlearn.procs.localserver import ChildServer, free_port
from splitlearn.transport import Transport, TransportConfig
from splitlearn.transport import unixframe as F

from serverproc import TOKEN, rss_mib

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # RSS and slots: run alone (pytest.ini)

MIB = 1 << 20
LIMIT = int(0.05 * (1 << 30))  # --max-memory-gb 0.05: 51.2 MiB, the whole account (one tenant: its share too)
TIMEOUT_S = 2.0  # --request-timeout: a body's first byte is due by then, the rest at --min-rate-kib
RATE_KIB = 16384


@pytest.fixture(scope="module")
def server():
    sock_path = os.path.join(tempfile.mkdtemp(prefix="sl-doors-"), "s.sock")
    port = free_port()
    cmd = [sys.executable, "-m", "splitlearn.server", "--model", "tiny", "--cut", "1", "--cut", "3",
           "--threads", "2", "--port", str(port), "--listen", "unix://" + sock_path,
           "--max-memory-gb", "0.05", "--max-connections", "4", "--request-timeout", str(TIMEOUT_S),
           "--min-rate-kib", str(RATE_KIB), "--log-level", "WARNING"]
    srv = ChildServer(cmd, port, env={"SPLITLEARN_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}, capture_stderr=True)
    with srv:
        srv.unix_path, srv.unix_url = sock_path, "unix://" + sock_path
        yield srv


def raw(server) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(server.unix_path)
    return s


def answer(s: socket.socket):
    """(status, JSON body or None) of the next answer on ``s``; None if the server closed it unanswered."""
    try:
        head = F.recv_exact(s, F.HEADER.size)
        _kind, meta_len, body_len = F.unpack_header(bytes(head), 1 << 30)
        meta = F.parse_meta(bytes(F.recv_exact(s, meta_len)))
        return meta["status"], json.loads(bytes(F.recv_exact(s, body_len))) if body_len else None
    except ConnectionError:
        return None


def closed(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except (ConnectionError, socket.timeout):
        return True


def request(method: str, path: str, token=None, **extra) -> dict:
    return {"method": method, "path": path, "headers": {"Authorization": f"Bearer {token}"} if token else {}, **extra}


def info(server) -> dict:
    t = Transport(TransportConfig(server.unix_url, TOKEN, retries=0, read_timeout_s=10))
    try:
        return t.get_json(P.INFO)
    finally:
        t.close()


def reserved(server) -> int:
    return info(server)["memory"]["reserved_bytes"]


def wait_for(condition, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def test_tokenless_unix_bodies_are_refused_unread_and_the_server_stays_small(server):
    """The attack of issue 40: eight tokenless connections announce 256 MiB each (to /v1/health,
    which needs no token) and send nothing. Each is answered 401 before a byte is read and
    closed; the server's memory does not move (it grew by 256 MiB a connection, allocated at
    the announcement) and a tenant is still served."""
    info(server)
    before = rss_mib(server.proc.pid)
    socks = [raw(server) for _ in range(8)]
    for i, s in enumerate(socks):
        s.sendall(F.pack(F.REQUEST, request("POST" if i % 2 else "GET", P.HEALTH), 256 * MIB))
    for s in socks:
        status, err = answer(s)
        assert status == 401 and err["error"] == "unauthorized" and "bodiless" in err["message"], err
        assert closed(s)
        s.close()
    grown = rss_mib(server.proc.pid) - before
    assert grown < 32, f"the server grew by {grown:.0f} MiB for 2 GiB of announced bodies"
    assert "cuts" in info(server) and reserved(server) == 0
    s = raw(server)  # without a body, the probe is answered as before
    s.sendall(F.pack(F.REQUEST, request("GET", P.HEALTH)))
    assert answer(s)[1]["status"] == "ok"
    s.close()


def test_a_tenants_unix_body_is_reserved_before_it_is_read(server):
    """A tenant announcing more than the account holds gets 429 before a byte is read (connection
    closed); one that fits is reserved at once (/v1/info shows it), and when it never comes it
    is cut off at --request-timeout (its bytes are due as they come, not at the end of the whole
    body's allowance) and the reservation is released."""
    before = rss_mib(server.proc.pid)
    s = raw(server)
    s.sendall(F.pack(F.REQUEST, request("POST", P.ECHO, TOKEN), 256 * MIB))
    status, err = answer(s)
    assert status == 429 and err["error"] == "too_many_requests" and "a request body" in err["message"], err
    assert closed(s)
    s.close()
    assert rss_mib(server.proc.pid) - before < 32

    s = raw(server)
    started = time.monotonic()
    s.sendall(F.pack(F.REQUEST, request("POST", P.ECHO, TOKEN), 40 * MIB) + b"x" * 1000)
    assert wait_for(lambda: reserved(server) >= 40 * MIB, 5)
    status, err = answer(s)  # then nothing: cut off at the pace's deadline
    assert status == 408 and err["error"] == "request_timeout", err
    assert time.monotonic() - started < TIMEOUT_S + 3
    s.close()
    assert wait_for(lambda: reserved(server) == 0, 5)


def test_four_tcp_bodies_held_back_are_bounded_by_the_account(server):
    """Issue 40, item 9: four tenant bodies of 40 MiB over TCP, the last byte held back. The
    first is reserved at its headers; the others do not fit (51.2 MiB) and get 429 with
    Retry-After before waitress buffers them. RSS grows by about one body (it grew by all four,
    0 bytes reserved), and closing the connection releases the reservation."""
    body = b"\0" * (40 * MIB - 1)
    base = rss_mib(server.proc.pid)
    socks, answers = [], []
    for _ in range(4):
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall((f"POST {P.ECHO} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                   f"Content-Type: {P.CONTENT_TYPE}\r\nContent-Length: {40 * MIB}\r\n\r\n").encode())
        socks.append(s)

    def send(s):
        try:
            s.sendall(body)
        except OSError:
            pass  # refused: the server lingered and closed

    senders = [threading.Thread(target=send, args=(s,)) for s in socks]
    for t in senders:
        t.start()
    for t in senders:
        t.join(30)
    assert reserved(server) >= 40 * MIB
    grown = rss_mib(server.proc.pid) - base
    for s in socks:
        s.settimeout(0.5)
        try:
            answers.append(s.recv(1 << 16))
        except (socket.timeout, ConnectionError):
            answers.append(b"")
    refused = [a for a in answers if a.startswith(b"HTTP/1.1 429")]
    assert len(refused) == 3, answers
    for a in refused:
        head, payload = a.split(b"\r\n\r\n", 1)
        assert b"Retry-After: 1" in head and json.loads(payload)["error"] == "too_many_requests"
    assert grown < 40 + 30, f"RSS grew by {grown:.0f} MiB for one 40 MiB body reserved"
    for s in socks:
        s.close()
    assert wait_for(lambda: reserved(server) == 0, 5)


def test_strangers_give_their_unix_slots_up(server):
    """Issue 40, item 5: with --max-connections 4, four pingers keep connections with a tokenless
    /v1/health every 0.3 s (reconnecting when dropped). A tenant's /v1/info is answered within
    seconds each time (it waited more than 25 s): the oldest stranger gives its slot up."""
    stop = threading.Event()

    def ping():
        while not stop.is_set():
            try:
                s = raw(server)
                while not stop.is_set():
                    s.sendall(F.pack(F.REQUEST, request("GET", P.HEALTH)))
                    if answer(s) is None:
                        break
                    time.sleep(0.3)
            except OSError:
                pass
            time.sleep(0.05)

    pingers = [threading.Thread(target=ping, daemon=True) for _ in range(4)]
    for t in pingers:
        t.start()
    try:
        time.sleep(0.5)  # the four slots taken (each pinger's first health: a few ms)
        waits = []
        for _ in range(3):
            t0 = time.monotonic()
            assert "cuts" in info(server)
            waits.append(time.monotonic() - t0)
        assert max(waits) < 3, waits
    finally:
        stop.set()
        for t in pingers:
            t.join(15)


@pytest.mark.parametrize("fields", [
    {"path": P.HEALTH + "\ud800"},
    {"headers": {"X-Note": "a\ud800b"}},
    {"headers": {"Authorization": "Bearer \udfff" + TOKEN}},
    {"path": P.INFO, "headers": {"Authorization": f"Bearer {TOKEN}", "X-Request-Id": "\ud83d"}},
])
def test_a_lone_surrogate_is_a_400_and_no_traceback(server, fields):
    """JSON's \\ud800 escapes make strings no encoder takes: in a path or a header (with a token
    or without) they are a JSON 400, the connection goes on, and the log has no traceback
    (they dropped the connection with one)."""
    s = raw(server)
    s.sendall(F.pack(F.REQUEST, {**request("GET", P.HEALTH), **fields}))
    status, err = answer(s)
    assert status == 400 and err["error"] == "bad_request" and "surrogate" in err["message"], err
    s.sendall(F.pack(F.REQUEST, request("GET", P.HEALTH)))
    assert answer(s)[1]["status"] == "ok"
    s.close()
    assert "Traceback" not in server.stderr_tail(1 << 20)


# -- the HELLO, in this process -------------------------------------------------------------

def test_the_hello_reads_the_seals_before_the_size(monkeypatch):
    """Issue 40, item 8: a memfd that can still shrink is refused for that before its size is
    read (read first, a racer could shrink it after the size check). A memfd of the wrong size
    and without seals is refused for the seals; the door's own calls come seals first."""
    from flask import Flask

    from splitlearn.server.tenants import Tenants
    from splitlearn.server.http.unixdoor import UnixDoor

    calls = []
    fstat, fcntl_ = os.fstat, fcntl.fcntl

    def spy_fstat(fd, *a):
        if threading.current_thread().name == "unixdoor-conn":
            calls.append("size")
        return fstat(fd, *a)

    def spy_fcntl(fd, op, *a):
        if threading.current_thread().name == "unixdoor-conn" and op == fcntl.F_GET_SEALS:
            calls.append("seals")
        return fcntl_(fd, op, *a)

    monkeypatch.setattr(os, "fstat", spy_fstat)
    monkeypatch.setattr(fcntl, "fcntl", spy_fcntl)
    path = os.path.join(tempfile.mkdtemp(prefix="sl-door-"), "d.sock")
    door = UnixDoor(Flask("t"), Tenants([TOKEN]), path, max_body_bytes=MIB).start()
    try:
        for seal, size, words in [(False, 1 << 17, "sealed"), (True, 1 << 17, "exactly region_bytes"),
                                  (True, 1 << 16, None)]:
            fd = os.memfd_create("t", os.MFD_ALLOW_SEALING)
            os.ftruncate(fd, 1 << 16)
            if seal:
                fcntl_(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(10)
            s.connect(path)
            calls.clear()
            s.sendmsg([F.pack(F.HELLO, {"version": F.VERSION, "region_bytes": size})],
                      [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
            status, body = answer(s)
            if words is None:
                assert status == 200 and calls == ["seals", "size"], (status, body, calls)
            else:
                assert status == 400 and words in body["message"], body
                assert calls == (["seals"] if not seal else ["seals", "size"]), calls
            s.close()
            os.close(fd)
    finally:
        door.close()
