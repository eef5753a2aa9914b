"""Metrics, access lines and readiness (splitlearn/server/http/metrics.py, accesslog.py, probes.py).

In-process through Flask's test client, except the last test: ``--metrics-port`` and
``--log-format json`` on a real server process.
"""
import json
import logging
import logging.handlers
import re
import shutil
import threading
import time

import pytest
import requests
import torch
from prometheus_client.parser import text_string_to_metric_families

from splitlearn.api import protocol as P
from splitlearn.procs.localserver import free_port
from splitlearn.server.http import accesslog
from splitlearn.server.http.app import create_app
from splitlearn.server.http.cli import parse_args
from splitlearn.server.config import ServerConfig
from splitlearn.server.tenants import digest_of
from splitlearn.errors import ConfigError
from splitlearn.api.wire import encode

from serverproc import (OTHER, TENANTS, TOKEN, ServerProcess, access_lines, apply_step, assert_error, auth, logged_json,
                        post_tensors, tensors_of)

D, VOCAB = 32, 257  # models/tiny.json


def scrape(client, token=TOKEN) -> dict:
    """``{(name, sorted labels): value}`` of every sample of ``GET /metrics``; the text too."""
    r = client.get(P.METRICS, headers=auth(token))
    assert r.status_code == 200, r.get_data(as_text=True)
    assert r.content_type.startswith("text/plain; version=0.0.4")
    text = r.get_data(as_text=True)
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, text


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def train_step(client, step: int, token=TOKEN):
    """One fused 2-way piece of step ``step``, then its apply: two requests."""
    g = torch.Generator().manual_seed(step)
    tensors = {P.HIDDEN: torch.randn(2, 6, D, generator=g), P.LABELS: torch.randint(0, VOCAB, (2, 6), generator=g)}
    out = tensors_of(post_tensors(client, P.TRAIN_STEP, tensors, P.StepMeta("c1", step).to_meta(), token=token))
    assert apply_step(client, "c1", step, token=token).status_code == 200
    return out


def decode_steps(client, n: int, token=OTHER) -> str:
    sid = client.post(P.SESSIONS, json={"rows": 1}, headers=auth(token)).get_json()["session_id"]
    for pos in range(n):
        h = torch.randn(1, 1, D, generator=torch.Generator().manual_seed(pos))
        tensors_of(post_tensors(client, P.SESSION_STEP.format(session_id=sid),
                                {P.HIDDEN: h, P.MASK: torch.ones(1, 1, dtype=torch.long)},
                                P.SessionStepMeta(pos).to_meta(), token=token))
    return sid


@pytest.fixture
def app():
    return create_app(ServerConfig(model="tiny", cuts=(2,), tokens=TENANTS))  # 2-way: alice operator, mallory


@pytest.fixture
def access(app):
    """The access lines the app logs, as parsed JSON objects (the JSON formatter of --log-format json)."""
    with access_lines() as lines:
        yield lines


def test_metrics_parse_and_move_with_real_requests(app):
    c = app.test_client()
    before, _ = scrape(c)
    train_step(c, 1), train_step(c, 2)
    sid = decode_steps(c, 3)
    assert c.get(P.INFO, headers=auth(OTHER)).status_code == 200
    assert_error(c.get("/v1/nowhere", headers=auth(OTHER)), 404)
    after, _ = scrape(c)
    moved = lambda name, **labels: value(after, name, **labels) - value(before, name, **labels)  # noqa: E731
    route = "/v1/sessions/<session_id>/step"
    assert moved("splitlearn_requests_total", route=P.TRAIN_STEP, method="POST", status="200", tenant="alice") == 2
    assert moved("splitlearn_requests_total", route=route, method="POST", status="200", tenant="mallory") == 3
    assert moved("splitlearn_requests_total", route=P.INFO, method="GET", status="200", tenant="mallory") == 1
    assert moved("splitlearn_requests_total", route="unmatched", method="GET", status="404", tenant="mallory") == 1
    assert moved("splitlearn_request_duration_seconds_count", route=route, method="POST") == 3
    assert moved("splitlearn_request_duration_seconds_sum", route=route, method="POST") > 0
    assert moved("splitlearn_request_bytes_total", route=route, direction="in") > 3 * D * 4
    assert moved("splitlearn_steps_applied_total") == 2
    assert moved("splitlearn_decode_steps_total") == 3
    assert moved("splitlearn_queue_wait_seconds_count", **{"class": "training"}) == 4  # a piece and an apply a step
    assert moved("splitlearn_queue_wait_seconds_count", **{"class": "decode"}) >= 1
    assert value(after, "splitlearn_sessions", tenant="mallory") == 1
    assert value(after, "splitlearn_cached_tokens", tenant="mallory") == 3  # 1 row x 3 positions
    assert value(after, "splitlearn_memory_reserved_bytes", tenant="mallory") > 0  # its KV cache
    assert value(after, "splitlearn_memory_limit_bytes") >= value(after, "splitlearn_memory_reserved_total_bytes") > 0
    assert value(after, "splitlearn_federation_round") == 1
    c.delete(P.SESSION.format(session_id=sid), headers=auth(OTHER))
    closed, _ = scrape(c)
    assert value(closed, "splitlearn_sessions", tenant="mallory") == 0


