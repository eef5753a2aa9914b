"""Helpers for the server tests: requests through Flask's test client, and a real server process.

Imported explicitly by the test modules (``from serverproc import ...``); no fixture lives here,
so nothing depends on another module's conftest.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import time
from pathlib import Path
from typing import Optional

import requests
import torch

from splitlearn.api import protocol as P
from splitlearn.model.checkpoint import read_weights
from splitlearn.procs.localserver import LocalServer
from splitlearn.api.wire import decode, encode

# two tenants; strong enough for the server (16+ characters, not a documentation example)
TOKEN, OTHER = "tok-5c1f0e8b2a9d4e77", "other-93be41d06fa2c815"
# token-file lines of a two-tenant server: TOKEN is tenant "alice" and the operator, OTHER "mallory"
TENANTS = (f"alice {TOKEN} operator", f"mallory {OTHER}")


def tenants_flag(directory) -> list:
    """``--token-file`` of :data:`TENANTS` written in ``directory``: a server of several tenants,
    whose decode products are batch-invariant (splitlearn/model/packed.py; with one tenant each
    product runs where it measured fastest, and answers may depend on what is batched beside them)."""
    import os

    path = os.path.join(str(directory), "tokens")
    with open(path, "w") as f:
        f.write("\n".join(TENANTS) + "\n")
    return ["--token-file", path]


def auth(token: Optional[str] = TOKEN) -> dict:
    return {"Authorization": f"Bearer {token}"} if token else {}


def post_tensors(client, path: str, tensors: dict, meta: Optional[dict] = None, *,
                 token: Optional[str] = TOKEN, content_type: Optional[str] = P.CONTENT_TYPE,
                 data: Optional[bytes] = None):
    """POST a safetensors body (or raw ``data``) with Flask's test client."""
    body = encode(tensors, meta) if data is None else data
    headers = auth(token)
    if content_type is not None:
        headers["Content-Type"] = content_type
    return client.post(path, data=body, headers=headers)


def apply_step(client, client_id: str, step: int, pieces: int = 1, lr: float = P.MAX_LR, *,
               token: Optional[str] = TOKEN, url: str = ""):
    """``POST /v1/train/apply`` of an open-ended step (Flask's test client, or a requests
    session with ``url``). ``lr`` defaults to the cap: the server's own ``--lr`` on the shared
    segment, what a closed step applied; a client's own state (SplitFed copy, LoRA adapter in
    shared mode) steps at ``lr`` as sent."""
    body = json.dumps({"client_id": client_id, "step": step, "pieces": pieces, "lr": lr})
    return client.post(url + P.TRAIN_APPLY, data=body, headers={**auth(token), "Content-Type": "application/json"})


def tensors_of(resp) -> dict:
    assert resp.status_code == 200, resp.get_data(as_text=True)
    assert resp.mimetype == P.CONTENT_TYPE
    return decode(resp.get_data())[0]


def assert_error(resp, status: int, words: str = "") -> dict:
    """The answer is ``status`` with a JSON ``{"error", "message"}`` whose message has ``words``."""
    assert resp.status_code == status, (resp.status_code, resp.get_data(as_text=True))
    payload = json.loads(resp.get_data())
    assert set(payload) == {"error", "message"}
    assert words.lower() in payload["message"].lower(), payload
    return payload


def rss_mib(pid: int) -> float:
    """A process's resident memory now, MiB (/proc/PID/status VmRSS)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def segment_of(app):
    return app.extensions["splitlearn"].segment


def snapshot(module: torch.nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- a real server process ---------------------------------------------------------------

class ServerProcess(LocalServer):
    """``python -m splitlearn.server --model tiny`` on a free loopback port, token ``tok``.

    ``restart()`` stops it with SIGTERM (it checkpoints) and starts it again on the same port.
    """

    def __init__(self, cuts, *, optimizer: str = "adamw", lr: float = 1e-2,
                 checkpoint_dir: Optional[Path] = None, extra=(), model: str = "tiny"):
        args = ["--model", model, "--optimizer", optimizer, "--lr", str(lr), "--threads", "2"]
        for c in cuts:
            args += ["--cut", str(c)]
        if checkpoint_dir is not None:
            args += ["--checkpoint-dir", str(checkpoint_dir)]
        super().__init__(args + list(extra), token=TOKEN, env={"OMP_NUM_THREADS": "1"})
        self.checkpoint_dir = checkpoint_dir

    def restart(self) -> "ServerProcess":
        code = self.stop()
        assert code == 0, f"server exited with {code} on SIGTERM"
        return self.start()

    def weights(self) -> dict[str, torch.Tensor]:
        """The server's segment weights now (Hugging Face names), via POST /v1/checkpoint."""
        r = requests.post(self.url + P.CHECKPOINT, json={}, headers=auth(), timeout=30)
        r.raise_for_status()
        return read_weights(self.checkpoint_dir, "server")


# -- the same server in this process -------------------------------------------------------

class _Web:
    """``requests``' functions (``get``, ``post``, ``delete``, ``request``) and ``Session()``,
    reaching ``inproc://`` URLs too (the tests' raw calls to an :class:`InprocServer`)."""

    ConnectionError = requests.ConnectionError

    @staticmethod
    def Session() -> requests.Session:  # noqa: N802 - requests' name
        from splitlearn.transport.inproc import InprocAdapter

        s = requests.Session()
        s.mount("inproc://", InprocAdapter())
        return s

    def request(self, method: str, url: str, **kw) -> requests.Response:
        with self.Session() as s:
            return s.request(method, url, **kw)

    def get(self, url: str, **kw) -> requests.Response:
        return self.request("GET", url, **kw)

    def post(self, url: str, **kw) -> requests.Response:
        return self.request("POST", url, **kw)

    def delete(self, url: str, **kw) -> requests.Response:
        return self.request("DELETE", url, **kw)


