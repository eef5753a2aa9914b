"""splitlearn.server.engine.memory: what the server holds for its tenants, against a real server process.

Issue 29, item 2: with ``--max-request-memory-gb 0.1`` a tenant could hold many times the
per-request limit: one large open-ended piece followed by small ones (the waiting graphs
were priced as (waiting + 1) x the new piece), 64 waiting pieces each under the limit
(+590 MiB), 300 pieces whose answers stayed in the ledger after the apply (1.49 GiB). Each
attack now gets a clear 429 (JSON, Retry-After) past the tenant's share, the server's RSS
stays within its budget, ``/v1/info`` shows what is reserved, and an honest client's step
answers bit for bit what it answers on a server without the attacks and with no limits.
"""
import json

import pytest
import requests
import torch

from splitlearn.api import protocol as P
from splitlearn.server.engine import budget as bm
from splitlearn.server.engine.ledger import DIGEST_BYTES
from splitlearn.api.wire import decode, encode

from serverproc import OTHER, TOKEN, ServerProcess, auth

MiB, GiB = 1 << 20, 1 << 30
# wide enough that a graph costs tens of MiB; cuts (1, 3): the server holds 2 blocks (U-shape)
SPEC = dict(model_type="gpt2", vocab_size=257, n_positions=256, n_embd=128, n_layer=4, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
D = SPEC["n_embd"]
LIMIT = 0.1  # --max-request-memory-gb: each tenant may hold 0.1 GiB, the server 0.2 GiB
DIMS = bm.Dims(d=D, heads=4, inner=4 * D, vocab=257, blocks=2, head=False, elem=4, eager=False,
               attn_dropout=False, dropout=False)


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _server(tmp, name, extra=()):
    spec = tmp / "wide.json"
    spec.write_text(json.dumps(SPEC))
    (tmp / "tokens").write_text(f"alice {TOKEN} operator\nmallory {OTHER}\n")
    return ServerProcess((1, 3), extra=["--model", str(spec), "--token-file", str(tmp / "tokens"),
                                        "--max-tokens-per-client", "1000000", *extra])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with _server(tmp_path_factory.mktemp("memory"), "limited", ["--max-request-memory-gb", str(LIMIT)]) as srv:
        yield srv


def post(srv, path, tensors, meta, token=OTHER):
    return requests.post(srv.url + path, data=encode(tensors, meta), timeout=120,
                         headers={**auth(token), "Content-Type": P.CONTENT_TYPE})


def apply(srv, body, token=OTHER):
    return requests.post(srv.url + P.TRAIN_APPLY, json=body, headers=auth(token), timeout=60)


def memory(srv, token=OTHER) -> dict:
    return requests.get(srv.url + P.INFO, headers=auth(token), timeout=30).json()["memory"]


def hidden(B, T, seed=0):
    return {P.HIDDEN: torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))}


def piece(cid, step, micro):
    return P.StepMeta(cid, step, micro=micro).to_meta()


def refused(r, what="this tenant holds"):
    assert r.status_code == 429, (r.status_code, r.text[:300])
    err = r.json()
    assert set(err) == {"error", "message"} and err["error"] == "too_many_requests"
    assert what in err["message"] and "--max-tenant-memory-gb" in err["message"], err
    assert "Retry-After" in r.headers
    return err


def discard(srv, cid, step):
    r = apply(srv, {"client_id": cid, "step": step, "pieces": 0, "lr": 1e-3, "discard": True})
    assert r.status_code == 200, r.text


def test_info_shows_the_totals_per_tenant(server):
    m = memory(server)
    assert m["limit_bytes"] == 2 * int(LIMIT * GiB) and m["tenant_limit_bytes"] == int(LIMIT * GiB)
    assert m["tenant_reserved_bytes"] == 0 and "reserved_bytes" not in m  # the server's total: the operator's
    assert memory(server, TOKEN)["reserved_bytes"] >= 0


def test_one_large_piece_then_small_ones_is_bounded_by_the_tenants_share(server):
    """A 7 x 256 piece (its graph ~64 MiB) then 4 x 128 ones (~18 MiB each): before, each small
    one was priced (waiting + 1) x its own size and all were accepted (~4.7x the limit held)."""
    pid, before = server.proc.pid, rss_mib(server.proc.pid)
    assert post(server, P.TRAIN_FORWARD, hidden(7, 256), piece("big", 1, 0)).status_code == 200
    held = [bm.graph_bytes(DIMS, 7, 256, False)]
    for i in range(1, 40):
        r = post(server, P.TRAIN_FORWARD, hidden(4, 128, i), piece("big", 1, i))
        if r.status_code != 200:
            refused(r)
            break
        held.append(bm.graph_bytes(DIMS, 4, 128, False))
    else:
        raise AssertionError("40 waiting pieces accepted")
    assert len(held) <= 3 and sum(held) <= LIMIT * GiB
    assert memory(server)["tenant_reserved_bytes"] == sum(held)
    assert rss_mib(pid) - before < LIMIT * 1024 * 2.5  # its share, one request and the allocator's slack
    discard(server, "big", 1)
    assert memory(server)["tenant_reserved_bytes"] == 0