def test_made_up_methods_and_paths_do_not_grow_the_registry(app):
    # the attack: a tenant sends requests with a new method word and a new path each time; the
    # labels come from what the server knows (the URL rule, a fixed set of methods), never the wire
    c = app.test_client()
    for i in range(50):
        c.open(f"/v1/nowhere/{i}", method=f"BREW{i}", headers=auth(OTHER))
    samples, _ = scrape(c)
    assert value(samples, "splitlearn_requests_total", route="unmatched", method="other", status="404",
                 tenant="mallory") == 50
    methods = {dict(labels)["method"] for name, labels in samples if name == "splitlearn_requests_total"}
    assert methods <= {"GET", "POST", "other"}


def test_metrics_are_the_operators_and_name_no_token(app):
    c = app.test_client()
    train_step(c, 1, token=OTHER)
    assert_error(c.get(P.METRICS), 401)
    assert_error(c.get(P.METRICS, headers=auth(OTHER)), 403, "operator")
    samples, text = scrape(c)
    assert value(samples, "splitlearn_requests_total", route=P.TRAIN_STEP, method="POST", status="200",
                 tenant="mallory") == 1
    for secret in (TOKEN, OTHER, digest_of(TOKEN), digest_of(OTHER), digest_of(OTHER)[:16]):
        assert secret not in text


def test_each_apps_metrics_are_its_own():
    a = create_app(ServerConfig(model="tiny", cuts=(2,), tokens=TENANTS)).test_client()
    b = create_app(ServerConfig(model="tiny", cuts=(2,), tokens=TENANTS)).test_client()
    train_step(a, 1)
    assert value(scrape(a)[0], "splitlearn_steps_applied_total") == 1
    assert value(scrape(b)[0], "splitlearn_requests_total", route=P.TRAIN_STEP, method="POST", status="200",
                 tenant="alice") == 0


def test_one_json_access_line_per_request_with_its_fields(app, access):
    c = app.test_client()
    train_step(c, 1, token=OTHER)
    mine = c.get(P.INFO, headers={**auth(OTHER), P.REQUEST_ID_HEADER: "trace-42:a"})
    bad_id = c.get(P.INFO, headers={**auth(OTHER), P.REQUEST_ID_HEADER: "x" * 65})
    c.get(P.INFO)  # no token: 401
    lines = access()
    assert [(x["method"], x["route"], x["status"], x["tenant"]) for x in lines] == [
        ("POST", P.TRAIN_STEP, 200, "mallory"), ("POST", P.TRAIN_APPLY, 200, "mallory"),
        ("GET", P.INFO, 200, "mallory"), ("GET", P.INFO, 200, "mallory"), ("GET", P.INFO, 401, "-")]
    assert len({x["request_id"] for x in lines}) == 5
    del lines[1]  # the apply
    step = lines[0]
    assert step["bytes_in"] > 2 * 6 * D * 4 and step["bytes_out"] > 2 * 6 * D * 4 and step["ms"] > 0
    assert step["level"] == "INFO" and step["logger"] == "splitlearn.server.http.accesslog"
    assert "incident" not in step
    assert lines[1]["request_id"] == mine.headers[P.REQUEST_ID_HEADER] == "trace-42:a"  # the client's id, kept
    assert re.fullmatch(r"[0-9a-f]{16}", lines[2]["request_id"]) and bad_id.headers[P.REQUEST_ID_HEADER] == lines[2]["request_id"]
    assert lines[1]["bytes_out"] == len(mine.get_data())
    assert not any(TOKEN in json.dumps(x) or OTHER in json.dumps(x) for x in lines)


