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
import re
import time
from concurrent.futures import Future
from typing import Any, Callable, Optional

from flask import Blueprint, Response, current_app, g, jsonify, request

from ...api import protocol as P
from ...errors import BadRequest, PayloadTooLarge, SplitLearnError, UnsupportedMediaType
from ...api.wire import decode
from ..engine.ledger import Answer
from ..engine.memory import MemoryAccount, scope as memory_scope
from ..engine.priority import timed
from ..tenants import Tenant
from . import validate

# Generation-step bodies up to this size are decoded on the WSGI thread: under 16 Ki float32
# values, below torch's grain size (32768) for running an operator on several threads.
INLINE_BODY_BYTES = 64 << 10
SERVED = "splitlearn.served"  # the app.extensions key of its Served
BODY_KEY = "splitlearn.body"  # WSGI environ: the request's whole body (the unix door's; no client can set it)
BODY_HOLD_KEY = "splitlearn.body_hold"  # WSGI environ: the door's reservation of the body (a memory Hold)


@dataclasses.dataclass
class Served:
    """One app's runtime and what its routes read of it (``app.extensions[SERVED]``)."""

    rt: Any  # a SegmentRuntime, or an OffloadRuntime (--offload)
    memory: Optional[MemoryAccount]  # what the server holds per tenant (an offload server: its bodies and products)
    metrics: Any = None  # its ServerMetrics

    @property
    def cfg(self):
        return self.rt.cfg

    @property
    def dims(self) -> tuple[int, int, int]:
        """``(hidden size, positions, vocab_size)`` of the served model (any family's config)."""
        c = self.rt.config
        return c.hidden_size, c.max_position_embeddings, c.vocab_size


def served() -> Served:
    """The current app's :class:`Served` (in a request)."""
    return current_app.extensions[SERVED]


def error_response(err: SplitLearnError) -> Response:
    resp = jsonify(err.to_payload())
    resp.status_code = err.status
    if err.retry_after is not None:
        resp.headers["Retry-After"] = str(int(round(err.retry_after)))
    return resp


def internal_error(incident: str) -> SplitLearnError:
    """A 500's answer: it names the incident; the operator's log has the details."""
    return SplitLearnError(f"internal server error (incident {incident}: the operator's log has the details)")


def request_body() -> bytes:
    """The request's whole body, read at once. The unix door hands it over whole (``app.py``);
    behind the TCP front door waitress holds a Content-Length body whole in its buffer before the
    app runs, and one read of its size takes it in one copy, where werkzeug's ``get_data`` reads
    64 KiB at a time and joins them (12.6 MB in 28 ms on the 2-core CPU host, ~0.45 GB/s: a third
    of a 12.6 MB crossing over TCP loopback; docs/PERFORMANCE.md). A chunked body (no
    Content-Length) goes through werkzeug."""
    n = request.content_length
    if request.environ.get(BODY_KEY) is not None or n is None:
        return request.get_data(cache=False)
    limit = request.max_content_length  # what get_data would have refused, unread
    if limit is not None and n > limit:
        raise PayloadTooLarge(f"request body of {n} bytes is too large: this server takes at most {limit}")
    body = request.environ["wsgi.input"].read(n)
    if len(body) != n:  # (waitress does not dispatch a request before its body is whole)
        raise BadRequest(f"the body ended after {len(body)} of the {n} bytes its Content-Length announced")
    return body


PASSTHROUGH_BYTES = 1 << 20  # answers larger than this go out through wsgi.file_wrapper (_Views)


class _Views:
    """A read-only file over an answer's bytes whose reads are views of them, not copies.

    Behind waitress, an answer given as ``bytes`` is copied into the connection's out-buffer
    and read back out of it in socket-sized chunks (two copies: ~20 ms for a 12.6 MB answer
    on the CPU host); through ``wsgi.file_wrapper`` waitress sends the file's reads as they are.
    ``on_close``: the response's close (its access line), called once the file is sent."""

    def __init__(self, data: bytes):
        self.view, self.pos, self.on_close = memoryview(data), 0, None

    def read(self, n: int = -1) -> memoryview:
        end = len(self.view) if n is None or n < 0 else min(len(self.view), self.pos + n)
        out, self.pos = self.view[self.pos:end], end
        return out

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = (0, self.pos, len(self.view))[whence] + offset
        return self.pos

    def close(self) -> None:
        on_close, self.on_close = self.on_close, None
        if on_close is not None:
            on_close()


def bytes_response(content: bytes) -> Response:
    """A 200 safetensors answer (bytes, or a ``memoryview`` of pinned host memory: a CUDA
    answer's, :meth:`~splitlearn.server.engine.ledger.Answer.host_body`); a large one handed to
    the WSGI server as a file of views of its bytes (:class:`_Views`), which waitress sends
    without copying."""
    wrapper = request.environ.get("wsgi.file_wrapper")
    if wrapper is None or len(content) <= PASSTHROUGH_BYTES:
        return Response(bytes(content), status=200, mimetype=P.CONTENT_TYPE)  # (a memoryview: a CUDA answer's)
    file = _Views(content)
    resp = Response(wrapper(file, 1 << 20), status=200, mimetype=P.CONTENT_TYPE, direct_passthrough=True)
    resp.headers["Content-Length"] = str(len(content))
    file.on_close = resp.close  # the hooks on the response's close run once it is sent
    return resp


