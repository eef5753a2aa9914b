"""The fed server (splitlearn.server.federation.fedserver): only the segment server's round members, bound
to their tenants, with their own tokens, in the fed server's own schema (issue 19, item 5).

A segment server (``--client-weights external``) and a fed server, their apps in this process
(tests/serverproc.py's InprocServerProcess, InprocFedServer), two tenants (alice, mallory),
shared by the tests of this module; the round and ticket rules on their own.
"""
import time

import pytest
import torch

from splitlearn import SplitClient
from splitlearn.api import protocol as P
from splitlearn.hf.fedsync import untied_weights
from splitlearn.hf.lora import adapter_tensors
from splitlearn.errors import BadRequest, ConfigError, Conflict, Forbidden
from splitlearn.model.loading import load_config
from splitlearn.model.lora import LoraSpec
from splitlearn.server.federation import tickets
from splitlearn.server.federation.clientside import ClientSide
from splitlearn.server.config import ServerConfig
from splitlearn.server.federation.fedserver import FedConfig, FedRounds
from splitlearn.server.federation.strategy import make_strategy
from splitlearn.api.wire import decode, encode

from serverproc import OTHER, TENANTS, TOKEN, InprocFedServer, InprocServerProcess, auth, run_threads, web
from test_client import LR, assert_both_sides_equal, unsplit_steps

SECRET = b"s" * 20 + b"3c9e1f7a5b2d4c6e8f0a1b2c"  # 44 bytes
FED_ALICE, FED_MALLORY = "fed-alice-0d8e7c6b5a4f", "fed-mallory-1e9f8d7c6b"
CUTS = (1, 3)


def batch(seed):
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(seed)), None


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    d = tmp_path_factory.mktemp("fed")
    (d / "secret").write_bytes(SECRET)
    (d / "tokens").write_text("\n".join(TENANTS) + "\n")
    (d / "fed-tokens").write_text(f"alice {FED_ALICE}\nmallory {FED_MALLORY}\n")
    fed = InprocFedServer(["--model", "tiny", "--cut", "1", "--cut", "3", "--mode", "splitfed",
                           "--fed-secret-file", str(d / "secret"), "--token-file", str(d / "fed-tokens")])
    seg = InprocServerProcess(CUTS, optimizer="sgd", lr=LR["sgd"], checkpoint_dir=d / "ckpt", extra=[
        "--federation", "splitfed", "--clients-per-round", "2", "--client-weights", "external",
        "--fed-secret-file", str(d / "secret"), "--token-file", str(d / "tokens")])
    with fed, seg:
        yield seg, fed


def client(seg, fed, token, cid, fed_token):
    return SplitClient(seg.url, "tiny", token=token, optimizer="sgd", lr=LR["sgd"], device="cpu", client_id=cid,
                       fed_url=fed.url, fed_token=fed_token, wait_timeout_s=120)


@pytest.mark.slow
def test_a_round_through_the_fed_server_equals_one_unsplit_step_and_needs_the_fed_token(servers):
    seg, fed = servers
    with pytest.raises(ConfigError, match="fed_token"):
        SplitClient(seg.url, "tiny", token=TOKEN, device="cpu", fed_url=fed.url)  # no fed token: refused
    with pytest.raises(ConfigError, match="segment server's token"):
        SplitClient(seg.url, "tiny", token=TOKEN, device="cpu", fed_url=fed.url, fed_token=TOKEN)
    a, m = client(seg, fed, TOKEN, "a", FED_ALICE), client(seg, fed, OTHER, "m", FED_MALLORY)
    batches = [batch(20), batch(21)]
    run_threads([lambda c=c, b=b: (c.train_step(*b), c.sync()) for c, b in zip((a, m), batches)])
    reference, _ = unsplit_steps(CUTS, "sgd", [(torch.cat([b[0] for b in batches]), None)])
    for c in (a, m):
        assert c.federation.version == 1
        assert_both_sides_equal(reference, c, seg)
    # the segment server holds none of them, and its token opens nothing on the fed server
    assert web.get(seg.url + P.FEDERATION_WEIGHTS, headers=auth(), timeout=10).status_code == 404
    assert web.get(fed.url + P.FEDERATION_WEIGHTS, headers=auth(TOKEN), timeout=10).status_code == 401
    r = web.get(fed.url + P.FEDERATION_WEIGHTS, headers=auth(FED_MALLORY), timeout=10)
    assert r.status_code == 200 and r.headers["Content-Type"] == P.CONTENT_TYPE
    status = web.get(fed.url + P.FEDERATION, headers=auth(FED_ALICE), timeout=10).json()
    assert status["version"] == 1 and status["last_round"]["members"] == 2 and status["last_round"]["samples"] == 44  # target tokens: 2 x 11 each