def test_lines_and_counts_come_after_the_answer_and_a_scrape_counts_every_answered_request(app, monkeypatch):
    """The answer does not wait for its line or its count (both queued); nothing queued is lost:
    a scrape drains the queue first, and the drainer writes the lines by itself."""
    accesslog.drain()
    running = accesslog._drainer
    monkeypatch.setattr(accesslog, "_drainer", "stopped")  # no background drains in this test
    if isinstance(running, threading.Thread):
        running.join(5)  # (it ends at its next wake-up: no drain of this test's records)
        assert not running.is_alive()
    c = app.test_client()
    with access_lines() as lines:
        for _ in range(3):
            assert c.get(P.INFO, headers=auth(OTHER)).status_code == 200
        assert len(accesslog._pending) == 3  # answered, not yet counted or logged
        count = value(scrape(c)[0], "splitlearn_requests_total", route=P.INFO, method="GET", status="200", tenant="mallory")
        assert count == 3 and len(accesslog._pending) == 1  # the scrape's own request, answered after it
        assert [x["route"] for x in lines()] == [P.INFO] * 3 + [P.METRICS]
    monkeypatch.undo()
    c.get(P.INFO, headers=auth(OTHER))  # the drainer (started by a record if need be) writes it by itself
    deadline = time.monotonic() + 5
    while accesslog._pending:
        assert time.monotonic() < deadline, "the drainer did not drain"
        time.sleep(0.01)


def test_a_500_logs_its_incident(app, access):
    rt = app.extensions["splitlearn"]
    rt.info = lambda: 1 / 0  # a bug in a view
    r = app.test_client().get(P.INFO, headers=auth(OTHER))
    assert r.status_code == 500
    incident = re.search(r"incident ([0-9a-f]{12})", r.get_json()["message"]).group(1)
    (line,) = access()
    assert (line["status"], line["incident"], line["route"]) == (500, incident, P.INFO)


def test_text_access_lines_and_json_records_of_other_loggers(app):
    record = logging.LogRecord("splitlearn.x", logging.WARNING, __file__, 1, "round %d closed", (3,), None)
    record.round = 3
    out = json.loads(accesslog.JsonFormatter().format(record))
    assert out["message"] == "round 3 closed" and out["level"] == "WARNING" and out["round"] == 3
    try:
        1 / 0
    except ZeroDivisionError:
        import sys
        record = logging.LogRecord("splitlearn.x", logging.ERROR, __file__, 1, "boom", (), sys.exc_info())
    assert "ZeroDivisionError" in json.loads(accesslog.JsonFormatter().format(record))["exc"]


def test_ready_is_200_and_503_when_the_checkpoint_dir_is_not_writable(tmp_path):
    ckpt = tmp_path / "ckpt"
    app = create_app(ServerConfig(model="tiny", cuts=(1, 3), tokens=TENANTS, checkpoint_dir=str(ckpt)))
    c = app.test_client()
    r = c.get(P.READY)  # no token needed; the directory is made by the first checkpoint
    assert r.status_code == 200, r.get_json()
    assert not ckpt.exists()
    ckpt.mkdir()
    assert c.get(P.READY).status_code == 200
    assert r.get_json() == {"ready": True, "checks": {"model": True, "compute_thread": True,
                                                      "checkpoint_dir": True, "state_dir": None,
                                                      "accepting": True}}
    shutil.rmtree(ckpt, ignore_errors=True)
    ckpt.write_text("a file where the directory was")  # not writable, even by root
    r = c.get(P.READY)
    assert r.status_code == 503 and r.get_json()["ready"] is False
    assert r.get_json()["checks"]["checkpoint_dir"] is False and r.get_json()["checks"]["model"] is True
    assert c.get(P.HEALTH).status_code == 200  # alive all the same
    ckpt.unlink()
    ckpt.mkdir()
    assert c.get(P.READY).status_code == 200  # and back


def test_ready_is_503_when_the_compute_thread_is_gone():
    app = create_app(ServerConfig(model="tiny", cuts=(2,), tokens=TENANTS))
    app.extensions["splitlearn"].compute.close()
    r = app.test_client().get(P.READY)
    assert r.status_code == 503 and r.get_json()["checks"]["compute_thread"] is False


