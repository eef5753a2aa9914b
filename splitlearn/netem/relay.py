"""A TCP relay that delays each direction by a fixed one-way time: an emulated WAN link.

Every chunk read is written on the other side at ``arrival + delay``, in order, per direction
(a round trip costs ``2 * delay`` more); ``rate_mbps`` adds a token bucket per direction,
shared by every connection through the relay. Why a relay and not ``tc netem``, rate shaping
with ``tc tbf``, and what it does not emulate: docs/WAN.md, 'The emulated link'. Use::

    python -m splitlearn.netem.relay --listen 127.0.0.1:9000 --upstream 127.0.0.1:8000 --rtt-ms 50

    with DelayRelay(("127.0.0.1", 8000), rtt_ms=50) as relay:   # a thread of this process
        client = SplitClient(relay.url, ...)"""
from __future__ import annotations

import argparse
import asyncio
import collections
import socket
import sys
import threading
import time
from typing import Optional

CHUNK = 1 << 16  # bytes read at once


def parse_hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


class TokenBucket:
    """``rate_bps`` bytes per second, ``burst`` bytes deep: :meth:`wait` says how long to wait
    before ``n`` bytes may leave (and takes them)."""

    def __init__(self, rate_bps: float, burst: int):
        if rate_bps <= 0 or burst <= 0:
            raise ValueError("rate and burst must be > 0")
        self.rate, self.burst = float(rate_bps), float(burst)
        self.tokens, self.t = float(burst), time.monotonic()

    def wait(self, n: int) -> float:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
        self.t = now
        self.tokens -= n  # may go negative: the debt is the wait
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


class LinkStats:
    """Bytes and connections through the relay (for reports and tests)."""

    def __init__(self):
        self.connections = 0
        self.bytes_up = 0  # client -> server
        self.bytes_down = 0  # server -> client


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


