"""Every server accounts the bodies it holds (issue 50, item 7): the fed server and the offload
server reserve a tenant's body in a memory account at its headers, as the segment server does
(splitlearn/server/http/frontdoor.py, splitlearn/server/engine/memory.py), and refuse beyond it.

The attack: connections that announce large bodies and hold their last bytes back (before, 3 x
400 MiB grew the fed server's RSS by 1,202 MiB in 2.1 s, with defaults of 2 GiB a body x 256
connections). Here the front door in-process (a real waitress server on loopback) with small
accounts: what is announced and never sent reserves at most the budget; the rest is refused at
its headers with a JSON 429 (the tenant's share) or 503 (the total), before a byte is buffered.
"""
import dataclasses
import json
import socket
import threading
import time
from contextlib import contextmanager

import pytest

from splitlearn.api import protocol as P
from splitlearn.model.loading import load_config
from splitlearn.procs.localserver import free_port
from splitlearn.server.engine.memory import HOST_SHARE, MemoryAccount, body_limits
from splitlearn.server.federation.clientside import ClientSide
from splitlearn.server.federation.fedserver import FedConfig, FedRounds
from splitlearn.server.federation.strategy import make_strategy
from splitlearn.server.http.fedapp import MEMORY, app_of, create_fedavg_app, parse_args
from splitlearn.server.http.frontdoor import make_server
from splitlearn.server.tenants import Tenants

from serverproc import OTHER, TENANTS, TOKEN

MiB = 1 << 20
SECRET = b"k" * 20 + b"9a1c3e5f7b2d4f6a8c0e1b3d"
CUTS = (1, 3)


@contextmanager
def serving(app, tenants, memory=None):
    server = make_server(app, tenants, host="127.0.0.1", port=0, threads=2, max_body_bytes=64 * MiB, memory=memory)
    loop = threading.Thread(target=server.run, daemon=True)
    loop.start()
    try:
        yield int(server.effective_port)
    finally:
        from waitress import wasyncore
        server.trigger.pull_trigger(lambda: wasyncore.close_all(server._map))
        loop.join(10)
        server.task_dispatcher.shutdown()