def test_sigterm_with_drain_is_unready_at_once_serves_meanwhile_then_stops(tmp_path):
    """--drain-seconds: the load balancer's check sees 503 from the signal on (HAProxy takes the replica
    out of rotation), while requests already routed here are still answered; the process then
    checkpoints and exits 0. A second SIGTERM stops it at once."""
    import signal
    import time

    with ServerProcess((2,), checkpoint_dir=tmp_path / "ckpt", extra=["--drain-seconds", "3"]) as srv:
        assert requests.get(srv.url + P.READY, timeout=10).status_code == 200
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        deadline = t0 + 2
        while requests.get(srv.url + P.READY, timeout=10).status_code == 200:
            assert time.monotonic() < deadline, "still ready after SIGTERM"
            time.sleep(0.05)
        r = requests.get(srv.url + P.READY, timeout=10)
        assert r.status_code == 503 and r.json()["checks"]["accepting"] is False
        assert r.json()["checks"]["model"] is True
        info = requests.get(srv.url + P.INFO, headers=auth(), timeout=10)  # still served while draining
        assert info.status_code == 200
        assert srv.proc.wait(30) == 0
        assert time.monotonic() - t0 >= 2.5  # it waited the drain out
        assert (tmp_path / "ckpt").is_dir()  # and checkpointed on the way out
    with ServerProcess((2,), extra=["--drain-seconds", "60"]) as srv:
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert requests.get(srv.url + P.READY, timeout=10).status_code == 503
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)  # the operator means it: no 60 s wait
        assert srv.proc.wait(20) == 0 and time.monotonic() - t0 < 15
    with pytest.raises(ConfigError, match="drain-seconds"):
        ServerConfig(model="tiny", cuts=(2,), drain_s=-1)


def test_flags():
    cfg = parse_args(["--model", "tiny", "--cut", "2", "--log-format", "json", "--metrics-port", "9100",
                      "--no-request-log"])
    assert (cfg.log_format, cfg.metrics_port, cfg.request_log) == ("json", 9100, False)
    assert parse_args(["--model", "tiny", "--cut", "2"]).log_format == "text"
    with pytest.raises(ConfigError, match="metrics-port"):
        ServerConfig(model="tiny", cuts=(2,), port=8000, metrics_port=8000)
    with pytest.raises(ConfigError, match="log-format"):
        ServerConfig(model="tiny", cuts=(2,), log_format="xml")


@pytest.fixture
def logger_state():
    """The access logger as it was: configure() below changes it, as a server's CLI does."""
    logger = logging.getLogger(accesslog.__name__)
    saved = logger.level, logger.propagate, list(logger.handlers)
    yield logger
    for h in logger.handlers[len(saved[2]):]:
        logger.removeHandler(h)
        h.close()
    logger.setLevel(saved[0])
    logger.propagate = saved[1]


def test_access_lines_are_off_unless_asked_and_the_metrics_count_anyway(app, logger_state, tmp_path):
    # the README starts the server with & in the user's terminal: its access lines would interleave
    # with the user's own output, so there are none unless --access-log names a file or '-'
    assert parse_args(["--model", "tiny", "--cut", "2"]).access_log is None
    assert not logger_state.isEnabledFor(logging.INFO)
    seen = logging.handlers.BufferingHandler(1000)
    logger_state.addHandler(seen)
    c = app.test_client()
    before, _ = scrape(c)
    assert c.get(P.INFO, headers=auth(OTHER)).status_code == 200
    accesslog.drain()
    after, _ = scrape(c)
    accesslog.drain()  # the scrape's own line too: written late, it would land in the file below
    assert value(after, "splitlearn_requests_total", route=P.INFO, method="GET", status="200", tenant="mallory") \
        == value(before, "splitlearn_requests_total", route=P.INFO, method="GET", status="200", tenant="mallory") + 1
    assert [r for r in seen.buffer if r.levelno < logging.WARNING] == []  # counted, not logged
    logger_state.removeHandler(seen)

    path = tmp_path / "access.log"
    cfg = parse_args(["--model", "tiny", "--cut", "2", "--log-format", "json", "--access-log", str(path)])
    assert cfg.access_log == str(path) and logger_state.isEnabledFor(logging.INFO)
    assert not logger_state.propagate  # to the file only, not over stderr
    assert c.get(P.INFO, headers=auth(OTHER)).status_code == 200
    accesslog.drain()
    for h in logger_state.handlers:
        h.flush()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(x["route"], x["status"], x["tenant"]) for x in lines] == [(P.INFO, 200, "mallory")]
    with pytest.raises(ConfigError, match="access-log"):
        parse_args(["--model", "tiny", "--cut", "2", "--access-log", str(tmp_path / "no" / "such" / "dir.log")])


