"""``python -m splitlearn.server``: the command line, and serving the app with waitress.

Why waitress: it is a production WSGI server in pure Python that runs in this process (one
model copy, shared by its worker threads), keeps connections alive and sets TCP_NODELAY by
default. It is set up by :mod:`.frontdoor`: request and response bodies stay in memory,
a request without a valid token is refused at its headers (before its body is read), slow
senders and clients that do not read their answers are cut off, and waitress's own error
answers are the same JSON ``{"error", "message"}`` as every other error (docs/INTERNALS.md).
A token generated for a run goes to a 0600 file, never to the log.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path
from typing import Optional

from ..errors import ConfigError, SplitLearnError
from ..lora import LoraSpec
from .tenants import read_token_file
from .config import ServerConfig
from .strategy import DEFAULT_MAX_MEMBER_SHARE, DEFAULT_MAX_UPDATE_NORM
from .tickets import read_secret_file


def parse_args(argv=None) -> ServerConfig:
    p = argparse.ArgumentParser(prog="python -m splitlearn.server", allow_abbrev=False,
                                description="serve one segment of a GPT-2 over HTTP")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="model source: hub id, local dir, JSON config or spec name (see models/)")
    src.add_argument("--segment", help="an exported segment (out_dir/trunk.json) to serve alone")
    p.add_argument("--cut", type=int, action="append", default=[], dest="cuts",
                   help="block index to cut at; once for 2-way (server holds the top), twice for U-shape")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="seed of random inits (must match the client's)")
    p.add_argument("--token-file", help="the tenants' bearer tokens, one per line: '<token>', '<name> <token>' "
                                        "or '<name> <token> operator' (default: $SPLITLEARN_TOKEN, "
                                        "comma-separated; see docs/SECURITY.md)")
    p.add_argument("--checkpoint-dir", help="save segment + optimizer state here periodically and on SIGTERM")
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
    p.add_argument("--state-dir", help="replicas (docs/CLUSTER.md): keep each client's LoRA adapter, optimizer "
                                       "and step record here, shared by the replicas, saved every "
                                       "--checkpoint-every steps of that client (needs --lora-r)")
    p.add_argument("--max-body-mb", type=float, default=256.0, help="larger request bodies get 413")
    p.add_argument("--max-echo-mb", type=float, default=4.0, help="larger POST /v1/echo bodies get 413")
    p.add_argument("--max-connections", type=int, default=256, help="open connections at once")
    p.add_argument("--request-timeout", type=float, default=10.0,
                   help="seconds for a request's headers; its body, and the reading of an answer, get "
                        "this plus their size at --min-rate-kib (docs: splitlearn/server/frontdoor.py)")
    p.add_argument("--min-rate-kib", type=float, default=256.0,
                   help="KiB/s a body must arrive at, and an answer be read at, on average")
    p.add_argument("--idle-timeout", type=float, default=300.0,
                   help="seconds an authenticated keep-alive connection may idle")
    p.add_argument("--token-out", help="where to write a generated token, mode 0600 (without --token-file "
                                       "and $SPLITLEARN_TOKEN; default <checkpoint-dir or .>/splitlearn-token)")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--max-request-memory-gb", type=float, default=None,
                   help="memory one request may cost (GiB; 413 beyond, before allocating); default: half "
                        "of the memory free at start less the training state (splitlearn/server/budget.py)")
    p.add_argument("--max-memory-gb", type=float, default=None,
                   help="memory (GiB) the server may hold for its tenants in all: request bodies and "
                        "prices, waiting graphs, stored answers, generation caches (503 beyond); "
                        "default: twice --max-request-memory-gb (splitlearn/server/memory.py)")
    p.add_argument("--max-tenant-memory-gb", type=float, default=None,
                   help="what one tenant may hold of it (429 beyond); default: all with one tenant, "
                        "else --max-request-memory-gb")
    p.add_argument("--threads", type=int, default=16, help="WSGI threads; >= concurrent clients so decode steps batch")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="intra-op threads for the segment (default: torch's, one per core)")
    p.add_argument("--no-batching", action="store_true",
                   help="run concurrent sessions' decode steps one at a time (for comparison)")
    p.add_argument("--priority", default="decode-first", choices=["decode-first", "fifo"],
                   help="decode-first: a training step yields to queued decode steps between its linear "
                        "layers (forward and backward); fifo: arrival order (splitlearn/server/priority.py)")
    p.add_argument("--decode-rows", type=int, default=ServerConfig.decode_rows,
                   help="rows of one decode batch at most, taken from the tenants' queued steps in turn "
                        "(the rest wait for the next batch; splitlearn/server/priority.py)")
    p.add_argument("--decode-share", type=float, default=ServerConfig.decode_share,
                   help="decode-first: seconds of decode per second of training that a training step's "
                        "preemption points may run (bounds how much decode steps slow a training step)")
    p.add_argument("--batch-wait-ms", type=float, default=5.0,
                   help="how long a decode batch may wait for the sessions of the previous batch "
                        "still on their way (0: never wait; see splitlearn/server/batching.py)")
    p.add_argument("--no-packed-weights", action="store_true",
                   help="decode on the layers' own matrix products, not on oneDNN prepacked copies of "
                        "the weights (which are faster for a few rows and cost a second copy in memory)")
    p.add_argument("--poll-idle", action="store_true",
                   help="keep this server's cores polling instead of sleeping between requests (Linux; "
                        "lower latency per step for the cores' idle time: splitlearn/idlepoll.py)")
    p.add_argument("--session-ttl", type=float, default=300.0, help="idle seconds before a session expires")
    p.add_argument("--max-sessions", type=int, default=64)
    p.add_argument("--max-tokens-per-client", type=int, default=65536,
                   help="cached generation tokens (rows x length) per tenant, over its sessions")
    p.add_argument("--max-sessions-per-tenant", type=int, default=16,
                   help="open generation sessions per tenant (--max-sessions is the server's total)")
    p.add_argument("--max-clients-per-tenant", type=int, default=64,
                   help="client ids one tenant may train with (each holds server state)")
    p.add_argument("--max-pending-per-tenant", type=int, default=8,
                   help="training steps one tenant may have in flight at once")
    p.add_argument("--allow-weak-tokens", action="store_true",
                   help="accept tokens shorter than 16 characters or the docs' examples (never in production)")
    p.add_argument("--federation", default="shared", choices=["shared", "sequential", "splitfed"],
                   help="how several data owners share the model (docs/FEDERATION.md)")
    p.add_argument("--clients-per-round", type=int, default=2, help="splitfed: syncs that close a round")
    p.add_argument("--round-timeout", type=float, default=300.0,
                   help="seconds a splitfed round waits for its syncs, or a sequential turn may idle")
    p.add_argument("--lease-timeout", type=float, default=60.0,
                   help="seconds a U-shape forward holds the segment waiting for its backward")
    p.add_argument("--client-weights", default="server", choices=["server", "external"],
                   help="external: clients share their client-side weights through a separate fed "
                        "server (python -m splitlearn.server.fedavg); this one never sees them")
    p.add_argument("--max-grad-norm", type=float, default=None, help="clip the server's gradient norm per step")
    p.add_argument("--aggregation", default="fedavg", choices=["fedavg", "median", "trimmed-mean"],
                   help="how a splitfed round's updates combine: sample-weighted mean, or the coordinate-wise "
                        "median / trimmed mean (robust to a few bad members; docs/FEDERATION.md)")
    p.add_argument("--max-update-norm", type=_norm, default=DEFAULT_MAX_UPDATE_NORM,
                   help=f"bound on the L2 norm of one member's update per round or turn, around the shared "
                        f"weights ('none': unbounded; default {DEFAULT_MAX_UPDATE_NORM:g}, docs/FEDERATION.md)")
    p.add_argument("--trim-beta", type=float, default=0.2,
                   help="--aggregation trimmed-mean: fraction of the members dropped at each end, per coordinate")
    p.add_argument("--max-member-share", type=float, default=DEFAULT_MAX_MEMBER_SHARE,
                   help=f"largest fraction of a splitfed round's FedAvg weight (target tokens trained) one member "
                        f"may hold (1: no cap; default {DEFAULT_MAX_MEMBER_SHARE:g}, docs/FEDERATION.md)")
    p.add_argument("--fed-secret-file", help="--client-weights external: file with the secret shared with the fed "
                                             "server (>= 32 bytes), which signs each member's ticket")
    p.add_argument("--fed-store", default=None, metavar="HOST:PORT",
                   help="splitfed across replicas: the TCPStore where they meet (python -m splitlearn.cluster "
                        "sets it; docs/CLUSTER.md); rounds close with a torch.distributed gloo collective")
    p.add_argument("--fed-rank", type=int, default=0, help="--fed-store: this replica's index, 0..R-1")
    p.add_argument("--fed-world-size", type=int, default=1, help="--fed-store: the number of replicas R")
    p.add_argument("--fed-timeout", type=float, default=60.0,
                   help="--fed-store: seconds a round's collective close (or the group's forming) waits for a replica")
    p.add_argument("--lora-r", type=int, default=None,
                   help="train per-client LoRA adapters of this rank on a frozen segment (docs/LORA.md)")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA scale alpha/r (default: 2r)")
    p.add_argument("--lora-targets", default="c_attn", help="comma-separated: c_attn, c_proj, c_fc")
    p.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the adapters' input")
    p.add_argument("--offload", action="store_true",
                   help="serve the linear layers of --model's blocks and LM head as products on one-time-"
                        "padded inputs (no --cut; client: splitlearn.OffloadGPT2LMHeadModel; docs/OFFLOAD.md)")
    p.add_argument("--offload-plain", action="store_true",
                   help="--offload: also answer unmasked float32 products (the benchmark's baseline)")
    p.add_argument("--offload-record", metavar="DIR",
                   help="test hook (needs SPLITLEARN_TEST_HOOKS=1): save every offload input to DIR")
    p.add_argument("--offload-tamper", type=int, default=0, metavar="N",
                   help="test hook (needs SPLITLEARN_TEST_HOOKS=1): alter every answer from the N-th product on")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="json: every log line one JSON object, with one access line per request "
                        "(request id, tenant, route, status, bytes, ms; docs/OPERATIONS.md)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="also serve Prometheus metrics on 127.0.0.1:PORT without a token (GET /metrics "
                        "on --port needs the operator's token; docs/OPERATIONS.md)")
    p.add_argument("--no-request-log", action="store_true",
                   help="neither count requests in the metrics nor log access lines (for comparison)")
    a = p.parse_args(argv)
    from .accesslog import configure as configure_logging
    configure_logging(a.log_level, a.log_format)
    return ServerConfig(
        model=a.model, segment=a.segment, cuts=tuple(a.cuts), host=a.host, port=a.port,
        device=a.device, dtype=a.dtype, optimizer=a.optimizer, lr=a.lr, weight_decay=a.weight_decay,
        seed=a.seed, tokens=read_token_file(a.token_file) if a.token_file else (),
        checkpoint_dir=a.checkpoint_dir, checkpoint_every=a.checkpoint_every, state_dir=a.state_dir,
        max_body_bytes=int(a.max_body_mb * (1 << 20)), max_batch=a.max_batch, threads=a.threads,
        max_echo_bytes=int(a.max_echo_mb * (1 << 20)), max_connections=a.max_connections,
        request_timeout_s=a.request_timeout, min_rate_kib_s=a.min_rate_kib, idle_timeout_s=a.idle_timeout,
        token_out=a.token_out,
        max_request_memory_bytes=None if a.max_request_memory_gb is None else int(a.max_request_memory_gb * (1 << 30)),
        max_memory_bytes=None if a.max_memory_gb is None else int(a.max_memory_gb * (1 << 30)),
        max_tenant_memory_bytes=None if a.max_tenant_memory_gb is None else int(a.max_tenant_memory_gb * (1 << 30)),
        torch_threads=a.torch_threads, batching=not a.no_batching,
        batch_wait_ms=a.batch_wait_ms, priority=a.priority, poll_idle=a.poll_idle,
        decode_rows=a.decode_rows, decode_share=a.decode_share,
        packed_weights=not a.no_packed_weights, session_ttl_s=a.session_ttl,
        max_sessions=a.max_sessions, max_tokens_per_client=a.max_tokens_per_client,
        max_sessions_per_tenant=a.max_sessions_per_tenant, max_clients_per_tenant=a.max_clients_per_tenant,
        max_pending_per_tenant=a.max_pending_per_tenant, allow_weak_tokens=a.allow_weak_tokens,
        federation=a.federation, clients_per_round=a.clients_per_round, round_timeout_s=a.round_timeout,
        lease_timeout_s=a.lease_timeout, max_grad_norm=a.max_grad_norm, client_weights=a.client_weights, lora=_lora_spec(a),
        aggregation=a.aggregation, max_update_norm=a.max_update_norm, trim_beta=a.trim_beta,
        max_member_share=a.max_member_share,
        fed_secret=read_secret_file(a.fed_secret_file) if a.fed_secret_file else None,
        fed_store=a.fed_store, fed_rank=a.fed_rank, fed_world_size=a.fed_world_size, fed_timeout_s=a.fed_timeout,
        offload=a.offload, offload_plain=a.offload_plain, offload_record=a.offload_record,
        offload_tamper=a.offload_tamper, log_format=a.log_format, metrics_port=a.metrics_port,
        request_log=not a.no_request_log)


def _norm(text: str) -> Optional[float]:
    """``--max-update-norm``: a number, or ``none`` for no bound."""
    return None if text.strip().lower() == "none" else float(text)


def _lora_spec(a) -> Optional[LoraSpec]:
    """``--lora-*`` as a :class:`LoraSpec` (ConfigError if invalid); None without ``--lora-r``."""
    if a.lora_r is None:
        if a.lora_alpha is not None or a.lora_targets != "c_attn" or a.lora_dropout:
            raise ConfigError("--lora-alpha, --lora-targets and --lora-dropout need --lora-r")
        return None
    alpha = 2.0 * a.lora_r if a.lora_alpha is None else a.lora_alpha
    return LoraSpec(a.lora_r, alpha, a.lora_targets, a.lora_dropout)


def write_generated_token(cfg: ServerConfig) -> Path:
    """Write the token made up for this run to a new file only its owner can read; its path.

    The token itself never goes to the log (logs are collected, shipped and kept)."""
    from ..checkpoint import open_private, private_dir

    path = Path(cfg.token_out or Path(cfg.checkpoint_dir or ".") / "splitlearn-token")
    try:
        private_dir(path.parent)
        with open_private(path) as f:
            f.write(cfg.tokens[0].encode() + b"\n")
    except OSError as e:
        raise ConfigError(f"no token given, and the one generated cannot be written to {path}: {e}; "
                          f"give --token-out PATH, --token-file or $SPLITLEARN_TOKEN") from None
    return path.resolve()


def serve(cfg: ServerConfig) -> None:
    """Build the app and serve it until SIGTERM/SIGINT, checkpointing on the way out."""
    from ..idlepoll import IdlePoller
    from .app import create_app
    from .frontdoor import make_server

    app = create_app(cfg)
    rt = app.extensions["splitlearn"]
    server = make_server(app, cfg.tenants, host=cfg.host, port=cfg.port, threads=cfg.threads,
                         max_body_bytes=cfg.max_body_bytes, limits=cfg.door_limits())

    poller = IdlePoller().start() if cfg.poll_idle else None
    scrape = app.extensions["splitlearn.metrics"].serve_loopback(cfg.metrics_port) if cfg.metrics_port else None

    def stop(signum, _frame):
        logging.getLogger(__name__).info("signal %d: checkpointing and stopping", signum)
        if poller is not None:
            poller.stop()
        if scrape is not None:
            scrape.shutdown()
        rt.compute.run(rt.checkpoint)
        server.close()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    if cfg.generated_token:
        path = write_generated_token(cfg)
        print(f"no token given: generated one for this run, written to {path} (mode 0600); "
              f"clients: --token-file {path}", file=sys.stderr)
    if cfg.offload:
        what = f"masked offload of {len(rt.layers)} linear layers of {cfg.model} on cpu"
    else:
        seg = rt.segment
        what = f"{seg.kind} blocks [{seg.start}, {seg.end}) on {rt.device}"
    print(f"splitlearn server: {what} at http://{cfg.host}:{cfg.port} (ready)", file=sys.stderr, flush=True)
    server.run()


def main(argv=None) -> int:
    try:
        cfg = parse_args(argv)
        serve(cfg)
    except SplitLearnError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0

