"""WSGI entry for running the app under another server (waitress-serve, gunicorn).

The server's flags come from ``$SPLITLEARN_ARGS`` (those of ``python -m splitlearn.server``),
the token from ``$SPLITLEARN_TOKEN``::

    SPLITLEARN_ARGS="--model gpt2 --cut 2 --cut 10 --checkpoint-dir /var/lib/splitlearn" \\
        waitress-serve --listen 127.0.0.1:8000 --call splitlearn.server.wsgi:create_app_from_env

Run exactly one worker process. There is no front door, no checkpoint on SIGTERM, and the
connection limits and deadlines of ``/v1/info`` describe nothing: server/README.md,
"Under another WSGI server" and "Behind TLS".
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
        app.extensions["splitlearn.metrics"].serve_loopback(cfg.metrics_port, cfg.tenants)
    return app
