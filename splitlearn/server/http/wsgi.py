"""WSGI entry for running the app under another server (waitress-serve, gunicorn).

The server's flags come from ``$SPLITLEARN_ARGS`` (the same flags as
``python -m splitlearn.server``), the token from ``$SPLITLEARN_TOKEN``::

    SPLITLEARN_ARGS="--model gpt2 --cut 2 --cut 10 --checkpoint-dir /var/lib/splitlearn" \\
        waitress-serve --listen 127.0.0.1:8000 --call splitlearn.server.wsgi:create_app_from_env

Run exactly one worker process: the segment, its optimizer and the per-client step
counters live in that process (threads are fine; gunicorn: ``-w 1 -k gthread --threads 4``).
Checkpoint-on-SIGTERM is done by ``python -m splitlearn.server``; under another server,
rely on ``--checkpoint-every`` and ``POST /v1/checkpoint``.

What another server does not have: the front door of ``python -m splitlearn.server``
(:mod:`.frontdoor`). The app still refuses a request without a valid token before its view
reads the body (Flask's ``before_request``, which reads no ``wsgi.input``), so under a server
that streams bodies (gunicorn) a tokenless body is never read into memory; but
``waitress-serve`` as configured by default reads the whole body first (into memory up to
512 KiB, then into a temporary file) before the app is called, and neither enforces the
request and answer deadlines or ``--max-connections``, ``--request-timeout``,
``--min-rate-kib`` and ``--idle-timeout`` (their values in ``/v1/info`` then describe nothing).
Put a proxy that enforces them in front (server/README.md, "Behind TLS").
"""
from __future__ import annotations

import os
import shlex

from flask import Flask

from ...errors import ConfigError

from .cli import parse_args
from .app import create_app


def create_app_from_env() -> Flask:
    args = os.environ.get("SPLITLEARN_ARGS")
    if not args:
        raise ConfigError('set SPLITLEARN_ARGS to the server flags, e.g. "--model gpt2 --cut 2 --cut 10"')
    cfg = parse_args(shlex.split(args))
    app = create_app(cfg)
    if cfg.metrics_port:  # --metrics-port: on a thread of this process, as under python -m splitlearn.server
        app.extensions["splitlearn.metrics"].serve_loopback(cfg.metrics_port)
    return app