class DelayRelay:
    """The relay on ``listen`` (default: a free loopback port) to ``upstream``, delaying each
    direction by ``rtt_ms / 2`` (or ``up_ms``/``down_ms``: client->server, server->client),
    optionally rate-limited per direction to ``rate_mbps``. ``start()`` runs it in a daemon
    thread; ``serve()`` is the coroutine (for :func:`main`)."""

    def __init__(self, upstream: tuple[str, int], *, rtt_ms: float = 0.0, up_ms: Optional[float] = None,
                 down_ms: Optional[float] = None, rate_mbps: Optional[float] = None,
                 burst_bytes: int = 64 * 1024, listen: tuple[str, int] = ("127.0.0.1", 0)):
        if rtt_ms < 0 or (up_ms is not None and up_ms < 0) or (down_ms is not None and down_ms < 0):
            raise ValueError("delays must be >= 0")
        self.upstream = upstream
        self.up_s = (rtt_ms / 2 if up_ms is None else up_ms) / 1000.0
        self.down_s = (rtt_ms / 2 if down_ms is None else down_ms) / 1000.0
        self.rate_bps = rate_mbps * 1e6 / 8 if rate_mbps else None
        self.burst = int(burst_bytes)
        # one bucket per direction for the whole link (every pump runs on the relay's one loop)
        self._buckets = {up: TokenBucket(self.rate_bps, self.burst) for up in (True, False)} \
            if self.rate_bps else {}
        self.listen = listen
        self.stats = LinkStats()
        self.port: Optional[int] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._server: Optional[asyncio.base_events.Server] = None
        self._thread: Optional[threading.Thread] = None
        self._ready = threading.Event()
        self._tasks: set = set()

    @property
    def rtt_ms(self) -> float:
        return (self.up_s + self.down_s) * 1000.0

    @property
    def url(self) -> str:
        return f"http://{self.listen[0]}:{self.port}"

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float,
                    up: bool) -> None:
        """Read from ``reader``; write each chunk to ``writer`` at its arrival + ``delay_s``."""
        loop = asyncio.get_running_loop()
        queue: collections.deque = collections.deque()
        arrived = asyncio.Event()
        bucket = self._buckets.get(up)  # the link's, shared with the other connections

        async def read():
            try:
                while True:
                    data = await reader.read(CHUNK)
                    queue.append((loop.time() + delay_s, data))  # b"": EOF, released after the delay too
                    arrived.set()
                    if not data:
                        return
            except (ConnectionError, OSError):
                queue.append((loop.time() + delay_s, None))  # a reset: close at once after the delay
                arrived.set()

        reading = asyncio.ensure_future(read())
        try:
            while True:
                while not queue:
                    arrived.clear()
                    await arrived.wait()
                due, data = queue.popleft()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if data is None:
                    break
                if not data:  # EOF: half-close the other side's write direction
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                if bucket is not None:
                    pause = bucket.wait(len(data))
                    if pause > 0:
                        await asyncio.sleep(pause)
                if up:  # counted before it is written: whoever has the bytes sees them counted
                    self.stats.bytes_up += len(data)
                else:
                    self.stats.bytes_down += len(data)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            reading.cancel()
        writer.close()  # a reset or a failed write: both ends go

    async def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        self.stats.connections += 1
        try:
            s_reader, s_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            c_writer.close()
            return
        _nodelay(c_writer)
        _nodelay(s_writer)
        try:
            await asyncio.gather(self._pump(c_reader, s_writer, self.up_s, True),
                                 self._pump(s_reader, c_writer, self.down_s, False))
        finally:
            for w in (c_writer, s_writer):
                w.close()

    def _spawn(self, reader, writer):
        task = asyncio.ensure_future(self._handle(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def serve(self) -> None:
        """Listen and relay until cancelled (or :meth:`stop`)."""
        self._loop = asyncio.get_running_loop()
        self._server = await asyncio.start_server(self._spawn, *self.listen, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        async with self._server:
            try:
                await self._server.serve_forever()
            except asyncio.CancelledError:
                pass
            finally:
                for t in list(self._tasks):
                    t.cancel()

    def start(self) -> "DelayRelay":
        """Run the relay in a daemon thread; returns once it listens (``self.port``)."""
        self._thread = threading.Thread(target=lambda: asyncio.run(self.serve()), name="delay-relay", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the relay did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)
            for t in list(self._tasks):
                self._loop.call_soon_threadsafe(t.cancel)
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None

    def __enter__(self) -> "DelayRelay":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def relay_process(upstream_url: str, rtt_ms: float, rate_mbps: Optional[float] = None, **kwargs):
    """A :class:`splitlearn.procs.localserver.ChildServer` running ``python -m splitlearn.netem.relay``
    to the HTTP server at ``upstream_url`` on a free port; ready when ``/v1/health`` answers
    through it. Its ``url`` is what the client connects to."""
    from ..procs.localserver import ChildServer, free_port

    host, port = parse_hostport(upstream_url.split("://", 1)[-1].rstrip("/"))
    listen = free_port()
    cmd = [sys.executable, "-m", "splitlearn.netem.relay", "--listen", f"127.0.0.1:{listen}",
           "--upstream", f"{host}:{port}", "--rtt-ms", str(rtt_ms)]
    if rate_mbps:
        cmd += ["--rate-mbps", str(rate_mbps)]
    return ChildServer(cmd, listen, **kwargs)


RelayProcess = relay_process


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m splitlearn.netem.relay", description=__doc__.splitlines()[0])
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to accept clients on")
    p.add_argument("--upstream", required=True, help="HOST:PORT of the server")
    p.add_argument("--rtt-ms", type=float, default=0.0, help="added round trip (half each way)")
    p.add_argument("--up-ms", type=float, help="one-way delay client -> server (overrides half the RTT)")
    p.add_argument("--down-ms", type=float, help="one-way delay server -> client")
    p.add_argument("--rate-mbps", type=float, help="token-bucket rate per direction (default: none)")
    p.add_argument("--burst-bytes", type=int, default=64 * 1024)
    a = p.parse_args(argv)
    relay = DelayRelay(parse_hostport(a.upstream), rtt_ms=a.rtt_ms, up_ms=a.up_ms, down_ms=a.down_ms,
                       rate_mbps=a.rate_mbps, burst_bytes=a.burst_bytes, listen=parse_hostport(a.listen))
    try:
        asyncio.run(relay.serve())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
