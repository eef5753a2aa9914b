"""The fed server operated as the segment server (issue 33, item 1): ``GET /v1/ready``,
``GET /metrics`` (the operator's fed token, on its port or ``--metrics-port`` on loopback) and one access
line per request, from the segment server's modules (splitlearn/server/http/metrics.py,
accesslog.py, probes.py).

Flask's test client for the rules and the metrics' values; the last test a real
``python -m splitlearn.server.http.fedapp`` process, where the process matters: the
loopback port, ``--log-format json`` on its stderr, the front door letting the probe through.
"""
import json
import socket
import sys
import time

import pytest
import requests
import torch
from prometheus_client.parser import text_string_to_metric_families

from splitlearn.api import protocol as P
from splitlearn.model.loading import load_config
from splitlearn.procs.localserver import ChildServer
from splitlearn.errors import ConfigError
from splitlearn.server.tenants import Tenants
from splitlearn.server.federation import tickets
from splitlearn.server.federation.clientside import ClientSide
from splitlearn.server.federation.fedserver import FedConfig, FedRounds, FedServe
from splitlearn.server.http.fedapp import create_fedavg_app, parse_args
from splitlearn.server.federation.strategy import make_strategy
from splitlearn.api.wire import encode

from serverproc import OTHER, TENANTS, TOKEN, access_lines, assert_error, auth, logged_json

SECRET = b"k" * 20 + b"9a1c3e5f7b2d4f6a8c0e1b3d"  # 44 bytes
CUTS = (1, 3)


@pytest.fixture
def fed():
    """A splitfed fed server's app: alice (TOKEN) its operator, mallory (OTHER) a tenant."""
    cfg = FedConfig("tiny", CUTS, SECRET, "splitfed", upload_timeout_s=3600.0)
    rounds = FedRounds(cfg, ClientSide(load_config("tiny"), CUTS, model="tiny"), make_strategy("fedavg", None))
    return create_fedavg_app(rounds, Tenants(TENANTS))


@pytest.fixture
def access():
    """The access lines logged meanwhile, as the JSON objects of --log-format json."""
    with access_lines() as lines:
        yield lines