@pytest.mark.slow
def test_the_fed_server_takes_only_a_ticketed_member_of_its_tenant_in_its_own_schema(servers):
    seg, fed = servers
    a = client(seg, fed, TOKEN, "a2", FED_ALICE)
    a.train_step(*batch(30))
    a.flush()  # the step's apply rides on the next request: sent now, as sync() would
    seg_sync = web.post(seg.url + P.FEDERATION_SYNC, data=encode({}, P.SyncMeta("a2", 2).to_meta()),
                        headers={**auth(TOKEN), "Content-Type": P.CONTENT_TYPE}, timeout=30)
    assert seg_sync.status_code == 200, seg_sync.text
    ticket = seg_sync.json()["ticket"]
    assert seg_sync.json()["members"] == ["a2"]  # alice sees her own ids only
    good = untied_weights(a.segments)
    name = next(iter(good))
    other_secret = tickets.sign(b"x" * 40, tickets.verify(SECRET, ticket, tickets.Ticket))
    flipped = ticket[:-1] + ("0" if ticket[-1] != "0" else "1")
    before = web.get(fed.url + P.FEDERATION, headers=auth(FED_ALICE), timeout=10).json()

    def upload(weights, meta, token=FED_ALICE):
        return web.post(fed.url + P.FEDERATION_SYNC, data=encode(weights, meta),
                        headers={**auth(token), "Content-Type": P.CONTENT_TYPE}, timeout=30)

    refused = {
        "no ticket": (upload(good, P.SyncMeta("a2", 2).to_meta()), 400),
        "altered ticket": (upload(good, P.SyncMeta("a2", 2, flipped).to_meta()), 403),
        "another secret": (upload(good, P.SyncMeta("a2", 2, other_secret).to_meta()), 403),
        "another tenant": (upload(good, P.SyncMeta("a2", 2, ticket).to_meta(), FED_MALLORY), 403),
        "another client": (upload(good, P.SyncMeta("zz", 2, ticket).to_meta()), 400),
        "the segment token": (upload(good, P.SyncMeta("a2", 2, ticket).to_meta(), TOKEN), 401),
    }
    for what, (r, code) in refused.items():
        assert r.status_code == code, (what, r.status_code, r.text)
        assert set(r.json()) == {"error", "message"}, what
    forged_close = web.post(fed.url + P.FEDERATION_CLOSE, headers=auth(FED_ALICE), timeout=10,
                            json={"record": tickets.sign(b"y" * 40, tickets.Close("splitfed", 2, 9, 1))})
    assert forged_close.status_code == 403
    for body in ("[" * 100000, '{"record": ' * 50000, "\xff\xfe", '{"record": ["x"]}'):  # issue 29, item 10
        r = web.post(fed.url + P.FEDERATION_CLOSE, data=body.encode("utf-8", "surrogateescape"),
                     headers=auth(FED_ALICE), timeout=10)
        assert r.status_code in (400, 413) and set(r.json()) == {"error", "message"}, (body[:10], r.text)
    after = web.get(fed.url + P.FEDERATION, headers=auth(FED_ALICE), timeout=10).json()
    assert after == before  # nothing of the refused ones counted
    ok = upload(good, P.SyncMeta("a2", 2, ticket).to_meta())
    assert ok.status_code == 200 and ok.json()["synced"] == ["a2"] and ok.json()["round"] == 2
    again = upload(good, P.SyncMeta("a2", 2, ticket).to_meta())  # a retry: counted once
    assert again.status_code == 200 and again.json()["synced_count"] == 1
    assert web.get(fed.url + P.FEDERATION, headers=auth(FED_MALLORY), timeout=10).json()["synced"] == []
    # a ticketed member's upload not in the schema is refused, and is its failure of the round
    # (issue 29, item 11; the in-process test below shows the round closing without it)
    m = client(seg, fed, OTHER, "m2", FED_MALLORY)
    m.train_step(*batch(31))
    m.flush()
    r = web.post(seg.url + P.FEDERATION_SYNC, data=encode({}, P.SyncMeta("m2", 2).to_meta()),
                 headers={**auth(OTHER), "Content-Type": P.CONTENT_TYPE}, timeout=30)
    assert r.status_code == 200, r.text
    theirs = r.json()["ticket"]
    for bad in ({"x": torch.ones(3)}, {**good, name: good[name].half()},
                {**good, name: torch.full_like(good[name], float("nan"))}):
        r = upload(bad, P.SyncMeta("m2", 2, theirs).to_meta(), FED_MALLORY)
        assert r.status_code == 400 and set(r.json()) == {"error", "message"}, r.text
    st = web.get(fed.url + P.FEDERATION, headers=auth(FED_MALLORY), timeout=10).json()
    assert (st["synced_count"], st["failed_count"]) == (1, 1)
    assert upload(good, P.SyncMeta("m2", 2, theirs).to_meta(), FED_MALLORY).status_code == 409


