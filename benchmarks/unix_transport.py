"""The unix:// transport against HTTP on loopback, side by side (issue 32).

One server process serves the same app on a TCP port and on a Unix socket
(``--listen unix:///...``); the client alternates between the two transports in rounds, so
both see the same machine load (interleaved, not one after the other):

- ``decode step overhead``: a U-shape decode step of batch 1 (1 x 1 x d float32 out and back),
  the client's round trip (encode, send, answer, decode) minus the compute the server reports
  (``X-Server-Time-Ms``): what the transport costs per call (target: <= 0.15 ms on unix, against
  ~0.9 ms on TCP loopback);
- ``round trip 1 MB`` / ``10 MB``: a float32 tensor of that size encoded, sent to ``POST
  /v1/echo``, its answer decoded (targets: <= 1 ms and <= 3 ms on unix).

Value: the median over all rounds, milliseconds. ``--cores 0,1`` pins the client and the
server to the same cores (the issue's "same cores"); ``--pinned`` puts the server on core 1 and
the client on core 0 (two devices emulated: a lane then polls for its answer). Run::

    .venv/bin/python -m benchmarks.unix_transport [--calls 300] [--rounds 5] [--model tiny] [--cores 0,1]

``--device cuda``: the server on the GPU and the client's tensors there; unix:// then carries
them through its device region (CUDA memory both processes map), TCP through host memory.

``--floor`` adds, interleaved with unix://'s decode steps, what bounds that overhead from below:
``frames`` (the same decode step sent by a bare client: one frame built ahead, one ``sendall``,
one ``recv``, no Transport, no encoding or decoding; what is left is the server's door and the
two wake-ups) and ``sockets`` (a bare Python Unix-socket ping-pong of the same size with a child
process: the wake-ups alone).

Prints one JSON row per (case, transport) and the unix/tcp ratio of the medians. ``--generate
gpt2`` adds greedy batch-1 generation by the unsplit model and the U-shape split model over each
transport (tokens/s, and split/unsplit per round: the issue's ">= 0.95x").
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from splitlearn.api import protocol as P
from splitlearn.procs.localserver import LocalServer
from splitlearn.transport import Transport, TransportConfig
from splitlearn.api.wire import Encoded, pack


def decode_overheads(t: Transport, d: int, calls: int, seed: int = 0, device: str = "cpu") -> list[float]:
    """Seconds beyond the server's compute of ``calls`` batch-1 decode steps (one session; the
    prefill step is not counted)."""
    sid = t.post_json(P.SESSIONS, {"rows": 1})["session_id"]
    path = P.SESSION_STEP.format(session_id=sid)
    g = torch.Generator().manual_seed(seed)
    out = []
    try:
        for pos in range(calls + 1):
            tensors = {**pack(P.HIDDEN, torch.randn(1, 1, d, generator=g).to(device), "float32"),
                       P.MASK: torch.ones(1, 1, dtype=torch.long, device=device)}
            before = t.stats.server_compute_s
            t0 = time.perf_counter()  # as the model classes call it: encode, send, answer, decode
            t.call(path, tensors, P.SessionStepMeta(pos, "float32").to_meta())
            out.append(time.perf_counter() - t0 - (t.stats.server_compute_s - before))
    finally:
        t.delete(P.SESSION.format(session_id=sid))
    return out[1:]


def echo_round_trips(t: Transport, nbytes: int, calls: int, device: str = "cpu") -> list[float]:
    """Seconds of ``calls`` round trips of one float32 tensor of ``nbytes`` through ``/v1/echo``
    as a client's tensor call makes them (``Transport.call``): encode, send, the server reads
    the body and writes it back, the answer decoded into a tensor of the client's own."""
    x = torch.randn(nbytes // 4, device=device)
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        back = t.call(P.ECHO, {"x": x})
        out.append(time.perf_counter() - t0)
        assert back["x"].numel() == x.numel()
    return out


def bare_frame_overheads(socket_path: str, token: str, t: Transport, d: int, calls: int, seed: int = 0) -> list[float]:
    """:func:`decode_overheads` by a bare client: each request's frame is built before the
    clock starts, then one ``sendall`` and ``recv`` until the answer is whole (not decoded),
    minus the server's ``X-Server-Time-Ms`` (``--floor``)."""
    import socket as socketlib

    from splitlearn.transport import unixframe as F
    from splitlearn.api.wire import encode

    sid = t.post_json(P.SESSIONS, {"rows": 1})["session_id"]
    path = P.SESSION_STEP.format(session_id=sid)
    g = torch.Generator().manual_seed(seed)
    headers = {"Authorization": f"Bearer {token}", "Content-Type": P.CONTENT_TYPE}
    sock = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    sock.connect(socket_path)
    out = []
    try:
        for pos in range(calls + 1):
            body = encode({P.HIDDEN: torch.randn(1, 1, d, generator=g), P.MASK: torch.ones(1, 1, dtype=torch.long)},
                          P.SessionStepMeta(pos, "float32").to_meta())
            frame = F.pack(F.REQUEST, {"method": "POST", "path": path, "headers": headers}, len(body)) + body
            t0 = time.perf_counter()
            sock.sendall(frame)
            buf = sock.recv(1 << 16)
            while len(buf) < F.HEADER.size or len(buf) < F.HEADER.size + sum(F.HEADER.unpack_from(buf)[4:]):
                buf += sock.recv(1 << 16)
            elapsed = time.perf_counter() - t0
            _, _, _, _, meta_len, _ = F.HEADER.unpack_from(buf)
            meta = json.loads(buf[F.HEADER.size:F.HEADER.size + meta_len])
            if meta["status"] != 200:
                raise RuntimeError(f"bare frame answered {meta['status']}")
            out.append(elapsed - float(dict(meta["headers"])[P.SERVER_TIME_HEADER]) / 1e3)
    finally:
        sock.close()
        t.delete(P.SESSION.format(session_id=sid))
    return out[1:]


_ECHO_CHILD = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
while True:
    data = s.recv(1 << 16)
    if not data:
        break
    s.sendall(data)
"""


def socket_ping_pongs(nbytes: int, calls: int) -> list[float]:
    """Round trips of ``nbytes`` between this process and a child that sends them back, plain
    Python sockets on a Unix socket (``--floor``: the wake-ups a call cannot avoid)."""
    import socket as socketlib
    import subprocess
    import sys

    where = os.path.join(tempfile.mkdtemp(prefix="sl-pingpong-"), "p.sock")
    listener = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    listener.bind(where)
    listener.listen(1)
    child = subprocess.Popen([sys.executable, "-c", _ECHO_CHILD, where])
    conn, _ = listener.accept()
    msg, out = b"x" * nbytes, []
    try:
        for _ in range(calls + 1):
            t0 = time.perf_counter()
            conn.sendall(msg)
            got = 0
            while got < nbytes:
                got += len(conn.recv(1 << 16))
            out.append(time.perf_counter() - t0)
    finally:
        conn.close()
        listener.close()
        child.wait(timeout=10)
        os.unlink(where)
    return out[1:]


def cases(d: int, calls: int, device: str = "cpu") -> dict:
    return {"decode step overhead": lambda t: decode_overheads(t, d, calls, device=device),
            "round trip 1 MB": lambda t: echo_round_trips(t, 1 << 20, max(6, calls // 10), device),
            "round trip 10 MB": lambda t: echo_round_trips(t, 10 << 20, max(6, calls // 30), device)}


def measure(tcp_url: str, unix_url: str, token: str, d: int, calls: int, rounds: int,
            device: str = "cpu", floor: bool = False) -> list[dict]:
    """Rows of medians (ms), both transports, interleaved ``rounds`` times (``floor``: the
    decode step's bare frames and bare sockets too, see the module docstring)."""
    ts = {"tcp": Transport(TransportConfig(tcp_url, token)), "unix": Transport(TransportConfig(unix_url, token))}
    samples: dict = {}
    try:
        for name, fn in cases(d, calls, device).items():
            for t in ts.values():
                fn(t)  # warm-up: connections, regions, allocator
            for _ in range(rounds):
                for kind, t in ts.items():
                    # the first call of a round is not counted: it pays for the other transport's
                    # round before it (10 MB: the heap the TCP round gave back to the kernel)
                    samples.setdefault((name, kind), []).extend(fn(t)[1:])
        if floor:
            path, t = unix_url[len("unix://"):], ts["unix"]
            size = len(bytes(Encoded({P.HIDDEN: torch.zeros(1, 1, d), P.MASK: torch.ones(1, 1, dtype=torch.long)})))
            kinds = {"unix": lambda: decode_overheads(t, d, calls),
                     "frames": lambda: bare_frame_overheads(path, token, t, d, calls),
                     "sockets": lambda: socket_ping_pongs(size, calls)}
            for _ in range(rounds):
                for kind, fn in kinds.items():
                    samples.setdefault(("decode step floor", kind), []).extend(fn()[1:])
    finally:
        for t in ts.values():
            t.close()
    rows = []
    for (name, kind), s in samples.items():
        ms = sorted(1e3 * v for v in s)
        rows.append({"case": name, "transport": kind, "median_ms": round(statistics.median(ms), 4),
                     "p10_ms": round(ms[len(ms) // 10], 4), "p90_ms": round(ms[(9 * len(ms)) // 10], 4),
                     "calls": len(ms)})
    return rows


def ratios(rows: list[dict]) -> dict:
    by = {(r["case"], r["transport"]): r["median_ms"] for r in rows}
    return {case: round(by[(case, "unix")] / by[(case, "tcp")], 3) for case, kind in by
            if kind == "unix" and (case, "tcp") in by}


def generation(tcp_url: str, unix_url: str, token: str, model_name: str, seed: int, new_tokens: int,
               prompt_len: int, rounds: int, device: str = "cpu") -> list[dict]:
    """Greedy batch-1 generation (transformers' ``generate``) by the unsplit model and by the split
    model over each transport, interleaved ``rounds`` times: tokens/s medians and the ratio of
    each split run to the unsplit run of its round (the issue's ">= 0.95x the unsplit model")."""
    import splitlearn
    from splitlearn import load_model

    from .generation import hf_generate

    unsplit = load_model(model_name, dtype="float32", device=device, seed=seed).eval()
    systems = {"unsplit": unsplit}
    for kind, url in (("tcp", tcp_url), ("unix", unix_url)):
        systems[kind] = splitlearn.SplitGPT2LMHeadModel.from_pretrained(model_name, server=url, token=token,
                                                                        seed=seed).to(device).eval()
    ids = torch.randint(0, unsplit.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(seed))
    ids = ids.to(device)
    times: dict = {k: [] for k in systems}
    with torch.no_grad():
        ref = hf_generate(unsplit, ids, new_tokens)
        same = {k: bool(torch.equal(hf_generate(m, ids, new_tokens), ref)) for k, m in systems.items()}  # + warm-up
        order = list(systems)
        for r in range(rounds):
            for k in order[r % 3:] + order[:r % 3]:
                t0 = time.perf_counter()
                hf_generate(systems[k], ids, new_tokens)
                times[k].append(time.perf_counter() - t0)
    for k, m in systems.items():
        if k != "unsplit":
            m.remote.close()
    return [{"case": f"greedy b1, {new_tokens} tokens ({model_name})", "transport": k,
             "tokens_per_s": round(new_tokens / statistics.median(ts), 2),
             "over_unsplit": round(statistics.median(u / t for u, t in zip(times["unsplit"], ts)), 3),
             "same_tokens": same[k], "runs": len(ts)} for k, ts in times.items()]


# seed 001: a client and the process owning the accelerator, over an RPC bridge: 1,024 tokens in
# 44.25 s, 98 calls at 332 ms each, 3,328 MB sent and 3,657 MB received (docs/TRANSPORT.md)
SEED_001 = {"seconds": 44.25, "calls": 98, "ms_per_call": 332, "mb_sent": 3328, "mb_received": 3657}


def seed_workload(tcp_url: str, unix_url: str, token: str, model_name: str, seed: int, tokens: int = 1024,
                  prompt_len: int = 24, device: str = "cpu") -> list[dict]:
    """Seed 001's workload on this transport: ``tokens`` positions in all, a ``prompt_len``
    prompt then greedy generation to ``tokens`` (U-shape, batch 1), once per system (unsplit,
    TCP, unix), with the calls and bytes each split run moved (its Transport's statistics); and
    the ``tokens``-long prompt alone as one forward (the seed's prefill)."""
    import splitlearn
    from splitlearn import load_model

    from .generation import hf_generate

    unsplit = load_model(model_name, dtype="float32", device=device, seed=seed).eval()
    systems = {"unsplit": unsplit}
    for kind, url in (("tcp", tcp_url), ("unix", unix_url)):
        systems[kind] = splitlearn.SplitGPT2LMHeadModel.from_pretrained(model_name, server=url, token=token,
                                                                        seed=seed).to(device).eval()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, unsplit.config.vocab_size, (1, prompt_len), generator=g).to(device)
    long_ids = torch.randint(0, unsplit.config.vocab_size, (1, tokens), generator=g).to(device)
    rows, ref = [], None
    with torch.no_grad():
        for kind, m in systems.items():
            hf_generate(m, ids, 2)  # warm-up: connections, regions, allocator
            stats = getattr(getattr(m, "remote", None), "transport", None)
            stats = stats.stats if stats is not None else None
            before = (stats.calls, stats.bytes_sent, stats.bytes_received) if stats else (0, 0, 0)
            t0 = time.perf_counter()
            out = hf_generate(m, ids, tokens - prompt_len)
            gen_s = time.perf_counter() - t0
            ref = out if ref is None else ref
            t0 = time.perf_counter()
            m(long_ids)
            if device == "cuda":
                torch.cuda.synchronize()
            prefill_s = time.perf_counter() - t0
            after = (stats.calls, stats.bytes_sent, stats.bytes_received) if stats else (0, 0, 0)
            calls, sent, received = (a - b for a, b in zip(after, before))
            rows.append({"case": f"seed 001: {tokens} tokens ({prompt_len} prompt + {tokens - prompt_len} generated, "
                                 f"then a {tokens}-token prefill; {model_name})", "transport": kind,
                         "generate_s": round(gen_s, 2), "prefill_s": round(prefill_s, 3),
                         "calls": calls, "mb_sent": round(sent / 2**20, 1), "mb_received": round(received / 2**20, 1),
                         "ms_per_call": round(1e3 * gen_s / max(calls, 1), 2) if calls else None,
                         "same_tokens": bool(torch.equal(out, ref)), "seed_001": SEED_001})
    for kind, m in systems.items():
        if kind != "unsplit":
            m.remote.close()
    return rows


def main(argv=None) -> int:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--model", default="tiny")
    a.add_argument("--cuts", default="1,3")
    a.add_argument("--calls", type=int, default=300)
    a.add_argument("--only-generate", action="store_true", help="skip the transport cases (with --generate or --seed-workload)")
    a.add_argument("--pinned", action="store_true", help="two devices emulated: the server on core 1, "
                                                         "the client on core 0 (transport cases and --generate)")
    a.add_argument("--rounds", type=int, default=5)
    a.add_argument("--cores", default=None, help="pin client and server to these cores, e.g. 0,1")
    a.add_argument("--floor", action="store_true", help="also the decode step by a bare frame client and a bare "
                                                        "socket ping-pong, interleaved with unix:// (see above)")
    a.add_argument("--generate", default=None, metavar="MODEL",
                   help="also greedy batch-1 generation, unsplit and split over each transport, on a "
                        "second server of MODEL (e.g. gpt2) cut at --generate-cuts")
    a.add_argument("--generate-cuts", default="2,10")
    a.add_argument("--new-tokens", type=int, default=32)
    a.add_argument("--seed-workload", default=None, metavar="MODEL",
                   help="seed 001's 1,024 tokens on MODEL (e.g. random:gpt2), U-shape --generate-cuts, each system once")
    a.add_argument("--seed-tokens", type=int, default=1024, help="positions of the seed workload (its 1,024)")
    a.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: the server computes on the GPU and the client's tensors live there "
                        "(unix:// then crosses through its device region)")
    args = a.parse_args(argv)
    env = {"OMP_NUM_THREADS": "1"}
    if args.cores:
        cores = {int(c) for c in args.cores.split(",")}
        os.sched_setaffinity(0, cores)  # the server inherits it
    path = os.path.join(tempfile.mkdtemp(prefix="sl-bench-"), "server.sock")
    flags = ["--model", args.model, "--threads", "4", "--max-echo-mb", "16", "--listen", "unix://" + path,
             "--device", args.device]
    for c in args.cuts.split(","):
        flags += ["--cut", c]
    torch.set_num_threads(1)
    if not args.only_generate:
        if args.pinned:
            os.sched_setaffinity(0, {1})  # the server inherits it
        with LocalServer(flags, env=env) as srv:
            if args.pinned:
                os.sched_setaffinity(0, {0})
            d = Transport(TransportConfig(srv.url, srv.token)).get_json(P.INFO)["model_config"]["n_embd"]
            calls = min(args.calls, 60) if args.model == "tiny" else args.calls  # tiny: n_positions 64
            rows = measure(srv.url, "unix://" + path, srv.token, d, calls, args.rounds, args.device, args.floor)
        for r in rows:
            print(json.dumps(r))
        print(json.dumps({"unix/tcp": ratios(rows)}), flush=True)
    if args.seed_workload:
        spath = os.path.join(os.path.dirname(path), "seed.sock")
        sflags = ["--model", args.seed_workload, "--threads", "4", "--seed", "0", "--torch-threads", "1",
                  "--listen", "unix://" + spath, "--device", args.device]
        for c in args.generate_cuts.split(","):
            sflags += ["--cut", c]
        with LocalServer(sflags, env=env) as srv:
            for r in seed_workload(srv.url, "unix://" + spath, srv.token, args.seed_workload, 0, args.seed_tokens,
                                   device=args.device):
                print(json.dumps(r), flush=True)
    if args.generate:
        gpath = os.path.join(os.path.dirname(path), "gen.sock")
        gflags = ["--model", args.generate, "--threads", "4", "--seed", "0", "--torch-threads", "1",
                  "--listen", "unix://" + gpath, "--device", args.device]  # one torch thread each side: two cores, shared
        for c in args.generate_cuts.split(","):
            gflags += ["--cut", c]
        if args.pinned:  # two devices emulated: the server on core 1, the client (and the unsplit model) on core 0
            os.sched_setaffinity(0, {1})
        with LocalServer(gflags, env=env) as srv:
            if args.pinned:
                os.sched_setaffinity(0, {0})
            for r in generation(srv.url, "unix://" + gpath, srv.token, args.generate, 0, args.new_tokens, 8,
                                args.rounds, args.device):
                print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