def samples_of(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(client) -> dict:
    r = client.get(P.METRICS, headers=auth(TOKEN))
    assert r.status_code == 200, r.get_data(as_text=True)
    assert r.content_type.startswith("text/plain; version=0.0.4")
    return samples_of(r.get_data(as_text=True))


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def upload(client, rounds, tenant: str, token: str, cid: str, number: int, fill: float, samples: int = 2,
           version: int = 0):
    ticket = tickets.sign(SECRET, tickets.Ticket("splitfed", number, version, tenant, cid, samples))
    weights = {k: torch.full(s, fill) for k, s in rounds.side.schema.items()}
    return client.post(P.FEDERATION_SYNC, data=encode(weights, P.SyncMeta(cid, 1, ticket).to_meta()),
                       headers={**auth(token), "Content-Type": P.CONTENT_TYPE})


def test_ready_needs_no_token_and_says_what_it_checked(fed):
    c = fed.test_client()
    r = c.get(P.READY)
    assert r.status_code == 200 and r.get_json() == {"ready": True, "checks": {"client_side_schema": True,
                                                                              "fed_secret": True}}
    fed.extensions["splitlearn.fedavg"].side.schema = {}  # (what a schema that failed to build would be)
    r = c.get(P.READY)
    assert r.status_code == 503 and r.get_json()["ready"] is False
    assert r.get_json()["checks"]["client_side_schema"] is False
    assert c.get(P.HEALTH).status_code == 200  # alive all the same


def test_metrics_are_the_operators_and_count_requests_and_rounds(fed, access):
    c, rounds = fed.test_client(), fed.extensions["splitlearn.fedavg"]
    assert_error(c.get(P.METRICS), 401, "token")
    assert_error(c.get(P.METRICS, headers=auth(OTHER)), 403, "operator")
    before = scrape(c)
    assert value(before, "splitlearn_server_info", shape="fed", federation="splitfed",
                 protocol_version=str(P.PROTOCOL_VERSION)) == 1
    assert value(before, "splitlearn_federation_version") == 0 and value(before, "splitlearn_fed_round") == 0
    assert upload(c, rounds, "alice", TOKEN, "a", 5, 1.0, samples=2).status_code == 200
    assert upload(c, rounds, "mallory", OTHER, "m", 5, float("nan")).status_code == 400  # refused: out of the round
    s = scrape(c)
    assert value(s, "splitlearn_fed_round") == 5
    assert value(s, "splitlearn_fed_uploads", state="accepted") == 1
    assert value(s, "splitlearn_fed_uploads", state="failed") == 1
    assert value(s, "splitlearn_requests_total", route=P.FEDERATION_SYNC, method="POST", status="200",
                 tenant="alice") == 1
    assert value(s, "splitlearn_requests_total", route=P.FEDERATION_SYNC, method="POST", status="400",
                 tenant="mallory") == 1
    assert value(s, "splitlearn_request_bytes_total", route=P.FEDERATION_SYNC, direction="in") > 1000
    # the segment server's record: 2 members synced; both are accounted for (one failed): closed at once
    record = tickets.sign(SECRET, tickets.Close("splitfed", 5, 1, 2))
    assert c.post(P.FEDERATION_CLOSE, json={"record": record}, headers=auth(OTHER)).status_code == 200
    s = scrape(c)
    assert value(s, "splitlearn_federation_version") == 1 and value(s, "splitlearn_fed_round") == 0
    assert value(s, "splitlearn_fed_rounds_closed_total", reason="complete") == 1
    assert value(s, "splitlearn_fed_rounds_closed_total", reason="timeout") == 0
    assert (value(s, "splitlearn_fed_last_round_members"), value(s, "splitlearn_fed_last_round_samples")) == (1, 2)
    # a later round's ticket closes the one collected
    assert upload(c, rounds, "alice", TOKEN, "a", 6, 1.0, version=1).status_code == 200
    assert upload(c, rounds, "alice", TOKEN, "a", 7, 1.0, version=1).status_code == 200
    assert value(scrape(c), "splitlearn_fed_rounds_closed_total", reason="later_round") == 1
    text = c.get(P.METRICS, headers=auth(TOKEN)).get_data(as_text=True)
    assert TOKEN not in text and OTHER not in text and record not in text  # names, never secrets
    # the access lines: one per request, the tenant's name, the route (the probe's: no tenant)
    c.get(P.READY)
    lines = access()
    syncs = [x for x in lines if x["route"] == P.FEDERATION_SYNC]
    assert [(x["tenant"], x["status"]) for x in syncs] == [("alice", 200), ("mallory", 400), ("alice", 200),
                                                          ("alice", 200)]
    assert all(len(x["request_id"]) == 16 and x["bytes_in"] > 1000 for x in syncs)
    assert [(x["tenant"], x["status"]) for x in lines if x["route"] == P.METRICS][:2] == [("-", 401), ("mallory", 403)]
    assert lines[-1]["route"] == P.READY and lines[-1]["tenant"] == "-"
    assert not any(TOKEN in json.dumps(x) or OTHER in json.dumps(x) for x in lines)


def test_a_round_closed_on_its_upload_timeout_is_counted_so_at_the_next_scrape():
    cfg = FedConfig("tiny", CUTS, SECRET, "splitfed", upload_timeout_s=0.2)
    rounds = FedRounds(cfg, ClientSide(load_config("tiny"), CUTS, model="tiny"), make_strategy("fedavg", None))
    c = create_fedavg_app(rounds, Tenants(TENANTS)).test_client()
    assert upload(c, rounds, "alice", TOKEN, "a", 3, 2.0).status_code == 200
    record = tickets.sign(SECRET, tickets.Close("splitfed", 3, 1, 2))  # 2 synced there; mallory's never comes
    assert c.post(P.FEDERATION_CLOSE, json={"record": record}, headers=auth(TOKEN)).status_code == 200
    s = scrape(c)
    assert (value(s, "splitlearn_fed_round"), value(s, "splitlearn_fed_expected_uploads")) == (3, 2)
    time.sleep(0.3)
    s = scrape(c)  # the scrape itself closes the overdue round, as a status read does
    assert value(s, "splitlearn_fed_rounds_closed_total", reason="timeout") == 1
    assert (value(s, "splitlearn_fed_round"), value(s, "splitlearn_federation_version")) == (0, 1)


def test_no_request_log_and_the_flags(access):
    cfg = FedConfig("tiny", CUTS, SECRET, "splitfed")
    app = create_fedavg_app(FedRounds(cfg, ClientSide(load_config("tiny"), CUTS, model="tiny"),
                                      make_strategy("fedavg", None)), Tenants(TENANTS), request_log=False)
    s = scrape(app.test_client())
    assert not [k for k in s if k[0] == "splitlearn_requests_total"] and value(s, "splitlearn_fed_round") == 0
    assert access() == []
    serve, _ = parse_args(["--model", "tiny", "--cut", "1", "--cut", "3", "--fed-secret-file", __file__,
                           "--metrics-port", "9101", "--log-format", "json", "--no-request-log"])
    assert (serve.metrics_port, serve.log_format, serve.request_log, serve.log_level) == (9101, "json", False, "INFO")
    with pytest.raises(ConfigError, match="metrics-port"):
        FedServe(port=8001, metrics_port=8001)


def test_a_real_fed_server_serves_ready_metrics_on_loopback_and_json_access_lines(tmp_path):
    token = "fed-op-7c1e9a3b5d2f4e60"
    secret = tmp_path / "fed.secret"
    secret.write_bytes(SECRET)
    with socket.socket() as a, socket.socket() as b:  # two distinct ports (free_port twice may give one twice)
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        port, mport = a.getsockname()[1], b.getsockname()[1]
    cmd = [sys.executable, "-m", "splitlearn.server.http.fedapp", "--model", "tiny", "--cut", "1", "--cut",
           "3", "--fed-secret-file", str(secret), "--port", str(port), "--metrics-port", str(mport),
           "--log-format", "json", "--access-log", "-"]
    with ChildServer(cmd, port, env={"SPLITLEARN_FED_TOKEN": token, "OMP_NUM_THREADS": "1"},
                     capture_stderr=True) as srv:
        r = requests.get(srv.url + P.READY, timeout=10)  # no token: the front door lets the probe through
        assert r.status_code == 200 and r.json()["ready"] is True
        assert requests.get(srv.url + P.METRICS, timeout=10).status_code == 401  # its port: a token
        for _ in range(2):
            assert requests.get(srv.url + P.FEDERATION, headers=auth(token), timeout=10).status_code == 200
        r = requests.get(srv.url + P.METRICS, headers=auth(token), timeout=10)  # the only token: the operator
        assert r.status_code == 200
        # loopback, where every local user reaches: the operator's token there too (SECURITY.md)
        assert requests.get(f"http://127.0.0.1:{mport}/metrics", timeout=10).status_code == 401
        r = requests.get(f"http://127.0.0.1:{mport}/metrics", headers=auth(token), timeout=10)
        assert r.status_code == 200
        s = samples_of(r.text)
        tenant = "t-" + __import__("hashlib").sha256(token.encode()).hexdigest()[:12]
        assert value(s, "splitlearn_requests_total", route=P.FEDERATION, method="GET", status="200", tenant=tenant) == 2
        assert value(s, "splitlearn_server_info", shape="fed", federation="splitfed",
                     protocol_version=str(P.PROTOCOL_VERSION)) == 1
        assert token not in r.text
        lines = logged_json(srv, lambda lines: any(x.get("route") == P.METRICS for x in lines))
        assert lines and all({"ts", "level", "logger", "message"} <= set(x) for x in lines)
        assert [x["status"] for x in lines if x.get("route") == P.FEDERATION] == [200, 200]
        # (the tokenless /metrics was refused by the front door at its headers: no app, no line)
        assert [x["status"] for x in lines if x.get("route") == P.METRICS] == [200]
        assert [x["status"] for x in lines if x.get("route") == P.READY] == [200]
        assert token not in srv.stderr_tail(200000)