def test_many_waiting_pieces_and_many_steps_without_a_lease_are_bounded(server):
    """64 waiting pieces of 4 x 256 (each accepted alone under the limit): refused past the
    share; so are further steps of other client ids of the same tenant (the bound is the
    budget, not the count of steps); the other tenant is not touched."""
    pid, before = server.proc.pid, rss_mib(server.proc.pid)
    accepted = 0
    for i in range(64):
        r = post(server, P.TRAIN_FORWARD, hidden(4, 256, i), piece("many", 1, i))
        if r.status_code != 200:
            refused(r)
            break
        accepted += 1
    assert 1 <= accepted <= 3
    assert rss_mib(pid) - before < LIMIT * 1024 * 2.5
    discard(server, "many", 1)
    assert memory(server)["tenant_reserved_bytes"] == 0
    # alice (another tenant) trains pieces of that size: her share is her own
    r = post(server, P.TRAIN_FORWARD, hidden(4, 256), piece("alice", 1, 0), token=TOKEN)
    assert r.status_code == 200, r.text
    assert memory(server, TOKEN)["tenant_reserved_bytes"] > 0 == memory(server)["tenant_reserved_bytes"]
    discard_alice = {"client_id": "alice", "step": 1, "pieces": 0, "lr": 1e-3, "discard": True}
    assert apply(server, discard_alice, TOKEN).status_code == 200


def honest_step(srv):
    """A U-shape step of two pieces of 4 x 64, then its apply: the answers' bytes."""
    out = []
    for i in range(2):
        r = post(srv, P.TRAIN_FORWARD, hidden(4, 64, 100 + i), piece("honest", 1, i), token=TOKEN)
        assert r.status_code == 200, r.text
        out.append(r.content)
    for i in range(2):
        g = {P.GRAD: torch.randn(4, 64, D, generator=torch.Generator().manual_seed(200 + i))}
        r = post(srv, P.TRAIN_BACKWARD, g, piece("honest", 1, i), token=TOKEN)
        assert r.status_code == 200, r.text
        out.append(decode(r.content)[0][P.GRAD])
    r = apply(srv, {"client_id": "honest", "step": 1, "pieces": 2, "lr": 1e-3}, TOKEN)
    assert r.status_code == 200 and r.json()["applied"], r.text
    return out


def test_an_honest_clients_step_is_unchanged(server, tmp_path):
    """After the attacks above (refused, then discarded: nothing applied), the honest step
    answers bit for bit what it answers on a fresh server without memory limits."""
    got = honest_step(server)
    with _server(tmp_path, "free") as free:
        want = honest_step(free)
    assert got[:2] == want[:2] and all(torch.equal(a, b) for a, b in zip(got[2:], want[2:]))


def test_pieces_then_an_apply_leave_only_digests_and_a_retry_is_409(server):
    """300 pieces of 1 x 16 then an apply: nothing of the pieces' answers is reserved after
    it; a retried piece gets 409 naming its digest (not applied twice), the apply's retry its
    answer. Larger pieces (4 x 256, ~2 MiB of answers each) are refused past the share."""
    for i in range(300):
        assert post(server, P.TRAIN_FORWARD, hidden(1, 16, i), piece("p", 1, i)).status_code == 200
        g = {P.GRAD: torch.full((1, 16, D), 1e-3)}
        assert post(server, P.TRAIN_BACKWARD, g, piece("p", 1, i)).status_code == 200
    during = memory(server)["tenant_reserved_bytes"]
    assert during >= 300 * 2 * 16 * D * 4  # the answers wait for the apply, reserved
    body = {"client_id": "p", "step": 1, "pieces": 300, "lr": 1e-3}
    first = apply(server, body)
    assert first.status_code == 200 and first.json()["applied"] is True, first.text
    digests = 2 * 300 * DIGEST_BYTES  # the pieces' and forwards' digests, kept (issue 50, item 10)
    assert digests <= memory(server)["tenant_reserved_bytes"] < 4096 + digests  # and the apply's answer
    again = apply(server, body)
    assert again.json() == first.json()
    r = post(server, P.TRAIN_BACKWARD, {P.GRAD: torch.zeros(1, 16, D)}, piece("p", 1, 7))
    assert r.status_code == 409 and "was applied" in r.json()["message"] and "blake2b" in r.json()["message"]
    state = requests.get(server.url + P.CLIENT_STATE.format(client_id="p"), headers=auth(OTHER), timeout=30)
    assert state.json()["step"] == 1  # applied once

    pid, before = server.proc.pid, rss_mib(server.proc.pid)
    n = 0
    for i in range(300):
        r = post(server, P.TRAIN_FORWARD, hidden(4, 256, i), piece("p", 2, i))
        if r.status_code != 200:
            refused(r)
            break
        r = post(server, P.TRAIN_BACKWARD, {P.GRAD: torch.full((4, 256, D), 1e-3)}, piece("p", 2, i))
        assert r.status_code == 200, r.text
        n += 1
    assert 1 <= n < 100
    assert rss_mib(pid) - before < LIMIT * 1024 * 2.5
    r = apply(server, {"client_id": "p", "step": 2, "pieces": n, "lr": 1e-3})
    assert r.status_code == 200, r.text
    assert memory(server)["tenant_reserved_bytes"] < 4096 + 2 * n * DIGEST_BYTES  # step 2's digests replace step 1's