def tensor_body() -> bytes:
    """The request's safetensors bytes; 415 for another content type."""
    if request.mimetype != P.CONTENT_TYPE:
        raise UnsupportedMediaType(f"send tensors as {P.CONTENT_TYPE} (safetensors), "
                                   f"not {request.mimetype or 'no content type'}")
    return request_body()


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
    checks = validate.Checks()  # the values' checks and the mask: one read (validate.py)
    h = validate.hidden(t, name, d, s.cfg.max_batch, npos, checks=checks)
    B, T, _ = h.shape
    return h, checks.verify(validate.attention_mask(t, P.MASK, B, T, npos, checks=checks))


@dataclasses.dataclass(frozen=True)
class TensorRoute:
    """One route taking and answering safetensors (:func:`tensor_route`), as the unix door's
    direct dispatch (:mod:`.direct`) finds it without Flask."""

    rule: str  # Flask's form, the ``route`` label of metrics and access lines
    handler: Callable
    owner: bool
    inline: bool
    cls: str
    pattern: re.Pattern  # the rule with its ``<args>`` as named groups (Flask's default converter: [^/]+)


#: a blueprint's name -> its tensor routes
TENSOR_ROUTES: dict[str, list[TensorRoute]] = {}


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
        pattern = re.compile(re.sub(r"<(\w+)>", r"(?P<\1>[^/]+)", re.escape(rule)))
        route = TensorRoute(rule, handler, owner, inline, cls, pattern)
        TENSOR_ROUTES.setdefault(bp.name, []).append(route)

        @functools.wraps(handler)
        def view(**url_args) -> Response:
            s = served()
            with memory_scope(s.memory, g.tenant.name) as held:  # released once the answer is built
                content, server_ms = serve(s, held, route, g.tenant, request.content_length or 0,
                                           request.mimetype, request_body, url_args,
                                           body_hold=request.environ.get(BODY_HOLD_KEY))
                resp = bytes_response(content)
                resp.headers[P.SERVER_TIME_HEADER] = server_ms
                return resp

        bp.add_url_rule(rule, endpoint=handler.__name__, view_func=view, methods=["POST"])
        return handler

    return register


def echoed(answer, meta: dict, rule: str):
    """A training piece's answer names the request it answers (metadata ``echo``: ``step/micro
    path``), so a client that reads an answer off the wrong connection or out of order (a relay,
    a stale keep-alive answer) knows it is not its own (:mod:`splitlearn.hf.pieces`)."""
    if isinstance(answer, Answer) and answer._bytes is None and "step" in meta and "micro" in meta:
        answer.meta["echo"] = echo_of(meta, rule)
    return answer


def echo_of(meta: dict, path: str) -> str:
    """The ``echo`` of a training request's metadata sent to ``path`` (the client's twin:
    :func:`splitlearn.hf.pieces.echo_of`)."""
    return f"{meta.get('step')}/{meta.get('micro')} {path}"


def serve(s: Served, held, route: TensorRoute, tenant: Tenant, content_length: int, mimetype: str,
          read_body: Callable[[], bytes], url_args: dict, lazy_above: Optional[int] = None,
          keep_device: bool = False, body_hold=None) -> tuple[bytes, str]:
    """Run ``route`` for ``tenant`` (Flask's view, or the unix door's direct dispatch): the
    answer's bytes and its ``X-Server-Time-Ms``. SplitLearnError for a bad request.
    ``lazy_above``: an answer larger than this comes as a :class:`~splitlearn.api.wire.Encoded`,
    written by the caller where it goes (shared memory; ``keep_device``: a device region).
    ``body_hold``: the door's reservation of the body (:mod:`.frontdoor`, :mod:`.unixdoor`),
    taken over by ``held``."""
    started = time.perf_counter()
    held.hold(2 * content_length, "a request body", adopt=body_hold)  # server's copy (the door's) + ours
    if mimetype != P.CONTENT_TYPE:
        raise UnsupportedMediaType(f"send tensors as {P.CONTENT_TYPE} (safetensors), "
                                   f"not {mimetype or 'no content type'}")
    body = read_body()
    if route.owner:
        url_args = {**url_args, "owner": tenant}

    def work():  # on the compute thread; the route's price is reserved for `held` (budget.py)
        with held.on_this_thread():
            tensors, meta = decode(body)
            return echoed(route.handler(s, tensors, meta, **url_args), meta, route.rule)

    if route.inline and len(body) <= INLINE_BODY_BYTES:
        answer = work()
    else:
        answer = s.rt.compute.run(timed(s.rt.waits, route.cls, work))
    if isinstance(answer, Future):  # a decode step waits for its batch
        answer = answer.result()
    content = answer.encoded(keep_device) if lazy_above is not None else answer.host_body()
    if not isinstance(content, bytes) and len(content) <= lazy_above:
        content = bytes(content)
    return content, f"{(time.perf_counter() - started) * 1e3:.3f}"
