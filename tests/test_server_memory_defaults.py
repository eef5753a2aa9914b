"""Memory defaults leave the host headroom, and a session's reservation covers its cache
(issue 50, item 8; splitlearn/server/engine/budget.py, memory.py).

Before, the account's default total was twice half of MemAvailable (21.46 of 21.47 GiB: nothing
left to the host), and 16 open sessions grew the RSS by 379 MiB against 128 MiB reserved (their
K and V only; the heap pages around them stay too). Here the derived defaults with MemAvailable
stubbed, and the storages a session's cache keeps alive against what the session reserves,
which covers the RSS measured (benchmarks/session_memory.py: 1.27x to 2.08x of K and V).
"""
import pytest
import torch

from splitlearn.api import protocol as P
from splitlearn.api.wire import encode
from splitlearn.server.engine import budget as bm
from splitlearn.server.engine.memory import HOST_SHARE

from serverproc import TOKEN, InprocServer, auth, web

GiB = 1 << 30


@pytest.fixture
def app_at(monkeypatch):
    """A tiny-demo U (2, 4) server built in this process, the host's free memory stubbed to ``avail``."""
    servers = []

    def start(avail: int, *extra):
        monkeypatch.setattr(bm, "available_memory", lambda device: (avail, "MemAvailable"))
        srv = InprocServer(["--model", "tiny-demo", "--cut", "2", "--cut", "4", "--threads", "2", *extra]).start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.stop()


def test_the_derived_total_leaves_the_host_headroom(app_at):
    srv = app_at(8 * GiB)
    rt = srv.app.extensions["splitlearn"]
    state = bm.state_bytes(rt.segment, "adamw", rt._packed is not None)
    rest = 8 * GiB - state
    assert rt.budget.limit == rest // 2  # one request: half of what the training state leaves (unchanged)
    assert rt.memory.limit == int(HOST_SHARE * rest) < 8 * GiB - GiB  # the total: 0.75 of it, not all
    assert rt.memory.tenant_limit == rt.memory.limit  # one tenant: the whole total
    info = web.get(srv.url + P.INFO, headers=auth(TOKEN), timeout=30).json()["memory"]
    assert info["limit_bytes"] == rt.memory.limit and f"{HOST_SHARE:g} of MemAvailable" in info["source"]


def test_several_tenants_each_get_a_part_of_the_total(app_at, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice {TOKEN} operator\nmallory other-93be41d06fa2c815\n")
    rt = app_at(8 * GiB, "--token-file", str(tokens)).app.extensions["splitlearn"]
    assert rt.memory.tenant_limit == rt.budget.limit < rt.memory.limit  # 2/3 of the total: the per-request limit


def storage_bytes(cache) -> int:
    """Bytes of the distinct storages the cache's K and V tensors keep alive (views of a larger
    tensor keep all of it)."""
    seen = {}
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("rows, T", [(16, 64), (4, 120)])
def test_a_sessions_reservation_covers_what_its_cache_keeps(app_at, rows, T):
    """The attack's shape: sessions prefilled and held open. What each cache keeps alive (its
    storages), with the allocator's slack, is within what the session reserves; after a
    decode step too."""
    srv = app_at(8 * GiB)
    rt = srv.app.extensions["splitlearn"]
    r = web.post(srv.url + P.SESSIONS, json={"rows": rows}, headers=auth(TOKEN), timeout=30)
    assert r.status_code == 201, r.text
    sid = r.json()["session_id"]
    for position, length in ((0, T), (T, 1)):
        x = torch.randn(rows, length, 128, generator=torch.Generator().manual_seed(position))
        r = web.post(srv.url + P.SESSION_STEP.format(session_id=sid), data=encode({P.HIDDEN: x}, {"position": str(position)}),
                     headers={**auth(TOKEN), "Content-Type": P.CONTENT_TYPE}, timeout=60)
        assert r.status_code == 200, r.text
        sess = rt.sessions._sessions[sid]
        kept = storage_bytes(sess.cache)
        kv = bm.kv_bytes(rt.budget.dims, rows * (position + length))
        assert kept >= kv  # K and V (views of a larger tensor would keep it all)
        assert kept * bm.ALLOCATOR_SLACK <= sess.hold.nbytes == bm.session_bytes(rt.budget.dims, rows * (position + length))