web = _Web()


class InprocServer:
    """The app that ``python -m splitlearn.server ARGS`` serves, built in this process and
    reached at an ``inproc://`` URL (splitlearn/transport/inproc.py) instead of a port: for
    tests of what the server answers, not of the process or the HTTP server in front of it.
    The parts of :class:`~splitlearn.procs.localserver.LocalServer` the tests use (``url``,
    ``token``, ``start``/``stop``, a context manager); ``app`` is the Flask app.
    """

    def __init__(self, args, *, token: str = TOKEN):
        self.args, self.token = list(args), token
        self.app = None
        self.url: Optional[str] = None

    def build(self):
        """The app, built from ``args`` as the command builds it."""
        import dataclasses

        from splitlearn.server.http.app import create_app
        from splitlearn.server.http.cli import parse_args

        cfg = parse_args([*self.args, "--log-level", "WARNING"])
        if "--token-file" not in self.args:  # LocalServer's $SPLITLEARN_TOKEN
            cfg = dataclasses.replace(cfg, tokens=(self.token,), generated_token=False)
        return create_app(cfg)

    def start(self) -> "InprocServer":
        from splitlearn.transport.inproc import serve_inproc

        self.app = self.build()
        name = None if self.url is None else self.url.split("://", 1)[1]  # restarted: the same URL
        self.url = serve_inproc(self.app, name)
        return self

    def stop(self) -> int:
        """What SIGTERM does: the URL takes no more requests, the ones running are answered,
        the server checkpoints; 0 as the process's exit code."""
        from splitlearn.transport.inproc import unserve

        if self.app is not None:
            rt, self.app = self.app.extensions.get("splitlearn"), None
            unserve(self.url, timeout_s=30)
            if rt is not None:  # a segment server's runtime
                if hasattr(rt, "checkpoint"):
                    rt.compute.run(rt.checkpoint)
                rt.compute.close()
        return 0

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class InprocFedServer(InprocServer):
    """The app of ``python -m splitlearn.server.http.fedapp ARGS`` in this process."""

    def build(self):
        from splitlearn.server.http.fedapp import app_of, parse_args

        return app_of(*parse_args(self.args))


class InprocServerProcess(InprocServer):
    """:class:`ServerProcess`'s server (the same flags) in this process."""

    def __init__(self, cuts, *, optimizer: str = "adamw", lr: float = 1e-2,
                 checkpoint_dir: Optional[Path] = None, extra=(), model: str = "tiny"):
        args = ["--model", model, "--optimizer", optimizer, "--lr", str(lr), "--threads", "2"]
        for c in cuts:
            args += ["--cut", str(c)]
        if checkpoint_dir is not None:
            args += ["--checkpoint-dir", str(checkpoint_dir)]
        super().__init__(args + list(extra))
        self.checkpoint_dir = checkpoint_dir

    def restart(self) -> "InprocServerProcess":
        """:meth:`ServerProcess.restart`: checkpoint, then a new app from it at the same URL."""
        assert self.stop() == 0
        return self.start()

    def weights(self) -> dict[str, torch.Tensor]:
        """The server's segment weights now (Hugging Face names), via POST /v1/checkpoint."""
        r = self.app.test_client().post(P.CHECKPOINT, json={}, headers=auth(self.token))
        assert r.status_code == 200, r.get_data(as_text=True)
        return read_weights(self.checkpoint_dir, "server")


def run_threads(fns, timeout_s: float = 300.0) -> None:
    """Run each callable in its own thread at once; fail with every exception they raised."""
    import threading

    errors = []

    def wrap(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - every failure is reported
            errors.append(repr(e))

    threads = [threading.Thread(target=wrap, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not errors, errors


# -- helpers shared by test files ----------------------------------------------------------

@contextlib.contextmanager
def access_lines():
    """The access lines logged meanwhile, as the JSON objects of ``--log-format json``: yields a
    function that returns the lines so far."""
    from splitlearn.server.http import accesslog

    # earlier requests' lines are not these: a server thread queues its line just after sending
    # the answer, so the last answer a test read may queue its line a moment later
    accesslog.drain()
    time.sleep(2 * accesslog.DRAIN_S)
    accesslog.drain()
    buf, handler = io.StringIO(), logging.StreamHandler()
    handler.stream = buf
    handler.setFormatter(accesslog.JsonFormatter())
    logger = logging.getLogger("splitlearn.server.http.accesslog")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        def lines():
            accesslog.drain()  # what was queued is logged now (the drainer would within DRAIN_S)
            return [json.loads(line) for line in buf.getvalue().splitlines()]

        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def logged_json(srv, ready=lambda lines: True, timeout_s: float = 5.0) -> list[dict]:
    """The JSON lines a server process (``capture_stderr``) has logged, once ``ready(lines)`` holds
    or ``timeout_s`` passed: a request's access line comes up to ``accesslog.DRAIN_S`` after its
    answer, so the last answer's may not be written yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [json.loads(x) for x in srv.stderr_tail(200000).splitlines() if x.startswith("{")]
        if ready(lines) or time.monotonic() > deadline:
            return lines
        time.sleep(0.02)


def sgd_steps(url: str, ids: torch.Tensor, client_id: str, steps: int = 2):
    """``steps`` SGD steps (lr 0.1) of a tiny split model against ``url``: (losses, the model)."""
    from splitlearn.hf import SplitGPT2LMHeadModel

    model = SplitGPT2LMHeadModel.from_pretrained("tiny", server=url, token=TOKEN, client_id=client_id)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model
