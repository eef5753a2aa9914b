"""LoRA: ``/v1/clients/<id>/adapter``, a client's server-side adapter
(:mod:`splitlearn.server.engine.adapters`)."""
from __future__ import annotations

from flask import Blueprint, Response

from ...api import protocol as P
from ...errors import NotFound
from .routing import client_key, served

bp = Blueprint("lora", __name__)


@bp.get(P.CLIENT_ADAPTER.replace("{client_id}", "<client_id>"))
def client_adapter(client_id: str):
    rt = served().rt
    if rt.adapters is None:
        raise NotFound("this server has no LoRA adapters (started without --lora-r)")
    key = client_key(client_id)
    body = rt.compute.run(rt.adapters.adapter_bytes, key, rt.cfg.federation, rt.ledger.known(key))
    return Response(body, status=200, mimetype=P.CONTENT_TYPE)
