"""An in-process link: a client reaching a server app of this process without a socket.

    app = create_app(cfg)                        # the server's Flask app (splitlearn.server)
    url = serve_inproc(app)                      # "inproc://app-1"
    model = SplitGPT2LMHeadModel.from_pretrained("tiny", server=url, token=token)
    ...
    unserve(url)

Each request goes through the app's WSGI interface (Flask's test client) in the calling thread:
the same routes, headers, statuses, error JSON and bytes as over HTTP, without the front door
or a second process. A tensor call is answered when started (``Transport.start``), so requests
reach the app in the order sent. An unserved URL is a refused connection (retried with backoff,
then TransportError). For tests and experiments; a ``requests.Session`` takes such URLs with
:class:`InprocAdapter` mounted. Imports neither Flask nor the server.
"""
from __future__ import annotations

import io
import itertools
import threading
from http import HTTPStatus
from typing import Optional
from urllib.parse import urlsplit

import requests
from requests.adapters import BaseAdapter
from requests.structures import CaseInsensitiveDict
from requests.utils import get_encoding_from_headers

from ..errors import ConfigError
from .http import register_scheme

SCHEME = "inproc"

_apps: dict[str, object] = {}  # name -> WSGI app (a Flask app)
_running: dict[int, int] = {}  # id(app) -> its requests running now
_lock = threading.Condition()
_names = itertools.count(1)


def serve_inproc(app, name: Optional[str] = None) -> str:
    """Register ``app`` (a Flask app) under ``name`` (default: a fresh one); its URL."""
    with _lock:
        name = name or f"app-{next(_names)}"
        if name in _apps and _apps[name] is not app:
            raise ConfigError(f"{SCHEME}://{name} already serves another app")
        _apps[name] = app
    return f"{SCHEME}://{name}"


def unserve(url: str, timeout_s: float = 60.0) -> None:
    """Forget the app at ``url``: its clients' requests are then refused (as when nothing
    listens on a port) until an app is served at that URL again. Returns once the requests
    it was running have been answered (at most ``timeout_s``), as a server that stops does."""
    with _lock:
        app = _apps.pop(_name(url), None)
        if app is not None:
            _lock.wait_for(lambda: id(app) not in _running, timeout_s)


def _name(url: str) -> str:
    prefix = SCHEME + "://"
    if not url.startswith(prefix):
        raise ConfigError(f"not an {prefix} URL: {url!r}")
    return url[len(prefix):].split("/", 1)[0]


class InprocLink:
    """A client's way to the app served at a URL: :meth:`request` runs one request through
    whichever app serves that URL at the time (one served again at the same URL, as a server
    restarted on the same port, gets the requests from then on)."""

    def __init__(self, url: str):
        self.name = _name(url)

    def request(self, method: str, path: str, headers: dict, body: Optional[bytes]):
        """``(status, headers, content)`` of ``method path`` with ``headers`` and ``body``;
        ``headers`` of the answer is case-insensitive (``.get``)."""
        with _lock:
            app = _apps.get(self.name)
            if app is None:
                raise ConnectionRefusedError(f"no app is served at {SCHEME}://{self.name} in this process "
                                             f"(serve_inproc)")
            _running[id(app)] = _running.get(id(app), 0) + 1
        try:
            client = app.test_client(use_cookies=False)  # one per request: threads share none of it
            resp = client.open(path, method=method, headers=headers, data=body or b"")
            try:
                return resp.status_code, resp.headers, resp.get_data()
            finally:
                resp.close()
        finally:
            with _lock:
                _running[id(app)] -= 1
                if not _running[id(app)]:
                    del _running[id(app)]
                    _lock.notify_all()


register_scheme(SCHEME, InprocLink)


class InprocAdapter(BaseAdapter):
    """``requests``' transport adapter for ``inproc://`` URLs::

        s = requests.Session(); s.mount("inproc://", InprocAdapter())
        s.get(url + "/v1/info", headers={"Authorization": f"Bearer {token}"}).json()

    An unserved URL raises ``requests.ConnectionError``, as a port nobody listens on does.
    """

    def send(self, request, stream=False, timeout=None, verify=True, cert=None, proxies=None):
        parts = urlsplit(request.url)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        body = request.body.encode("utf-8") if isinstance(request.body, str) else request.body
        try:
            status, headers, content = InprocLink(request.url).request(
                request.method, path, dict(request.headers), body)
        except ConnectionError as e:
            raise requests.ConnectionError(str(e), request=request) from None
        resp = requests.Response()
        resp.status_code, resp.reason = status, _reason(status)
        resp.headers = CaseInsensitiveDict(headers)
        resp.encoding = get_encoding_from_headers(resp.headers)
        resp.raw, resp.url, resp.request, resp.connection = io.BytesIO(content), request.url, request, self
        return resp

    def close(self) -> None:
        pass


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""