# -- in process: the fed server's rounds and the tickets' rules --------------------------

def rounds(mode="splitfed", timeout_s=60.0, norm=None, share=None):
    cfg = FedConfig("tiny", CUTS, SECRET, mode, upload_timeout_s=timeout_s, max_update_norm=norm, max_member_share=share,
                    max_update_ratio=None)  # norm None: unbounded (these uploads are far from the initial weights)
    return FedRounds(cfg, ClientSide(load_config("tiny"), CUTS, model="tiny"),
                     make_strategy("fedavg", norm, max_share=share, max_update_ratio=None))


def weights_like(side: ClientSide, value: float):
    return {k: torch.full(s, value) for k, s in side.schema.items()}


def meta_of(ticket: tickets.Ticket) -> P.SyncMeta:
    return P.SyncMeta(ticket.client_id, 1, tickets.sign(SECRET, ticket))


def test_sequential_takes_the_turn_holders_ticket_once():
    fr = rounds("sequential")
    t0 = tickets.Ticket("sequential", 0, 0, "alice", "a", 4)
    fr.upload("alice", meta_of(t0), weights_like(fr.side, 0.5))
    name = next(iter(fr.side.schema))
    assert fr.version == 1 and torch.equal(fr.latest()[1][name], torch.full(fr.side.schema[name], 0.5))
    with pytest.raises(Conflict, match="closed without"):  # the same ticket again: an old turn's
        fr.upload("alice", meta_of(t0), weights_like(fr.side, 9.0))
    with pytest.raises(BadRequest, match="splitfed ticket"):
        fr.upload("alice", meta_of(tickets.Ticket("splitfed", 1, 1, "alice", "a", 4)), weights_like(fr.side, 1.0))
    assert fr.version == 1


def test_a_splitfed_round_closes_with_the_records_members_or_after_the_upload_timeout():
    fr = rounds(timeout_s=0.3)
    a, b = tickets.Ticket("splitfed", 5, 0, "alice", "a", 2), tickets.Ticket("splitfed", 5, 0, "mallory", "m", 6)
    fr.upload("alice", meta_of(a), weights_like(fr.side, 1.0))
    fr.upload("mallory", meta_of(b), weights_like(fr.side, 3.0))
    assert fr.version == 0  # no close record yet: the segment server's round may still take syncs
    fr.close("alice", tickets.sign(SECRET, tickets.Close("splitfed", 5, 1, 2)))
    name = next(iter(fr.side.schema))
    version, w = fr.latest()
    assert version == 1 and torch.equal(w[name], torch.full(fr.side.schema[name], (1.0 * 2 + 3.0 * 6) / 8))
    with pytest.raises(Conflict):  # round 5 is closed here
        fr.upload("alice", meta_of(tickets.Ticket("splitfed", 5, 0, "alice", "late", 2)), weights_like(fr.side, 7.0))
    # round 6: the record says 2 synced, one upload never comes: closed after the upload timeout
    fr.upload("alice", meta_of(tickets.Ticket("splitfed", 6, 1, "alice", "a", 2)), weights_like(fr.side, 5.0))
    fr.close("alice", tickets.sign(SECRET, tickets.Close("splitfed", 6, 2, 2)))
    assert fr.version == 1
    time.sleep(0.4)
    assert fr.status("alice")["version"] == 2 and torch.equal(fr.latest()[1][name], torch.full(fr.side.schema[name], 5.0))
    with pytest.raises(Forbidden):
        fr.upload("mallory", meta_of(tickets.Ticket("splitfed", 7, 2, "alice", "a", 2)), weights_like(fr.side, 5.0))