def test_generation_caches_count_against_the_tenants_share(server):
    """Sessions of 16 rows x 256 positions (8 MiB of cache each): past the share, 429."""
    kept = memory(server)["tenant_reserved_bytes"]  # the digests of client p's last step (the test above)
    opened = []
    try:
        for i in range(16):
            r = requests.post(server.url + P.SESSIONS, json={"rows": 16}, headers=auth(OTHER), timeout=30)
            assert r.status_code == 201, r.text
            sid = r.json()["session_id"]
            opened.append(sid)
            r = post(server, P.SESSION_STEP.format(session_id=sid), hidden(16, 256, i), {"position": "0"})
            if r.status_code != 200:
                refused(r)
                break
        else:
            raise AssertionError("16 sessions of 8 MiB accepted under a 0.1 GiB share")
        assert memory(server)["tenant_reserved_bytes"] <= LIMIT * GiB
    finally:
        for sid in opened:
            requests.delete(server.url + P.SESSION.format(session_id=sid), headers=auth(OTHER), timeout=30)
    assert memory(server)["tenant_reserved_bytes"] <= kept  # nothing of the sessions (a stored answer may have made room)


def test_steps_without_a_lease_are_bounded_by_the_budget_not_only_their_count(tmp_path):
    """LoRA: each client id trains its own adapter, so a tenant's steps need no lease and up
    to --max-pending-per-tenant (8) of them used to hold graphs at once. Now their graphs
    count against the tenant's share: the third 4 x 256 step is refused, the others finish."""
    with _server(tmp_path, "lora", ["--max-request-memory-gb", str(LIMIT), "--lora-r", "4"]) as srv:
        ok = []
        for c in range(8):
            r = post(srv, P.TRAIN_FORWARD, hidden(4, 256, c), piece(f"c{c}", 1, 0))
            if r.status_code != 200:
                refused(r)
                break
            ok.append(c)
        assert 1 <= len(ok) <= 3
        for c in ok:  # the accepted steps complete, and give their memory back
            g = {P.GRAD: torch.full((4, 256, D), 1e-3)}
            assert post(srv, P.TRAIN_BACKWARD, g, piece(f"c{c}", 1, 0)).status_code == 200
            assert apply(srv, {"client_id": f"c{c}", "step": 1, "pieces": 1, "lr": 1e-3}).status_code == 200
        assert memory(srv)["tenant_reserved_bytes"] < 8 * MiB  # the kept answers of the last steps
        r = post(srv, P.TRAIN_FORWARD, hidden(4, 256, 9), piece("c9", 1, 0))
        assert r.status_code == 200, r.text  # room again (stored answers are evicted for it if needed)


def test_the_flags_and_their_defaults():
    from splitlearn.errors import ConfigError
    from splitlearn.server.http.cli import parse_args
    from splitlearn.server.config import ServerConfig
    from splitlearn.server.engine.memory import default_limits

    cfg = parse_args(["--model", "tiny", "--cut", "1", "--max-memory-gb", "0.5", "--max-tenant-memory-gb", "0.25"])
    assert (cfg.max_memory_bytes, cfg.max_tenant_memory_bytes) == (GiB // 2, GiB // 4)
    assert default_limits(100, tenants=1) == (200, 200) and default_limits(100, tenants=2) == (200, 100)
    assert default_limits(100, 2, total=150, per_tenant=120) == (150, 120)
    with pytest.raises(ConfigError, match="--max-memory-gb must be at least 1 MiB"):
        ServerConfig(model="tiny", cuts=(1,), tokens=(TOKEN,), max_memory_bytes=1000)
