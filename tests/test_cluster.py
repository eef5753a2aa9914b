"""Replicas: ``python -m splitlearn.cluster`` with a real HAProxy, and the shared per-client state.

The first tests need no HAProxy: the configuration it is given, the client's route key, and
two in-process server runtimes sharing one ``--state-dir`` handing a client back and forth
(every answer equals a single server's). The rest start the real thing once (module fixture:
2 replicas of the tiny model with per-client LoRA behind HAProxy) and skip with a reason
where ``haproxy`` is not installed (``.ci/run`` installs it):

- LoRA owners of two tenants, spread over both replicas, train while one replica is killed
  with SIGKILL: every owner's losses and both sides' adapters equal a run against one server
  (float32 wire), and the server holds exactly the steps sent, so none was lost or applied
  twice; a generation in progress on that replica gives the tokens of the one-server run;
- replicas.json names live processes; SIGTERM stops every one of them, and so does HAProxy dying.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import requests
import torch

from splitlearn.api import protocol as P
from splitlearn.client import SplitClient
from splitlearn.hf.lora import adapter_tensors
from splitlearn.cluster.config import ClusterConfig
from splitlearn.cluster.haproxy import HAProxySettings, write_config
from splitlearn.errors import ConfigError
from splitlearn.procs.localserver import ChildServer, free_port
from splitlearn.model.lora import LoraSpec
from splitlearn.api.wire import decode

import clusterboot
from serverproc import OTHER, TOKEN, auth

HAPROXY = shutil.which("haproxy")
needs_haproxy = pytest.mark.skipif(HAPROXY is None, reason="HAProxy is not installed (apt-get install haproxy; "
                                                           ".ci/run installs it): the cluster tests run it for real")
LORA = ["--lora-r", "4", "--lora-alpha", "8", "--lora-targets", "c_attn,c_proj"]
SERVER = ["--model", "tiny", "--cut", "1", "--cut", "3", "--optimizer", "adamw", "--lr", "0.01",
          "--threads", "4", "--checkpoint-every", "3", *LORA]
STEPS, KILL_AFTER = 8, 4


# -- no HAProxy needed ----------------------------------------------------------------------

def test_the_haproxy_config_hashes_the_route_header_on_a_ring_and_checks_readiness(tmp_path):
    conf = HAProxySettings(bind="127.0.0.1:9000", servers=[("r0", "127.0.0.1:9001"), ("r1", "127.0.0.1:9002")]).render()
    route = f"set-header {P.ROUTE_HEADER} %[req.hdr(Authorization),sha2(256),hex]:%[req.hdr({P.ROUTE_HEADER}),field(2,:)]"
    assert f"option httpchk GET {P.READY}\n    http-check expect status 200" in conf  # readiness, not liveness
    assert P.HEALTH not in conf
    for line in (f"balance hdr({P.ROUTE_HEADER})", route, "hash-type consistent", f"option httpchk GET {P.READY}",
                 "option redispatch 1", "retries 3", "server r0 127.0.0.1:9001", "server r1 127.0.0.1:9002",
                 "on-error mark-down", f"set-header {P.REPLICA_HEADER} %[srv_name]", "bind 127.0.0.1:9000",
                 "http-reuse never"):  # a replica counts a connection as one tenant's (issue 50, item 6)
        assert line in conf, line
    if HAPROXY:  # HAProxy itself accepts it
        write_config(HAProxySettings(bind="127.0.0.1:9000", servers=[("r0", "127.0.0.1:9001")]),
                     tmp_path / "h.cfg", HAPROXY)
    with pytest.raises(ConfigError):
        HAProxySettings(bind="127.0.0.1:9000", servers=[])


@needs_haproxy
def test_haproxy_sends_no_traffic_to_a_replica_that_is_up_but_not_ready(tmp_path):
    """Two real segment apps behind a real HAProxy with the generated configuration: r1 is
    alive (``/v1/health`` 200) but not ready (its ``--checkpoint-dir`` is a file: ``/v1/ready``
    503), so every route, its owners' included, lands on r0; once r1 is ready its owners move
    back to it."""
    import subprocess

    from werkzeug.serving import make_server

    from splitlearn.cluster.haproxy import command
    from splitlearn.server.config import ServerConfig
    from splitlearn.server.http.app import create_app

    ckpt = [tmp_path / "ckpt0", tmp_path / "ckpt1"]
    ckpt[1].write_text("a file where the directory should be")
    apps = [create_app(ServerConfig(model="tiny", cuts=(2,), tokens=(TOKEN,), checkpoint_dir=str(d), torch_threads=1))
            for d in ckpt]
    servers = [make_server("127.0.0.1", free_port(), app, threaded=True) for app in apps]
    threads = [threading.Thread(target=srv.serve_forever, daemon=True) for srv in servers]
    for t in threads:
        t.start()
    port = free_port()
    settings = HAProxySettings(bind=f"127.0.0.1:{port}", inter_ms=100, fall=1, rise=1,
                               servers=[(f"r{i}", f"127.0.0.1:{srv.server_port}") for i, srv in enumerate(servers)])
    proxy = subprocess.Popen(command(HAPROXY, write_config(settings, tmp_path / "haproxy.cfg", HAPROXY)),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    keys = [P.route_key(TOKEN, f"c{i}") for i in range(24)]

    def where() -> set:
        out = set()
        for key in keys:
            r = requests.get(url + P.INFO, headers={**auth(TOKEN), P.ROUTE_HEADER: key}, timeout=10)
            assert r.status_code == 200, r.text
            out.add(r.headers[P.REPLICA_HEADER])
        return out

    def wait_until(want: set) -> set:
        deadline, got = time.monotonic() + 20, set()
        while time.monotonic() < deadline:
            try:
                got = where()
            except (requests.ConnectionError, AssertionError):  # HAProxy starting
                got = set()
            if got == want:
                return got
            time.sleep(0.2)
        return got

    try:
        c = apps[1].test_client()
        r = c.get(P.READY)
        assert r.status_code == 503 and r.get_json()["checks"]["checkpoint_dir"] is False
        assert c.get(P.HEALTH).status_code == 200  # alive: the old check (/v1/health) would route to it
        assert wait_until({"r0"}) == {"r0"}
        time.sleep(0.5)
        assert where() == {"r0"}  # and it stays out
        ckpt[1].unlink()
        ckpt[1].mkdir()  # ready now
        assert c.get(P.READY).status_code == 200
        assert wait_until({"r0", "r1"}) == {"r0", "r1"}  # its owners are back
    finally:
        proxy.terminate()
        proxy.wait(10)
        for srv in servers:
            srv.shutdown()
        for app in apps:
            app.extensions["splitlearn"].compute.close()


def test_the_cluster_config_sets_host_port_and_state_dir_and_refuses_what_would_split_the_state(tmp_path, monkeypatch):
    monkeypatch.setenv("SPLITLEARN_TOKEN", TOKEN)
    cfg = ClusterConfig(replicas=2, port=9000, run_dir=str(tmp_path), server_args=tuple(SERVER))
    assert cfg.state_dir == str(tmp_path / "state")
    args = cfg.replica_args(9001)
    assert args[-6:] == ["--host", "127.0.0.1", "--port", "9001", "--state-dir", str(tmp_path / "state")]
    plain = ClusterConfig(replicas=1, port=9000, run_dir=str(tmp_path), server_args=("--model", "tiny", "--cut", "2"))
    assert plain.state_dir is None and "--state-dir" not in plain.replica_args(9001)
    bad = [dict(replicas=0), dict(port=0), dict(server_args=(*SERVER, "--port", "1")),
           dict(server_args=(*SERVER, "--checkpoint-dir", "x")), dict(server_args=()),
           dict(server_args=(*SERVER, "--federation", "sequential")), dict(server_args=(*SERVER, "--fed-rank", "1"))]
    for change in bad:
        with pytest.raises(ConfigError):
            ClusterConfig(**{**dict(replicas=2, port=9000, run_dir=str(tmp_path), server_args=tuple(SERVER)), **change})
    fed = ClusterConfig(replicas=2, port=9000, run_dir=str(tmp_path),
                        server_args=("--model", "tiny", "--cut", "2", "--federation", "splitfed"))
    assert fed.splitfed and fed.state_dir is None  # splitfed spans replicas: each gets its place in the group
    assert fed.replica_args(9001, 1, "127.0.0.1:29500")[-6:] == ["--fed-store", "127.0.0.1:29500", "--fed-rank", "1",
                                                               "--fed-world-size", "2"]
    with pytest.raises(ConfigError, match="turn is one lock"):
        ClusterConfig(replicas=2, port=9000, run_dir=str(tmp_path),
                      server_args=("--model", "tiny", "--cut", "2", "--federation", "sequential"))
    monkeypatch.delenv("SPLITLEARN_TOKEN")
    with pytest.raises(ConfigError, match="same tokens"):
        ClusterConfig(replicas=2, port=9000, run_dir=str(tmp_path), server_args=tuple(SERVER))
    caps = args[args.index("--max-sessions-per-tenant"):args.index("--host")]  # each replica: 1/R of each cap
    assert caps == ["--max-sessions-per-tenant", "8", "--max-tokens-per-client", "32768", "--max-clients-per-tenant",
                    "32", "--max-pending-per-tenant", "4"]
    three = ClusterConfig(replicas=3, port=9000, run_dir=str(tmp_path),
                          server_args=(*SERVER, "--token-file", "t", "--max-pending-per-tenant", "2",
                                       "--max-clients-per-tenant", "7"))
    args3 = three.replica_args(9001)
    assert args3[args3.index("--max-clients-per-tenant", len(SERVER) + 6) + 1] == "2"  # floor(7 / 3), after the given 7
    assert args3[args3.index("--max-pending-per-tenant", len(SERVER) + 6) + 1] == "1"  # at least 1
    assert "--max-pending-per-tenant" not in plain.replica_args(9001)  # one replica: the caps as given
    with pytest.raises(ConfigError, match="max-pending"):
        ClusterConfig(replicas=2, port=9000, run_dir=str(tmp_path), server_args=(*SERVER, "--token-file", "t", "--max-pending-per-tenant", "x"))
    assert cfg.cores(1) is None  # pinning is off by default
    assert ClusterConfig(replicas=2, port=9000, run_dir=str(tmp_path), server_args=(*SERVER, "--token-file", "t"),
                         cores_per_replica=1).cores(1) == [1 % (os.cpu_count() or 1)]


def test_the_route_key_names_the_tenant_by_a_hash_and_never_carries_the_token():
    key = P.route_key(TOKEN, "alice")
    assert key.endswith(":alice") and TOKEN not in key and len(key.split(":")[0]) == 16
    assert key == P.route_key(TOKEN, "alice") != P.route_key(OTHER, "alice")


def _runtime(state_dir):
    from splitlearn.server.config import ServerConfig
    from splitlearn.server.engine.runtime import SegmentRuntime

    return SegmentRuntime(ServerConfig(model="tiny", cuts=(2,), optimizer="adamw", lr=1e-2, tokens=(TOKEN,),
                                       lora=LoraSpec(4, 8.0, ("c_attn", "c_proj")), checkpoint_every=2,
                                       state_dir=None if state_dir is None else str(state_dir), torch_threads=1))


@pytest.mark.slow
def test_two_replicas_sharing_a_state_dir_hand_a_client_over_exactly(tmp_path):
    """Steps applied on A, then B, then A again give the answers of one server; a replica never
    overwrites a newer generation with its stale copy, reloads it instead, and a sweep drops
    the copies of clients another replica has saved past."""
    ref, a, b = _runtime(None), _runtime(tmp_path), _runtime(tmp_path)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(2, 6, 32, generator=g), torch.randint(0, 256, (2, 6), generator=g)) for _ in range(8)]
    key = "t-x:alice"
    assert ref.config.n_embd == 32

    def apply(rt, s):
        return rt.compute.run(rt.train_apply, key, P.ApplyRequest("alice", s, 1, rt.cfg.lr)).meta

    def step(rt, s):
        """A fused piece of step ``s``, then its apply: the piece's tensors, the apply's answer."""
        h, y = batches[s - 1]
        ans = rt.compute.run(rt.train_step, P.StepMeta(key, s, "float32"), h, y, None)
        return ans.tensors, apply(rt, s)

    def same(x, y):
        return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)

    want = [step(ref, s)[0] for s in range(1, 9)]
    assert step(a, 1)[1]["durable"] == "0"
    second = step(a, 2)[1]
    assert second["durable"] == "2"  # durable every 2 of this client's steps
    assert same(step(a, 3)[0], want[2])
    assert b.client_step(key) == 2  # B loads A's generation: step 2, not A's step 3 in memory
    again = apply(b, 2)  # a retry of the durable step's apply gets the stored answer (as saved: no "durable")
    assert again == {k: v for k, v in second.items() if k != "durable"} and again["applied"] == "1"
    for s in (3, 4, 5):  # B replays 3 and goes on; durable at 4
        assert same(step(b, s)[0], want[s - 1])
    assert not a.compute.run(a.states.save, key)  # A's stale copy never overwrites B's generation
    assert a.client_step(key) == 4  # A sees a newer generation and reloads it
    for s in (5, 6, 7):
        assert same(step(a, s)[0], want[s - 1])
    assert b.client_step(key) == 6 and a.states.loads == 1 and b.states.loads == 2
    for s in (7, 8):  # B goes on and saves generation 4; A, not asked since, holds a stale copy...
        assert same(step(b, s)[0], want[s - 1])
    assert a.ledger.known(key) and a.compute.run(a.states.sweep) == 1  # ...which a sweep drops
    assert not a.ledger.known(key) and key not in a.adapters.replicas and a.client_step(key) == 8
    for rt in (ref, a, b):
        rt.compute.close()


def test_the_cluster_serves_haproxys_metrics_and_each_replicas_on_loopback(tmp_path, monkeypatch):
    monkeypatch.setenv("SPLITLEARN_TOKEN", TOKEN)
    cfg = ClusterConfig(replicas=2, port=9000, run_dir=str(tmp_path), server_args=tuple(SERVER), metrics_port=9100)
    assert cfg.replica_args(9002, 1)[-2:] == ["--metrics-port", "9102"]  # replica i: the port + 1 + i
    assert "--metrics-port" not in ClusterConfig(replicas=2, port=9000, run_dir=str(tmp_path),
                                                 server_args=tuple(SERVER)).replica_args(9001)
    with pytest.raises(ConfigError, match="not a replica argument"):
        ClusterConfig(replicas=2, port=9000, run_dir=str(tmp_path), server_args=(*SERVER, "--metrics-port", "1"))
    settings = HAProxySettings(bind="0.0.0.0:9000", servers=[("r0", "127.0.0.1:9001")], metrics="127.0.0.1:9100")
    conf = settings.render()
    assert "bind 127.0.0.1:9100\n    http-request use-service prometheus-exporter if { path /metrics }" in conf
    assert "prometheus-exporter" not in HAProxySettings(bind="127.0.0.1:9000", servers=[("r0", "127.0.0.1:9001")]).render()
    if HAPROXY:  # HAProxy itself accepts it (and was built with the exporter)
        write_config(settings, tmp_path / "h.cfg", HAPROXY)


def free_ports_in_a_row(n: int) -> int:
    """The first of ``n`` consecutive loopback ports free now, below the kernel's ephemeral range
    (net.ipv4.ip_local_port_range): a port in that range that is free now can be taken by any
    outgoing connection before the cluster binds it (one run: a replica's --metrics-port, "Address
    already in use", while the other test worker made connections); below it only an explicit bind
    takes a port."""
    import random
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        base = random.randrange(max(1024, low - 12000), low - n)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} free ports in a row")


# -- the real cluster -------------------------------------------------------------------------

class ClusterProcess(ChildServer):
    """``python -m splitlearn.cluster`` of the tiny model with per-client LoRA; ready when
    replicas.json is written and a request through HAProxy answers."""

    def __init__(self, run_dir: Path, replicas: int = 2):
        self.run_dir = run_dir
        port = free_ports_in_a_row(1)  # HAProxy's
        tokens = run_dir.parent / "tokens"
        tokens.write_text(f"alice {TOKEN} operator\nmallory {OTHER}\n")
        self.metrics_port = free_ports_in_a_row(replicas + 1)  # HAProxy's exporter, then each replica's
        cmd = [*clusterboot.command("--replicas", str(replicas), "--port", str(port)),  # replicas forked
               "--run-dir", str(run_dir), "--check-interval-ms", "100", "--log-level", "WARNING",
               "--metrics-port", str(self.metrics_port), "--",
               *SERVER, "--token-file", str(tokens), "--log-level", "WARNING"]
        super().__init__(cmd, port, startup_timeout_s=180, quiet=False, env={"OMP_NUM_THREADS": "1"})

    def _spawn(self) -> None:
        with clusterboot.here():
            super()._spawn()

    def ready(self) -> bool:
        return (self.run_dir / "replicas.json").is_file() and super().ready()

    def manifest(self) -> dict:
        return json.loads((self.run_dir / "replicas.json").read_text())


@contextlib.contextmanager
def one_server():
    """The reference: one server with the replicas' options, in this process (waitress on a
    thread; one torch thread, as the replicas under OMP_NUM_THREADS=1)."""
    from waitress import create_server

    from splitlearn.server.http.app import create_app
    from splitlearn.server.config import ServerConfig

    cfg = ServerConfig(model="tiny", cuts=(1, 3), optimizer="adamw", lr=0.01, threads=4, torch_threads=1,
                       lora=LoraSpec(4, 8.0, ("c_attn", "c_proj")), tokens=(f"alice {TOKEN} operator", f"mallory {OTHER}"))
    server = create_server(create_app(cfg), host="127.0.0.1", port=0, threads=4)
    threading.Thread(target=server.run, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.effective_port}"
    finally:
        server.close()


def replica_of(url: str, token: str, client_id: str) -> str:
    # HAProxy routes on the Authorization header's tenant and the route header's client id
    r = requests.get(url + P.HEALTH, headers={**auth(token), P.ROUTE_HEADER: P.route_key(token, client_id)}, timeout=10)
    return r.headers[P.REPLICA_HEADER]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if HAPROXY is None:
        pytest.skip("HAProxy is not installed (apt-get install haproxy; .ci/run installs it)")
    c = ClusterProcess(tmp_path_factory.mktemp("cluster") / "run").start()
    yield c
    c.stop()


def batches_of(seed: int, n: int = STEPS):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (2, 10), generator=g) for _ in range(n)]


def lora_client(url, token, cid) -> SplitClient:
    return SplitClient(url, "tiny", token=token, optimizer="adamw", lr=1e-2, device="cpu", client_id=cid,
                       lora="server", reconnect_timeout_s=60)


def both_adapters(client: SplitClient, url: str, token: str) -> dict:
    client.flush()  # the last step's apply rides on the next request: sent now, before reading the server's
    r = requests.get(url + P.CLIENT_ADAPTER.format(client_id=client.client_id),
                     headers={**auth(token), P.ROUTE_HEADER: P.route_key(token, client.client_id)}, timeout=30)
    assert r.status_code == 200, r.text
    return {**adapter_tensors(client.model), **decode(r.content)[0]}


@needs_haproxy
@pytest.mark.slow
def test_replicas_json_names_the_live_processes_and_owners_spread_over_both(cluster):
    m = cluster.manifest()
    assert [r["name"] for r in m["replicas"]] == ["r0", "r1"] and m["port"] == cluster.port
    for pid in [r["pid"] for r in m["replicas"]] + [m["haproxy"]["pid"]]:
        os.kill(pid, 0)  # alive
    assert Path(m["state_dir"]).is_dir() and m["url"] == cluster.url
    seen = {replica_of(cluster.url, TOKEN, f"o{i}") for i in range(12)}
    assert seen == {"r0", "r1"}  # the ring spreads client ids over both
    assert replica_of(cluster.url, TOKEN, "o1") == replica_of(cluster.url, TOKEN, "o1")  # and pins each


@needs_haproxy
@pytest.mark.slow
def test_a_tenant_routes_as_itself_and_holds_its_caps_over_all_replicas(cluster):
    """The attack: HAProxy hashed the client's route header, and each replica counts a tenant's
    sessions, tokens, client ids and pending steps on its own; a tenant spreading its client ids
    (or naming another tenant in the header) over R replicas got R x every cap. Now HAProxy puts
    the hash of the Authorization header in the route (the client id stays the client's), and
    each replica holds 1/R of each cap: mallory's sessions, over both replicas, stop at the cap."""
    def replica(token, route):
        r = requests.get(cluster.url + P.HEALTH, headers={**auth(token), P.ROUTE_HEADER: route}, timeout=10)
        return r.headers[P.REPLICA_HEADER]

    for i in range(16):  # whatever tenant the header names, the route is the token's
        honest = replica(OTHER, P.route_key(OTHER, f"o{i}"))
        assert replica(OTHER, P.route_key(TOKEN, f"o{i}")) == replica(OTHER, f"0000:o{i}") == honest, i
    replicas = cluster.manifest()["replicas"]
    limits = [requests.get(r["url"] + P.INFO, headers=auth(), timeout=10).json()["limits"] for r in replicas]
    assert [lim["max_sessions_per_tenant"] for lim in limits] == [8, 8]  # 16 (the default) over 2 replicas
    assert [lim["max_pending_per_tenant"] for lim in limits] == [4, 4]
    opened, refused, where = [], 0, set()
    for i in range(40):  # mallory's client ids land on both replicas
        cid = f"s{i}"
        r = requests.post(cluster.url + P.SESSIONS, json={"rows": 1}, timeout=30,
                          headers={**auth(OTHER), P.ROUTE_HEADER: P.route_key(OTHER, cid)})
        if r.status_code == 201:
            opened.append((cid, r.json()["session_id"]))
            where.add(r.headers[P.REPLICA_HEADER])
        else:
            assert r.status_code == 429, r.text
            refused += 1
    try:
        assert where == {"r0", "r1"} and len(opened) == 16 and refused == 24  # the cap, over the cluster
        r = requests.post(cluster.url + P.SESSIONS, json={"rows": 1}, timeout=30,
                          headers={**auth(TOKEN), P.ROUTE_HEADER: P.route_key(TOKEN, "s0")})
        assert r.status_code == 201, r.text  # alice is unaffected
        opened.append(("s0", r.json()["session_id"], TOKEN))
    finally:
        for cid, sid, *token in opened:
            t = token[0] if token else OTHER
            requests.delete(cluster.url + P.SESSION.format(session_id=sid), timeout=30,
                            headers={**auth(t), P.ROUTE_HEADER: P.route_key(t, cid)})


@needs_haproxy
@pytest.mark.slow
def test_haproxy_and_every_replica_serve_metrics_on_loopback(cluster):
    from prometheus_client.parser import text_string_to_metric_families

    m = cluster.manifest()
    assert m["haproxy"]["metrics"] == f"http://127.0.0.1:{cluster.metrics_port}/metrics"
    proxy = requests.get(m["haproxy"]["metrics"], timeout=10)
    assert proxy.status_code == 200
    names = {f.name for f in text_string_to_metric_families(proxy.text)}
    assert {"haproxy_backend_http_responses", "haproxy_server_check_status"} & names, sorted(names)[:20]
    assert 'proxy="replicas"' in proxy.text
    for i, r in enumerate(m["replicas"]):
        assert r["metrics"] == f"http://127.0.0.1:{cluster.metrics_port + 1 + i}/metrics"
        deadline = time.monotonic() + 90  # (before the test that kills r0: no replica is starting again)
        while True:
            try:
                info = requests.get(r["url"] + P.INFO, headers=auth(OTHER), timeout=10)
                # the operator's token, on loopback too (docs/SECURITY.md, 'Tenants see their own')
                assert requests.get(r["metrics"], timeout=10).status_code == 401
                text = requests.get(r["metrics"], headers=auth(TOKEN), timeout=10).text
                break
            except requests.ConnectionError:
                assert time.monotonic() < deadline, f"replica {i} did not come back"
                time.sleep(0.5)
        assert info.status_code == 200
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
        assert any(s.name == "splitlearn_requests_total" and s.labels == {
            "route": P.INFO, "method": "GET", "status": "200", "tenant": "mallory"} and s.value >= 1 for s in samples)
        assert TOKEN not in text and OTHER not in text


@needs_haproxy
@pytest.mark.slow
def test_a_replica_killed_mid_training_and_mid_generation_loses_nothing(cluster):
    """Two LoRA owners per replica, of two tenants (the same client id "o0" in both is two
    clients), train; a third owner on r0 generates. r0 is killed with SIGKILL between steps
    4 and 5 of every owner (3 is durable: --checkpoint-every 3) and mid-generation."""
    owners, per = [], {"r0": 0, "r1": 0}
    for i in range(20):
        for token in (TOKEN, OTHER):
            rep = replica_of(cluster.url, token, f"o{i}")
            if per[rep] < 2:
                per[rep] += 1
                owners.append((token, f"o{i}", rep))
    assert per == {"r0": 2, "r1": 2}
    writer = next(f"w{i}" for i in range(50) if replica_of(cluster.url, OTHER, f"w{i}") == "r0")
    data = {(t, c): batches_of(seed) for seed, (t, c, _) in enumerate(owners)}
    prompt = batches_of(7, 1)[0][:1, :5]

    # the reference: the same owners against one server
    with one_server() as url:
        ref = {}
        for t, c, _ in owners:
            with lora_client(url, t, c) as cl:
                ref[(t, c)] = ([cl.train_step(b) for b in data[(t, c)]], both_adapters(cl, url, t))
        with lora_client(url, OTHER, writer) as cl:
            for b in batches_of(99, 3):  # 3 steps: its adapter is durable
                cl.train_step(b)
            ref_tokens = cl.generate(prompt, max_new_tokens=10)

    gen = lora_client(cluster.url, OTHER, writer)
    for b in batches_of(99, 3):
        gen.train_step(b)
    clients = {(t, c): lora_client(cluster.url, t, c) for t, c, _ in owners}
    losses = {k: [] for k in clients}
    at_kill, errors = threading.Barrier(len(clients) + 1), []

    def train(k):
        try:
            for i, b in enumerate(data[k]):
                if i == KILL_AFTER:
                    at_kill.wait(120)  # everyone is past a durable step (3) with one step more in memory
                losses[k].append(clients[k].train_step(b))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"{k[1]}: {e!r}")
            at_kill.abort()

    threads = [threading.Thread(target=train, args=(k,)) for k in clients]
    for th in threads:
        th.start()
    victim = cluster.manifest()["replicas"][0]
    tokens = [prompt]
    for i, tok in enumerate(gen.generate_stream(prompt, max_new_tokens=10)):
        tokens.append(tok[:, None])
        if i == 2:  # 3 tokens out: the session's replica dies, with the owners' steps 5 in flight
            at_kill.wait(120)
            os.kill(victim["pid"], signal.SIGKILL)
    for th in threads:
        th.join(180)
    assert not errors, errors
    assert torch.equal(torch.cat(tokens, dim=1), ref_tokens)  # the generation went on, unchanged
    for (t, c, rep), k in zip(owners, clients):
        assert losses[k] == ref[k][0], (c, rep)  # bit-identical to one server
        got, want = both_adapters(clients[k], cluster.url, t), ref[k][1]
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want), (c, rep)
        state = requests.get(cluster.url + P.CLIENT_STATE.format(client_id=c),
                             headers={**auth(t), P.ROUTE_HEADER: P.route_key(t, c)}, timeout=30).json()
        assert state["step"] == STEPS  # every step once: none lost, none applied twice
        if rep == "r0":
            assert clients[k].recoveries, c  # its replica died: it recovered elsewhere
    deadline = time.monotonic() + 30
    while cluster.manifest()["replicas"][0]["pid"] == victim["pid"]:  # the supervisor starts it again
        assert time.monotonic() < deadline, "the killed replica was not restarted"
        time.sleep(0.2)
    for cl in [gen, *clients.values()]:
        cl.close()


@needs_haproxy
@pytest.mark.slow
def test_sigterm_stops_the_haproxy_and_every_replica(cluster):
    time.sleep(0.5)  # (a replica killed by the tests above is being started again: it is listed)
    m = cluster.manifest()
    pids = [r["pid"] for r in m["replicas"]] + [m["haproxy"]["pid"]]
    cluster.proc.send_signal(signal.SIGTERM)
    assert cluster.proc.wait(60) == 0
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not (cluster.run_dir / "replicas.json").exists()
    with pytest.raises(requests.ConnectionError):
        requests.get(cluster.url + P.HEALTH, timeout=5)


@needs_haproxy
@pytest.mark.slow
def test_haproxy_dying_stops_the_cluster(tmp_path):
    """No router, nothing to serve: the supervisor stops its replicas and exits 1."""
    c = ClusterProcess(tmp_path / "run", replicas=1).start()
    try:
        m = c.manifest()
        os.kill(m["haproxy"]["pid"], signal.SIGKILL)
        assert c.proc.wait(60) == 1
        with pytest.raises(ProcessLookupError):
            os.kill(m["replicas"][0]["pid"], 0)
        assert not (tmp_path / "run" / "replicas.json").exists()
    finally:
        c.stop()