def test_a_refused_upload_is_a_failure_of_the_round_which_closes_with_the_others():
    """Issue 29, item 11 (Flower's accept_failures): a ticketed member's NaN upload is 400 and
    counts for the round; the record's other member's upload closes it at once, not after
    --upload-timeout; the failed member cannot come back into that round. A member with 10**6
    counted tokens against 2 holds at most --max-member-share of the average (item 9)."""
    fr = rounds(timeout_s=3600.0, share=0.5)
    a, m = tickets.Ticket("splitfed", 1, 0, "alice", "a", 2), tickets.Ticket("splitfed", 1, 0, "mallory", "m", 6)
    with pytest.raises(BadRequest, match="NaN"):
        fr.upload("mallory", meta_of(m), weights_like(fr.side, float("nan")))
    fr.close("alice", tickets.sign(SECRET, tickets.Close("splitfed", 1, 1, 2)))  # the segment server: 2 synced
    assert fr.status("alice")["failed_count"] == 1 and fr.version == 0
    fr.upload("alice", meta_of(a), weights_like(fr.side, 1.0))
    name = next(iter(fr.side.schema))
    assert fr.version == 1 and torch.equal(fr.latest()[1][name], torch.full(fr.side.schema[name], 1.0))
    with pytest.raises(Conflict):
        fr.upload("mallory", meta_of(m), weights_like(fr.side, 3.0))
    # round 2: 2 against 10**6 tokens, capped to an even split (two members, cap 1/2)
    fr.upload("alice", meta_of(tickets.Ticket("splitfed", 2, 1, "alice", "a", 2)), weights_like(fr.side, 1.0))
    fr.upload("mallory", meta_of(tickets.Ticket("splitfed", 2, 1, "mallory", "m", 10**6)), weights_like(fr.side, 3.0))
    fr.close("alice", tickets.sign(SECRET, tickets.Close("splitfed", 2, 2, 2)))
    assert fr.version == 2 and torch.equal(fr.latest()[1][name], torch.full(fr.side.schema[name], 2.0))


def test_the_first_round_is_bounded_around_the_initial_weights_the_server_rebuilds():
    fr = rounds(norm=1.0)
    initial = fr.side.initial()
    assert set(initial) == set(fr.side.schema) and all(v.dtype == torch.float32 for v in initial.values())
    fr.upload("alice", meta_of(tickets.Ticket("splitfed", 1, 0, "alice", "a", 1)), weights_like(fr.side, 3e38))
    fr.close("alice", tickets.sign(SECRET, tickets.Close("splitfed", 1, 1, 1)))
    _, w = fr.latest()
    moved = sum(float((w[k].double() - initial[k].double()).pow(2).sum()) for k in w) ** 0.5
    assert all(bool(torch.isfinite(v).all()) for v in w.values()) and moved == pytest.approx(1.0, rel=1e-4)


@pytest.mark.slow
def test_lora_with_a_fed_server_says_external_and_its_clients_train_through_it(tmp_path):
    """It said "server", and clients given fed_url were refused."""
    with pytest.raises(ConfigError, match="fed-secret-file"):
        ServerConfig(model="tiny", cuts=CUTS, tokens=TENANTS, federation="splitfed", client_weights="external")
    (tmp_path / "secret").write_bytes(SECRET)
    (tmp_path / "tokens").write_text(f"alice {TOKEN}\n")
    (tmp_path / "fed-tokens").write_text(f"alice {FED_ALICE}\n")
    lora = ["--lora-r", "2", "--lora-alpha", "4"]
    fed = InprocFedServer(["--model", "tiny", "--cut", "1", "--cut", "3", *lora,
                           "--fed-secret-file", str(tmp_path / "secret"), "--token-file", str(tmp_path / "fed-tokens")])
    with fed, InprocServerProcess(CUTS, optimizer="sgd", lr=0.1, extra=[
            "--federation", "splitfed", "--clients-per-round", "1", "--client-weights", "external", *lora,
            "--fed-secret-file", str(tmp_path / "secret"), "--token-file", str(tmp_path / "tokens")]) as seg:
        assert web.get(seg.url + P.FEDERATION, headers=auth(), timeout=10).json()["client_weights"] == "external"
        c = SplitClient(seg.url, "tiny", token=TOKEN, lora="server", client_id="a", device="cpu", optimizer="sgd",
                        lr=0.1, fed_url=fed.url, fed_token=FED_ALICE)
        c.train_step(*batch(70))
        assert c.sync()["version"] == 1
        r = web.get(fed.url + P.FEDERATION_WEIGHTS, headers=auth(FED_ALICE), timeout=10)
        shared, mine = decode(r.content)[0], adapter_tensors(c.model)
        side = ClientSide(load_config("tiny"), CUTS, model="tiny", lora=LoraSpec(r=2, alpha=4.0))
        assert set(shared) == set(mine) == set(side.schema)  # adapters only, in the fed server's own schema
        assert all(torch.equal(shared[k], mine[k]) for k in mine)  # one member: the average is its adapters
        c.close()


