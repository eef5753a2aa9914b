"""The emulated WAN link (splitlearn/netem/relay.py) and speculative decoding across it.

Timing assertions are one-sided where a loaded CI box can only add time: a round trip through
the relay is at least the configured RTT and below it plus a generous slack.
"""
import socket
import threading
import time

import pytest
import torch

from splitlearn.netem import DelayRelay, TokenBucket, relay_process

SLACK_S = 0.5  # what a loaded 2-core box may add to a round trip


class Echo:
    """A TCP echo server on loopback (one thread per connection); half-closes after EOF."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.addr = self.sock.getsockname()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn):
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)
            conn.shutdown(socket.SHUT_WR)

    def close(self):
        self.sock.close()


@pytest.fixture
def echo():
    e = Echo()
    yield e
    e.close()


def connect(port):
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def recv_exactly(s, n):
    out = bytearray()
    while len(out) < n:
        chunk = s.recv(n - len(out))
        assert chunk, "connection closed early"
        out += chunk
    return bytes(out)


@pytest.mark.parametrize("rtt_ms", [0, 30, 80])
def test_round_trip_through_the_relay_is_the_configured_rtt(echo, rtt_ms):
    with DelayRelay(echo.addr, rtt_ms=rtt_ms) as relay, connect(relay.port) as s:
        times = []
        for i in range(5):
            t = time.perf_counter()
            s.sendall(bytes([i]) * 16)
            assert recv_exactly(s, 16) == bytes([i]) * 16
            times.append(time.perf_counter() - t)
    best = min(times)
    assert rtt_ms / 1000 <= best < rtt_ms / 1000 + SLACK_S, times
    assert sorted(times)[len(times) // 2] < rtt_ms / 1000 + SLACK_S


def test_one_way_delays_add_up(echo):
    with DelayRelay(echo.addr, up_ms=10, down_ms=30) as relay, connect(relay.port) as s:
        assert relay.rtt_ms == pytest.approx(40)
        t = time.perf_counter()
        s.sendall(b"x")
        assert recv_exactly(s, 1) == b"x"
        assert 0.040 <= time.perf_counter() - t < 0.040 + SLACK_S


def test_bytes_arrive_unchanged_and_in_order_while_pipelined(echo):
    payload = torch.randint(0, 256, (3_000_000,), generator=torch.Generator().manual_seed(0),
                            dtype=torch.uint8).numpy().tobytes()
    with DelayRelay(echo.addr, rtt_ms=20) as relay, connect(relay.port) as s:
        got = bytearray()

        def reader():
            while len(got) < len(payload):
                chunk = s.recv(1 << 16)
                if not chunk:
                    return
                got.extend(chunk)

        th = threading.Thread(target=reader)
        th.start()
        for i in range(0, len(payload), 50_000):  # many writes in flight inside the delay
            s.sendall(payload[i:i + 50_000])
        th.join(60)
        assert bytes(got) == payload
        assert relay.stats.bytes_up == relay.stats.bytes_down == len(payload)


def test_closing_propagates_both_ways(echo):
    with DelayRelay(echo.addr, rtt_ms=40) as relay:
        s = connect(relay.port)
        s.sendall(b"last words")
        s.shutdown(socket.SHUT_WR)  # EOF to the server, after the one-way delay
        assert recv_exactly(s, 10) == b"last words"
        t = time.perf_counter()
        assert s.recv(10) == b""  # the server's half-close came back through the relay
        assert time.perf_counter() - t < SLACK_S
        s.close()
        # a server that goes away: the client sees the connection close
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        with DelayRelay(srv.getsockname(), rtt_ms=20) as r2:
            c = connect(r2.port)
            conn, _ = srv.accept()
            conn.close()
            srv.close()
            c.settimeout(5)
            assert c.recv(10) == b""
            c.close()


def test_rate_limit_token_bucket(echo):
    b = TokenBucket(1000.0, 100)
    assert b.wait(100) == 0.0 and b.wait(50) == pytest.approx(0.05, abs=0.01)
    n = 400_000  # 400 kB at 8 Mbit/s (1 MB/s) each way: at least ~0.3 s once the burst is spent
    with DelayRelay(echo.addr, rtt_ms=0, rate_mbps=8, burst_bytes=64 * 1024) as relay, connect(relay.port) as s:
        t = time.perf_counter()
        threading.Thread(target=lambda: s.sendall(b"z" * n), daemon=True).start()
        assert recv_exactly(s, n) == b"z" * n
        assert time.perf_counter() - t >= (n - 64 * 1024) / 1e6


def test_the_rate_is_the_links_not_each_connections(echo):
    """Four connections at once share the link's rate: 4 x 200 kB at 8 Mbit/s (1 MB/s) each
    way take at least ~0.7 s in all (one bucket per connection would let them through in ~0.15 s)."""
    n, k = 200_000, 4
    with DelayRelay(echo.addr, rtt_ms=0, rate_mbps=8, burst_bytes=64 * 1024) as relay:
        socks = [connect(relay.port).__enter__() for _ in range(k)]
        t = time.perf_counter()
        for s in socks:
            threading.Thread(target=lambda s=s: s.sendall(b"q" * n), daemon=True).start()
        got = []
        readers = [threading.Thread(target=lambda s=s: got.append(recv_exactly(s, n))) for s in socks]
        for r in readers:
            r.start()
        for r in readers:
            r.join(30)
        elapsed = time.perf_counter() - t
        for s in socks:
            s.close()
    assert len(got) == k and all(g == b"q" * n for g in got)
    assert elapsed >= (k * n - 2 * 64 * 1024) / 1e6


@pytest.mark.slow
def test_speculative_generation_through_the_relay_process(tiny_model):
    """The split model behind the relay as a child process (what benchmarks/wan.py runs):
    greedy with the free draft equals the unsplit model, in fewer round trips than tokens."""
    from serverproc import TOKEN, ServerProcess
    from splitlearn.hf.draft import CountingRemoteCache, LinkAwarePolicy, free_draft, link_aware
    from splitlearn.hf.modeling import SplitGPT2LMHeadModel

    ids = torch.tensor([[72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]])
    kw = dict(do_sample=False, max_new_tokens=12, pad_token_id=256)
    want = tiny_model.generate(ids, **kw)
    with ServerProcess((1, 3)) as srv, relay_process(srv.url, rtt_ms=40) as relay:
        model = SplitGPT2LMHeadModel.from_pretrained("tiny", server=relay.url, token=TOKEN)
        try:
            remote = model.transformer.remote
            t = time.perf_counter()
            with CountingRemoteCache.from_info(model.config, remote.transport, remote.info) as cache:
                plain = model.generate(ids, cache=cache, **kw)
            plain_s = time.perf_counter() - t
            assert torch.equal(plain, want) and plain_s >= 12 * 0.040
            with CountingRemoteCache.from_info(model.config, remote.transport, remote.info) as cache, \
                    link_aware(model, LinkAwarePolicy(rtt_ms=40)) as policy:
                got = model.generate(ids, cache=cache, assistant_model=free_draft(model), **kw)
            assert torch.equal(got, want)
            assert cache.steps_sent == policy.rounds
            if policy.measured_acceptance > 0.5:
                assert policy.rounds < 12
        finally:
            model.transformer.remote.close()


def test_the_benchmarks_cells_and_tables():
    """benchmarks/wan.py's grid: loopback always, the lowest rate at 50 ms for generation, every
    rate at 1 and 50 ms for training; --grid crosses everything; the tables come from the rows."""
    from benchmarks.wan import cells, parse_args, tables

    gen, train = cells(parse_args([]))
    assert gen == [(0, 0), (1, 0), (20, 0), (50, 0), (100, 0), (50, 10)]
    assert train == [(0, 0)] + [(r, m) for r in (1, 50) for m in (1000, 100, 10)]
    gen, train = cells(parse_args(["--grid", "--rtt", "20,100", "--mbps", "10"]))
    assert gen == train == [(0, 0), (20, 10), (100, 10)]
    with pytest.raises(SystemExit):
        parse_args(["--mbps", "0"])
    rows = [{"link": "loopback", "system": "split", "tokens_per_s": 50.0, "speedup_vs_split": 1.0, "exact": True},
            {"link": "50 ms", "system": "split", "tokens_per_s": 10.0, "speedup_vs_split": 1.0, "exact": True},
            {"link": "50 ms", "system": "split + d", "tokens_per_s": 31.0, "speedup_vs_split": 3.1, "exact": False,
             "acceptance": 0.5, "agreement": 0.9}]
    training = [{"link": "loopback", "wire_dtype": "int8", "step_s_micro1": 1.0, "vs_loopback_micro1": 1.0},
                {"link": "50 ms / 100 Mbit/s", "wire_dtype": "int8", "step_s_micro1": 1.5, "vs_loopback_micro1": 1.5}]
    text = tables({"rows": rows, "unsplit_tokens_per_s": 80.0, "training": training, "micro_batches": [1]})
    assert "| split + d | - | 31.0 (x3.10) NOT EXACT | 0.90 | 0.50 |" in text
    assert "| 50 ms / 100 Mbit/s | int8 | 1.500 | 1.50x |" in text