def announce(port: int, path: str, length: int, token: str) -> socket.socket:
    """A POST announcing ``length`` bytes, of which only the first KiB is sent (the rest held back)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
              f"Content-Type: {P.CONTENT_TYPE}\r\nContent-Length: {length}\r\n\r\n".encode() + b"\0" * 1024)
    return s


def answer(sock: socket.socket, timeout_s: float = 1.5):
    """(status, JSON body) if the server answered on ``sock`` within ``timeout_s``, else None."""
    sock.settimeout(timeout_s)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except socket.timeout:
        return None
    head, _, body = data.partition(b"\r\n\r\n")
    if not head:
        return None
    length = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1]), json.loads(body)


def wait_until(check, timeout_s: float = 5.0) -> bool:
    stop = time.monotonic() + timeout_s
    while not check() and time.monotonic() < stop:
        time.sleep(0.02)
    return check()


def test_fed_bodies_held_back_cannot_reserve_past_the_budget():
    cfg = FedConfig("tiny", CUTS, SECRET, "splitfed", upload_timeout_s=3600.0)
    rounds = FedRounds(cfg, ClientSide(load_config("tiny"), CUTS, model="tiny"), make_strategy("fedavg", None))
    memory = MemoryAccount(8 * MiB, 6 * MiB)
    tenants = Tenants(TENANTS)  # alice (TOKEN), mallory (OTHER)
    app = create_fedavg_app(rounds, tenants, request_log=False, memory=memory)
    socks = []
    with serving(app, tenants, memory) as port:
        try:
            for _ in range(2):  # mallory: two 3 MiB uploads held back, 6 MiB: her share
                socks.append(announce(port, P.FEDERATION_SYNC, 3 * MiB, OTHER))
                assert answer(socks[-1], 0.5) is None  # reserved, waiting for the rest
            assert wait_until(lambda: memory.tenants.get("mallory") == 6 * MiB), memory.to_dict()
            s = announce(port, P.FEDERATION_SYNC, 3 * MiB, OTHER)  # a third: past her share
            status, err = answer(s)
            assert status == 429 and err["error"] == "too_many_requests" and "--max-tenant-memory-gb" in err["message"]
            s.close()
            s = announce(port, P.FEDERATION_SYNC, 3 * MiB, TOKEN)  # alice: her share has room, the total not
            status, err = answer(s)
            assert status == 503 and err["error"] == "unavailable" and "--max-memory-gb" in err["message"]
            s.close()
            assert memory.reserved == 6 * MiB <= memory.limit and memory.refusals == 2
            for s in socks:
                s.close()
            assert wait_until(lambda: memory.reserved == 0), memory.to_dict()  # given back when cut off
            # a whole body is still served: held at 3 copies while the route reads it, then released
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            body = b"not safetensors"
            s.sendall(f"POST {P.FEDERATION_SYNC} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                      f"Content-Type: {P.CONTENT_TYPE}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            status, err = answer(s, 10)
            assert status == 400, err
            s.close()
            assert wait_until(lambda: memory.reserved == 0), memory.to_dict()
        finally:
            for s in socks:
                s.close()


def test_the_offload_server_reserves_its_bodies():
    from splitlearn.server import create_app
    from splitlearn.server.engine.offload import OffloadRuntime
    from splitlearn.server.http.cli import parse_args as server_args

    cfg = server_args(["--model", "tiny", "--offload", "--threads", "2", "--port", str(free_port()),
                       "--log-level", "WARNING", "--max-memory-gb", str(8 * MiB / (1 << 30))])
    cfg = dataclasses.replace(cfg, tokens=(TOKEN,), generated_token=False)
    rt = OffloadRuntime(cfg)
    try:
        app = create_app(runtime=rt)
        assert rt.account.limit == 8 * MiB and rt.account.tenant_limit == 8 * MiB  # one tenant: all of it
        socks = []
        with serving(app, cfg.tenants) as port:
            try:
                for _ in range(2):
                    socks.append(announce(port, P.OFFLOAD_LINEAR, 3 * MiB, TOKEN))
                assert wait_until(lambda: rt.account.reserved == 6 * MiB), rt.account.to_dict()
                s = announce(port, P.OFFLOAD_LINEAR, 3 * MiB, TOKEN)
                status, err = answer(s)
                assert status == 429 and err["error"] == "too_many_requests", err  # its share: all of it
                s.close()
                assert rt.account.reserved == 6 * MiB
            finally:
                for s in socks:
                    s.close()
            assert wait_until(lambda: rt.account.reserved == 0), rt.account.to_dict()
    finally:
        rt.compute.close()


def test_body_accounts_default_to_a_share_of_the_host():
    assert HOST_SHARE < 1
    assert body_limits(100 * MiB, tenants=1) == (75 * MiB, 75 * MiB)
    assert body_limits(100 * MiB, tenants=3) == (75 * MiB, 75 * MiB // 2)
    assert body_limits(100 * MiB, 2, total=10, per_tenant=4) == (10, 4)


@pytest.mark.parametrize("flags, total, tenant", [([], None, None), (["--max-memory-gb", "0.5"], 1 << 29, 1 << 29),
                                                   (["--max-memory-gb", "0.5", "--max-tenant-memory-gb", "0.25"],
                                                    1 << 29, 1 << 28)])
def test_the_fed_server_command_builds_its_account(tmp_path, monkeypatch, flags, total, tenant):
    secret = tmp_path / "fed.secret"
    secret.write_text("s" * 48)
    monkeypatch.setenv("SPLITLEARN_FED_TOKEN", "fed-token-5e2b7c90d1a34f68")
    serve, cfg = parse_args(["--model", "tiny", "--cut", "1", "--cut", "3", "--fed-secret-file", str(secret), *flags])
    memory = app_of(serve, cfg).extensions[MEMORY]
    assert isinstance(memory, MemoryAccount)
    if total is None:  # derived: a share of what the host has, never all of it
        assert 0 < memory.limit and memory.source.startswith(f"derived at start: {HOST_SHARE:g} of ")
    else:
        assert (memory.limit, memory.tenant_limit) == (total, tenant)