def test_no_request_log_counts_nothing(access):
    c = create_app(ServerConfig(model="tiny", cuts=(2,), tokens=TENANTS, request_log=False)).test_client()
    train_step(c, 1)
    samples, _ = scrape(c)
    assert not [k for k in samples if k[0] == "splitlearn_requests_total"]
    assert value(samples, "splitlearn_steps_applied_total") == 1  # the state is still read
    assert access() == []


@pytest.mark.slow
def test_metrics_port_and_json_logs_on_a_real_server():
    port = free_port()
    srv = ServerProcess((2,), extra=["--metrics-port", str(port), "--log-format", "json", "--access-log", "-"])
    assert srv.cmd[-2:] == ["--log-level", "WARNING"]
    srv.cmd, srv.capture_stderr = srv.cmd[:-2], True  # INFO: the access lines, kept
    tenant = "t-" + digest_of(TOKEN)[:12]  # a bare token's tenant name (the token's sole tenant)
    with srv:
        assert_status = lambda r, code: r.status_code == code or pytest.fail(r.text)  # noqa: E731
        assert_status(requests.get(srv.url + P.METRICS, timeout=10), 401)  # the server's port: a token
        assert requests.get(srv.url + P.READY, timeout=10).json()["ready"] is True  # no token, through the door
        for _ in range(3):
            assert_status(requests.get(srv.url + P.INFO, headers=auth(), timeout=10), 200)
        # an answer over 1 MiB goes out through waitress's file wrapper (routing.bytes_response):
        # whole, and counted and logged once it is sent, as any other
        big = encode({"x": torch.arange(600_000, dtype=torch.float32)})
        r = requests.post(srv.url + P.ECHO, data=big, headers={**auth(), "Content-Type": P.CONTENT_TYPE}, timeout=30)
        assert_status(r, 200)
        assert r.content == big and int(r.headers["Content-Length"]) == len(big)
        echoed = logged_json(srv, lambda lines: any(x.get("route") == P.ECHO for x in lines))
        assert [x["bytes_out"] for x in echoed if x.get("route") == P.ECHO] == [len(big)]
        # loopback, where every local user reaches: the operator's token there too (SECURITY.md)
        assert_status(requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10), 401)
        r = requests.get(f"http://127.0.0.1:{port}/metrics", headers=auth(), timeout=10)
        assert_status(r, 200)
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(r.text) for s in f.samples}
        assert value(samples, "splitlearn_requests_total", route=P.INFO, method="GET", status="200",
                     tenant=tenant) == 3
        assert value(samples, "splitlearn_request_bytes_total", route=P.ECHO, direction="out") == len(big)
        assert TOKEN not in r.text and digest_of(TOKEN) not in r.text
        lines = logged_json(srv, lambda lines: sum(x.get("route") in (P.INFO, P.READY) for x in lines) >= 4)
        assert lines and all({"ts", "level", "logger", "message"} <= set(x) for x in lines)  # every line JSON
        infos = [x for x in lines if x.get("route") == P.INFO]
        assert len(infos) == 3 and all(x["status"] == 200 and x["tenant"] == tenant for x in infos)
        assert [x["status"] for x in lines if x.get("route") == P.READY] == [200]


def test_the_dashboard_and_the_docs_query_only_metrics_the_server_exports(app):
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    c = app.test_client()
    train_step(c, 1)
    decode_steps(c, 2)
    samples, _ = scrape(c)
    exported = {name for name, _ in samples}
    dashboard = json.loads((root / "server" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    docs = (root / "docs" / "OPERATIONS.md").read_text()
    promql = re.findall(r"```promql\n(.*?)```", docs, re.S)
    used = set(re.findall(r"\bsplitlearn_[a-z_]+", " ".join(exprs + promql)))
    assert len(used) >= 8 and used <= exported, sorted(used - exported)