@pytest.mark.slow
def test_the_model_classes_train_lora_in_a_round_through_a_fed_server_as_split_client_does(tmp_path):
    """LoRA + splitfed + a separate fed server on SplitGPT2LMHeadModel (from_pretrained(lora=...,
    fed_url=..., fed_token=...)): the round's upload is its adapters in the fed server's schema,
    equal to what SplitClient uploads for the same step."""
    from splitlearn.hf import SplitGPT2LMHeadModel
    from splitlearn.hf.lora import adapter_tensors

    (tmp_path / "secret").write_bytes(SECRET)
    (tmp_path / "tokens").write_text(f"alice {TOKEN}\n")
    (tmp_path / "fed-tokens").write_text(f"alice {FED_ALICE}\n")
    lora = ["--lora-r", "2", "--lora-alpha", "4"]
    uploads = {}
    for kind in ("SplitClient", "model"):
        fed = InprocFedServer(["--model", "tiny", "--cut", "1", "--cut", "3", *lora, "--fed-secret-file",
                               str(tmp_path / "secret"), "--token-file", str(tmp_path / "fed-tokens")])
        with fed, InprocServerProcess(CUTS, optimizer="sgd", lr=0.1, extra=[
                "--federation", "splitfed", "--clients-per-round", "1", "--client-weights", "external", *lora,
                "--fed-secret-file", str(tmp_path / "secret"), "--token-file", str(tmp_path / "tokens")]) as seg:
            if kind == "SplitClient":
                c = SplitClient(seg.url, "tiny", token=TOKEN, lora="server", client_id="a", device="cpu",
                                optimizer="sgd", lr=0.1, fed_url=fed.url, fed_token=FED_ALICE)
                c.train_step(*batch(70))
                assert c.sync()["version"] == 1
                mine = adapter_tensors(c.model)
            else:
                with pytest.raises(ConfigError, match="fed_token"):
                    SplitGPT2LMHeadModel.from_pretrained("tiny", server=seg.url, token=TOKEN, fed_url=fed.url)
                c = SplitGPT2LMHeadModel.from_pretrained("tiny", server=seg.url, token=TOKEN, lora="server",
                                                         client_id="a", fed_url=fed.url, fed_token=FED_ALICE).train()
                opt = torch.optim.SGD([p for p in c.parameters() if p.requires_grad], lr=0.1)
                ids = batch(70)[0]
                c(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
                assert c.sync()["version"] == 1
                mine = adapter_tensors(c)
                c = c.remote
            r = web.get(fed.url + P.FEDERATION_WEIGHTS, headers=auth(FED_ALICE), timeout=10)
            shared = decode(r.content)[0]
            side = ClientSide(load_config("tiny"), CUTS, model="tiny", lora=LoraSpec(r=2, alpha=4.0))
            assert set(shared) == set(mine) == set(side.schema)  # adapters only, in the fed server's own schema
            assert all(torch.equal(shared[k], mine[k]) for k in mine)  # one member: the average is its adapters
            assert web.get(seg.url + P.FEDERATION_WEIGHTS, headers=auth(), timeout=10).status_code == 404
            uploads[kind] = shared
            c.close()
    a, b = uploads["SplitClient"], uploads["model"]
    assert all(torch.allclose(a[k], b[k], atol=1e-6, rtol=1e-5) for k in a)
