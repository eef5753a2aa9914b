"""What every blueprint of the segment server shares: the app's :class:`Served` state, the
error answer, and :func:`tensor_route`, the one shape of every route that carries tensors::

    WSGI thread:     read the body (415 unless application/octet-stream)
    compute thread:  decode (safetensors, never pickle) -> validate (:mod:`.validate`)
                     -> the runtime's method -> an Answer, or a future of one (decode steps)
    WSGI thread:     wait for the future, encode the Answer, add X-Server-Time-Ms

This layer is the only one that hands work to the compute thread (``rt.compute.run``). Except:
a generation step's body of at most ``INLINE_BODY_BYTES`` is decoded and validated on the WSGI
thread and goes straight to the batcher's queue (saves ~0.3 ms a step, benchmarks/README.md).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from concurrent.futures import Future
from typing import Any, Callable, Optional

from flask import Blueprint, Response, current_app, g, jsonify, request

from ... import protocol as P
from ...errors import BadRequest, SplitLearnError, UnsupportedMediaType
from ...wire import decode
from ..engine.memory import MemoryAccount, scope as memory_scope
from ..engine.priority import timed
from ..engine.tenants import Tenant
from . import validate

# Generation-step bodies up to this size are decoded on the WSGI thread: under 16 Ki float32
# values, below torch's grain size (32768) for running an operator on several threads.
INLINE_BODY_BYTES = 64 << 10
SERVED = "splitlearn.served"  # the app.extensions key of its Served


@dataclasses.dataclass
class Served:
    """One app's runtime and what its routes read of it (``app.extensions[SERVED]``)."""

    rt: Any  # a SegmentRuntime, or an OffloadRuntime (--offload)
    memory: Optional[MemoryAccount]  # what the server holds per tenant; None: offload
    metrics: Any = None  # its ServerMetrics

    @property
    def cfg(self):
        return self.rt.cfg

    @property
    def dims(self) -> tuple[int, int, int]:
        """``(n_embd, n_positions, vocab_size)`` of the served model."""
        c = self.rt.config
        return c.n_embd, c.n_positions, c.vocab_size


def served() -> Served:
    """The current app's :class:`Served` (in a request)."""
    return current_app.extensions[SERVED]


def error_response(err: SplitLearnError) -> Response:
    resp = jsonify(err.to_payload())
    resp.status_code = err.status
    if err.retry_after is not None:
        resp.headers["Retry-After"] = str(int(round(err.retry_after)))
    return resp


def tensor_body() -> bytes:
    """The request's safetensors bytes; 415 for another content type."""
    if request.mimetype != P.CONTENT_TYPE:
        raise UnsupportedMediaType(f"send tensors as {P.CONTENT_TYPE} (safetensors), "
                                   f"not {request.mimetype or 'no content type'}")
    return request.get_data(cache=False)


def scoped(m, tenant: Tenant):
    """The request's metadata with its client id scoped to the caller's tenant: every server
    state is keyed by ``<tenant>:<client_id>`` (:mod:`splitlearn.server.engine.tenants`)."""
    return dataclasses.replace(m, client_id=tenant.key(m.client_id))


def client_key(client_id: str) -> str:
    """The caller's key of ``client_id`` (400 unless valid), claimed on this replica."""
    if not P.valid_client_id(client_id):
        raise BadRequest("client ids are 1-64 characters of [A-Za-z0-9_.-]")
    key = g.tenant.key(client_id)
    served().rt.claim(key)  # replicas: the newest state of a client that arrives from another one
    return key


def hidden_and_mask(s: Served, t: dict, name: str = P.HIDDEN):
    """A left-padded ``(B, T, d)`` input and its mask, validated against the served model."""
    d, npos, _ = s.dims
    h = validate.hidden(t, name, d, s.cfg.max_batch, npos)
    B, T, _ = h.shape
    return h, validate.attention_mask(t, P.MASK, B, T, npos)


def tensor_route(bp: Blueprint, rule: str, *, owner: bool = False, inline: bool = False,
                 cls: str = "other") -> Callable:
    """Register ``handler(served, tensors, meta, **url_args) -> Answer | Future[Answer]`` on
    ``bp`` as a POST route taking and answering safetensors (see the module docstring). ``owner=True`` also
    passes ``owner``, the caller's :class:`~splitlearn.server.engine.tenants.Tenant` (Flask's
    ``g`` and ``current_app`` do not reach the compute thread). ``inline=True``: bodies up to
    ``INLINE_BODY_BYTES`` are decoded and the handler called on the WSGI thread; the handler
    hands its model work to the compute thread itself. ``cls``: the priority class whose wait
    for the compute thread is counted."""

    def register(handler: Callable) -> Callable:
        @functools.wraps(handler)
        def view(**url_args) -> Response:
            s = served()
            with memory_scope(s.memory, g.tenant.name) as held:  # released once the answer is built
                return serve(s, held, **url_args)

        def serve(s: Served, held, **url_args) -> Response:
            started = time.perf_counter()
            held.hold(2 * (request.content_length or 0), "a request body")  # server's copy + ours
            body = tensor_body()
            if owner:
                url_args["owner"] = g.tenant

            def work():  # on the compute thread; the route's price is reserved for `held` (budget.py)
                with held.on_this_thread():
                    tensors, meta = decode(body)
                    return handler(s, tensors, meta, **url_args)

            if inline and len(body) <= INLINE_BODY_BYTES:
                answer = work()
            else:
                answer = s.rt.compute.run(timed(s.rt.waits, cls, work))
            if isinstance(answer, Future):  # a decode step waits for its batch
                answer = answer.result()
            resp = Response(answer.encode(), status=200, mimetype=P.CONTENT_TYPE)
            resp.headers[P.SERVER_TIME_HEADER] = f"{(time.perf_counter() - started) * 1e3:.3f}"
            return resp

        bp.add_url_rule(rule, endpoint=handler.__name__, view_func=view, methods=["POST"])
        return handler

    return register
