"""SplitFed across replicas (splitlearn/server/federation/collective.py): rounds over every replica's members,
closed with torch.distributed (gloo) so every replica continues from the same weights.

In-process first (no HAProxy): server runtimes in 2 child processes, a TCPStore hosted by the
test, members on both; the round's result is bit-identical on both replicas and to one runtime
that has all the members (FedAvg with the syncs in replica order, and the median); a replica
killed mid-round: the survivor closes the round without it, the restarted one takes the
survivor's weights. Then the real thing: ``python -m splitlearn.cluster --replicas 2 ... --
--federation splitfed`` behind HAProxy, real clients on both replicas, against one server.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import requests
import torch

from splitlearn.api import protocol as P
from splitlearn.procs.localserver import ChildServer, free_port
from splitlearn.server.federation.collective import weights_sha256
from splitlearn.api.wire import decode

import clusterboot
from splitfedreplica import K, _config, _result, _spawn, _train_and_sync, _wait
from listening import of_pids, public_address
from serverproc import TOKEN, auth

pytestmark = pytest.mark.slow


def test_the_server_takes_a_place_in_the_group_only_for_splitfed_and_checks_it():
    from splitlearn.errors import ConfigError
    from splitlearn.server.http.cli import parse_args

    assert _config().tokens == (TOKEN,)  # tests/splitfedreplica.py's token is serverproc's
    assert _config(store="127.0.0.1:29500", rank=1, world=2).fed_world_size == 2
    for bad in (dict(store="127.0.0.1"), dict(store="127.0.0.1:0"), dict(store="h:1", rank=2, world=2),
                dict(store="h:1", timeout_s=0)):
        with pytest.raises(ConfigError):
            _config(**bad)
    with pytest.raises(ConfigError, match="global lock"):
        parse_args(["--model", "tiny", "--cut", "2", "--federation", "sequential", "--fed-store", "h:1"])


@contextlib.contextmanager
def _store():
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    yield store.port


def _reference(keys_in_order, aggregations, k=K, lora=False) -> list[dict]:
    """One server with every member, syncs in replica order; its weights after each round."""
    from splitlearn.server.engine.runtime import SegmentRuntime
    from splitlearn.server.federation.strategy import make_strategy

    rt = SegmentRuntime(_config(k=k, lora=lora))
    try:
        out = []
        for n, aggregation in enumerate(aggregations, start=1):
            rt.federation.strategy = make_strategy(aggregation, 5.0)
            _train_and_sync(rt, keys_in_order, n)
            assert rt.federation.version == n
            out.append(_result(rt))
        return out
    finally:
        rt.compute.close()


def _load(out: Path, rank: int, n: int = 1) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    return load_file(str(out / f"r{rank}-{n}.safetensors")), json.loads((out / f"r{rank}-{n}.json").read_text())


@pytest.mark.parametrize("lora", [False, True], ids=["segment", "lora"])
def test_rounds_over_two_replica_processes_equal_one_server_bit_for_bit(tmp_path, lora):
    """a, b on replica 0 and c on replica 1 (c's upload bounded there), a FedAvg round then a
    median round, on copies of the segment or (SplitLoRA) of the round's adapter: after each
    collective close both replicas hold the same bits, equal to one server whose syncs came
    in the order a, b, c."""
    rounds = ["fedavg", "median"]
    with _store() as port:
        procs = [_spawn(0, port, 2, str(tmp_path), ["a", "b"], rounds, False, False, lora),
                 _spawn(1, port, 2, str(tmp_path), ["c"], rounds, False, False, lora)]
        wants = _reference(["a", "b", "c"], rounds, lora=lora)
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
    for n, want in enumerate(wants, start=1):
        (r0, s0), (r1, s1) = _load(tmp_path, 0, n), _load(tmp_path, 1, n)
        assert r0.keys() == r1.keys() == want.keys() and any(k.startswith("client/") for k in want)
        for k in want:
            assert torch.equal(r0[k], r1[k]), (n, k)  # the replicas agree bit for bit
            assert torch.equal(r0[k], want[k]), (n, k)  # and with one server
        for s in (s0, s1):
            st = s["status"]
            assert s["version"] == n and st["round"] == n + 1 and st["members"] == [] and st["aggregation"] == rounds[n - 1]
            assert st["last_round"] == {"round": n, "members": 3, "samples": 40, "server_clipped": 0, "client_clipped": 1,
                                        "share_capped": 0, "failed": 0}  # samples: target tokens, 2/4/2 x 5
            assert st["replicas"]["ready"] and st["replicas"]["group"] == [0, 1]
        # (the tensors above are compared bit for bit; the sha256 each replica reports in its
        # status is read while the next round may already be under way, so it is not compared)
        assert s0["status"]["replicas"]["last_close"]["local"] == 2 and s1["status"]["replicas"]["last_close"]["local"] == 1


def test_a_replica_that_dies_mid_round_the_survivor_closes_without_it_and_the_restarted_one_catches_up(tmp_path):
    """Replica 1 dies after its member c synced (all K synced: the round closes). Replica 0's
    collective fails or finds it gone; it forms the next group alone after --fed-timeout and
    closes the round with a and b (c's copy died with its replica): one server's round of a
    and b. The restarted replica 1 starts a new generation; replica 0 joins it, and the state
    agreement gives replica 1 version 1, bit for bit."""
    late = tmp_path / "late"
    late.mkdir()
    with _store() as port:
        dying = _spawn(1, port, 2, str(tmp_path), ["c"], ["fedavg"], True, False)
        survivor = _spawn(0, port, 2, str(tmp_path), ["a", "b"], ["fedavg"], False, True)
        want = _reference(["a", "b"], ["fedavg"], k=2)[0]
        dying.join(120)
        assert dying.exitcode == 3
        _wait(lambda: (tmp_path / "r0-1.json").exists(), timeout_s=120, what="the survivor's close")
        restarted = _spawn(1, port, 2, str(late), [], [], False, False)
        restarted.join(120)
        (tmp_path / "stop").touch()
        survivor.join(60)
        assert restarted.exitcode == 0 and survivor.exitcode == 0
    (r0, s0), (r1, s1) = _load(tmp_path, 0), _load(late, 1)
    assert s0["status"]["last_round"]["members"] == 2 and s0["status"]["replicas"]["group"] == [0]
    assert s1["version"] == 1 and s1["status"]["round"] == 2 and s1["status"]["replicas"]["group"] == [0, 1]
    for k in want:
        assert torch.equal(r0[k], want[k]), k
        assert torch.equal(r1[k], want[k]), k
    assert s1["status"]["replicas"]["weights_sha256"] == s0["status"]["replicas"]["weights_sha256"]


# -- the real cluster: python -m splitlearn.cluster with HAProxy ------------------------------

HAPROXY = shutil.which("haproxy")
SPLITFED = ["--model", "tiny", "--cut", "1", "--cut", "3", "--optimizer", "sgd", "--lr", "0.1", "--threads", "4",
            "--federation", "splitfed", "--clients-per-round", str(K), "--fed-timeout", "20"]


class SplitFedCluster(ChildServer):
    """``python -m splitlearn.cluster --replicas 2 ... -- --federation splitfed``."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        tokens = run_dir.parent / "tokens"
        tokens.write_text(f"alice {TOKEN} operator\n")
        port = free_port()
        cmd = [*clusterboot.command("--replicas", "2", "--port", str(port)),  # its replicas forked
               "--run-dir", str(run_dir), "--check-interval-ms", "100", "--log-level", "WARNING", "--",
               *SPLITFED, "--token-file", str(tokens), "--log-level", "INFO"]
        super().__init__(cmd, port, startup_timeout_s=180, quiet=False, env={"OMP_NUM_THREADS": "1"})

    def _spawn(self) -> None:
        with clusterboot.here():
            super()._spawn()

    def ready(self) -> bool:
        return (self.run_dir / "replicas.json").is_file() and super().ready()

    def replicas(self) -> dict:
        return {r["name"]: r["url"] for r in json.loads((self.run_dir / "replicas.json").read_text())["replicas"]}


@contextlib.contextmanager
def one_splitfed_server():
    """The reference: one server with the replicas' options, in this process (its runtime at hand)."""
    from waitress import create_server

    from splitlearn.server.http.app import create_app
    from splitlearn.server.config import ServerConfig

    cfg = ServerConfig(model="tiny", cuts=(1, 3), optimizer="sgd", lr=0.1, threads=4, torch_threads=1,
                       federation="splitfed", clients_per_round=K, tokens=(f"alice {TOKEN} operator",))
    app = create_app(cfg)
    server = create_server(app, host="127.0.0.1", port=0, threads=4)
    threading.Thread(target=server.run, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.effective_port}", app.extensions["splitlearn"]
    finally:
        server.close()


def _route(cid: str) -> dict:
    return {**auth(TOKEN), P.ROUTE_HEADER: P.route_key(TOKEN, cid)}


def _batch(cid: str, step: int):
    g = torch.Generator().manual_seed(1000 * step + sum(map(ord, cid)))
    return torch.randint(0, 256, (4 if cid == "b" else 2, 10), generator=g)


def _splitfed_run(url: str, ids: list[str], liar: str) -> dict:
    """Every member trains one step, then syncs in the order of ``ids`` (the round closes at the
    last); ``liar`` first tries two bad syncs and claims 10**12 samples; then one step more each."""
    from splitlearn.client import SplitClient
    from splitlearn.hf.fedsync import untied_weights
    from splitlearn.api.wire import encode

    clients = {c: SplitClient(url, "tiny", token=TOKEN, optimizer="sgd", lr=0.1, device="cpu", client_id=c)
               for c in ids}
    mine = untied_weights(clients[liar].segments)
    headers = {**_route(liar), "Content-Type": P.CONTENT_TYPE}
    huge = requests.post(url + P.FEDERATION_SYNC, headers=headers, timeout=30,
                         data=encode(mine, {"client_id": liar, "samples": "1" + "0" * 400}))
    nan = requests.post(url + P.FEDERATION_SYNC, headers=headers, timeout=30,
                        data=encode({k: torch.full_like(v, float("nan")) for k, v in mine.items()},
                                    P.SyncMeta(liar, 2).to_meta()))
    refused = (huge.status_code, "samples" in huge.json()["message"], nan.status_code)
    # (the lies come before it trains: a member's refused sync is its failure of the round, issue 29)
    losses = {c: [cl.train_step(_batch(c, 1))] for c, cl in clients.items()}
    clients[liar].federation.samples = 10**12  # what its library claims: the server counts its rows
    threads = []
    for i, c in enumerate(ids):  # syncs in this order (each waits for the round to close)
        threads.append(threading.Thread(target=clients[c].sync))
        threads[-1].start()
        _wait(lambda: requests.get(url + P.FEDERATION, headers=_route(c), timeout=10).json()["synced_count"] > i
              or requests.get(url + P.FEDERATION, headers=_route(c), timeout=10).json()["version"] == 1,
              what=f"{c}'s sync")
    for t in threads:
        t.join(120)
    for c, cl in clients.items():
        assert cl.federation.version == 1
        losses[c].append(cl.train_step(_batch(c, 2)))
    out = {"losses": losses, "refused": refused, "client_side": {c: untied_weights(cl.segments) for c, cl in clients.items()},
           "status": requests.get(url + P.FEDERATION, headers=_route(ids[0]), timeout=10).json()}
    for cl in clients.values():
        cl.close()
    return out


@pytest.mark.skipif(HAPROXY is None, reason="HAProxy is not installed (apt-get install haproxy; .ci/run installs it)")
def test_splitfed_over_two_replicas_behind_haproxy_equals_one_server(tmp_path):
    """Three real clients, a and b on replica r0 and c on r1 (through HAProxy's ring): one
    SplitFed round, c lying (10**400 samples: 400; NaN weights: 400; 10**12 samples claimed:
    its rows counted). Both replicas end with the same server-side bits (sha256) and the same
    shared client-side weights as one server with the same clients, and every loss is equal."""
    cluster = SplitFedCluster(tmp_path / "run").start()
    try:
        def replica_of(cid):
            return requests.get(cluster.url + P.HEALTH, headers=_route(cid), timeout=10).headers[P.REPLICA_HEADER]

        on = {"r0": [], "r1": []}
        for i in range(40):
            cid = f"m{i}"
            rep = replica_of(cid)
            if len(on[rep]) < (2 if rep == "r0" else 1):
                on[rep].append(cid)
        ids = on["r0"] + on["r1"]  # replica order: FedAvg's sum in the order one server adds them
        assert len(ids) == K
        got = _splitfed_run(cluster.url, ids, liar=ids[-1])
        urls = cluster.replicas()
        per = {name: requests.get(u + P.FEDERATION, headers=auth(TOKEN), timeout=10).json() for name, u in urls.items()}
        shared = {name: decode(requests.get(u + P.FEDERATION_WEIGHTS, headers=auth(TOKEN), timeout=30).content)[0]
                  for name, u in urls.items()}
        m = json.loads((cluster.run_dir / "replicas.json").read_text())
        sockets = of_pids([m["supervisor_pid"], m["haproxy"]["pid"], *(r["pid"] for r in m["replicas"])])
        # the store is a file of the private run directory (docs/SECURITY.md, 'The store'): no port
        assert m["fed_store"] == f"file://{cluster.run_dir / 'fed-store'}"
        assert os.stat(cluster.run_dir).st_mode & 0o077 == 0
        # nothing of the cluster (gloo's ports, the replicas, HAProxy) listens beyond loopback
        assert all(a.is_loopback for a, _ in sockets), sockets
        if public_address() is not None:
            for _, port in sockets:
                with pytest.raises(OSError):
                    socket.create_connection((public_address(), port), timeout=5)
    finally:
        cluster.stop()
    with one_splitfed_server() as (url, rt):
        want = _splitfed_run(url, ids, liar=ids[-1])
        want_sha = weights_sha256(rt.segment.state_dict())
        want_shared = rt.federation.client_weights
    assert got["refused"] == want["refused"] == (400, True, 400)
    assert got["losses"] == want["losses"]  # every member's step before and after the round
    for c in ids:
        assert all(torch.equal(got["client_side"][c][k], want["client_side"][c][k]) for k in want["client_side"][c])
    for name, st in per.items():
        assert st["version"] == 1 and st["round"] == 2, name
        assert st["last_round"] == want["status"]["last_round"] == {
            "round": 1, "members": 3, "samples": 54, "server_clipped": 0, "client_clipped": 0,  # tokens: 3 x 2 x 9
            "share_capped": 0, "failed": 0}
        assert st["replicas"]["weights_sha256"]["server"] == want_sha, name  # bit-identical server side
        assert st["replicas"]["group"] == [0, 1]
        assert all(torch.equal(shared[name][k], want_shared[k]) for k in want_shared), name
    assert per["r0"]["replicas"]["last_close"]["local"] == 2 and per["r1"]["replicas"]["last_close"]["local"] == 1
