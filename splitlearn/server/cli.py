"""``python -m splitlearn.server``: the command line, and serving the app with waitress.

Why waitress: it is a production WSGI server in pure Python that runs in this process (one
model copy, shared by its worker threads), keeps connections alive and sets TCP_NODELAY by
default. Its request/response spill-to-disk thresholds (512 KiB / 1 MiB by default) are
raised to the body limit so activation bodies stay in memory, and its own error pages
(a body over the limit is refused by waitress before Flask sees it) are answered as the
same JSON ``{"error", "message"}`` as every other error (see docs/INTERNALS.md).
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from typing import Optional

from ..errors import ConfigError, SplitLearnError, from_status
from ..lora import LoraSpec
from .tenants import read_token_file
from .config import ServerConfig


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
    p.add_argument("--max-body-mb", type=float, default=256.0, help="larger request bodies get 413")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=16, help="WSGI threads; >= concurrent clients so decode steps batch")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="intra-op threads for the segment (default: torch's, one per core)")
    p.add_argument("--no-batching", action="store_true",
                   help="run concurrent sessions' decode steps one at a time (for comparison)")
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
    p.add_argument("--lora-r", type=int, default=None,
                   help="train per-client LoRA adapters of this rank on a frozen segment (docs/LORA.md)")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA scale alpha/r (default: 2r)")
    p.add_argument("--lora-targets", default="c_attn", help="comma-separated: c_attn, c_proj, c_fc")
    p.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the adapters' input")
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return ServerConfig(
        model=a.model, segment=a.segment, cuts=tuple(a.cuts), host=a.host, port=a.port,
        device=a.device, dtype=a.dtype, optimizer=a.optimizer, lr=a.lr, weight_decay=a.weight_decay,
        seed=a.seed, tokens=read_token_file(a.token_file) if a.token_file else (),
        checkpoint_dir=a.checkpoint_dir, checkpoint_every=a.checkpoint_every,
        max_body_bytes=int(a.max_body_mb * (1 << 20)), max_batch=a.max_batch, threads=a.threads,
        torch_threads=a.torch_threads, batching=not a.no_batching,
        batch_wait_ms=a.batch_wait_ms, poll_idle=a.poll_idle,
        packed_weights=not a.no_packed_weights, session_ttl_s=a.session_ttl,
        max_sessions=a.max_sessions, max_tokens_per_client=a.max_tokens_per_client,
        max_sessions_per_tenant=a.max_sessions_per_tenant, max_clients_per_tenant=a.max_clients_per_tenant,
        max_pending_per_tenant=a.max_pending_per_tenant, allow_weak_tokens=a.allow_weak_tokens,
        federation=a.federation, clients_per_round=a.clients_per_round, round_timeout_s=a.round_timeout,
        lease_timeout_s=a.lease_timeout, max_grad_norm=a.max_grad_norm, client_weights=a.client_weights, lora=_lora_spec(a))


def _lora_spec(a) -> Optional[LoraSpec]:
    """``--lora-*`` as a :class:`LoraSpec` (ConfigError if invalid); None without ``--lora-r``."""
    if a.lora_r is None:
        if a.lora_alpha is not None or a.lora_targets != "c_attn" or a.lora_dropout:
            raise ConfigError("--lora-alpha, --lora-targets and --lora-dropout need --lora-r")
        return None
    alpha = 2.0 * a.lora_r if a.lora_alpha is None else a.lora_alpha
    return LoraSpec(a.lora_r, alpha, a.lora_targets, a.lora_dropout)


def _json_channel():
    """A waitress channel whose own error answers (413, 400) are splitlearn's JSON errors."""
    from waitress.channel import HTTPChannel
    from waitress.task import ErrorTask

    class JsonErrorTask(ErrorTask):
        def execute(self):
            e = self.request.error
            err = from_status(e.code, f"{e.reason}: {e.body}")
            body = json.dumps(err.to_payload()).encode()
            self.status = f"{e.code} {e.reason}"
            self.response_headers.append(("Content-Type", "application/json"))
            self.set_close_on_finish()
            self.content_length = len(body)
            self.write(body)

    class JsonChannel(HTTPChannel):
        error_task_class = JsonErrorTask

    return JsonChannel


def serve(cfg: ServerConfig) -> None:
    """Build the app and serve it until SIGTERM/SIGINT, checkpointing on the way out."""
    import waitress

    from ..idlepoll import IdlePoller
    from .app import create_app

    app = create_app(cfg)
    rt = app.extensions["splitlearn"]
    body_limit = cfg.max_body_bytes
    server = waitress.create_server(
        app, host=cfg.host, port=cfg.port, threads=cfg.threads,
        inbuf_overflow=body_limit, outbuf_overflow=body_limit, max_request_body_size=body_limit,
        recv_bytes=256 << 10,  # default 8 KiB: a 1.5 MB body took 190 reads (echo 8.8 -> 6.3 ms)
        channel_timeout=300, connection_limit=256, ident="splitlearn")
    server.channel_class = _json_channel()

    poller = IdlePoller().start() if cfg.poll_idle else None

    def stop(signum, _frame):
        logging.getLogger(__name__).info("signal %d: checkpointing and stopping", signum)
        if poller is not None:
            poller.stop()
        rt.compute.run(rt.checkpoint)
        server.close()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    seg = rt.segment
    if cfg.generated_token:
        print(f"no token given: generated one for this run: export SPLITLEARN_TOKEN={cfg.tokens[0]}",
              file=sys.stderr)
    print(f"splitlearn server: {seg.kind} blocks [{seg.start}, {seg.end}) on {rt.device} "
          f"at http://{cfg.host}:{cfg.port} (ready)", file=sys.stderr, flush=True)
    server.run()


def main(argv=None) -> int:
    try:
        cfg = parse_args(argv)
        serve(cfg)
    except SplitLearnError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0

