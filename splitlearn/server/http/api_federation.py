"""Federation: ``/v1/federation`` (status), ``/turn`` (sequential), ``/sync`` (SplitFed
client-side weights) and ``/weights`` (:mod:`splitlearn.server.federation.modes`)."""
from __future__ import annotations

import logging
import time

from flask import Blueprint, Response, g, jsonify, request

from ...api import protocol as P
from ...errors import BadRequest
from ...api.wire import decode
from .routing import served, tensor_body
from .validate import json_object

log = logging.getLogger(__name__)

bp = Blueprint("federation", __name__)


@bp.get(P.FEDERATION)
def federation():
    """The federation as the caller's tenant may see it: its own client ids, others counted."""
    rt = served().rt
    return jsonify(rt.compute.run(rt.federation.status, g.tenant.name))


@bp.post(P.FEDERATION_TURN)
def take_turn():
    rt = served().rt
    shape = '{"client_id": "<1-64 of [A-Za-z0-9_.-]>"}'
    payload = json_object(request.get_data(cache=False), shape)
    client_id = payload.get("client_id")
    if set(payload) != {"client_id"} or not isinstance(client_id, str) or not P.valid_client_id(client_id):
        raise BadRequest('the body must be JSON {"client_id": "<1-64 of [A-Za-z0-9_.-]>"}')
    return jsonify(rt.compute.run(rt.federation.take_turn, g.tenant.key(client_id)))


@bp.post(P.FEDERATION_SYNC)
def sync():
    rt = served().rt
    started, body, tenant = time.perf_counter(), tensor_body(), g.tenant

    def work() -> dict:
        tensors, meta = decode(body)
        cid = meta.get("client_id", "")
        try:
            key = tenant.key(P.SyncMeta.from_meta(meta).client_id)
        except BadRequest as e:  # bad counts: a member's failure of its round (Federation.refuse)
            if P.valid_client_id(cid):
                rt.federation.refuse(tenant.key(cid), e)
            raise
        return rt.sync(key, tensors)

    status = rt.compute.run(work)
    log.info("sync: version %s, round %s (%.0f ms)", status["version"], status["round"],
             (time.perf_counter() - started) * 1e3)
    return jsonify(status)


@bp.get(P.FEDERATION_WEIGHTS)
def shared_weights():
    rt = served().rt
    answer = rt.compute.run(rt.shared_weights)
    return Response(answer.encode(), status=200, mimetype=P.CONTENT_TYPE)
